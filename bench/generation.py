"""Generation throughput: the `hf` engine vs. plain `model.generate` (and transformers' own
continuous batching), side by side in one run.

Every request has its own number of new tokens, forced with per-request ``max_new_tokens`` and
no EOS stopping, so every method generates exactly the same token counts for the same prompts.
``model.generate`` runs static batches of ``slots`` requests (left-padded), each batch decoding
until its longest member is done; the engine keeps ``slots`` sequences running and refills a
slot as soon as its sequence finishes; transformers' continuous-batching manager
(``paged|sdpa`` attention) gets the same requests with their own lengths. Tokens/s counts only
the requested tokens, over wall time including prefill and sampling. Methods run alternately
(``repeats`` rounds; the best round of each is reported, robust to a shared machine).

Modes:

- ``--quick`` / ``--full``: CPU, the tiny model, text prompts, skewed lengths (most around the
  median, one in ``long_every`` eight times longer). The library row is opt-in here
  (``--library``): its manager costs ~35 s to start on a CPU.
- ``--gpu``: a Qwen2-0.5B-shaped model built from its config (random bf16 weights, see
  ``bench/_models.py``), 256 prompts of 128 tokens, batch/slots 256; a uniform workload (256 new
  tokens each) and a skewed one (median 64, every 8th 256). Peak GPU memory per method. Then
  the engine's decoding of ``slots`` requests of 32 tokens (fewer if the context is short)
  under ``torch.profiler`` (``profile`` in the JSON): how much of a step's wall time the GPU
  spent in kernels (the rest is the host's work between them) and that kernel time by kind.
- ``--gpu-check``: the ``--gpu`` code path on a CPU with a 2-layer model and a handful of
  requests: checks the bench, measures nothing.

    .venv/bin/python bench/generation.py [--quick|--full|--gpu|--gpu-check] [--slots N] [--library]

Targets: CPU, engine / generate >= 2; H100, engine >= 10x generate at batch 256 and >= the
library.
"""

from __future__ import annotations

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

from _common import mode_parser, print_table, profile_once, require_device, sync_device, write_results  # noqa: E402

SKEWED = dict(kind="skewed", long_every=8, long_factor=8)
MODES = {
    "quick": dict(model="tiny", device="cpu", num_requests=96, slots=8, repeats=3, library=False,
                  workloads=[dict(SKEWED, median_tokens=16)]),
    "full": dict(model="tiny", device="cpu", num_requests=256, slots=16, repeats=3, library=False,
                 workloads=[dict(SKEWED, median_tokens=16)]),
    "gpu": dict(model="qwen2-0.5b", device="cuda", dtype="bfloat16", num_requests=256, slots=256, prompt_tokens=128,
                repeats=2, library=True, profile=True, workloads=[dict(kind="uniform", new_tokens=256),
                                                     dict(SKEWED, median_tokens=64, long_factor=4)]),
    "gpu-check": dict(model="qwen2-0.5b", shape=dict(num_hidden_layers=2, vocab_size=4096), device="cpu",
                      dtype="float32", num_requests=8, slots=4, prompt_tokens=16, repeats=1, library=False, profile=True,
                      workloads=[dict(kind="uniform", new_tokens=8), dict(SKEWED, median_tokens=4, long_factor=2)]),
}
TARGETS = {"cpu": {"engine_over_generate": 2.0}, "cuda": {"engine_over_generate": 10.0, "engine_over_library": 1.0}}


def make_prompts(cfg: dict, tokenizer, seed: int = 0) -> list[list[int]]:
    """Text prompts of 8-40 characters (tiny model), or ``prompt_tokens`` random ids."""
    rng = random.Random(seed)
    if "prompt_tokens" in cfg:
        return [[rng.randrange(4, len(tokenizer)) for _ in range(cfg["prompt_tokens"])] for _ in range(cfg["num_requests"])]
    alphabet = "abcdefghijklmnopqrstuvwxyz     "
    return [tokenizer("".join(rng.choice(alphabet) for _ in range(rng.randint(8, 40))))["input_ids"]
            for _ in range(cfg["num_requests"])]


def make_lengths(workload: dict, n: int, seed: int = 0) -> list[int]:
    """New tokens per request: all equal (uniform), or skewed (median m +-25%, every k-th one
    ``long_factor`` x the realised median)."""
    if workload["kind"] == "uniform":
        return [workload["new_tokens"]] * n
    rng = random.Random(seed + 1)
    m = workload["median_tokens"]
    lengths = [None if rng.random() < 1.0 / workload["long_every"] else rng.randint(m - m // 4, m + m // 4) for _ in range(n)]
    median = sorted(lengths, key=lambda x: float("inf") if x is None else x)[n // 2]
    return [median * workload["long_factor"] if x is None else x for x in lengths]


def run_generate(model, tokenizer, prompts, lengths, slots: int, device: str) -> dict:
    """Static batches of ``slots`` through ``model.generate``."""
    from transformers import GenerationConfig

    start, steps = time.perf_counter(), 0
    for b in range(0, len(prompts), slots):
        batch, want = prompts[b : b + slots], lengths[b : b + slots]
        enc = tokenizer.pad({"input_ids": batch}, padding=True, return_tensors="pt").to(device)
        gen_cfg = GenerationConfig(do_sample=True, max_new_tokens=max(want), eos_token_id=None, temperature=1.0,
                                   top_k=0, top_p=1.0, pad_token_id=tokenizer.pad_token_id)
        with torch.inference_mode():
            out = model.generate(**enc, generation_config=gen_cfg)
        assert out.shape[1] - enc["input_ids"].shape[1] == max(want), "generate stopped early"
        steps += max(want)
    sync_device(device)
    return dict(seconds=time.perf_counter() - start, tokens=sum(lengths), decode_steps=steps)


def run_engine(engine, prompts, lengths) -> dict:
    """All requests through one (already warmed-up) HFEngine."""
    from rollout_workers.engine import GenRequest, SamplingParams

    steps0, start = engine.num_steps, time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.add(GenRequest(f"r{i}", p, SamplingParams(max_new_tokens=n, ignore_eos=True)))
    produced = 0
    while engine.has_work():
        for result in engine.step():
            produced += result.num_tokens
    seconds = time.perf_counter() - start
    assert produced == sum(lengths), f"engine produced {produced} tokens, expected {sum(lengths)}"
    return dict(seconds=seconds, tokens=produced, decode_steps=engine.num_steps - steps0)


def run_library(model, prompts, lengths, slots: int, device: str) -> dict:
    """transformers' continuous-batching manager (``paged|sdpa``), per-request lengths; timed
    from the first request to the last result (the manager's start-up is not counted)."""
    from transformers import GenerationConfig

    before = model.config._attn_implementation
    model.set_attn_implementation("paged|sdpa")
    gen_cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None,
                               max_new_tokens=max(lengths), max_batch_tokens=None)
    try:
        with model.continuous_batching_context_manager(generation_config=gen_cfg, block=True, timeout=30) as manager:
            start = time.perf_counter()
            for i, (p, n) in enumerate(zip(prompts, lengths)):
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
            got = {}
            while len(got) < len(prompts):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    got[result.request_id] = result
            seconds = time.perf_counter() - start
    finally:
        model.set_attn_implementation(before)
    produced = sum(len(r.generated_tokens) for r in got.values())
    assert produced == sum(lengths), f"the library produced {produced} tokens, expected {sum(lengths)}"
    return dict(seconds=seconds, tokens=produced, decode_steps=None)


def load(cfg: dict, cache_dir: str):
    """(model, tokenizer, description) for the mode."""
    from rlhf_core.config import ModelConfig
    from rlhf_core.models import load_policy, load_tokenizer

    if cfg["model"] == "tiny":
        model_cfg = ModelConfig(cache_dir=cache_dir)
        return load_policy(model_cfg).eval(), load_tokenizer(model_cfg), {"model": "tiny", "tiny": vars(model_cfg.tiny)}
    from _models import qwen2_05b_dir

    path = qwen2_05b_dir(cache_dir, dtype=cfg["dtype"], **cfg.get("shape", {}))
    model_cfg = ModelConfig(name="hf", path=str(path), dtype=cfg["dtype"], device=cfg["device"], cache_dir=cache_dir)
    return load_policy(model_cfg).eval(), load_tokenizer(model_cfg), {"model": str(path.name), "shape": cfg.get("shape")}


def measure_workload(cfg, workload, model, tokenizer, engine, prompts, library: bool) -> list[dict]:
    device, slots = cfg["device"], cfg["slots"]
    lengths = make_lengths(workload, len(prompts))
    methods = {"model.generate (static batches)": lambda: run_generate(model, tokenizer, prompts, lengths, slots, device),
               "hf engine (slot cache" + (", CUDA graphs)" if engine._graphs is not None else ")"):
                   lambda: run_engine(engine, prompts, lengths)}
    if library:
        methods["transformers continuous batching"] = lambda: run_library(model, prompts, lengths, slots, device)
    best: dict[str, dict] = {}
    for _ in range(cfg["repeats"]):
        for name, fn in methods.items():
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            run = fn()
            run["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
            if name not in best or run["seconds"] < best[name]["seconds"]:
                best[name] = run
    rows = []
    for name, run in best.items():
        steps = run["decode_steps"]
        rows.append({"workload": workload["kind"], "method": name, "tokens": run["tokens"], "decode_steps": steps,
                     "best_s": run["seconds"], "tokens_per_s": run["tokens"] / run["seconds"],
                     "ms_per_step": 1000 * run["seconds"] / steps if steps else None, "peak_gpu_gib": run["peak_gpu_gib"]})
    return rows


def warm_up(cfg, model, tokenizer, engine, prompts, library: bool) -> None:
    """First calls pay for lazy imports, allocator growth and (GPU) graph captures: lengths
    1..slots make the engine's batch shrink through every bucket."""
    n = cfg["slots"]
    run_generate(model, tokenizer, prompts[:n], [2] * n, n, cfg["device"])
    run_engine(engine, prompts[:n], [1 + i % n for i in range(n)])
    if library:
        run_library(model, prompts[:n], [2] * n, n, cfg["device"])


def profile_decoding(cfg: dict, engine, prompts, new_tokens: int = 32) -> dict:
    """The engine decoding ``slots`` requests of ``new_tokens`` each under the profiler, per step."""
    n = cfg["slots"]
    steps0 = engine.num_steps
    prof = profile_once(lambda: run_engine(engine, prompts[:n], [new_tokens] * n), cfg["device"])
    steps = engine.num_steps - steps0
    if "error" in prof or not steps:
        return prof
    return {"requests": n, "new_tokens": new_tokens, "steps": steps, "cuda_graphs": engine._graphs is not None,
            "wall_ms_per_step": prof["wall_ms"] / steps, "busy_ms_per_step": prof["busy_ms"] / steps, **prof}


def ratios(rows: list[dict]) -> dict:
    out = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        tps = {r["method"].split(" (")[0]: r["tokens_per_s"] for r in rows if r["workload"] == workload}
        out[workload] = {"engine_over_generate": tps["hf engine"] / tps["model.generate"]}
        if "transformers continuous batching" in tps:
            out[workload]["engine_over_library"] = tps["hf engine"] / tps["transformers continuous batching"]
    return out


def main() -> None:
    ap = mode_parser(__doc__, MODES)
    ap.add_argument("--slots", type=int, default=None)
    ap.add_argument("--requests", type=int, default=None, help="number of requests (default: the mode's)")
    ap.add_argument("--library", action="store_true", help="also measure transformers' continuous batching on a CPU")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads on a CPU (1: the tiny model is overhead-bound, and on a shared "
                         "2-core machine more threads only add spin-wait contention)")
    ap.add_argument("--cache-dir", default=os.environ.get("RLHF_TEST_CACHE") or os.path.join(tempfile.gettempdir(), "rlhf-bench-cache"))
    args = ap.parse_args()
    name = args.mode
    cfg = dict(MODES[name])
    cfg["slots"] = args.slots or cfg["slots"]
    cfg["num_requests"] = args.requests or cfg["num_requests"]
    library = cfg["library"] or args.library
    require_device(cfg["device"])
    if cfg["device"] == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from rollout_workers.hf_engine import HFEngine

    model, tokenizer, described = load(cfg, args.cache_dir)
    # generate() fills settings left as None from the model's generation config, so
    # eos_token_id=None alone would bring EOS stopping back; remove it at the source.
    model.generation_config.eos_token_id = None
    prompts = make_prompts(cfg, tokenizer)
    longest = max(len(p) for p in prompts) + max(max(make_lengths(w, len(prompts))) for w in cfg["workloads"])
    engine = HFEngine(model, tokenizer, slots=cfg["slots"], seed=0, max_model_len=longest)
    warm_up(cfg, model, tokenizer, engine, prompts, library)
    rows = [row for w in cfg["workloads"] for row in measure_workload(cfg, w, model, tokenizer, engine, prompts, library)]
    device_name = torch.cuda.get_device_name(0) if cfg["device"] == "cuda" else "cpu"
    print_table(rows, f"generation throughput, {described['model']} on {device_name}, {cfg['num_requests']} requests, "
                      f"{cfg['slots']} slots")
    got = ratios(rows)
    targets = TARGETS[cfg["device"]]
    met = all(got[w].get(k, float("inf")) >= v for w in got for k, v in targets.items())
    for w, r in got.items():
        print(f"{w}: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items()))
    print(f"targets {targets}: {'met' if met else 'NOT met'}")
    room = longest - max(len(p) for p in prompts)  # new tokens the engine's context holds after any prompt
    prof = profile_decoding(cfg, engine, prompts, min(32, room)) if cfg.get("profile") else None
    if prof is not None and "error" not in prof:
        print(f"profile, {prof['requests']} requests x {prof['new_tokens']} tokens: {prof['wall_ms_per_step']:.2f} ms a step, "
              f"{prof['busy_ms_per_step']:.2f} of it in {prof['counted']}: "
              + ", ".join(f"{kind} {ms / prof['steps']:.2f}" for kind, ms in prof["by_kind_ms"].items()))
    stem = "generation" if name in ("quick", "full") else f"generation_{name.replace('-', '_')}"
    write_results(stem + ("_library" if args.library else ""), {
        "mode": name, "device": device_name,
        "config": {**{k: v for k, v in cfg.items() if k != "workloads"}, "workloads": cfg["workloads"], "threads": args.threads,
                   "sampling": dict(temperature=1.0, top_k=0, top_p=1.0), **described, "library": library},
        "results": rows, "ratios": got, "targets": targets, "met": met, **({"profile": prof} if prof else {}),
    })


if __name__ == "__main__":
    main()
