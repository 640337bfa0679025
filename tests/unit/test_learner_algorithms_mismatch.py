"""learner.algorithms.mismatch: the train/rollout mismatch of behaviour log-probs against the
learner's, split by lag; its accumulation over micro-batches. Tiny tensors, arithmetic in the comments."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from learner.algorithms.mismatch import context_lags, mismatch_metrics, mismatch_stats
from learner.stats import MetricSums
from learner_helpers import T, close

NAN, INF = float("nan"), float("inf")
L15, L3, L4 = math.log(1.5), math.log(3.0), math.log(4.0)

# log r = log pi - log mu per token; mu = -1 everywhere, so pi = -1 + log r.
# row 0: log r = 0, ln 1.5, -ln 4 (r = 1, 1.5, 0.25), then padding; versions 5 5 5 at version 5: lag 0
# row 1: log r = 0.5, ln 3 (r = 1.65, 3), versions 4 5: the second token's context is version 4's, lag 1 too
LOG_R = [[0.0, L15, -L4, NAN], [0.5, L3, NAN, NAN]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0]]
VERSIONS = [[5, 5, 5, -1], [4, 5, -1, -1]]


def behav() -> torch.Tensor:
    return torch.tensor([[-1.0, -1.0, -1.0, NAN], [-1.0, -1.0, INF, NAN]], dtype=torch.float64)


def learner() -> torch.Tensor:
    return behav() + T(LOG_R)


def test_context_lag_counts_from_the_oldest_token_so_far():
    # cummin of [5 5 5 -1] is [5 5 5 -1]: lags 0 0 0 6; of [4 5 -1 -1] is [4 4 -1 -1]: lags 1 1 6 6
    assert context_lags(torch.tensor(VERSIONS), 5).tolist() == [[0, 0, 0, 6], [1, 1, 6, 6]]


def test_lag_split_abs_k3_and_band_with_worked_numbers():
    st = mismatch_stats(learner(), behav(), T(MASK).bool(), context_lags(torch.tensor(VERSIONS), 5))
    # lag 0: |log r| = 0, 0.405465, 1.386294 -> mean 1.791759 / 3 = 0.597253, max 1.386294
    #   k3 = r - 1 - log r: 0, 0.5 - 0.405465 = 0.094535, 0.25 - 1 + 1.386294 = 0.636294 -> mean 0.243610
    #   out of [0.5, 2]: r = 0.25 only -> 1/3
    close(st.lag0.tokens, 3.0)
    close(st.lag0.abs_mean, (L15 + L4) / 3)
    close(st.lag0.abs_max, L4)
    close(st.lag0.kl_k3, (0.0 + (0.5 - L15) + (0.25 - 1 + L4)) / 3)
    close(st.lag0.out_of_band_frac, 1 / 3)
    # lagged: |log r| = 0.5, 1.098612 -> mean 0.799306, max 1.098612
    #   k3 = e^0.5 - 1.5 = 0.148721, 3 - 1 - 1.098612 = 0.901388 -> mean 0.525055
    #   out of band: r = 3 (r = 1.65 is inside) -> 1/2
    close(st.lagged.tokens, 2.0)
    close(st.lagged.abs_mean, (0.5 + L3) / 2)
    close(st.lagged.abs_max, L3)
    close(st.lagged.kl_k3, ((math.exp(0.5) - 1.5) + (2 - L3)) / 2)
    close(st.lagged.out_of_band_frac, 0.5)
    assert all(t.dtype == torch.float64 for t in (*st.lag0, *st.lagged))


def test_nan_and_inf_at_masked_positions_change_nothing():
    clean = mismatch_stats(learner(), behav(), T(MASK).bool(), context_lags(torch.tensor(VERSIONS), 5))
    lp, bl = learner(), behav()
    lp[0, 3], bl[0, 3] = INF, -INF  # padding: inf - (-inf) would be inf, k3 inf
    lp[1, 2] = NAN
    dirty = mismatch_stats(lp, bl, T(MASK).bool(), context_lags(torch.tensor(VERSIONS), 5))
    for a, b in zip(clean, dirty):
        for x, y in zip(a, b):
            assert torch.isfinite(y) and float(x) == float(y)


def test_all_masked_reads_zero_tokens_and_zeros():
    st = mismatch_stats(learner(), behav(), torch.zeros(2, 4, dtype=torch.bool), torch.zeros(2, 4, dtype=torch.long))
    assert [float(x) for x in (*st.lag0, *st.lagged)] == [0.0] * 10


def test_a_negative_lag_is_in_neither_split():
    # lags -1 (a token newer than the weights held: the reader refuses those) count nowhere
    st = mismatch_stats(learner(), behav(), T(MASK).bool(), torch.full((2, 4), -1))
    assert float(st.lag0.tokens) == float(st.lagged.tokens) == 0.0


def test_float32_log_probs_one_ulp_apart_have_a_k3_float32_could_not_hold():
    # -1 and the next float32 towards 0: log r = -2^-24 = -5.96e-8, k3 = (log r)^2 / 2 = 1.776e-15
    # (float32's r - 1 would round it to 0 or to ~1e-8)
    pi = torch.tensor([[-1.0]], dtype=torch.float32)
    mu = torch.nextafter(pi, torch.zeros_like(pi))
    st = mismatch_stats(pi, mu, torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, 1, dtype=torch.long))
    assert float(st.lag0.abs_mean) == 2.0 ** -24
    assert float(st.lag0.kl_k3) == pytest.approx(2.0 ** -48 / 2, rel=1e-6)


def test_micro_batches_add_up_to_the_whole_batch():
    # row by row through MetricSums (row 1 has no lag-0 token: it weighs 0 in the lag-0 means)
    def batch(rows):
        return SimpleNamespace(behaviour_logprobs=behav()[rows], token_versions=torch.tensor(VERSIONS)[rows])

    whole, parts = MetricSums(), MetricSums()
    mismatch_metrics(batch([0, 1]), learner(), T(MASK).bool(), 5, whole)
    for r in ([0], [1]):
        mismatch_metrics(batch(r), learner()[r], T(MASK).bool()[r], 5, parts)
    a, b = whole.result(), parts.result()
    assert a.keys() == b.keys() and len(a) == 10
    for key in a:
        assert b[key] == pytest.approx(a[key], abs=1e-12), key
    # tokens summed (3 + 0, 0 + 2), maxima as maxima
    assert (b["mismatch/lag0_tokens"], b["mismatch/lagged_tokens"]) == (3.0, 2.0)
    assert b["mismatch/lagged_abs_max"] == pytest.approx(L3)
