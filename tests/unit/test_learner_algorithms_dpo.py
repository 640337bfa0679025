"""learner.algorithms.dpo: the DPO loss and the pairs it trains on (best vs worst of a group,
lone samples and ties left out). Tiny tensors, arithmetic in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from learner.algorithms.dpo import dpo_loss, dpo_pairs, select_dpo_pairs
from learner_helpers import T, close  # noqa: E402

NAN = float("nan")


# --------------------------------------------------------------------------- #
# Online DPO
# --------------------------------------------------------------------------- #
class TestDPOLoss:
    # pair 0: h = (-10 + 12) - (-11 + 11) = 2 -> beta h = 0.2 -> -logsig(0.2) = log(1 + e^-0.2) = 0.598139
    #         rewards: chosen 0.1 * 1 = 0.1, rejected 0.1 * -1 = -0.1 -> correct
    # pair 1: h = (-8 + 5) - (-9 + 7) = -1 -> beta h = -0.1 -> log(1 + e^0.1) = 0.744397
    #         rewards: chosen 0.1 * 1 = 0.1, rejected 0.1 * 2 = 0.2 -> wrong
    PC, PR, RC, RR = [-10.0, -8.0], [-12.0, -5.0], [-11.0, -9.0], [-11.0, -7.0]

    def test_worked_example(self):
        pc = T(self.PC).requires_grad_()
        loss, stats = dpo_loss(pc, T(self.PR), T(self.RC), T(self.RR), beta=0.1)
        close(loss, (math.log1p(math.exp(-0.2)) + math.log1p(math.exp(0.1))) / 2)
        close(stats.reward_accuracy, 0.5)
        close(stats.reward_margin, (0.2 + -0.1) / 2)
        close(stats.chosen_reward, 0.1)
        close(stats.rejected_reward, (-0.1 + 0.2) / 2)
        loss.backward()
        # d/dpc of -logsig(beta h) = -beta * sigmoid(-beta h), over 2 pairs
        sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
        close(pc.grad, [-0.1 * sig(-0.2) / 2, -0.1 * sig(0.1) / 2])

    def test_label_smoothing(self):
        # 0.9 * log(1 + e^-0.2) + 0.1 * log(1 + e^0.2) = 0.618139 for pair 0
        loss, _ = dpo_loss(
            T(self.PC[:1]), T(self.PR[:1]), T(self.RC[:1]), T(self.RR[:1]), beta=0.1, label_smoothing=0.1
        )
        close(loss, 0.9 * math.log1p(math.exp(-0.2)) + 0.1 * math.log1p(math.exp(0.2)))

    def test_invalid_pairs_ignored(self):
        pc = T([-10.0, NAN]).requires_grad_()
        loss, stats = dpo_loss(
            pc, T([-12.0, NAN]), T([-11.0, 1e9]), T([-11.0, NAN]), beta=0.1,
            valid=torch.tensor([True, False]),
        )
        close(loss, math.log1p(math.exp(-0.2)))
        close(stats.reward_accuracy, 1.0)
        close(stats.valid_frac, 0.5)
        loss.backward()
        assert torch.isfinite(pc.grad).all() and pc.grad[1].item() == 0.0

    @pytest.mark.parametrize(
        "kwargs, match", [({"beta": 0.0}, "beta.*0.0"), ({"label_smoothing": 0.5}, "label_smoothing.*0.5")]
    )
    def test_validation(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            dpo_loss(T(self.PC), T(self.PR), T(self.RC), T(self.RR), **kwargs)


class TestSelectDPOPairs:
    def test_best_vs_worst(self):
        rewards = T([1.0, 3.0, 2.0, 5.0, 5.0, 5.0, 0.0, -1.0, 4.0])
        chosen, rejected, valid = select_dpo_pairs(rewards, group_size=3)
        assert chosen.tolist() == [1, 3, 8]
        assert rejected.tolist() == [0, 3, 7]
        assert valid.tolist() == [True, False, True]  # group 1 is a three-way tie

    def test_only_eligible_samples_are_paired(self):
        # group 0 [1, 3, 2] without row 1: best row 2 (2), worst row 0 (1);
        # group 1 [0, -1, 4] with row 8 alone eligible: best = worst = row 8, no pair;
        # group 2 [7, 6, 5], none eligible: no pair
        rewards = T([1.0, 3.0, 2.0, 0.0, -1.0, 4.0, 7.0, 6.0, 5.0])
        eligible = torch.tensor([1, 0, 1, 0, 0, 1, 0, 0, 0], dtype=torch.bool)
        chosen, rejected, valid = select_dpo_pairs(rewards, group_size=3, eligible=eligible)
        assert valid.tolist() == [True, False, False]
        assert (chosen[0].item(), rejected[0].item()) == (2, 0)

    def test_errors(self):
        with pytest.raises(ValueError, match="N=8.*group_size=3"):
            select_dpo_pairs(torch.zeros(8), 3)
        with pytest.raises(ValueError, match="group_size must be >= 2, got 1"):
            select_dpo_pairs(torch.zeros(4), 1)


# Three groups: a full one of 4, a partial one of 3 (one sample dead-lettered), a lone sample.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 5.0])
SIZES = torch.tensor([4, 3, 1])


def test_dpo_pairs_skip_lone_samples_and_ties():
    # group 1 [1,0,0,1]: best = first max (row 0), worst = first min (row 1)
    # group 2 [1,0,1]: rows 4 and 5; lone sample: no pair; a tied group: no pair
    r = torch.cat([REWARDS, torch.tensor([2.0, 2.0])])
    chosen, rejected = dpo_pairs(r, torch.tensor([4, 3, 1, 2]))
    assert chosen.tolist() == [0, 4] and rejected.tolist() == [1, 5]
