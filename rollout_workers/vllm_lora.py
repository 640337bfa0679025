"""LoRA versions for the `vllm` engine: each policy version's adapter, written as a PEFT adapter
directory in the engine's private folder, is a vLLM ``LoRARequest`` loaded at once (a broken
adapter fails the update, not a request) that every request added afterwards carries to its end;
a version no request uses any more is removed. docs/architecture.md (Models: LoRA).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from rlhf_core import lora
from rlhf_core.config import VLLM_LORA_RANKS, LoraConfig
from rollout_workers.engine import EngineError, check_weight_update

log = logging.getLogger(__name__)

MAX_LORAS = 4  # adapters (versions) in one batch: the newest plus requests still running on older ones
MAX_CPU_LORAS = 8  # adapters vLLM keeps loaded; versions are removed when no request uses them


def engine_args(cfg: LoraConfig) -> dict[str, Any]:
    """The ``vllm.EngineArgs`` settings that turn on LoRA for adapters of rank ``cfg.r``."""
    rank = next(r for r in VLLM_LORA_RANKS if r >= lora.rank(cfg))  # vLLM sizes its buffers for one of these
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": MAX_LORAS, "max_cpu_loras": MAX_CPU_LORAS}


class AdapterVersions:
    """The LoRA adapter of each version a request may still use (the engine's thread only). Built
    before vLLM starts, so a ``model.lora`` that does not fit the model (``model_path``) is refused
    with nothing running; then :meth:`bind` to the engine."""

    def __init__(self, model_path: str, cfg: LoraConfig, trust_remote_code: bool = False) -> None:
        from transformers import AutoConfig
        from vllm.lora.request import LoRARequest

        self.cfg = cfg
        self.model_path = str(model_path)
        self._request_cls = LoRARequest
        self._engine: Any = None
        self._call: Callable[..., Any] = lambda fn, *args: fn(*args)
        config = AutoConfig.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
        self.shapes = lora.adapter_shapes(config, cfg, trust_remote_code)  # what every version must hold
        self.root: Path | None = None  # the engine's private folder, which holds one folder per version
        self.requests: dict[int, Any] = {}  # version -> its LoRARequest, while a request may use it
        self.current: int | None = None

    def bind(self, engine: Any, call: Callable[..., Any], root: Path) -> None:
        """``engine``: the ``vllm.LLMEngine``; ``call``: runs a blocking call into its engine core
        (the engine's dead-core watch); ``root``: the engine's private folder (it removes it)."""
        self._engine, self._call, self.root = engine, call, root

    def request(self) -> Any:
        """The newest version's ``LoRARequest`` (None before the first update: the base model)."""
        return self.requests.get(self.current) if self.current is not None else None

    def add(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Make ``tensors`` (every adapter tensor) the adapter of ``version`` and the newest one."""
        missing = sorted(set(self.shapes) - set(tensors))
        if missing:
            raise EngineError(f"weight update v{version} lacks {len(missing)} adapter tensor(s) of model.lora "
                              f"(e.g. {missing[:3]}): the learner and the workers need the same model.lora settings")
        check_weight_update(tensors, self.shapes, version)
        if version in self.requests:  # a version number never names other weights: this adapter is loaded
            self.current = version
            return
        assert self.root is not None, "bind() comes first"
        folder = lora.save_adapter(self.root / f"v{version}", tensors, self.cfg, base_model=self.model_path)
        req = self._request_cls(f"v{version}", version + 1, str(folder))
        try:
            self._call(self._engine.add_lora, req)  # loaded now: a bad adapter fails here, not in a request
        except Exception:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self.requests[version] = req
        self.current = version

    def retire(self, in_use: set[int]) -> None:
        """Remove the versions that are not the newest and that no request in ``in_use`` runs."""
        for version in [v for v in self.requests if v != self.current and v not in in_use]:
            self._drop(version)

    def _drop(self, version: int) -> None:
        req = self.requests.pop(version)
        try:
            self._call(self._engine.remove_lora, req.lora_int_id)
        except EngineError:
            raise
        except Exception as exc:  # already evicted by vLLM's own LRU: nothing to remove
            log.debug("vllm: removing adapter v%d: %s", version, exc)
        shutil.rmtree(req.lora_path, ignore_errors=True)
