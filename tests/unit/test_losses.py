"""Unit tests for learner/losses.py: tiny tensors, arithmetic in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from learner.losses import (
    ISConfig,
    decoupled_ppo_loss,
    entropy_bonus,
    entropy_from_logits,
    kl_estimate,
    ppo_clip_loss,
    value_loss,
)

from learner_helpers import T, close  # noqa: E402

NAN = float("nan")
INF = float("inf")


# --------------------------------------------------------------------------- #
# KL, entropy
# --------------------------------------------------------------------------- #
class TestKL:
    # log r = ref - logp = [-0.5, 1.0]
    LOGP, REF = [[-1.0, -2.0]], [[-1.5, -1.0]]

    def test_k1(self):
        close(kl_estimate(T(self.LOGP), T(self.REF), kind="k1"), [[0.5, -1.0]])

    def test_k2(self):
        # 0.5 * 0.25 = 0.125, 0.5 * 1 = 0.5
        close(kl_estimate(T(self.LOGP), T(self.REF), kind="k2"), [[0.125, 0.5]])

    def test_k3(self):
        # e^-0.5 + 0.5 - 1 = 0.106531, e^1 - 1 - 1 = 0.718282
        close(kl_estimate(T(self.LOGP), T(self.REF), kind="k3"), [[0.1065307, 0.7182818]])

    def test_mask_zeroes_garbage(self):
        out = kl_estimate(T([[-1.0, NAN]]), T([[-1.5, 1e9]]), T([[1, 0]]), kind="k3")
        close(out, [[0.1065307, 0.0]])

    def test_unknown_kind(self):
        with pytest.raises(ValueError, match="'k4'.*'k1', 'k2', 'k3'"):
            kl_estimate(T(self.LOGP), T(self.REF), kind="k4")


class TestEntropy:
    def test_values(self):
        # uniform over 4 -> ln 4; two -inf entries -> uniform over 2 -> ln 2;
        # [0, ln 3] -> -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
        logits = T([[[0.0, 0.0, 0.0, 0.0], [0.0, -INF, -INF, 0.0], [0.0, math.log(3.0), -INF, -INF]]])
        close(entropy_from_logits(logits), [[math.log(4), math.log(2), 0.5623351]])

    def test_gradient_finite_with_neg_inf(self):
        logits = T([[[0.0, -INF, 1.0]]]).requires_grad_()
        entropy_from_logits(logits).sum().backward()
        assert torch.isfinite(logits.grad).all()

    def test_bonus(self):
        # entropy of real tokens 1, 2 -> mean 1.5 -> loss -0.01 * 1.5
        loss, stats = entropy_bonus(T([[1.0, 2.0, NAN]]), T([[1, 1, 0]]), coef=0.01)
        close(loss, -0.015)
        close(stats.entropy, 1.5)


# --------------------------------------------------------------------------- #
# PPO clip
# --------------------------------------------------------------------------- #
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
        loss, stats = ppo_clip_loss(logp, old, T(ADV), T(PMASK), clip_eps_low=0.2)
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
        loss, _ = ppo_clip_loss(logp, old, T(ADV), T(PMASK), clip_eps_low=0.2, clip_eps_high=0.28)
        close(loss, (-math.exp(0.1) - 1.28 + 0.8 - math.exp(-0.3)) / 4)

    def test_on_policy_baseline(self):
        # logp == old_logp -> ratio 1 -> loss = -mean(A) = -(1 + 2 - 4) / 3
        logp = T([[-1.0, -2.0, -3.0, NAN]])
        loss, stats = ppo_clip_loss(logp, logp, T([[1.0, 2.0, -4.0, 5.0]]), T([[1, 1, 1, 0]]))
        close(loss, 1 / 3)
        close(stats.clip_frac, 0.0)
        close(stats.approx_kl, 0.0)

    def test_a_token_the_policy_filters_out_keeps_the_loss_and_approx_kl_finite(self):
        # token 1 left the policy's top-k: logp -inf, log r = -inf, r = 0. Its loss is
        # max(-A * 0, -A * clip(0, 0.8, 1.2)) = max(0, -0.8) = 0 with gradient 0; its k3
        # (r - 1 - log r = inf) leaves approx_kl, the mean over token 0: e^0.1 - 1 - 0.1 = 0.0051709
        logp = T([[-0.9, -INF]]).requires_grad_()
        loss, stats = ppo_clip_loss(logp, T([[-1.0, -1.0]]), T([[1.0, 1.0]]), T([[1, 1]]))
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
        loss, _ = ppo_clip_loss(logp, old, adv, mask)
        close(loss, (5 - 1.2) / 2)
        loss, stats = ppo_clip_loss(logp, old, adv, mask, dual_clip_c=3.0)
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
            ppo_clip_loss(logp, old, T(ADV), T(PMASK), **kwargs)

    def test_shape_mismatch(self):
        with pytest.raises(ValueError, match="advantages=\\(1, 2\\)"):
            ppo_clip_loss(T([[0.0]]), T([[0.0]]), T([[0.0, 1.0]]), T([[1]]))


# --------------------------------------------------------------------------- #
# Decoupled PPO
# --------------------------------------------------------------------------- #
def _random_batch(seed: int, b: int = 3, t: int = 6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    prox = logp + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)
    behav = prox + 0.6 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[:, 0] = True
    # garbage in masked positions
    for x in (logp, prox, behav, adv):
        x[~mask] = NAN
    return logp, prox, behav, adv, mask


class TestDecoupledPPO:
    @pytest.mark.parametrize("is_correction", ["none", "tis", "mis"])
    @pytest.mark.parametrize("is_level", ["token", "sequence"])
    @pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
    @pytest.mark.parametrize("dual_clip_c", [None, 3.0])
    def test_equals_ppo_when_behav_is_prox(self, is_correction, is_level, agg_mode, dual_clip_c):
        logp, prox, _, adv, mask = _random_batch(0)
        a = logp.clone().requires_grad_()
        b = logp.clone().requires_grad_()
        clip = {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip_c": dual_clip_c, "agg_mode": agg_mode}
        is_config = ISConfig(is_correction, is_level, tis_cap=2.0, mis_low=0.5, mis_high=2.0)
        loss_d, stats_d = decoupled_ppo_loss(a, prox, prox.clone(), adv, mask, is_config=is_config, **clip)
        loss_p, stats_p = ppo_clip_loss(b, prox, adv, mask, **clip)
        assert torch.equal(loss_d, loss_p)
        for name, x, y in zip(stats_p._fields, stats_d, stats_p):
            assert torch.equal(x, y), name
        (loss_d + loss_p).backward()
        assert torch.equal(a.grad, b.grad)
        assert torch.isfinite(a.grad).all()

    @pytest.mark.parametrize("is_level", ["token", "sequence"])
    def test_tis_with_infinite_cap_is_full_is(self, is_level):
        logp, prox, behav, adv, mask = _random_batch(1)
        full, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, is_config=ISConfig("none", is_level))
        tis, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, is_config=ISConfig("tis", is_level, tis_cap=INF))
        assert torch.equal(full, tis)
        assert stats.is_truncated_frac.item() == 0.0
        # and the weights do matter here (guards against w being ignored)
        plain, _ = ppo_clip_loss(logp, prox, adv, mask)
        assert not torch.allclose(full, plain)

    # ratio = 1 everywhere (logp == prox), A = 1, so token loss = -w.
    def test_tis_worked_example(self):
        prox = T([[-1.0, -1.0, -1.0]])
        behav = prox - T([[1.0, -0.5, 0.0]])  # log w = 1, -0.5, 0 -> w = 2.718, 0.607, 1
        adv, mask = T([[1.0, 1.0, 1.0]]), T([[1, 1, 1]])
        # TIS cap 2: w = 2, 0.607, 1 -> loss -(2 + 0.6065 + 1) / 3 = -1.2022
        loss, stats = decoupled_ppo_loss(prox, prox, behav, adv, mask, is_config=ISConfig("tis", tis_cap=2.0))
        close(loss, -(2 + math.exp(-0.5) + 1) / 3)
        close(stats.is_truncated_frac, 1 / 3)
        close(stats.is_weight_max, math.e)  # raw weight, before truncation
        # full IS: -(2.718 + 0.6065 + 1) / 3 = -1.4416
        loss, _ = decoupled_ppo_loss(prox, prox, behav, adv, mask, is_config=ISConfig("none"))
        close(loss, -(math.e + math.exp(-0.5) + 1) / 3)

    def test_mis_drops_exactly_the_tokens_outside_band(self):
        prox = T([[-1.0, -1.0, -1.0, -1.0, NAN]])
        # w = 3, 0.25, 1.5, 1 (+ masked garbage); band [0.5, 2] keeps tokens 2, 3 only
        behav = prox - torch.log(T([[3.0, 0.25, 1.5, 1.0, 1.0]]))
        adv, mask = T([[1.0, 1.0, 1.0, 1.0, 1e9]]), T([[1, 1, 1, 1, 0]])
        logp = prox.clone().requires_grad_()
        loss, stats = decoupled_ppo_loss(
            logp, prox, behav, adv, mask, is_config=ISConfig("mis", mis_low=0.5, mis_high=2.0)
        )
        # token losses [0, 0, -1.5, -1]; dropped tokens stay in the denominator: -2.5 / 4
        close(loss, -0.625)
        close(stats.is_masked_frac, 0.5)
        loss.backward()
        # d(-w * ratio)/dlogp = -w * ratio / 4 -> 0, 0, -0.375, -0.25, 0
        close(logp.grad, [[0.0, 0.0, -0.375, -0.25, 0.0]])

    def test_sequence_level_geometric_mean(self):
        prox = T([[-1.0, -1.0], [-1.0, NAN]])
        # row 0: w = 4, 1 -> geometric mean sqrt(4 * 1) = 2 on both tokens
        # row 1: w = 0.5 (second token masked garbage)
        behav = prox - torch.log(T([[4.0, 1.0], [0.5, 1e9]]))
        adv, mask = T([[1.0, 1.0], [1.0, NAN]]), T([[1, 1], [1, 0]])
        loss, stats = decoupled_ppo_loss(prox, prox, behav, adv, mask, is_config=ISConfig(level="sequence"))
        close(loss, -(2 + 2 + 0.5) / 3)  # -1.5 (token level would be -(4 + 1 + 0.5) / 3)
        close(stats.is_weight_mean, 1.5)
        close(stats.is_weight_max, 2.0)
        # TIS cap 1.5 truncates all of row 0: -(1.5 + 1.5 + 0.5) / 3
        loss, stats = decoupled_ppo_loss(
            prox, prox, behav, adv, mask, is_config=ISConfig("tis", "sequence", tis_cap=1.5)
        )
        close(loss, -3.5 / 3)
        close(stats.is_truncated_frac, 2 / 3)
        # MIS band [0.6, 3] drops the whole of row 1: -(2 + 2) / 3
        loss, stats = decoupled_ppo_loss(
            prox, prox, behav, adv, mask, is_config=ISConfig("mis", "sequence", mis_low=0.6, mis_high=3.0)
        )
        close(loss, -4 / 3)
        close(stats.is_masked_frac, 1 / 3)

    def test_behav_kl_stat_and_no_grad_through_weights(self):
        prox = T([[-1.0, -1.0]]).requires_grad_()
        behav = T([[-1.5, -1.0]])  # log w = 0.5, 0 -> k3 = e^0.5 - 1 - 0.5 = 0.148721 and 0
        logp = T([[-1.0, -1.0]]).requires_grad_()
        loss, stats = decoupled_ppo_loss(logp, prox, behav, T([[1.0, 1.0]]), T([[1, 1]]))
        close(stats.behav_approx_kl, (math.exp(0.5) - 1.5) / 2)
        loss.backward()
        assert prox.grad is None
        close(logp.grad, [[-math.exp(0.5) / 2, -0.5]])

    @pytest.mark.parametrize(
        "kwargs, match",
        [
            ({"tis_cap": 0.0}, "tis_cap.*0.0"),
            ({"tis_cap": -1.0}, "tis_cap.*-1.0"),
            ({"mis_low": 2.0, "mis_high": 1.0}, "mis_low=2.0, mis_high=1.0"),
            ({"mis_low": 1.0, "mis_high": 1.0}, "mis_low=1.0, mis_high=1.0"),
            ({"correction": "clip"}, "'clip'.*'none', 'tis', 'mis'"),
            ({"level": "batch"}, "'batch'.*'token', 'sequence'"),
        ],
    )
    def test_is_config_validation(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            ISConfig(**kwargs)

    def test_validation(self):
        logp, prox, behav, adv, mask = _random_batch(2)
        with pytest.raises(ValueError, match="'sum'.*'token-mean'"):
            decoupled_ppo_loss(logp, prox, behav, adv, mask, agg_mode="sum")

    def test_options_are_keyword_only(self):
        # a clip range given by position would land in the wrong slot: refused outright
        logp, prox, behav, adv, mask = _random_batch(3)
        with pytest.raises(TypeError):
            decoupled_ppo_loss(logp, prox, behav, adv, mask, 0.2)
        with pytest.raises(TypeError):
            ppo_clip_loss(logp, prox, adv, mask, 0.2)


# --------------------------------------------------------------------------- #
# Critic
# --------------------------------------------------------------------------- #
class TestValueLoss:
    # token: value, old, return (clip 0.2)
    #   0: 1.0, 1.0, 1.5 -> clipped value 1.0; (0.5)^2 = 0.25 both         -> 0.25
    #   1: 2.0, 1.0, 1.0 -> clipped 1.2; max(1.0, 0.04) = 1.0 (unclipped)   -> 1.0
    #   2: 0.5, 1.0, 0.0 -> clipped 0.8; max(0.25, 0.64) = 0.64 (clipped)   -> 0.64
    #   3: masked garbage
    V, OLD, RET = [[1.0, 2.0, 0.5, NAN]], [[1.0, 1.0, 1.0, 1e9]], [[1.5, 1.0, 0.0, NAN]]
    MASK = [[1, 1, 1, 0]]

    def test_clipped(self):
        values = T(self.V).requires_grad_()
        loss, stats = value_loss(values, T(self.OLD), T(self.RET), T(self.MASK), clip_eps=0.2)
        close(loss, 0.5 * (0.25 + 1.0 + 0.64) / 3)  # 0.315
        close(stats.clip_frac, 1 / 3)
        close(stats.value_mean, 3.5 / 3)
        loss.backward()
        # 0.5 * 2 * (v - R) / 3 where unclipped; 0 on the clipped token 2 and the masked one
        close(values.grad, [[-0.5 / 3, 1.0 / 3, 0.0, 0.0]])

    def test_unclipped(self):
        loss, stats = value_loss(T(self.V), T(self.OLD), T(self.RET), T(self.MASK), clip_eps=None)
        close(loss, 0.5 * (0.25 + 1.0 + 0.25) / 3)  # 0.25
        close(stats.clip_frac, 0.0)

    def test_explained_variance(self):
        # perfect prediction -> 1; here Var[R - V] happens to equal Var[R] (7/18) -> 0
        _, stats = value_loss(T(self.RET), T(self.RET), T(self.RET), T(self.MASK))
        close(stats.explained_variance, 1.0)
        _, stats = value_loss(T(self.V), T(self.OLD), T(self.RET), T(self.MASK))
        close(stats.explained_variance, 0.0)

    def test_bad_clip(self):
        with pytest.raises(ValueError, match="clip_eps.*-0.2"):
            value_loss(T(self.V), T(self.OLD), T(self.RET), T(self.MASK), clip_eps=-0.2)


