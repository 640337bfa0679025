"""Soak: a long run of the default task with several workers stays fast and bounded.

`rlhf-run` runs as a user starts it (a child process, on a Redis this bench starts) for a fixed
wall time. Every few seconds the bench records each process's resident memory and the
launcher's CPU time, and Redis's memory. At the end:

- trained samples/s in each third of the learner's active window (from ``metrics.jsonl``): the
  last third must keep >= 95% of the first;
- resident memory of every process at the end vs. after warm-up (the end of the first third):
  growth <= 5%;
- the launcher's CPU use per third, and Redis's memory at the start and the end.

    python bench/soak.py            # quick: 3 workers, 150 s (under 3 minutes in all)
    python bench/soak.py --full     # 6 workers, 15 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import print_table, write_results  # noqa: E402

MODES = {"quick": dict(workers=3, seconds=150, sample_s=3.0), "full": dict(workers=6, seconds=900, sample_s=5.0)}
TARGETS = {"last_third_over_first": 0.95, "rss_growth_max": 0.05}
PAGE = os.sysconf("SC_PAGE_SIZE")
TICKS = os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except OSError:
        return None


def cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime
    except OSError:
        return None


def sample(launcher_pid: int, out: Path, redis_client) -> dict:
    try:
        children = json.loads((out / "children.json").read_text())
    except (OSError, json.JSONDecodeError):
        children = {}
    pids = {"launcher": launcher_pid, **children}
    return {"t": time.time(), "rss": {name: rss_bytes(pid) for name, pid in pids.items()},
            "pids": pids, "launcher_cpu_s": cpu_seconds(launcher_pid),
            "redis_used_memory": int(redis_client.info("memory")["used_memory"])}


def thirds(rows: list[dict]) -> list[dict]:
    """Trained samples/s over each third of the learner's active window (by wall time)."""
    from rlhf_core import metric_names as M

    rows = [r for r in rows if M.TIME in r and M.SAMPLES_TRAINED in r]
    if len(rows) < 4:
        return []
    t0, t1 = rows[0][M.TIME], rows[-1][M.TIME]
    out = []
    for i in range(3):
        a, b = t0 + (t1 - t0) * i / 3, t0 + (t1 - t0) * (i + 1) / 3
        part = [r for r in rows if a <= r[M.TIME] <= b]
        span = part[-1][M.TIME] - part[0][M.TIME] if len(part) > 1 else 0.0
        done = part[-1][M.SAMPLES_TRAINED] - part[0][M.SAMPLES_TRAINED] if len(part) > 1 else 0
        out.append({"third": i + 1, "updates": len(part), "trained_samples_per_s": done / span if span else 0.0})
    return out


def rss_growth(samples: list[dict]) -> dict[str, dict]:
    """Per process: RSS after warm-up (the first sample past a third of the run) and at the end.
    A process restarted in between (another pid) is reported, not compared."""
    running = live(samples)
    if len(running) < 3:
        return {}
    start, end = running[len(running) // 3], running[-1]
    out = {}
    for name, before in start["rss"].items():
        after = end["rss"].get(name)
        same = start["pids"].get(name) == end["pids"].get(name)
        if before and after:
            out[name] = {"after_warmup_mb": before / 2**20, "end_mb": after / 2**20,
                         "growth": (after - before) / before if same else None, "restarted": not same}
    return out


def live(samples: list[dict]) -> list[dict]:
    """The samples taken while every process ran (not during the start or the shutdown, whose
    report and plots would count as the launcher's steady-state CPU)."""
    return [s for s in samples if len(s["rss"]) > 1 and all(v is not None for v in s["rss"].values())]


def launcher_cpu(samples: list[dict]) -> list[float]:
    """The launcher's CPU use (cores) in each third of the run."""
    timed = [(s["t"], s["launcher_cpu_s"]) for s in live(samples) if s["launcher_cpu_s"] is not None]
    k = len(timed) // 3
    if k < 2:
        return []
    parts = [timed[i * k : (i + 1) * k] for i in range(3)]
    return [(p[-1][1] - p[0][1]) / (p[-1][0] - p[0][0]) for p in parts if p[-1][0] > p[0][0]]


def run(mode: str, workdir: Path) -> dict:
    import redis

    from buffer.local_server import RedisServer

    cfg = MODES[mode]
    server = RedisServer(workdir / "redis", fsync="everysec").start()
    client = redis.Redis.from_url(server.url)
    out = workdir / "run"
    cmd = [str(Path(sys.executable).parent / "rlhf-run"), f"hydra.run.dir={out}", "run.progress=false",
           f"buffer.url={server.url}", f"rollout.num_workers={cfg['workers']}", "learner.max_updates=1000000",
           f"run.max_seconds={cfg['seconds']}", "learner.checkpoint_every=50"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if os.environ.get("RLHF_TEST_CACHE"):
        cmd.append(f"model.cache_dir={os.environ['RLHF_TEST_CACHE']}")
    log = open(workdir / "run.log", "w")
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, env=env)
    samples = []
    try:
        while proc.poll() is None:
            time.sleep(cfg["sample_s"])
            samples.append(sample(proc.pid, out, client))
        code = proc.wait()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
        log.close()
        client.close()
        server.stop()
    from rlhf_run.summary import read_metrics

    rows = read_metrics(out)
    return {"exit_code": code, "samples": samples, "rows": len(rows), "thirds": thirds(rows),
            "rss": rss_growth(samples),
            "launcher_cpu_cores_per_third": launcher_cpu(samples),
            "redis_used_memory_mb": {"start": samples[0]["redis_used_memory"] / 2**20,
                                     "end": samples[-1]["redis_used_memory"] / 2**20} if samples else {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_const", const="quick", dest="mode")
    ap.add_argument("--full", action="store_const", const="full", dest="mode")
    ap.add_argument("--seconds", type=int, default=None, help="override the run's wall time")
    args = ap.parse_args()
    mode = args.mode or "quick"
    if args.seconds:
        MODES[mode]["seconds"] = args.seconds
    with tempfile.TemporaryDirectory(prefix="rlhf-soak-") as tmp:
        res = run(mode, Path(tmp))
    th = res["thirds"]
    ratio = th[-1]["trained_samples_per_s"] / th[0]["trained_samples_per_s"] if len(th) == 3 and th[0]["trained_samples_per_s"] else None
    growths = [v["growth"] for v in res["rss"].values() if v["growth"] is not None]
    worst = max(growths, default=None)
    print_table(th, f"soak ({mode}): trained samples/s per third of the run")
    print_table([{"process": n, **v} for n, v in res["rss"].items()], "resident memory after warm-up and at the end")
    print(f"\nlast third / first: {ratio if ratio is None else f'{ratio:.3f}'} (target >= {TARGETS['last_third_over_first']}); "
          f"worst RSS growth: {worst if worst is None else f'{100 * worst:.1f}%'} (target <= 5%)")
    print(f"launcher CPU (cores) per third: {[round(c, 3) for c in res['launcher_cpu_cores_per_third']]}; "
          f"Redis memory MB: {res['redis_used_memory_mb']}")
    met = ratio is not None and ratio >= TARGETS["last_third_over_first"] and worst is not None and worst <= TARGETS["rss_growth_max"]
    write_results("soak", {
        "mode": mode, "config": MODES[mode], "exit_code": res["exit_code"], "updates": res["rows"],
        "thirds": th, "last_third_over_first": ratio, "rss": res["rss"], "worst_rss_growth": worst,
        "launcher_cpu_cores_per_third": res["launcher_cpu_cores_per_third"],
        "redis_used_memory_mb": res["redis_used_memory_mb"], "targets": TARGETS, "met": met,
    })


if __name__ == "__main__":
    main()
