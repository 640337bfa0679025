"""Online DPO loss over (chosen, rejected) response pairs against a reference policy.

A pure function like those of :mod:`learner.losses`: tensors in, a scalar loss and a
``NamedTuple`` of detached stats out. The pairs are the best and worst response of each group
by reward (:func:`learner.advantages.select_dpo_pairs`; for a learner batch with partial groups,
:func:`learner.batch_advantages.dpo_pairs`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from learner.masked import bool_mask, check_same_shape, masked_mean, where_real


class DPOStats(NamedTuple):
    """Detached scalars over valid pairs."""

    loss: torch.Tensor
    reward_accuracy: torch.Tensor  # fraction with chosen_reward > rejected_reward
    reward_margin: torch.Tensor  # mean(chosen_reward - rejected_reward)
    chosen_reward: torch.Tensor  # mean beta * (pi_c - ref_c)
    rejected_reward: torch.Tensor  # mean beta * (pi_r - ref_r)
    valid_frac: torch.Tensor


def dpo_loss(
    policy_chosen_logp_sum: torch.Tensor,
    policy_rejected_logp_sum: torch.Tensor,
    ref_chosen_logp_sum: torch.Tensor,
    ref_rejected_logp_sum: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, DPOStats]:
    """DPO loss (Rafailov et al. 2023), conservative variant with label smoothing.

    ``h = (pi_c - pi_r) - (ref_c - ref_r)`` (sequence log-prob sums);
    ``loss = -(1 - eps) * logsigmoid(beta * h) - eps * logsigmoid(-beta * h)``
    (cDPO, Mitchell 2023, "A note on DPO with noisy preferences"), averaged
    over valid pairs (0 if none). Implicit rewards ``beta * (pi - ref)``.

    Args:
        policy_chosen_logp_sum, policy_rejected_logp_sum (torch.Tensor): ``[G]`` policy
            log-prob sums over each response (with grad).
        ref_chosen_logp_sum, ref_rejected_logp_sum (torch.Tensor): ``[G]`` the reference's.
        beta (float): inverse temperature, > 0.
        label_smoothing (float): assumed label-flip probability, in [0, 0.5).
        valid (torch.Tensor | None): ``[G]`` bool; invalid pairs are ignored.

    Returns:
        tuple[torch.Tensor, DPOStats]: scalar loss and detached stats.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    pc, pr = policy_chosen_logp_sum, policy_rejected_logp_sum
    rc, rr = ref_chosen_logp_sum, ref_rejected_logp_sum
    v = torch.ones_like(pc, dtype=torch.bool) if valid is None else bool_mask(valid)
    check_same_shape(pc=pc, pr=pr, rc=rc, rr=rr, valid=v)
    pc, pr = where_real(pc, v), where_real(pr, v)
    rc, rr = where_real(rc, v).detach(), where_real(rr, v).detach()
    logits = (pc - pr) - (rc - rr)
    losses = (
        -(1.0 - label_smoothing) * F.logsigmoid(beta * logits)
        - label_smoothing * F.logsigmoid(-beta * logits)
    )
    loss = masked_mean(losses, v)
    with torch.no_grad():
        chosen_rewards = beta * (pc - rc).detach()
        rejected_rewards = beta * (pr - rr).detach()
        stats = DPOStats(
            loss=loss.detach(),
            reward_accuracy=masked_mean((chosen_rewards > rejected_rewards).to(pc.dtype), v),
            reward_margin=masked_mean(chosen_rewards - rejected_rewards, v),
            chosen_reward=masked_mean(chosen_rewards, v),
            rejected_reward=masked_mean(rejected_rewards, v),
            valid_frac=v.to(pc.dtype).mean(),
        )
    return loss, stats
