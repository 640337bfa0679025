"""``algo.policy_loss=ppo``: plain PPO, the behaviour policy as "old" and no correction for
staleness (the baseline that shows what staleness does)."""

from __future__ import annotations

from typing import Any

import torch

from learner.algorithms import register_policy_loss
from learner.algorithms.core import PolicyLossStats, clip_loss
from rlhf_core.choices import PolicyLoss
from rlhf_core.config import ISConfig


@register_policy_loss(PolicyLoss.ppo, importance_sampling=False)
def ppo_clip_loss(
    logp: torch.Tensor, prox_logp: torch.Tensor | None, behav_logp: torch.Tensor, advantages: torch.Tensor,
    mask: torch.Tensor, *, is_config: ISConfig | None = None, **options: Any,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """The PPO clipped surrogate with ``old = behav_logp`` (:func:`learner.algorithms.core.clip_loss`
    and its ``options``); ``prox_logp`` and ``is_config`` are not read. ``[B, T]`` log-probs under
    the current policy (with grad), the proximal and the behaviour policy, advantages and mask."""
    return clip_loss(logp, behav_logp, advantages, mask, **options)
