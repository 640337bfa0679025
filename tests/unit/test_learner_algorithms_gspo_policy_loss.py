"""learner.algorithms.gspo_policy_loss: GSPO (Zheng et al. 2025, arXiv 2507.18071), one ratio and one
clip per response, around pi_prox, with a sequence-level behaviour weight. Tiny tensors, arithmetic
in the comments (equation numbers are the paper's)."""

from __future__ import annotations

import math

import pytest
import torch

from learner.algorithms.decoupled_policy_loss import decoupled_ppo_loss
from learner.algorithms.gspo_policy_loss import gspo_loss
from learner_helpers import T, close, random_policy_batch, shifted  # noqa: E402
from rlhf_core.config import AlgoConfig, ConfigError, ISConfig

NAN = float("nan")
INF = float("inf")
SEQ = ISConfig(level="sequence")  # correction none: w = the geometric mean pi_prox / mu, kept
SEQ_MEAN = "seq-mean-token-mean"  # the paper's 1/G sum_i (eq. 5)

# row 0: log(pi / pi_prox) per token 0.2, 0.0        -> mean 0.1 -> s_0 = e^0.1 = 1.105171 (eq. 7), in [0.8, 1.2]
# row 1: 0.3, -0.1, 0.4                                -> mean 0.2 -> s_1 = e^0.2 = 1.221403 > 1.2: clipped (A = +1)
# (token-level PPO would clip only tokens 0 and 2 of row 1 and train its token 1, ratio e^-0.1)
PROX = [[-1.0, -2.0, NAN], [-1.0, -1.5, -0.5]]
LOG_RATIO = [[0.2, 0.0, NAN], [0.3, -0.1, 0.4]]
MASK = [[1, 1, 0], [1, 1, 1]]
ADV = [[1.0, 1.0, 1e9], [1.0, 1.0, 1.0]]



class TestGSPO:
    def test_worked_example(self):
        logp, prox = shifted(PROX, LOG_RATIO)
        loss, stats = gspo_loss(logp, prox, prox.clone(), T(ADV), T(MASK), is_config=SEQ, clip_eps_low=0.2, agg_mode=SEQ_MEAN)
        s0, s1 = math.exp(0.1), math.exp(0.2)
        # per token max(-A s, -A clip(s)): row 0 -s0 on both tokens, row 1 -1.2 on all three;
        # seq-mean-token-mean: (-1.105171 - 1.2) / 2 = -1.152585
        close(loss, (-s0 - 1.2) / 2)
        close(stats.clip_frac, 3 / 5)  # every token of row 1
        close(stats.ratio_mean, (2 * s0 + 3 * s1) / 5)  # the sequence ratio on each of its tokens
        close(stats.ratio_max, s1)
        close(stats.approx_kl, (2 * (s0 - 1 - 0.1) + 3 * (s1 - 1 - 0.2)) / 5)
        close(stats.is_weight_mean, 1.0)
        loss.backward()
        # eq. 17: d loss / d logp_t = -A s_i / (|y_i| G) where unclipped: row 0: -1.105171 / (2 * 2) = -0.276293
        # each; row 1 clipped: 0 (its tokens share s_1, so none of them trains); padding 0
        close(logp.grad, [[-s0 / 4, -s0 / 4, 0.0], [0.0, 0.0, 0.0]])

    def test_token_mean_weighs_tokens(self):
        # the same token losses over all 5 tokens: (2 * -1.105171 + 3 * -1.2) / 5 = -1.162068
        logp, prox = shifted(PROX, LOG_RATIO)
        loss, _ = gspo_loss(logp, prox, prox.clone(), T(ADV), T(MASK), is_config=SEQ, clip_eps_low=0.2)
        close(loss, (-2 * math.exp(0.1) - 3.6) / 5)

    def test_the_papers_tiny_clip_range(self):
        # §5.1: eps_low 3e-4, eps_high 4e-4. Mean log ratio 3e-4 -> s = 1.0003 < 1.0004: kept;
        # 5e-4 -> s = 1.0005 > 1.0004: clipped for A > 0; -5e-4 -> s = 0.9995 < 0.9997: clipped for A < 0
        prox = T([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
        logp = (prox + T([[2e-4, 4e-4], [5e-4, 5e-4], [-5e-4, -5e-4]])).requires_grad_()
        adv = T([[1.0, 1.0], [1.0, 1.0], [-1.0, -1.0]])
        loss, stats = gspo_loss(logp, prox, prox.clone(), adv, T([[1, 1]] * 3), is_config=SEQ,
                                clip_eps_low=3e-4, clip_eps_high=4e-4, agg_mode=SEQ_MEAN)
        # rows: -1.0003, -1.0004 (clipped at 1 + 4e-4), +0.9997 (clipped at 1 - 3e-4) -> mean / 3
        close(loss, (-math.exp(3e-4) - 1.0004 + 0.9997) / 3, atol=1e-9)
        close(stats.clip_frac, 4 / 6)
        loss.backward()
        close(logp.grad, [[-math.exp(3e-4) / 6] * 2, [0.0, 0.0], [0.0, 0.0]], atol=1e-9)

    def test_per_token_advantages_take_the_sequence_ratio(self):
        # GSPO-token (eq. 13-14, 17): token t's gradient is -A_t s_i / (|y_i| G); with A = 2, -1 in one
        # response, s = e^0.1: -2 * 1.105171 / 2 = -1.105171 and +1.105171 / 2 = 0.552585 (G = 1)
        prox = T([[-1.0, -2.0]])
        logp = (prox + T([[0.2, 0.0]])).requires_grad_()
        loss, _ = gspo_loss(logp, prox, prox.clone(), T([[2.0, -1.0]]), T([[1, 1]]), is_config=SEQ, agg_mode=SEQ_MEAN)
        close(loss, -math.exp(0.1) * (2 - 1) / 2)
        loss.backward()
        close(logp.grad, [[-2 * math.exp(0.1) / 2, math.exp(0.1) / 2]])

    def test_behaviour_weight_is_one_per_response(self):
        # logp == prox: s = 1. Row 0: pi_prox / mu = 4, 1 -> geometric mean 2 on both tokens;
        # row 1: 0.5 (its second token is padding). seq-mean: (-2 + -0.5) / 2 = -1.25
        prox = T([[-1.0, -1.0], [-1.0, NAN]])
        behav = prox - torch.log(T([[4.0, 1.0], [0.5, 1e9]]))
        adv, mask = T([[1.0, 1.0], [1.0, NAN]]), T([[1, 1], [1, 0]])
        loss, stats = gspo_loss(prox, prox, behav, adv, mask, is_config=SEQ, agg_mode=SEQ_MEAN)
        close(loss, -1.25)
        close(stats.is_weight_max, 2.0)
        # TIS at the sequence cap 1.5 truncates row 0: (-1.5 - 0.5) / 2; the band [0.6, 3] drops row 1: -2 / 2
        loss, stats = gspo_loss(prox, prox, behav, adv, mask, is_config=ISConfig("tis", "sequence", tis_cap=1.5), agg_mode=SEQ_MEAN)
        close(loss, -1.0)
        close(stats.is_truncated_frac, 2 / 3)
        loss, stats = gspo_loss(prox, prox, behav, adv, mask, is_config=ISConfig("mis", "sequence", mis_low=0.6, mis_high=3.0),
                                agg_mode=SEQ_MEAN)
        close(loss, -1.0)
        close(stats.is_masked_frac, 1 / 3)

    @pytest.mark.parametrize("dual_clip_c", [None, 3.0])
    def test_one_token_responses_are_decoupled_ppo(self, dual_clip_c):
        # with |y_i| = 1 the sequence ratio is the token ratio and the geometric-mean weight the
        # token weight: GSPO is decoupled PPO exactly (loss, statistics, gradient)
        logp, prox, behav, adv = random_policy_batch(0, 6, 1, moved=0.4, stale=0.6)
        mask = T([[1]] * 6)
        a, b = logp.detach().clone().requires_grad_(), logp.detach().clone().requires_grad_()
        opts = {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip_c": dual_clip_c}
        loss_g, st_g = gspo_loss(a, prox, behav, adv, mask, is_config=ISConfig("tis", "sequence", tis_cap=1.5), **opts)
        loss_d, st_d = decoupled_ppo_loss(b, prox, behav, adv, mask, is_config=ISConfig("tis", "token", tis_cap=1.5), **opts)
        close(loss_g, loss_d, atol=1e-12)
        for x, y in zip(st_g, st_d):
            close(x, y, atol=1e-12)
        (loss_g + loss_d).backward()
        close(a.grad, b.grad, atol=1e-12)

    def test_gradient_of_a_random_batch(self):
        # no clip (eps 0.99 / 10 on ratios near 1) and no IS correction: the gradient is eq. 17,
        # -A_t s_i w_i / (|y_i| G), with G the responses that have a token
        logp, prox, behav, adv = random_policy_batch(1, 4, 5, moved=0.1, stale=0.2)
        mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
        loss, _ = gspo_loss(logp, prox, behav, adv, mask, is_config=SEQ, clip_eps_low=0.99, clip_eps_high=10.0, agg_mode=SEQ_MEAN)
        loss.backward()
        n = mask.sum(-1, keepdim=True).double()
        s = torch.exp(((logp.detach() - prox) * mask).sum(-1, keepdim=True) / n.clamp(min=1))
        w = torch.exp(((prox - behav) * mask).sum(-1, keepdim=True) / n.clamp(min=1))
        close(logp.grad, torch.where(mask, -adv * s * w / (n.clamp(min=1) * 3), 0.0))

    def test_garbage_in_padding_and_filtered_tokens(self):
        # padding holds NaN / inf / 1e9 in every input; row 1's second real token is filtered out
        # under the current weights (log pi = -inf): the mean is over its live token only
        # (log ratio 0.1 -> s = e^0.1), the filtered token has ratio 0 and no gradient
        prox = T([[-1.0, -1.0, NAN], [-1.0, -1.0, INF]])
        logp = T([[-0.9, -1.1, NAN], [-0.9, -INF, 1e9]]).requires_grad_()
        behav = T([[-1.0, -1.0, -INF], [-1.0, -1.0, NAN]])
        adv, mask = T([[1.0, 1.0, NAN], [1.0, 1.0, 1e9]]), T([[1, 1, 0], [1, 1, 0]])
        loss, stats = gspo_loss(logp, prox, behav, adv, mask, is_config=SEQ, agg_mode=SEQ_MEAN)
        # row 0: s = e^0 = 1 on both tokens -> -1; row 1: token 0 -e^0.1, token 1 max(-0, -0.8) = 0
        close(loss, (-1.0 + (-math.exp(0.1) + 0.0) / 2) / 2)
        loss.backward()
        assert torch.isfinite(logp.grad).all()
        close(logp.grad, [[-0.25, -0.25, 0.0], [-math.exp(0.1) / 4, 0.0, 0.0]])
        assert all(torch.isfinite(x).all() for x in stats)


class TestGSPOConfig:
    def test_the_papers_clip_range_passes_the_checks(self):
        AlgoConfig(policy_loss="gspo", is_level="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4).check()

    def test_needs_the_sequence_level(self):
        with pytest.raises(ConfigError, match="algo.policy_loss=gspo weighs whole responses.*set algo.is_level=sequence"):
            AlgoConfig(policy_loss="gspo").check()
