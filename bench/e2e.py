"""End to end: the same task, model, workers and sample budget run synchronously
(``algo.max_staleness=0``: generation and training alternate) and asynchronously
(``algo.max_staleness=2``) in one invocation. Reports trained samples/s of each, the ratio
and the reward reached. Target on the CPU machine: async >= 1.5x sync at equal or better reward.

    python bench/e2e.py            # quick (< 60 s): one seed, 200 updates per mode
    python bench/e2e.py --full     # 3 seeds x 600 updates per mode, a clearer reward signal

Speed: trained samples/s over the learner's active window (first to last update: start-up is
the same fixed cost in both modes). Reward: the mean batch reward over the last quarter of the
updates, pooled over seeds, with its standard error. "Equal or better" is a statistical
statement: async's mean is at least sync's minus two standard errors of the difference (one
seed's final reward moves by a few hundredths between runs of the same mode).
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
from _common import print_table, write_results  # noqa: E402


def compose(overrides: list[str]):
    from hydra import compose as hcompose, initialize_config_module

    from rlhf_core.config import register_configs, to_object

    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return to_object(hcompose(config_name="config", overrides=overrides))


def reward_tail(out: Path, frac: float = 0.25) -> list[float]:
    """Batch rewards of the last ``frac`` of the updates."""
    from learner.report import REWARD_KEY
    from learner.trainer import METRICS_FILE

    rows = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines() if line.strip()]
    rewards = [r[REWARD_KEY] for r in rows if r.get(REWARD_KEY) is not None]
    return rewards[-max(1, int(len(rewards) * frac)):]


def run_one(name: str, overrides: list[str], workdir: Path) -> dict:
    from learner.launch import run_launcher
    from learner.report import SUMMARY_FILE

    cfg = compose(overrides)
    out = workdir / name
    t0 = time.monotonic()
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
        "_tail": tail,
    }


def pooled(rows: list[dict]) -> tuple[float, float]:
    """Mean batch reward over the last quarter of every run of a mode, and its standard error
    (batches of one run are treated as independent draws; with several seeds the between-seed
    spread enters through the pooled variance)."""
    values = [v for r in rows for v in r["_tail"]]
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("inf")
    return mean, se


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the default")
    # One worker by default: on the 2-core CPU machine one worker and the learner get a core
    # each, the setting in which overlapping generation with training can pay at all.
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--ppo-epochs", type=int, default=1, help="learner work per batch")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per mode (quick 1, full 3)")
    ap.add_argument("--updates", type=int, default=None, help="updates per run (quick 200, full 600)")
    args = ap.parse_args()
    updates = args.updates or (600 if args.full else 200)
    seeds = args.seeds or (3 if args.full else 1)
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
    (rs, ses), (ra, sea) = pooled(sync), pooled(asyn)
    margin = 2 * math.sqrt(ses**2 + sea**2)
    reward_ok = ra >= rs - margin
    print_table([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
                "end to end: sync vs async (same task, model, workers, sample budget)")
    print(f"\nasync / sync trained samples/s: {ratio:.2f}x (median over {seeds} seed(s); target >= 1.5x)")
    print(f"reward over the last quarter: async {ra:.3f} +- {sea:.3f} vs sync {rs:.3f} +- {ses:.3f} "
          f"(equal or better within 2 SE of the difference, {margin:.3f}: {'yes' if reward_ok else 'no'})")
    payload = {
        "mode": "full" if args.full else "quick",
        "config": {"updates": updates, "seeds": seeds, "workers": args.workers, "ppo_epochs": args.ppo_epochs,
                   "overrides": common},
        "runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
        "async_over_sync": ratio,
        "async_over_sync_per_seed": ratios,
        "reward": {"sync_mean": rs, "sync_se": ses, "async_mean": ra, "async_se": sea, "margin_2se": margin},
        "target": {"async_over_sync": 1.5, "speed_met": ratio >= 1.5, "reward_equal_or_better": reward_ok},
        "notes": "trained samples/s over the learner's active window; reward = mean batch reward over the last "
                 "quarter of the updates, pooled over seeds; 'equal or better' = async >= sync - 2 SE of the difference",
    }
    write_results("e2e", payload)


if __name__ == "__main__":
    main()
