"""Logit processing shared by the rollout engines and the learner.

The behaviour log-prob a worker records for a token must be the log-prob under the exact
distribution that token was sampled from; the learner recomputes the same distribution from its
own forward pass to form the importance ratio pi_prox / mu. Both sides go through these
functions, so the processing cannot drift between them.

Order of operations (the same as transformers' default warpers and vLLM's sampler):

1. cast to float32;
2. divide by ``temperature`` (``temperature == 0`` means greedy: it is treated as
   temperature 1 with ``top_k = 1``, so the chosen token has log-prob 0);
3. top-k: keep the ``top_k`` largest logits (``0`` = off; ties with the k-th value are kept);
4. top-p (nucleus) on the renormalised top-k distribution: keep the smallest prefix of the
   tokens sorted by probability whose mass reaches ``top_p``, and the tokens tied with the last
   one kept (the most likely token is always kept; ``top_p`` held as float32 ``>= 1`` = off).

Filtered entries become ``-inf``. Every setting may be a number (one value for the batch) or a
``[B]`` tensor (one per row), which is how a continuous-batching engine mixes requests.
"""

from __future__ import annotations

import torch

Setting = float | int | torch.Tensor

__all__ = ["process_logits", "process_logits_rows", "sample_tokens", "token_logprobs", "response_logprobs"]


def _rows(value: torch.Tensor, ndim: int) -> torch.Tensor:
    """A per-row setting of shape [B] viewed as [B, 1, ..., 1] so it broadcasts over logits."""
    return value.reshape(value.shape[0], *([1] * (ndim - 1)))


def process_logits(
    logits: torch.Tensor, temperature: Setting = 1.0, top_k: Setting = 0, top_p: Setting = 1.0
) -> torch.Tensor:
    """Temperature (>= 0), then top-k (0 = off), then top-p (1 = off) on ``[..., V]`` logits of any
    float dtype, each setting a number or a ``[B]`` tensor (B = ``logits.shape[0]``). Returns
    ``[..., V]`` float32 with filtered entries at -inf, differentiable with respect to ``logits``."""
    if any(isinstance(s, torch.Tensor) for s in (temperature, top_k, top_p)):
        rows, device = logits.shape[0], logits.device
        t, k, p = (_per_row(s, rows, dtype, device) for s, dtype in
                   ((temperature, torch.float32), (top_k, torch.long), (top_p, torch.float32)))
        use_k = bool(((t == 0) | ((k > 0) & (k < logits.shape[-1]))).any())
        return process_logits_rows(logits, t, k, p, use_top_k=use_k, use_top_p=bool((p < 1).any()))
    x = logits.float()
    if temperature == 0:
        top_k = 1
    elif temperature != 1.0:
        x = x / float(temperature)
    if 0 < int(top_k) < x.shape[-1]:
        kth = torch.topk(x, int(top_k), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.tensor(float(top_p), dtype=torch.float32)  # as the rows' path holds it: 1 - 1e-8 is 1.0, off
    if p < 1:
        x = _top_p(x, p)
    return x


def process_logits_rows(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    *, use_top_k: bool = True, use_top_p: bool = True,
) -> torch.Tensor:
    """:func:`process_logits` with one ``[B]`` tensor per setting and no host sync (it runs inside a
    captured CUDA graph). ``use_top_k`` / ``use_top_p``: whether any row filters by top-k (greedy
    rows included) or top-p; False skips that sort."""
    x = logits.float()
    ndim, vocab = x.ndim, x.shape[-1]
    greedy = temperature == 0
    x = x / _rows(torch.where(greedy, torch.ones_like(temperature), temperature), ndim)
    if use_top_k:
        k = torch.where(greedy, torch.ones_like(top_k), top_k)
        k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
        sorted_x = x.sort(dim=-1, descending=True).values
        kth = sorted_x.gather(-1, _rows(k - 1, ndim).expand(*x.shape[:-1], 1))
        x = x.masked_fill(x < kth, float("-inf"))
    if use_top_p:
        x = _top_p(x, _rows(top_p, ndim))
    return x


def _per_row(value: Setting, rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype)
    return torch.full((rows,), value, dtype=dtype, device=device)


def _top_p(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter on ``softmax(x)``: drop the least likely tokens while their mass stays within
    ``1 - p`` (rows with ``p >= 1`` keep everything), with vLLM's arithmetic (an ascending sort,
    ``cumsum <= 1 - p`` in float32), so both cut at the same value; every token tied with the least
    likely one kept stays (vLLM may keep any of a tie). ``p``: float32, 0-d (a CPU scalar) or per row."""
    sorted_x = x.sort(dim=-1).values
    cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    dropped = (cum <= 1 - p).sum(dim=-1, keepdim=True).clamp(max=x.shape[-1] - 1)
    least_kept = sorted_x.gather(-1, dropped)
    return x.masked_fill((x < least_kept) & (p < 1), float("-inf"))


def sample_tokens(processed: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from ``softmax(processed)``: ``[..., V]`` -> ``[...]`` int64, as
    ``torch.multinomial`` draws it (``argmax(p / q)``, ``q ~ Exp(1)``: the same draws for the same
    generator state) but without its host-side check, so it runs inside a captured CUDA graph."""
    probs = processed.softmax(dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return probs.div_(race).argmax(dim=-1)


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
    """The learner-side recomputation: ``[B, T]`` float32 log-probs of ``tokens`` ``[B, T]`` given
    ``logits`` ``[B, T, V]`` (``logits[:, t]`` predicts ``tokens[:, t]``): what the engine recorded
    as behaviour log-probs for the same weights and settings, up to float rounding."""
    return token_logprobs(process_logits(logits, temperature, top_k, top_p), tokens)
