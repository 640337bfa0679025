"""The `vllm` generation engine: vLLM's offline ``LLMEngine`` behind the GenerationEngine protocol.

HONESTY NOTE: this module follows the documented API of vLLM 0.11 (V1 engine) and needs
vLLM >= 0.10.2 (the first release whose ``logprobs_mode="processed_logprobs"`` returns the
log-probs of the distribution after temperature and top-k/top-p, i.e. the distribution the
token was sampled from). It has NOT been run here: vLLM needs a CUDA torch build that the
development machines do not have. ``tests/unit/test_vllm_engine.py`` exercises it on a GPU
machine with ``pip install rlhf-service[gpu]`` and skips cleanly elsewhere.

How the protocol maps onto vLLM:

* ``add`` -> ``LLMEngine.add_request(request_id, {"prompt_token_ids": ids}, vllm.SamplingParams)``
  with ``output_kind=DELTA`` (each ``step()`` reports only the new tokens, so every token can be
  stamped with the policy version current when it was produced) and ``logprobs=0`` (the sampled
  token's log-prob only);
* ``step`` -> one ``LLMEngine.step()``; vLLM schedules (continuous batching, chunked prefill,
  ``max_num_seqs = slots``) by itself;
* ``abort`` -> ``LLMEngine.abort_request([id])``;
* ``update_weights`` -> ``LLMEngine.collective_rpc("rlhf_load_weights", args=(weights,))``, run
  on every vLLM worker by :class:`WeightLoaderExtension` (passed as ``worker_extension_cls``),
  which calls the model runner's ``model.load_weights`` with HF state-dict names (vLLM maps
  them onto its fused layers). The KV cache of running requests is kept (in-flight update);
  the prefix cache is reset so new requests never reuse blocks computed by older weights.

Sampling settings map one to one: temperature, top_p, top_k (0 -> -1 = off), max_new_tokens ->
max_tokens, stop_token_ids, stop_strings -> stop (``include_stop_str_in_output=True`` so the
text keeps the stop string, as in the hf engine), ignore_eos. Greedy (temperature 0) is sent
as temperature 1 with top_k 1: vLLM's own greedy path reports unprocessed log-probs, while
this maps to the convention of :mod:`rlhf_core.sampling` (the chosen token has log-prob 0).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch

from rollout_workers.engine import EngineError, GenRequest, GenResult, RequestError, SamplingParams, make_result

log = logging.getLogger(__name__)

MIN_VLLM = "0.10.2"
INSTALL_HINT = "pip install 'rlhf-service[gpu]' (vLLM needs a CUDA GPU and its own torch build)"


def import_vllm() -> Any:
    """vLLM, imported lazily (it is an optional extra); a clear UserError when absent or too old."""
    try:
        import vllm
    except ImportError as exc:
        raise EngineError(
            f"rollout.engine=vllm but vLLM is not importable ({exc}). Install it with {INSTALL_HINT}, "
            "or use rollout.engine=hf (CPU or GPU, no extra packages)"
        ) from None
    from packaging.version import Version

    if Version(vllm.__version__.split("+")[0]) < Version(MIN_VLLM):
        raise EngineError(
            f"vLLM {vllm.__version__} is too old: behaviour log-probs need logprobs_mode='processed_logprobs' "
            f"(vLLM >= {MIN_VLLM}). Upgrade with {INSTALL_HINT}"
        )
    return vllm


class WeightLoaderExtension:
    """Mixed into each vLLM worker (``worker_extension_cls``); its methods run inside the worker.

    Kept free of project imports beyond this module so the vLLM worker process can import it.
    """

    def rlhf_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        model = self.model_runner.model  # type: ignore[attr-defined]  # provided by vLLM's worker
        device = self.device  # type: ignore[attr-defined]
        model.load_weights(weights=[(name, tensor.to(device, non_blocking=True)) for name, tensor in weights])
        torch.cuda.synchronize()
        return len(weights)


class _Track:
    """Host-side record of one request: tokens, log-probs and per-token versions so far."""

    __slots__ = ("request", "tokens", "logprobs", "versions")

    def __init__(self, request: GenRequest) -> None:
        self.request = request
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []


class VLLMEngine:
    """GenerationEngine over ``vllm.LLMEngine``. See the module docstring (and its honesty note).

    Args:
        model_path: a local HF-format directory (``rlhf_core.models.model_dir``).
        tokenizer: the policy tokenizer, used to decode the final texts exactly like the hf engine.
        slots: ``max_num_seqs``; dtype, seed, gpu_memory_utilization, tensor_parallel_size,
        trust_remote_code, max_model_len: passed to ``vllm.EngineArgs``.
    """

    def __init__(self, model_path: str, tokenizer: Any, slots: int = 16, seed: int = 0, dtype: str = "auto",
                 gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1,
                 trust_remote_code: bool = False, max_model_len: int | None = None) -> None:
        self._vllm = import_vllm()
        from vllm.sampling_params import RequestOutputKind

        self._delta = RequestOutputKind.DELTA
        args = self._vllm.EngineArgs(
            model=str(model_path),
            dtype=dtype,
            seed=seed,
            max_num_seqs=slots,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            trust_remote_code=trust_remote_code,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WeightLoaderExtension",
        )
        self.engine = self._vllm.LLMEngine.from_engine_args(args)
        self.tokenizer = tokenizer
        self.slots = slots
        self.version = 0
        self._tracks: dict[str, _Track] = {}

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any = None) -> "VLLMEngine":
        from rlhf_core.models import load_tokenizer, model_dir

        import_vllm()  # fail with the install hint before building anything
        tokenizer = load_tokenizer(cfg.model) if tokenizer is None else tokenizer
        return cls(
            str(model_dir(cfg.model)), tokenizer, slots=int(cfg.rollout.slots), seed=int(cfg.rollout.seed),
            dtype=str(cfg.model.dtype), gpu_memory_utilization=float(cfg.rollout.gpu_memory_utilization),
            tensor_parallel_size=int(cfg.rollout.tensor_parallel_size),
            trust_remote_code=bool(cfg.model.trust_remote_code),
        )

    # ----------------------------------------------------------------------------- protocol

    def add(self, request: GenRequest) -> None:
        if request.request_id in self._tracks:
            raise RequestError(f"request id {request.request_id!r} is already queued or running; ids must be unique")
        if not request.prompt_ids:
            raise RequestError(f"request {request.request_id}: empty prompt; a prompt needs at least one token")
        request.prompt_ids = [int(t) for t in request.prompt_ids]
        self.engine.add_request(request.request_id, {"prompt_token_ids": request.prompt_ids},
                                self._sampling_params(request.params))
        self._tracks[request.request_id] = _Track(request)

    def step(self) -> list[GenResult]:
        finished = []
        version = self.version
        for out in self.engine.step():
            track = self._tracks.get(out.request_id)
            if track is None:  # aborted between steps
                continue
            completion = out.outputs[0]
            new = list(completion.token_ids)
            track.tokens.extend(new)
            track.logprobs.extend(_sampled_logprobs(completion.logprobs, new))
            track.versions.extend([version] * len(new))
            if out.finished:
                del self._tracks[out.request_id]
                reason = completion.finish_reason if completion.finish_reason in ("stop", "length", "abort") else "stop"
                finished.append(self._result(track, reason))
        return finished

    def has_work(self) -> bool:
        return bool(self._tracks)

    def num_active(self) -> int:
        # vLLM does not expose its running/waiting split through the offline API; report what the
        # scheduler can run at once as active and the rest as waiting.
        return min(len(self._tracks), self.slots)

    def num_waiting(self) -> int:
        return max(0, len(self._tracks) - self.slots)

    def abort(self, request_id: str) -> GenResult | None:
        track = self._tracks.pop(request_id, None)
        if track is None:
            return None
        self.engine.abort_request([request_id])
        return self._result(track, "abort")

    def abort_all(self) -> list[GenResult]:
        return [r for rid in list(self._tracks) if (r := self.abort(rid)) is not None]

    def weights_target(self) -> None:
        return None  # the weights live in vLLM's worker processes; pass tensors to update_weights

    def update_weights(self, tensors: Mapping[str, torch.Tensor] | None, version: int) -> None:
        if tensors is None:
            raise EngineError("the vllm engine has no in-process weights_target(); pass the tensors to update_weights")
        weights = [(name, t.detach().cpu().contiguous()) for name, t in tensors.items()]
        loaded = self.engine.collective_rpc("rlhf_load_weights", args=(weights,))
        log.info("vllm: loaded %s tensors of version %d", loaded, version)
        # New requests must not reuse prefix-cache blocks computed by the old weights; running
        # requests keep their KV cache (in-flight update).
        if self.engine.reset_prefix_cache() is False:
            log.warning("vllm: prefix cache not reset after the weight update to v%d", version)
        self.version = int(version)

    # ----------------------------------------------------------------------------- internals

    def _sampling_params(self, p: SamplingParams) -> Any:
        greedy = p.temperature == 0
        return self._vllm.SamplingParams(
            n=1,
            temperature=1.0 if greedy else p.temperature,
            top_p=p.top_p,
            top_k=1 if greedy else (p.top_k if p.top_k > 0 else -1),
            max_tokens=p.max_new_tokens,
            stop=list(p.stop_strings) or None,
            stop_token_ids=list(p.stop_token_ids) or None,
            ignore_eos=p.ignore_eos,
            include_stop_str_in_output=True,
            logprobs=0,  # the sampled token's log-prob only (under logprobs_mode=processed_logprobs)
            skip_special_tokens=True,
            output_kind=self._delta,
        )

    def _result(self, track: _Track, reason: str) -> GenResult:
        text = self.tokenizer.decode(track.tokens, skip_special_tokens=True)
        return make_result(track.request.request_id, track.request.prompt_ids, track.tokens, track.logprobs,
                           track.versions, reason, text)


def _sampled_logprobs(position_logprobs: Any, tokens: list[int]) -> list[float]:
    """The sampled token's log-prob at each new position (vLLM: one {token_id: Logprob} per position)."""
    if position_logprobs is None:
        raise EngineError("vLLM returned no log-probs although logprobs=0 was requested; check the vLLM version")
    out = []
    for entry, token in zip(position_logprobs, tokens):
        out.append(float(entry[token].logprob))
    if len(out) != len(tokens):
        raise EngineError(f"vLLM returned {len(out)} log-probs for {len(tokens)} new tokens")
    return out
