"""learner.algorithms: every name the config takes has its module, a name nothing registered is
refused with the choices, and no learner module outside the package branches on a name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from learner import algorithms
from rlhf_core.choices import Estimator, PolicyLoss
from rlhf_core.config import ConfigError

LEARNER = Path(algorithms.__file__).parent.parent


def test_every_choice_has_its_registered_module():
    assert set(algorithms._ALGORITHMS) == set(Estimator)
    assert set(algorithms._POLICY_LOSSES) == set(PolicyLoss)
    assert algorithms.algorithm("gae").needs_critic and not algorithms.algorithm("grpo").needs_critic
    assert algorithms.algorithm(Estimator.dpo).needs_reference
    assert [e for e in Estimator if e.grouped] == ["grpo", "dr_grpo", "rloo", "dpo"]
    assert algorithms.policy_loss("decoupled").importance_sampling and not algorithms.policy_loss("ppo").importance_sampling


def test_an_unknown_name_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="algo.estimator='ppo2' is not one of grpo, dr_grpo, rloo, reinforce_pp, gae, dpo"):
        algorithms.algorithm("ppo2")
    with pytest.raises(ConfigError, match="algo.policy_loss='gspo' is not one of decoupled, ppo"):
        algorithms.policy_loss("gspo")


def test_no_learner_module_outside_the_package_compares_a_name():
    # The updater and the trainer look a name up once and ask the algorithm what it needs; a
    # comparison such as `cfg.algo.estimator == "gae"` is a choice made in the wrong place.
    names = {"estimator", "policy_loss"}
    found = []
    for path in sorted(LEARNER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Attribute) and s.attr in names for s in sides):
                    found.append(f"{path.name}:{node.lineno}")
    assert found == []
