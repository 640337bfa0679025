"""Pure advantage / return estimators: the per-algorithm math on equal-sized groups.

Tensors in, tensors out, no config: GAE, GRPO/Dr.GRPO, RLOO, REINFORCE++, V-trace, per-token
rewards with a KL penalty, and online-DPO pair selection (best vs worst sample of each group;
the loss is :func:`learner.dpo_loss.dpo_loss`). :mod:`learner.batch_advantages` applies them to
a learner batch (partial groups, config, statistics over data-parallel ranks).

Conventions of :mod:`learner.masked`: per-token tensors are ``[B, T]``, ``mask`` is a bool/float
``[B, T]`` tensor of response tokens (non-zero = real token), masked positions never affect
results (even if they hold NaN) and are 0 in every per-token output.

Masked positions *inside* a sequence (e.g. tool-output tokens between two
generated spans) are transparent to the reverse scans: the recursion goes
from one real token straight to the next real token. After the last real
token the episode ends (value 0, or ``bootstrap_value`` for V-trace).

Everything here runs under ``torch.no_grad()``: advantages and targets are
constants for the losses.
"""

from __future__ import annotations

import math

import torch

from learner.masked import bool_mask, check_same_shape, masked_whiten, where_real


def _check_gamma_lam(gamma: float, lam: float = 1.0) -> None:
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam}")


def _check_groups(rewards: torch.Tensor, group_size: int, min_size: int) -> None:
    if group_size < min_size:
        raise ValueError(f"group_size must be >= {min_size}, got {group_size}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"number of rewards N={rewards.numel()} is not divisible by group_size={group_size}"
        )


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016).

    ``delta_t = r_t + gamma * V_{t+1} - V_t``,
    ``A_t = delta_t + gamma * lam * A_{t+1}``, ``returns_t = A_t + V_t``;
    ``V`` and ``A`` after the last real token are 0. Vectorised over ``B``,
    reverse loop over ``T``.

    Args:
        rewards (torch.Tensor): ``[B, T]`` per-token rewards (see :func:`token_rewards`).
        values (torch.Tensor): ``[B, T]`` value predictions.
        mask (torch.Tensor): ``[B, T]``, non-zero = real token.
        gamma (float): discount in [0, 1].
        lam (float): GAE lambda in [0, 1].

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``advantages [B, T]``, ``returns [B, T]``.
    """
    _check_gamma_lam(gamma, lam)
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
def group_advantages(
    rewards: torch.Tensor, group_size: int, scale_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO group-relative advantages (Shao et al. 2024, DeepSeekMath).

    ``A_i = (r_i - mean_group) / (std_group + eps)`` with the unbiased std of
    the group; ``scale_std=False`` gives Dr.GRPO (Liu et al. 2025),
    ``A_i = r_i - mean_group``. Samples ``[g * group_size, (g + 1) * group_size)``
    form group ``g``. With ``group_size == 1`` the advantage is 0.

    Args:
        rewards (torch.Tensor): ``[N]`` sequence rewards, ``N = G * group_size``.
        group_size (int): samples per prompt, >= 1.
        scale_std (bool): divide by the group std (GRPO) or not (Dr.GRPO).
        eps (float): added to the std.

    Returns:
        torch.Tensor: ``[N]`` per-sequence advantages.
    """
    _check_groups(rewards, group_size, min_size=1)
    # in float64: a float32 mean of equal rewards can miss them by an ulp, and dividing that by a
    # std of an ulp gave the whole group an advantage of up to 1 (same sign) where it is 0
    grouped = rewards.view(-1, group_size).double()
    adv = grouped - grouped.mean(dim=-1, keepdim=True)
    if scale_std:
        std = grouped.std(dim=-1, keepdim=True, correction=1 if group_size > 1 else 0)
        adv = adv / (std + eps)
    return adv.reshape(-1).to(rewards.dtype)


@torch.no_grad()
def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024).

    ``A_i = r_i - (sum_group - r_i) / (k - 1)``: the baseline is the mean of
    the other ``k - 1`` samples of the same prompt.

    Args:
        rewards (torch.Tensor): ``[N]`` sequence rewards, ``N = G * group_size``.
        group_size (int): samples per prompt ``k``, >= 2.

    Returns:
        torch.Tensor: ``[N]`` per-sequence advantages.
    """
    _check_groups(rewards, group_size, min_size=2)
    grouped = rewards.view(-1, group_size)
    baseline = (grouped.sum(dim=-1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - baseline).reshape(-1)


@torch.no_grad()
def token_rewards(
    seq_rewards: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards: sequence reward on the last real token, minus a KL penalty.

    ``r_t = -kl_coef * kl_t + [t == last real token] * seq_reward``
    (KL as a reward penalty, as in Ziegler et al. 2019 / OpenRLHF). A
    sequence without real tokens gets no reward.

    Args:
        seq_rewards (torch.Tensor): ``[B]`` scalar rewards.
        mask (torch.Tensor): ``[B, T]``, non-zero = real token.
        kl (torch.Tensor | None): ``[B, T]`` per-token KL estimate (see
            :func:`learner.losses.kl_estimate`), or None.
        kl_coef (float): KL penalty coefficient, >= 0.

    Returns:
        torch.Tensor: ``[B, T]`` per-token rewards (0 at masked positions).
    """
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    m = bool_mask(mask)
    if seq_rewards.shape != m.shape[:1]:
        raise ValueError(
            f"seq_rewards must have shape [B]={tuple(m.shape[:1])}, got {tuple(seq_rewards.shape)}"
        )
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)
    last = torch.where(m, positions, torch.full_like(positions, -1)).max(dim=-1, keepdim=True).values
    is_last = m & (positions == last)
    out = torch.where(is_last, seq_rewards.unsqueeze(-1), torch.zeros((), dtype=seq_rewards.dtype, device=seq_rewards.device))
    if kl is not None:
        check_same_shape(kl=kl, mask=m)
        out = out - kl_coef * where_real(kl, m)
    return where_real(out, m)


@torch.no_grad()
def reinforce_pp_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, eps: float = 1e-8
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantages (Hu 2025, "REINFORCE++").

    ``G_t = r_t + gamma * G_{t+1}`` per token (no critic), then whitened over
    all real tokens of the batch (global batch normalisation, biased var).

    Args:
        rewards (torch.Tensor): ``[B, T]`` per-token rewards, or ``[B]``
            sequence rewards (placed on the last real token, no KL).
        mask (torch.Tensor): ``[B, T]``, non-zero = real token.
        gamma (float): discount in [0, 1].
        eps (float): added to the variance when whitening.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: whitened ``advantages [B, T]`` and
        the un-whitened discounted ``returns [B, T]``.
    """
    _check_gamma_lam(gamma)
    m = bool_mask(mask)
    if rewards.dim() == 1:
        rewards = token_rewards(rewards, m)
    check_same_shape(rewards=rewards, mask=m)
    r = where_real(rewards, m)
    running = torch.zeros_like(r[:, 0])
    rets = []
    for t in reversed(range(r.shape[1])):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        rets.append(where_real(running, m[:, t]))
    returns = torch.stack(rets[::-1], dim=1)
    return masked_whiten(returns, m, eps=eps), returns


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
    """V-trace targets and policy-gradient advantages (Espeholt et al. 2018, IMPALA).

    With ``rho_t = min(rho_bar, pi/mu)``, ``c_t = min(c_bar, pi/mu)`` and
    ``delta_t = rho_t (r_t + gamma V_{t+1} - V_t)`` (paper eq. 1):

        v_s = V_s + sum_{t>=s} gamma^{t-s} (prod_{i=s}^{t-1} c_i) delta_t
            = V_s + delta_s + gamma c_s (v_{s+1} - V_{s+1})      (reverse scan)
        pg_advantage_s = rho_s (r_s + gamma v_{s+1} - V_s)

    After the last real token ``V = v = bootstrap_value`` (0 if None, i.e.
    the episode terminated). The paper assumes ``rho_bar >= c_bar``.

    Args:
        behaviour_logp (torch.Tensor): ``[B, T]`` log mu (sampling policy).
        target_logp (torch.Tensor): ``[B, T]`` log pi (policy being evaluated).
        rewards (torch.Tensor): ``[B, T]`` per-token rewards.
        values (torch.Tensor): ``[B, T]`` value predictions ``V(x_t)``.
        bootstrap_value (torch.Tensor | None): ``[B]`` value after the last real token.
        mask (torch.Tensor): ``[B, T]``, non-zero = real token.
        gamma (float): discount in [0, 1].
        rho_bar (float): truncation of the TD-error weights, > 0.
        c_bar (float): truncation of the trace-cutting weights, > 0.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``vs [B, T]`` (value targets) and
        ``pg_advantages [B, T]``.
    """
    _check_gamma_lam(gamma)
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


@torch.no_grad()
def select_dpo_pairs(
    rewards: torch.Tensor, group_size: int, *, eligible: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick (best, worst) by reward within each group of ``group_size`` samples.

    Samples ``[g * group_size, (g + 1) * group_size)`` form group ``g``. Ties
    resolve to the lowest index. A group whose rewards are all equal has no
    preference and is marked invalid. With ``eligible``, best and worst are
    picked among the eligible samples only (an ineligible one counts as reward
    ``-inf`` for the best and ``+inf`` for the worst), so a group with fewer than
    two eligible samples of different rewards is invalid.

    Args:
        rewards (torch.Tensor): ``[N]`` scalar (finite) rewards, ``N = G * group_size``.
        group_size (int): samples per prompt, >= 2.
        eligible (torch.Tensor | None): ``[N]`` bool, the samples that may be paired (None: all).

    Returns:
        tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ``chosen_idx [G]``,
        ``rejected_idx [G]`` (indices into ``rewards``) and ``valid [G]`` (bool).
    """
    _check_groups(rewards, group_size, min_size=2)
    grouped = rewards.detach().view(-1, group_size)
    offsets = torch.arange(grouped.shape[0], device=rewards.device) * group_size
    if eligible is None:
        best, chosen = grouped.max(dim=-1)
        worst, rejected = grouped.min(dim=-1)
    else:
        ok = eligible.view(-1, group_size)
        best, chosen = torch.where(ok, grouped, -math.inf).max(dim=-1)
        worst, rejected = torch.where(ok, grouped, math.inf).min(dim=-1)
    return chosen + offsets, rejected + offsets, best > worst
