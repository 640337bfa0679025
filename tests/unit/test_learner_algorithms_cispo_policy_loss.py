"""learner.algorithms.cispo_policy_loss: CISPO (MiniMax-M1, arXiv 2506.13585, §3.1 eq. 4-5), the
clipped and detached IS weight, pi_prox as old, with the behaviour weight. Tiny tensors,
arithmetic in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from learner.algorithms.cispo_policy_loss import cispo_loss
from learner.algorithms.ppo_policy_loss import ppo_clip_loss
from learner_helpers import T, close, random_policy_batch, shifted  # noqa: E402
from rlhf_core.config import AlgoConfig, ConfigError, ISConfig

NAN = float("nan")
INF = float("inf")

# token: log(pi / pi_prox), A, log pi
#   0: +0.1, +1, -0.9 -> r = 1.105171, clip [0.8, 1.2] keeps it -> loss -1.105171 * 1 * -0.9 = +0.994654
#   1: +0.5, +1, -0.5 -> r = 1.648721 -> weight 1.2              -> loss -1.2 * 1 * -0.5      = +0.6
#   2: -0.5, -1, -1.5 -> r = 0.606531 -> weight 0.8              -> loss -0.8 * -1 * -1.5     = -1.2
#   3:  0.0, -1, -1.0 -> r = 1                                   -> loss -1 * -1 * -1         = -1.0
#   4: padding garbage
PROX = [[-1.0, -1.0, -1.0, -1.0, NAN]]
LOG_RATIO = [[0.1, 0.5, -0.5, 0.0, NAN]]
ADV = [[1.0, 1.0, -1.0, -1.0, 1e9]]
MASK = [[1, 1, 1, 1, 0]]



class TestCISPO:
    def test_worked_example(self):
        logp, prox = shifted(PROX, LOG_RATIO)
        loss, stats = cispo_loss(logp, prox, prox.clone(), T(ADV), T(MASK), clip_eps_low=0.2, clip_eps_high=0.2)
        # eq. 4, token-mean: (0.994654 + 0.6 - 1.2 - 1.0) / 4 = -0.151337
        close(loss, (math.exp(0.1) * 0.9 + 0.6 - 1.2 - 1.0) / 4)
        close(stats.clip_frac, 0.5)  # tokens 1 and 2: weight clipped, gradient kept
        close(stats.ratio_max, math.exp(0.5))
        close(stats.approx_kl, sum(math.exp(v) - 1 - v for v in (0.1, 0.5, -0.5, 0.0)) / 4)
        close(stats.is_weight_mean, 1.0)
        loss.backward()
        # d loss / d logp_t = -clip(r_t) * A_t / 4: every real token trains
        #   -1.105171 / 4, -1.2 / 4, +0.8 / 4, +1 / 4 (PPO: 0 for tokens 1 and 2, its clip drops them)
        close(logp.grad, [[-math.exp(0.1) / 4, -0.3, 0.2, 0.25, 0.0]])
        ppo_logp = (T(PROX) + T(LOG_RATIO)).requires_grad_()
        ppo_loss, _ = ppo_clip_loss(ppo_logp, None, T(PROX), T(ADV), T(MASK), clip_eps_low=0.2)
        ppo_loss.backward()
        close(ppo_logp.grad[0, 1:3], [0.0, 0.0])

    def test_no_lower_bound(self):
        # MiniMax-M1 sets no lower bound (eps_low large): eps_low = 1 -> the clip is [0, 1.2];
        # token 2 keeps its weight r = 0.606531: gradient +0.606531 / 4 instead of +0.8 / 4
        logp, prox = shifted(PROX, LOG_RATIO)
        loss, stats = cispo_loss(logp, prox, prox.clone(), T(ADV), T(MASK), clip_eps_low=1.0, clip_eps_high=0.2)
        close(loss, (math.exp(0.1) * 0.9 + 0.6 - math.exp(-0.5) * 1.5 - 1.0) / 4)
        close(stats.clip_frac, 0.25)  # token 1 only
        loss.backward()
        close(logp.grad, [[-math.exp(0.1) / 4, -0.3, math.exp(-0.5) / 4, 0.25, 0.0]])

    def test_behaviour_weight_multiplies_each_token(self):
        # logp == prox (an update's first step): r = 1, so the gradient is -w_t A_t grad log pi / n, IS-weighted
        # REINFORCE. pi_prox / mu = e^1, e^-0.5, 1; TIS at 2: w = 2, 0.606531, 1; A = 1
        prox = T([[-1.0, -1.0, -1.0]])
        behav = prox - T([[1.0, -0.5, 0.0]])
        logp = prox.clone().requires_grad_()
        loss, stats = cispo_loss(logp, prox, behav, T([[1.0, 1.0, 1.0]]), T([[1, 1, 1]]), is_config=ISConfig("tis", tis_cap=2.0))
        # loss -(2 + 0.606531 + 1) * (-1) / 3: every log pi is -1
        close(loss, (2 + math.exp(-0.5) + 1) / 3)
        close(stats.is_truncated_frac, 1 / 3)
        close(stats.is_weight_max, math.e)
        loss.backward()
        close(logp.grad, [[-2 / 3, -math.exp(-0.5) / 3, -1 / 3]])

    def test_gradient_of_a_random_batch(self):
        # the gradient is -w_t clip(r_t) A_t / n_tokens on every real token (eq. 4), whatever r_t
        logp, prox, behav, adv = random_policy_batch(2, 3, 6, moved=0.5, stale=0.5)
        mask = torch.rand(3, 6, generator=torch.Generator().manual_seed(2)) > 0.3
        loss, _ = cispo_loss(logp, prox, behav, adv, mask, clip_eps_low=1.0, clip_eps_high=0.2, is_config=ISConfig("tis"))
        loss.backward()
        r = torch.exp(logp.detach() - prox).clamp(max=1.2)
        w = torch.exp(prox - behav).clamp(max=2.0)
        close(logp.grad, torch.where(mask, -w * r * adv / mask.sum(), 0.0))
        assert (logp.grad[mask] != 0).all()  # no token dropped

    def test_garbage_in_padding_and_filtered_tokens(self):
        # padding holds NaN / inf / 1e9; token 2 is real but filtered out under the current weights
        # (log pi = -inf): it adds 0 and no gradient and stays in the denominator (3 tokens)
        prox = T([[-1.0, -1.0, -1.0, INF]])
        logp = T([[-1.0, -2.0, -INF, NAN]]).requires_grad_()
        behav = T([[-1.0, -1.0, -1.0, NAN]])
        adv, mask = T([[1.0, 1.0, 1.0, NAN]]), T([[1, 1, 1, 0]])
        loss, stats = cispo_loss(logp, prox, behav, adv, mask)
        # token 0: r = 1 -> -1 * 1 * -1 = 1; token 1: r = e^-1 = 0.367879, no lower bound -> -0.367879 * -2 = 0.735759
        close(loss, (1 + 2 * math.exp(-1)) / 3)
        loss.backward()
        close(logp.grad, [[-1 / 3, -math.exp(-1) / 3, 0.0, 0.0]])
        assert all(torch.isfinite(x).all() for x in stats)
        close(stats.ratio_mean, (1 + math.exp(-1) + 0) / 3)  # the filtered token's ratio is 0, as in PPO's statistics

    def test_seq_mean_aggregation(self):
        # agg_mode applies as in every loss: rows of 2 and 1 tokens, logp == prox == -1, A = 1:
        # token loss 1 each; seq-mean-token-mean (1 + 1) / 2 = 1, gradient -1 / (2 * 2) and -1 / (1 * 2)
        prox = T([[-1.0, -1.0], [-1.0, NAN]])
        logp = prox.clone().requires_grad_()
        loss, _ = cispo_loss(logp, prox, prox, T([[1.0, 1.0], [1.0, NAN]]), T([[1, 1], [1, 0]]), agg_mode="seq-mean-token-mean")
        close(loss, 1.0)
        loss.backward()
        close(logp.grad, [[-0.25, -0.25], [-0.5, 0.0]])

    def test_validation(self):
        logp, prox = shifted(PROX, LOG_RATIO)
        refused = {"clip_eps_low": (0.0, r"clip_eps_low must be > 0 \(>= 1: no lower bound\), got 0.0"),
                   "clip_eps_high": (-0.1, "clip_eps_high.*-0.1"),
                   "dual_clip_c": (3.0, "dual_clip_c caps PPO's clipped loss; algo.policy_loss=cispo.*has no such cap"),
                   "agg_mode": ("mean", "'mean'.*'token-mean'")}
        for key, (value, match) in refused.items():
            with pytest.raises(ValueError, match=match):
                cispo_loss(logp, prox, prox, T(ADV), T(MASK), **{key: value})


class TestCISPOConfig:
    def test_no_lower_bound_is_cispo_only(self):
        AlgoConfig(policy_loss="cispo", clip_eps_low=1.0).check()
        with pytest.raises(ConfigError, match=r"algo.clip_eps_low must be in \(0, 1\) \(>= 1, no lower bound, only with "
                                              r"algo.policy_loss=cispo\), got 1.0"):
            AlgoConfig(policy_loss="decoupled", clip_eps_low=1.0).check()

    def test_no_dual_clip(self):
        with pytest.raises(ConfigError, match="set algo.dual_clip_c=null, got 3.0"):
            AlgoConfig(policy_loss="cispo", dual_clip_c=3.0).check()
