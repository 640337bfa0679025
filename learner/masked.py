"""Masked reductions over response tokens, shared by the losses and the advantage estimators.

Conventions (every loss and estimator of the learner follows them):
    * Per-token tensors have shape ``[B, T]`` (batch, response length).
    * ``mask`` is a bool or float ``[B, T]`` tensor of response tokens (non-zero = real token).
      Masked positions never affect any result, even when they hold garbage such as ``1e9`` or
      ``NaN``: inputs are sanitised with ``torch.where`` (not multiplication, which would leak
      NaN, and not after ``exp``, which would leak NaN into the backward pass).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

AggregationMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]


# ---------- Argument checks ----------------------------------------------- #
def check_choice(name: str, value: object, literal: object) -> None:
    """Raise ``ValueError`` unless ``value`` is one of the ``Literal`` type's values."""
    allowed = get_args(literal)
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(map(repr, allowed))}")


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` naming every shape unless all ``tensors`` have the same one."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        desc = ", ".join(f"{n}={s}" for n, s in shapes.items())
        raise ValueError(f"shape mismatch: {desc}")


# ---------- Mask utilities ------------------------------------------------ #
def bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` as a bool tensor (non-zero = real token)."""
    return mask if mask.dtype == torch.bool else mask != 0


def where_real(x: torch.Tensor, m: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``x`` at real tokens of the bool mask ``m``, ``fill`` elsewhere (NaN-safe, gradient-safe)."""
    return torch.where(m, x, torch.full((), fill, dtype=x.dtype, device=x.device))


# ---------- Masked reductions --------------------------------------------- #
def masked_sum(x: torch.Tensor, mask: torch.Tensor, *, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` (any shape, e.g. ``[B, T]``) over real tokens of ``mask`` (same shape).

    ``dim=None`` reduces everything to a scalar; otherwise only ``dim`` is reduced.
    """
    check_same_shape(x=x, mask=mask)
    xs = where_real(x, bool_mask(mask))
    return xs.sum() if dim is None else xs.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, *, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over real tokens of ``mask``; 0 where there is no real token.

    Shapes and ``dim`` as in :func:`masked_sum`.
    """
    m = bool_mask(mask)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim=dim) / count.clamp(min=1)


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True, dim: int | None = None
) -> torch.Tensor:
    """Variance of ``x`` over real tokens of ``mask``.

    ``unbiased=True`` applies Bessel's correction ``n / (n - 1)``; with a single real token
    the variance is 0 (not NaN). Shapes and ``dim`` as in :func:`masked_sum`.
    """
    m = bool_mask(mask)
    mean = masked_mean(x, m, dim=dim)
    if dim is not None:
        mean = mean.unsqueeze(dim)
    var = masked_mean((where_real(x, m) - mean) ** 2, m, dim=dim)
    if unbiased:
        n = m.sum() if dim is None else m.sum(dim)
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, unbiased: bool = False, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise ``x`` to zero mean / unit variance over all real tokens.

    ``(x - mean) * rsqrt(var + eps)``; with ``shift_mean=False`` the mean is added back
    (scale only). Masked positions are 0.

    Args:
        x (torch.Tensor): values ``[B, T]``.
        mask (torch.Tensor): ``[B, T]``, non-zero = real token.
        shift_mean (bool): subtract the mean.
        unbiased (bool): Bessel-corrected variance.
        eps (float): added to the variance.

    Returns:
        torch.Tensor: ``[B, T]`` whitened values.
    """
    m = bool_mask(mask)
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=unbiased)
    whitened = (where_real(x, m) - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return where_real(whitened, m)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of ``x`` over real tokens (scalar); 0 when there are none."""
    m = bool_mask(mask)
    check_same_shape(x=x, mask=m)
    out = where_real(x, m, float("-inf")).max()
    return torch.where(m.any(), out, torch.zeros_like(out))


# ---------- Aggregation --------------------------------------------------- #
def aggregate(
    loss_tokens: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: AggregationMode = "token-mean",
    norm_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    Modes:
        * ``"token-mean"``: sum over all real tokens / total number of real tokens (every
          token weighs the same; long sequences weigh more).
        * ``"seq-mean-token-mean"``: mean over each sequence's real tokens, then mean over
          sequences (every sequence weighs the same; the original GRPO formulation).
        * ``"seq-mean-token-sum"``: sum over each sequence's real tokens, then mean over
          sequences.
        * ``"seq-mean-token-sum-norm"``: Dr.GRPO (Liu et al. 2025, "Understanding
          R1-Zero-like training"): sum over each sequence's real tokens divided by the
          constant ``norm_len`` (e.g. the max generation length), then mean over sequences;
          removes the length bias.

    In the ``seq-*`` modes, sequences without any real token are excluded from the mean over
    sequences. An all-masked batch gives 0.

    Args:
        loss_tokens (torch.Tensor): per-token loss ``[B, T]``.
        mask (torch.Tensor): ``[B, T]``, non-zero = real token.
        mode (AggregationMode): see above.
        norm_len (int | None): constant length, required for ``"seq-mean-token-sum-norm"``.

    Returns:
        torch.Tensor: scalar loss.
    """
    check_choice("agg_mode", mode, AggregationMode)
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
        seq_loss = seq_sum / norm_len
    return masked_mean(seq_loss, seq_len > 0)
