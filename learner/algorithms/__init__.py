"""The learner's algorithms, one module each, registered under their names (``rlhf_core.choices``).

An estimator family (``algo.estimator``) is an :class:`Algorithm`: its advantages (``prepare``,
on the whole batch before any optimizer step) and its loss (``loss``, one micro-batch's
backward). The families trained by a policy gradient share their body
(:mod:`learner.algorithms.policy_gradient`) and take the configured policy loss
(``algo.policy_loss``), itself one module registered with :func:`register_policy_loss`. The pure
math they share is :mod:`learner.algorithms.core`. The updater and the trainer look the
configured names up once (:func:`algorithm`, :func:`policy_loss`) and never branch on them.

Every module of this package is imported below, so a new one registers itself: adding a policy
loss is a new file and its name in ``rlhf_core.choices.PolicyLoss`` (docs/architecture.md).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from learner.batch import TrainBatch
from rlhf_core.choices import Estimator, PolicyLoss
from rlhf_core.config import ConfigError, ISConfig

if TYPE_CHECKING:
    from learner.engines import TrainEngine
    from learner.passes import ModelPasses
    from learner.stats import MetricSums


@dataclass
class Work:
    """What an algorithm hands the update loop: this rank's rows, in units the loss reads together."""

    local: TrainBatch  # this rank's rows, with the extras the loss reads
    weights: torch.Tensor  # [U] float64: each unit's count in its minibatch's loss denominator
    tokens: float  # tokens one epoch trains, over every rank (for the FLOP count)
    rows_per_unit: int = 1  # rows a unit spans (a DPO pair: 2), kept together in one micro-batch


class Updater(Protocol):
    """What an algorithm reads and calls of the update running it (``learner.update.PolicyUpdater``)."""

    algo: Any  # AlgoConfig
    rollout: Any  # RolloutConfig: the sampling settings log-probs are computed under
    distill: Any  # DistillConfig: on-policy distillation's settings (its teacher is passes.teacher)
    engine: TrainEngine
    critic: TrainEngine | None
    device: torch.device
    policy_loss: PolicyLossEntry  # algo.policy_loss, looked up
    is_config: ISConfig | None  # its IS settings (None: a loss without importance sampling)
    prox_from_training_pass: bool
    version: int  # the version of the weights the update starts from (pi_prox's): a token of it has lag 0
    passes: ModelPasses  # this rank's rows, the loss mask, the models' per-token outputs


class Algorithm(Protocol):
    """An estimator family: what it needs, its advantages and its loss."""

    needs_critic: bool  # a value model trains beside the policy
    needs_reference: bool  # reference log-probs whatever algo.kl_coef
    proximal: bool  # reads pi_prox, the policy before the update

    def prepare(self, up: Updater, batch: TrainBatch, rewards: torch.Tensor, m: MetricSums) -> Work | None:
        """This rank's rows with what the loss reads (advantages, ...); None: nothing to train."""

    def loss(self, up: Updater, mb: TrainBatch, denom: float, m: MetricSums) -> None:
        """One micro-batch's backward, its loss scaled to its share of the minibatch's ``denom``."""


PolicyLossFn = Callable[..., tuple[torch.Tensor, Any]]


@dataclass(frozen=True)
class PolicyLossEntry:
    fn: PolicyLossFn  # (logp, prox_logp, behav_logp, advantages, mask, *, is_config, **clip_loss options)
    importance_sampling: bool  # weighs tokens by pi_prox / mu: algo.is_* apply and are checked


_ALGORITHMS: dict[Estimator, Algorithm] = {}
_POLICY_LOSSES: dict[PolicyLoss, PolicyLossEntry] = {}
F = TypeVar("F", bound=PolicyLossFn)


def register_algorithm(name: Estimator, algorithm: Algorithm) -> None:
    if name in _ALGORITHMS:
        raise ValueError(f"two modules register algo.estimator={name}")
    _ALGORITHMS[Estimator(name)] = algorithm


def register_policy_loss(name: PolicyLoss, *, importance_sampling: bool) -> Callable[[F], F]:
    """Register the decorated function as ``algo.policy_loss=<name>``."""
    def register(fn: F) -> F:
        if name in _POLICY_LOSSES:
            raise ValueError(f"two modules register algo.policy_loss={name}")
        _POLICY_LOSSES[PolicyLoss(name)] = PolicyLossEntry(fn, importance_sampling)
        return fn

    return register


def algorithm(name: str) -> Algorithm:
    """The family registered as ``algo.estimator=<name>``."""
    return _lookup("algo.estimator", Estimator, _ALGORITHMS, name)


def policy_loss(name: str) -> PolicyLossEntry:
    """The loss registered as ``algo.policy_loss=<name>``."""
    return _lookup("algo.policy_loss", PolicyLoss, _POLICY_LOSSES, name)


def _lookup(key: str, names: type[StrEnum], registry: dict[Any, Any], name: str) -> Any:
    try:
        return registry[names(name)]
    except (ValueError, KeyError):
        raise ConfigError(f"{key}={name!r} is not one of {', '.join(n for n in names if n in registry)}") from None


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
