"""On-policy distillation (``distill.teacher.path``): a frozen teacher scores the tokens the student
sampled, and each token's advantage is the reverse-KL term ``log pi_teacher(y_t) - log mu(y_t)``,
``mu`` the student's sampling (behaviour) log-prob, plus ``distill.reward_weight`` times the
family's own reward advantage (0: pure distillation). A mode of every policy-gradient family
(:mod:`learner.algorithms.policy_gradient` calls :func:`teacher_logprobs` and
:func:`add_teacher_advantages`), not an estimator of its own: the teacher's term adds to whatever
advantage the configured estimator gives, as in slime ("orthogonal to advantage estimators").

The form followed: Thinking Machines, "On-Policy Distillation" (2025), and its tinker-cookbook
(``distillation/train_on_policy.py``: advantage ``-(sampled_logprobs - teacher_logprobs)``, the
sampler's log-probs as the student term, no discount, trained by the importance-sampling loss).
slime (``apply_opd_kl_to_advantages``) and a verl fork's ``adv_estimator=opd`` take the trainer's
recomputed old log-probs (our pi_prox) as the student term; prime-rl the trainer's current ones,
detached. Here it is ``mu``: the workers record it with every token, so the advantage is known
before any pass of the student (with one epoch of one minibatch pi_prox is read off the training
pass, ``learner.update.prox_is_training_pass``, too late for an advantage), and ``mu`` is what
the sampled tokens' distribution is; pi_prox differs from it by at most ``algo.max_staleness``
versions, which the loss's IS weight pi_prox / mu corrects. TRL's GKD trains a divergence over
the whole vocabulary instead; this is the sampled-token, policy-gradient form.

The advantage is a constant (computed without gradients); ``E_mu[grad log pi * A]`` is the
gradient of ``-KL(pi || teacher)`` (``tests/unit/test_learner_algorithms_distill.py`` checks it
on an exact expectation). The teacher's log-probs are of the rollout's sampling distribution
(temperature, top-k, top-p), as ``mu``'s are; a token the teacher's top-k/top-p filters out
(log-prob -inf) leaves the loss mask, as it does for the reference model.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from learner.algorithms.core import bool_mask, check_same_shape, kl_estimate, masked_mean, where_real
from learner.batch import TrainBatch
from rlhf_core.choices import KLEstimator
from rlhf_core.metric_names import DISTILL_REVERSE_KL, DISTILL_REVERSE_KL_K3, DISTILL_TEACHER_S

if TYPE_CHECKING:
    from learner.algorithms import Updater
    from learner.stats import MetricSums


@torch.no_grad()
def teacher_advantages(teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` per-token advantage ``log pi_teacher(y_t) - log pi_student(y_t)`` (the negative
    per-token reverse KL, k1) at the real tokens of ``mask``, 0 elsewhere (whatever the inputs
    hold there, NaN included). Both ``[B, T]`` log-probs of the sampled tokens."""
    check_same_shape(teacher_logp=teacher_logp, student_logp=student_logp, mask=mask)
    m = bool_mask(mask)
    return where_real(where_real(teacher_logp, m) - where_real(student_logp, m), m)


@torch.no_grad()
def mixed_advantages(task_adv: torch.Tensor, teacher_logp: torch.Tensor, student_logp: torch.Tensor,
                     mask: torch.Tensor, *, reward_weight: float) -> torch.Tensor:
    """``[B, T]`` ``reward_weight * task_adv + (log pi_teacher - log pi_student)`` at the real tokens
    of ``mask``, 0 elsewhere: an estimator's reward advantage beside the teacher's
    (``reward_weight`` 0: the teacher's alone)."""
    if not reward_weight >= 0:
        raise ValueError(f"reward_weight must be >= 0, got {reward_weight}")
    check_same_shape(task_adv=task_adv, mask=mask)
    m = bool_mask(mask)
    task = where_real(task_adv, m) * reward_weight if reward_weight else torch.zeros_like(task_adv)
    return where_real(task + teacher_advantages(teacher_logp, student_logp, m), m)


def teacher_logprobs(up: Updater, local: TrainBatch, m: MetricSums) -> torch.Tensor | None:
    """The teacher's ``[b, T]`` log-probs of this rank's rows (its no-grad pass, timed into
    ``distill/time_teacher_s``); None when the run has no teacher."""
    if up.passes.teacher is None:
        return None
    cuda = local.response_ids.is_cuda
    if cuda:  # the clock times the teacher's pass alone, not the work queued before it
        torch.cuda.synchronize(local.response_ids.device)
    t0 = time.perf_counter()
    logp = up.passes.teacher_logprobs(local)
    if cuda:
        torch.cuda.synchronize(local.response_ids.device)
    m.set(DISTILL_TEACHER_S, time.perf_counter() - t0)
    return logp


def add_teacher_advantages(up: Updater, task_adv: torch.Tensor, teacher: torch.Tensor, local: TrainBatch,
                           mask: torch.Tensor, m: MetricSums) -> torch.Tensor:
    """:func:`mixed_advantages` of this rank's rows with the behaviour log-probs as the student
    term, and the student's reverse KL to the teacher over ``mask`` (k1 and k3) as metrics."""
    behav, n = local.behaviour_logprobs, float(mask.sum())
    m.add(DISTILL_REVERSE_KL, masked_mean(kl_estimate(behav, teacher, mask, kind=KLEstimator.k1), mask), n)
    m.add(DISTILL_REVERSE_KL_K3, masked_mean(kl_estimate(behav, teacher, mask, kind=KLEstimator.k3), mask), n)
    return mixed_advantages(task_adv, teacher, behav, mask, reward_weight=up.distill.reward_weight)
