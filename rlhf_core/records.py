"""The records every component shares: prompts handed to workers and the samples they produce.

Both travel as :mod:`rlhf_core.wire` records. ``Sample.decode`` checks structure (fields,
types, dtypes, shapes that agree with each other); :func:`validate_sample` checks meaning
(finite reward, log-probs <= 0, token ids inside the vocabulary, length caps). Both raise
:class:`~rlhf_core.wire.WireError` with a message that names the problem.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from rlhf_core.wire import (
    DEFAULT_MAX_RECORD_BYTES,
    WireError,
    decode_record,
    decode_tensor,
    encode_record,
    encode_tensor,
    optional,
    require,
)

KIND_SAMPLE = "sample"
KIND_PROMPT = "prompt"

#: ``max_turns``: a multi-turn episode ended by ``rollout.max_turns`` before its environment said done.
FINISH_REASONS = frozenset({"stop", "length", "abort", "max_turns"})
#: Largest policy version a record may carry (integers stay exact in Lua's doubles up to 2^53).
MAX_VERSION = 2**53 - 1
_SCALAR = (str, int, float, bool)


def rle_encode(per_token: Iterable[int]) -> list[list[int]]:
    """Run-length encode per-token policy versions: [3, 3, 4] -> [[3, 2], [4, 1]]."""
    runs: list[list[int]] = []
    for v in per_token:
        v = int(v)
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs


def rle_decode(runs: Iterable[Iterable[int]]) -> np.ndarray:
    """Inverse of :func:`rle_encode`, as an int64 array."""
    pairs = np.array([tuple(r) for r in runs], dtype=np.int64).reshape(-1, 2)
    return np.repeat(pairs[:, 0], pairs[:, 1])


def _check_metadata(meta: Any, field_name: str) -> dict[str, Any]:
    if not isinstance(meta, dict):
        raise WireError(f"field {field_name!r}: expected a map, got {type(meta).__name__}")
    for k, v in meta.items():
        if not isinstance(k, str):
            raise WireError(f"field {field_name!r}: keys must be strings, got {k!r}")
        if v is not None and not isinstance(v, (*_SCALAR, list)):
            raise WireError(f"field {field_name!r}: value of {k!r} must be a scalar or list, got {type(v).__name__}")
    return meta


@dataclass
class Prompt:
    """One prompt of the dataset, as a worker claims it. ``messages`` (chat turns) wins over
    ``text`` when the tokenizer has a chat template; ``metadata`` reaches the reward function."""

    prompt_id: str
    text: str
    messages: list[dict[str, str]] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0
    index: int = 0

    def encode(self) -> bytes:
        return encode_record(KIND_PROMPT, {f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def decode(cls, data: bytes, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Prompt:
        obj = decode_record(data, KIND_PROMPT, max_bytes=max_bytes)
        messages = optional(obj, "messages", list)
        if messages is not None:
            for i, m in enumerate(messages):
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    raise WireError(f"field 'messages': turn {i} must be a map with string 'role' and 'content'")
        return cls(
            prompt_id=require(obj, "prompt_id", str),
            text=require(obj, "text", str),
            messages=messages,
            metadata=_check_metadata(optional(obj, "metadata", dict, {}), "metadata"),
            epoch=require(obj, "epoch", int),
            index=require(obj, "index", int),
        )


@dataclass
class Sample:
    """One scored response. A GRPO/RLOO group is the ``group_size`` samples of one prompt.

    Shapes: ``prompt_ids`` int32 [P], ``response_ids`` int32 [R], ``behaviour_logprobs``
    float32 [R] (under the exact distribution each token was sampled from), ``ref_logprobs``
    float32 [R] or None; ``versions``: each response token's policy version, run-length encoded as
    ``[[version, count], ...]``. ``loss_mask`` uint8 [R] or None (all the policy's): 0 on a
    multi-turn episode's tokens between the policy's turns (:mod:`rlhf_core.episode`), which never
    enter a loss nor :attr:`oldest_version`.
    """

    sample_id: str
    prompt_id: str
    group_id: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behaviour_logprobs: np.ndarray
    versions: list[list[int]]
    reward: float
    reward_components: dict[str, float] = field(default_factory=dict)
    finish_reason: str = "stop"
    worker_id: str = ""
    group_size: int = 1
    group_index: int = 0
    ref_logprobs: np.ndarray | None = None
    created_at: float = 0.0
    finished_at: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)
    loss_mask: np.ndarray | None = None

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def num_policy_tokens(self) -> int:
        """Response tokens the policy sampled (all of them without a loss mask)."""
        return self.num_response_tokens if self.loss_mask is None else int(np.count_nonzero(self.loss_mask))

    def policy_mask(self) -> np.ndarray:
        """``[R]`` bool: True at tokens the policy sampled."""
        if self.loss_mask is None:
            return np.ones(self.num_response_tokens, dtype=bool)
        return np.asarray(self.loss_mask) != 0

    @property
    def oldest_version(self) -> int:
        """Policy version of the oldest policy token; staleness = learner_version - this."""
        if self.loss_mask is not None:
            policy = self.token_versions()[self.policy_mask()]
            return int(policy.min()) if policy.size else -1
        return min(v for v, _ in self.versions) if self.versions else -1

    @property
    def newest_version(self) -> int:
        return max(v for v, _ in self.versions) if self.versions else -1

    def token_versions(self) -> np.ndarray:
        return rle_decode(self.versions)

    def encode(self) -> bytes:
        return encode_record(
            KIND_SAMPLE,
            {
                "sample_id": self.sample_id,
                "prompt_id": self.prompt_id,
                "group_id": self.group_id,
                "group_size": self.group_size,
                "group_index": self.group_index,
                "prompt_ids": encode_tensor(np.asarray(self.prompt_ids, dtype=np.int32)),
                "response_ids": encode_tensor(np.asarray(self.response_ids, dtype=np.int32)),
                "behaviour_logprobs": encode_tensor(np.asarray(self.behaviour_logprobs, dtype=np.float32)),
                "ref_logprobs": None
                if self.ref_logprobs is None
                else encode_tensor(np.asarray(self.ref_logprobs, dtype=np.float32)),
                "versions": [[int(v), int(c)] for v, c in self.versions],
                "reward": float(self.reward),
                "reward_components": {k: float(v) for k, v in self.reward_components.items()},
                "finish_reason": self.finish_reason,
                "worker_id": self.worker_id,
                "created_at": float(self.created_at),
                "finished_at": float(self.finished_at),
                "metadata": self.metadata,
                # only when present: a single-turn sample is as small as before
                **({} if self.loss_mask is None else {"loss_mask": encode_tensor(np.asarray(self.loss_mask, dtype=np.uint8))}),
            },
        )

    @classmethod
    def decode(cls, data: bytes, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Sample:
        """Decode untrusted bytes. Raises WireError naming what is wrong."""
        obj = decode_record(data, KIND_SAMPLE, max_bytes=max_bytes)
        prompt_ids = decode_tensor(require(obj, "prompt_ids", dict), "prompt_ids", dtype="int32", ndim=1)
        response_ids = decode_tensor(require(obj, "response_ids", dict), "response_ids", dtype="int32", ndim=1)
        logp = decode_tensor(require(obj, "behaviour_logprobs", dict), "behaviour_logprobs", dtype="float32", ndim=1)
        n = response_ids.shape[0]
        if logp.shape[0] != n:
            raise WireError(f"field 'behaviour_logprobs': {logp.shape[0]} values for {n} response tokens")
        ref = optional(obj, "ref_logprobs", dict)
        if ref is not None:
            ref = decode_tensor(ref, "ref_logprobs", dtype="float32", ndim=1)
            if ref.shape[0] != n:
                raise WireError(f"field 'ref_logprobs': {ref.shape[0]} values for {n} response tokens")
        versions = require(obj, "versions", list)
        total = 0
        for run in versions:
            if not (isinstance(run, list) and len(run) == 2 and all(type(x) is int for x in run) and run[1] > 0):
                raise WireError(f"field 'versions': each run must be [version, count>0], got {run!r}")
            total += run[1]
        if total != n:
            raise WireError(f"field 'versions': runs cover {total} tokens but the response has {n}")
        mask = optional(obj, "loss_mask", dict)
        if mask is not None:
            if obj["schema_version"] < 2:
                raise WireError("field 'loss_mask' needs schema_version >= 2 (the record says 1)")
            mask = decode_tensor(mask, "loss_mask", dtype="uint8", ndim=1)
            if mask.shape[0] != n:
                raise WireError(f"field 'loss_mask': {mask.shape[0]} values for {n} response tokens")
            if mask.size and int(mask.max()) > 1:
                raise WireError(f"field 'loss_mask': values must be 0 or 1, got {int(mask.max())}")
        components = optional(obj, "reward_components", dict, {})
        for k, v in components.items():
            if not isinstance(k, str) or not isinstance(v, (int, float)) or isinstance(v, bool):
                raise WireError(f"field 'reward_components': {k!r} must map to a number, got {v!r}")
        group_size = require(obj, "group_size", int)
        group_index = require(obj, "group_index", int)
        if group_size < 1 or not 0 <= group_index < group_size:
            raise WireError(f"group_index {group_index} is outside group_size {group_size}")
        return cls(
            sample_id=require(obj, "sample_id", str),
            prompt_id=require(obj, "prompt_id", str),
            group_id=require(obj, "group_id", str),
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            behaviour_logprobs=logp,
            versions=versions,
            reward=float(require(obj, "reward", (int, float))),
            reward_components={k: float(v) for k, v in components.items()},
            finish_reason=require(obj, "finish_reason", str),
            worker_id=require(obj, "worker_id", str),
            group_size=group_size,
            group_index=group_index,
            ref_logprobs=ref,
            created_at=float(require(obj, "created_at", (int, float))),
            finished_at=float(require(obj, "finished_at", (int, float))),
            metadata=_check_metadata(optional(obj, "metadata", dict, {}), "metadata"),
            loss_mask=mask,
        )


def validate_sample(
    sample: Sample,
    *,
    vocab_size: int | None = None,
    max_response_tokens: int | None = None,
    max_prompt_tokens: int | None = None,
) -> None:
    """Semantic checks a decoded sample must pass before training. Raises WireError."""
    if not math.isfinite(sample.reward):
        raise WireError(f"reward is not finite ({sample.reward})")
    for name, value in sample.reward_components.items():
        if not math.isfinite(value):
            raise WireError(f"reward component {name!r} is not finite ({value})")
    if sample.finish_reason not in FINISH_REASONS:
        raise WireError(f"finish_reason {sample.finish_reason!r} is not one of {sorted(FINISH_REASONS)}")
    n = sample.num_response_tokens
    if n == 0:
        raise WireError("response is empty")
    if sample.prompt_ids.shape[0] == 0:
        raise WireError("prompt is empty: the first response token needs a prompt token to be predicted from")
    if max_response_tokens is not None and n > max_response_tokens:
        raise WireError(f"response has {n} tokens, more than the configured max of {max_response_tokens}")
    if max_prompt_tokens is not None and sample.prompt_ids.shape[0] > max_prompt_tokens:
        raise WireError(
            f"prompt has {sample.prompt_ids.shape[0]} tokens, more than the configured max of {max_prompt_tokens}"
        )
    # min and max only (NaN propagates into both): this runs for every sample on both sides of the buffer
    low, high = _min_max(sample.behaviour_logprobs)
    if not (math.isfinite(low) and math.isfinite(high)):
        raise WireError("behaviour_logprobs contain NaN or inf")
    if high > 1e-4:  # a little float slack above 0
        raise WireError(f"behaviour_logprobs contain a log-prob > 0 (max {high:.4g})")
    if sample.loss_mask is not None:
        mask = np.asarray(sample.loss_mask)
        if mask.shape != (n,):
            raise WireError(f"loss_mask has shape {list(mask.shape)} for {n} response tokens")
        if not np.isin(mask, (0, 1)).all():
            raise WireError("loss_mask holds values other than 0 and 1")
        if not mask.any():
            raise WireError("loss_mask is 0 everywhere: the response has no token the policy sampled")
    if sample.ref_logprobs is not None and not all(math.isfinite(x) for x in _min_max(sample.ref_logprobs)):
        raise WireError("ref_logprobs contain NaN or inf")
    if vocab_size is not None:
        for name, ids in (("prompt_ids", sample.prompt_ids), ("response_ids", sample.response_ids)):
            low, high = _min_max(ids)
            if ids.size and (low < 0 or high >= vocab_size):
                raise WireError(
                    f"{name} hold token ids outside the vocabulary [0, {vocab_size}): "
                    f"min {int(low)}, max {int(high)}; do the worker and learner use the same tokenizer?"
                )
    if any(v < 0 or v > MAX_VERSION for v, _ in sample.versions):
        raise WireError(f"policy version out of range [0, {MAX_VERSION}] in {sample.versions[:4]}")


def _min_max(values: Any) -> tuple[float, float]:
    """``(min, max)`` of an array as Python numbers (``(0, 0)`` when empty); NaN gives NaN in both.
    A short array goes through a list: a numpy reduction costs more than the values themselves."""
    values = np.asarray(values)
    if values.size > 64:
        return values.min().item(), values.max().item()
    items = values.tolist()
    if not items:
        return 0.0, 0.0
    if any(x != x for x in items):  # Python's min/max skip NaN instead of returning it
        return math.nan, math.nan
    return min(items), max(items)


