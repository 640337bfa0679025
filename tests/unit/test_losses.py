"""Unit tests for learner/losses.py: tiny tensors, arithmetic in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from learner.losses import (
    aggregate,
    decoupled_ppo_loss,
    dpo_loss,
    entropy_bonus,
    entropy_from_logits,
    kl_estimate,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    ppo_clip_loss,
    sft_loss,
    token_logprobs,
    value_loss,
)

from learner_helpers import T, close  # noqa: E402

NAN = float("nan")
INF = float("inf")




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
        out = masked_whiten(T(X), T(M), eps=0.0)
        close(out, [[-1.5 / s, -0.5 / s, 0.0], [0.5 / s, 0.0, 1.5 / s]])
        # shift_mean=False adds the mean 2.5 back to the real tokens only
        out = masked_whiten(T(X), T(M), shift_mean=False, eps=0.0)
        close(out, [[-1.5 / s + 2.5, -0.5 / s + 2.5, 0.0], [0.5 / s + 2.5, 0.0, 1.5 / s + 2.5]])

    def test_gradient_is_finite_with_nan_in_masked_positions(self):
        x = T(X).requires_grad_()
        masked_mean(x, T(M)).backward()
        close(x.grad, [[0.25, 0.25, 0.0], [0.25, 0.0, 0.25]])

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
        close(aggregate(T(LOSS), T(LMASK), mode), expected)

    def test_dr_grpo_norm(self):
        # row sums 6, 8 divided by norm_len 4 -> 1.5, 2 -> mean 1.75
        close(aggregate(T(LOSS), T(LMASK), "seq-mean-token-sum-norm", norm_len=4), 1.75)

    def test_norm_mode_needs_norm_len(self):
        with pytest.raises(ValueError, match="norm_len"):
            aggregate(T(LOSS), T(LMASK), "seq-mean-token-sum-norm")

    def test_unknown_mode(self):
        with pytest.raises(ValueError, match="'token_mean'.*'token-mean'.*'seq-mean-token-mean'"):
            aggregate(T(LOSS), T(LMASK), "token_mean")

    def test_all_masked_is_zero(self):
        for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
            close(aggregate(T([[NAN, 1.0]]), T([[0, 0]]), mode), 0.0)

    def test_gradient_weights(self):
        # seq-mean-token-mean: row 0 tokens get 1/3 * 1/2, row 1 token gets 1 * 1/2
        x = T(LOSS).requires_grad_()
        aggregate(x, T(LMASK), "seq-mean-token-mean").backward()
        close(x.grad, [[1 / 6, 1 / 6, 1 / 6, 0], [0.5, 0, 0, 0], [0, 0, 0, 0]])


# --------------------------------------------------------------------------- #
# Log-probs, KL, entropy, SFT
# --------------------------------------------------------------------------- #
class TestKL:
    # log r = ref - logp = [-0.5, 1.0]
    LOGP, REF = [[-1.0, -2.0]], [[-1.5, -1.0]]

    def test_k1(self):
        close(kl_estimate(T(self.LOGP), T(self.REF), "k1"), [[0.5, -1.0]])

    def test_k2(self):
        # 0.5 * 0.25 = 0.125, 0.5 * 1 = 0.5
        close(kl_estimate(T(self.LOGP), T(self.REF), "k2"), [[0.125, 0.5]])

    def test_k3(self):
        # e^-0.5 + 0.5 - 1 = 0.106531, e^1 - 1 - 1 = 0.718282
        close(kl_estimate(T(self.LOGP), T(self.REF), "k3"), [[0.1065307, 0.7182818]])

    def test_mask_zeroes_garbage(self):
        out = kl_estimate(T([[-1.0, NAN]]), T([[-1.5, 1e9]]), "k3", mask=T([[1, 0]]))
        close(out, [[0.1065307, 0.0]])

    def test_unknown_kind(self):
        with pytest.raises(ValueError, match="'k4'.*'k1', 'k2', 'k3'"):
            kl_estimate(T(self.LOGP), T(self.REF), "k4")


class TestTokenLogprobs:
    def test_values_and_temperature(self):
        # logits [0, ln 3] -> probs [1/4, 3/4]
        logits = T([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
        close(token_logprobs(logits, torch.tensor([[1, 0]])), [[math.log(0.75), math.log(0.25)]])
        # T=2: logits [0, ln3/2] -> p0 = 1 / (1 + sqrt 3) -> log p0 = -1.005053
        close(token_logprobs(logits, torch.tensor([[0, 0]]), temperature=2.0), [[-1.0050525] * 2])

    def test_masked_ignore_index_and_upcast(self):
        logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0]]], dtype=torch.bfloat16)
        out = token_logprobs(logits, torch.tensor([[1, -100]]), mask=T([[1, 0]]))
        assert out.dtype == torch.float32
        close(out, [[math.log(0.75), 0.0]], atol=1e-2)

    def test_bad_temperature(self):
        with pytest.raises(ValueError, match="temperature.*0"):
            token_logprobs(T([[[0.0]]]), torch.tensor([[0]]), temperature=0.0)


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


class TestSFT:
    def test_nll(self):
        logp, mask = T([[-1.0, -3.0, NAN], [-5.0, 1e9, 1e9]]), T([[1, 1, 0], [1, 0, 0]])
        # token-mean: (1 + 3 + 5) / 3 = 3; seq-mean-token-mean: (2 + 5) / 2 = 3.5
        loss, stats = sft_loss(logp, mask)
        close(loss, 3.0)
        close(stats.nll, 3.0)
        assert stats.num_tokens.item() == 3
        loss, stats = sft_loss(logp, mask, "seq-mean-token-mean")
        close(loss, 3.5)
        close(stats.nll, 3.0)


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
        loss_d, stats_d = decoupled_ppo_loss(
            a, prox, prox.clone(), adv, mask, 0.2, 0.28, is_correction, is_level,
            tis_cap=2.0, mis_low=0.5, mis_high=2.0, dual_clip_c=dual_clip_c, agg_mode=agg_mode,
        )
        loss_p, stats_p = ppo_clip_loss(b, prox, adv, mask, 0.2, 0.28, dual_clip_c, agg_mode)
        assert torch.equal(loss_d, loss_p)
        for name, x, y in zip(stats_p._fields, stats_d, stats_p):
            assert torch.equal(x, y), name
        (loss_d + loss_p).backward()
        assert torch.equal(a.grad, b.grad)
        assert torch.isfinite(a.grad).all()

    @pytest.mark.parametrize("is_level", ["token", "sequence"])
    def test_tis_with_infinite_cap_is_full_is(self, is_level):
        logp, prox, behav, adv, mask = _random_batch(1)
        full, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, is_correction="none", is_level=is_level)
        tis, stats = decoupled_ppo_loss(
            logp, prox, behav, adv, mask, is_correction="tis", is_level=is_level, tis_cap=INF
        )
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
        loss, stats = decoupled_ppo_loss(prox, prox, behav, adv, mask, is_correction="tis", tis_cap=2.0)
        close(loss, -(2 + math.exp(-0.5) + 1) / 3)
        close(stats.is_truncated_frac, 1 / 3)
        close(stats.is_weight_max, math.e)  # raw weight, before truncation
        # full IS: -(2.718 + 0.6065 + 1) / 3 = -1.4416
        loss, _ = decoupled_ppo_loss(prox, prox, behav, adv, mask, is_correction="none")
        close(loss, -(math.e + math.exp(-0.5) + 1) / 3)

    def test_mis_drops_exactly_the_tokens_outside_band(self):
        prox = T([[-1.0, -1.0, -1.0, -1.0, NAN]])
        # w = 3, 0.25, 1.5, 1 (+ masked garbage); band [0.5, 2] keeps tokens 2, 3 only
        behav = prox - torch.log(T([[3.0, 0.25, 1.5, 1.0, 1.0]]))
        adv, mask = T([[1.0, 1.0, 1.0, 1.0, 1e9]]), T([[1, 1, 1, 1, 0]])
        logp = prox.clone().requires_grad_()
        loss, stats = decoupled_ppo_loss(
            logp, prox, behav, adv, mask, is_correction="mis", mis_low=0.5, mis_high=2.0
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
        loss, stats = decoupled_ppo_loss(prox, prox, behav, adv, mask, is_level="sequence")
        close(loss, -(2 + 2 + 0.5) / 3)  # -1.5 (token level would be -(4 + 1 + 0.5) / 3)
        close(stats.is_weight_mean, 1.5)
        close(stats.is_weight_max, 2.0)
        # TIS cap 1.5 truncates all of row 0: -(1.5 + 1.5 + 0.5) / 3
        loss, stats = decoupled_ppo_loss(
            prox, prox, behav, adv, mask, is_correction="tis", is_level="sequence", tis_cap=1.5
        )
        close(loss, -3.5 / 3)
        close(stats.is_truncated_frac, 2 / 3)
        # MIS band [0.6, 3] drops the whole of row 1: -(2 + 2) / 3
        loss, stats = decoupled_ppo_loss(
            prox, prox, behav, adv, mask, is_correction="mis", is_level="sequence",
            mis_low=0.6, mis_high=3.0,
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
            ({"is_correction": "clip"}, "'clip'.*'none', 'tis', 'mis'"),
            ({"is_level": "batch"}, "'batch'.*'token', 'sequence'"),
            ({"agg_mode": "sum"}, "'sum'.*'token-mean'"),
        ],
    )
    def test_validation(self, kwargs, match):
        logp, prox, behav, adv, mask = _random_batch(2)
        with pytest.raises(ValueError, match=match):
            decoupled_ppo_loss(logp, prox, behav, adv, mask, **kwargs)


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
