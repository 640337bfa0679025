"""The pure math every algorithm shares: masked reductions and aggregation, whitening, per-token
rewards, KL estimators, the entropy bonus, importance-sampling weights and the PPO clip.

Tensors in, tensors (or a scalar loss and a ``NamedTuple`` of detached stats) out; no I/O, no
config objects, no state. Tensors are positional and every other option keyword-only, so two
neighbouring numbers cannot be swapped. Log-probabilities, never probabilities.

Conventions (every loss and estimator of the learner follows them):
    * Per-token tensors have shape ``[B, T]`` (batch, response length).
    * ``mask`` is a bool or float ``[B, T]`` tensor of response tokens (non-zero = real token).
      Masked positions never affect any result, even when they hold garbage such as ``1e9`` or
      ``NaN``: inputs are sanitised with ``torch.where`` (not multiplication, which would leak
      NaN, and not after ``exp``, which would leak NaN into the backward pass).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from rlhf_core.choices import AggMode, ISCorrection, ISLevel, KLEstimator, check_choice
from rlhf_core.config import ISConfig, check_clip, check_penalties

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # in-place sum over data-parallel ranks; identity when alone
TOKEN_MEAN = AggMode["token-mean"]


# ---------- Argument checks ----------------------------------------------- #
def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` naming every shape unless all ``tensors`` have the same one."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        desc = ", ".join(f"{n}={s}" for n, s in shapes.items())
        raise ValueError(f"shape mismatch: {desc}")


def check_groups(rewards: torch.Tensor, group_size: int, min_size: int) -> None:
    """``[N]`` rewards that form groups of ``group_size`` (at least ``min_size``)."""
    if group_size < min_size:
        raise ValueError(f"group_size must be >= {min_size}, got {group_size}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"number of rewards N={rewards.numel()} is not divisible by group_size={group_size}")


# ---------- Masked reductions --------------------------------------------- #
def bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` as a bool tensor (non-zero = real token)."""
    return mask if mask.dtype == torch.bool else mask != 0


def where_real(x: torch.Tensor, m: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``x`` at real tokens of the bool mask ``m``, ``fill`` elsewhere (NaN-safe, gradient-safe)."""
    return torch.where(m, x, torch.full((), fill, dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, *, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` (any shape, e.g. ``[B, T]``) over real tokens of ``mask`` (same shape).
    ``dim=None`` reduces everything to a scalar; otherwise only ``dim`` is reduced."""
    check_same_shape(x=x, mask=mask)
    xs = where_real(x, bool_mask(mask))
    return xs.sum() if dim is None else xs.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, *, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over real tokens of ``mask``; 0 where there is no real token."""
    m = bool_mask(mask)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim=dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True, dim: int | None = None) -> torch.Tensor:
    """Variance of ``x`` over real tokens of ``mask``. ``unbiased=True`` applies Bessel's
    correction ``n / (n - 1)``; with a single real token the variance is 0 (not NaN)."""
    m = bool_mask(mask)
    mean = masked_mean(x, m, dim=dim)
    if dim is not None:
        mean = mean.unsqueeze(dim)
    var = masked_mean((where_real(x, m) - mean) ** 2, m, dim=dim)
    if unbiased:
        n = m.sum() if dim is None else m.sum(dim)
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of ``x`` over real tokens (scalar); 0 when there are none."""
    m = bool_mask(mask)
    check_same_shape(x=x, mask=m)
    out = where_real(x, m, float("-inf")).max()
    return torch.where(m.any(), out, torch.zeros_like(out))


def aggregate(
    loss_tokens: torch.Tensor, mask: torch.Tensor, *, mode: AggMode = TOKEN_MEAN, norm_len: int | None = None
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    Modes:
        * ``"token-mean"``: sum over all real tokens / total number of real tokens (every
          token weighs the same; long sequences weigh more).
        * ``"seq-mean-token-mean"``: mean over each sequence's real tokens, then mean over
          sequences (every sequence weighs the same; the original GRPO formulation).
        * ``"seq-mean-token-sum"``: sum over each sequence's real tokens, then mean over sequences.
        * ``"seq-mean-token-sum-norm"``: Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-like
          training"): sum over each sequence's real tokens divided by the constant ``norm_len``
          (e.g. the max generation length), then mean over sequences; removes the length bias.

    In the ``seq-*`` modes, sequences without any real token are excluded from the mean over
    sequences. An all-masked batch gives 0.
    """
    check_choice("agg_mode", mode, AggMode)
    if mode == "seq-mean-token-sum-norm" and (norm_len is None or not norm_len > 0):
        raise ValueError(f"agg_mode 'seq-mean-token-sum-norm' needs norm_len > 0, got {norm_len}")
    m = bool_mask(mask)
    if mode == "token-mean":
        return masked_mean(loss_tokens, m)
    seq_sum = masked_sum(loss_tokens, m, dim=-1)
    seq_len = m.sum(-1)
    if mode == "seq-mean-token-mean":
        seq_loss = seq_sum / seq_len.clamp(min=1)
    elif mode == "seq-mean-token-sum":
        seq_loss = seq_sum
    else:
        assert norm_len is not None  # checked above
        seq_loss = seq_sum / norm_len
    return masked_mean(seq_loss, seq_len > 0)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@torch.no_grad()
def global_whiten(x: torch.Tensor, mask: torch.Tensor, all_reduce: AllReduce = _identity, eps: float = 1e-8) -> torch.Tensor:
    """``[B, T]`` ``(x - mean) * rsqrt(var + eps)`` with mean and (biased) variance over the real
    tokens of every data-parallel rank (``all_reduce`` sums over them; alone: the identity).
    Masked positions are 0."""
    m = bool_mask(mask)
    sums = torch.stack([masked_sum(x, m), m.sum().to(x.dtype)])
    all_reduce(sums)
    mean = sums[0] / sums[1].clamp(min=1)
    sq = masked_sum((where_real(x, m) - mean) ** 2, m).reshape(1)
    all_reduce(sq)
    var = sq[0] / sums[1].clamp(min=1)
    return where_real((where_real(x, m) - mean) * torch.rsqrt(var + eps), m)


def rows_by_size(group_sizes: torch.Tensor) -> dict[int, torch.Tensor]:
    """{size: row indices of every group of that size, group after group} of a batch whose groups
    are contiguous: an estimator over equal-sized groups runs once per size, not once per group."""
    out: dict[int, list[int]] = {}
    start = 0
    for n in group_sizes.tolist():
        out.setdefault(n, []).extend(range(start, start + n))
        start += n
    return {n: torch.tensor(rows, dtype=torch.long, device=group_sizes.device) for n, rows in out.items()}


@torch.no_grad()
def token_rewards(
    seq_rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """``[B, T]`` per-token rewards: the ``[B]`` sequence reward on the last real token, minus a KL
    penalty, ``r_t = -kl_coef * kl_t + [t == last real token] * seq_reward`` (KL as a reward
    penalty, as in Ziegler et al. 2019 / OpenRLHF; 0 at masked positions). A sequence without
    real tokens gets no reward. ``kl``: ``[B, T]`` per-token KL estimate (:func:`kl_estimate`)."""
    check_penalties(kl_coef=kl_coef)
    m = bool_mask(mask)
    if seq_rewards.shape != m.shape[:1]:
        raise ValueError(f"seq_rewards must have shape [B]={tuple(m.shape[:1])}, got {tuple(seq_rewards.shape)}")
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)
    last = torch.where(m, positions, torch.full_like(positions, -1)).max(dim=-1, keepdim=True).values
    is_last = m & (positions == last)
    out = torch.where(is_last, seq_rewards.unsqueeze(-1), torch.zeros((), dtype=seq_rewards.dtype, device=seq_rewards.device))
    if kl is not None:
        check_same_shape(kl=kl, mask=m)
        out = out - kl_coef * where_real(kl, m)
    return where_real(out, m)


# ---------- KL, entropy --------------------------------------------------- #
def kl_estimate(
    logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor | None = None, *, kind: KLEstimator = KLEstimator.k3
) -> torch.Tensor:
    """``[B, T]`` per-token Monte-Carlo estimate of ``KL(pi || ref)`` for ``x ~ pi``.

    From J. Schulman, "Approximating KL Divergence" (2020),
    http://joschu.net/blog/kl-approx.html, with ``log r = ref_logp - logp``:

        * ``k1 = -log r = logp - ref_logp``              (unbiased, high variance)
        * ``k2 = 0.5 * (log r)^2``                       (biased, low variance)
        * ``k3 = (r - 1) - log r``                       (unbiased, low variance, >= 0)

    The estimators are unbiased only if the tokens were sampled from ``pi``; in an off-policy
    setting they were sampled from the behaviour policy. Masked positions give 0.
    """
    check_choice("kl kind", kind, KLEstimator)
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


class EntropyStats(NamedTuple):
    entropy: torch.Tensor  # aggregated entropy (nats), detached


def entropy_bonus(
    entropy: torch.Tensor, mask: torch.Tensor, *, coef: float, agg_mode: AggMode = TOKEN_MEAN,
    norm_len: int | None = None,
) -> tuple[torch.Tensor, EntropyStats]:
    """Entropy bonus as a loss term to *add* to the total loss: ``-coef * H``, with ``H`` the
    ``[B, T]`` per-token ``entropy`` over the real tokens of ``mask`` aggregated per ``agg_mode``
    (:func:`aggregate`). ``coef > 0`` encourages exploration."""
    h = aggregate(entropy, mask, mode=agg_mode, norm_len=norm_len)
    return -coef * h, EntropyStats(entropy=h.detach())


# ---------- Importance sampling and the PPO clip ------------------------- #
class ISWeights(NamedTuple):
    w: torch.Tensor  # corrected weight multiplying the token loss
    raw_w: torch.Tensor  # before truncation / masking
    log_w_tokens: torch.Tensor  # per-token prox_logp - behav_logp
    truncated: torch.Tensor  # bool
    dropped: torch.Tensor  # bool


@torch.no_grad()
def is_weights(prox: torch.Tensor, behav: torch.Tensor, m: torch.Tensor, cfg: ISConfig) -> ISWeights:
    """IS weights ``pi_prox / pi_behav`` of sanitised ``[B, T]`` log-probs under the bool mask ``m``,
    at ``cfg.level`` and corrected as ``cfg.correction`` says (:class:`ISConfig`). ``mis`` and
    ``icepop`` are the same mask, ``M(w) = w`` inside the band and 0 outside (IcePop, Ling Team
    2025, eq. of ``M(k)``), each with its own band; dropped tokens keep their place in every
    denominator."""
    log_w_tokens = prox - behav
    if cfg.level == ISLevel.sequence:
        log_w = masked_mean(log_w_tokens, m, dim=-1).unsqueeze(-1).expand_as(log_w_tokens)
    else:
        log_w = log_w_tokens
    raw_w = torch.exp(log_w)
    truncated = dropped = torch.zeros_like(m)
    if cfg.correction == ISCorrection.tis:
        truncated = raw_w > cfg.tis_cap
        w = torch.clamp(raw_w, max=cfg.tis_cap)
    elif cfg.correction in (ISCorrection.mis, ISCorrection.icepop):
        low, high = (cfg.mis_low, cfg.mis_high) if cfg.correction == ISCorrection.mis else (cfg.icepop_low, cfg.icepop_high)
        dropped = (raw_w < low) | (raw_w > high)
        w = torch.where(dropped, torch.zeros_like(raw_w), raw_w)
    else:
        w = raw_w
    return ISWeights(w, raw_w, log_w_tokens, truncated, dropped)


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


def clip_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
    clip_eps_low: float = 0.2, clip_eps_high: float | None = None, dual_clip_c: float | None = None,
    agg_mode: AggMode = TOKEN_MEAN, norm_len: int | None = None,
    importance: ISWeights | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """The PPO clipped surrogate (Schulman et al. 2017, eq. 7) every policy loss is built on; a
    scalar loss and detached stats.

    ``ratio = exp(logp - old_logp)``, ``pg_loss1 = -A * ratio``,
    ``pg_loss2 = -A * clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high)``, per-token loss
    ``max(pg_loss1, pg_loss2)``, aggregated over the real tokens of ``mask`` per ``agg_mode``
    (:func:`aggregate`; ``norm_len`` for ``"seq-mean-token-sum-norm"``). ``clip_eps_high``
    defaults to ``clip_eps_low``; a larger value is DAPO's "clip-higher" (Yu et al. 2025). With
    ``dual_clip_c`` (``c > 1``, Ye et al. 2020) a token with ``A < 0`` gets
    ``min(max(pg_loss1, pg_loss2), -c * A)``: the loss of a very unlikely-under-old, now-likely
    token is capped. ``importance``: IS weights that multiply the token losses (:func:`is_weights`
    of the sanitised ``old_logp``).

    ``logp`` ``[B, T]`` carries the gradient; ``old_logp`` and ``advantages`` ``[B, T]`` are constants.
    """
    high = check_clip(clip_eps_low, clip_eps_high, dual_clip_c)
    check_choice("agg_mode", agg_mode, AggMode)
    check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    m = bool_mask(mask)
    old = where_real(old_logp, m).detach()
    isw = importance
    logp, advantages = where_real(logp, m), where_real(advantages, m).detach()
    log_ratio = logp - old
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + high)
    clip_pg_loss = torch.maximum(pg_loss1, pg_loss2)
    if dual_clip_c is not None:
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
    return loss, policy_loss_stats(loss, log_ratio, m, clipped=pg_loss2 > pg_loss1, dual_clipped=dual_clipped, importance=isw)


@torch.no_grad()
def policy_loss_stats(
    loss: torch.Tensor, log_ratio: torch.Tensor, m: torch.Tensor, *, clipped: torch.Tensor,
    dual_clipped: torch.Tensor | None = None, importance: ISWeights | None = None,
) -> PolicyLossStats:
    """A policy loss's detached statistics over the real tokens of the bool mask ``m``: ``[B, T]``
    ``log_ratio`` (log pi - log old), the bool tokens its clip acts on (``clipped``) and the dual
    clip caps, and its IS weights (None: on-policy, weight 1)."""
    log_ratio_d = log_ratio.detach()
    ratio_d = torch.exp(log_ratio_d)
    isw = importance
    if isw is None:
        zero = torch.zeros_like(ratio_d)
        isw = ISWeights(zero, zero + 1.0, zero, zero, zero)
    to_f = lambda b: b.to(ratio_d.dtype)  # noqa: E731
    return PolicyLossStats(
        loss=loss.detach(),
        clip_frac=masked_mean(to_f(clipped), m),
        dual_clip_frac=masked_mean(to_f(torch.zeros_like(m) if dual_clipped is None else dual_clipped), m),
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
