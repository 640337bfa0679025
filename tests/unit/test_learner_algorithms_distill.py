"""learner.algorithms.distill: the teacher's per-token advantage (worked numbers, NaN in padding,
the gradient it gives) and the updater's path with a teacher (its pass over the same rows, the
reverse-KL metrics, the default path untouched without one)."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from learner.algorithms.core import kl_estimate, masked_mean
from learner.algorithms.decoupled_policy_loss import decoupled_ppo_loss
from learner.algorithms.distill import mixed_advantages, teacher_advantages
from learner.engine_factory import make_engine
from learner.update import PolicyUpdater
from learner_helpers import T, batch_of, close, digit_reward, generate_samples, tiny_config, train
from rlhf_core import metric_names as M
from rlhf_core.models import load_policy, load_reference

NAN = float("nan")


def test_teacher_advantages_worked_numbers():
    teacher = T([[-0.5, -1.0, -3.0], [-0.2, -2.5, -9.0]])
    student = T([[-1.0, -1.0, -0.5], [-0.7, -0.5, -1.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    # log pi_teacher - log pi_student: row 0 [-0.5 + 1.0, -1.0 + 1.0, -3.0 + 0.5] = [0.5, 0.0, -2.5]
    # row 1 [-0.2 + 0.7, -2.5 + 0.5, (padding)] = [0.5, -2.0, 0]
    close(teacher_advantages(teacher, student, mask), [[0.5, 0.0, -2.5], [0.5, -2.0, 0.0]])


def test_mixed_advantages_worked_numbers():
    teacher, student = T([[-0.5, -1.0, -3.0]]), T([[-1.0, -1.0, -0.5]])
    task, mask = T([[2.0, 2.0, 2.0]]), T([[1, 1, 0]])
    # reward_weight 0.25: 0.25 * 2.0 = 0.5 beside [0.5, 0.0]; the padding stays 0 -> [1.0, 0.5, 0]
    close(mixed_advantages(task, teacher, student, mask, reward_weight=0.25), [[1.0, 0.5, 0.0]])
    # reward_weight 0: the teacher's alone, whatever the task's hold (inf, nan)
    close(mixed_advantages(T([[math.inf, NAN, 1.0]]), teacher, student, mask, reward_weight=0.0), [[0.5, 0.0, 0.0]])
    with pytest.raises(ValueError, match="reward_weight"):
        mixed_advantages(task, teacher, student, mask, reward_weight=-1.0)


def test_nan_and_inf_in_padding_never_leak():
    # only [0, 0] is real; every padded position holds NaN, inf or 1e9 in some input
    teacher = T([[-0.5, NAN, -math.inf], [NAN, NAN, NAN]])
    student = T([[-1.0, math.inf, NAN], [-1.0, 1e9, NAN]])
    task = T([[2.0, NAN, math.inf], [NAN, NAN, NAN]])
    mask = T([[1, 0, 0], [0, 0, 0]])
    # [0, 0]: 1.0 * 2.0 + (-0.5 + 1.0) = 2.5; 0 elsewhere
    close(mixed_advantages(task, teacher, student, mask, reward_weight=1.0), [[2.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    close(teacher_advantages(teacher, student, mask), [[0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_the_advantage_is_the_gradient_of_the_reverse_kl():
    # One step of a 4-token vocabulary, the expectation over the student's samples written out:
    # sum_y pi(y) * A(y) * grad log pi(y), A(y) = log q(y) - log pi(y) (detached), is
    # -grad KL(pi || q) = -grad sum_y pi(y) (log pi(y) - log q(y)) (the E[grad log pi] term is 0).
    theta = torch.tensor([0.3, -1.2, 0.8, 0.0], dtype=torch.float64, requires_grad=True)
    log_q = torch.log_softmax(torch.tensor([1.0, 0.5, -2.0, 0.1], dtype=torch.float64), -1)
    log_pi = torch.log_softmax(theta, -1)
    ones = torch.ones(1, 4, dtype=torch.float64)
    adv = teacher_advantages(log_q[None], log_pi.detach()[None], ones)
    surrogate = -(log_pi.detach().exp() * adv[0] * log_pi).sum()  # the policy-gradient loss, weighted by pi
    (pg,) = torch.autograd.grad(surrogate, theta)
    log_pi = torch.log_softmax(theta, -1)  # a graph of its own
    kl = (log_pi.exp() * (log_pi - log_q)).sum()
    (exact,) = torch.autograd.grad(kl, theta)
    torch.testing.assert_close(pg, exact)
    # the decoupled loss on-policy (pi_prox = mu = pi, token-mean over one row of 4 tokens, ratio 1)
    # gives each token's log-prob the gradient -A / 4: the advantage enters the loss as is
    logp = log_pi.detach()[None].clone().requires_grad_(True)
    loss, _ = decoupled_ppo_loss(logp, logp.detach(), logp.detach(), adv, ones)
    (g,) = torch.autograd.grad(loss, logp)
    close(g, -adv / 4)


@pytest.fixture(scope="module")
def models(tiny_model_cfg):
    student = load_policy(tiny_model_cfg)
    teacher = copy.deepcopy(student).eval().requires_grad_(False)
    with torch.no_grad():  # another model of the same tokenizer: the student's weights, moved
        gen = torch.Generator().manual_seed(7)
        for p in teacher.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    return student, teacher


def updater(student, teacher, cfg):
    return PolicyUpdater(cfg, make_engine(cfg, copy.deepcopy(student)), None, None, teacher)


def test_updater_trains_on_the_teacher_advantage_of_the_same_rows(models, tiny_model_cfg):
    student, teacher = models
    smp = generate_samples(student, [[20, 30], [21, 30, 4, 5, 6]], group_size=4, max_new_tokens=6, seed=1,
                           reward_fn=digit_reward)
    cfg = tiny_config(tiny_model_cfg, **{"distill.teacher.path": "teacher", "distill.reward_weight": 0.0})
    up = updater(student, teacher, cfg)
    batch = batch_of(up, smp)
    expected_teacher = up.passes.teacher_logprobs(batch)
    # the teacher's pass is the reference pass's over another model: the same rows and mask
    ref_up = PolicyUpdater(cfg, make_engine(cfg, copy.deepcopy(student)), teacher)
    torch.testing.assert_close(expected_teacher, ref_up.passes.reference_logprobs(batch))
    mask = batch.response_mask
    work = up.algorithm.prepare(up, batch, batch.rewards, _sums())
    adv = work.local.token_extras["adv"]
    torch.testing.assert_close(adv[mask], (expected_teacher - batch.behaviour_logprobs)[mask])
    m = train(up, smp, 0)
    k1 = float(masked_mean(batch.behaviour_logprobs - expected_teacher, mask))
    k3 = float(masked_mean(kl_estimate(batch.behaviour_logprobs, expected_teacher, mask, kind="k3"), mask))
    assert m[M.DISTILL_REVERSE_KL] == pytest.approx(k1, abs=1e-5) and k1 > 0.1
    assert m[M.DISTILL_REVERSE_KL_K3] == pytest.approx(k3, abs=1e-5)
    assert m[M.DISTILL_TEACHER_S] > 0
    assert m["loss/advantage_mean"] == pytest.approx(-k1, abs=1e-5)


def test_reward_weight_adds_the_estimators_advantage(models, tiny_model_cfg):
    student, teacher = models
    smp = generate_samples(student, [[20, 30], [21, 30, 4, 5, 6]], group_size=4, max_new_tokens=6, seed=1,
                           reward_fn=digit_reward)
    plain_cfg = tiny_config(tiny_model_cfg)
    plain = PolicyUpdater(plain_cfg, make_engine(plain_cfg, copy.deepcopy(student)))
    batch = batch_of(plain, smp)
    grpo = plain.algorithm.prepare(plain, batch, batch.rewards, _sums()).local.token_extras["adv"]
    cfg = tiny_config(tiny_model_cfg, **{"distill.teacher.path": "teacher", "distill.reward_weight": 0.5})
    up = updater(student, teacher, cfg)
    adv = up.algorithm.prepare(up, batch, batch.rewards, _sums()).local.token_extras["adv"]
    mask = batch.response_mask
    torch.testing.assert_close(adv[mask], (0.5 * grpo + up.passes.teacher_logprobs(batch) - batch.behaviour_logprobs)[mask])


def test_without_a_teacher_there_is_no_teacher_pass_nor_metric(models, tiny_model_cfg):
    student, _ = models
    smp = generate_samples(student, [[20, 30]], group_size=4, max_new_tokens=6, seed=2, reward_fn=digit_reward)
    cfg = tiny_config(tiny_model_cfg, **{"learner.batch_size": 4})
    m = train(PolicyUpdater(cfg, make_engine(cfg, copy.deepcopy(student))), smp, 0)
    assert not any(k.startswith("distill/") for k in m)


def test_a_lora_student_distils_unchanged(models, tiny_model_cfg):
    # the teacher is a model of its own: the student's adapters train, its base and the teacher stay
    from rlhf_core.config import LoraConfig

    _, teacher = models
    lora_cfg = dataclasses.replace(tiny_model_cfg, lora=LoraConfig(r=2, target_modules=["all-linear", "lm_head"]))
    student = load_policy(lora_cfg)
    cfg = tiny_config(lora_cfg, **{"distill.teacher.path": "teacher", "learner.lr": 1e-2, "algo.kl_coef": 0.01})
    up = PolicyUpdater(cfg, make_engine(cfg, student), load_reference(lora_cfg), None, teacher)
    smp = generate_samples(student, [[20, 30], [21, 30, 4, 5, 6]], group_size=4, max_new_tokens=6, seed=3,
                           reward_fn=digit_reward)
    batch = batch_of(up, smp)
    teacher_before = up.passes.teacher_logprobs(batch)
    base_before = {n: p.detach().clone() for n, p in student.named_parameters() if not p.requires_grad}
    for v in range(3):
        m = train(up, smp, v)
    assert all(torch.equal(p, base_before[n]) for n, p in student.named_parameters() if not p.requires_grad)
    torch.testing.assert_close(up.passes.teacher_logprobs(batch), teacher_before, rtol=0, atol=0)
    assert m[M.DISTILL_REVERSE_KL] > 0 and "loss/kl" in m  # the KL to the reference (the base) beside it


def _sums():
    from learner.stats import MetricSums

    return MetricSums()
