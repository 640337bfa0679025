"""Pure loss math for the learner: masked reductions, KL estimators and losses.

Every function here is a pure function: tensors in, tensors (and a small
``NamedTuple`` of detached stats) out. No I/O, no config objects, no state.

Conventions:
    * Per-token tensors have shape ``[B, T]`` (batch, response length).
    * ``mask`` is a bool or float ``[B, T]`` tensor of response tokens
      (non-zero = real token). Masked positions never affect any result, even
      when they hold garbage such as ``1e9`` or ``NaN``: inputs are sanitised
      with ``torch.where`` (not multiplication, which would leak NaN, and not
      after ``exp``, which would leak NaN into the backward pass).
    * Log-probabilities, never probabilities.

Advantage estimators (GAE, GRPO, RLOO, REINFORCE++, V-trace) and online-DPO
pair selection live in ``learner/advantages.py``.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F

AggregationMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
KLKind = Literal["k1", "k2", "k3"]
ISCorrection = Literal["none", "tis", "mis"]
ISLevel = Literal["token", "sequence"]


# ---------- Validation helpers -------------------------------------------- #
def _check_choice(name: str, value: object, literal: object) -> None:
    allowed = get_args(literal)
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(map(repr, allowed))}")


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        desc = ", ".join(f"{n}={s}" for n, s in shapes.items())
        raise ValueError(f"shape mismatch: {desc}")


def _check_clip(clip_eps_low: float, clip_eps_high: float | None, dual_clip_c: float | None) -> float:
    if not 0.0 < clip_eps_low < 1.0:
        raise ValueError(f"clip_eps_low must be in (0, 1), got {clip_eps_low}")
    high = clip_eps_low if clip_eps_high is None else clip_eps_high
    if not high > 0.0:
        raise ValueError(f"clip_eps_high must be > 0, got {clip_eps_high}")
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (or None to disable), got {dual_clip_c}")
    return high


def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _fill(x: torch.Tensor, m: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    """``x`` at real tokens, ``value`` elsewhere (NaN-safe, gradient-safe)."""
    return torch.where(m, x, torch.full((), value, dtype=x.dtype, device=x.device))


# ---------- Masked reductions --------------------------------------------- #
def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` (any shape, e.g. ``[B, T]``) over real tokens of ``mask`` (same shape).

    ``dim=None`` reduces everything to a scalar; otherwise only ``dim`` is reduced.
    """
    _check_same_shape(x=x, mask=mask)
    m = _as_bool(mask)
    xs = _fill(x, m)
    return xs.sum() if dim is None else xs.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over real tokens of ``mask``; 0 where there is no real token.

    Shapes and ``dim`` as in :func:`masked_sum`.
    """
    m = _as_bool(mask)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim) / count.clamp(min=1)


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, dim: int | None = None
) -> torch.Tensor:
    """Variance of ``x`` over real tokens of ``mask``.

    ``unbiased=True`` applies Bessel's correction ``n / (n - 1)``; with a
    single real token the variance is 0 (not NaN). Shapes and ``dim`` as in
    :func:`masked_sum`.
    """
    m = _as_bool(mask)
    mean = masked_mean(x, m, dim)
    if dim is not None:
        mean = mean.unsqueeze(dim)
    var = masked_mean((_fill(x, m) - mean) ** 2, m, dim)
    if unbiased:
        n = m.sum() if dim is None else m.sum(dim)
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, unbiased: bool = False, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise ``x`` to zero mean / unit variance over all real tokens.

    ``(x - mean) * rsqrt(var + eps)``; with ``shift_mean=False`` the mean is
    added back (scale only). Masked positions are 0.

    Args:
        x (torch.Tensor): values ``[B, T]``.
        mask (torch.Tensor): ``[B, T]``, non-zero = real token.
        shift_mean (bool): subtract the mean.
        unbiased (bool): Bessel-corrected variance.
        eps (float): added to the variance.

    Returns:
        torch.Tensor: ``[B, T]`` whitened values.
    """
    m = _as_bool(mask)
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=unbiased)
    whitened = (_fill(x, m) - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _fill(whitened, m)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of ``x`` over real tokens (scalar); 0 when there are none."""
    m = _as_bool(mask)
    _check_same_shape(x=x, mask=m)
    out = _fill(x, m, float("-inf")).max()
    return torch.where(m.any(), out, torch.zeros_like(out))


# ---------- Aggregation --------------------------------------------------- #
def aggregate(
    loss_tokens: torch.Tensor,
    mask: torch.Tensor,
    mode: AggregationMode = "token-mean",
    norm_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    Modes:
        * ``"token-mean"``: sum over all real tokens / total number of real
          tokens (every token weighs the same; long sequences weigh more).
        * ``"seq-mean-token-mean"``: mean over each sequence's real tokens,
          then mean over sequences (every sequence weighs the same; the
          original GRPO formulation).
        * ``"seq-mean-token-sum"``: sum over each sequence's real tokens, then
          mean over sequences.
        * ``"seq-mean-token-sum-norm"``: Dr.GRPO (Liu et al. 2025,
          "Understanding R1-Zero-like training"): sum over each sequence's real
          tokens divided by the constant ``norm_len`` (e.g. the max generation
          length), then mean over sequences; removes the length bias.

    In the ``seq-*`` modes, sequences without any real token are excluded
    from the mean over sequences. An all-masked batch gives 0.

    Args:
        loss_tokens (torch.Tensor): per-token loss ``[B, T]``.
        mask (torch.Tensor): ``[B, T]``, non-zero = real token.
        mode (AggregationMode): see above.
        norm_len (int | None): constant length, required for
            ``"seq-mean-token-sum-norm"``.

    Returns:
        torch.Tensor: scalar loss.
    """
    _check_choice("agg_mode", mode, AggregationMode)
    if mode == "seq-mean-token-sum-norm" and (norm_len is None or not norm_len > 0):
        raise ValueError(f"agg_mode 'seq-mean-token-sum-norm' needs norm_len > 0, got {norm_len}")
    m = _as_bool(mask)
    if mode == "token-mean":
        return masked_mean(loss_tokens, m)
    seq_sum = masked_sum(loss_tokens, m, dim=-1)
    seq_len = m.sum(-1)
    if mode == "seq-mean-token-mean":
        seq_loss = seq_sum / seq_len.clamp(min=1)
    elif mode == "seq-mean-token-sum":
        seq_loss = seq_sum
    else:
        seq_loss = seq_sum / norm_len
    return masked_mean(seq_loss, seq_len > 0)


# ---------- Log-probs, KL, entropy ---------------------------------------- #
def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-prob of each target token: ``log_softmax(logits / temperature).gather``.

    This is how the learner recomputes log-probs; the workers record the
    behaviour log-probs from their exact sampling distribution, so the same
    ``temperature`` must be used here. bf16/fp16 logits are upcast to fp32.

    Args:
        logits (torch.Tensor): ``[B, T, V]``, logits predicting ``targets``.
        targets (torch.Tensor): ``[B, T]`` token ids.
        temperature (float): sampling temperature, > 0.
        mask (torch.Tensor | None): ``[B, T]``; if given, masked targets may
            hold any id (e.g. -100) and their log-prob is 0.

    Returns:
        torch.Tensor: ``[B, T]`` log-probs.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if mask is not None:
        m = _as_bool(mask)
        targets = torch.where(m, targets, torch.zeros_like(targets))
    logp = F.log_softmax(logits / temperature, dim=-1)
    out = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return out if mask is None else _fill(out, m)


def kl_estimate(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kind: KLKind = "k3",
    mask: torch.Tensor | None = None,
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
        kind (KLKind): ``"k1"``, ``"k2"`` or ``"k3"``.
        mask (torch.Tensor | None): ``[B, T]``; masked positions give 0.

    Returns:
        torch.Tensor: ``[B, T]`` per-token KL estimate.
    """
    _check_choice("kl kind", kind, KLKind)
    _check_same_shape(logp=logp, ref_logp=ref_logp)
    if mask is not None:
        m = _as_bool(mask)
        logp, ref_logp = _fill(logp, m), _fill(ref_logp, m)
    log_r = ref_logp - logp
    if kind == "k1":
        kl = -log_r
    elif kind == "k2":
        kl = 0.5 * log_r**2
    else:
        kl = torch.exp(log_r) - log_r - 1.0
    return kl if mask is None else _fill(kl, m)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy ``H = -sum_v p_v log p_v`` of ``softmax(logits)``.

    Uses ``log_softmax`` (logsumexp-stable); vocabulary entries with logit
    ``-inf`` contribute 0 (and no NaN gradient).

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
    coef: float,
    agg_mode: AggregationMode = "token-mean",
    norm_len: int | None = None,
) -> tuple[torch.Tensor, EntropyStats]:
    """Entropy bonus as a loss term to *add* to the total loss: ``-coef * H``.

    Args:
        entropy (torch.Tensor): ``[B, T]`` per-token entropy.
        mask (torch.Tensor): ``[B, T]``, non-zero = real token.
        coef (float): bonus coefficient (>= 0 encourages exploration).
        agg_mode (AggregationMode): how to reduce over tokens.
        norm_len (int | None): for ``"seq-mean-token-sum-norm"``.

    Returns:
        tuple[torch.Tensor, EntropyStats]: scalar loss and stats.
    """
    h = aggregate(entropy, mask, agg_mode, norm_len)
    return -coef * h, EntropyStats(entropy=h.detach())


# ---------- Policy losses ------------------------------------------------- #
class PolicyLossStats(NamedTuple):
    """Detached scalars; fractions/means are over real tokens."""

    loss: torch.Tensor  # aggregated loss
    clip_frac: torch.Tensor  # tokens where the clipped PPO branch is active
    dual_clip_frac: torch.Tensor  # tokens capped by the dual clip (A < 0)
    approx_kl: torch.Tensor  # k3 estimate of KL(old/prox || pi), Schulman 2020
    ratio_mean: torch.Tensor  # pi / pi_old (or pi / pi_prox)
    ratio_max: torch.Tensor
    is_weight_mean: torch.Tensor  # raw pi_prox / pi_behav before correction (1 on-policy)
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


def _clipped_policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, m: torch.Tensor,
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
    loss = aggregate(_fill(pg_losses, m), m, agg_mode, norm_len)

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
            # KL(old || pi) with x ~ old, r = pi / old: k3 = (r - 1) - log r.
            approx_kl=masked_mean(ratio_d - 1.0 - log_ratio_d, m),
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
        agg_mode (AggregationMode): see :func:`aggregate`.
        norm_len (int | None): for ``"seq-mean-token-sum-norm"``.

    Returns:
        tuple[torch.Tensor, PolicyLossStats]: scalar loss and detached stats.
    """
    high = _check_clip(clip_eps_low, clip_eps_high, dual_clip_c)
    _check_choice("agg_mode", agg_mode, AggregationMode)
    _check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    m = _as_bool(mask)
    return _clipped_policy_loss(
        _fill(logp, m), _fill(old_logp, m).detach(), _fill(advantages, m).detach(), m,
        clip_eps_low, high, dual_clip_c, agg_mode, norm_len,
    )


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    is_correction: ISCorrection = "none",
    is_level: ISLevel = "token",
    tis_cap: float = 2.0,
    mis_low: float = 0.5,
    mis_high: float = 2.0,
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

    ``is_level``:
        * ``"token"``: per-token ``w_t``.
        * ``"sequence"``: the geometric mean of the sequence's per-token
          weights, ``exp(masked_mean_t(log w_t))``, broadcast to its tokens.

    ``is_correction`` (applied to the token- or sequence-level ``w``):
        * ``"none"``: ``w`` as is (full importance sampling).
        * ``"tis"``: truncated IS, ``min(w, tis_cap)``.
        * ``"mis"``: masked IS, ``w`` if ``mis_low <= w <= mis_high`` else 0;
          dropped tokens still count in the aggregation denominator.

    With ``behav_logp == prox_logp`` (and a band/cap admitting 1) this is
    exactly :func:`ppo_clip_loss`.

    Args:
        logp (torch.Tensor): ``[B, T]`` log-probs under the current policy (with grad).
        prox_logp (torch.Tensor): ``[B, T]`` log-probs under the proximal policy.
        behav_logp (torch.Tensor): ``[B, T]`` log-probs recorded by the workers.
        advantages (torch.Tensor): ``[B, T]`` per-token advantages.
        mask (torch.Tensor): ``[B, T]``, non-zero = real token.
        clip_eps_low (float): lower clip range, in (0, 1).
        clip_eps_high (float | None): upper clip range (default: ``clip_eps_low``).
        is_correction (ISCorrection): ``"none"``, ``"tis"`` or ``"mis"``.
        is_level (ISLevel): ``"token"`` or ``"sequence"``.
        tis_cap (float): truncation cap ``C > 0`` (``inf`` allowed).
        mis_low (float): lower edge of the kept band, >= 0.
        mis_high (float): upper edge of the kept band, > ``mis_low``.
        dual_clip_c (float | None): dual-clip constant ``c > 1``, or None.
        agg_mode (AggregationMode): see :func:`aggregate`.
        norm_len (int | None): for ``"seq-mean-token-sum-norm"``.

    Returns:
        tuple[torch.Tensor, PolicyLossStats]: scalar loss and detached stats.
    """
    high = _check_clip(clip_eps_low, clip_eps_high, dual_clip_c)
    _check_choice("agg_mode", agg_mode, AggregationMode)
    _check_choice("is_correction", is_correction, ISCorrection)
    _check_choice("is_level", is_level, ISLevel)
    if not tis_cap > 0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    if not (0.0 <= mis_low < mis_high):
        raise ValueError(f"need 0 <= mis_low < mis_high, got mis_low={mis_low}, mis_high={mis_high}")
    _check_same_shape(
        logp=logp, prox_logp=prox_logp, behav_logp=behav_logp, advantages=advantages, mask=mask
    )
    m = _as_bool(mask)
    prox = _fill(prox_logp, m).detach()
    with torch.no_grad():
        log_w_tokens = prox - _fill(behav_logp, m)
        if is_level == "sequence":
            log_w = masked_mean(log_w_tokens, m, dim=-1).unsqueeze(-1).expand_as(log_w_tokens)
        else:
            log_w = log_w_tokens
        raw_w = torch.exp(log_w)
        truncated = dropped = torch.zeros_like(m)
        if is_correction == "tis":
            truncated = raw_w > tis_cap
            w = torch.clamp(raw_w, max=tis_cap)
        elif is_correction == "mis":
            dropped = (raw_w < mis_low) | (raw_w > mis_high)
            w = torch.where(dropped, torch.zeros_like(raw_w), raw_w)
        else:
            w = raw_w
    return _clipped_policy_loss(
        _fill(logp, m), prox, _fill(advantages, m).detach(), m,
        clip_eps_low, high, dual_clip_c, agg_mode, norm_len,
        _ISWeights(w, raw_w, log_w_tokens, truncated, dropped),
    )


# ---------- Critic, SFT --------------------------------------------------- #
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
        agg_mode (AggregationMode): see :func:`aggregate`.
        norm_len (int | None): for ``"seq-mean-token-sum-norm"``.

    Returns:
        tuple[torch.Tensor, ValueLossStats]: scalar loss and detached stats.
    """
    _check_choice("agg_mode", agg_mode, AggregationMode)
    if clip_eps is not None and not clip_eps > 0:
        raise ValueError(f"clip_eps must be > 0 (or None to disable), got {clip_eps}")
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    m = _as_bool(mask)
    values = _fill(values, m)
    old_values, returns = _fill(old_values, m).detach(), _fill(returns, m).detach()
    vf_loss1 = (values - returns) ** 2
    if clip_eps is None:
        vf_losses = vf_loss1
        clipped = torch.zeros_like(m)
    else:
        values_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
        vf_loss2 = (values_clipped - returns) ** 2
        vf_losses = torch.maximum(vf_loss1, vf_loss2)
        clipped = vf_loss2 > vf_loss1
    loss = aggregate(0.5 * vf_losses, m, agg_mode, norm_len)
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


class SFTStats(NamedTuple):
    nll: torch.Tensor  # token-mean negative log-likelihood, detached
    num_tokens: torch.Tensor


def sft_loss(
    logp_of_targets: torch.Tensor,
    mask: torch.Tensor,
    agg_mode: AggregationMode = "token-mean",
    norm_len: int | None = None,
) -> tuple[torch.Tensor, SFTStats]:
    """Negative log-likelihood of the target tokens, aggregated per ``agg_mode``.

    Args:
        logp_of_targets (torch.Tensor): ``[B, T]`` log-probs of the targets
            (see :func:`token_logprobs`).
        mask (torch.Tensor): ``[B, T]``, non-zero = real (trained) token.
        agg_mode (AggregationMode): see :func:`aggregate`.
        norm_len (int | None): for ``"seq-mean-token-sum-norm"``.

    Returns:
        tuple[torch.Tensor, SFTStats]: scalar loss and detached stats.
    """
    m = _as_bool(mask)
    nll_tokens = -_fill(logp_of_targets, m)
    loss = aggregate(nll_tokens, m, agg_mode, norm_len)
    with torch.no_grad():
        stats = SFTStats(nll=masked_mean(nll_tokens.detach(), m), num_tokens=m.sum())
    return loss, stats


# ---------- Online DPO ---------------------------------------------------- #
class DPOStats(NamedTuple):
    """Detached scalars over valid pairs."""

    loss: torch.Tensor
    reward_accuracy: torch.Tensor  # fraction with chosen_reward > rejected_reward
    reward_margin: torch.Tensor  # mean(chosen_reward - rejected_reward)
    chosen_reward: torch.Tensor  # mean beta * (pi_c - ref_c)
    rejected_reward: torch.Tensor  # mean beta * (pi_r - ref_r)
    valid_frac: torch.Tensor


def dpo_loss(
    policy_chosen_logp_sum: torch.Tensor,
    policy_rejected_logp_sum: torch.Tensor,
    ref_chosen_logp_sum: torch.Tensor,
    ref_rejected_logp_sum: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, DPOStats]:
    """DPO loss (Rafailov et al. 2023), conservative variant with label smoothing.

    Pairs come from :func:`learner.advantages.select_dpo_pairs`.

    ``h = (pi_c - pi_r) - (ref_c - ref_r)`` (sequence log-prob sums);
    ``loss = -(1 - eps) * logsigmoid(beta * h) - eps * logsigmoid(-beta * h)``
    (cDPO, Mitchell 2023, "A note on DPO with noisy preferences"), averaged
    over valid pairs (0 if none). Implicit rewards ``beta * (pi - ref)``.

    Args:
        policy_chosen_logp_sum (torch.Tensor): ``[G]`` policy log-prob sums (with grad).
        policy_rejected_logp_sum (torch.Tensor): ``[G]``.
        ref_chosen_logp_sum (torch.Tensor): ``[G]`` reference log-prob sums.
        ref_rejected_logp_sum (torch.Tensor): ``[G]``.
        beta (float): inverse temperature, > 0.
        label_smoothing (float): assumed label-flip probability, in [0, 0.5).
        valid (torch.Tensor | None): ``[G]`` bool; invalid pairs are ignored.

    Returns:
        tuple[torch.Tensor, DPOStats]: scalar loss and detached stats.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    pc, pr = policy_chosen_logp_sum, policy_rejected_logp_sum
    rc, rr = ref_chosen_logp_sum, ref_rejected_logp_sum
    v = torch.ones_like(pc, dtype=torch.bool) if valid is None else _as_bool(valid)
    _check_same_shape(pc=pc, pr=pr, rc=rc, rr=rr, valid=v)
    pc, pr = _fill(pc, v), _fill(pr, v)
    rc, rr = _fill(rc, v).detach(), _fill(rr, v).detach()
    logits = (pc - pr) - (rc - rr)
    losses = (
        -(1.0 - label_smoothing) * F.logsigmoid(beta * logits)
        - label_smoothing * F.logsigmoid(-beta * logits)
    )
    loss = masked_mean(losses, v)
    with torch.no_grad():
        chosen_rewards = beta * (pc - rc).detach()
        rejected_rewards = beta * (pr - rr).detach()
        stats = DPOStats(
            loss=loss.detach(),
            reward_accuracy=masked_mean((chosen_rewards > rejected_rewards).to(pc.dtype), v),
            reward_margin=masked_mean(chosen_rewards - rejected_rewards, v),
            chosen_reward=masked_mean(chosen_rewards, v),
            rejected_reward=masked_mean(rejected_rewards, v),
            valid_frac=v.to(pc.dtype).mean(),
        )
    return loss, stats
