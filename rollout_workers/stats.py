"""A worker's throughput accounting: one record its parts count into, sent with every heartbeat."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from rlhf_core import metric_names as M

#: heartbeat stats key -> engine attribute, for engines that count their forward passes (hf)
ENGINE_COUNTERS = {M.WORKER_ENGINE_STEPS: "num_steps", M.WORKER_ENGINE_PREFILLS: "num_prefills",
                   M.WORKER_ENGINE_REUSED: "num_reused_tokens", M.WORKER_ENGINE_PROMPT: "num_prompt_tokens"}


@dataclass
class WorkerStats:
    """Throughput accounting, written with every heartbeat into the buffer's consumer record
    (``MonitorClient.metrics()["consumers"][worker_id]["stats"]``) where the monitor reads it."""

    started: float = field(default_factory=time.monotonic)
    prompts: int = 0  # groups appended (prompts completed with >= 1 sample)
    prompts_empty: int = 0  # prompts acked with no sample (all dead-lettered, or the prompt rejected)
    samples: int = 0
    tokens: int = 0  # generated tokens of finished responses
    dead_letters: int = 0
    duplicates: int = 0  # completions refused: another worker completed the prompt first
    leases_lost: int = 0  # groups abandoned because another worker reclaimed their lease
    released: int = 0  # prompts given back at shutdown
    weight_updates: int = 0
    t_generate: float = 0.0  # in engine.step
    t_score: float = 0.0  # scoring threads' busy time, summed over threads (overlaps generation)
    reward_calls: int = 0  # calls of a reward function or model (per sample, or per batch when batched)
    reward_timeouts: int = 0  # reward calls abandoned after reward.timeout_s
    empty_responses: int = 0  # responses with no text (handled as reward.empty_response says)
    t_wait: float = 0.0  # in claim: waiting for prompts / admission budget
    groups_filtered: int = 0  # groups dropped by algo.filter_groups (their prompts acked, budget returned)
    samples_filtered: int = 0
    t_weights: float = 0.0  # pulling and applying weights

    def as_dict(self, version: int | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        d: dict[str, Any] = {k: v for k, v in dataclasses.asdict(self).items() if k != "started"}
        d.update(version=version, prompts_per_s=self.prompts / elapsed, samples_per_s=self.samples / elapsed,
                 tokens_per_s=self.tokens / elapsed, reward_calls_per_s=self.reward_calls / elapsed, uptime_s=elapsed)
        d.update(extra or {})
        return d
