"""The generation-engine protocol the worker loop drives and its request/result records.

Two implementations: :class:`rollout_workers.hf_engine.HFEngine` (transformers, CPU or GPU) and
:class:`rollout_workers.vllm_engine.VLLMEngine` (vLLM, when installed);
:func:`rollout_workers.engine_factory.make_engine` picks one.

How the worker drives an engine (one thread; engines are not thread-safe)::

    for i in range(group_size):
        engine.add(GenRequest(f"{prompt_id}/{i}", prompt_ids, params))
    while engine.has_work():
        for result in engine.step():      # admit + ONE decoding step
            scorer.submit(result)         # score at once, no batch barrier
        if (new := weights.poll()) is not None:
            engine.update_weights(new.tensors, new.version)   # between steps, KV cache kept

Per-token versions: every token carries the ``engine.version`` current when it was sampled, so a
weight update that lands mid-generation shows in ``GenResult.versions`` from the step after
``update_weights`` on (the in-flight update of PipelineRL: running sequences keep their KV cache).
A response's first token carries at most the version current when its prompt's prefill may have
begun: a prompt prefilled in chunks across an update was partly written by older weights, and a
sample's staleness, counted from its oldest token, must not start at newer ones.
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch

from rlhf_core.errors import UserError

FinishReason = Literal["stop", "length", "abort"]


class EngineError(UserError):
    """An engine cannot do what was asked (missing package, weights that do not fit the model)."""


class RequestError(UserError, ValueError):
    """A request the engine cannot serve (empty or too long prompt, bad sampling settings)."""


@dataclass
class SamplingParams:
    """Sampling settings of one request (processed in the order of :mod:`rlhf_core.sampling`).
    ``temperature == 0`` is greedy. ``stop_token_ids`` (plus the EOS ids unless ``ignore_eos``) and
    ``stop_strings`` end a sequence; the token that ends it is kept, so ``text == decode(token_ids)``."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Hydra hands over ListConfig; keep tuples so params are hashable and comparable.
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.stop_strings = tuple(str(s) for s in self.stop_strings)
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise RequestError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(s == "" for s in self.stop_strings):
            raise RequestError("stop_strings must not contain the empty string (it would stop every sequence at once)")

    @property
    def key(self) -> tuple[float, int, float]:
        """The settings that shape the sampling distribution (what the learner must reproduce)."""
        return (self.temperature, self.top_k, self.top_p)

    @classmethod
    def from_config(cls, rollout: Any, **overrides: Any) -> SamplingParams:
        """From ``cfg.rollout`` (:class:`rlhf_core.config.RolloutConfig` or its DictConfig)."""
        kwargs: dict[str, Any] = dict(
            temperature=float(rollout.temperature),
            top_p=float(rollout.top_p),
            top_k=int(rollout.top_k),
            max_new_tokens=int(rollout.max_new_tokens),
            stop_strings=tuple(rollout.stop_strings or ()),
        )
        kwargs.update(overrides)
        return cls(**kwargs)


@dataclass
class GenRequest:
    """One response to generate. A group of n responses is n requests with distinct ids.

    ``min_kv_version``: the oldest policy version whose K/V (a finished turn's, kept by the engine)
    the request may reuse. A continued conversation passes the oldest version of its tokens so far
    (its staleness counts from there already, so the reuse hides nothing); None: the engine's
    current version only (a new prompt)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    min_kv_version: int | None = None

    def kv_floor(self, version: int) -> int:
        """The oldest version whose K/V this request may reuse on an engine at ``version``."""
        return version if self.min_kv_version is None else min(int(self.min_kv_version), version)


@dataclass
class GenResult:
    """A finished (or aborted) request. ``prompt_ids`` [P] int32; ``token_ids``, ``logprobs``
    (float32, behaviour log-probs under the processed distribution) and ``versions`` (int64, the
    policy version that sampled each token) are all [T], T <= max_new_tokens (0: aborted unstarted)."""

    request_id: str
    prompt_ids: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: FinishReason
    text: str

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def make_result(request_id: str, prompt_ids: list[int] | np.ndarray, token_ids: list[int], logprobs: list[float],
                versions: list[int], finish_reason: FinishReason, text: str) -> GenResult:
    """Build a :class:`GenResult` with the documented dtypes."""
    return GenResult(
        request_id=request_id,
        prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
        token_ids=np.asarray(token_ids, dtype=np.int32),
        logprobs=np.asarray(logprobs, dtype=np.float32),
        versions=np.asarray(versions, dtype=np.int64),
        finish_reason=finish_reason,
        text=text,
    )


class Generation:
    """An admitted request's record in an engine: the tokens sampled so far, their log-probs and versions."""

    __slots__ = ("request", "tokens", "logprobs", "versions")

    def __init__(self, request: GenRequest) -> None:
        self.request = request
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []

    def result(self, reason: FinishReason, tokenizer: Any, versions: list[int] | None = None) -> GenResult:
        """The request's :class:`GenResult`, its text decoded by ``tokenizer``; ``versions`` replace the recorded ones."""
        text = tokenizer.decode(self.tokens, skip_special_tokens=True)
        return make_result(self.request.request_id, self.request.prompt_ids, self.tokens, self.logprobs,
                           self.versions if versions is None else versions, reason, text)


def check_request(request: GenRequest, known: Container[str], vocab_size: int, max_model_len: int) -> None:
    """Refuse a request an engine cannot serve (a :class:`RequestError` saying what is wrong) and
    make its prompt a list of ints. ``known``: the ids queued or running."""
    rid = request.request_id
    if not isinstance(request.params, SamplingParams):
        raise RequestError(f"request {rid}: params must be a SamplingParams, got {type(request.params).__name__}")
    if rid in known:
        raise RequestError(f"request id {rid!r} is already queued or running; ids must be unique")
    prompt = [int(t) for t in request.prompt_ids]
    if not prompt:
        raise RequestError(f"request {rid}: empty prompt; a prompt needs at least one token (e.g. BOS)")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise RequestError(f"request {rid}: token ids must lie in [0, {vocab_size}), got min {min(prompt)} max "
                           f"{max(prompt)}; was the prompt tokenized with another tokenizer?")
    if len(prompt) >= max_model_len:
        raise RequestError(f"request {rid}: prompt has {len(prompt)} tokens but the model's context is {max_model_len}; "
                           "lower rollout.max_prompt_tokens or use rollout.prompt_overflow=truncate")
    request.prompt_ids = prompt


def check_weight_update(tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]], version: int) -> None:
    """Refuse a weight update with a name or shape the model does not have (``shapes``: the model's
    {name: shape}), before an engine copies or sends anything, so nothing is ever half-applied."""
    unknown = [n for n in tensors if n not in shapes]
    if unknown:
        raise EngineError(
            f"weight update v{version} has {len(unknown)} tensor(s) this model does not have, e.g. "
            f"{unknown[:3]}; the learner and the workers must load the same model architecture"
        )
    bad = [(n, tuple(t.shape), tuple(shapes[n])) for n, t in tensors.items() if tuple(t.shape) != tuple(shapes[n])]
    if bad:
        raise EngineError(f"weight update v{version}: shape mismatch (name, got, expected): {bad[:3]}")


@runtime_checkable
class GenerationEngine(Protocol):
    """What the worker loop needs from an engine. All calls come from one thread."""

    version: int  # policy version of the weights in use

    def add(self, request: GenRequest) -> None:
        """Queue a request; it is admitted into a free slot at the next :meth:`step`."""

    def step(self) -> list[GenResult]:
        """Admit waiting requests into free slots (prefill), run ONE decoding step for all active
        slots, and return the sequences that finished in this step."""

    def has_work(self) -> bool:
        """Anything active or waiting."""

    def num_active(self) -> int: ...

    def num_waiting(self) -> int: ...

    def sampled(self, request_id: str) -> list[int]:
        """The token ids a running request has sampled so far ([] while it waits or when unknown;
        the engine's own list: read it, do not keep it). The gateway streams them."""

    def abort(self, request_id: str) -> GenResult | None:
        """Drop a request (finish_reason "abort") and free its slot; None if the id is unknown."""

    def abort_all(self) -> list[GenResult]: ...

    def weights_target(self) -> torch.nn.Module | Mapping[str, torch.Tensor] | None:
        """What a weight pull may ``copy_`` into in place (hf: the model, with LoRA its adapter
        parameters by name; vllm: None)."""

    def update_weights(self, tensors: Mapping[str, torch.Tensor] | None, version: int) -> None:
        """Install weights between steps. ``tensors`` None: already copied into :meth:`weights_target`.
        Tokens sampled after this call carry ``version``."""

    def close(self) -> None:
        """Free what the engine holds outside this process (vllm: its engine-core process). Idempotent."""
