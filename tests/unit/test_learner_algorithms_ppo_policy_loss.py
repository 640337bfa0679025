"""learner.algorithms.ppo_policy_loss: the PPO clip (clip-higher, dual clip), the behaviour
policy as old. Tiny tensors, arithmetic in the comments."""

from __future__ import annotations

import math

import pytest

from learner.algorithms.ppo_policy_loss import ppo_clip_loss
from learner_helpers import T, close  # noqa: E402

NAN = float("nan")
INF = float("inf")


# token: log ratio, advantage
#   0: +0.1, +1 -> ratio 1.105 in [0.8, 1.2]       -> loss -1.105 (unclipped)
#   1: +0.3, +1 -> ratio 1.350 -> clipped to 1.2    -> loss -1.2   (clipped, no grad)
#   2: -0.3, -1 -> ratio 0.741 -> clipped to 0.8    -> loss +0.8   (clipped, no grad)
#   3: -0.3, +1 -> ratio 0.741; max(-0.741, -0.8)   -> loss -0.741 (unclipped)
#   4: masked garbage
LOG_RATIO = [[0.1, 0.3, -0.3, -0.3, NAN]]
ADV = [[1.0, 1.0, -1.0, 1.0, 1e9]]
PMASK = [[1, 1, 1, 1, 0]]


def _ppo_inputs():
    old = T([[-1.0, -2.0, -1.5, -0.5, 0.0]])
    logp = (old + T(LOG_RATIO)).requires_grad_()
    return logp, old


class TestPPOClip:
    def test_worked_example(self):
        logp, old = _ppo_inputs()
        loss, stats = ppo_clip_loss(logp, None, old, T(ADV), T(PMASK), clip_eps_low=0.2)
        close(loss, (-math.exp(0.1) - 1.2 + 0.8 - math.exp(-0.3)) / 4)
        close(stats.loss, loss.detach())
        close(stats.clip_frac, 0.5)  # tokens 1, 2
        close(stats.ratio_max, math.exp(0.3))
        close(stats.ratio_mean, (math.exp(0.1) + math.exp(0.3) + 2 * math.exp(-0.3)) / 4)
        # approx_kl = mean(r - 1 - log r)
        k3 = [math.exp(v) - 1 - v for v in (0.1, 0.3, -0.3, -0.3)]
        close(stats.approx_kl, sum(k3) / 4)
        close(stats.dual_clip_frac, 0.0)
        close(stats.is_weight_mean, 1.0)
        loss.backward()
        # d/dlogp of -A * ratio = -A * ratio / 4 where unclipped, 0 where clipped or masked
        close(logp.grad, [[-math.exp(0.1) / 4, 0.0, 0.0, -math.exp(-0.3) / 4, 0.0]])

    def test_clip_higher(self):
        # token 1: ratio 1.350 -> clipped to 1.28 instead of 1.2
        logp, old = _ppo_inputs()
        loss, _ = ppo_clip_loss(logp, None, old, T(ADV), T(PMASK), clip_eps_low=0.2, clip_eps_high=0.28)
        close(loss, (-math.exp(0.1) - 1.28 + 0.8 - math.exp(-0.3)) / 4)

    def test_on_policy_baseline(self):
        # logp == old_logp -> ratio 1 -> loss = -mean(A) = -(1 + 2 - 4) / 3
        logp = T([[-1.0, -2.0, -3.0, NAN]])
        loss, stats = ppo_clip_loss(logp, None, logp, T([[1.0, 2.0, -4.0, 5.0]]), T([[1, 1, 1, 0]]))
        close(loss, 1 / 3)
        close(stats.clip_frac, 0.0)
        close(stats.approx_kl, 0.0)

    def test_a_token_the_policy_filters_out_keeps_the_loss_and_approx_kl_finite(self):
        # token 1 left the policy's top-k: logp -inf, log r = -inf, r = 0. Its loss is
        # max(-A * 0, -A * clip(0, 0.8, 1.2)) = max(0, -0.8) = 0 with gradient 0; its k3
        # (r - 1 - log r = inf) leaves approx_kl, the mean over token 0: e^0.1 - 1 - 0.1 = 0.0051709
        logp = T([[-0.9, -INF]]).requires_grad_()
        loss, stats = ppo_clip_loss(logp, None, T([[-1.0, -1.0]]), T([[1.0, 1.0]]), T([[1, 1]]))
        close(loss, -math.exp(0.1) / 2)  # (-1 * e^0.1 + 0) / 2 tokens
        close(stats.approx_kl, math.exp(0.1) - 1.1)
        loss.backward()
        close(logp.grad, [[-math.exp(0.1) / 2, 0.0]])

    def test_dual_clip(self):
        # A = -1, ratio 5: max(5, 1.2) = 5 -> dual clip min(5, c=3) = 3 (no grad)
        # A = +1, ratio 5: max(-5, -1.2) = -1.2; dual clip does not apply to A > 0
        old = T([[0.0, 0.0]])
        logp = T([[math.log(5.0)] * 2]).requires_grad_()
        adv, mask = T([[-1.0, 1.0]]), T([[1, 1]])
        loss, _ = ppo_clip_loss(logp, None, old, adv, mask)
        close(loss, (5 - 1.2) / 2)
        loss, stats = ppo_clip_loss(logp, None, old, adv, mask, dual_clip_c=3.0)
        close(loss, (3 - 1.2) / 2)
        close(stats.dual_clip_frac, 0.5)
        loss.backward()
        close(logp.grad, [[0.0, 0.0]])

    @pytest.mark.parametrize(
        "kwargs, match",
        [
            ({"clip_eps_low": 0.0}, "clip_eps_low.*0.0"),
            ({"clip_eps_high": -0.1}, "clip_eps_high.*-0.1"),
            ({"dual_clip_c": 1.0}, "dual_clip_c.*1.0"),
            ({"agg_mode": "mean"}, "'mean'.*'token-mean'"),
        ],
    )
    def test_validation(self, kwargs, match):
        logp, old = _ppo_inputs()
        with pytest.raises(ValueError, match=match):
            ppo_clip_loss(logp, None, old, T(ADV), T(PMASK), **kwargs)

    def test_shape_mismatch(self):
        with pytest.raises(ValueError, match="advantages=\\(1, 2\\)"):
            ppo_clip_loss(T([[0.0]]), None, T([[0.0]]), T([[0.0, 1.0]]), T([[1]]))
