"""The names of the learner's algorithm choices, written once.

They type the config schema (``AlgoConfig``: OmegaConf refuses any other value at composition)
and key the learner's registry (``learner/algorithms/``: one module registers itself under each
name). A member is its own name, which is what OmegaConf matches a YAML value against, and
equals that string (``Estimator.grpo == "grpo"``).
"""

from __future__ import annotations

from enum import StrEnum


class Estimator(StrEnum):
    """``algo.estimator``: the advantage estimator, and with it the family of losses."""

    grpo = "grpo"  # group-relative, scaled by the group's std (learner/algorithms/group_relative.py)
    dr_grpo = "dr_grpo"  # group-relative, mean-centred only
    rloo = "rloo"  # leave-one-out baseline
    reinforce_pp = "reinforce_pp"  # learner/algorithms/reinforce_pp.py
    gae = "gae"  # PPO with a critic (learner/algorithms/gae.py)
    dpo = "dpo"  # online DPO on best vs worst of a group (learner/algorithms/dpo.py)


class PolicyLoss(StrEnum):
    """``algo.policy_loss`` of the estimators trained by a policy gradient (all but dpo)."""

    decoupled = "decoupled"  # AReaL's decoupled PPO with IS correction (learner/algorithms/decoupled_policy_loss.py)
    ppo = "ppo"  # plain PPO, behaviour policy as old (learner/algorithms/ppo_policy_loss.py)


class ISCorrection(StrEnum):
    """``algo.is_correction``: what the decoupled loss does with its weight ``w = pi_prox / mu``."""

    none = "none"  # keep it
    tis = "tis"  # truncate it at the cap
    mis = "mis"  # zero it outside the band


class ISLevel(StrEnum):
    """``algo.is_level``: ``w`` per token, or the geometric mean of a response's token weights."""

    token = "token"
    sequence = "sequence"
