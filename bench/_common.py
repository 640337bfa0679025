"""Shared helpers for the benchmarks: machine description, a table printer and the JSON writer."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

RESULTS = Path(__file__).resolve().parent / "results"
#: a folder to write the JSON into instead of bench/results/ (the smoke tests set it, so a quick
#: run in the suite never overwrites the committed results)
RESULTS_ENV = "RLHF_BENCH_RESULTS"


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kb"] = int(f.readline().split()[1])
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def print_table(rows: Sequence[dict[str, Any]], title: str = "") -> None:
    if not rows:
        return
    cols = list(rows[0])
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    if title:
        print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def results_dir() -> Path:
    """Where the JSON goes: ``$RLHF_BENCH_RESULTS`` when set, else bench/results/."""
    override = os.environ.get(RESULTS_ENV)
    return Path(override).expanduser() if override else RESULTS


def write_results(name: str, payload: dict[str, Any]) -> Path:
    folder = results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}.json"
    doc = {"bench": name, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(), **payload}
    out.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    print(f"\nwrote {out}")
    return out
