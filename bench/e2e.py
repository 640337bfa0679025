"""End to end: the same task, model, workers and sample budget run synchronously
(``algo.max_staleness=0``: generation and training alternate) and asynchronously
(``algo.max_staleness=2``) in one invocation. Reports trained samples/s of each, the ratio
and the reward reached. Target on the CPU machine: async >= 1.5x sync at equal or better reward.

    python bench/e2e.py            # quick (< 60 s)
    python bench/e2e.py --full     # longer runs, a clearer reward signal
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_results  # noqa: E402


def compose(overrides: list[str]):
    from hydra import compose as hcompose, initialize_config_module

    from rlhf_core.config import register_configs, to_object

    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return to_object(hcompose(config_name="config", overrides=overrides))


def run_one(name: str, overrides: list[str], workdir: Path) -> dict:
    from learner.launch import run_launcher
    from learner.report import SUMMARY_FILE

    cfg = compose(overrides)
    out = workdir / name
    t0 = time.monotonic()
    code = run_launcher(cfg, out)
    wall = time.monotonic() - t0
    summary = json.loads((out / SUMMARY_FILE).read_text())
    return {
        "mode": name,
        "exit_code": code,
        "max_staleness": cfg.algo.max_staleness,
        "updates": summary["steps"],
        "samples_trained": summary["samples_trained"],
        "wall_s": wall,
        "trained_samples_per_s": summary["samples_trained"] / wall if wall else 0.0,
        "reward_start": summary["reward_start"],
        "reward_end": summary["reward_end"],
        "staleness_mean": summary["staleness_mean"],
        "staleness_max": summary["staleness_max"],
        "generated_tokens_per_s": summary["throughput"]["generated_tokens_per_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the default")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    updates = 120 if args.full else 20
    common = [
        f"learner.max_updates={updates}",
        f"rollout.num_workers={args.workers}",
        "run.progress=false",
        "learner.checkpoint_every=1000",
    ]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        rows = [
            run_one("sync", common + ["algo.max_staleness=0"], Path(tmp)),
            run_one("async", common + ["algo.max_staleness=2"], Path(tmp)),
        ]
    ratio = rows[1]["trained_samples_per_s"] / max(rows[0]["trained_samples_per_s"], 1e-9)
    print_table(rows, "end to end: sync vs async (same task, model, workers, sample budget)")
    print(f"\nasync / sync trained samples/s: {ratio:.2f}x (target >= 1.5x)")
    write_results("e2e", {
        "mode": "full" if args.full else "quick",
        "config": {"updates": updates, "workers": args.workers, "overrides": common},
        "runs": rows,
        "async_over_sync": ratio,
        "target": {"async_over_sync": 1.5, "met": ratio >= 1.5 and (rows[1]["reward_end"] or 0) >= (rows[0]["reward_end"] or 0)},
    })


if __name__ == "__main__":
    main()
