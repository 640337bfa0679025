"""``algo.estimator=grpo | dr_grpo | rloo``: each response's advantage is its reward against a
baseline from the other responses to its prompt, the same on every token, trained by the policy
loss (:mod:`learner.algorithms.policy_gradient`).

A batch's groups may be partial (a sample dead-lettered): :func:`per_group` runs an estimator
once per distinct group size over all groups of that size (vectorised; no Python loop over
groups). A group of one sample has no baseline: its advantage is 0. With the KL as a reward
penalty (``algo.kl_mode=reward``), as OpenRLHF does, the sequence advantage is combined with
the per-token KL return, ``A_t = A_seq - kl_coef * sum_{t'>=t} kl_t'``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from learner.algorithms import register_algorithm
from learner.algorithms.core import bool_mask, check_groups, rows_by_size, where_real
from learner.algorithms.policy_gradient import AdvantageFn, AdvantageInputs, PolicyGradient
from rlhf_core.choices import Estimator
from rlhf_core.config import AlgoConfig


@torch.no_grad()
def group_advantages(rewards: torch.Tensor, group_size: int, scale_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO group-relative advantages (Shao et al. 2024, DeepSeekMath): ``[N]`` of the ``[N]``
    sequence rewards of ``N / group_size`` groups, samples ``[g * group_size, (g + 1) * group_size)``
    forming group ``g``.

    ``A_i = (r_i - mean_group) / (std_group + eps)`` with the unbiased std of
    the group; ``scale_std=False`` gives Dr.GRPO (Liu et al. 2025),
    ``A_i = r_i - mean_group``. With ``group_size == 1`` the advantage is 0.
    """
    check_groups(rewards, group_size, min_size=1)
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
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024): ``[N]`` advantages of
    ``[N]`` sequence rewards in groups of ``group_size = k >= 2``, as :func:`group_advantages`.

    ``A_i = r_i - (sum_group - r_i) / (k - 1)``: the baseline is the mean of
    the other ``k - 1`` samples of the same prompt.
    """
    check_groups(rewards, group_size, min_size=2)
    grouped = rewards.view(-1, group_size)
    baseline = (grouped.sum(dim=-1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - baseline).reshape(-1)


@torch.no_grad()
def per_group(
    fn: Callable[[torch.Tensor, int], torch.Tensor], rewards: torch.Tensor, group_sizes: torch.Tensor, min_size: int
) -> torch.Tensor:
    """``[B]``: ``fn(rewards_of_equal_sized_groups, size)`` per distinct group size (an estimator
    taking ``([n * size], size) -> [n * size]``); 0 for groups below ``min_size``. ``rewards``
    ``[B]`` with groups contiguous, ``group_sizes`` ``[G]`` summing to ``B``."""
    if int(group_sizes.sum()) != rewards.shape[0]:
        raise ValueError(f"group sizes sum to {int(group_sizes.sum())} but there are {rewards.shape[0]} rewards")
    out = torch.zeros_like(rewards)
    for size, rows in rows_by_size(group_sizes).items():
        if size >= min_size:
            out[rows] = fn(rewards[rows], size)
    return out


@torch.no_grad()
def reverse_cumsum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` -> ``y_t = sum_{t' >= t} x_t'`` over real tokens (0 at padding)."""
    m = bool_mask(mask)
    xs = where_real(x, m)
    return where_real(xs.flip(-1).cumsum(-1).flip(-1), m)


def group_relative(estimate: Callable[[torch.Tensor, int], torch.Tensor]) -> AdvantageFn:
    """The advantages of a family whose baseline ``estimate`` computes over equal-sized groups."""

    @torch.no_grad()
    def advantages(algo: AlgoConfig, x: AdvantageInputs) -> tuple[torch.Tensor, None]:
        # over the whole batch (a group may span ranks), then this rank's rows
        seq_adv = per_group(estimate, x.rewards, x.group_sizes, 2)[x.rows]
        m = bool_mask(x.mask)
        adv = where_real(seq_adv[:, None].expand_as(m).to(torch.float32), m)
        if x.kl is not None:
            adv = adv - algo.kl_coef * reverse_cumsum(x.kl, m)
        return adv, None

    return advantages


register_algorithm(Estimator.grpo, PolicyGradient(group_relative(lambda r, k: group_advantages(r, k, scale_std=True))))
register_algorithm(Estimator.dr_grpo, PolicyGradient(group_relative(lambda r, k: group_advantages(r, k, scale_std=False))))
register_algorithm(Estimator.rloo, PolicyGradient(group_relative(rloo_advantages)))
