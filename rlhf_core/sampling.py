"""Logit processing shared by the rollout engines and the learner.

The behaviour log-prob a worker records for a token must be the log-prob under the exact
distribution that token was sampled from; the learner recomputes the same distribution from
its own forward pass to form the importance ratio pi_prox / mu. Both sides therefore go
through these functions, so the processing cannot drift between them (the "logprob mismatch"
that RLHF frameworks keep rediscovering is mostly a worker returning raw-softmax log-probs
while sampling from a temperature/top-p distribution, or the other way round).

Order of operations (the same as transformers' default warpers and vLLM's sampler):

1. cast to float32;
2. divide by ``temperature`` (``temperature == 0`` means greedy: it is treated as
   temperature 1 with ``top_k = 1``, so the chosen token has log-prob 0);
3. top-k: keep the ``top_k`` largest logits (``0`` = off; ties with the k-th value are kept);
4. top-p (nucleus) on the renormalised top-k distribution: keep the smallest prefix of the
   tokens sorted by probability whose mass reaches ``top_p`` (the most likely token is always
   kept; ``top_p >= 1`` = off).

Filtered entries become ``-inf``. Every setting may be a Python number (one value for the
whole batch) or a tensor of shape ``[B]`` (one value per row, broadcast over the remaining
leading dims), which is how a continuous-batching engine mixes requests with different
settings in one decoding step.
"""

from __future__ import annotations

from typing import Union

import torch

Setting = Union[float, int, torch.Tensor]

__all__ = ["process_logits", "sample_tokens", "token_logprobs", "response_logprobs"]


def _rows(value: torch.Tensor, ndim: int) -> torch.Tensor:
    """A per-row setting of shape [B] viewed as [B, 1, ..., 1] so it broadcasts over logits."""
    return value.reshape(value.shape[0], *([1] * (ndim - 1)))


def process_logits(
    logits: torch.Tensor, temperature: Setting = 1.0, top_k: Setting = 0, top_p: Setting = 1.0
) -> torch.Tensor:
    """Temperature, then top-k, then top-p. Returns float32 logits with filtered entries at -inf.

    Args:
        logits: ``[..., V]`` raw model logits (any float dtype; the rows are the leading dims).
        temperature: ``>= 0``; a number or a ``[B]`` tensor (B = ``logits.shape[0]``).
        top_k: ``>= 0``, 0 = off; a number or a ``[B]`` integer tensor.
        top_p: in ``(0, 1]``, 1 = off; a number or a ``[B]`` tensor.

    Returns:
        ``[..., V]`` float32. Differentiable with respect to ``logits`` (the learner backprops
        through it); the filtering masks themselves carry no gradient.
    """
    x = logits.float()
    ndim, vocab = x.ndim, x.shape[-1]
    neg_inf = float("-inf")

    # Greedy rows: temperature 0 -> temperature 1, top_k 1.
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(device=x.device, dtype=torch.float32)
        greedy = temperature == 0
        if isinstance(top_k, torch.Tensor) or bool(greedy.any()):
            k = top_k if isinstance(top_k, torch.Tensor) else torch.full_like(greedy, int(top_k), dtype=torch.long)
            top_k = torch.where(greedy, torch.ones_like(k, dtype=torch.long), k.to(device=x.device, dtype=torch.long))
        x = x / _rows(torch.where(greedy, torch.ones_like(temperature), temperature), ndim)
    elif temperature == 0:
        top_k = 1 if not isinstance(top_k, torch.Tensor) else torch.ones_like(top_k)
    elif temperature != 1.0:
        x = x / float(temperature)

    # Top-k.
    if isinstance(top_k, torch.Tensor):
        k = top_k.to(device=x.device, dtype=torch.long)
        k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
        if bool((k < vocab).any()):
            sorted_x = x.sort(dim=-1, descending=True).values
            index = _rows(k - 1, ndim).expand(*x.shape[:-1], 1)
            kth = sorted_x.gather(-1, index)
            x = x.masked_fill(x < kth, neg_inf)
    elif 0 < int(top_k) < vocab:
        kth = torch.topk(x, int(top_k), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, neg_inf)

    # Top-p on the (renormalised) top-k distribution.
    if isinstance(top_p, torch.Tensor):
        p = _rows(top_p.to(device=x.device, dtype=torch.float32), ndim)
        apply_p = bool((top_p < 1).any())
    else:
        p, apply_p = float(top_p), float(top_p) < 1.0
    if apply_p:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Keep a token while the mass of the more likely tokens is still below top_p; the
        # first token has mass_before 0 and is always kept. Rows with top_p >= 1 keep all.
        remove_sorted = mass_before >= p
        if isinstance(p, torch.Tensor):
            remove_sorted &= p < 1
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        x = x.masked_fill(remove, neg_inf)
    return x


def sample_tokens(processed: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from ``softmax(processed)``: ``[..., V]`` -> ``[...]`` int64.

    Entries at -inf have probability exactly 0 and are never drawn.
    """
    probs = processed.softmax(dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    tokens = torch.multinomial(flat, 1, generator=generator)
    return tokens.reshape(probs.shape[:-1])


def token_logprobs(processed: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-prob of ``tokens`` under ``softmax(processed)``: ``[..., V]``, ``[...]`` -> ``[...]`` float32."""
    logp = torch.log_softmax(processed.float(), dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def response_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: Setting = 1.0,
    top_k: Setting = 0,
    top_p: Setting = 1.0,
) -> torch.Tensor:
    """The learner-side recomputation: log-probs of ``tokens`` given the logits that predicted them.

    Args:
        logits: ``[B, T, V]`` where ``logits[:, t]`` is the model output that predicts ``tokens[:, t]``
            (i.e. the forward pass over prompt + response, shifted by one).
        tokens: ``[B, T]`` sampled token ids.

    Returns:
        ``[B, T]`` float32, the same numbers the engine recorded as behaviour log-probs when the
        weights and settings are the same (up to float rounding of the forward pass).
    """
    return token_logprobs(process_logits(logits, temperature, top_k, top_p), tokens)
