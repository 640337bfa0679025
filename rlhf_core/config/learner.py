"""``learner``: batches, optimisation, checkpoints, engine and placement of the learner."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlhf_core.choices import LearnerEngine, LRSchedule, PublishDtype
from rlhf_core.config.rollout import check_devices
from rlhf_core.errors import ConfigError


@dataclass
class LearnerConfig:
    engine: LearnerEngine = LearnerEngine.torch
    batch_size: int = 32  # samples per update (a multiple of algo.group_size)
    micro_batch_size: int = 16
    ppo_epochs: int = 1
    num_minibatches: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: LRSchedule = LRSchedule.cosine
    max_updates: int = 100
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_dir: str | None = None  # default: <output dir>/checkpoints
    # updates between checkpoints (>= 1); the batches trained are acked in the buffer at each one,
    # so there is no "never": a large number checkpoints rarely and keeps that many batches in Redis
    checkpoint_every: int = 10
    zero_stage: int = 2
    offload_optimizer: bool = False
    bf16: bool = False
    peak_tflops: float | None = None  # the device's dense bf16 peak for learner/mfu; null = known GPUs by name
    logits_chunk_tokens: int = 1024  # a micro-batch with more response tokens gets its log-probs chunk by chunk
    # the fused LM head keeps each chunk's logits for its backward (one matmul less; N x V logits held)
    keep_head_logits: bool = False
    publish_dtype: PublishDtype = PublishDtype.as_trained
    prometheus_port: int | None = None
    export_dir: str | None = None  # HF-format export at the end
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio (OpenRLHF's default floor)
    # critic (gae) learning rate; null = lr. The critic has its own AdamW and clipping, so this sets its step
    # size (a coefficient on its loss would change nothing: Adam's step does not depend on the loss's scale)
    critic_lr: float | None = None
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8
    keep_checkpoints: int = 3  # newest checkpoints kept on disk
    devices: list[int] | None = None  # GPU indices of the learner (CUDA_VISIBLE_DEVICES); > 1 runs it under torchrun
    # torch.compile each transformer block (inductor fuses its norms, rotary and activations) and
    # the fused LM head's softmax passes; the first updates compile (tens of seconds, then cached
    # on disk). learner.engine=torch only. null: on for full-parameter training on a GPU
    # (1.19-1.42x the eager update on an H200), off on a CPU (slower on one host, faster on
    # another) and with LoRA (not measured)
    compile: bool | None = None

    def check(self) -> None:
        """Batches, minibatches and micro-batches dividing into each other, the learning rates and
        their floor, the run's length in updates, checkpoints, and what the engine allows."""
        if self.batch_size < 1:
            raise ConfigError(f"learner.batch_size must be >= 1 (samples per update), got {self.batch_size}")
        if self.num_minibatches < 1:
            raise ConfigError(f"learner.num_minibatches must be >= 1 (optimizer steps per epoch), got {self.num_minibatches}")
        if self.batch_size % self.num_minibatches:
            raise ConfigError(f"learner.batch_size {self.batch_size} is not divisible by learner.num_minibatches "
                              f"{self.num_minibatches}")
        minibatch = self.batch_size // self.num_minibatches
        if not 1 <= self.micro_batch_size <= minibatch:
            raise ConfigError(f"learner.micro_batch_size {self.micro_batch_size} must be between 1 and the minibatch size "
                              f"{minibatch} (batch_size {self.batch_size} / num_minibatches {self.num_minibatches})")
        if not 0 <= self.min_lr_ratio <= 1 or self.keep_checkpoints < 1:
            raise ConfigError(f"learner.min_lr_ratio must be in [0, 1] and learner.keep_checkpoints >= 1, got "
                              f"{self.min_lr_ratio}, {self.keep_checkpoints}")
        if self.max_updates < 1 or self.ppo_epochs < 1:
            raise ConfigError(f"learner.max_updates and learner.ppo_epochs must be >= 1 (a run also ends at "
                              f"run.max_seconds), got {self.max_updates}, {self.ppo_epochs}")
        if not all(0 <= lr < math.inf for lr in (self.lr, self.critic_lr) if lr is not None):
            raise ConfigError(f"learner.lr and learner.critic_lr must be >= 0 and finite (critic_lr null: lr), got "
                              f"{self.lr}, {self.critic_lr}")
        if self.checkpoint_every < 1:
            raise ConfigError(f"learner.checkpoint_every must be >= 1 update, got {self.checkpoint_every}: a checkpoint "
                              "is where the learner acks the batches it trained, so the buffer keeps every batch since the "
                              "last one; set a large number (e.g. 1000) to checkpoint rarely")
        if self.compile is True and self.engine != LearnerEngine.torch:
            raise ConfigError("learner.compile=true works with learner.engine=torch only (DeepSpeed wraps and partitions "
                              "the model itself); drop learner.compile or use the torch engine")
        if self.zero_stage not in (1, 2, 3):
            raise ConfigError(f"learner.zero_stage must be 1, 2 or 3 (DeepSpeed's ZeRO stages), got {self.zero_stage}")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas) or not self.adam_eps > 0:
            raise ConfigError(f"learner.adam_betas must be two numbers in [0, 1) and learner.adam_eps > 0, got "
                              f"{list(self.adam_betas)}, {self.adam_eps}")
        check_devices("learner.devices", self.devices)
        if self.devices is not None and len(self.devices) > 1 and self.engine != LearnerEngine.deepspeed:
            raise ConfigError(f"learner.devices={list(self.devices)} runs the learner on {len(self.devices)} GPUs, "
                              "which needs learner.engine=deepspeed (the torch engine is single-process)")
