"""``algo.estimator=dpo``: online DPO. The best and worst response of each group by reward form a
pair, trained against the reference policy by the DPO loss on their sequence log-probs; no
advantages, no pi_prox. Among the responses with a token in the loss mask only
(``algo.overlong=mask``: those that finished).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from learner.algorithms import Work, register_algorithm
from learner.algorithms.core import bool_mask, check_groups, check_same_shape, masked_mean, masked_sum, rows_by_size, where_real
from learner.batch import TrainBatch
from rlhf_core.choices import Estimator
from rlhf_core.config import check_penalties

if TYPE_CHECKING:
    from learner.algorithms import Updater
    from learner.stats import MetricSums


@torch.no_grad()
def select_dpo_pairs(
    rewards: torch.Tensor, group_size: int, *, eligible: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``chosen [G]`` and ``rejected [G]`` indices into the ``[N]`` (finite) ``rewards`` and
    ``valid [G]``: the best and the worst sample by reward of each group of ``group_size >= 2``,
    samples ``[g * group_size, (g + 1) * group_size)`` forming group ``g``.

    Ties resolve to the lowest index. A group whose rewards are all equal has no
    preference and is marked invalid. With ``eligible`` (``[N]`` bool), best and worst are
    picked among the eligible samples only (an ineligible one counts as reward
    ``-inf`` for the best and ``+inf`` for the worst), so a group with fewer than
    two eligible samples of different rewards is invalid.
    """
    check_groups(rewards, group_size, min_size=2)
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


@torch.no_grad()
def dpo_pairs(rewards: torch.Tensor, group_sizes: torch.Tensor,
              eligible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Best vs worst sample of every group with at least 2 samples and unequal rewards (groups
    contiguous, partial ones too); with ``eligible`` (``[B]`` bool), best vs worst of the
    group's eligible samples.

    Returns:
        ``chosen [P]`` and ``rejected [P]`` row indices of the valid pairs, in group order.
    """
    chosen, rejected, group_of = [], [], []
    for size, rows in rows_by_size(group_sizes).items():
        if size < 2:
            continue
        c, r, valid = select_dpo_pairs(rewards[rows], size, eligible=None if eligible is None else eligible[rows])
        chosen.append(rows[c][valid])
        rejected.append(rows[r][valid])
        group_of.append(rows[c][valid])
    if not chosen:
        empty = torch.zeros(0, dtype=torch.long, device=rewards.device)
        return empty, empty
    chosen_t, rejected_t = torch.cat(chosen), torch.cat(rejected)
    order = torch.argsort(torch.cat(group_of), stable=True)  # back to group order
    return chosen_t[order], rejected_t[order]


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
    """DPO loss (Rafailov et al. 2023), conservative variant with label smoothing: a scalar and
    detached stats of the ``[G]`` log-prob sums over each chosen and rejected response under the
    policy (with grad) and the reference, over the ``valid`` (``[G]`` bool) pairs.

    ``h = (pi_c - pi_r) - (ref_c - ref_r)``;
    ``loss = -(1 - eps) * logsigmoid(beta * h) - eps * logsigmoid(-beta * h)``
    (cDPO, Mitchell 2023, "A note on DPO with noisy preferences"; ``eps = label_smoothing``, the
    assumed label-flip probability in [0, 0.5); ``beta > 0``), averaged over valid pairs (0 if
    none). Implicit rewards ``beta * (pi - ref)``.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    check_penalties(label_smoothing=label_smoothing)
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


class DPO:
    needs_critic = False
    needs_reference = True
    proximal = False

    def prepare(self, up: Updater, batch: TrainBatch, rewards: torch.Tensor, m: MetricSums) -> Work | None:
        """The pairs (chosen then rejected row, pair after pair) on this rank, with the reference's
        log-probs; None when every group is tied (nothing to prefer, no step)."""
        chosen, rejected = dpo_pairs(rewards, batch.group_sizes, eligible=up.passes.loss_mask(batch).any(-1))
        n_pairs = int(chosen.shape[0])
        m.set("loss/dpo_pairs", n_pairs)
        if n_pairs == 0:
            return None
        pair_rows, fillers = up.passes.shard(n_pairs)
        rows = [int(x) for p in pair_rows for x in (chosen[p], rejected[p])]
        local = batch.select(rows, drop=[f for f in fillers for _ in (0, 1)])
        # A token that top-k/top-p filters out under the reference (or, below, the policy) has
        # log-prob -inf: it leaves both sums of its response, so each log-ratio spans the same tokens
        ref = up.passes.reference_logprobs(local)
        valid = torch.tensor([not f for f in fillers for _ in (0, 1)], dtype=torch.bool, device=up.device)
        local = replace(local.with_extras(dpo_ref=ref, dpo_mask=local.policy_mask & torch.isfinite(ref)),
                        row_extras={"pair_valid": valid})  # a data-parallel filler pair is no pair
        tokens = float(batch.attention_mask[torch.cat([chosen, rejected])].sum())
        return Work(local, valid[0::2].double().cpu(), tokens, rows_per_unit=2)

    def loss(self, up: Updater, mb: TrainBatch, denom: float, m: MetricSums) -> None:
        a = up.algo
        logp, _ = up.passes.logprobs(mb, entropy=False)
        ok = mb.token_extras["dpo_mask"] & torch.isfinite(logp.detach())
        sums = masked_sum(logp, ok, dim=-1)
        rs = masked_sum(mb.token_extras["dpo_ref"], ok, dim=-1)
        v = mb.row_extras["pair_valid"][0::2]
        loss, st = dpo_loss(sums[0::2], sums[1::2], rs[0::2], rs[1::2], beta=a.dpo_beta,
                            label_smoothing=a.dpo_label_smoothing, valid=v)
        count = v.sum()
        share = count * (up.engine.world_size / denom) if denom > 0 else 0.0
        up.engine.backward(loss * share)
        m.add("loss/dpo", st.loss, count)
        m.add("loss/dpo_accuracy", st.reward_accuracy, count)
        m.add("loss/dpo_margin", st.reward_margin, count)


register_algorithm(Estimator.dpo, DPO())
