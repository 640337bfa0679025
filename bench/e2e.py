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
# the repository root first: bench/buffer.py must not shadow the `buffer` package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
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
        # over the learner's active window (first to last update): start-up is the same
        # fixed cost in both modes and would only blur the comparison
        "training_window_s": summary["training_window_s"],
        "trained_samples_per_s": summary["throughput"]["trained_samples_per_s"],
        "trained_samples_per_s_incl_startup": summary["samples_trained"] / wall if wall else 0.0,
        "reward_start": summary["reward_start"],
        "reward_end": summary["reward_end"],
        "staleness_mean": summary["staleness_mean"],
        "staleness_max": summary["staleness_max"],
        "generated_tokens_per_s": summary["throughput"]["generated_tokens_per_s"],
        "learner_compute_s": summary["throughput"]["learner_compute_s"],
        "learner_wait_s": summary["throughput"]["learner_wait_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the default")
    # One worker by default: on the 2-core CPU machine one worker and the learner get a core
    # each, the setting in which overlapping generation with training can pay at all. With two
    # workers generation alone saturates both cores and there is nothing left to overlap (the
    # full mode measures that too).
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--ppo-epochs", type=int, default=1,
                    help="learner work per batch; 2 balances the stages of the tiny model on CPU")
    args = ap.parse_args()
    updates = 400 if args.full else 120
    common = [
        f"learner.max_updates={updates}",
        f"rollout.num_workers={args.workers}",
        "learner.lr=1e-3",  # the default task learns visibly within this budget
        f"learner.ppo_epochs={args.ppo_epochs}",
        "run.progress=false",
        "learner.checkpoint_every=1000",
    ]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    extra: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        rows = [
            run_one("sync", common + ["algo.max_staleness=0"], Path(tmp)),
            run_one("async", common + ["algo.max_staleness=2"], Path(tmp)),
        ]
        if args.full and args.workers == 1:  # the saturated case, for the record
            two = [o.replace("rollout.num_workers=1", "rollout.num_workers=2") for o in common]
            extra = [run_one("sync-2w", two + ["algo.max_staleness=0"], Path(tmp)),
                     run_one("async-2w", two + ["algo.max_staleness=2"], Path(tmp))]
    ratio = rows[1]["trained_samples_per_s"] / max(rows[0]["trained_samples_per_s"], 1e-9)
    print_table(rows + extra, "end to end: sync vs async (same task, model, workers, sample budget)")
    reward_ok = (rows[1]["reward_end"] or 0) >= (rows[0]["reward_end"] or 0)
    print(f"\nasync / sync trained samples/s: {ratio:.2f}x (target >= 1.5x); "
          f"final reward async {rows[1]['reward_end']:.3f} vs sync {rows[0]['reward_end']:.3f}")
    payload = {
        "mode": "full" if args.full else "quick",
        "config": {"updates": updates, "workers": args.workers, "ppo_epochs": args.ppo_epochs, "overrides": common},
        "runs": rows + extra,
        "async_over_sync": ratio,
        "target": {"async_over_sync": 1.5, "speed_met": ratio >= 1.5, "reward_equal_or_better": reward_ok},
        "notes": "trained samples/s over the learner's active window; reward_end is the mean batch reward "
                 "of the last updates (noisy at this budget: compare within a few hundredths)",
    }
    if extra:
        payload["async_over_sync_2_workers"] = extra[1]["trained_samples_per_s"] / max(extra[0]["trained_samples_per_s"], 1e-9)
    write_results("e2e", payload)


if __name__ == "__main__":
    main()
