"""Rewards that are real models: the same run scored one sample per call vs in batches.

A neural reward model built from a config (a Llama-style sequence classifier, 4 layers of 256,
random weights, the tiny model's character tokenizer, so it reads the default task's text) scores
the default task's responses in a real run of the service (``bench/e2e.py``'s ``run_one``: private
Redis, learner, one worker), once with ``reward.batch_size=1`` (one forward pass per sample, what
scoring did before batching) and once with ``reward.batch_size=32`` (a forward pass per batch of
whole groups). Reports trained samples/s of each, the ratio, and each worker's scoring share and
reward calls/s from ``summary.json``; beside it, the model alone: ms per completion one at a time
and in batches of 4 and 32 (one thread). Target on the 2-core CPU machine: batched >= 2x per sample.

    python bench/rewards.py            # quick (< 60 s): 10 updates per mode, one seed
    python bench/rewards.py --full     # 3 seeds x 100 updates, and a third mode: 2 scoring threads
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the repository root first: bench/buffer.py must not shadow the `buffer` package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import mode_parser, print_table, write_results  # noqa: E402

#: the reward model's shape: a few ms per call on one CPU thread, so batching matters
RM_SHAPE = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=256)
BATCH = 32


def reward_model_dir(cache_dir: str) -> Path:
    """The reward model, built once under ``cache_dir`` (saved in HF format, loaded by the
    workers through ``from_pretrained`` like any user's reward model)."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rlhf_core.models import build_tiny_tokenizer, save_model_dir

    out = Path(cache_dir).expanduser() / "bench-reward-model-256x4"
    if not (out / "config.json").exists():
        tok = build_tiny_tokenizer()
        config = LlamaConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id, num_labels=1, **RM_SHAPE)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = LlamaForSequenceClassification(config)
        save_model_dir(model, tok, out)
    return out


def model_alone(rm: Path, cache_dir: str, reps: int = 3) -> dict[str, float]:
    """ms per completion through the scorer, one thread, batches of 1, 4 and 32 (best of ``reps``)."""
    import torch

    from rlhf_core.config import ModelConfig, RewardConfig
    from rollout_workers.rewards import ScoreItem, Scorer

    torch.set_num_threads(1)
    scorer = Scorer(RewardConfig(models={"rm": {"path": str(rm)}}), ModelConfig(cache_dir=cache_dir))
    digits = "8901234567890123"
    items = [ScoreItem(f"{i % 10}:", digits[: 1 + i % 16], [1], {}) for i in range(BATCH)]
    out = {}
    for size in (1, 4, BATCH):
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for i in range(0, BATCH, size):
                scorer.score_batch(items[i : i + size])
            best = min(best, (time.perf_counter() - t0) / BATCH)
        out[f"batch_{size}"] = round(best * 1000, 3)
    return out


def main() -> None:
    ap = mode_parser(__doc__)
    ap.add_argument("--updates", type=int, default=None, help="updates per run (quick 10, full 100)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per mode (quick 1, full 3)")
    ap.add_argument("--cache-dir", default=os.environ.get("RLHF_TEST_CACHE") or "/tmp/rlhf-bench-cache")
    args = ap.parse_args()
    full = args.mode == "full"
    updates = args.updates or (100 if full else 10)
    seeds = args.seeds or (3 if full else 1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # every child: one intra-op thread, as rlhf-run gives 2 cores
    from e2e import run_one

    rm = reward_model_dir(args.cache_dir)
    alone = model_alone(rm, args.cache_dir)
    modes = {"per_sample": ["reward.batch_size=1"], "batched": [f"reward.batch_size={BATCH}"]}
    if full:
        modes["batched_2_threads"] = [f"reward.batch_size={BATCH}", "reward.num_threads=2"]
    common = [
        f"learner.max_updates={updates}", "rollout.num_workers=1", "run.progress=false", "learner.checkpoint_every=1000",
        f"model.cache_dir={args.cache_dir}", "reward=model", f"reward.models.rm.path={rm}",
    ]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-rewards-") as tmp:
        for seed in range(seeds):
            seeded = common + [f"learner.seed={seed}", f"rollout.seed={seed}", f"data.seed={seed}"]
            for mode, extra in modes.items():  # back to back: a change in the machine's load hits every mode
                name = f"{mode}-s{seed}"
                r = run_one(name, seeded + extra, Path(tmp))
                cost = json.loads((Path(tmp) / name / "summary.json").read_text()).get("rewards", {})
                rows.append({"mode": mode, "seed": seed, "exit_code": r["exit_code"], "updates": r["updates"],
                             "trained_samples_per_s": r["trained_samples_per_s"],
                             "generated_tokens_per_s": r["generated_tokens_per_s"],
                             "scoring_share": cost.get("scoring_share"),
                             "reward_calls_per_s": cost.get("reward_calls_per_s"),
                             "learner_wait_s": r["learner_wait_s"], "wall_s": r["wall_s"]})
    if any(r["exit_code"] != 0 for r in rows):
        raise SystemExit(f"a run failed: {[(r['mode'], r['exit_code']) for r in rows]}")

    def rate(mode: str, seed: int) -> float:
        return next(r["trained_samples_per_s"] for r in rows if (r["mode"], r["seed"]) == (mode, seed))

    ratios = {m: [rate(m, s) / max(rate("per_sample", s), 1e-9) for s in range(seeds)] for m in modes if m != "per_sample"}
    ratio = statistics.median(ratios["batched"])
    print(f"\nthe reward model alone, one thread, ms per completion: {alone}")
    print_table(rows, f"rewards: a neural reward model scored per sample vs in batches of {BATCH} ({updates} updates, "
                      "1 worker)")
    print(f"\nbatched / per-sample trained samples/s: {ratio:.2f}x (median over {seeds} seed(s); target >= 2x)")
    write_results("rewards" if args.mode == "quick" else f"rewards_{args.mode}", {
        "mode": args.mode,
        "config": {"updates": updates, "seeds": seeds, "batch_size": BATCH, "reward_model": RM_SHAPE,
                   "overrides": common[:-1] + ["reward.models.rm.path=<built>"], "modes": modes},
        "reward_model_ms_per_completion": alone,
        "runs": rows,
        "batched_over_per_sample": ratio,
        "ratios_per_seed": ratios,
        "target": {"batched_over_per_sample": 2.0, "met": ratio >= 2.0},
        "notes": "trained samples/s over the learner's active window (start-up excluded); scoring_share = the "
                 "worker's scoring-thread time spent scoring (1: the reward is the bottleneck); the reward model has "
                 "random weights, so what is learnt is noise: this measures throughput only",
    })


if __name__ == "__main__":
    main()
