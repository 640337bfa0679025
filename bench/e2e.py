"""End to end: the same task, model, workers and sample budget run synchronously
(``algo.max_staleness=0``: generation and training alternate) and asynchronously
(``algo.max_staleness=2``) in one invocation. Reports trained samples/s of each, the ratio
and the reward reached. Target on the CPU machine: async >= 1.5x sync at equal or better reward.

    python bench/e2e.py            # quick (< 60 s): one seed, 200 updates per mode
    python bench/e2e.py --full     # 5 seeds x 600 updates per mode, a clearer reward signal

Speed: trained samples/s over the learner's active window (first to last update: start-up is
the same fixed cost in both modes). Reward: the mean batch reward over the last quarter of the
updates, averaged over seeds, with its standard error over seeds. "Equal or better" is a
statistical statement: async's mean is at least sync's minus two standard errors of the
difference (one seed's final reward moves by several hundredths between runs of one mode).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the repository root first: bench/buffer.py must not shadow the `buffer` package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import CpuPerUpdate, print_table, write_results  # noqa: E402


def compose(overrides: list[str]):
    from hydra import compose as hcompose
    from hydra import initialize_config_module

    from rlhf_core.config import register_configs, to_object

    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return to_object(hcompose(config_name="config", overrides=overrides))


def reward_tail(out: Path, frac: float = 0.25) -> list[float]:
    """Batch rewards of the last ``frac`` of the updates."""
    from rlhf_core.metric_names import METRICS_FILE, REWARD_MEAN

    rows = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines() if line.strip()]
    rewards = [r[REWARD_MEAN] for r in rows if r.get(REWARD_MEAN) is not None]
    return rewards[-max(1, int(len(rewards) * frac)):]


def run_one(name: str, overrides: list[str], workdir: Path, cpu_warmup: int = 20) -> dict:
    """One run of rlhf-run under ``overrides`` in ``workdir / name``; ``cpu_warmup``: the updates
    before its CPU-per-update window opens."""
    from rlhf_core.metric_names import METRICS_FILE
    from rlhf_run.launch import run_launcher
    from rlhf_run.summary import SUMMARY_FILE

    cfg = compose(overrides)
    out = workdir / name
    t0 = time.monotonic()
    with CpuPerUpdate(out / METRICS_FILE, warmup=cpu_warmup) as cpu:
        code = run_launcher(cfg, out)
    wall = time.monotonic() - t0
    summary = json.loads((out / SUMMARY_FILE).read_text())
    tail = reward_tail(out)
    return {
        "mode": name,
        "exit_code": code,
        "max_staleness": cfg.algo.max_staleness,
        "seed": cfg.learner.seed,
        "updates": summary["steps"],
        "samples_trained": summary["samples_trained"],
        "wall_s": wall,
        "training_window_s": summary["training_window_s"],
        "trained_samples_per_s": summary["throughput"]["trained_samples_per_s"],
        "trained_samples_per_s_incl_startup": summary["samples_trained"] / wall if wall else 0.0,
        "reward_start": summary["reward_start"],
        "reward_last_quarter": statistics.fmean(tail),
        "reward_last_quarter_n": len(tail),
        "staleness_mean": summary["staleness_mean"],
        "staleness_max": summary["staleness_max"],
        "generated_tokens_per_s": summary["throughput"]["generated_tokens_per_s"],
        "learner_compute_s": summary["throughput"]["learner_compute_s"],
        "learner_wait_s": summary["throughput"]["learner_wait_s"],
        "learner_read_s": summary["throughput"]["learner_read_s"],
        "learner_mfu": summary["throughput"].get("learner_mfu"),
        "cpu_ms_per_update": cpu.result(),
        "_tail": tail,
    }


def compare_rewards(sync: list[dict], asyn: list[dict]) -> dict:
    """Final reward of each mode with its standard error, and whether async is equal or better.

    With several seeds the unit is a run (its last-quarter mean): the spread between seeds is
    what the comparison must beat, and it is far larger than the spread of batches within a
    run. With one seed the batches of the last quarter are the units; that understates the
    run-to-run spread, so a quick run's verdict is only indicative.
    """
    def stat(rows: list[dict]) -> tuple[float, float]:
        values = [r["reward_last_quarter"] for r in rows] if len(rows) > 1 else rows[0]["_tail"]
        se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("inf")
        return statistics.fmean(values), se

    (rs, ses), (ra, sea) = stat(sync), stat(asyn)
    margin = 2 * math.sqrt(ses**2 + sea**2)
    return {"unit": "run" if len(sync) > 1 else "batch", "sync_mean": rs, "sync_se": ses, "async_mean": ra,
            "async_se": sea, "margin_2se": margin, "async_better_seeds": sum(a["reward_last_quarter"] >= s["reward_last_quarter"]
                                                                           for s, a in zip(sync, asyn)),
            "equal_or_better": ra >= rs - margin}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the default")
    # One worker by default: on the 2-core CPU machine one worker and the learner get a core
    # each, the setting in which overlapping generation with training can pay at all.
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--ppo-epochs", type=int, default=1, help="learner work per batch")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per mode (quick 1, full 5)")
    ap.add_argument("--updates", type=int, default=None, help="updates per run (quick 200, full 600)")
    args = ap.parse_args()
    updates = args.updates or (600 if args.full else 200)
    seeds = args.seeds or (5 if args.full else 1)
    common = [
        f"learner.max_updates={updates}",
        f"rollout.num_workers={args.workers}",
        "learner.lr=1e-3",  # the default task learns visibly within this budget
        f"learner.ppo_epochs={args.ppo_epochs}",
        "run.progress=false",
        "learner.checkpoint_every=1000",
    ]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        for seed in range(seeds):
            seeded = common + [f"learner.seed={seed}", f"rollout.seed={seed}", f"data.seed={seed}"]
            # sync and async of one seed back to back: a change in the machine's load hits both
            rows.append(run_one(f"sync-s{seed}", seeded + ["algo.max_staleness=0"], Path(tmp)))
            rows.append(run_one(f"async-s{seed}", seeded + ["algo.max_staleness=2"], Path(tmp)))
    sync = [r for r in rows if r["max_staleness"] == 0]
    asyn = [r for r in rows if r["max_staleness"] > 0]
    ratios = [a["trained_samples_per_s"] / max(s["trained_samples_per_s"], 1e-9) for s, a in zip(sync, asyn)]
    ratio = statistics.median(ratios)
    rw = compare_rewards(sync, asyn)
    reward_ok = rw["equal_or_better"]
    print_table([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
                "end to end: sync vs async (same task, model, workers, sample budget)")
    print(f"\nasync / sync trained samples/s: {ratio:.2f}x (median over {seeds} seed(s); target >= 1.5x)")
    print(f"reward over the last quarter: async {rw['async_mean']:.3f} +- {rw['async_se']:.3f} vs sync "
          f"{rw['sync_mean']:.3f} +- {rw['sync_se']:.3f} (SE over {rw['unit']}s; async >= sync in "
          f"{rw['async_better_seeds']}/{seeds} seed(s); equal or better within 2 SE of the difference, "
          f"{rw['margin_2se']:.3f}: {'yes' if reward_ok else 'no'})")
    payload = {
        "mode": "full" if args.full else "quick",
        "config": {"updates": updates, "seeds": seeds, "workers": args.workers, "ppo_epochs": args.ppo_epochs,
                   "overrides": common},
        "runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
        "async_over_sync": ratio,
        "async_over_sync_per_seed": ratios,
        "reward": rw,
        "target": {"async_over_sync": 1.5, "speed_met": ratio >= 1.5, "reward_equal_or_better": reward_ok},
        "notes": "trained samples/s over the learner's active window; reward = mean batch reward over the last "
                 "quarter of the updates; SE over runs (several seeds) or over batches (one seed: indicative only); "
                 "'equal or better' = async >= sync - 2 SE of the difference",
    }
    write_results("e2e_full" if args.full else "e2e", payload)


if __name__ == "__main__":
    main()
