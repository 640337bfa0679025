"""``algo.policy_loss=cispo``: Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585):
the IS weight is clipped and detached, so no token loses its gradient to the clip."""

from __future__ import annotations

import torch

from learner.algorithms import register_policy_loss
from learner.algorithms.core import (
    TOKEN_MEAN,
    PolicyLossStats,
    aggregate,
    bool_mask,
    check_same_shape,
    is_weights,
    policy_loss_stats,
    where_real,
)
from rlhf_core.choices import AggMode, PolicyLoss, check_choice
from rlhf_core.config import ISConfig, check_clip

DEFAULT_IS = ISConfig()  # read-only: the losses never change their settings


@register_policy_loss(PolicyLoss.cispo, importance_sampling=True)
def cispo_loss(
    logp: torch.Tensor, prox_logp: torch.Tensor, behav_logp: torch.Tensor, advantages: torch.Tensor,
    mask: torch.Tensor, *, is_config: ISConfig = DEFAULT_IS, clip_eps_low: float = 1.0, clip_eps_high: float | None = 0.2,
    dual_clip_c: float | None = None, agg_mode: AggMode = TOKEN_MEAN, norm_len: int | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """CISPO (MiniMax-M1 §3.1, eq. 4-5), its old policy the proximal one, with the behaviour weight:

        r_t    = exp(logp_t - prox_logp_t)                      (pi / pi_prox)
        w_t    = exp(prox_logp_t - behav_logp_t)                (detached, corrected per is_config)
        loss_t = -w_t * sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * logp_t

    The gradient of a token is ``-w_t * clip(r_t) * A_t * grad log pi(y_t)`` whatever ``r_t``:
    where PPO's clip zeroes a token's gradient, CISPO only caps its weight. Old policy: pi_prox,
    the learner's weights before this update (as in decoupled PPO), so ``r_t`` measures this
    update's own drift and ``clip`` bounds it; the staleness of the samples enters through
    ``w_t = pi_prox / mu`` as in the decoupled loss (``algo.is_*``: TIS, MIS or IcePop, per token
    or per response). The product ``w_t * r_t`` is the full ratio pi / mu; each factor is bounded
    by its own setting. MiniMax-M1 sets no lower bound (``eps_low`` large) and tunes only
    ``eps_high``: ``clip_eps_low >= 1`` (``1 - eps_low <= 0``) has none, the default here and
    ``experiment=cispo``'s; ``eps_high`` 0.2 is verl's CISPO example's (the paper gives no value).
    The paper's ``1 / sum_i |o_i|`` is ``agg_mode=token-mean``; there is no dual clip.

    The loss value, ``-sum w clip(r) A log pi``, is the paper's surrogate, not comparable with a
    PPO loss. ``clip_frac`` counts the tokens whose weight was clipped (they still train). A token
    that top-k/top-p filters out under the current weights (log pi = -inf) adds 0 and no gradient.
    Tensors ``[B, T]``: log-probs under the current policy (with grad), the proximal and the
    behaviour policy, advantages and mask.
    """
    high = check_clip(clip_eps_low, clip_eps_high, dual_clip_c, weight_clip=True)
    check_choice("agg_mode", agg_mode, AggMode)
    check_same_shape(logp=logp, prox_logp=prox_logp, behav_logp=behav_logp, advantages=advantages, mask=mask)
    m = bool_mask(mask)
    prox = where_real(prox_logp, m).detach()
    live = m & torch.isfinite(logp.detach())
    logp, advantages = where_real(logp, live), where_real(advantages, m).detach()
    log_ratio = logp.detach() - prox
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, min=1.0 - clip_eps_low, max=1.0 + high)
    isw = is_weights(prox, where_real(behav_logp, m), m, is_config)
    loss_tokens = -isw.w * weight * advantages * logp
    loss = aggregate(where_real(loss_tokens, live), m, mode=agg_mode, norm_len=norm_len)
    # a filtered-out token's ratio is 0 (log -inf), as in the PPO clip's statistics
    stats = policy_loss_stats(loss, where_real(log_ratio, live, float("-inf")), m, clipped=live & (weight != ratio), importance=isw)
    return loss, stats
