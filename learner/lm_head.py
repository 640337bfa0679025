"""A batch through a model, to per-token outputs at the response positions: the policy's
log-probs of the response tokens (and their entropies) under the rollout's sampling settings,
and a critic's values.

:func:`response_logprobs` picks the way: full ``[B, T, V]`` logits for short micro-batches;
beyond ``learner.logits_chunk_tokens`` response tokens the LM head runs chunk by chunk, through
:class:`_LinearLogprobs` (a written-out backward) where the head is a plain linear layer and the
logits need no processing but a temperature, else through activation-checkpointed autograd.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from learner.batch import TrainBatch
from rlhf_core.sampling import process_logits, token_logprobs


def no_filtering(rollout: Any) -> bool:
    """Sampling without top-k or top-p (any temperature > 0): every token keeps a finite log-prob."""
    return rollout.temperature > 0 and not (rollout.top_k or 0) > 0 and (rollout.top_p is None or rollout.top_p >= 1.0)


def response_logprobs(
    forward: Callable[..., Any], model: torch.nn.Module, batch: TrainBatch, sampling: Any, *, chunk_tokens: int,
    entropy: bool, entropy_grad: bool, compiled: bool = False, keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, T]`` log-probs of the response under the sampling settings ``sampling`` (``temperature``,
    ``top_k``, ``top_p``: the rollout's), and with ``entropy`` its per-token entropy (same
    processed logits; differentiable with ``entropy_grad``, otherwise a detached statistic that
    keeps no graph). ``forward`` runs ``model`` (an engine's forward, or the module itself)."""
    parts = lm_parts(model) if batch.response_ids.numel() > chunk_tokens else None
    weight = fused_head(parts[1]) if parts is not None else None
    if parts is not None and weight is not None and not (entropy and entropy_grad) and no_filtering(sampling):
        # the common case (plain head, no top-k/top-p, entropy only a statistic): a written-out backward
        return fused_response_logprobs(parts[0], weight, batch, sampling.temperature, chunk_tokens, entropy,
                                       compiled=compiled, keep_logits=keep_logits)
    process = lambda x: process_logits(x, sampling.temperature, sampling.top_k, sampling.top_p)  # noqa: E731
    if parts is not None:  # long responses x a large vocabulary: never all the logits at once
        logp, ent = chunked_response_logprobs(*parts, batch, process, chunk_tokens,
                                              entropy_from_logits if entropy else None)
        return logp, (ent if ent is None or entropy_grad else ent.detach())
    processed = process(response_logits(forward, batch))
    logp = token_logprobs(processed, batch.response_ids)
    if not entropy:
        return logp, None
    if entropy_grad:
        return logp, entropy_from_logits(processed)
    with torch.no_grad():
        return logp, entropy_from_logits(processed.detach())


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` entropy in nats, ``H = -sum_v p_v log p_v`` of ``softmax(logits [B, T, V])``;
    logsumexp-stable, and vocabulary entries with logit ``-inf`` contribute 0 (and no NaN gradient)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp = F.log_softmax(logits, dim=-1)
    p = torch.exp(logp)
    safe_logp = torch.where(p > 0, logp, torch.zeros_like(logp))
    return -(p * safe_logp).sum(-1)


def gather_response(per_position: torch.Tensor, batch: TrainBatch, offset: int = 0) -> torch.Tensor:
    """Pick the outputs that predict the response tokens.

    Args:
        per_position: ``[B, L', ...]`` model outputs for positions ``offset .. offset + L' - 1``.
        batch: the batch the outputs belong to.
        offset: position of ``per_position[:, 0]`` in ``input_ids`` (non-zero with ``logits_to_keep``).

    Returns:
        ``[B, T, ...]`` where ``[:, t]`` is the output at position ``response_start - 1 + t``
        (clamped inside the sequence for padding positions, which the masks exclude).
    """
    T = batch.response_ids.shape[1]
    pos = batch.response_start[:, None] - 1 + torch.arange(T, device=per_position.device)[None, :]
    idx = (pos - offset).clamp(0, per_position.shape[1] - 1)
    if per_position.dim() == 2:
        return per_position.gather(1, idx)
    idx = idx.reshape(*idx.shape, *([1] * (per_position.dim() - 2))).expand(-1, -1, *per_position.shape[2:])
    return per_position.gather(1, idx)


def policy_inputs(batch: TrainBatch) -> dict[str, Any]:
    """A causal LM's forward arguments for ``batch``, with no attention mask: rows are right-padded
    and causal attention never looks right of a position, so every real token's output is what
    the padding mask would give (outputs at padding positions differ; every loss masks them).
    Without a mask the model builds none (nor checks, a host sync, whether any row is padded)
    and SDPA can take its causal flash kernel. Not for a critic or reward model that may not be
    causal: :func:`response_values` keeps the mask."""
    return {"input_ids": batch.input_ids, "attention_mask": None, "use_cache": False}


def response_logits(forward: Callable[..., Any], batch: TrainBatch, use_logits_to_keep: bool = True) -> torch.Tensor:
    """``[B, T, V]`` logits predicting the response tokens, from one forward pass.

    With ``use_logits_to_keep`` the LM head runs only from the first position any row needs
    (the shortest prompt's last token) to the end, which skips most prompt positions; models
    whose forward has no ``logits_to_keep`` argument fall back to full logits.
    """
    L = batch.input_ids.shape[1]
    first = int(batch.response_start.min()) - 1
    kwargs = policy_inputs(batch)
    if use_logits_to_keep and first > 0:
        try:
            out = forward(**kwargs, logits_to_keep=L - first)
        except TypeError as exc:
            if "logits_to_keep" not in str(exc):
                raise
        else:
            # The returned positions are the last ones; a model that swallows the argument in
            # **kwargs and returns every position is handled by the same offset arithmetic.
            return gather_response(out.logits, batch, offset=L - out.logits.shape[1])
    out = forward(**kwargs)
    return gather_response(out.logits, batch)


def response_values(forward: Callable[..., Any], batch: TrainBatch) -> torch.Tensor:
    """``[B, T]`` critic values (token-classification head, one label) for the state before
    each response token: the same positions as :func:`response_logits`."""
    out = forward(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    logits = out.logits
    if logits.dim() == 3:
        logits = logits[..., 0]
    return gather_response(logits.float(), batch)


def lm_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(decoder body, LM head) of a transformers causal LM whose logits are exactly
    ``head(body(...).last_hidden_state)``; None when that is not known to hold (logit scaling or
    soft-capping after the head, or no such attributes), and the caller keeps full logits."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    body = getattr(model, getattr(model, "base_model_prefix", ""), None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    linear = isinstance(head, torch.nn.Linear) or isinstance(getattr(head, "base_layer", None), torch.nn.Linear)
    # base_layer: a LoRA-adapted head (a module around the Linear)
    if not isinstance(body, torch.nn.Module) or body is model or not linear or not isinstance(head, torch.nn.Module):
        return None
    return body, head


class _LinearLogprobs(torch.autograd.Function):
    """Log-probs of ``ids`` under ``softmax(hidden @ weight.T / temperature)``, ``chunk`` rows at a
    time, with the backward written out so no chunk's logits outlive it.

    Per chunk, forward and backward alike start from the head's matmul ``z`` (the weight's dtype
    in and out) and hand it to a :class:`_HeadMath`: the forward takes the log-probs of the
    sampled tokens (and, as a statistic without gradient, the entropies) and keeps only those
    ``[N]`` results and its inputs; the backward computes ``z`` again, turns it into
    ``dz = d(sum g * logp) / dz = g * (onehot - p) / temperature`` in the weight's dtype, then
    ``grad_hidden = dz @ W`` and ``grad_W += dz.T @ h`` (accumulated in the weight's dtype, as
    micro-batches accumulate). By count, on a GPU the elementwise passes over ``[chunk, V]``
    outweigh the matmuls: the four matmuls do ``8 x width`` FLOP a logit (7,168 at width 896),
    the passes moved about 58 bytes a logit before :class:`_HeadMath` (26 forward, 32 backward),
    and an H100 does about 300 FLOP in the time it moves a byte. ``bench/learner.py`` times the head
    alone (its ``head`` rows). ``keep_logits`` (``learner.keep_head_logits``) keeps each chunk's
    ``z`` from the forward for the backward instead: one matmul of four less, at ``N x V`` logits of
    the weight's dtype held between the passes (5 GB for 64 x 256 bf16 tokens at Qwen2's vocabulary).
    """

    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature, chunk, with_entropy, math, keep_logits=False):  # noqa: ANN001
        logp = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        ent = torch.zeros_like(logp)
        kept = []
        for i in range(0, hidden.shape[0], chunk):
            z = hidden[i : i + chunk].to(weight.dtype) @ weight.t()
            lp, e = math.stats(z, ids[i : i + chunk], temperature, with_entropy)
            logp[i : i + chunk] = lp
            if with_entropy:
                ent[i : i + chunk] = e
            if keep_logits:
                kept.append(z)
            del z
        ctx.save_for_backward(hidden, weight, ids, logp)
        ctx.temperature, ctx.chunk, ctx.math, ctx.kept = temperature, chunk, math, kept
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):  # noqa: ANN001
        hidden, weight, ids, logp = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for k, i in enumerate(range(0, hidden.shape[0], ctx.chunk)):
            h, rows = hidden[i : i + ctx.chunk].to(weight.dtype), slice(i, i + ctx.chunk)
            if ctx.kept:
                z, ctx.kept[k] = ctx.kept[k], None  # freed as soon as its gradient is made
            else:
                z = h @ weight.t()
            dz = ctx.math.grad(z, ids[rows], grad_logp[rows].float(), logp[rows], ctx.temperature)
            del z
            if grad_hidden is not None:
                grad_hidden[rows] = dz @ weight
            if grad_weight is not None:
                grad_weight.addmm_(dz.t(), h)
            del dz
        return grad_hidden, grad_weight, None, None, None, None, None, None


class _HeadMath:
    """The fused head's elementwise work on a chunk's logits ``z [n, V]``, in eager torch.

    ``stats``: the fp32 log-softmax read straight from ``z`` (at temperature 1 a low-precision
    matmul's output is not copied to fp32 first), the sampled tokens' log-probs gathered from it, and the entropy
    ``H = -sum_v p_v log p_v`` when asked. ``grad``: ``p = softmax(z)`` in fp32 scaled in place
    by ``-g / T``, the sampled token's entry set to ``g / T * (1 - p) = -g / T * expm1(logp)``
    from the forward's fp32 log-prob (precise where ``p`` is near 1), then cast to the weight's
    dtype: its passes over ``[n, V]`` move about 22 bytes an entry with a bf16 head (a
    log-softmax, ``exp``, scaling and cast moved about 32), the forward's about 26.
    """

    @staticmethod
    def stats(z: torch.Tensor, ids: torch.Tensor, temperature: float, with_entropy: bool):
        # not in place: an fp32 z is its own .float(), and the backward may read it again (keep_logits)
        y = torch.log_softmax(z if temperature == 1.0 else z.float() / temperature, dim=-1, dtype=torch.float32)
        logp = y.gather(-1, ids[:, None]).squeeze(-1)
        return logp, (-(y.exp().unsqueeze(1) @ y.unsqueeze(2)).view(-1) if with_entropy else None)

    @staticmethod
    def grad(z: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, logp: torch.Tensor, temperature: float) -> torch.Tensor:
        coef = g.div(-temperature)[:, None]  # -g / T
        p = torch.softmax(z if temperature == 1.0 else z.float().div_(temperature), dim=-1, dtype=torch.float32)
        return p.mul_(coef).scatter_(-1, ids[:, None], coef * torch.expm1(logp)[:, None]).to(z.dtype)


class _CompiledHeadMath:
    """:class:`_HeadMath` as expressions ``torch.compile`` fuses (``learner.compile``): ``stats``
    reads ``z`` for the log-sum-exp, the sampled logits and the entropy (``sum_v p_v (lse - z_v)``)
    and writes ``[n]`` results; ``grad`` reads ``z`` (and the forward's log-sum-exp, recovered as
    ``z_id - logp``) and writes ``dz`` in the weight's dtype, the sampled token's entry
    ``p - 1`` in fp32 inside the kernel: a few bytes an entry with a bf16 head, against the
    eager one's 26 and 22. Same numbers to float rounding (``tests/unit/test_learner_batch.py``)."""

    @staticmethod
    def _stats(z, ids, temperature: float, with_entropy: bool):  # noqa: ANN001
        x = z.float() / temperature
        lse = torch.logsumexp(x, dim=-1)
        logp = x.gather(-1, ids[:, None]).squeeze(-1) - lse
        if not with_entropy:
            return logp, None
        neg_logp = lse[:, None] - x  # H = sum_v p_v (lse - x_v): non-negative terms, no cancellation at the end
        return logp, (torch.exp(-neg_logp) * neg_logp).sum(-1)

    @staticmethod
    def _grad(z, ids, g, logp, temperature: float):  # noqa: ANN001
        x = z.float() / temperature
        lse = x.gather(-1, ids[:, None]) - logp[:, None]
        p = torch.exp(x - lse)
        onehot = torch.arange(z.shape[-1], device=z.device)[None, :] == ids[:, None]
        return (torch.where(onehot, p - 1.0, p) * (g.div(-temperature)[:, None])).to(z.dtype)

    def __init__(self) -> None:
        self.stats = torch.compile(self._stats, dynamic=True)
        self.grad = torch.compile(self._grad, dynamic=True)


@functools.cache
def _compiled_head_math() -> _CompiledHeadMath:
    return _CompiledHeadMath()  # made once, at the first compiled use


def _head_math(compiled: bool) -> type[_HeadMath] | _CompiledHeadMath:
    return _compiled_head_math() if compiled else _HeadMath


def fused_head(head: torch.nn.Module) -> torch.Tensor | None:
    """The weight of an LM head :class:`_LinearLogprobs` can run: a plain bias-free
    ``nn.Linear`` whose weight is really there (not a LoRA layer, not a ZeRO-3 placeholder)."""
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    weight = head.weight
    if hasattr(weight, "ds_id") or weight.numel() != head.in_features * head.out_features:
        return None
    return weight


def fused_response_logprobs(
    body: torch.nn.Module, weight: torch.Tensor, batch: TrainBatch, temperature: float, chunk_tokens: int,
    with_entropy: bool, compiled: bool = False, keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, T]`` log-probs of the response tokens at ``temperature`` (no top-k/top-p), and their
    entropies (no gradient) when asked, through :class:`_LinearLogprobs`: what
    :func:`chunked_response_logprobs` computes for that case, with fewer passes over the logits.
    ``compiled``: its elementwise work through ``torch.compile`` (:class:`_CompiledHeadMath`);
    ``keep_logits``: the forward's logits kept for the backward (:class:`_LinearLogprobs`), when
    there is a backward: a no-grad pass holds one chunk's logits at a time either way."""
    hidden = body(**policy_inputs(batch)).last_hidden_state
    h = gather_response(hidden, batch)  # [B, T, H]
    B, T = batch.response_ids.shape
    logp, ent = _LinearLogprobs.apply(h.reshape(B * T, -1), weight, batch.response_ids.reshape(B * T).long(),
                                      float(temperature), int(chunk_tokens), bool(with_entropy), _head_math(compiled),
                                      bool(keep_logits and torch.is_grad_enabled()))
    return logp.reshape(B, T), (ent.reshape(B, T) if with_entropy else None)


def chunked_response_logprobs(
    body: torch.nn.Module, head: torch.nn.Module, batch: TrainBatch, process: Callable[[torch.Tensor], torch.Tensor],
    chunk_tokens: int, entropy_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, T]`` log-probs of the response tokens (and entropies with ``entropy_fn``) without
    materialising ``[B, T, V]`` logits: the body runs once, then the LM head, ``process`` (the
    sampling's logit processing) and the log-softmax gather run over ``chunk_tokens`` response
    positions at a time, each chunk under activation checkpointing, so backward keeps only the
    ``[B, T, H]`` hidden states and recomputes one chunk's logits at a time. At vocab 151k,
    16 x 512 tokens of fp32 logits are 5 GB; a chunk of 1024 is 0.6 GB.
    """
    from torch.utils.checkpoint import checkpoint

    hidden = body(**policy_inputs(batch)).last_hidden_state
    h = gather_response(hidden, batch)  # [B, T, H]
    B, T = batch.response_ids.shape
    flat_h, flat_ids = h.reshape(B * T, -1), batch.response_ids.reshape(B * T)

    def chunk(hc: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        processed = process(head(hc))
        logp = token_logprobs(processed, ids)
        ent = entropy_fn(processed) if entropy_fn is not None else torch.zeros_like(logp)
        return logp, ent

    parts = [checkpoint(chunk, flat_h[i : i + chunk_tokens], flat_ids[i : i + chunk_tokens], use_reentrant=False)
             if torch.is_grad_enabled() else chunk(flat_h[i : i + chunk_tokens], flat_ids[i : i + chunk_tokens])
             for i in range(0, B * T, chunk_tokens)]
    logp = torch.cat([p[0] for p in parts]).reshape(B, T)
    ent = torch.cat([p[1] for p in parts]).reshape(B, T) if entropy_fn is not None else None
    return logp, ent
