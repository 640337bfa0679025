"""Shared helpers for the benchmarks: machine description, a table printer, the JSON writer and a profiler summary."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
#: a folder to write the JSON into instead of bench/results/ (the smoke tests set it, so a quick
#: run in the suite never overwrites the committed results)
RESULTS_ENV = "RLHF_BENCH_RESULTS"


def mode_parser(doc: str | None, modes: Sequence[str] = ("quick", "full")) -> argparse.ArgumentParser:
    """A bench's argument parser: its docstring's first paragraph as the description and one
    flag per mode (``--quick``, ``--full``, ...), exclusive, in ``args.mode`` (the first mode
    when none is given)."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    group = ap.add_mutually_exclusive_group()
    for name in modes:
        group.add_argument(f"--{name}", action="store_const", const=name, dest="mode")
    ap.set_defaults(mode=next(iter(modes)))
    return ap


def require_device(device: str, on_cpu: str = "--gpu-check") -> None:
    """Exit with a message when a CUDA mode runs where there is no CUDA device; ``on_cpu`` names
    the mode that runs the same code path on a CPU (empty: none)."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("--gpu needs a CUDA device" + (f"; {on_cpu} runs the same code path on a CPU" if on_cpu else ""))


def sync_device(device: str) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so a host clock times it."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


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
    if isinstance(v, dict):
        return " ".join(f"{k}={_fmt(x)}" for k, x in v.items())
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


class CpuPerUpdate:
    """CPU seconds each process of a run spends per learner update, over the training window.

    A thread samples, every ``interval_s``, the cumulative CPU time (user + system) of this
    process (the in-process launcher with its weight-server thread) and of every child (learner,
    workers, redis-server; a worker's engine core too), and the number of updates written to
    ``metrics.jsonl``. The window runs from the first sample that saw ``warmup`` updates to the
    first that saw the last one, so start-up (imports, model builds) and shutdown (the final
    checkpoint, plots) are left out. CPU per update is what two cores share, so unlike wall
    time it barely moves with the machine's other load.
    """

    def __init__(self, metrics_file: Path, warmup: int = 20, interval_s: float = 0.25) -> None:
        import threading

        self.metrics_file, self.warmup, self.interval_s = metrics_file, warmup, interval_s
        self._stop = threading.Event()
        self._first: tuple[int, dict[str, float]] | None = None
        self._last: tuple[int, dict[str, float]] | None = None
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuPerUpdate:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @staticmethod
    def _role(proc: Any) -> str:
        cmd = " ".join(proc.cmdline())
        for marker, role in (("-m learner", "learner"), ("rollout_workers", "workers"), ("redis-server", "redis")):
            if marker in cmd:
                return role
        return "other"

    def _sample(self) -> tuple[int, dict[str, float]] | None:
        import psutil

        me = psutil.Process()
        cpu: dict[str, float] = {}
        alive = False
        for proc in [me, *me.children(recursive=True)]:
            try:
                t = proc.cpu_times()
                role = "launcher" if proc.pid == me.pid else self._role(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            alive |= role == "learner"
            cpu[role] = cpu.get(role, 0.0) + t.user + t.system
        try:
            updates = self.metrics_file.read_bytes().count(b"\n")
        except FileNotFoundError:
            updates = 0
        return (updates, cpu) if alive else None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            sample = self._sample()
            if sample is None or sample[0] < self.warmup:
                continue
            self._first = self._first or sample
            if self._last is None or sample[0] > self._last[0]:  # not the final checkpoint and shutdown
                self._last = sample

    def result(self) -> dict[str, float]:
        """``{role: CPU ms per update}`` plus ``total`` (empty when the window saw no update).
        The launcher's share includes this benchmark's own thread, a negligible sampler."""
        if self._first is None or self._last is None or self._last[0] <= self._first[0]:
            return {}
        (u0, c0), (u1, c1) = self._first, self._last
        out = {role: 1e3 * (c1[role] - c0.get(role, 0.0)) / (u1 - u0) for role in sorted(c1)}
        out["total"] = sum(out.values())
        return out


# kind of a kernel (or, on a CPU, of an operator), by the first pattern its lower-cased name matches
KERNEL_KINDS = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa|scaled_dot")),
    ("matmul", re.compile(r"gemm|cutlass|xmma|cublas|nvjet|\baten::(mm|addmm|bmm|baddbmm|matmul|_scaled_mm)_?\b")),
    ("optimizer", re.compile(r"adam|foreach|multi_tensor")),
    ("compiled (triton)", re.compile(r"triton")),
    ("copy", re.compile(r"memcpy|memset|copy|catarray|aten::(cat|to|_to_copy|clone|contiguous)\b")),
    ("reduction", re.compile(r"reduce|softmax|logsumexp|norm|aten::(sum|mean|max|min|amax|gather|scatter)")),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|aten::(mul|add|sub|div|exp|log|pow|neg|where|silu)")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(low)), "other")


#: CUDA runtime calls in which the host waits for the device
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"})


def profile_once(fn: Callable[[], Any], device: str, top: int = 12) -> dict[str, Any]:
    """One call of ``fn`` under ``torch.profiler``: its wall time, the time the device spent in
    kernels (on a CPU, the operators' own CPU time) in all and by :func:`kernel_kind`, and the
    ``top`` costliest kernels. Kernel time over wall time is how busy ``fn`` kept the device.
    A profiler that cannot run gives ``{"error": ...}``: the caller's timed figures come first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    sync_device(device)
    try:
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            fn()
            sync_device(device)
            wall_ms = (time.perf_counter() - t0) * 1e3
    except Exception as exc:  # noqa: BLE001 - e.g. no CUPTI on the machine
        print(f"profiling failed: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    averages, counted = prof.key_averages(), "kernel time on the device" if on_gpu else "operators' own CPU time"
    if on_gpu:
        events = [(e.key, e.count, e.self_device_time_total / 1e3) for e in averages if e.device_type == DeviceType.CUDA]
        if not any(ms > 0 for *_, ms in events):  # kernels not listed apart: their time by the operator that launched them
            events = [(e.key, e.count, e.self_device_time_total / 1e3) for e in averages if e.device_type == DeviceType.CPU]
            counted = "kernel time on the device, by launching operator"
    else:
        events = [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in averages]
    events = [e for e in events if e[2] > 0]
    # where the host waited for the device: each .item()/float()/bool() of a device tensor is an
    # aten::_local_scalar_dense; .cpu()/.tolist() and explicit syncs show as CUDA runtime calls
    waits = [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in averages
             if e.device_type == DeviceType.CPU and (e.key == "aten::_local_scalar_dense" or e.key in SYNC_CALLS)]
    busy_ms = sum(ms for _, _, ms in events)
    kinds: dict[str, float] = {}
    for name, _, ms in events:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + ms
    return {"wall_ms": wall_ms, "counted": counted,
            "busy_ms": busy_ms, "busy_fraction": busy_ms / wall_ms if wall_ms > 0 else None,
            "kernels": sum(n for _, n, _ in events),
            "host_syncs": {name: {"calls": n, "ms": ms} for name, n, ms in waits},
            "by_kind_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top": [{"name": name[:160], "calls": n, "ms": ms, "kind": kernel_kind(name)}
                    for name, n, ms in sorted(events, key=lambda e: -e[2])[:top]]}
