"""``algo.estimator=reinforce_pp``: REINFORCE++ (Hu 2025), no critic and no group baseline: each
token's discounted return, whitened over the whole batch (every rank's tokens), trained by the
policy loss (:mod:`learner.algorithms.policy_gradient`). With the KL as a reward penalty its
k1 estimate enters each token's reward (eq. 9; the ``reinforce_pp`` preset)."""

from __future__ import annotations

import torch

from learner.algorithms import register_algorithm
from learner.algorithms.core import bool_mask, check_same_shape, global_whiten, token_rewards, where_real
from learner.algorithms.policy_gradient import AdvantageInputs, PolicyGradient
from rlhf_core.choices import Estimator
from rlhf_core.config import AlgoConfig, check_gamma_lam


@torch.no_grad()
def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++'s returns (Hu 2025, "REINFORCE++"), ``G_t = r_t + gamma * G_{t+1}`` per token
    (no critic): ``[B, T]`` of ``[B, T]`` per-token rewards (or ``[B]`` sequence rewards, placed on
    the last real token) over the real tokens of ``mask``. Its advantages are these whitened
    over all real tokens of the batch (:func:`learner.algorithms.core.global_whiten`)."""
    check_gamma_lam(gamma)
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
    return torch.stack(rets[::-1], dim=1)


@torch.no_grad()
def advantages(algo: AlgoConfig, x: AdvantageInputs) -> tuple[torch.Tensor, None]:
    m = bool_mask(x.mask)
    r_tok = token_rewards(x.rewards[x.rows], m, x.kl, algo.kl_coef if x.kl is not None else 0.0)
    # REINFORCE++ whitens over the global batch: over every rank, not just this one.
    return global_whiten(discounted_returns(r_tok, m, gamma=algo.gamma), m, x.all_reduce), None


register_algorithm(Estimator.reinforce_pp, PolicyGradient(advantages))
