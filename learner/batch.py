"""Batch assembly: samples -> right-padded tensors, micro-batches, and the logits alignment.

Layout of a :class:`TrainBatch` of ``B`` samples (``L`` = longest prompt + response,
``T`` = longest response):

* ``input_ids [B, L]``: prompt then response, right-padded with ``pad_id``. Right padding
  keeps every real token at its unpadded position, so the default ``position_ids`` of a
  causal LM are right without passing them.
* Per-token tensors ``[B, T]`` cover the response only: token ``t`` of row ``b`` is
  ``input_ids[b, response_start[b] + t]`` and is predicted by the logits at position
  ``response_start[b] - 1 + t`` (see :func:`gather_response`).
* Samples of one group (one prompt) are contiguous, groups in order of their ids and samples
  in order of their index in the group, whatever order they arrived in (that depends on the
  workers' timing): an update does not depend on it, so a synchronous run with fixed seeds
  repeats itself. ``group_sizes [G]`` may hold fewer than ``algo.group_size`` when a sample was
  dead-lettered.
* ``response_mask`` marks every real response token (the forward pass, the alignment);
  ``policy_mask`` the ones the policy sampled: ``response_mask`` AND the sample's ``loss_mask``
  (a multi-turn episode's observations and template tokens are 0 there). Every loss, KL,
  entropy, advantage and statistic of the policy reduces over ``policy_mask`` (or a mask derived
  from it), never over ``response_mask``.

``token_extras`` / ``row_extras`` carry tensors computed later (proximal log-probs,
advantages, ...) so that :meth:`TrainBatch.select` slices them with the batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from rlhf_core.errors import UserError
from rlhf_core.records import Sample
from rlhf_core.sampling import token_logprobs


class BatchError(UserError, ValueError):
    """Samples that cannot form a training batch (wrong tokenizer, broken groups). Says what to fix."""


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, L] int64
    attention_mask: torch.Tensor  # [B, L] int64, 1 = real token
    response_start: torch.Tensor  # [B] int64, index in input_ids of the first response token (= prompt length)
    response_ids: torch.Tensor  # [B, T] int64, pad_id after the response
    response_mask: torch.Tensor  # [B, T] bool: real response tokens
    policy_mask: torch.Tensor  # [B, T] bool: response tokens the policy sampled (response_mask & loss_mask)
    behaviour_logprobs: torch.Tensor  # [B, T] float32, 0 at padding
    ref_logprobs: torch.Tensor | None  # [B, T] float32 when every sample carried them, else None
    token_versions: torch.Tensor  # [B, T] int64, -1 at padding
    rewards: torch.Tensor  # [B] float32
    group_index: torch.Tensor  # [B] int64, 0..G-1, contiguous
    group_sizes: torch.Tensor  # [G] int64
    truncated: torch.Tensor  # [B] bool: finish_reason == "length"
    sample_ids: list[str]
    pad_id: int
    token_extras: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [B, T]
    row_extras: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [B]

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_groups(self) -> int:
        return int(self.group_sizes.shape[0])

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` prompt + response tokens per row."""
        return self.attention_mask.sum(-1)

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)

    @property
    def policy_lengths(self) -> torch.Tensor:
        """``[B]`` tokens the policy sampled per row."""
        return self.policy_mask.sum(-1)

    def select(self, rows: Sequence[int] | torch.Tensor, drop: Sequence[bool] | None = None) -> "TrainBatch":
        """The rows ``rows`` (in that order), trimmed to their own longest ``L`` and ``T``.

        ``drop[i]`` True blanks the response mask of output row ``i``: a filler row that runs
        through the forward pass (every data-parallel rank must make the same calls) but
        contributes nothing to any loss or statistic. Group structure is not kept (a
        selection is for forward/backward passes, after group-relative advantages exist).
        """
        idx = torch.as_tensor(list(rows) if not isinstance(rows, torch.Tensor) else rows, dtype=torch.long)
        idx = idx.to(self.input_ids.device)
        attn = self.attention_mask[idx]
        resp_mask = self.response_mask[idx]
        policy = self.policy_mask[idx]
        L = max(int(attn.sum(-1).max()), 1) if idx.numel() else 1
        T = max(int(resp_mask.sum(-1).max()), 1) if idx.numel() else 1
        if drop is not None:
            keep = torch.tensor([not d for d in drop], dtype=torch.bool, device=resp_mask.device)
            resp_mask = resp_mask & keep[:, None]
            policy = policy & keep[:, None]
        tok = lambda x: x[idx][:, :T]  # noqa: E731
        return TrainBatch(
            input_ids=self.input_ids[idx][:, :L],
            attention_mask=attn[:, :L],
            response_start=self.response_start[idx],
            response_ids=tok(self.response_ids),
            response_mask=resp_mask[:, :T],
            policy_mask=policy[:, :T],
            behaviour_logprobs=tok(self.behaviour_logprobs),
            ref_logprobs=None if self.ref_logprobs is None else tok(self.ref_logprobs),
            token_versions=tok(self.token_versions),
            rewards=self.rewards[idx],
            group_index=self.group_index[idx],
            group_sizes=self.group_sizes,
            truncated=self.truncated[idx],
            sample_ids=[self.sample_ids[i] for i in idx.tolist()],
            pad_id=self.pad_id,
            token_extras={k: tok(v) for k, v in self.token_extras.items()},
            row_extras={k: v[idx] for k, v in self.row_extras.items()},
        )

    def with_extras(self, **token_extras: torch.Tensor) -> "TrainBatch":
        return replace(self, token_extras={**self.token_extras, **token_extras})


def _group_order(samples: Sequence[Sample]) -> tuple[list[int], list[int]]:
    """Sample indices reordered so each group is contiguous (groups in order of their ids, samples
    by their index in the group), and the size of each group."""
    groups: dict[str, list[int]] = {}
    for i in sorted(range(len(samples)), key=lambda i: (samples[i].group_id, samples[i].group_index)):
        groups.setdefault(samples[i].group_id, []).append(i)
    for gid, members in groups.items():
        declared = samples[members[0]].group_size
        if len(members) > declared:
            raise BatchError(
                f"group {gid!r} has {len(members)} samples in this batch but its samples say group_size "
                f"{declared}; a group's samples were delivered twice or two prompts share a group id"
            )
    order = [i for members in groups.values() for i in members]
    return order, [len(m) for m in groups.values()]


def check_vocab(samples: Sequence[Sample], vocab_size: int) -> None:
    """Raise :class:`BatchError` if any token id lies outside ``[0, vocab_size)``."""
    lo, hi = 0, -1
    for s in samples:
        for ids in (s.prompt_ids, s.response_ids):
            if ids.size:
                lo, hi = min(lo, int(ids.min())), max(hi, int(ids.max()))
    if lo < 0 or hi >= vocab_size:
        raise BatchError(
            f"samples hold token ids outside the learner's vocabulary [0, {vocab_size}) (min {lo}, max {hi}): "
            f"do the workers and the learner use the same tokenizer? worker vocab > {hi}, learner vocab "
            f"{vocab_size}. Point model.tokenizer_path / model.path of both at the same model"
        )


def stop_token_misfits(samples: Sequence[Sample], eos_ids: frozenset[int] | set[int]) -> list[tuple[int, str]]:
    """``(index, why)`` of the samples that contradict the learner's end-of-sequence ids.

    A worker stops a response at its first end-of-sequence token, so (without stop strings)
    a ``"stop"`` response ends on one of ``eos_ids`` and no response holds one before its last
    token. A worker whose tokenizer has other special tokens breaks one of the two. Multi-turn
    episodes (samples with a ``loss_mask``) are not checked: each turn may end on one, the chat
    template writes others between turns, and an episode stops when its environment says so.
    """
    single = [i for i, s in enumerate(samples) if s.loss_mask is None]
    if len(single) < len(samples):
        return [(single[i], why) for i, why in stop_token_misfits([samples[i] for i in single], eos_ids)]
    eos = np.fromiter(sorted(eos_ids), dtype=np.int64)
    if not eos.size or not samples:
        return []
    # the common case in one vectorised pass: no EOS inside a response, every "stop" ends on one
    is_eos = np.isin(np.concatenate([s.response_ids for s in samples]), eos)
    last = np.cumsum([len(s.response_ids) for s in samples]) - 1
    stopped = np.asarray([s.finish_reason == "stop" for s in samples])
    if is_eos.sum() == is_eos[last].sum() and is_eos[last][stopped].all():
        return []
    out = []
    for i, s in enumerate(samples):
        r = s.response_ids
        inside = np.flatnonzero(np.isin(r[:-1], eos))
        if s.finish_reason == "stop" and int(r[-1]) not in eos_ids:
            out.append((i, f"finished with 'stop' on token {int(r[-1])}, which is not one of them"))
        elif inside.size:
            out.append((i, f"holds token {int(r[inside[0]])} at position {int(inside[0])}, where generation should "
                           "have stopped"))
    return out


def stop_token_message(sample: Sample, eos_ids: frozenset[int] | set[int], why: str) -> str:
    return (f"sample {sample.sample_id!r} from worker {sample.worker_id or '?'} does not fit the learner's "
            f"end-of-sequence token ids {sorted(eos_ids)}: it {why}")


def check_stop_tokens(samples: Sequence[Sample], eos_ids: frozenset[int] | set[int]) -> None:
    """Raise :class:`BatchError` if any sample contradicts the learner's end-of-sequence ids
    (see :func:`stop_token_misfits`): a tokenizer mismatch between workers and learner."""
    misfits = stop_token_misfits(samples, eos_ids)
    if misfits:
        i, why = misfits[0]
        raise BatchError(
            f"{stop_token_message(samples[i], eos_ids, why)}. The workers use a tokenizer with other special "
            "tokens than the learner's: point model.path / model.tokenizer_path of workers and learner at the same "
            "tokenizer, and start a new run (buffer.run_id): this batch stays in the buffer. (With "
            "rollout.stop_strings set a response may also stop on other tokens, and this check is off)"
        )


def collate(
    samples: Sequence[Sample],
    pad_id: int,
    device: torch.device | str = "cpu",
    vocab_size: int | None = None,
) -> TrainBatch:
    """Assemble samples into a right-padded :class:`TrainBatch` (see the module docstring).

    Args:
        samples: decoded samples; groups may be partial and need not arrive contiguous.
        pad_id: id written into padding (never read: masks exclude it).
        device: where the tensors go.
        vocab_size: the learner model's vocabulary; when given, out-of-range ids raise
            :class:`BatchError` naming both vocabularies.
    """
    if not samples:
        raise BatchError("cannot train on an empty batch")
    if vocab_size is not None:
        check_vocab(samples, vocab_size)
    order, sizes = _group_order(samples)
    ordered = [samples[i] for i in order]
    B = len(ordered)
    P = [int(s.prompt_ids.shape[0]) for s in ordered]
    R = [int(s.response_ids.shape[0]) for s in ordered]
    if min(P) < 1:
        raise BatchError("a sample has an empty prompt; the first response token needs a context to be predicted from")
    if min(R) < 1:
        raise BatchError("a sample has an empty response; workers must not emit those")
    L, T = max(p + r for p, r in zip(P, R)), max(R)
    input_ids = np.full((B, L), pad_id, dtype=np.int64)
    attn = np.zeros((B, L), dtype=np.int64)
    resp_ids = np.full((B, T), pad_id, dtype=np.int64)
    resp_mask = np.zeros((B, T), dtype=bool)
    policy_mask = np.zeros((B, T), dtype=bool)
    behav = np.zeros((B, T), dtype=np.float32)
    versions = np.full((B, T), -1, dtype=np.int64)
    has_ref = all(s.ref_logprobs is not None for s in ordered)
    ref = np.zeros((B, T), dtype=np.float32) if has_ref else None
    for b, (s, p, r) in enumerate(zip(ordered, P, R)):
        input_ids[b, :p] = s.prompt_ids
        input_ids[b, p : p + r] = s.response_ids
        attn[b, : p + r] = 1
        resp_ids[b, :r] = s.response_ids
        resp_mask[b, :r] = True
        policy_mask[b, :r] = True if s.loss_mask is None else s.policy_mask()
        behav[b, :r] = s.behaviour_logprobs
        versions[b, :r] = s.token_versions()
        if ref is not None:
            ref[b, :r] = s.ref_logprobs
    group_index = np.repeat(np.arange(len(sizes)), sizes)
    t = lambda x: torch.from_numpy(x).to(device)  # noqa: E731
    return TrainBatch(
        input_ids=t(input_ids),
        attention_mask=t(attn),
        response_start=t(np.asarray(P, dtype=np.int64)),
        response_ids=t(resp_ids),
        response_mask=t(resp_mask),
        policy_mask=t(policy_mask),
        behaviour_logprobs=t(behav),
        ref_logprobs=None if ref is None else t(ref),
        token_versions=t(versions),
        rewards=t(np.asarray([s.reward for s in ordered], dtype=np.float32)),
        group_index=t(group_index.astype(np.int64)),
        group_sizes=t(np.asarray(sizes, dtype=np.int64)),
        truncated=t(np.asarray([s.finish_reason == "length" for s in ordered], dtype=bool)),
        sample_ids=[s.sample_id for s in ordered],
        pad_id=int(pad_id),
    )


def micro_batches(batch: TrainBatch, size: int) -> Iterator[tuple[torch.Tensor, TrainBatch]]:
    """Sort-by-length bucketing: rows sorted by total length (longest first, stable), cut into
    chunks of ``size`` rows, each trimmed to its own longest row, so little compute goes to
    padding. Longest first makes an out-of-memory error show up on the first micro-batch.

    Yields:
        ``(rows, micro)``: the ``[b]`` row indices into ``batch`` and ``batch.select(rows)``;
        a per-token result ``x [b, t]`` of ``micro`` goes back with ``out[rows, :t] = x``.
    """
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    order = torch.argsort(batch.lengths.cpu(), descending=True, stable=True)
    for i in range(0, len(order), size):
        rows = order[i : i + size]
        yield rows, batch.select(rows)


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
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear = isinstance(head, torch.nn.Linear) or isinstance(getattr(head, "base_layer", None), torch.nn.Linear)
    if not isinstance(body, torch.nn.Module) or body is model or not linear:  # base_layer: a LoRA-adapted head
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
