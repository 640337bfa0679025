"""``algo.estimator=gae``: PPO with a critic. Generalised advantage estimation from the critic's
values before the update, the policy trained by the policy loss
(:mod:`learner.algorithms.policy_gradient`) and the critic by the clipped value loss on the
returns; with ``algo.vtrace`` the critic's targets are V-trace's, corrected for the staleness
of the behaviour policy (the policy's own correction is the decoupled loss's IS weight).

Masked positions *inside* a sequence (e.g. tool-output tokens between two generated spans)
are transparent to the reverse scans: the recursion goes from one real token straight to the
next real token. After the last real token the episode ends (value 0, or ``bootstrap_value``
for V-trace).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from learner.algorithms import register_algorithm
from learner.algorithms.core import (
    TOKEN_MEAN,
    aggregate,
    bool_mask,
    check_same_shape,
    masked_mean,
    masked_var,
    token_rewards,
    where_real,
)
from learner.algorithms.policy_gradient import AdvantageInputs, PolicyGradient
from rlhf_core.choices import AggMode, Estimator, check_choice
from rlhf_core.config import AlgoConfig, check_gamma_lam, check_penalties


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016): ``advantages [B, T]`` and
    ``returns [B, T]`` of per-token ``rewards [B, T]`` (:func:`learner.algorithms.core.token_rewards`)
    and ``values [B, T]`` over the real tokens of ``mask``, discount ``gamma`` and ``lam`` in [0, 1].

    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``,
    ``returns_t = A_t + V_t``; ``V`` and ``A`` after the last real token are 0. Vectorised over
    ``B``, reverse loop over ``T``.
    """
    check_gamma_lam(gamma, lam)
    check_same_shape(rewards=rewards, values=values, mask=mask)
    m = bool_mask(mask)
    r, v = where_real(rewards, m), where_real(values, m)
    next_value = torch.zeros_like(r[:, 0])
    last_adv = torch.zeros_like(r[:, 0])
    advs = []
    for t in reversed(range(r.shape[1])):
        m_t = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv_t = delta + gamma * lam * last_adv
        last_adv = torch.where(m_t, adv_t, last_adv)
        next_value = torch.where(m_t, v[:, t], next_value)
        advs.append(where_real(adv_t, m_t))
    advantages = torch.stack(advs[::-1], dim=1)
    return advantages, where_real(advantages + v, m)


@torch.no_grad()
def vtrace(
    behaviour_logp: torch.Tensor,
    target_logp: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor | None,
    mask: torch.Tensor,
    gamma: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace targets ``vs [B, T]`` and policy-gradient advantages ``[B, T]`` (Espeholt et al.
    2018, IMPALA) of ``[B, T]`` log-probs under the sampling policy mu and the evaluated policy pi,
    per-token rewards and values ``V(x_t)``, over the real tokens of ``mask``.

    With ``rho_t = min(rho_bar, pi/mu)``, ``c_t = min(c_bar, pi/mu)`` (both bars > 0) and
    ``delta_t = rho_t (r_t + gamma V_{t+1} - V_t)`` (paper eq. 1):

        v_s = V_s + sum_{t>=s} gamma^{t-s} (prod_{i=s}^{t-1} c_i) delta_t
            = V_s + delta_s + gamma c_s (v_{s+1} - V_{s+1})      (reverse scan)
        pg_advantage_s = rho_s (r_s + gamma v_{s+1} - V_s)

    After the last real token ``V = v = bootstrap_value`` (``[B]``; 0 if None, i.e. the episode
    terminated). The paper assumes ``rho_bar >= c_bar``.
    """
    check_gamma_lam(gamma)
    if not rho_bar > 0 or not c_bar > 0:
        raise ValueError(f"rho_bar and c_bar must be > 0, got rho_bar={rho_bar}, c_bar={c_bar}")
    check_same_shape(
        behaviour_logp=behaviour_logp, target_logp=target_logp, rewards=rewards, values=values, mask=mask
    )
    m = bool_mask(mask)
    r, v = where_real(rewards, m), where_real(values, m)
    rho = torch.exp(where_real(target_logp, m) - where_real(behaviour_logp, m))
    clipped_rho = torch.clamp(rho, max=rho_bar)
    cs = torch.clamp(rho, max=c_bar)
    if bootstrap_value is None:
        bootstrap_value = torch.zeros_like(r[:, 0])
    if bootstrap_value.shape != r.shape[:1]:
        raise ValueError(
            f"bootstrap_value must have shape [B]={tuple(r.shape[:1])}, got {tuple(bootstrap_value.shape)}"
        )
    next_value = bootstrap_value.to(r.dtype)  # V_{t+1}
    next_vs = next_value.clone()  # v_{t+1}
    acc = torch.zeros_like(next_value)  # v_{t+1} - V_{t+1}
    vs_list, adv_list = [], []
    for t in reversed(range(r.shape[1])):
        m_t = m[:, t]
        delta = clipped_rho[:, t] * (r[:, t] + gamma * next_value - v[:, t])
        vs_minus_v = delta + gamma * cs[:, t] * acc
        pg_adv = clipped_rho[:, t] * (r[:, t] + gamma * next_vs - v[:, t])
        vs_t = v[:, t] + vs_minus_v
        acc = torch.where(m_t, vs_minus_v, acc)
        next_vs = torch.where(m_t, vs_t, next_vs)
        next_value = torch.where(m_t, v[:, t], next_value)
        vs_list.append(where_real(vs_t, m_t))
        adv_list.append(where_real(pg_adv, m_t))
    return torch.stack(vs_list[::-1], dim=1), torch.stack(adv_list[::-1], dim=1)


class ValueLossStats(NamedTuple):
    loss: torch.Tensor  # aggregated value loss, detached
    clip_frac: torch.Tensor  # tokens where the clipped error is the larger one
    value_mean: torch.Tensor
    explained_variance: torch.Tensor  # 1 - Var[returns - values] / Var[returns]


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float | None = 0.2,
    agg_mode: AggMode = TOKEN_MEAN,
    norm_len: int | None = None,
) -> tuple[torch.Tensor, ValueLossStats]:
    """Critic loss with PPO value clipping, a scalar and detached stats, of ``[B, T]`` current
    value predictions (with grad), those before the update, and the targets, aggregated over the
    real tokens of ``mask`` as :func:`learner.algorithms.core.aggregate` does.

    ``vf_loss1 = (values - returns)^2``;
    ``values_clipped = old_values + clip(values - old_values, -eps, eps)``;
    ``vf_loss2 = (values_clipped - returns)^2``; per-token loss
    ``0.5 * max(vf_loss1, vf_loss2)`` (OpenAI baselines ppo2). With
    ``clip_eps=None`` it is ``0.5 * vf_loss1``.
    """
    check_choice("agg_mode", agg_mode, AggMode)
    check_penalties(value_clip=clip_eps)
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    m = bool_mask(mask)
    values = where_real(values, m)
    old_values, returns = where_real(old_values, m).detach(), where_real(returns, m).detach()
    vf_loss1 = (values - returns) ** 2
    if clip_eps is None:
        vf_losses = vf_loss1
        clipped = torch.zeros_like(m)
    else:
        values_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
        vf_loss2 = (values_clipped - returns) ** 2
        vf_losses = torch.maximum(vf_loss1, vf_loss2)
        clipped = vf_loss2 > vf_loss1
    loss = aggregate(0.5 * vf_losses, m, mode=agg_mode, norm_len=norm_len)
    with torch.no_grad():
        v = values.detach()
        var_ret = masked_var(returns, m, unbiased=False)
        ev = 1.0 - masked_var(returns - v, m, unbiased=False) / var_ret.clamp(min=1e-8)
        stats = ValueLossStats(
            loss=loss.detach(),
            clip_frac=masked_mean(clipped.to(v.dtype), m),
            value_mean=masked_mean(v, m),
            explained_variance=ev,
        )
    return loss, stats


@torch.no_grad()
def advantages(algo: AlgoConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and the critic's targets (GAE's returns, or V-trace's with ``algo.vtrace``)."""
    if x.values is None:
        raise ValueError("estimator gae needs critic values")
    m = bool_mask(x.mask)
    r_tok = token_rewards(x.rewards[x.rows], m, x.kl, algo.kl_coef if x.kl is not None else 0.0)
    adv, returns = gae(r_tok, x.values, m, gamma=algo.gamma, lam=algo.lam)
    if algo.vtrace:
        if x.behav is None or x.prox is None:
            raise ValueError("vtrace needs behaviour and proximal log-probs")
        returns, _ = vtrace(x.behav, x.prox, r_tok, x.values, None, m, gamma=algo.gamma,
                            rho_bar=algo.vtrace_rho_bar, c_bar=algo.vtrace_c_bar)
    return adv, returns


register_algorithm(Estimator.gae, PolicyGradient(advantages, value_loss=value_loss))
