"""The learner alone on one device: model FLOP utilisation (MFU) of an update, side by side with
a plain torch training step on the same tokens.

Every method trains the same model on the same token batch (random ids, a GRPO batch of
``batch`` samples in groups of ``group``, ``prompt_tokens + response_tokens`` each, in
micro-batches of ``micro_batch``):

- ``plain torch``: what a user writes first: bf16 weights, full-vocabulary logits, fp32
  cross-entropy on every position, backward, torch's fused AdamW stepping the bf16 weights
  directly (which loses updates below bf16 precision: the reference for speed,
  not for learning);
- ``learner torch``: :meth:`learner.update.PolicyUpdater.update` with the torch engine (fp32
  master weights, decoupled PPO loss on the response tokens, log-probs chunked over the LM head,
  pi_prox read off the training pass), including collation and metrics;
- ``learner torch compiled`` (``--gpu``, or ``--compile``): the same with ``learner.compile=true``
  (each transformer block through ``torch.compile``; its warm-up update compiles);
- ``learner deepspeed ZeRO-2`` (``--gpu`` only): the same with ``learner.engine=deepspeed``,
  bf16 with fp32 masters.

``--profile`` (on with ``--gpu``) runs one more update of the compiled learner (else the eager
one) of each shape under ``torch.profiler`` and keeps, in that row's ``profile``: the update's
wall time, how much of it the device was computing (kernel time over wall time: the rest is the
host launching, syncing or waiting), that kernel time by kind (matrix products, attention,
compiled fusions, eager elementwise and reductions, the optimizer, copies), the costliest
kernels, and where the host waited for the device (``host_syncs``: each ``.item()``-style read is
an ``aten::_local_scalar_dense``; stream and device synchronisations). On a CPU it counts the
operators' own CPU time instead, and a scalar read waits for nothing.

``--variant NAME=KEY=VALUE[,KEY=VALUE]`` (repeatable) adds, per shape, a row of the compiled
(else eager) learner under those config overrides, e.g. ``chunk4k=learner.logits_chunk_tokens=4096``:
settings compared in the same run. ``--gpu`` always adds ``learner.keep_head_logits=true``.

Beside them, the fused LM head alone (``head`` in the JSON): the log-probs of the first shape's
whole batch of response tokens through ``learner.lm_head._LinearLogprobs``, forward and backward,
its elementwise work in eager torch and through ``torch.compile`` (what ``learner.compile`` runs),
and compiled with the forward's logits kept for the backward (``learner.keep_head_logits``): how
much of an update the head is, and what compiling its softmax passes and skipping its recompute save.

MFU = a step's FLOPs / its seconds / the device's dense bf16 peak, the FLOPs counted as the learner
counts them (``learner.stats.flops_metrics``: 6 x parameters x tokens, each token once per epoch
that trains it, a frozen parameter 4 instead of 6), so a ``--variant`` of other epochs or LoRA
reads as ``learner/mfu`` does; the learner's own ``learner/mfu`` metric (its time inside the
update) is reported beside it. Each method: ``warmup`` updates,
then the median of ``repeats`` timed ones (synchronised).

Modes:

- ``--quick`` (default): the ``--gpu`` code path on a CPU with a 2-layer, 256-wide Qwen2-shaped model:
  checks the bench, no MFU (a CPU has no peak here), the learner / plain time ratio only.
- ``--gpu``: a Qwen2-0.5B-shaped model (bf16), batch 64, group 8, 128 + 256 tokens, micro-batch 16
  (the shape of ``vs_trl.py --gpu``), and the 16 x 512 single micro-batch step.

    .venv/bin/python bench/learner.py [--quick|--gpu] [--no-deepspeed] [--[no-]compile] [--[no-]profile] [--variant ...]

Target (H100): learner >= 35% MFU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
# the repository root first: bench/buffer.py must not shadow the `buffer` package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from _common import mode_parser, print_table, profile_once, require_device, sync_device, write_results  # noqa: E402

SHAPES = {
    # name: (batch, group, prompt tokens, response tokens, micro-batch)
    "grpo 64x(128+256) mb16": (64, 8, 128, 256, 16),
    # the same batch in one micro-batch: larger matrix products (full logits may not fit for the plain step)
    "grpo 64x(128+256) mb64": (64, 8, 128, 256, 64),
    "16x512 one micro-batch": (16, 8, 256, 256, 16),
}
MODES: dict[str, dict[str, Any]] = {
    "quick": dict(device="cpu", dtype="float32", warmup=1, repeats=2,
                  shape=dict(num_hidden_layers=2, vocab_size=4096, hidden_size=256, intermediate_size=704,
                             num_attention_heads=4, num_key_value_heads=2),
                  shapes={"grpo 8x(16+144) mb8": (8, 4, 16, 144, 8)}, deepspeed=False, compile=False, profile=False,
                  variants={}),
    "gpu": dict(device="cuda", dtype="bfloat16", shape={}, warmup=2, repeats=5, shapes=SHAPES, deepspeed=True,
                compile=True, profile=True, variants={"kept logits": ("learner.keep_head_logits=true",)}),
}
TARGET_MFU = 0.35


def synthetic_samples(batch: int, group: int, prompt_tokens: int, response_tokens: int, vocab: int, seed: int = 0):
    """``batch`` valid samples with random ids, rewards and behaviour log-probs near a uniform
    policy's (so importance ratios stay near 1 and no token is masked out)."""
    from rlhf_core.records import Sample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(batch):
        g = i // group
        out.append(Sample(
            sample_id=f"g{g}/{i % group}", prompt_id=f"p{g}", group_id=f"g{g}",
            prompt_ids=rng.integers(4, vocab, prompt_tokens, dtype=np.int32),
            response_ids=rng.integers(4, vocab, response_tokens, dtype=np.int32),
            behaviour_logprobs=np.full(response_tokens, -float(np.log(vocab)), dtype=np.float32),
            versions=[[0, response_tokens]], reward=float(rng.random()), finish_reason="length",
            group_size=group, group_index=i % group))
    return out


def timed(fn: Callable[[], Any], warmup: int, repeats: int, device: str) -> tuple[float, Any]:
    """Median seconds of ``repeats`` calls after ``warmup``, and the last call's result."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        sync_device(device)
        t0 = time.perf_counter()
        out = fn()
        sync_device(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, micro: int) -> float:
    """One optimizer step over ``ids`` in micro-batches: full logits, fp32 cross-entropy."""
    total = 0.0
    for i in range(0, ids.shape[0], micro):
        x = ids[i : i + micro]
        logits = model(input_ids=x).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        (loss * x.shape[0] / ids.shape[0]).backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def learner_config(path: Path, spec: dict[str, Any], shape: tuple[int, ...], engine: str, compiled: bool = False,
                   overrides: tuple[str, ...] = ()):
    from e2e import compose

    batch, group, prompt_tokens, response_tokens, micro = shape
    return compose([f"learner.compile={compiled}",
        "model=hf", f"model.path={path}", f"model.dtype={spec['dtype']}", f"model.device={spec['device']}",
        f"learner.batch_size={batch}", f"learner.micro_batch_size={micro}", f"algo.group_size={group}",
        f"rollout.max_new_tokens={response_tokens}", f"rollout.max_prompt_tokens={prompt_tokens}",
        "learner.lr=1e-6", f"learner.engine={engine}", "learner.zero_stage=2", f"learner.bf16={spec['dtype'] == 'bfloat16'}",
        *overrides,
    ])


def learner_update(updater: Any, collate: Callable[[list[Any]], Any], samples: list[Any]) -> dict[str, float]:
    """One update from samples, as the Learner does: collate them, then update."""
    return updater.update(collate(samples), 0)


def release_memory() -> None:
    """Collect what the caller just dropped and hand its cached GPU memory back, so the next
    method's peak memory is its own."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(spec: dict[str, Any], path: Path, name: str, shape: tuple[int, ...], use_deepspeed: bool,
            use_compile: bool, use_profile: bool = False,
            variants: dict[str, tuple[str, ...]] | None = None) -> list[dict[str, Any]]:
    from learner.batch import Collator
    from learner.engine_factory import make_engine
    from learner.stats import flops_metrics, peak_flops
    from learner.update import PolicyUpdater
    from rlhf_core import metric_names as M
    from rlhf_core.models import load_policy

    batch, group, prompt_tokens, response_tokens, micro = shape
    device, warmup, repeats = spec["device"], spec["warmup"], spec["repeats"]
    peak = peak_flops(torch.device(device), None)
    rows = []

    def row(method: str, seconds: float, flops: float, tokens: int, learner_mfu: float | None = None) -> dict[str, Any]:
        """``flops``: one step's, so that the row's TFLOP/s and MFU are at the bench's median time."""
        achieved = flops / seconds
        return {"shape": name, "method": method, "tokens": tokens, "step_s": seconds,
                "tflops": achieved / 1e12, "mfu": achieved / peak if peak else None, "learner_metric_mfu": learner_mfu,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}

    def update_flops(metrics: dict[str, Any]) -> float:
        """An update's FLOPs as the learner counts them (``flops_metrics``: each token once per epoch
        that trains it, frozen parameters without their weight gradient): its TFLOP/s x its time."""
        return metrics[M.TRAIN_TFLOPS] * 1e12 * metrics[M.TIME_COMPUTE_S]

    # plain torch
    cfg = learner_config(path, spec, shape, "torch")
    model = load_policy(cfg.model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    samples = synthetic_samples(batch, group, prompt_tokens, response_tokens, int(model.config.vocab_size))
    ids = torch.tensor(np.stack([np.concatenate([s.prompt_ids, s.response_ids]) for s in samples]), dtype=torch.long,
                       device=device)
    params = sum(p.numel() for p in model.parameters())
    plain_flops = flops_metrics(params, ids.numel(), 1.0, None)[M.TRAIN_TFLOPS] * 1e12  # one epoch, every weight trains
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    plain_label = "plain torch (bf16 weights, full logits)" if spec["dtype"] == "bfloat16" else "plain torch"
    try:
        seconds, _ = timed(partial(plain_step, model, opt, ids, micro), warmup, repeats, device)
        rows.append(row(plain_label, seconds, plain_flops, ids.numel()))
    except torch.OutOfMemoryError as exc:  # full-vocabulary logits of a large micro-batch
        print(f"{plain_label} failed: out of memory")
        rows.append({**row(plain_label, float("nan"), plain_flops, ids.numel()), "error": f"OutOfMemoryError: {exc}"[:300]})
    del model, opt
    release_memory()

    labels = {"torch": "learner torch (fp32 masters)", "compiled": "learner torch compiled (learner.compile=true)",
              "deepspeed": "learner deepspeed ZeRO-2 (bf16)"}
    engines = ["torch"] + (["compiled"] if use_compile else []) + (["deepspeed"] if use_deepspeed else [])
    profiled = "compiled" if use_compile else "torch"  # the learner as a GPU run uses it
    overrides: dict[str, tuple[str, ...]] = dict.fromkeys(engines, ())
    for variant, extra in (variants or {}).items():  # --variant: one more row of that learner
        engines.append(key := f"{profiled} {variant}")
        labels[key], overrides[key] = f"{labels[profiled].split(' (')[0]} + {variant} ({' '.join(extra)})", extra
    for engine_name in engines:
        label = labels[engine_name]
        cfg = learner_config(path, spec, shape, "deepspeed" if engine_name == "deepspeed" else "torch",
                             compiled=engine_name.startswith("compiled"), overrides=overrides[engine_name])
        try:
            engine = make_engine(cfg, load_policy(cfg.model))
            updater = PolicyUpdater(cfg, engine)
            update = partial(learner_update, updater, Collator.for_model(engine.module, updater.device), samples)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            # the same version each time: it only seeds the minibatch order and the staleness metrics
            seconds, metrics = timed(update, warmup, repeats, device)
        except Exception as exc:  # noqa: BLE001 - DeepSpeed's start can fail on a machine; keep the other rows
            if engine_name == "torch":
                raise
            print(f"{label} failed: {type(exc).__name__}: {exc}")
            rows.append({**row(label, float("nan"), plain_flops, ids.numel()), "error": f"{type(exc).__name__}: {exc}"})
            continue
        rows.append(row(label, seconds, update_flops(metrics), ids.numel(), metrics.get(M.MFU)))
        if use_profile and engine_name == profiled:
            rows[-1]["profile"] = profile_once(update, device)
        del engine, updater, update
        release_memory()
    return rows


def head_rows(spec: dict[str, Any], path: Path, shape: tuple[int, ...]) -> list[dict[str, Any]]:
    """The fused LM head alone, forward and backward over ``batch x response_tokens`` hidden states
    at the model's width and vocabulary (chunked as the learner chunks), eager and compiled."""
    from transformers import AutoConfig

    from learner.lm_head import _head_math, _LinearLogprobs
    from rlhf_core.config import LearnerConfig

    config = AutoConfig.from_pretrained(path)
    batch, _, _, response_tokens, _ = shape
    n, device, dtype = batch * response_tokens, spec["device"], getattr(torch, spec["dtype"])
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, config.hidden_size, device=device, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(config.vocab_size, config.hidden_size, device=device, generator=gen) * 0.02).to(dtype).requires_grad_()
    ids = torch.randint(0, config.vocab_size, (n,), device=device, generator=gen)
    chunk = LearnerConfig().logits_chunk_tokens

    def step(hidden: torch.Tensor, weight: torch.Tensor, compiled: bool, keep: bool) -> None:
        hidden.grad = weight.grad = None
        logp, _ = _LinearLogprobs.apply(hidden, weight, ids, 1.0, chunk, True, _head_math(compiled), keep)
        logp.sum().backward()

    rows = []
    for compiled, keep in ((False, False), (True, False), (True, True)):
        seconds, _ = timed(partial(step, hidden, weight, compiled, keep), spec["warmup"], spec["repeats"], device)
        rows.append({"math": ("compiled" if compiled else "eager") + (", logits kept" if keep else ""), "tokens": n,
                     "vocab": config.vocab_size, "hidden": config.hidden_size, "chunk": chunk,
                     "fwd_bwd_ms": seconds * 1e3})
    del hidden, weight
    release_memory()
    return rows


def main() -> None:
    ap = mode_parser(__doc__, MODES)
    ap.add_argument("--no-deepspeed", action="store_true", help="leave the DeepSpeed row out")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="the learner.compile=true row (default: on with --gpu; its warm-up update compiles)")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                    help="profile one more update of the compiled (else eager) learner row (default: on with --gpu)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=OVERRIDE[,OVERRIDE]",
                    help="one more learner row per shape under these config overrides, e.g. "
                         "chunk4k=learner.logits_chunk_tokens=4096 (repeatable)")
    ap.add_argument("--cache-dir", default=os.environ.get("RLHF_TEST_CACHE") or os.path.join(tempfile.gettempdir(), "rlhf-bench-cache"))
    args = ap.parse_args()
    spec = dict(MODES[args.mode])
    require_device(spec["device"], "--quick")
    if spec["device"] == "cpu":
        torch.set_num_threads(1)
    use_deepspeed = spec["deepspeed"] and not args.no_deepspeed
    variants = dict(spec.pop("variants"))
    for v in args.variant:
        name, sep, extra = v.partition("=")
        if not sep or not name or "=" not in extra:
            ap.error(f"--variant {v!r}: expected NAME=KEY=VALUE[,KEY=VALUE], e.g. chunk4k=learner.logits_chunk_tokens=4096")
        variants[name] = tuple(extra.split(","))
    spec["compile"] = use_compile = spec["compile"] if args.compile is None else args.compile
    spec["profile"] = use_profile = spec["profile"] if args.profile is None else args.profile
    if use_deepspeed:
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            print("DeepSpeed is not installed: its row is left out (pip install -e '.[train]')")
            use_deepspeed = False
    from _models import qwen2_05b_dir

    torch.manual_seed(0)
    path = qwen2_05b_dir(args.cache_dir, dtype=spec["dtype"], **spec["shape"])
    rows = [r for name, shape in spec["shapes"].items() for r in measure(spec, path, name, shape, use_deepspeed, use_compile, use_profile,
                                                                        variants)]
    device_name = torch.cuda.get_device_name(0) if spec["device"] == "cuda" else "cpu"
    print_table([{k: v for k, v in r.items() if k != "profile"} for r in rows],
                f"learner update vs a plain torch step, {path.name} on {device_name}")
    for r in (r for r in rows if "busy_ms" in r.get("profile", {})):
        prof = r["profile"]
        print(f"profile, {r['method']}, {r['shape']}: {prof['busy_ms']:.1f} of {prof['wall_ms']:.1f} ms "
              f"({prof['busy_fraction']:.0%}) in {prof['counted']}: "
              + ", ".join(f"{kind} {ms:.1f}" for kind, ms in prof["by_kind_ms"].items())
              + "; host waits: " + (", ".join(f"{name} x{w['calls']} ({w['ms']:.1f} ms)" for name, w in prof["host_syncs"].items())
                                    or "none"))
    ratios = {}
    for name in spec["shapes"]:
        mine = {r["method"].split(" (")[0]: r for r in rows if r["shape"] == name}
        ratios[name] = {m: mine["plain torch"]["step_s"] / r["step_s"] for m, r in mine.items() if m != "plain torch"}
        print(f"{name}: speed over plain torch " + ", ".join(f"{m} {v:.2f}x" for m, v in ratios[name].items()))
    head = head_rows(spec, path, next(iter(spec["shapes"].values())))
    print_table(head, "the fused LM head alone, forward + backward (entropy as a statistic)")
    head_ratio = head[0]["fwd_bwd_ms"] / head[1]["fwd_bwd_ms"]
    print(f"fused head: compiled {head_ratio:.2f}x eager, logits kept {head[1]['fwd_bwd_ms'] / head[2]['fwd_bwd_ms']:.2f}x compiled")
    best = max((r["mfu"] for r in rows if r["mfu"] is not None and r["method"].startswith("learner")), default=None)
    if best is not None:
        print(f"best learner MFU {best:.1%} (target >= {TARGET_MFU:.0%})")
    write_results("learner" if args.mode == "quick" else f"learner_{args.mode}", {
        "mode": args.mode, "device": device_name,
        "config": {**{k: v for k, v in spec.items() if k != "shapes"}, "variants": variants,
                   "shapes": {k: dict(zip(("batch", "group", "prompt_tokens", "response_tokens", "micro_batch"), v))
                              for k, v in spec["shapes"].items()}, "model": path.name},
        "results": rows, "speed_over_plain": ratios, "best_learner_mfu": best, "target_mfu": TARGET_MFU,
        "head": head, "head_compiled_over_eager": head_ratio,
        "notes": "MFU = 6 x params x tokens / median step time / dense bf16 peak (989 TFLOP/s for an H100); "
                 "tokens = every position of the batch (prompt and response), once per epoch that trains it, and a "
                 "frozen parameter counts 4 (learner.stats.flops_metrics); the learner's loss covers response tokens",
    })


if __name__ == "__main__":
    main()
