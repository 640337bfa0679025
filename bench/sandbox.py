"""The sandbox and the verifiable rewards: sandboxed executions per second at pool sizes 1, 2
and 4 (a trivial program and one busy for 100 ms of CPU), the start-up overhead of an execution
against a plain subprocess, what reward=math costs per answer, and trained samples/s of the
same run scored by the default count_up reward, by reward=math and by reward=code_tests.

    python bench/sandbox.py            # quick (< 60 s on a quiet machine): one round, 8 updates per run, no code_tests run
    python bench/sandbox.py --full     # 3 rounds of everything, 60 updates per run, code_tests too

Targets, measured side by side: the sandbox's start-up overhead <= 50 ms per execution; a run
with reward=math >= 0.7x the trained samples/s of the default reward. The machine may be shared:
every measurement alternates its configurations (round after round), and the JSON records the
load average around each part.

The runs' task: the default task's prompts (``"7:"``) as a JSONL file whose rows also hold the
count as ``ground_truth`` (reward=math reads the response's last number against it) and as a
stdin/stdout test (reward=code_tests runs the response as a program expecting it printed), so the
three runs train on one task and differ only in their reward.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the repository root first: bench/buffer.py must not shadow the `buffer` package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import mode_parser, print_table, write_results  # noqa: E402

TRIVIAL = "print(1)"
BUSY_100MS = "import time\nwhile time.process_time() < 0.1:\n    pass\nprint(1)"
POOLS = (1, 2, 4)
TARGETS = {"overhead_ms": 50.0, "math_over_default": 0.7}


def load() -> float:
    return round(os.getloadavg()[0], 2)


def sandbox_for(pool: int, backend: str = "bwrap"):
    from rlhf_core.config.sandbox import SandboxConfig
    from rollout_workers.sandbox import Sandbox

    return Sandbox(SandboxConfig.of({"pool_size": pool, "backend": backend, "wall_s": 60.0, "cpu_s": 30}))


def executions(rounds: int, n: dict[str, int]) -> list[dict]:
    """Executions/s of each program at each pool size, the configurations alternated each round."""
    from rollout_workers.sandbox import SandboxStatus

    boxes = {p: sandbox_for(p) for p in POOLS}
    boxes[POOLS[0]].check()
    rates: dict[tuple[str, int], list[float]] = {}
    loads: list[float] = []
    for _ in range(rounds):
        for name, program in (("trivial", TRIVIAL), ("busy_100ms", BUSY_100MS)):
            for pool, box in boxes.items():
                loads.append(load())
                t0 = time.perf_counter()
                results = box.run_all([(program, "")] * n[name])
                elapsed = time.perf_counter() - t0
                bad = [r.reason for r in results if r.status != SandboxStatus.ok]
                if bad:
                    raise SystemExit(f"an execution failed: {bad[0]}")
                rates.setdefault((name, pool), []).append(n[name] / elapsed)
    return [{"program": name, "pool_size": pool, "executions": n[name], "rounds": rounds,
             "per_s": statistics.median(r), "per_s_rounds": [round(x, 2) for x in r], "load_mean": statistics.fmean(loads)}
            for (name, pool), r in rates.items()]


def overhead(n: int) -> dict:
    """Seconds per trivial execution, one at a time, alternating: a plain subprocess (the same
    interpreter, ``-I -c``), the sandbox's command line without bwrap (sandbox=none: prlimit and
    the worker's pipe handling) and the full sandbox. Overhead = sandbox - plain, of the medians
    and of the minimums (on a loaded machine the minimum is the cost without waiting for a core)."""
    plain_argv = ["/usr/bin/python3", "-I", "-c", TRIVIAL]
    boxes = {"none": sandbox_for(1, "none"), "bwrap": sandbox_for(1)}
    times: dict[str, list[float]] = {"plain": [], "none": [], "bwrap": []}
    loads = [load()]
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(plain_argv, capture_output=True, check=True)
        times["plain"].append(time.perf_counter() - t0)
        for name, box in boxes.items():
            t0 = time.perf_counter()
            box.run(TRIVIAL)
            times[name].append(time.perf_counter() - t0)
    loads.append(load())
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    least = {k: 1000 * min(v) for k, v in times.items()}
    return {"ms_per_execution": ms, "overhead_ms": ms["bwrap"] - ms["plain"], "overhead_none_ms": ms["none"] - ms["plain"],
            "min_ms_per_execution": least, "overhead_min_ms": least["bwrap"] - least["plain"], "executions": n, "load": loads}


def math_cost(n: int) -> dict:
    """ms per answer through MathReward, one thread: plain numbers (compared at once) and LaTeX
    answers that go to math-verify in its process."""
    from rollout_workers.math_reward import MathReward

    reward = MathReward()
    try:
        out = {}
        for name, answers, gold in (("plain_numbers", [f"The answer is {k * 1000:,}" for k in range(n)], [str(k * 1000) for k in range(n)]),
                                    ("math_verify", [f"\\boxed{{\\frac{{{k}}}{{{2 * k + 2}}}}}" for k in range(n)],
                                     [f"{k / (2 * k + 2)}" for k in range(n)])):
            t0 = time.perf_counter()
            scores = reward(answers, ground_truth=gold)
            out[name] = {"ms_per_answer": 1000 * (time.perf_counter() - t0) / n, "correct": sum(s == 1.0 for s in scores), "answers": n}
        return out
    finally:
        reward.close()


def task_file(folder: Path) -> Path:
    """The default task's prompts with their count as ground_truth and as a program's expected output."""
    path = folder / "count_up_verifiable.jsonl"
    rows = []
    for i in range(256):
        d = i % 10
        count = "".join(str((d + k) % 10) for k in range(1, 7))
        rows.append({"id": f"count_up-{i}", "prompt": f"{d}:", "start": d, "ground_truth": count,
                     "tests": [{"input": "", "output": count}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def runs(rounds: int, updates: int, with_code: bool, cache_dir: str) -> list[dict]:
    from e2e import run_one

    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as tmp:
        data = task_file(Path(tmp))
        common = [f"learner.max_updates={updates}", "rollout.num_workers=1", "run.progress=false", "learner.checkpoint_every=1000",
                  f"model.cache_dir={cache_dir}", "data=jsonl", f"data.path={data}"]
        modes = {"count_up": [], "math": ["reward=math"]}
        if with_code:
            modes["code_tests"] = ["reward=code_tests"]
        for r in range(rounds):
            for mode, extra in modes.items():  # back to back, alternated: a change in the machine's load hits every mode
                before = load()
                name = f"{mode}-r{r}"
                result = run_one(name, common + extra, Path(tmp), cpu_warmup=min(20, updates // 2))
                cost = json.loads((Path(tmp) / name / "summary.json").read_text()).get("rewards", {})
                rows.append({"mode": mode, "round": r, "exit_code": result["exit_code"], "updates": result["updates"],
                             "trained_samples_per_s": result["trained_samples_per_s"],
                             "reward_last_quarter": result["reward_last_quarter"], "scoring_share": cost.get("scoring_share"),
                             "reasons": cost.get("reasons"), "wall_s": result["wall_s"], "load_before": before, "load_after": load()})
    if any(r["exit_code"] != 0 for r in rows):
        raise SystemExit(f"a run failed: {[(r['mode'], r['exit_code']) for r in rows]}")
    return rows


def ratio(rows: list[dict], mode: str) -> float:
    """The mode's median trained samples/s over the default reward's (medians over rounds)."""
    def rate(m: str) -> float:
        return statistics.median(r["trained_samples_per_s"] for r in rows if r["mode"] == m)

    return rate(mode) / max(rate("count_up"), 1e-9)


def ratios_per_round(rows: list[dict], mode: str) -> list[float]:
    """The mode's trained samples/s over the default reward's run of the same round (back to back)."""
    base = {r["round"]: r["trained_samples_per_s"] for r in rows if r["mode"] == "count_up"}
    return [round(r["trained_samples_per_s"] / max(base[r["round"]], 1e-9), 3) for r in rows if r["mode"] == mode]


def main() -> None:
    ap = mode_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every measurement (quick 1, full 3)")
    ap.add_argument("--updates", type=int, default=None, help="learner updates per run (quick 8, full 60)")
    ap.add_argument("--no-runs", action="store_true", help="skip the training runs (the sandbox alone)")
    ap.add_argument("--cache-dir", default=os.environ.get("RLHF_TEST_CACHE") or "/tmp/rlhf-bench-cache")
    args = ap.parse_args()
    full = args.mode == "full"
    rounds = args.rounds or (3 if full else 1)
    updates = args.updates or (60 if full else 8)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sizes = {"trivial": 32 if full else 8, "busy_100ms": 16 if full else 6}
    started = load()
    execs = executions(rounds, sizes)
    over = overhead(40 if full else 10)
    cost = math_cost(64 if full else 16)
    trained = [] if args.no_runs else runs(rounds, updates, full, args.cache_dir)
    print_table(execs, "sandboxed executions per second (bwrap), by pool size")
    print("\nms per trivial execution, one at a time (median): " + ", ".join(f"{k} {v:.1f}" for k, v in over["ms_per_execution"].items())
          + f"; start-up overhead of the sandbox {over['overhead_ms']:.1f} ms (target <= {TARGETS['overhead_ms']:g}; of the "
          f"minimums {over['overhead_min_ms']:.1f} ms), of sandbox=none {over['overhead_none_ms']:.1f} ms")
    print("reward=math alone, ms per answer: " + ", ".join(f"{k} {v['ms_per_answer']:.2f}" for k, v in cost.items()))
    ratios = {}
    if trained:
        print_table([{k: v for k, v in r.items() if k != "reasons"} for r in trained],
                    f"trained samples/s of one run per reward ({updates} updates, 1 worker)")
        ratios = {m: ratio(trained, m) for m in sorted({r["mode"] for r in trained}) if m != "count_up"}
        per_round = {m: ratios_per_round(trained, m) for m in ratios}
        print(f"\nover the default reward's trained samples/s: {ratios}, per round {per_round} "
              f"(math target >= {TARGETS['math_over_default']:g})")
    met = {"overhead_ms": over["overhead_ms"] <= TARGETS["overhead_ms"]}
    if "math" in ratios:
        met["math_over_default"] = ratios["math"] >= TARGETS["math_over_default"]
    write_results("sandbox" if args.mode == "quick" else f"sandbox_{args.mode}", {
        "mode": args.mode,
        "config": {"rounds": rounds, "updates": updates, "executions": sizes, "pools": POOLS, "cpu_count": os.cpu_count()},
        "load": {"start": started, "end": load(), "note": "1-minute load average of the machine (shared by other jobs)"},
        "executions": execs, "overhead": over, "math_reward_alone": cost, "runs": trained,
        "ratios_over_default": ratios,
        "ratios_per_round": {m: ratios_per_round(trained, m) for m in ratios} if trained else {},
        "targets": TARGETS, "met": met,
        "notes": "executions/s: wall clock of run_all over n executions (each a fresh bwrap + prlimit + python -I); "
                 "overhead: medians of alternated single executions; runs: trained samples/s over the learner's active "
                 "window, medians over rounds",
    })


if __name__ == "__main__":
    main()
