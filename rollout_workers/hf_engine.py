"""The `hf` generation engine: a transformers causal LM with continuous batching over a KV cache.

Design (sample-level streaming, RLHFuse): up to ``slots`` sequences decode together; a
sequence that finishes frees its row and the next waiting request takes it at the next
:meth:`HFEngine.step`, so one long response never holds a whole batch.

The batch is ONE ``transformers.DynamicCache`` whose rows are the active sequences
(``layers[i].keys/values``: ``[B, kv_heads, T, head_dim]``), each row right-aligned: a row's
real tokens occupy its last ``n_cached`` columns, the columns left of them are padding,
masked out by a 2-D boolean attention mask ``[B, T]``. Positions (``position_ids``) count only
a row's real tokens, so RoPE sees exactly the positions of an unpadded forward pass; that is
what makes the behaviour log-probs reproducible by the learner (see ``tests/unit/test_hf_engine.py``).

Per step:

1. release the rows of sequences that finished (or were aborted) since the last step;
2. admit waiting requests: prefill ``prompt[:-1]`` of all newcomers in one left-padded
   forward pass into a fresh cache, then write each newcomer's K/V into a free row (padding
   the batch cache on the left when a newcomer is longer than it) or append a row. The last
   prompt token is not prefilled: it is the newcomer's input of this step's decoding pass, so
   every active sequence samples exactly one token per step;
3. drop rows still free (nothing was waiting for them) and the leading columns that are
   padding in every row (a view; the cache's own concatenation in the next forward copies it);
4. one forward pass of ``[B, 1]`` tokens, then temperature/top-k/top-p, sampling and
   log-probs for all rows at once through :mod:`rlhf_core.sampling`, one host sync for the
   sampled ids.

Models whose cache is not a plain full-attention ``DynamicCache`` (sliding-window or linear
attention layers) are refused with a clear error; use the vllm engine for them.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Mapping

import torch

from rlhf_core.sampling import process_logits, sample_tokens, token_logprobs
from rollout_workers.engine import (EngineError, GenRequest, GenResult, RequestError, SamplingParams, check_weight_update,
                                    make_result)

log = logging.getLogger(__name__)


class _Seq:
    """One active sequence (a batch row of the cache)."""

    __slots__ = ("request", "params", "prompt", "tokens", "logprobs", "versions", "n_cached", "next_input",
                 "stop_ids", "stop_window", "done")

    def __init__(self, request: GenRequest, stop_ids: frozenset[int]) -> None:
        self.request = request
        self.params = request.params
        self.prompt = request.prompt_ids
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.n_cached = len(self.prompt) - 1  # real tokens of this row in the cache
        self.next_input = self.prompt[-1]  # fed at the next decoding pass
        self.stop_ids = stop_ids
        # A stop string of n characters spans at most n tokens when each token decodes to >= 1
        # character; the margin covers tokenizers that merge a leading space into a word.
        longest = max((len(s) for s in self.params.stop_strings), default=0)
        self.stop_window = longest + 8
        self.done = False


class HFEngine:
    """Continuous-batching generation with a transformers model. See the module docstring.

    Args:
        model: a causal LM (``AutoModelForCausalLM``); it is put in eval mode and used in place.
        tokenizer: its tokenizer (EOS ids, pad id, decoding of texts and stop strings).
        slots: sequences decoded together at most.
        seed: seed of the engine's sampling generator (on the model's device).
        max_model_len: context limit; defaults to ``config.max_position_embeddings``.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, slots: int = 16, seed: int = 0,
                 max_model_len: int | None = None) -> None:
        if slots < 1:
            raise EngineError(f"slots must be >= 1, got {slots}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.slots = int(slots)
        self.version = 0
        config = model.config
        self.device = next(model.parameters()).device
        self._dtype = next(model.parameters()).dtype
        self._attn_impl = getattr(config, "_attn_implementation", None)
        self.max_model_len = int(max_model_len or getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad or 0)
        self.eos_ids = frozenset(_eos_ids(tokenizer, model))
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(int(seed))
        self.num_steps = 0  # decoding steps run (one forward pass of [B, 1] each)
        self.num_prefills = 0
        self.tokens_generated = 0
        self._waiting: deque[GenRequest] = deque()
        self._known: dict[str, GenRequest | _Seq] = {}  # waiting or active, by request id
        self._rows: list[_Seq | None] = []  # batch row -> sequence; None = free row
        self._cache: Any = None  # DynamicCache, None while no row has a cached token
        self._mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # [B, T] True = real token
        self._check_cache_layout()

    # ----------------------------------------------------------------------------- protocol

    def add(self, request: GenRequest) -> None:
        if not isinstance(request.params, SamplingParams):
            raise RequestError(f"request {request.request_id}: params must be a SamplingParams, got {type(request.params).__name__}")
        if request.request_id in self._known:
            raise RequestError(f"request id {request.request_id!r} is already queued or running; ids must be unique")
        prompt = [int(t) for t in request.prompt_ids]
        if not prompt:
            raise RequestError(f"request {request.request_id}: empty prompt; a prompt needs at least one token (e.g. BOS)")
        if len(prompt) >= self.max_model_len:
            raise RequestError(
                f"request {request.request_id}: prompt has {len(prompt)} tokens but the model's context is "
                f"{self.max_model_len}; lower rollout.max_prompt_tokens or use rollout.prompt_overflow=truncate"
            )
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise RequestError(f"request {request.request_id}: token ids must lie in [0, {self.vocab_size}), "
                               f"got min {min(prompt)} max {max(prompt)}")
        request.prompt_ids = prompt
        self._waiting.append(request)
        self._known[request.request_id] = request

    def step(self) -> list[GenResult]:
        with torch.inference_mode():
            self._release_finished()
            self._admit()
            self._drop_free_rows()
            if not self._rows:
                self._reset_cache()
                return []
            self._trim_leading_padding()
            return self._decode()

    def has_work(self) -> bool:
        return bool(self._known)

    def num_active(self) -> int:
        return len(self._known) - len(self._waiting)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def abort(self, request_id: str) -> GenResult | None:
        entry = self._known.pop(request_id, None)
        if entry is None:
            return None
        if isinstance(entry, GenRequest):
            self._waiting.remove(entry)
            return make_result(request_id, entry.prompt_ids, [], [], [], "abort", "")
        entry.done = True  # its row is released at the next step
        return self._result(entry, "abort")

    def abort_all(self) -> list[GenResult]:
        return [r for rid in list(self._known) if (r := self.abort(rid)) is not None]

    def weights_target(self) -> torch.nn.Module:
        return self.model

    def close(self) -> None:
        pass  # everything lives in this process

    def update_weights(self, tensors: Mapping[str, torch.Tensor] | None, version: int) -> None:
        """Copy ``tensors`` (state-dict names) into the model in place; all names and shapes are
        checked before the first copy, so a mismatch never leaves half-updated weights."""
        if tensors is not None:
            own = self.model.state_dict(keep_vars=True)
            check_weight_update(tensors, {n: tuple(t.shape) for n, t in own.items()}, version)
            with torch.no_grad():
                for name, tensor in tensors.items():
                    own[name].copy_(tensor)  # copy_ converts device and dtype
        self.version = int(version)

    # ----------------------------------------------------------------------------- internals

    def _check_cache_layout(self) -> None:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        layers = DynamicCache(config=self.model.config).layers
        odd = {type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer}
        if odd:
            raise EngineError(
                f"the hf engine batches full-attention KV caches only; this model's cache has {sorted(odd)} layers. "
                "Use rollout.engine=vllm for sliding-window or linear-attention models"
            )

    def _release_finished(self) -> None:
        for i, seq in enumerate(self._rows):
            if seq is not None and seq.done:
                self._rows[i] = None

    def _admit(self) -> None:
        n_live = sum(seq is not None for seq in self._rows)
        take = min(self.slots - n_live, len(self._waiting))
        if take <= 0:
            return
        seqs = []
        for _ in range(take):
            request = self._waiting.popleft()
            stop_ids = frozenset(request.params.stop_token_ids) | (frozenset() if request.params.ignore_eos else self.eos_ids)
            seq = _Seq(request, stop_ids)
            self._known[request.request_id] = seq
            seqs.append(seq)
        new_cache, new_mask = self._prefill(seqs)
        self._place(seqs, new_cache, new_mask)

    def _prefill(self, seqs: list[_Seq]) -> tuple[Any, torch.Tensor]:
        """A cache holding ``prompt[:-1]`` of each newcomer, left-padded to the longest (K/V per
        layer ``[n, kv_heads, P, head_dim]``; None when P == 0), and its mask ``[n, P]``."""
        from transformers import DynamicCache

        n, width = len(seqs), max(seq.n_cached for seq in seqs)
        real = [[False] * (width - s.n_cached) + [True] * s.n_cached for s in seqs]
        mask = torch.tensor(real, dtype=torch.bool, device=self.device).reshape(n, width)
        if width == 0:
            return None, mask
        ids = [[self.pad_id] * (width - s.n_cached) + s.prompt[:-1] for s in seqs]
        positions = [[0] * (width - s.n_cached) + list(range(s.n_cached)) for s in seqs]
        cache = DynamicCache(config=self.model.config)
        self.model(
            input_ids=torch.tensor(ids, device=self.device),
            attention_mask=mask,
            position_ids=torch.tensor(positions, device=self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,  # the logits are not needed; keep the LM head cheap
        )
        self.num_prefills += 1
        return cache, mask

    def _place(self, seqs: list[_Seq], new_cache: Any, new_mask: torch.Tensor) -> None:
        """Write the newcomers' K/V into free rows first, then append rows (right-aligned)."""
        if self._cache is None:
            # No cached tokens yet, so no rows either (see step()): the newcomers are the batch.
            self._rows = list(seqs)
            self._cache, self._mask = new_cache, new_mask
            return
        width, total = new_mask.shape[1], self._mask.shape[1]
        if width > total:  # a newcomer is longer than every cached row: grow the batch on the left
            self._grow_left(width - total)
            total = width
        free = [i for i, seq in enumerate(self._rows) if seq is None][: len(seqs)]
        n_reuse = len(free)
        index = torch.tensor(free, dtype=torch.long, device=self.device)
        for li, layer in enumerate(self._cache.layers):
            for attr in ("keys", "values"):
                cur = getattr(layer, attr)
                if new_cache is None:
                    rows = cur.new_zeros(len(seqs), cur.shape[1], total, cur.shape[3])
                else:
                    rows = _pad_left_kv(getattr(new_cache.layers[li], attr), total)
                if n_reuse:
                    # Overwrite the whole row: the previous occupant's K/V left of the newcomer
                    # would be masked, but zeros also rule out inf/NaN leaking through 0 * x.
                    cur[index] = rows[:n_reuse]
                if n_reuse < len(seqs):
                    cur = torch.cat([cur, rows[n_reuse:]], 0)
                setattr(layer, attr, cur)
        mask_rows = _pad_left(new_mask, total)
        if n_reuse:
            self._mask[index] = mask_rows[:n_reuse]
        if n_reuse < len(seqs):
            self._mask = torch.cat([self._mask, mask_rows[n_reuse:]], 0)
        for i, seq in zip(free, seqs):
            self._rows[i] = seq
        self._rows.extend(seqs[n_reuse:])

    def _grow_left(self, extra: int) -> None:
        for layer in self._cache.layers:
            layer.keys = _pad_left_kv(layer.keys, layer.keys.shape[2] + extra)
            layer.values = _pad_left_kv(layer.values, layer.values.shape[2] + extra)
        self._mask = _pad_left(self._mask, self._mask.shape[1] + extra)

    def _drop_free_rows(self) -> None:
        keep = [i for i, seq in enumerate(self._rows) if seq is not None]
        if len(keep) == len(self._rows):
            return
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._mask = self._mask.index_select(0, index)
        if self._cache is not None:
            for layer in self._cache.layers:
                layer.keys = layer.keys.index_select(0, index)
                layer.values = layer.values.index_select(0, index)

    def _trim_leading_padding(self) -> None:
        total = self._mask.shape[1]
        lead = min(total - seq.n_cached for seq in self._rows)  # host bookkeeping: no device sync
        if lead <= 0 or self._cache is None:
            return
        # Views only: the concatenation inside the next forward pass makes the copy anyway.
        for layer in self._cache.layers:
            layer.keys = layer.keys[:, :, lead:]
            layer.values = layer.values[:, :, lead:]
        self._mask = self._mask[:, lead:]

    def _reset_cache(self) -> None:
        self._cache = None
        self._mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)

    def _sampling_settings(self) -> tuple[Any, Any, Any]:
        """Scalars when every row shares its settings (the usual case), else ``[B]`` tensors."""
        keys = [seq.params.key for seq in self._rows]
        first = keys[0]
        if all(k == first for k in keys):
            return first
        temps, ks, ps = zip(*keys)
        return (torch.tensor(temps, dtype=torch.float32, device=self.device),
                torch.tensor(ks, dtype=torch.long, device=self.device),
                torch.tensor(ps, dtype=torch.float32, device=self.device))

    def _decode(self) -> list[GenResult]:
        from transformers import DynamicCache

        rows = self._rows
        n = len(rows)
        input_ids = torch.tensor([[seq.next_input] for seq in rows], device=self.device)
        positions = torch.tensor([[seq.n_cached] for seq in rows], device=self.device)
        mask = torch.cat([self._mask, torch.ones(n, 1, dtype=torch.bool, device=self.device)], 1)
        cache = self._cache if self._cache is not None else DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=self._decode_mask(mask), position_ids=positions,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        self._cache, self._mask = cache, mask
        temperature, top_k, top_p = self._sampling_settings()
        processed = process_logits(out.logits[:, -1], temperature, top_k, top_p)
        tokens = sample_tokens(processed, self.generator)
        logprobs = token_logprobs(processed, tokens)
        token_list = tokens.tolist()  # the one device sync of the step
        logprob_list = logprobs.tolist()
        self.num_steps += 1
        self.tokens_generated += n
        version = self.version
        finished = []
        for seq, token, logprob in zip(rows, token_list, logprob_list):
            seq.n_cached += 1
            seq.next_input = token
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                seq.done = True
                del self._known[seq.request.request_id]
                finished.append(self._result(seq, reason))
        return finished

    def _decode_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """The attention mask of a decoding pass, prepared as 4-D where we know the attention's
        convention: a single query per row attends to every real column, so no causal part is
        needed, and transformers' generic mask construction (~10% of a tiny-model step) is skipped."""
        impl = self._attn_impl
        if impl == "sdpa":  # boolean, True = attend
            return mask[:, None, None, :]
        if impl == "eager":  # additive
            dtype = self._dtype
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
                ~mask, torch.finfo(dtype).min)[:, None, None, :]
        return mask  # other kernels (flash, flex, paged) build their own from the 2-D mask

    def _finish_reason(self, seq: _Seq, token: int) -> str | None:
        if token in seq.stop_ids:
            return "stop"
        if seq.params.stop_strings:
            tail = self.tokenizer.decode(seq.tokens[-seq.stop_window:], skip_special_tokens=True)
            if any(s in tail for s in seq.params.stop_strings):
                return "stop"
        if len(seq.tokens) >= seq.params.max_new_tokens or len(seq.prompt) + len(seq.tokens) >= self.max_model_len:
            return "length"
        return None

    def _result(self, seq: _Seq, reason: str) -> GenResult:
        text = self.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        return make_result(seq.request.request_id, seq.prompt, seq.tokens, seq.logprobs, seq.versions, reason, text)


def _pad_left(mask: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, T]`` bool -> ``[B, width]`` with False columns prepended."""
    extra = width - mask.shape[1]
    if extra <= 0:
        return mask
    return torch.cat([mask.new_zeros(mask.shape[0], extra), mask], 1)


def _pad_left_kv(kv: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, H, T, D]`` -> ``[B, H, width, D]`` with zero columns prepended."""
    extra = width - kv.shape[2]
    if extra <= 0:
        return kv
    return torch.cat([kv.new_zeros(kv.shape[0], kv.shape[1], extra, kv.shape[3]), kv], 2)


def _eos_ids(tokenizer: Any, model: torch.nn.Module) -> set[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(int(t) for t in gen_eos)
    return ids
