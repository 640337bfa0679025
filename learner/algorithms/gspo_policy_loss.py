"""``algo.policy_loss=gspo``: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071),
one importance ratio per response, clipped per response, around the proximal policy."""

from __future__ import annotations

from typing import Any

import torch

from learner.algorithms import register_policy_loss
from learner.algorithms.core import PolicyLossStats, bool_mask, check_same_shape, clip_loss, is_weights, masked_mean, where_real
from rlhf_core.choices import ISLevel, PolicyLoss
from rlhf_core.config import ISConfig

DEFAULT_IS = ISConfig(level=ISLevel.sequence)  # read-only: the losses never change their settings


@register_policy_loss(PolicyLoss.gspo, importance_sampling=True)
def gspo_loss(
    logp: torch.Tensor, prox_logp: torch.Tensor, behav_logp: torch.Tensor, advantages: torch.Tensor,
    mask: torch.Tensor, *, is_config: ISConfig = DEFAULT_IS, **options: Any,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """GSPO's sequence-level clipped surrogate (the paper's eq. 5) in its GSPO-token form (eq. 13-14,
    as verl's ``compute_policy_loss_gspo``), with the trust region around the proximal policy and a
    sequence-level weight for the behaviour policy:

        s_i    = exp(mean_t (logp_t - prox_logp_t))                  (eq. 7: (pi/pi_prox)^(1/|y_i|))
        s_i,t  = sg(s_i) * pi(y_t) / sg(pi(y_t))                      (eq. 14: value s_i, gradient of log pi(y_t))
        w_i    = exp(mean_t (prox_logp_t - behav_logp_t))             (detached, corrected per is_config)
        loss_t = w_i * max(-A_t * s_i,t, -A_t * clip(s_i,t, 1 - eps_low, 1 + eps_high))

    Old policy: pi_prox, the learner's weights before this update (as in decoupled PPO), so the
    trust region is around recent weights whatever the samples' staleness; the behaviour policy
    mu enters only through ``w_i``, the geometric mean of the response's token weights pi_prox/mu
    (``algo.is_level=sequence``, checked at start-up, with ``algo.seq_tis_cap`` / the
    ``algo.seq_mis_*`` band): GSPO's argument against token-level ratios applies to this weight too.

    With ``A_t = A_i`` on every token (the group-relative estimators) the gradient is GSPO's
    (eq. 10 = eq. 17), ``-A_i s_i mean_t grad log pi(y_t)`` per response, and the clip acts on whole responses
    (their tokens share ``s_i``); per-token advantages are what the token form adds. The paper's
    ``1/G sum_i`` is ``agg_mode=seq-mean-token-mean`` and its clip range 3e-4 / 4e-4 (§5.1, with each batch in 4 minibatches), both
    set by ``experiment=gspo``: the defaults' 0.2 would never clip a geometric mean. The mean is
    over the tokens ``logp`` has (a token top-k/top-p filters out, log pi = -inf, gets ratio 0 and
    no gradient, as in the PPO clip). The ratio statistics (``ratio_*``, ``approx_kl``,
    ``clip_frac``) are of ``s_i`` on every token; the clip ``options`` are
    :func:`learner.algorithms.core.clip_loss`'s. Tensors ``[B, T]``: log-probs under the current
    policy (with grad), the proximal and the behaviour policy, advantages and mask.
    """
    check_same_shape(logp=logp, prox_logp=prox_logp, behav_logp=behav_logp, mask=mask)
    m = bool_mask(mask)
    prox = where_real(prox_logp, m).detach()
    live = m & torch.isfinite(logp.detach())
    seq_log_ratio = masked_mean(where_real(logp.detach(), live) - prox, live, dim=-1).unsqueeze(-1)
    # logp - seq_old = logp - sg(logp) + sg(log s_i): s_i's value, each token's own gradient
    seq_old = torch.where(live, logp.detach() - seq_log_ratio, prox)
    isw = is_weights(prox, where_real(behav_logp, m), m, is_config)
    return clip_loss(logp, seq_old, advantages, mask, **options, importance=isw)
