"""DeepSpeed ZeRO stage 1/2/3 engine (CPU over gloo for tests, GPU over NCCL).

* torch AdamW is passed as the client optimizer (``zero_allow_untested_optimizer``) so the
  numbers match :class:`learner.engines.TorchEngine`; the warm-up + cosine ``LambdaLR`` is
  built by DeepSpeed on that optimizer and stepped by ``engine.step()``.
* Gradient accumulation is unmanaged (``managed_gradient_accumulation: false``): every
  ``backward`` accumulates locally, every ``step`` is the accumulation boundary (reduce,
  clip, update). The number of micro-batches per step may therefore vary from update to
  update (partial groups), as long as every rank makes the same calls.
* Under ZeRO-3 :meth:`DeepSpeedEngine.named_full_parameters` gathers one module's own
  parameters at a time (``deepspeed.zero.GatheredParameters``) and copies them to the CPU,
  so the full model never exists twice on the accelerator. A parameter two modules share (an
  output head tied to the input embeddings) comes out once, under the name
  ``module.named_parameters()`` gives it, as with every other engine.

Single-process runs get the ``MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK``
environment filled in by :func:`init_distributed`; under ``torchrun``/``deepspeed`` it is set.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from buffer.local_server import free_port
from learner.engines import apply_config_hyperparameters, lr_lambda, make_optimizer, persistent_buffers
from rlhf_core.config import ConfigError, LearnerConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

CHECKPOINT_TAG = "ds"


def init_distributed() -> None:
    """Initialise torch.distributed through DeepSpeed (gloo on CPU, NCCL on GPU), idempotent."""
    import deepspeed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    if "RANK" not in os.environ:  # a plain single process: be a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        # DeepSpeed's CPU backend JIT-compiles a shared-memory op at init that only its inference
        # all-reduce uses: training over gloo never calls it, and the compile costs ~40 s per machine
        # (a killed compile leaves a lock file every later start waits on forever). DeepSpeed reads
        # this dict (its documented cache of probed ops) before building the op.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend)


def ds_config(cfg: LearnerConfig, world_size: int, on_gpu: bool, bf16_model: bool = False) -> dict[str, Any]:
    """The DeepSpeed config dict for ``cfg`` (see the module docstring for the choices).

    ``bf16_model``: the model is held in bf16 (``model.dtype=bfloat16``); DeepSpeed's bf16 mode
    is then on whatever ``learner.bf16`` says, because that mode is what keeps fp32 master weights
    (stepped directly, bf16 weights lose every update below their precision)."""
    if cfg.bf16 and not on_gpu:
        log.warning("learner.bf16=true on CPU: bf16 matmuls on CPU are slow; intended for GPUs")
    zero: dict[str, Any] = {
        "stage": cfg.zero_stage,
        # overlap_comm needs CUDA streams; with unmanaged accumulation it is allowed for stage >= 2 only.
        "overlap_comm": bool(on_gpu and cfg.zero_stage >= 2),
        "contiguous_gradients": True,
    }
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if cfg.zero_stage == 3:
        # Gather everything on every forward: the policy is small enough per layer, and the
        # default live-parameter caching would keep gathered weights across our no-grad passes.
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(cfg.grad_clip) if cfg.grad_clip and cfg.grad_clip > 0 else 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # torch AdamW also under offload (same numbers as the torch engine)
        "bf16": {"enabled": bool(cfg.bf16) or bf16_model},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class DeepSpeedEngine:
    """A :class:`learner.engines.TrainEngine` over ``deepspeed.initialize``."""

    compiled = False  # learner.compile is the torch engine's

    def __init__(self, module: PreTrainedModel, cfg: LearnerConfig, lr: float | None = None) -> None:
        try:
            import deepspeed
        except ImportError:
            raise ConfigError("learner.engine=deepspeed needs DeepSpeed: pip install 'rlhf-service[train]'") from None
        init_distributed()
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        self.cfg = cfg
        on_gpu = next(module.parameters()).is_cuda
        bf16_model = any(p.dtype == torch.bfloat16 for p in module.parameters())
        self.config = ds_config(cfg, self.world_size, on_gpu, bf16_model)
        self.base_lr = cfg.lr if lr is None else lr
        optimizer = make_optimizer(module, cfg, self.base_lr)
        schedule = lr_lambda(cfg)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module,
            optimizer=optimizer,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
            config=self.config,
        )
        self.module = self.engine.module
        self.zero_stage = cfg.zero_stage
        self._frozen = any(not p.requires_grad for p in self.module.parameters())

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    @property
    def global_step(self) -> int:
        return int(self.engine.global_steps)

    def forward(self, **kwargs: Any) -> Any:
        return self.engine(**kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        # The caller already scaled the loss to this micro-batch's share of the minibatch.
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def train(self, mode: bool = True) -> None:
        self.engine.train(mode)

    def named_full_parameters(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor on the CPU) for every parameter and persistent buffer.

        Under ZeRO-3 this is a collective: EVERY rank must iterate it to the end (ranks other
        than 0 gather too, and get nothing yielded).
        """
        yield from self._gathered(dtype, trainable_only=False)
        if self.is_rank0:
            yield from persistent_buffers(self.module, dtype)

    def named_trainable_parameters(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor on the CPU) for every parameter that trains (LoRA: the adapters);
        a collective under ZeRO-3 like :meth:`named_full_parameters`."""
        yield from self._gathered(dtype, trainable_only=True)

    def _gathered(self, dtype: torch.dtype | None, trainable_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
        if self.zero_stage != 3:
            if self.is_rank0:
                for name, p in self.module.named_parameters():
                    if p.requires_grad or not trainable_only:
                        yield name, p.detach().to("cpu", dtype=dtype or p.dtype, copy=True)
            return
        import deepspeed

        # a parameter two modules share (a tied head) goes out once, under its first name: the names
        # and order of module.named_parameters(), which the workers' targets are built from
        seen: set[int] = set()
        for mod_name, mod in self.module.named_modules():
            params = [(n, p) for n, p in mod.named_parameters(recurse=False)
                      if id(p) not in seen and (p.requires_grad or not trainable_only)]
            seen.update(id(p) for _, p in params)
            if not params:
                continue
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
                if self.is_rank0:
                    copies = [
                        (f"{mod_name}.{n}" if mod_name else n, p.detach().to("cpu", dtype=dtype or p.dtype, copy=True))
                        for n, p in params
                    ]
            if self.is_rank0:
                yield from copies  # outside the context: the consumer never holds the gathered weights

    def save_state(self, directory: str | Path) -> None:
        """Collective: every rank writes its partition into ``directory`` (shared filesystem)."""
        # frozen parameters (the base weights under LoRA) come from model.path: not saved again
        self.engine.save_checkpoint(str(directory), tag=CHECKPOINT_TAG, client_state={}, save_latest=False,
                                    exclude_frozen_parameters=self._frozen)

    def load_state(self, directory: str | Path) -> None:
        path, _ = self.engine.load_checkpoint(
            str(directory), tag=CHECKPOINT_TAG, load_optimizer_states=True, load_lr_scheduler_states=True,
            load_module_strict=not self._frozen,
        )
        if path is None:
            raise ConfigError(f"no DeepSpeed checkpoint (tag {CHECKPOINT_TAG!r}) in {directory}")
        apply_config_hyperparameters(self.scheduler, self.cfg, self.base_lr)
