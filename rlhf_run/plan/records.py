"""The planner's records: the knobs of one run (:class:`Plan`) and what simulating it gives
(:class:`SimResult`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Plan:
    """The knobs of one run (the Hydra setting each one is)."""

    workers: int = 2  # rollout.num_workers
    slots: int = 32  # rollout.slots
    batch_size: int = 32  # learner.batch_size
    micro_batch_size: int = 32  # learner.micro_batch_size (at most the minibatch: batch_size / num_minibatches)
    num_minibatches: int = 1  # learner.num_minibatches
    group_size: int = 4  # algo.group_size
    max_staleness: int = 2  # algo.max_staleness
    lookahead: int | None = 1  # buffer.lookahead (None: up to max_staleness)
    checkpoint_every: int = 10  # learner.checkpoint_every (>= 1, as rlhf_core.config.validate wants)
    learner_devices: int = 1  # len(learner.devices)
    zero_stage: int = 0  # learner.zero_stage (deepspeed)
    reward_batch_size: int = 32  # reward.batch_size
    reward_max_wait_s: float = 0.010  # reward.max_wait_ms / 1000

    @property
    def ahead(self) -> int:
        return self.max_staleness if self.lookahead is None else min(self.max_staleness, self.lookahead)


@dataclass
class SimResult:
    updates: int
    sim_s: float  # simulated seconds
    window_s: float  # from the warm-up's last update to the last update
    trained_samples_per_s: float
    generated_samples_per_s: float
    staleness_mean: float
    staleness_hist: list[int]  # trained samples per staleness 0, 1, ...
    learner_idle_frac: float  # share of the window the learner waited for a batch
    buffer_depth_mean: float  # samples appended and not yet trained (time average over the window)
    samples_admitted: int
    samples_generated: int
    samples_trained: int
    samples_dropped: int
    samples_in_buffer: int
    samples_in_flight: int  # admitted, not appended yet
    max_admitted_over_bound: int  # <= 0: pacing's bound held at every claim
    min_version_margin: int  # >= 0: every group generated with weights >= its lease's version
    cpu_per_update_ms: dict[str, float] = field(default_factory=dict)  # core-ms per update, by role
    background_cores_used: float = 0.0  # cores the background threads got (their demand is Machine.background)
    max_lag_seen: int = 0  # the largest lag the learner's staleness filter saw (see :func:`~rlhf_run.plan.simulate.same_run`)
    events: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
