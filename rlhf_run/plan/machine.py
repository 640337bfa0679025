"""The machine's figures, which no stage shows alone: how busy other jobs keep it, how long a
thread woken by another waits for a core (``handoff``), the run's small periodic work, and how
much slower the processes run beside each other than alone (``contention``, fitted to short
real runs of the config). They fill the profile's :class:`~rlhf_run.plan.profile.Machine`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rlhf_run.plan.profile import Profile


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds of this process tree: itself, its children that ended and those alive;
    busy seconds of the whole machine, ``/proc/stat``)."""
    import psutil

    me = psutil.Process()
    t = me.cpu_times()
    ours = t.user + t.system + t.children_user + t.children_system
    for proc in me.children(recursive=True):
        try:
            t = proc.cpu_times()
            ours += t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    m = psutil.cpu_times()
    return ours, sum(m) - m.idle - getattr(m, "iowait", 0.0)


class BackgroundMeter:
    """Cores kept busy by other processes while it runs: the machine's busy time minus this
    process tree's CPU, over the wall time."""

    def __init__(self) -> None:
        self.t0, (self.ours0, self.busy0) = time.monotonic(), cpu_seconds()

    def cores(self) -> float:
        ours, busy = cpu_seconds()
        wall = max(time.monotonic() - self.t0, 1e-9)
        return max(0.0, ((busy - self.busy0) - (ours - self.ours0)) / wall)


def steady_rate(metrics: Path, warmup: int) -> tuple[float, float]:
    """A run's trained samples/s from the learner's update ``warmup`` to its last (as the simulator's
    ``warmup``) and its mean staleness over the same updates, from its ``metrics.jsonl``."""
    from rlhf_core.metric_names import METRICS_FILE, SAMPLES_TRAINED, STALENESS_MEAN, TIME

    path = metrics if metrics.name == METRICS_FILE else metrics / METRICS_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][warmup:]
    if len(rows) < 2:
        raise RuntimeError(f"{path} has {len(rows) + warmup} updates: at least {warmup + 2} are needed for a rate")
    rate = (rows[-1][SAMPLES_TRAINED] - rows[0][SAMPLES_TRAINED]) / (rows[-1][TIME] - rows[0][TIME])
    return rate, statistics.fmean(r[STALENESS_MEAN] for r in rows[1:])


def fit_contention(profile: Profile, cfg: Any, updates: int = 100, warmup: int = 20, runs: int = 3) -> dict[str, Any]:
    """How much slower each busy thread runs while others are busy, fitted to short real runs.

    How much the processes slow each other depends on the work, and no synthetic pair stood for
    the pipeline, so the run itself is the measurement: ``cfg`` runs ``updates`` updates, ``runs``
    times (one run's luck must not set every prediction), and ``contention`` is set by bisection
    to the value under which the simulator reproduces the runs' median steady trained samples/s,
    beside the other jobs' demand that leaves them the cores they used
    (:func:`~rlhf_run.plan.simulate.background_demand`; the two are fitted in turn). Returns what
    was fitted."""
    from rlhf_run.launch import run_launcher
    from rlhf_run.plan.search import plan_from_config
    from rlhf_run.plan.simulate import background_demand, simulate

    base = dataclasses.replace(
        cfg, launcher="local", resume=None,
        buffer=dataclasses.replace(cfg.buffer, url=None),
        weight_server=dataclasses.replace(cfg.weight_server, port=0, pub_port=0),
        learner=dataclasses.replace(cfg.learner, max_updates=updates),
        run=dataclasses.replace(cfg.run, progress=False))
    rates, loads = [], []
    for _ in range(runs):
        run_cfg = copy.deepcopy(base)  # a fresh copy each time: the launcher writes its Redis URL and run id into it
        with tempfile.TemporaryDirectory(prefix="rlhf-plan-fit-") as tmp:
            meter = BackgroundMeter()
            code = run_launcher(run_cfg, Path(tmp))
            loads.append(meter.cores())
            if code != 0:
                raise RuntimeError(f"the calibration's short run of this config failed (exit {code}); run it with "
                                   "rlhf-run to see why")
            rates.append(steady_rate(Path(tmp), warmup)[0])
    measured, background = statistics.median(rates), statistics.median(loads)
    plan = plan_from_config(cfg)

    def with_contention(c: float) -> Profile:
        return dataclasses.replace(profile, machine=dataclasses.replace(profile.machine, contention=c))

    demand = 0.0
    rounds = 1 if background <= 0.01 else 3
    for round_ in range(rounds):  # contention at the demand, then the demand at that contention, ...
        lo, hi = 1.0, 4.0

        def rate(c: float, demand: float = demand) -> float:
            return simulate(with_contention(c), plan, updates=updates, warmup=warmup, background=demand).trained_samples_per_s

        if rate(lo) <= measured:  # already as slow as the run (or slower): no contention to add
            hi = lo
        for _ in range(12):  # the simulated rate falls as contention rises
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if rate(mid) > measured else (lo, mid)
        profile.machine.contention = (lo + hi) / 2
        if round_ < rounds - 1:
            demand = background_demand(profile, plan, background, updates, warmup)[0]
    return {"updates": updates, "warmup": warmup, "runs_samples_per_s": [round(r, 1) for r in rates],
            "measured_samples_per_s": round(measured, 1), "background_cores": round(background, 3),
            "background_demand": round(demand, 3), "contention": round(profile.machine.contention, 3)}


def _round_trips(client: Any, n: int) -> list[float]:
    """Wall seconds of ``n`` Redis PINGs less the caller's CPU in each, each started from sleep (as a
    pipeline's hand-offs are): the time spent waiting for the server and for the reply to wake us."""
    out = []
    for _ in range(n):
        time.sleep(0.002)
        t0, c0 = time.perf_counter(), time.thread_time()
        client.ping()
        out.append(max(0.0, (time.perf_counter() - t0) - (time.thread_time() - c0)))
    return out


def measure_handoff(redis_url: str, cores: float, n: int = 200) -> dict[str, float]:
    """How long a thread woken by another waits before it runs (``plan.des``'s hand-offs), from
    round trips to a Redis server: with a core free (the tenth percentile), then with ``cores``
    spinning processes of ours keeping them all busy (the median), per runnable thread beyond the
    cores. Other jobs used ``b`` cores while our ``k`` spinners used ``s``: ``k * b / s`` threads."""
    import subprocess
    import sys

    import psutil
    import redis as redis_py

    client = redis_py.Redis.from_url(redis_url)
    try:
        client.ping()
        free = statistics.quantiles(_round_trips(client, n), n=10)[0] / 2
        k = max(1, round(cores))
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]
        try:
            time.sleep(0.5)  # let them start spinning
            procs = [psutil.Process(sp.pid) for sp in spinners]
            spun0 = sum(sum(p.cpu_times()[:2]) for p in procs)
            meter = BackgroundMeter()
            t0 = time.monotonic()
            busy = statistics.median(_round_trips(client, n)) / 2
            spun = (sum(sum(p.cpu_times()[:2]) for p in procs) - spun0) / (time.monotonic() - t0)
            other = meter.cores() - spun  # the meter counts the spinners as ours: take them out
        finally:
            for sp in spinners:
                sp.kill()
                sp.wait()
    finally:
        client.close()
    demand = k * max(0.0, other) / max(spun, 1e-3)
    beyond = k + demand + 1.0 - cores  # runnable while the woken thread waits, beyond the cores
    return {"handoff_s": free, "handoff_busy_s": max(0.0, busy - free) / max(beyond, 1.0),
            "busy_handoff_s": busy, "busy_other_demand": round(demand, 3)}


def measure_launcher(learner: Any, reps: int = 5) -> float:
    """Core-seconds per second of the run's small periodic work: the launcher's snapshot of the
    buffer (once a second), the learner's prompt top-up check (10 a second) and stats (4)."""
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        learner.buffer_monitor.metrics()
        times.append(time.thread_time() - t0)
    t0 = time.thread_time()
    for _ in range(reps):
        learner.buffer.publish_stats("calib", {"x": 1.0})
        learner.buffer.learner_version()
    small = (time.thread_time() - t0) / reps
    return (statistics.median(times) if times else 0.0) + 14 * small
