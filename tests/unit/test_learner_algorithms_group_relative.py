"""learner.algorithms.group_relative: GRPO, Dr.GRPO and RLOO baselines on equal groups, and the
families' advantages on a batch with partial groups, the KL as a reward and normalisation."""

from __future__ import annotations

import math

import pytest
import torch

from learner.algorithms import algorithm
from learner.algorithms.group_relative import group_advantages, reverse_cumsum, rloo_advantages
from learner.algorithms.policy_gradient import AdvantageInputs
from learner_helpers import T, close  # noqa: E402
from rlhf_core.config import AlgoConfig


def seq_advantages(estimator: str, rewards: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """``[B]`` the registered family's advantages of ``rewards`` in groups of ``sizes`` (a token each)."""
    x = AdvantageInputs(rewards, sizes, torch.arange(len(rewards)), torch.ones(len(rewards), 1, dtype=torch.bool))
    return algorithm(estimator).advantages(AlgoConfig(estimator=estimator), x)[0][:, 0]


class TestGroupAdvantages:
    REWARDS = [1.0, 2.0, 3.0, 0.0, 0.0, 4.0]

    def test_grpo(self):
        # group 0: mean 2, unbiased std 1 -> -1, 0, 1
        # group 1: mean 4/3, unbiased std sqrt(16/3) = 2.3094 -> -0.57735, -0.57735, 1.1547
        adv = group_advantages(T(self.REWARDS), group_size=3)
        s = math.sqrt(16 / 3)
        close(adv, [-1.0, 0.0, 1.0, -4 / 3 / s, -4 / 3 / s, 8 / 3 / s], atol=1e-5)

    def test_dr_grpo_no_std(self):
        adv = group_advantages(T(self.REWARDS), group_size=3, scale_std=False)
        close(adv, [-1.0, 0.0, 1.0, -4 / 3, -4 / 3, 8 / 3])

    def test_constant_group_is_zero(self):
        close(group_advantages(T([5.0, 5.0, 1.0, 3.0]), group_size=2), [0.0, 0.0, -1 / math.sqrt(2), 1 / math.sqrt(2)], atol=1e-5)

    @pytest.mark.parametrize("k", [3, 7, 16])
    @pytest.mark.parametrize("value", [0.3, 3.3, 77.7, 1000.1])
    def test_a_group_of_equal_rewards_has_advantage_exactly_zero(self, k, value):
        # float32 mean of three 1000.1s is 1000.1 - 6.1e-5 (one ulp off), so each deviation is
        # 6.1e-5, the unbiased std ~7.5e-5, and 6.1e-5 / (7.5e-5 + 1e-6) = 0.80 for every sample:
        # the whole group pushed one way. Equal rewards carry no signal: exactly 0, in float32 out.
        adv = group_advantages(torch.full((2 * k,), value), group_size=k)
        assert adv.dtype == torch.float32 and torch.equal(adv, torch.zeros(2 * k))

    def test_not_divisible(self):
        with pytest.raises(ValueError, match="N=5.*group_size=2"):
            group_advantages(torch.zeros(5), group_size=2)


class TestRLOO:
    def test_worked_example(self):
        # sum 12; baseline_i = (12 - r_i) / 3 = 11/3, 10/3, 3, 2
        adv = rloo_advantages(T([1.0, 2.0, 3.0, 6.0]), group_size=4)
        close(adv, [1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0])
        # two groups of 2: baseline is the other sample
        close(rloo_advantages(T([1.0, 3.0, 5.0, 5.0]), group_size=2), [-2.0, 2.0, 0.0, 0.0])

    def test_errors(self):
        with pytest.raises(ValueError, match="group_size.*2.*1"):
            rloo_advantages(torch.zeros(4), group_size=1)
        with pytest.raises(ValueError, match="N=6.*group_size=4"):
            rloo_advantages(torch.zeros(6), group_size=4)


# Three groups: a full one of 4, a partial one of 3 (one sample dead-lettered), a lone sample.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 5.0])
SIZES = torch.tensor([4, 3, 1])
S3 = 1 / math.sqrt(3)  # unbiased std of both [1,0,0,1] and [1,0,1]


def test_grpo_with_partial_groups():
    # group 1: mean 0.5, std sqrt(1/3) -> +-0.5 / 0.57735 = +-0.86603
    # group 2: mean 2/3, std sqrt(1/3) -> [1/3, -2/3, 1/3] / 0.57735 = [0.57735, -1.1547, 0.57735]
    # group 3 (one sample): no baseline -> 0
    adv = seq_advantages("grpo", REWARDS, SIZES)
    expect = [0.5 / S3, -0.5 / S3, -0.5 / S3, 0.5 / S3, (1 / 3) / S3, (-2 / 3) / S3, (1 / 3) / S3, 0.0]
    torch.testing.assert_close(adv, torch.tensor(expect), atol=1e-5, rtol=1e-5)


def test_dr_grpo_and_rloo_with_partial_groups():
    # Dr.GRPO: r - group mean
    torch.testing.assert_close(seq_advantages("dr_grpo", REWARDS, SIZES),
                               torch.tensor([0.5, -0.5, -0.5, 0.5, 1 / 3, -2 / 3, 1 / 3, 0.0]))
    # RLOO: r_i - mean of the others: group 1: 1 - 1/3 = 2/3, 0 - 2/3 = -2/3;
    # group 2 [1, 0, 1]: 1 - 0.5 = 0.5, 0 - 1 = -1; lone sample: 0
    torch.testing.assert_close(seq_advantages("rloo", REWARDS, SIZES),
                               torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.5, -1.0, 0.5, 0.0]))


def test_equal_groups_match_the_pure_estimators():
    r = torch.tensor([0.3, 0.9, 0.1, 0.4, 0.8, 0.8, 0.2, 0.0])
    sizes = torch.tensor([4, 4])
    torch.testing.assert_close(seq_advantages("grpo", r, sizes), group_advantages(r, 4))
    torch.testing.assert_close(seq_advantages("rloo", r, sizes), rloo_advantages(r, 4))


def test_group_sizes_must_cover_the_rewards():
    with pytest.raises(ValueError, match="sum to 7 but there are 8"):
        seq_advantages("grpo", REWARDS, torch.tensor([4, 3]))


def test_reverse_cumsum_over_real_tokens():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # row 0: [1+2+3, 2+3, 3]; row 1: padding (even NaN) is ignored
    assert reverse_cumsum(x, mask).tolist() == [[6.0, 5.0, 3.0], [4.0, 0.0, 0.0]]


def test_group_advantage_with_kl_penalty_as_reward():
    # A_t = A_seq - kl_coef * sum_{t'>=t} kl_t': A_seq = 1 (Dr.GRPO, row 0 of the group [2, 0]:
    # 2 - 1), kl = [0.1, 0.2, 0.3], coef 0.5 -> [1 - 0.5*0.6, 1 - 0.5*0.5, 1 - 0.5*0.3] = [0.7, 0.75, 0.85]
    algo = AlgoConfig(estimator="dr_grpo", kl_coef=0.5, kl_mode="reward")
    mask = torch.tensor([[1, 1, 1]])
    x = AdvantageInputs(torch.tensor([2.0, 0.0]), torch.tensor([2]), torch.tensor([0]), mask,
                        kl=torch.tensor([[0.1, 0.2, 0.3]]))
    adv, ret = algorithm("dr_grpo").advantages(algo, x)
    torch.testing.assert_close(adv, torch.tensor([[0.7, 0.75, 0.85]]))
    assert ret is None


def test_normalize_advantages_whitens():
    algo = AlgoConfig(estimator="dr_grpo", normalize_advantages=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    # rows 0 and 1 of the group [1, -2, 1] (mean 0): advantages 1 and -2
    x = AdvantageInputs(torch.tensor([1.0, -2.0, 1.0]), torch.tensor([3]), torch.tensor([0, 1]), mask)
    adv, _ = algorithm("dr_grpo").normalized_advantages(algo, x)
    # tokens [1, 1, -2]: mean 0, var 2 -> [1, 1, -2] / sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0], [-2.0, 0.0]]) / math.sqrt(2.0 + 1e-8))
