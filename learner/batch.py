"""Samples checked against the learner's model, collated into a typed :class:`TrainBatch` of
right-padded tensors, and cut into micro-batches.

Layout of a :class:`TrainBatch` of ``B`` samples (``L`` = longest prompt + response,
``T`` = longest response):

* ``input_ids [B, L]``: prompt then response, right-padded with ``pad_id``. Right padding
  keeps every real token at its unpadded position, so the default ``position_ids`` of a
  causal LM are right without passing them.
* Per-token tensors ``[B, T]`` cover the response only: token ``t`` of row ``b`` is
  ``input_ids[b, response_start[b] + t]`` and is predicted by the logits at position
  ``response_start[b] - 1 + t`` (see :func:`learner.lm_head.gather_response`).
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

:func:`collate` checks the samples' token ids against the learner's vocabulary and their groups
against ``algo.group_size`` (their end-of-sequence tokens were checked when they were read,
:mod:`learner.reader`): a batch that reaches the update is one the learner can train on.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from rlhf_core.errors import UserError
from rlhf_core.records import Sample


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
    oldest_version: torch.Tensor  # [B] int64: version of the row's oldest policy token (staleness = learner version - it)
    sample_ids: list[str]
    pad_id: int
    # the batch's reward components (name -> the values of the samples that have it) and, when
    # any sample is a multi-turn episode, every row's assistant turns; not kept by select()
    reward_components: dict[str, list[float]] = field(default_factory=dict)
    turns: torch.Tensor | None = None  # [B] float64
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

    def select(self, rows: Sequence[int] | torch.Tensor, drop: Sequence[bool] | None = None) -> TrainBatch:
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
            oldest_version=self.oldest_version[idx],
            sample_ids=[self.sample_ids[i] for i in idx.tolist()],
            pad_id=self.pad_id,
            token_extras={k: tok(v) for k, v in self.token_extras.items()},
            row_extras={k: v[idx] for k, v in self.row_extras.items()},
        )

    def with_extras(self, **token_extras: torch.Tensor) -> TrainBatch:
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


def collate(
    samples: Sequence[Sample],
    pad_id: int,
    device: torch.device | str = "cpu",
    vocab_size: int | None = None,
    max_group_size: int | None = None,
) -> TrainBatch:
    """Assemble samples into a right-padded :class:`TrainBatch` (see the module docstring).

    Args:
        samples: decoded samples; groups may be partial and need not arrive contiguous.
        pad_id: id written into padding (never read: masks exclude it).
        device: where the tensors go.
        vocab_size: the learner model's vocabulary; when given, out-of-range ids raise
            :class:`BatchError` naming both vocabularies.
        max_group_size: ``algo.group_size`` of an estimator that compares the responses of one
            prompt; a larger group raises :class:`BatchError` (workers and learner disagree).
    """
    if not samples:
        raise BatchError("cannot train on an empty batch")
    if vocab_size is not None:
        check_vocab(samples, vocab_size)
    order, sizes = _group_order(samples)
    if max_group_size is not None and max(sizes) > max_group_size:
        raise BatchError(f"a group has {max(sizes)} samples but algo.group_size is {max_group_size}: the workers and "
                         "the learner must run with the same algo.group_size")
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
    components: dict[str, list[float]] = {}
    for s in ordered:
        for k, v in s.reward_components.items():
            components.setdefault(k, []).append(v)
    episodes = any(s.loss_mask is not None for s in ordered)
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
        oldest_version=t(np.asarray([s.oldest_version for s in ordered], dtype=np.int64)),
        sample_ids=[s.sample_id for s in ordered],
        pad_id=int(pad_id),
        reward_components=components,
        turns=t(np.asarray([float(s.metadata.get("turns", 0)) for s in ordered])) if episodes else None,
    )


@dataclass(frozen=True)
class Collator:
    """:func:`collate` for one model: its padding id and vocabulary, where the tensors go, and the
    ``algo.group_size`` of an estimator that compares the responses of one prompt (else None)."""

    pad_id: int
    vocab_size: int | None
    device: torch.device | str = "cpu"
    max_group_size: int | None = None

    @classmethod
    def for_model(cls, model: torch.nn.Module, device: torch.device | str, max_group_size: int | None = None) -> Collator:
        """Padding with the model's pad token, else its (first) end-of-sequence token."""
        config: Any = model.config  # a transformers PretrainedConfig
        pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
        pad_id = int(pad if isinstance(pad, int) else (pad[0] if pad else 0))
        return cls(pad_id, int(config.vocab_size), device, max_group_size)

    def __call__(self, samples: Sequence[Sample]) -> TrainBatch:
        return collate(samples, self.pad_id, self.device, self.vocab_size, self.max_group_size)


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


