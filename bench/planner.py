"""The planner against real runs: predicted vs measured trained samples/s and mean staleness.

Each configuration of the default task runs as ``rlhf-run`` does (in-process launcher, private
Redis, learner and workers as child processes); the bench reads its ``metrics.jsonl`` and
samples the machine while it trains. The simulator is given the profile and the run's plan,
and the cores other jobs kept busy during that run's training window (the machine is shared:
its load is an input to the prediction, as the device count is on GPUs, and is recorded): the
other jobs' demand is the one under which the simulated run leaves them the cores they got.

    python bench/planner.py            # quick (< 60 s): the committed profile, two short runs
    python bench/planner.py --full     # calibrate, 7 configurations and the search's pick x 3 runs
                                       # (the pick vs the default side by side), the at-scale table
    python bench/planner.py --scale-only   # the at-scale table alone (~1 min, no runs), into the
                                           # existing results (the measured figures are kept)

Rates are steady-state: trained samples/s from the learner's update ``--warmup`` to its last
(start-up and torch's warm-up left out, as the simulator's ``warmup`` does); staleness is the
mean over the same updates. Each configuration's figures are the medians of its runs.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import RESULTS, mode_parser, print_table, results_dir, write_results  # noqa: E402

PROFILE = RESULTS / "planner_profile.json"
#: the validation grid: 1-3 workers, staleness 0/2/4, batch 32/64; plus the search's pick
CONFIGS = {
    "w1-s0-b32": ["rollout.num_workers=1", "algo.max_staleness=0"],
    "w1-s2-b32": ["rollout.num_workers=1", "algo.max_staleness=2"],
    "w2-s2-b32 (default)": ["rollout.num_workers=2", "algo.max_staleness=2"],
    "w3-s4-b32": ["rollout.num_workers=3", "algo.max_staleness=4"],
    "w2-s0-b64": ["rollout.num_workers=2", "algo.max_staleness=0", "learner.batch_size=64", "learner.micro_batch_size=64"],
    "w1-s4-b64": ["rollout.num_workers=1", "algo.max_staleness=4", "learner.batch_size=64", "learner.micro_batch_size=64"],
    "w3-s2-b64": ["rollout.num_workers=3", "algo.max_staleness=2", "learner.batch_size=64", "learner.micro_batch_size=64"],
}
QUICK = {"w1-s0-b32": CONFIGS["w1-s0-b32"], "w1-s2-b32": CONFIGS["w1-s2-b32"]}
GPUS = [8, 16, 32, 64, 128, 256, 512, 1024]
SCALE_MODEL = "Qwen2.5-7B shape, bf16, H100 SXM 80 GB, 8 per node"


def scale_tables() -> dict:
    """The at-scale tables (weight server, NCCL what-if): the best plan per GPU count, and how the
    search got there (plans, simulations, whether its bound closed)."""
    from rlhf_run.plan.scale import SOURCES, table

    out = {"model": SCALE_MODEL, "sources": SOURCES,
           "search": "per GPU count, branch and bound over every feasible plan (rlhf_run.plan.search): simulated "
                     "most promising first until no plan left has an upper bound above the best simulated rate "
                     "(exact: true) or the count's share of 26 simulations per table is spent (exact: false; gap: "
                     "how far above the pick the best plan left could still be, by its bound); the learner's part "
                     "of the bound is exact, the rollout side's a steady-state ceiling with margins"}
    for key, transport in (("weight_server", "weight_server"), ("nccl_what_if", "nccl")):
        t0 = time.monotonic()
        out[key] = table(GPUS, transport)
        out[f"{key}_seconds"] = round(time.monotonic() - t0, 1)
        print_table(out[key], f"at scale ({key}): best plan per GPU count (predicted, {out[f'{key}_seconds']:.0f} s)")
    return out


def rescale() -> None:
    """--scale-only: recompute the at-scale tables into the committed results, nothing else."""
    path = results_dir() / "planner_full.json"
    doc = json.loads(path.read_text()) if path.exists() else {"bench": "planner"}
    doc["scale"] = scale_tables()
    doc["scale"]["recomputed"] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                  "how": "bench/planner.py --scale-only (the validation's figures are those of "
                                         f"{doc.get('date', 'the last full run')})"}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nwrote the at-scale tables into {path}")


class Window:
    """Samples, every 0.25 s, the learner's update count, this process tree's CPU and the whole
    machine's busy time: the cores other jobs used between update ``warmup`` and the last."""

    def __init__(self, metrics: Path, warmup: int) -> None:
        self.metrics, self.warmup = metrics, warmup
        self.first: tuple | None = None
        self.last: tuple | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> tuple[int, float, float, float]:
        from rlhf_run.plan.machine import cpu_seconds

        try:
            updates = self.metrics.read_bytes().count(b"\n")
        except FileNotFoundError:
            updates = 0
        return (updates, time.monotonic(), *cpu_seconds())

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            s = self._sample()
            if s[0] < self.warmup:
                continue
            self.first = self.first or s
            if self.last is None or s[0] > self.last[0]:
                self.last = s

    def __enter__(self) -> Window:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def background(self) -> float | None:
        if not self.first or not self.last or self.last[1] <= self.first[1]:
            return None
        (_, t0, o0, b0), (_, t1, o1, b1) = self.first, self.last
        return max(0.0, ((b1 - b0) - (o1 - o0)) / (t1 - t0))

    def ours(self) -> float | None:
        if not self.first or not self.last or self.last[1] <= self.first[1]:
            return None
        return (self.last[2] - self.first[2]) / (self.last[1] - self.first[1])


def measure(name: str, overrides: list[str], workdir: Path, updates: int, warmup: int) -> tuple[dict, object]:
    from e2e import compose
    from rlhf_run.launch import run_launcher
    from rlhf_run.plan.machine import steady_rate

    cfg = compose([f"learner.max_updates={updates}", "run.progress=false", *overrides])
    out = workdir / re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_")  # a path Hydra overrides can carry
    load0 = os.getloadavg()[0]
    with Window(out / "metrics.jsonl", warmup) as window:
        code = run_launcher(cfg, out)
    rate, staleness = steady_rate(out, warmup)
    summary = json.loads((out / "summary.json").read_text())
    return {
        "exit_code": code, "trained_samples_per_s": rate, "staleness_mean": staleness,
        "samples_dropped": summary["buffer_counters"].get("samples_dropped_stale", 0),
        "summary_trained_samples_per_s": summary["throughput"]["trained_samples_per_s"],
        "background_cores": window.background(), "our_cores": window.ours(), "loadavg_1m": [load0, os.getloadavg()[0]],
    }, cfg


def median_of(runs: list[dict], key: str, predicted: bool = False) -> float:
    """The median of ``key`` over the runs: as measured, or as the simulator predicted it."""
    return statistics.median((m["predicted"] if predicted else m)[key] for m in runs)


def validate(profile, configs: dict[str, list[str]], reps: int, updates: int, warmup: int) -> list[dict]:
    from rlhf_run.plan.search import plan_from_config
    from rlhf_run.plan.simulate import background_demand, simulate

    runs: dict[str, list[dict]] = {name: [] for name in configs}
    plans = {}
    with tempfile.TemporaryDirectory(prefix="bench-planner-") as tmp:
        for rep in range(reps):  # all configurations once, then again: a change of load hits them all
            for name, overrides in configs.items():
                m, cfg = measure(f"{name}-r{rep}", overrides, Path(tmp), updates, warmup)
                plan = plan_from_config(cfg)
                plans[name] = plan
                bg = m["background_cores"] or 0.0
                demand, pred = background_demand(profile, plan, bg, updates, warmup)
                m["background_demand"] = demand
                m["predicted"] = {"trained_samples_per_s": pred.trained_samples_per_s, "staleness_mean": pred.staleness_mean,
                                  "background_cores_used": pred.background_cores_used}
                runs[name].append(m)
                print(f"  {name} run {rep + 1}: measured {m['trained_samples_per_s']:.0f} samples/s, staleness "
                      f"{m['staleness_mean']:.2f} (other jobs {bg:.2f} cores); predicted "
                      f"{pred.trained_samples_per_s:.0f}, {pred.staleness_mean:.2f}", flush=True)
    rows = []
    for name, ms in runs.items():
        bg = statistics.median(m["background_cores"] or 0.0 for m in ms)
        quiet_pred = simulate(profile, plans[name], updates=updates, warmup=warmup, background=0.0)
        meas, pred = median_of(ms, "trained_samples_per_s"), median_of(ms, "trained_samples_per_s", predicted=True)
        stale, pstale = median_of(ms, "staleness_mean"), median_of(ms, "staleness_mean", predicted=True)
        rows.append({
            "config": name, "overrides": configs[name], "runs": len(ms),
            "measured_samples_per_s": meas, "predicted_samples_per_s": pred, "error": (pred - meas) / meas,
            "measured_staleness": stale, "predicted_staleness": pstale, "staleness_error": pstale - stale,
            "background_cores": bg, "predicted_quiet_samples_per_s": quiet_pred.trained_samples_per_s,
            "plan": asdict(plans[name]), "per_run": ms,
        })
    return rows


def main() -> None:
    ap = mode_parser(__doc__)
    ap.add_argument("--reps", type=int, default=None, help="runs per configuration (quick 1, full 3)")
    ap.add_argument("--updates", type=int, default=None, help="updates per run (quick 60, full 200)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--profile", default=None, help="use this profile instead (full: calibrate a new one)")
    ap.add_argument("--skip-scale", action="store_true", help="full mode without the at-scale table")
    ap.add_argument("--scale-only", action="store_true",
                    help="only recompute the at-scale tables into the existing results (no runs, no calibration)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.scale_only:
        rescale()
        return
    from rlhf_run.plan.profile import load

    full = args.mode == "full"
    reps = args.reps or (3 if full else 1)
    updates = args.updates or (200 if full else 60)
    if args.profile:
        profile = load(args.profile)
    elif full:
        from e2e import compose
        from rlhf_run.plan.measure import calibrate

        print("calibrating (every stage alone)...", flush=True)
        profile = calibrate(compose([]))
        profile.source["overrides"] = []
        if os.environ.get("RLHF_BENCH_RESULTS") is None:
            profile.save(PROFILE)
    else:
        profile = load(PROFILE)
    configs = CONFIGS if full else QUICK
    pick = None
    if full:
        from e2e import compose
        from rlhf_run.plan.search import Request, overrides, plan_from_config, search

        base = plan_from_config(compose([]))
        ranked = search(Request(base=base, max_staleness=base.max_staleness, max_workers=3), profile, top=3)
        pick = ranked[0]
        configs = dict(configs)
        configs["search pick"] = overrides(pick.plan, gpu=False)
        print("search's pick for this machine: " + " ".join(configs["search pick"]), flush=True)
    rows = validate(profile, configs, reps, updates, args.warmup)
    print_table([{k: v for k, v in r.items() if k in ("config", "measured_samples_per_s", "predicted_samples_per_s", "error",
                                                       "measured_staleness", "predicted_staleness", "background_cores")}
                 for r in rows], "planner: predicted vs measured (medians of each configuration's runs)")
    grid = [r for r in rows if r["config"] != "search pick"]
    errors = [abs(r["error"]) for r in grid]
    stale = [abs(r["staleness_error"]) for r in grid]
    payload = {
        "mode": "full" if full else "quick",
        "config": {"reps": reps, "updates": updates, "warmup": args.warmup, "profile": str(args.profile or PROFILE)},
        "profile": profile.to_dict(),
        "validation": rows,
        "summary": {"max_abs_error": max(errors), "median_abs_error": statistics.median(errors),
                    "max_abs_staleness_error": max(stale),
                    "within_15pct": sum(e <= 0.15 for e in errors), "within_0_3_staleness": sum(s <= 0.3 for s in stale),
                    "configs": len(grid)},
        "targets": {"samples_per_s_error": 0.15, "staleness_error": 0.3},
        "notes": "measured: trained samples/s from update `warmup` to the last, staleness mean over the same updates, "
                 "medians over runs; predicted: the simulator with the profile and the cores other jobs used during "
                 "each run's window (background_cores); predicted_quiet_samples_per_s: the same plan on an idle machine",
    }
    print(f"\nerror on trained samples/s: median {100 * payload['summary']['median_abs_error']:.1f}%, max "
          f"{100 * payload['summary']['max_abs_error']:.1f}% ({payload['summary']['within_15pct']}/{len(grid)} within 15%); "
          f"staleness: max {payload['summary']['max_abs_staleness_error']:.2f} versions")
    if pick is not None:
        default = next(r for r in rows if r["config"].endswith("(default)"))
        chosen = next(r for r in rows if r["config"] == "search pick")
        payload["search"] = {"pick": asdict(pick.plan), "overrides": configs["search pick"],
                             "predicted_samples_per_s": pick.result.trained_samples_per_s,
                             "measured_samples_per_s": chosen["measured_samples_per_s"],
                             "default_measured_samples_per_s": default["measured_samples_per_s"],
                             "pick_over_default": chosen["measured_samples_per_s"] / default["measured_samples_per_s"]}
        print(f"search's pick vs the default config, measured: {payload['search']['pick_over_default']:.2f}x")
    if full and not args.skip_scale:
        payload["scale"] = scale_tables()
    write_results("planner_full" if full else "planner", payload)


if __name__ == "__main__":
    main()
