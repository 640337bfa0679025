"""learner.algorithms.decoupled_policy_loss: decoupled PPO with TIS/MIS at token or sequence
level, and the ISConfig it takes. Tiny tensors, arithmetic in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from learner.algorithms.decoupled_policy_loss import decoupled_ppo_loss
from learner.algorithms.ppo_policy_loss import ppo_clip_loss
from learner_helpers import T, close  # noqa: E402
from rlhf_core.config import ISConfig

NAN = float("nan")
INF = float("inf")


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
    @pytest.mark.parametrize("is_correction, is_level", [(c, lv) for c in ("none", "tis", "mis") for lv in ("token", "sequence")]
                             + [("icepop", "token")])  # IcePop is a token mask
    @pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
    @pytest.mark.parametrize("dual_clip_c", [None, 3.0])
    def test_equals_ppo_when_behav_is_prox(self, is_correction, is_level, agg_mode, dual_clip_c):
        logp, prox, _, adv, mask = _random_batch(0)
        a = logp.clone().requires_grad_()
        b = logp.clone().requires_grad_()
        clip = {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip_c": dual_clip_c, "agg_mode": agg_mode}
        is_config = ISConfig(is_correction, is_level, tis_cap=2.0, mis_low=0.5, mis_high=2.0)
        loss_d, stats_d = decoupled_ppo_loss(a, prox, prox.clone(), adv, mask, is_config=is_config, **clip)
        loss_p, stats_p = ppo_clip_loss(b, None, prox, adv, mask, **clip)
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
        plain, _ = ppo_clip_loss(logp, None, prox, adv, mask)
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

    def test_icepop_masks_outside_its_band_and_reweights_inside(self):
        # IcePop (Ring-1T: alpha 0.5, beta 5), its objective M(k) * PPO-clip term with k = pi_prox / mu:
        # k = 0.3, 0.5, 4, 6 (+ padding garbage) -> M = 0, 0.5, 4, 0; ratio 1, A = 1: token losses
        # 0, -0.5, -4, 0; the masked tokens stay in the denominator (the paper's 1/|y_i|): -4.5 / 4
        prox = T([[-1.0, -1.0, -1.0, -1.0, NAN]])
        behav = prox - torch.log(T([[0.3, 0.5, 4.0, 6.0, 1.0]]))
        behav[0, 4] = INF
        adv, mask = T([[1.0, 1.0, 1.0, 1.0, NAN]]), T([[1, 1, 1, 1, 0]])
        logp = prox.clone().requires_grad_()
        loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, is_config=ISConfig("icepop"))
        close(loss, -4.5 / 4)
        close(stats.is_masked_frac, 0.5)  # counted as staleness/is_masked_frac
        close(stats.is_weight_max, 6.0)
        loss.backward()
        # d(-M * ratio)/dlogp = -M / 4: 0, -0.125, -1, 0, padding 0 (MIS [0.5, 2] would drop k = 4 too)
        close(logp.grad, [[0.0, -0.125, -1.0, 0.0, 0.0]])
        mis, _ = decoupled_ppo_loss(prox, prox, behav, adv, mask, is_config=ISConfig("mis"))
        close(mis, -0.5 / 4)

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
            ({"mis_low": 2.0, "mis_high": 1.0}, r"mis_low < mis_high, got \[2.0, 1.0\]"),
            ({"mis_low": 1.0, "mis_high": 1.0}, r"mis_low < mis_high, got \[1.0, 1.0\]"),
            ({"correction": "clip"}, "'clip'.*'none', 'tis', 'mis', 'icepop'"),
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
            ppo_clip_loss(logp, prox, behav, adv, mask, 0.2)
