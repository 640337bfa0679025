"""Pure loss math for the learner: KL estimators, entropy bonus, policy and value losses.

Tensors in, a scalar loss and a ``NamedTuple`` of detached stats out; no I/O, no config
objects, no state. Tensors are positional and every other option keyword-only, so two
neighbouring numbers cannot be swapped. ``[B, T]`` per-token tensors and the ``mask`` of real
tokens follow :mod:`learner.masked`. Log-probabilities, never probabilities. Advantage
estimators live in :mod:`learner.advantages`, the online-DPO loss in :mod:`learner.dpo_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from learner.masked import (
    AggregationMode, aggregate, bool_mask, check_choice, check_same_shape, masked_max, masked_mean, masked_var,
    where_real,
)

KLKind = Literal["k1", "k2", "k3"]
ISCorrection = Literal["none", "tis", "mis"]
ISLevel = Literal["token", "sequence"]


def _check_clip(clip_eps_low: float, clip_eps_high: float | None, dual_clip_c: float | None) -> float:
    if not 0.0 < clip_eps_low < 1.0:
        raise ValueError(f"clip_eps_low must be in (0, 1), got {clip_eps_low}")
    high = clip_eps_low if clip_eps_high is None else clip_eps_high
    if not high > 0.0:
        raise ValueError(f"clip_eps_high must be > 0, got {clip_eps_high}")
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (or None to disable), got {dual_clip_c}")
    return high


# ---------- KL, entropy --------------------------------------------------- #
def kl_estimate(
    logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor | None = None, *, kind: KLKind = "k3"
) -> torch.Tensor:
    """Per-token Monte-Carlo estimate of ``KL(pi || ref)`` for ``x ~ pi``.

    From J. Schulman, "Approximating KL Divergence" (2020),
    http://joschu.net/blog/kl-approx.html, with ``log r = ref_logp - logp``:

        * ``k1 = -log r = logp - ref_logp``              (unbiased, high variance)
        * ``k2 = 0.5 * (log r)^2``                       (biased, low variance)
        * ``k3 = (r - 1) - log r``                       (unbiased, low variance, >= 0)

    The estimators are unbiased only if the tokens were sampled from ``pi``;
    in an off-policy setting they were sampled from the behaviour policy.

    Args:
        logp (torch.Tensor): ``[B, T]`` log-probs under the policy.
        ref_logp (torch.Tensor): ``[B, T]`` log-probs under the reference.
        mask (torch.Tensor | None): ``[B, T]``; masked positions give 0.
        kind (KLKind): ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        torch.Tensor: ``[B, T]`` per-token KL estimate.
    """
    check_choice("kl kind", kind, KLKind)
    check_same_shape(logp=logp, ref_logp=ref_logp)
    if mask is not None:
        m = bool_mask(mask)
        logp, ref_logp = where_real(logp, m), where_real(ref_logp, m)
    log_r = ref_logp - logp
    if kind == "k1":
        kl = -log_r
    elif kind == "k2":
        kl = 0.5 * log_r**2
    else:
        kl = torch.exp(log_r) - log_r - 1.0
    return kl if mask is None else where_real(kl, m)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy ``H = -sum_v p_v log p_v`` of ``softmax(logits)``.

    Uses ``log_softmax`` (logsumexp-stable); vocabulary entries with logit ``-inf``
    contribute 0 (and no NaN gradient).

    Args:
        logits (torch.Tensor): ``[B, T, V]``.

    Returns:
        torch.Tensor: ``[B, T]`` entropy in nats.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp = F.log_softmax(logits, dim=-1)
    p = torch.exp(logp)
    safe_logp = torch.where(p > 0, logp, torch.zeros_like(logp))
    return -(p * safe_logp).sum(-1)


class EntropyStats(NamedTuple):
    entropy: torch.Tensor  # aggregated entropy (nats), detached


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float,
    agg_mode: AggregationMode = "token-mean",
    norm_len: int | None = None,
) -> tuple[torch.Tensor, EntropyStats]:
    """Entropy bonus as a loss term to *add* to the total loss: ``-coef * H``, with ``H`` the
    ``[B, T]`` per-token ``entropy`` (:func:`entropy_from_logits`) over the real tokens of
    ``mask`` aggregated per ``agg_mode`` (:func:`learner.masked.aggregate`). ``coef > 0``
    encourages exploration. Returns the scalar loss and the detached aggregated entropy.
    """
    h = aggregate(entropy, mask, mode=agg_mode, norm_len=norm_len)
    return -coef * h, EntropyStats(entropy=h.detach())


# ---------- Policy losses ------------------------------------------------- #
@dataclass(frozen=True)
class ISConfig:
    """How :func:`decoupled_ppo_loss` weights token losses by ``w = pi_prox / pi_behav``.

    ``level``: ``"token"`` uses per-token ``w_t``; ``"sequence"`` the geometric mean of the
    sequence's token weights, ``exp(masked_mean_t(log w_t))``, on all its tokens.
    ``correction`` (applied to that ``w``): ``"none"`` keeps ``w`` (full IS); ``"tis"``
    truncates, ``min(w, tis_cap)`` (``inf`` allowed); ``"mis"`` keeps ``w`` if
    ``mis_low <= w <= mis_high`` else 0 (dropped tokens still count in the denominator).
    """

    correction: ISCorrection = "none"
    level: ISLevel = "token"
    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0

    def __post_init__(self) -> None:
        check_choice("is_correction", self.correction, ISCorrection)
        check_choice("is_level", self.level, ISLevel)
        if not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        if not 0.0 <= self.mis_low < self.mis_high:
            raise ValueError(f"need 0 <= mis_low < mis_high, got mis_low={self.mis_low}, mis_high={self.mis_high}")


class PolicyLossStats(NamedTuple):
    """Detached scalars; fractions/means are over real tokens."""

    loss: torch.Tensor  # aggregated loss
    clip_frac: torch.Tensor  # tokens where the clipped PPO branch is active
    dual_clip_frac: torch.Tensor  # tokens capped by the dual clip (A < 0)
    approx_kl: torch.Tensor  # k3 estimate of KL(old/prox || pi), Schulman 2020
    ratio_mean: torch.Tensor  # pi / pi_old (or pi / pi_prox)
    ratio_max: torch.Tensor
    is_weight_mean: torch.Tensor  # raw pi_prox / pi_behav at the IS level, before correction (1 on-policy)
    is_weight_max: torch.Tensor
    is_truncated_frac: torch.Tensor  # TIS: tokens with w > tis_cap
    is_masked_frac: torch.Tensor  # MIS: tokens dropped (w outside band)
    behav_approx_kl: torch.Tensor  # k3 estimate of KL(behav || prox): staleness


class _ISWeights(NamedTuple):
    w: torch.Tensor  # corrected weight multiplying the token loss
    raw_w: torch.Tensor  # before truncation / masking
    log_w_tokens: torch.Tensor  # per-token prox_logp - behav_logp
    truncated: torch.Tensor  # bool
    dropped: torch.Tensor  # bool


@torch.no_grad()
def _is_weights(prox: torch.Tensor, behav: torch.Tensor, m: torch.Tensor, cfg: ISConfig) -> _ISWeights:
    """IS weights of sanitised ``[B, T]`` log-probs; see :func:`decoupled_ppo_loss`."""
    log_w_tokens = prox - behav
    if cfg.level == "sequence":
        log_w = masked_mean(log_w_tokens, m, dim=-1).unsqueeze(-1).expand_as(log_w_tokens)
    else:
        log_w = log_w_tokens
    raw_w = torch.exp(log_w)
    truncated = dropped = torch.zeros_like(m)
    if cfg.correction == "tis":
        truncated = raw_w > cfg.tis_cap
        w = torch.clamp(raw_w, max=cfg.tis_cap)
    elif cfg.correction == "mis":
        dropped = (raw_w < cfg.mis_low) | (raw_w > cfg.mis_high)
        w = torch.where(dropped, torch.zeros_like(raw_w), raw_w)
    else:
        w = raw_w
    return _ISWeights(w, raw_w, log_w_tokens, truncated, dropped)


def _clipped_policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, m: torch.Tensor, *,
    clip_eps_low: float, clip_eps_high: float, dual_clip_c: float | None,
    agg_mode: AggregationMode, norm_len: int | None, isw: _ISWeights | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Shared PPO-clip body; all tensor inputs already sanitised with ``m``."""
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    # Schulman et al. 2017, eq. 7 (as a loss to minimise).
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    clip_pg_loss = torch.maximum(pg_loss1, pg_loss2)
    if dual_clip_c is not None:
        # Ye et al. 2020 ("Mastering complex control in MOBA games with deep
        # RL"): for A < 0 the loss is capped at -c * A.
        pg_loss3 = -advantages * dual_clip_c
        negative = advantages < 0
        pg_losses = torch.where(negative, torch.minimum(clip_pg_loss, pg_loss3), clip_pg_loss)
        dual_clipped = negative & (clip_pg_loss > pg_loss3)
    else:
        pg_losses = clip_pg_loss
        dual_clipped = torch.zeros_like(m)
    if isw is not None:
        pg_losses = isw.w * pg_losses
    loss = aggregate(where_real(pg_losses, m), m, mode=agg_mode, norm_len=norm_len)

    with torch.no_grad():
        ratio_d, log_ratio_d = ratio.detach(), log_ratio.detach()
        if isw is None:
            zero = torch.zeros_like(ratio_d)
            isw = _ISWeights(zero, zero + 1.0, zero, zero, zero)
        to_f = lambda b: b.to(ratio_d.dtype)  # noqa: E731
        stats = PolicyLossStats(
            loss=loss.detach(),
            clip_frac=masked_mean(to_f(pg_loss2 > pg_loss1), m),
            dual_clip_frac=masked_mean(to_f(dual_clipped), m),
            # KL(old || pi) with x ~ old, r = pi / old: k3 = (r - 1) - log r; over the tokens pi
            # has (a token top-k/top-p filters out under pi has log r = -inf: k3 = inf)
            approx_kl=masked_mean(ratio_d - 1.0 - log_ratio_d, m & torch.isfinite(log_ratio_d)),
            ratio_mean=masked_mean(ratio_d, m),
            ratio_max=masked_max(ratio_d, m),
            is_weight_mean=masked_mean(isw.raw_w, m),
            is_weight_max=masked_max(isw.raw_w, m),
            is_truncated_frac=masked_mean(to_f(isw.truncated), m),
            is_masked_frac=masked_mean(to_f(isw.dropped), m),
            # KL(behav || prox) with x ~ behav, r = prox / behav = w.
            behav_approx_kl=masked_mean(torch.exp(isw.log_w_tokens) - 1.0 - isw.log_w_tokens, m),
        )
    return loss, stats


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    agg_mode: AggregationMode = "token-mean",
    norm_len: int | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """PPO clipped surrogate loss (Schulman et al. 2017, eq. 7).

    ``ratio = exp(logp - old_logp)``;
    ``pg_loss1 = -A * ratio``, ``pg_loss2 = -A * clip(ratio, 1 - eps_low, 1 + eps_high)``;
    per-token loss ``max(pg_loss1, pg_loss2)``. ``clip_eps_high`` defaults to
    ``clip_eps_low``; a larger value is DAPO's "clip-higher" (Yu et al. 2025).

    With ``dual_clip_c`` (Ye et al. 2020), tokens with ``A < 0`` get
    ``min(max(pg_loss1, pg_loss2), -c * A)``: the loss of a very unlikely-
    under-old, now-likely token is capped (``c > 1``).

    Args:
        logp (torch.Tensor): ``[B, T]`` log-probs under the current policy (with grad).
        old_logp (torch.Tensor): ``[B, T]`` log-probs the advantages were computed for.
        advantages (torch.Tensor): ``[B, T]`` per-token advantages.
        mask (torch.Tensor): ``[B, T]``, non-zero = real token.
        clip_eps_low (float): lower clip range, in (0, 1).
        clip_eps_high (float | None): upper clip range, > 0 (default: ``clip_eps_low``).
        dual_clip_c (float | None): dual-clip constant ``c > 1``, or None.
        agg_mode (AggregationMode): see :func:`learner.masked.aggregate`.
        norm_len (int | None): for ``"seq-mean-token-sum-norm"``.

    Returns:
        tuple[torch.Tensor, PolicyLossStats]: scalar loss and detached stats.
    """
    high = _check_clip(clip_eps_low, clip_eps_high, dual_clip_c)
    check_choice("agg_mode", agg_mode, AggregationMode)
    check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    m = bool_mask(mask)
    return _clipped_policy_loss(
        where_real(logp, m), where_real(old_logp, m).detach(), where_real(advantages, m).detach(), m,
        clip_eps_low=clip_eps_low, clip_eps_high=high, dual_clip_c=dual_clip_c, agg_mode=agg_mode, norm_len=norm_len,
    )


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    is_config: ISConfig = ISConfig(),
    dual_clip_c: float | None = None,
    agg_mode: AggregationMode = "token-mean",
    norm_len: int | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Decoupled PPO objective for off-policy (stale) samples.

    Hilton et al. 2021, "Batch size-invariance for policy optimization";
    Fu et al. 2025, "AReaL: a large-scale asynchronous reinforcement learning
    system for language reasoning". The trust region is centred on the
    *proximal* policy ``pi_prox`` (recent learner weights) while the data were
    sampled by the *behaviour* policy ``pi_behav`` (stale worker weights):

        ratio = exp(logp - prox_logp)                       (clipped as in PPO)
        w     = exp(prox_logp - behav_logp)                 (detached IS weight)
        loss_t = w_t * max(-A_t * ratio_t, -A_t * clip(ratio_t, 1-eps_low, 1+eps_high))

    ``w`` is taken per token or per sequence and truncated or masked as ``is_config`` says
    (:class:`ISConfig`).

    With ``behav_logp == prox_logp`` (and a band/cap admitting 1) this is exactly
    :func:`ppo_clip_loss`.

    Args:
        logp (torch.Tensor): ``[B, T]`` log-probs under the current policy (with grad).
        prox_logp (torch.Tensor): ``[B, T]`` log-probs under the proximal policy.
        behav_logp (torch.Tensor): ``[B, T]`` log-probs recorded by the workers.
        advantages (torch.Tensor): ``[B, T]`` per-token advantages.
        mask (torch.Tensor): ``[B, T]``, non-zero = real token.
        clip_eps_low (float): lower clip range, in (0, 1).
        clip_eps_high (float | None): upper clip range (default: ``clip_eps_low``).
        is_config (ISConfig): importance-sampling correction, level, cap and band.
        dual_clip_c (float | None): dual-clip constant ``c > 1``, or None.
        agg_mode (AggregationMode): see :func:`learner.masked.aggregate`.
        norm_len (int | None): for ``"seq-mean-token-sum-norm"``.

    Returns:
        tuple[torch.Tensor, PolicyLossStats]: scalar loss and detached stats.
    """
    high = _check_clip(clip_eps_low, clip_eps_high, dual_clip_c)
    check_choice("agg_mode", agg_mode, AggregationMode)
    check_same_shape(
        logp=logp, prox_logp=prox_logp, behav_logp=behav_logp, advantages=advantages, mask=mask
    )
    m = bool_mask(mask)
    prox = where_real(prox_logp, m).detach()
    isw = _is_weights(prox, where_real(behav_logp, m), m, is_config)
    return _clipped_policy_loss(
        where_real(logp, m), prox, where_real(advantages, m).detach(), m,
        clip_eps_low=clip_eps_low, clip_eps_high=high, dual_clip_c=dual_clip_c, agg_mode=agg_mode, norm_len=norm_len,
        isw=isw,
    )


# ---------- Critic --------------------------------------------------------- #
class ValueLossStats(NamedTuple):
    loss: torch.Tensor  # aggregated value loss, detached
    clip_frac: torch.Tensor  # tokens where the clipped error is the larger one
    value_mean: torch.Tensor
    explained_variance: torch.Tensor  # 1 - Var[returns - values] / Var[returns]


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float | None = 0.2,
    agg_mode: AggregationMode = "token-mean",
    norm_len: int | None = None,
) -> tuple[torch.Tensor, ValueLossStats]:
    """Critic loss with PPO value clipping.

    ``vf_loss1 = (values - returns)^2``;
    ``values_clipped = old_values + clip(values - old_values, -eps, eps)``;
    ``vf_loss2 = (values_clipped - returns)^2``; per-token loss
    ``0.5 * max(vf_loss1, vf_loss2)`` (OpenAI baselines ppo2). With
    ``clip_eps=None`` it is ``0.5 * vf_loss1``.

    Args:
        values (torch.Tensor): ``[B, T]`` current value predictions (with grad).
        old_values (torch.Tensor): ``[B, T]`` value predictions at rollout time.
        returns (torch.Tensor): ``[B, T]`` value targets.
        mask (torch.Tensor): ``[B, T]``, non-zero = real token.
        clip_eps (float | None): value clip range > 0, or None to disable.
        agg_mode (AggregationMode): see :func:`learner.masked.aggregate`.
        norm_len (int | None): for ``"seq-mean-token-sum-norm"``.

    Returns:
        tuple[torch.Tensor, ValueLossStats]: scalar loss and detached stats.
    """
    check_choice("agg_mode", agg_mode, AggregationMode)
    if clip_eps is not None and not clip_eps > 0:
        raise ValueError(f"clip_eps must be > 0 (or None to disable), got {clip_eps}")
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    m = bool_mask(mask)
    values = where_real(values, m)
    old_values, returns = where_real(old_values, m).detach(), where_real(returns, m).detach()
    vf_loss1 = (values - returns) ** 2
    if clip_eps is None:
        vf_losses = vf_loss1
        clipped = torch.zeros_like(m)
    else:
        values_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
        vf_loss2 = (values_clipped - returns) ** 2
        vf_losses = torch.maximum(vf_loss1, vf_loss2)
        clipped = vf_loss2 > vf_loss1
    loss = aggregate(0.5 * vf_losses, m, mode=agg_mode, norm_len=norm_len)
    with torch.no_grad():
        v = values.detach()
        var_ret = masked_var(returns, m, unbiased=False)
        ev = 1.0 - masked_var(returns - v, m, unbiased=False) / var_ret.clamp(min=1e-8)
        stats = ValueLossStats(
            loss=loss.detach(),
            clip_frac=masked_mean(clipped.to(v.dtype), m),
            value_mean=masked_mean(v, m),
            explained_variance=ev,
        )
    return loss, stats
