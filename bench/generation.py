"""Generation throughput: the `hf` engine's continuous batching vs. plain `model.generate`.

Both sides generate exactly the same tokens counts for the same prompts: every request has its
own length (a skewed distribution: most around the median, one in ``long_every`` eight times
longer), forced with per-request ``max_new_tokens`` and no EOS stopping. ``model.generate``
runs static batches of ``slots`` requests (left-padded), each batch decoding until its longest
member is done; the engine keeps ``slots`` sequences running and refills a slot as soon as its
sequence finishes. Tokens/s counts only the requested tokens on both sides, over wall time
including tokenisation, prefill and sampling. The two are measured alternately in one process
(``repeats`` rounds; the best round of each is reported, which is robust to a shared machine).

    .venv/bin/python bench/generation.py [--quick|--full] [--slots 8] [--threads 1]

Target: ratio engine / generate >= 2 on CPU with the tiny model.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from _common import machine, print_table, write_results  # noqa: E402

MODES = {
    "quick": dict(num_requests=96, slots=8, median_tokens=16, long_every=8, long_factor=8, repeats=3),
    "full": dict(num_requests=256, slots=16, median_tokens=16, long_every=8, long_factor=8, repeats=3),
}


def make_workload(cfg: dict, tokenizer, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompts of 8-40 characters and skewed response lengths (median m, every k-th one 8*m)."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz     "
    prompts, lengths = [], []
    m = cfg["median_tokens"]
    for i in range(cfg["num_requests"]):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(8, 40)))
        prompts.append(tokenizer(text)["input_ids"])
        long = rng.random() < 1.0 / cfg["long_every"]
        lengths.append(None if long else rng.randint(m - m // 4, m + m // 4))
    # The long ones are exactly long_factor x the realised median (long ones count as +inf).
    median = sorted(lengths, key=lambda n: float("inf") if n is None else n)[len(lengths) // 2]
    return prompts, [median * cfg["long_factor"] if n is None else n for n in lengths]


def run_generate(model, tokenizer, prompts, lengths, slots: int, sampling: dict) -> tuple[float, int]:
    """Static batches of ``slots`` through ``model.generate``; returns (seconds, useful tokens)."""
    from transformers import GenerationConfig

    start = time.perf_counter()
    useful = 0
    for b in range(0, len(prompts), slots):
        batch, want = prompts[b : b + slots], lengths[b : b + slots]
        enc = tokenizer.pad({"input_ids": batch}, padding=True, return_tensors="pt")
        gen_cfg = GenerationConfig(
            do_sample=True, max_new_tokens=max(want), eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id, **sampling,
        )
        with torch.inference_mode():
            out = model.generate(**enc, generation_config=gen_cfg)
        assert out.shape[1] - enc["input_ids"].shape[1] == max(want), "generate stopped early"
        useful += sum(want)
    return time.perf_counter() - start, useful


def run_engine(model, tokenizer, prompts, lengths, slots: int, sampling: dict) -> tuple[float, int, int]:
    """All requests through one HFEngine; returns (seconds, tokens, decoding steps)."""
    from rollout_workers.engine import GenRequest, SamplingParams
    from rollout_workers.hf_engine import HFEngine

    start = time.perf_counter()
    engine = HFEngine(model, tokenizer, slots=slots, seed=0)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.add(GenRequest(f"r{i}", p, SamplingParams(max_new_tokens=n, ignore_eos=True, **sampling)))
    produced = 0
    while engine.has_work():
        for result in engine.step():
            produced += result.num_tokens
    seconds = time.perf_counter() - start
    assert produced == sum(lengths), f"engine produced {produced} tokens, expected {sum(lengths)}"
    return seconds, produced, engine.num_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_const", const="quick", dest="mode")
    mode.add_argument("--full", action="store_const", const="full", dest="mode")
    ap.add_argument("--slots", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: the tiny model is overhead-bound, and on a shared "
                         "2-core machine more threads only add spin-wait contention)")
    ap.add_argument("--cache-dir", default=os.environ.get("RLHF_TEST_CACHE") or os.path.join(tempfile.gettempdir(), "rlhf-bench-cache"))
    args = ap.parse_args()
    cfg = dict(MODES[args.mode or "quick"])
    if args.slots:
        cfg["slots"] = args.slots
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from rlhf_core.config import ModelConfig
    from rlhf_core.models import load_policy, load_tokenizer

    model_cfg = ModelConfig(cache_dir=args.cache_dir)
    model, tokenizer = load_policy(model_cfg).eval(), load_tokenizer(model_cfg)
    # generate() fills settings left as None from the model's generation config, so
    # eos_token_id=None alone would bring EOS stopping back; remove it at the source.
    model.generation_config.eos_token_id = None
    sampling = dict(temperature=1.0, top_k=0, top_p=1.0)
    prompts, lengths = make_workload(cfg, tokenizer)
    slots = cfg["slots"]

    # Warm-up both paths (first calls pay for lazy imports and allocator growth).
    run_generate(model, tokenizer, prompts[:slots], [4] * slots, slots, sampling)
    run_engine(model, tokenizer, prompts[:slots], [4] * slots, slots, sampling)

    gen_runs, eng_runs, steps = [], [], 0
    for _ in range(cfg["repeats"]):
        gen_runs.append(run_generate(model, tokenizer, prompts, lengths, slots, sampling)[0])
        seconds, _, steps = run_engine(model, tokenizer, prompts, lengths, slots, sampling)
        eng_runs.append(seconds)
    total = sum(lengths)
    static_steps = sum(max(lengths[b : b + slots]) for b in range(0, len(lengths), slots))
    gen_tps, eng_tps = total / min(gen_runs), total / min(eng_runs)
    rows = [
        {"method": "model.generate (static batches)", "tokens": total, "decode_steps": static_steps,
         "best_s": min(gen_runs), "tokens_per_s": gen_tps},
        {"method": "hf engine (continuous batching)", "tokens": total, "decode_steps": steps,
         "best_s": min(eng_runs), "tokens_per_s": eng_tps},
    ]
    ratio = eng_tps / gen_tps
    median = sorted(lengths)[len(lengths) // 2]
    print_table(rows, f"generation throughput, tiny model, {cfg['num_requests']} requests, {slots} slots")
    print(f"\nratio engine / generate: {ratio:.2f}x (target >= 2.0x)")
    write_results("generation", {
        "mode": args.mode or "quick",
        "config": {**cfg, "threads": args.threads, "sampling": sampling, "model": "tiny",
                   "tiny": vars(model_cfg.tiny),
                   "lengths": {"median": median, "max": max(lengths), "long_over_median": max(lengths) / median,
                               "num_long": sum(n == max(lengths) for n in lengths), "total": total}},
        "results": rows,
        "runs_s": {"generate": gen_runs, "engine": eng_runs},
        "ratio": ratio,
        "target_ratio": 2.0,
        "met": ratio >= 2.0,
    })


if __name__ == "__main__":
    main()
