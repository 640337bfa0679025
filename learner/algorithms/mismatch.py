"""Train/rollout mismatch: the behaviour log-probs ``mu`` the workers sent against the learner's
own log-probs of the same tokens (pi_prox, or the training pass, detached, when pi_prox is read
off it), split by the tokens' lag.

A token is at **lag 0** when it and every token before it in its response were sampled by the
weights the learner holds when it computes its log-probs: the two sides then ran the same weights
on the same context, and any difference is numerics (kernels, batch shapes, dtypes) or an engine
bug. Every other token of the loss mask is **lagged** (lag > 0): its weights, or the K/V of the
tokens before it (an engine keeps a response's cache across an in-flight weight update), are
older, so staleness adds to the difference. The lag of a token is therefore the learner's version
less the oldest version up to it in its response (:func:`context_lags`), the same oldest token
that a sample's staleness counts from.

Per split: the mean and max of ``|log pi - log mu|``, the k3 estimate of KL(mu || pi)
(``r = pi / mu``, ``k3 = r - 1 - log r``: the tokens were sampled from mu), the share of tokens
whose ratio ``r`` is outside ``[BAND_LOW, BAND_HIGH]`` and the count of tokens. Everything in
float64 (a lag-0 difference of 1e-7 nats has a k3 of 5e-15, far below float32's resolution of
``r - 1``), with ``expm1`` for ``r - 1``.

DPO (``algo.estimator=dpo``) reports none of this: its loss never reads the behaviour log-probs
(so a mismatch cannot bias its gradient), it computes no pi_prox, and it forwards only each
group's chosen and rejected responses.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from learner.algorithms.core import bool_mask, check_same_shape
from rlhf_core import metric_names as M

if TYPE_CHECKING:
    from learner.batch import TrainBatch
    from learner.stats import MetricSums

BAND_LOW, BAND_HIGH = 0.5, 2.0  # a ratio pi / mu outside this band is out of band (MIS's default band)


class MismatchSplit(NamedTuple):
    """Detached float64 scalars over one split's tokens (0 each when it has none)."""

    tokens: torch.Tensor  # loss-mask tokens in the split
    abs_mean: torch.Tensor  # mean |log pi - log mu| (nats)
    kl_k3: torch.Tensor  # mean k3 = r - 1 - log r, r = pi / mu: KL(mu || pi)
    out_of_band_frac: torch.Tensor  # share with r < BAND_LOW or r > BAND_HIGH
    abs_max: torch.Tensor  # max |log pi - log mu|


class Mismatch(NamedTuple):
    lag0: MismatchSplit  # sampled by the weights the learner holds, context included
    lagged: MismatchSplit  # the rest of the loss mask


def context_lags(token_versions: torch.Tensor, version: int) -> torch.Tensor:
    """``[B, T]`` each token's lag: ``version`` less the oldest version among it and the tokens
    before it in its row (right padding, -1, comes after every real token and changes none)."""
    return version - torch.cummin(token_versions, dim=-1).values


@torch.no_grad()
def mismatch_stats(learner_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
                   lags: torch.Tensor, *, band_low: float = BAND_LOW, band_high: float = BAND_HIGH) -> Mismatch:
    """The mismatch of ``learner_logp`` (pi) against ``behav_logp`` (mu), ``[B, T]`` each, over the
    tokens of ``mask``, split into ``lags == 0`` and ``lags > 0`` (``[B, T]`` integers; a negative
    lag is in neither split). Masked positions never matter, NaN included."""
    m = bool_mask(mask)
    check_same_shape(learner_logp=learner_logp, behav_logp=behav_logp, mask=m, lags=lags)
    # the float32 values' exact difference, then the rest in float64; garbage at masked positions -> 0
    log_r = torch.where(m, learner_logp.double() - behav_logp.double(), 0.0)
    abs_d = log_r.abs()
    out = (log_r < math.log(band_low)) | (log_r > math.log(band_high))  # r outside the band, without exp's overflow
    # one product sums every statistic of both splits (few small ops: this runs once per micro-batch)
    per_token = torch.stack([torch.ones_like(log_r), abs_d, torch.expm1(log_r) - log_r, out.double()], -1)  # [B, T, 4]
    splits = torch.stack([lags == 0, lags > 0]) & m  # [2, B, T]
    sums = splits.flatten(1).double() @ per_token.flatten(0, 1)  # [2, 4]: tokens, sum |log r|, sum k3, out of band
    means = sums[:, 1:] / sums[:, :1].clamp(min=1)
    maxima = torch.where(splits, abs_d, 0.0).amax((1, 2))  # |log r| >= 0: 0 for a split without tokens
    lag0, lagged = (MismatchSplit(*row.unbind()) for row in torch.cat([sums[:, :1], means, maxima[:, None]], 1))
    return Mismatch(lag0, lagged)


def mismatch_metrics(batch: TrainBatch, learner_logp: torch.Tensor, mask: torch.Tensor, version: int,
                     m: MetricSums) -> None:
    """Add the mismatch of ``batch``'s rows (one pass: the pi_prox pass or a training micro-batch)
    to the update's metrics, the learner holding weights ``version``: means weighted by their
    split's tokens, maxima as maxima, token counts summed; all device tensors until ``m`` reads them."""
    st = mismatch_stats(learner_logp, batch.behaviour_logprobs, mask, context_lags(batch.token_versions, version))
    for split, s in ((M.MISMATCH_LAG0, st.lag0), (M.MISMATCH_LAGGED, st.lagged)):
        key = M.mismatch_key
        m.add(key(split, "abs_mean"), s.abs_mean, s.tokens)
        m.add_max(key(split, "abs_max"), s.abs_max)
        m.add(key(split, "kl_k3"), s.kl_k3, s.tokens)
        m.add(key(split, "out_of_band_frac"), s.out_of_band_frac, s.tokens)
        m.add_total(key(split, "tokens"), s.tokens)
