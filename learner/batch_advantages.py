"""Advantages for a learner batch, assembled from the config: partial groups, KL as a reward,
statistics over data-parallel ranks.

The pure estimators in :mod:`learner.advantages` take equal-sized groups and one process's
tensors. A learner batch differs in three ways, handled here:

* **Partial groups.** A group loses members when a sample is dead-lettered, so group sizes
  vary. :func:`per_group` runs an estimator once per distinct size over all groups of that
  size (vectorised; no Python loop over groups). A group of one sample has no baseline: its
  GRPO/RLOO advantage is 0 and it forms no DPO pair.
* **KL as a reward penalty** with group estimators: as OpenRLHF does, the sequence-level
  advantage is combined with the per-token KL return, ``A_t = A_seq - kl_coef * sum_{t'>=t} kl_t'``.
* **Data parallelism.** Each rank holds only its shard of rows, so whitening (REINFORCE++,
  ``normalize_advantages``) uses sums and counts all-reduced across ranks
  (:func:`global_whiten`); with one process it is exactly :func:`learner.masked.masked_whiten`.
"""

from __future__ import annotations

from typing import Callable

import torch

from learner import advantages as adv_fn
from learner.losses import kl_estimate
from learner.masked import bool_mask, masked_sum, where_real
from rlhf_core.config import AlgoConfig

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # in-place sum over ranks; identity when alone

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _rows_by_size(group_sizes: torch.Tensor) -> dict[int, torch.Tensor]:
    """{size: row indices of every group of that size, group after group}."""
    sizes = group_sizes.tolist()
    starts, s0 = [], 0
    for n in sizes:
        starts.append(s0)
        s0 += n
    out: dict[int, list[int]] = {}
    for start, n in zip(starts, sizes):
        out.setdefault(n, []).extend(range(start, start + n))
    return {n: torch.tensor(rows, dtype=torch.long, device=group_sizes.device) for n, rows in out.items()}


@torch.no_grad()
def per_group(
    fn: Callable[[torch.Tensor, int], torch.Tensor], rewards: torch.Tensor, group_sizes: torch.Tensor, min_size: int
) -> torch.Tensor:
    """``fn(rewards_of_equal_sized_groups, size)`` per distinct group size; 0 for groups below ``min_size``.

    Args:
        fn: an estimator of ``learner.advantages`` taking ``([n * size], size)`` -> ``[n * size]``.
        rewards: ``[B]`` sequence rewards, groups contiguous.
        group_sizes: ``[G]`` sizes summing to ``B``.
        min_size: groups smaller than this get 0.

    Returns:
        ``[B]`` per-sample values.
    """
    if int(group_sizes.sum()) != rewards.shape[0]:
        raise ValueError(f"group sizes sum to {int(group_sizes.sum())} but there are {rewards.shape[0]} rewards")
    out = torch.zeros_like(rewards)
    for size, rows in _rows_by_size(group_sizes).items():
        if size >= min_size:
            out[rows] = fn(rewards[rows], size)
    return out


@torch.no_grad()
def group_relative_advantages(estimator: str, rewards: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """``[B]`` sequence advantages for grpo (std-scaled), dr_grpo (mean-centred) or rloo."""
    if estimator == "grpo":
        return per_group(lambda r, k: adv_fn.group_advantages(r, k, scale_std=True), rewards, group_sizes, 2)
    if estimator == "dr_grpo":
        return per_group(lambda r, k: adv_fn.group_advantages(r, k, scale_std=False), rewards, group_sizes, 2)
    if estimator == "rloo":
        return per_group(adv_fn.rloo_advantages, rewards, group_sizes, 2)
    raise ValueError(f"{estimator!r} is not a group-relative estimator ({', '.join(GROUP_ESTIMATORS)})")


@torch.no_grad()
def dpo_pairs(rewards: torch.Tensor, group_sizes: torch.Tensor,
              eligible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Best vs worst sample of every group with at least 2 samples and unequal rewards; with
    ``eligible`` (``[B]`` bool), best vs worst of the group's eligible samples.

    Returns:
        ``chosen [P]`` and ``rejected [P]`` row indices of the valid pairs, in group order.
    """
    chosen, rejected, group_of = [], [], []
    for size, rows in _rows_by_size(group_sizes).items():
        if size < 2:
            continue
        c, r, valid = adv_fn.select_dpo_pairs(rewards[rows], size, eligible=None if eligible is None else eligible[rows])
        chosen.append(rows[c][valid])
        rejected.append(rows[r][valid])
        group_of.append(rows[c][valid])
    if not chosen:
        empty = torch.zeros(0, dtype=torch.long, device=rewards.device)
        return empty, empty
    chosen_t, rejected_t = torch.cat(chosen), torch.cat(rejected)
    order = torch.argsort(torch.cat(group_of), stable=True)  # back to group order
    return chosen_t[order], rejected_t[order]


@torch.no_grad()
def reverse_cumsum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` -> ``y_t = sum_{t' >= t} x_t'`` over real tokens (0 at padding)."""
    m = bool_mask(mask)
    xs = where_real(x, m)
    return where_real(xs.flip(-1).cumsum(-1).flip(-1), m)


@torch.no_grad()
def global_whiten(x: torch.Tensor, mask: torch.Tensor, all_reduce: AllReduce = _identity, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) * rsqrt(var + eps)`` with mean and (biased) variance over the real tokens of
    every rank. One process: identical to ``learner.masked.masked_whiten(x, mask, eps=eps)``."""
    m = bool_mask(mask)
    sums = torch.stack([masked_sum(x, m), m.sum().to(x.dtype)])
    all_reduce(sums)
    mean = sums[0] / sums[1].clamp(min=1)
    sq = masked_sum((where_real(x, m) - mean) ** 2, m).reshape(1)
    all_reduce(sq)
    var = sq[0] / sums[1].clamp(min=1)
    return where_real((where_real(x, m) - mean) * torch.rsqrt(var + eps), m)


@torch.no_grad()
def kl_per_token(algo: AlgoConfig, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` KL(pi || ref) estimate used as a reward penalty."""
    return kl_estimate(logp, ref_logp, mask, kind=algo.kl_estimator)


@torch.no_grad()
def token_rewards(algo: AlgoConfig, seq_rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None) -> torch.Tensor:
    """``[b, T]`` per-token rewards of the token-level estimators (reinforce_pp, gae): the sequence
    reward on the last real token, minus ``algo.kl_coef * kl`` on every token when ``kl`` is given
    (the KL as a reward penalty; REINFORCE++ eq. 9 with ``algo.kl_estimator=k1``)."""
    return adv_fn.token_rewards(seq_rewards, mask, kl, algo.kl_coef if kl is not None else 0.0)


@torch.no_grad()
def compute_advantages(
    algo: AlgoConfig,
    seq_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_adv: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
    behav_logp: torch.Tensor | None = None,
    prox_logp: torch.Tensor | None = None,
    all_reduce: AllReduce = _identity,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token advantages (and value targets for gae) for this rank's rows.

    Args:
        algo: estimator, gamma/lam, kl_coef, vtrace and normalisation settings.
        seq_rewards: ``[b]`` (normalised) sequence rewards of this rank's rows.
        mask: ``[b, T]`` response tokens of this rank's rows.
        group_adv: ``[b]`` sequence advantages (group estimators; computed on the whole batch
            by :func:`group_relative_advantages` and sliced to this rank's rows).
        values: ``[b, T]`` critic values at rollout (gae).
        kl: ``[b, T]`` per-token KL when ``algo.kl_mode == "reward"``, else None.
        behav_logp, prox_logp: ``[b, T]`` for V-trace critic targets (``algo.vtrace``).
        all_reduce: sum over data-parallel ranks, for global whitening.

    Returns:
        ``advantages [b, T]`` and ``returns [b, T]`` (critic targets; None without a critic).
    """
    m = bool_mask(mask)
    kl_coef = algo.kl_coef if kl is not None else 0.0
    returns = None
    if algo.estimator in GROUP_ESTIMATORS:
        if group_adv is None:
            raise ValueError(f"estimator {algo.estimator} needs group_adv")
        adv = where_real(group_adv[:, None].expand_as(m).to(torch.float32), m)
        if kl is not None:
            adv = adv - kl_coef * reverse_cumsum(kl, m)
    elif algo.estimator == "reinforce_pp":
        r_tok = token_rewards(algo, seq_rewards, m, kl)
        _, discounted = adv_fn.reinforce_pp_advantages(r_tok, m, gamma=algo.gamma)
        # REINFORCE++ whitens over the global batch: over every rank, not just this one.
        return global_whiten(discounted, m, all_reduce), None
    elif algo.estimator == "gae":
        if values is None:
            raise ValueError("estimator gae needs critic values")
        r_tok = token_rewards(algo, seq_rewards, m, kl)
        adv, returns = adv_fn.gae(r_tok, values, m, gamma=algo.gamma, lam=algo.lam)
        if algo.vtrace:
            if behav_logp is None or prox_logp is None:
                raise ValueError("vtrace needs behaviour and proximal log-probs")
            # Critic targets corrected for the staleness of the behaviour policy; the policy's
            # own correction is the decoupled loss's IS weight, so the GAE advantages stay.
            returns, _ = adv_fn.vtrace(
                behav_logp, prox_logp, r_tok, values, None, m, gamma=algo.gamma,
                rho_bar=algo.vtrace_rho_bar, c_bar=algo.vtrace_c_bar,
            )
    else:
        raise ValueError(f"estimator {algo.estimator!r} has no per-token advantages (dpo uses pairs)")
    if algo.normalize_advantages:
        adv = global_whiten(adv, m, all_reduce)
    return adv, returns
