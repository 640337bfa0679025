"""``algo.policy_loss=decoupled``: PPO for off-policy (stale) samples, the trust region around the
proximal policy and the tokens weighted by proximal over behaviour policy (AReaL)."""

from __future__ import annotations

from typing import Any

import torch

from learner.algorithms import register_policy_loss
from learner.algorithms.core import PolicyLossStats, bool_mask, check_same_shape, clip_loss, is_weights, where_real
from rlhf_core.choices import PolicyLoss
from rlhf_core.config import ISConfig

DEFAULT_IS = ISConfig()  # read-only: the losses never change their settings


@register_policy_loss(PolicyLoss.decoupled, importance_sampling=True)
def decoupled_ppo_loss(
    logp: torch.Tensor, prox_logp: torch.Tensor, behav_logp: torch.Tensor, advantages: torch.Tensor,
    mask: torch.Tensor, *, is_config: ISConfig = DEFAULT_IS, **options: Any,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Decoupled PPO objective for off-policy (stale) samples.

    Hilton et al. 2021, "Batch size-invariance for policy optimization";
    Fu et al. 2025, "AReaL: a large-scale asynchronous reinforcement learning
    system for language reasoning". The trust region is centred on the
    *proximal* policy ``pi_prox`` (recent learner weights) while the data were
    sampled by the *behaviour* policy ``pi_behav`` (stale worker weights):

        ratio = exp(logp - prox_logp)                       (clipped as in PPO)
        w     = exp(prox_logp - behav_logp)                 (detached IS weight)
        loss_t = w_t * max(-A_t * ratio_t, -A_t * clip(ratio_t, 1-eps_low, 1+eps_high))

    ``w`` is taken per token or per sequence and truncated or masked as ``is_config`` says
    (:class:`rlhf_core.config.ISConfig`); the clip ``options`` are
    :func:`learner.algorithms.core.clip_loss`'s. With ``behav_logp == prox_logp`` (and a
    band/cap admitting 1) this is exactly :func:`learner.algorithms.ppo_policy_loss.ppo_clip_loss`.
    Tensors ``[B, T]``: log-probs under the current policy (with grad), the proximal and the
    behaviour policy, advantages and mask.
    """
    check_same_shape(prox_logp=prox_logp, behav_logp=behav_logp, mask=mask)
    m = bool_mask(mask)
    isw = is_weights(where_real(prox_logp, m).detach(), where_real(behav_logp, m), m, is_config)
    return clip_loss(logp, prox_logp, advantages, mask, **options, importance=isw)
