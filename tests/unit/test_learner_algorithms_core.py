"""learner.algorithms.core: masked reductions and aggregation, whitening over ranks, per-token
rewards, KL estimators, the entropy bonus and IcePop's importance weights. Tiny tensors,
arithmetic in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from learner.algorithms.core import (
    aggregate,
    entropy_bonus,
    global_whiten,
    is_weights,
    kl_estimate,
    masked_max,
    masked_mean,
    masked_sum,
    masked_var,
    token_rewards,
)
from learner_helpers import T, close  # noqa: E402
from rlhf_core.config import ConfigError, ISConfig

NAN = float("nan")


# --------------------------------------------------------------------------- #
# Masked helpers
# --------------------------------------------------------------------------- #
X = [[1.0, 2.0, 1e9], [3.0, NAN, 4.0]]
M = [[1, 1, 0], [1, 0, 1]]


class TestMaskedHelpers:
    def test_sum_and_mean_ignore_garbage(self):
        # real values 1, 2, 3, 4 -> sum 10, mean 2.5; 1e9 and NaN are masked
        close(masked_sum(T(X), T(M)), 10.0)
        close(masked_mean(T(X), T(M)), 2.5)
        # per row: (1+2)/2 = 1.5, (3+4)/2 = 3.5; bool mask works the same
        close(masked_mean(T(X), T(M).bool(), dim=-1), [1.5, 3.5])
        close(masked_sum(T(X), T(M), dim=-1), [3.0, 7.0])

    def test_var_biased_and_unbiased(self):
        # deviations from 2.5: -1.5, -0.5, 0.5, 1.5 -> squares sum 5
        close(masked_var(T(X), T(M), unbiased=False), 5 / 4)
        close(masked_var(T(X), T(M), unbiased=True), 5 / 3)
        # per row (1,2) and (3,4): biased 0.25, unbiased 0.5
        close(masked_var(T(X), T(M), unbiased=False, dim=-1), [0.25, 0.25])
        close(masked_var(T(X), T(M), unbiased=True, dim=-1), [0.5, 0.5])

    def test_var_single_token_is_zero_and_empty_mean_is_zero(self):
        close(masked_var(T([[7.0, NAN]]), T([[1, 0]]), unbiased=True), 0.0)
        close(masked_mean(T([[7.0, NAN]]), T([[0, 0]])), 0.0)

    def test_whiten(self):
        # (x - 2.5) / sqrt(1.25): 1 -> -1.3416, 2 -> -0.4472, 3 -> 0.4472, 4 -> 1.3416
        s = math.sqrt(1.25)
        out = global_whiten(T(X), T(M), eps=0.0)
        close(out, [[-1.5 / s, -0.5 / s, 0.0], [0.5 / s, 0.0, 1.5 / s]])

    def test_gradient_is_finite_with_nan_in_masked_positions(self):
        x = T(X).requires_grad_()
        masked_mean(x, T(M)).backward()
        close(x.grad, [[0.25, 0.25, 0.0], [0.25, 0.0, 0.25]])

    def test_max_ignores_garbage_and_is_zero_when_empty(self):
        # real values 1, 2, 3, 4 -> 4 (the masked 1e9 is not a candidate)
        close(masked_max(T(X), T(M)), 4.0)
        close(masked_max(T([[-5.0, 1e9]]), T([[0, 0]])), 0.0)

    def test_shape_mismatch_raises(self):
        with pytest.raises(ValueError, match=r"\(2, 3\).*\(3, 2\)"):
            masked_sum(T(X), torch.ones(3, 2))


# --------------------------------------------------------------------------- #
# Aggregation
# --------------------------------------------------------------------------- #
LOSS = [[1.0, 2.0, 3.0, NAN], [8.0, 1e9, 1e9, 1e9], [NAN, NAN, NAN, NAN]]
LMASK = [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]  # row 2 has no real token


class TestAggregate:
    @pytest.mark.parametrize(
        "mode, expected",
        [
            ("token-mean", (1 + 2 + 3 + 8) / 4),  # 3.5
            ("seq-mean-token-mean", (2 + 8) / 2),  # row means 2, 8 -> 5 (row 2 excluded)
            ("seq-mean-token-sum", (6 + 8) / 2),  # row sums 6, 8 -> 7
        ],
    )
    def test_modes(self, mode, expected):
        close(aggregate(T(LOSS), T(LMASK), mode=mode), expected)

    def test_dr_grpo_norm(self):
        # row sums 6, 8 divided by norm_len 4 -> 1.5, 2 -> mean 1.75
        close(aggregate(T(LOSS), T(LMASK), mode="seq-mean-token-sum-norm", norm_len=4), 1.75)

    def test_norm_mode_needs_norm_len(self):
        with pytest.raises(ValueError, match="norm_len"):
            aggregate(T(LOSS), T(LMASK), mode="seq-mean-token-sum-norm")

    def test_unknown_mode(self):
        with pytest.raises(ValueError, match="'token_mean'.*'token-mean'.*'seq-mean-token-mean'"):
            aggregate(T(LOSS), T(LMASK), mode="token_mean")

    def test_all_masked_is_zero(self):
        for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
            close(aggregate(T([[NAN, 1.0]]), T([[0, 0]]), mode=mode), 0.0)

    def test_gradient_weights(self):
        # seq-mean-token-mean: row 0 tokens get 1/3 * 1/2, row 1 token gets 1 * 1/2
        x = T(LOSS).requires_grad_()
        aggregate(x, T(LMASK), mode="seq-mean-token-mean").backward()
        close(x.grad, [[1 / 6, 1 / 6, 1 / 6, 0], [0.5, 0, 0, 0], [0, 0, 0, 0]])


# --------------------------------------------------------------------------- #
# Whitening over data-parallel ranks
# --------------------------------------------------------------------------- #
def test_global_whiten_alone_is_the_masked_formula():
    torch.manual_seed(0)
    x, mask = torch.randn(4, 6), torch.rand(4, 6) > 0.3
    mean, var = masked_mean(x, mask), masked_var(x, mask, unbiased=False)
    want = torch.where(mask, (x - mean) * torch.rsqrt(var + 1e-8), torch.zeros_like(x))
    torch.testing.assert_close(global_whiten(x, mask), want, rtol=0, atol=0)


def test_global_whiten_uses_the_statistics_of_every_rank():
    # two "ranks" holding halves of the batch, summed by a fake all-reduce that adds the
    # other rank's contribution: the result equals whitening the whole batch at once
    torch.manual_seed(1)
    x, mask = torch.randn(4, 5), torch.rand(4, 5) > 0.2
    whole = global_whiten(x, mask)
    halves = [(x[:2], mask[:2]), (x[2:], mask[2:])]

    def run(me: int):
        other_x, other_m = halves[1 - me]
        calls = iter([
            lambda t: t.add_(torch.stack([(other_x * other_m).sum(), other_m.sum().float()])),
            None,  # the squared deviations, filled below once the mean is known
        ])
        mean = (x * mask).sum() / mask.sum()
        sq_other = (((other_x - mean) ** 2) * other_m).sum()

        def fake(t):
            f = next(calls)
            return f(t) if f else t.add_(sq_other)

        return global_whiten(halves[me][0], halves[me][1], fake)

    torch.testing.assert_close(torch.cat([run(0), run(1)]), whole, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------- #
# Token rewards
# --------------------------------------------------------------------------- #
class TestTokenRewards:
    MASK = [[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]]

    def test_reward_on_last_real_token(self):
        out = token_rewards(T([1.0, 2.0, 3.0]), T(self.MASK))
        # row 2 has no real token: its reward is dropped
        close(out, [[0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 0, 0]])

    def test_kl_penalty(self):
        kl = T([[0.1, 0.2, 0.3, NAN], [0.5, NAN, -0.1, 9.0], [1.0, 1.0, 1.0, 1.0]])
        out = token_rewards(T([1.0, 2.0, 3.0]), T(self.MASK), kl=kl, kl_coef=0.5)
        # row 0: -0.05, -0.1, -0.15 + 1; row 1: -0.25, -, 0.05 + 2
        close(out, [[-0.05, -0.1, 0.85, 0], [-0.25, 0, 2.05, 0], [0, 0, 0, 0]])

    def test_errors(self):
        with pytest.raises(ValueError, match="kl_coef.*-1"):
            token_rewards(T([1.0]), T([[1]]), kl_coef=-1.0)
        with pytest.raises(ValueError, match=r"\[B\]=\(1,\).*\(2,\)"):
            token_rewards(T([1.0, 2.0]), T([[1]]))


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


class TestEntropyBonus:
    def test_bonus(self):
        # entropy of real tokens 1, 2 -> mean 1.5 -> loss -0.01 * 1.5
        loss, stats = entropy_bonus(T([[1.0, 2.0, NAN]]), T([[1, 1, 0]]), coef=0.01)
        close(loss, -0.015)
        close(stats.entropy, 1.5)


class TestIcePopWeights:
    # pi_prox / mu per token: 0.3, 0.5, 1.5, 3, 6 (+ padding garbage). IcePop (Ring-1T's alpha 0.5,
    # beta 5): M(k) = k inside [0.5, 5], 0 outside -> 0, 0.5, 1.5, 3, 0; MIS [0.5, 2] would also drop 3
    W = [[0.3, 0.5, 1.5, 3.0, 6.0, 1.0]]
    MASK = [[1, 1, 1, 1, 1, 0]]

    def _weights(self, correction):
        prox = T([[-1.0] * 6])
        return is_weights(prox, prox - torch.log(T(self.W)), T(self.MASK) > 0, ISConfig(correction))

    def test_band_keeps_and_reweights(self):
        w = self._weights("icepop")
        close(w.w[:, :5], [[0.0, 0.5, 1.5, 3.0, 0.0]])  # kept tokens keep their weight k (not 1)
        assert w.dropped[0].tolist() == [True, False, False, False, True, False]
        close(w.raw_w[:, :5], [self.W[0][:5]])
        assert not w.truncated.any()
        mis = self._weights("mis")
        close(mis.w[:, :5], [[0.0, 0.5, 1.5, 0.0, 0.0]])

    def test_token_level_only(self):
        with pytest.raises(ConfigError, match="algo.is_correction=icepop masks single tokens; with algo.is_level=sequence"):
            ISConfig("icepop", "sequence")
        with pytest.raises(ConfigError, match=r"0 <= algo.icepop_low < algo.icepop_high, got \[5.0, 0.5\]"):
            ISConfig("icepop", icepop_low=5.0, icepop_high=0.5)
