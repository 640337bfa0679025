"""Unit tests for learner/dpo_loss.py: two pairs, the arithmetic in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from learner.dpo_loss import dpo_loss

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
