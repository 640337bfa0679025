"""The hf engine's KV cache: one preallocated row ("slot") per running sequence, written in place.

Every layer's keys and values live in ``[slots, kv_heads, columns, head_dim]`` tensors allocated
once; column ``j`` of a slot holds the K/V of that sequence's token at position ``j``, so a step
allocates nothing (which also lets it be captured in a CUDA graph). The attention of a token at
position ``p`` sees columns ``0..p`` of its own slot. The last column is a scratch column no real
token reaches: inputs that only fill a batch write there, fed at position 0
(:meth:`SlotKVCache.positions`).

Llama and Qwen2 models run through :func:`direct_forward` (their own modules in their forward's
order, without the work around them); any other model runs its own forward with
:func:`slot_attention` plugged in (:func:`slot_attention_for`), once :func:`check_slot_attention`
has seen it reach every layer. docs/architecture.md (Rollout workers: Engines) says more.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from rollout_workers.engine import EngineError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTENTION_NAME = "rlhf_slots"
PROBE_NAME = "rlhf_slots_probe"  # the start-up probe's counting slot attention (check_slot_attention)
COLUMN_ALIGN = 64  # columns are allocated (and, without CUDA graphs, attended) in multiples of this


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a transformers decoder config."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return int(config.num_hidden_layers), kv_heads, head_dim


class SlotKVCache:
    """Per-layer K/V ``[slots, kv_heads, columns, head_dim]`` with the transformers cache's
    ``update`` hook. Call :meth:`select` before each forward pass.

    Args:
        config: the model's config (layers, heads, head_dim).
        slots: sequences held at once.
        max_len: longest sequence (prompt + response) a slot holds; one scratch column is
            added and the total rounded up to :data:`COLUMN_ALIGN`.
    """

    def __init__(self, config: Any, slots: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        layers, kv_heads, head_dim = kv_shape(config)
        self.slots = int(slots)
        self.columns = round_up(int(max_len) + 1, COLUMN_ALIGN)
        self.scratch = self.columns - 1
        shape = (self.slots, kv_heads, self.columns, head_dim)
        self.nbytes = 2 * layers * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        try:
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        except torch.OutOfMemoryError as exc:
            raise EngineError(
                f"the KV cache ({self.nbytes / 2**30:.1f} GiB: {layers} layers x {shape}) does not fit on {device}; "
                "lower rollout.slots or the longest sequence (rollout.max_prompt_tokens + rollout.max_new_tokens)"
            ) from exc
        self._all_rows = torch.arange(self.slots, device=device)
        self._col_index = torch.arange(self.columns, device=device)
        self._rows: torch.Tensor | int = 0
        self._write_rows = self._all_rows[:0, None]
        self._cols = self._all_rows[:0, None]
        self._width = self.columns

    def select(self, rows: torch.Tensor | int, positions: torch.Tensor, width: int) -> None:
        """The next forward pass feeds ``rows`` (an int n: slots 0..n-1, read as views; or a
        ``[n]`` long tensor of slot ids) with tokens at ``positions`` ``[n, C]`` (the columns they
        write), and attends over the first ``width`` columns."""
        self._rows = rows
        self._write_rows = (self._all_rows[:rows] if isinstance(rows, int) else rows)[:, None]
        self._cols = positions
        self._width = int(width)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this pass's K/V ``[n, kv_heads, C, head_dim]`` at (row, position) in place and
        return the rows' K/V over the attended columns, ``[n, kv_heads, width, head_dim]``."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        # Advanced indices split by a slice put their broadcast shape [n, C] first: [n, C, H, D].
        keys[self._write_rows, :, self._cols] = key_states.transpose(1, 2).to(keys.dtype)
        values[self._write_rows, :, self._cols] = value_states.transpose(1, 2).to(values.dtype)
        if isinstance(self._rows, int):  # a view: no copy
            return keys[: self._rows, :, : self._width], values[: self._rows, :, : self._width]
        return keys[self._rows, :, : self._width], values[self._rows, :, : self._width]

    def relocate(self, moves: list[tuple[int, int, int]], swaps: list[tuple[int, int, int, int]]) -> None:
        """Apply a packing in one indexed copy per cache tensor: each ``(src, dst, columns)`` of
        ``moves`` copies slot ``src``'s first ``columns`` columns into slot ``dst``; each ``(a, b,
        columns_a, columns_b)`` of ``swaps`` exchanges slot ``a``'s first ``columns_a`` columns with
        slot ``b``'s first ``columns_b``. Every slot named appears once, so the copies commute."""
        if not moves and not swaps:
            return
        src = torch.tensor([m[0] for m in moves] + [w[0] for w in swaps], device=self._all_rows.device)
        dst = torch.tensor([m[1] for m in moves] + [w[1] for w in swaps], device=self._all_rows.device)
        width = max([m[2] for m in moves] + [w[2] for w in swaps])
        back_width = max((w[3] for w in swaps), default=0)
        back_src, back_dst = dst[len(moves):], src[len(moves):]  # a swap's other half: b's columns up into a
        for cache in (*self.keys, *self.values):
            kept = cache[back_src, :, :back_width] if back_width else None  # indexing copies
            cache[dst, :, :width] = cache[src, :, :width]
            if kept is not None:
                cache[back_dst, :, :back_width] = kept

    def positions(self, columns: torch.Tensor) -> torch.Tensor:
        """The position ids the model embeds for inputs writing ``columns``: a real token's column is
        its position; the scratch column, which may lie past the model's context, is fed at 0."""
        return columns.masked_fill(columns == self.scratch, 0)

    def attention_mask(self, positions: torch.Tensor, width: int) -> torch.Tensor:
        """``[n, 1, C, width]`` boolean, True where column ``j <= position``: each token sees its
        own slot's prefix and itself (causal within a prefill chunk)."""
        return self._col_index[:width] <= positions[:, None, :, None]

    # The rest of transformers' cache interface that a forward pass with explicit positions and
    # a prepared 4-D mask can touch.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return False


def slot_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA over a slot cache. ``query`` ``[n, H, C, D]``, ``key``/``value`` ``[n, H_kv, W, D]``,
    ``attention_mask`` ``[n, 1, C, W]`` bool. Returns ``[n, C, H, D]`` (transformers' layout).

    Grouped-query attention: query head ``h`` reads K/V head ``h // G`` (G = H / H_kv), so the G
    heads of a group are folded into the query axis, ``[n, H_kv, G*C, D]``, and SDPA runs as plain
    multi-head attention over H_kv heads without materialising repeated K/V.
    """
    n, heads, q_len, dim = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    group = heads // kv_heads
    mask = attention_mask
    if group > 1:
        query = query.reshape(n, kv_heads, group * q_len, dim)
        if mask is not None and q_len > 1:
            mask = mask[:, :, None].expand(n, 1, group, q_len, width).reshape(n, 1, group * q_len, width)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(n, heads, q_len, dim).transpose(1, 2).contiguous(), None


#: Causal LMs :func:`direct_forward` runs: pre-norm attention and MLP blocks with rotary positions,
#: whose forward passes (transformers 5) are those modules called in this order and nothing else.
DIRECT_MODELS = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM"})


def direct_forward_supported(model: torch.nn.Module) -> bool:
    """Whether :func:`direct_forward` computes what ``model``'s own forward does (not for a
    subclass, which may change it, even one of the same name, or a sliding-window layer)."""
    cls = type(model)
    if cls.__name__ not in DIRECT_MODELS or not cls.__module__.startswith("transformers.models."):
        return False
    inner: Any = model.model  # a DIRECT_MODELS decoder: its submodules are reached by name
    return all(getattr(layer.self_attn, "sliding_window", None) is None for layer in inner.layers)


def direct_forward(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                   cache: SlotKVCache) -> torch.Tensor:
    """The logits ``[n, V]`` of the last of ``ids`` ``[n, C]`` at ``positions`` through ``cache``
    (its :meth:`~SlotKVCache.select` done; ``mask`` from :meth:`~SlotKVCache.attention_mask`), for
    a :func:`direct_forward_supported` model: its embedding, rotary, norm, projection, MLP and
    head modules (a LoRA layer in place of a projection included) with the arithmetic of its
    attention and decoder layers, the same operations in the same order."""
    inner: Any = model.model  # a DIRECT_MODELS decoder: its submodules are reached by name
    head: Any = model.lm_head
    hidden = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(hidden, position_ids=positions)
    rotate = sys.modules[type(inner.layers[0].self_attn).__module__].apply_rotary_pos_emb
    n, c = ids.shape
    for layer in inner.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        shape = (n, c, -1, attn.head_dim)
        q, k = rotate(attn.q_proj(x).view(shape).transpose(1, 2), attn.k_proj(x).view(shape).transpose(1, 2), cos, sin)
        k, v = cache.update(k, attn.v_proj(x).view(shape).transpose(1, 2), attn.layer_idx)
        out, _ = slot_attention(attn, q, k, v, mask, scaling=attn.scaling)
        hidden = hidden + attn.o_proj(out.reshape(n, c, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return head(inner.norm(hidden[:, -1]))


@contextlib.contextmanager
def slot_attention_for(model: PreTrainedModel, name: str = ATTENTION_NAME,
                       attention: Callable[..., Any] = slot_attention) -> Iterator[None]:
    """Route ``model``'s attention through :func:`slot_attention` (registered as ``name``; the
    probe's counting wrapper of it) inside the block (the model's own implementation is restored
    after, so other users of the model are unaffected)."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention)
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


_probe = threading.local()  # .layers: the modules the slot attention ran for in this thread's probe


def _counted_slot_attention(module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    _probe.layers.append(module)
    return slot_attention(module, *args, **kwargs)


def check_slot_attention(model: PreTrainedModel, one_pass: Callable[[], Any]) -> None:
    """Refuse a model the slot attention plug-in does not reach: ``one_pass`` (the engine's pass of
    one token) must run :func:`slot_attention` once in each layer. Families whose attention code
    bypasses transformers' attention interface (Falcon, GPT-J, MPT, Bloom, ...) would ignore the
    slot mask and give wrong log-probs silently; a pass that fails (a cache layout the slot cache
    does not hold) is refused the same way."""
    layers = kv_shape(model.config)[0]
    _probe.layers = []
    try:
        with slot_attention_for(model, PROBE_NAME, _counted_slot_attention):
            one_pass()
    except Exception as exc:  # noqa: BLE001 - whatever breaks, the engine cannot run this model
        raise EngineError(
            f"the hf engine cannot run {type(model).__name__}: a one-token pass through its slot KV cache failed "
            f"({type(exc).__name__}: {exc}); its attention is not one the slot cache holds. Use rollout.engine=vllm"
        ) from exc
    finally:
        ran, _probe.layers = _probe.layers, []
    if len(ran) != layers or len({id(m) for m in ran}) != layers:
        raise EngineError(
            f"the hf engine cannot run {type(model).__name__}: its attention does not go through transformers' "
            f"attention interface (the slot attention ran {len(ran)} times for {layers} layers in a one-token pass), "
            "so it would ignore the slot cache's mask and read other requests' K/V. Use rollout.engine=vllm"
        )
