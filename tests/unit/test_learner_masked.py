"""Unit tests for learner/masked.py: masked reductions and aggregation, garbage in masked slots."""

from __future__ import annotations

import math

import pytest
import torch

from learner.masked import aggregate, masked_max, masked_mean, masked_sum, masked_var, masked_whiten

from learner_helpers import T, close  # noqa: E402

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
        out = masked_whiten(T(X), T(M), eps=0.0)
        close(out, [[-1.5 / s, -0.5 / s, 0.0], [0.5 / s, 0.0, 1.5 / s]])
        # shift_mean=False adds the mean 2.5 back to the real tokens only
        out = masked_whiten(T(X), T(M), shift_mean=False, eps=0.0)
        close(out, [[-1.5 / s + 2.5, -0.5 / s + 2.5, 0.0], [0.5 / s + 2.5, 0.0, 1.5 / s + 2.5]])

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
