"""``distill``: on-policy distillation. A teacher model scores the student's own samples token by
token in the learner, and every policy-gradient estimator trains on the teacher's per-token
advantage beside (``reward_weight`` > 0) or instead of its reward advantage
(``learner/algorithms/distill.py``). Whether the teacher fits the student (its path, vocabulary,
tokenizer, context) is checked on its files before anything starts (``rlhf_core.models.check_teacher``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlhf_core.errors import ConfigError


@dataclass
class TeacherConfig:
    # a causal LM sharing the student's tokenizer: a local HF folder (save_pretrained, with its
    # tokenizer) or a Hub id; null: no distillation. Loaded with model.dtype on model.device.
    path: str | None = None


@dataclass
class DistillConfig:
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    # weight of the estimator's reward advantage beside the teacher's (0: pure distillation, the
    # rewards are only reported)
    reward_weight: float = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.teacher.path)

    def check(self) -> None:
        """The weight of the task's advantage."""
        if not (math.isfinite(self.reward_weight) and self.reward_weight >= 0):
            raise ConfigError(f"distill.reward_weight must be >= 0 and finite (0: the teacher alone; 1: the estimator's "
                              f"reward advantage at full weight beside it), got {self.reward_weight}")
