"""Torch-side helpers: named tensors in, wire dtypes, zero-copy byte views, staged tensors out,
and the staging buffer a pull applies verified bytes through.

bfloat16 has no numpy dtype, so every tensor is handled as raw bytes through a ``uint8`` view of
its storage (``t.view(torch.uint8)``); the wire dtype name travels beside it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from rlhf_core.errors import UserError
from weight_server.errors import TensorMismatchError
from weight_server.protocol import Layout
from weight_server.shm_map import copy_bytes

TORCH_TO_WIRE: dict[torch.dtype, str] = {
    torch.float64: "float64", torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
    torch.bool: "bool",
}
WIRE_TO_TORCH: dict[str, torch.dtype] = {v: k for k, v in TORCH_TO_WIRE.items()}
_TRANSFER = {"as_trained": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def transfer_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """Accept a torch dtype, None, or a config name (``as_trained``, ``bfloat16``, ``float16``)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _TRANSFER:
        raise UserError(f"publish dtype {dtype!r} is not one of {', '.join(_TRANSFER)}")
    return _TRANSFER[dtype]


def named_tensors(source: Any) -> list[tuple[str, torch.Tensor]]:
    """Sorted (name, tensor) pairs from an nn.Module (its state_dict), a mapping or an iterable of pairs."""
    if isinstance(source, torch.nn.Module):
        items: Iterable[tuple[str, Any]] = source.state_dict().items()
    elif isinstance(source, Mapping):
        items = source.items()
    else:
        items = source
    out: dict[str, torch.Tensor] = {}
    for name, t in items:
        if not isinstance(name, str) or not name:
            raise UserError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise UserError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
        if name in out:
            raise UserError(f"tensor name {name!r} appears twice")
        if t.layout != torch.strided:
            raise UserError(f"{name!r} is a {t.layout} tensor; only dense tensors can be published")
        if t.dtype not in TORCH_TO_WIRE:
            raise UserError(f"{name!r} has dtype {t.dtype}, which cannot go on the wire; use one of {sorted(TORCH_TO_WIRE.values())}")
        out[name] = t
    return sorted(out.items())


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, zero-copy (works for bfloat16 and bool)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data


def check_target(layout: Layout, target: Mapping[str, torch.Tensor]) -> None:
    """Names must match exactly and shapes agree; dtypes may differ (copy_ converts)."""
    names = {t.name for t in layout.tensors}
    missing = sorted(names - target.keys())
    extra = sorted(target.keys() - names)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} published tensor(s) missing from the target (e.g. {missing[:3]})")
        if extra:
            parts.append(f"{len(extra)} target tensor(s) not in the published version (e.g. {extra[:3]})")
        raise TensorMismatchError(
            "pulled weights do not fit the target: " + "; ".join(parts)
            + ". Publish and pull the same architecture (state_dict names), or pull into=None and map names yourself"
        )
    for spec in layout.tensors:
        dest = target[spec.name]
        if tuple(dest.shape) != spec.shape:
            raise TensorMismatchError(f"tensor {spec.name!r}: target shape {tuple(dest.shape)} != published shape {spec.shape}")
        if dest.dtype == torch.bool and spec.dtype != "bool":
            raise TensorMismatchError(f"tensor {spec.name!r}: cannot copy {spec.dtype} into a bool tensor")


def staged(slab: torch.Tensor, layout: Layout, index: int) -> torch.Tensor:
    """Tensor ``index`` of ``layout`` as a view of the uint8 staging buffer ``slab`` (no copy)."""
    spec = layout.tensors[index]
    dtype = WIRE_TO_TORCH[spec.dtype]
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype)
    return slab[spec.offset : spec.offset + spec.nbytes].view(dtype).view(spec.shape)


def readonly_tensor(data: np.ndarray) -> torch.Tensor:
    """A uint8 tensor over a (possibly read-only) numpy buffer, without a copy. torch has no
    read-only tensors and warns about them; the caller only reads from it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


def target_of(into: Any) -> dict[str, torch.Tensor]:
    """The tensors a pull writes into: an nn.Module's state_dict or a dict of preallocated tensors.
    A module's tied weights (``lm_head.weight`` sharing ``embed_tokens.weight``) appear once, under
    their first name in ``named_parameters`` order, as a learner publishes them."""
    if isinstance(into, torch.nn.Module):
        seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
        out = {}
        for name, t in into.state_dict().items():
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if t.numel() and key in seen:
                continue
            seen.add(key)
            out[name] = t
        return out
    if isinstance(into, Mapping):
        bad = [k for k, v in into.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise UserError(f"pull(into=...) values must be tensors; {bad[:3]} are not")
        return dict(into)
    raise UserError(f"pull(into=...) takes an nn.Module or a dict of tensors, got {type(into).__name__}")


class Staging:
    """The host buffer verified bytes pass through on their way into a pull's target, and the copy
    into the target's tensors. Reused across pulls into a target (no fresh pages per pull)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def buffer(self, nbytes: int, target: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes``: a fresh one for a pull without a target (handed
        to the caller), else the reused one, pinned when the target has GPU tensors."""
        if target is None:
            return torch.empty(max(nbytes, 1), dtype=torch.uint8)  # handed to the caller: never reused
        pinned = any(t.is_cuda for t in target.values())
        cur = self._buf
        if cur is None or cur.numel() < nbytes or cur.is_pinned() != pinned:
            # Pinned memory makes host->GPU copies asynchronous DMA; allocated once, reused.
            self._buf = cur = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
        return cur

    @torch.no_grad()
    def apply(self, layout: Layout, source: np.ndarray, target: dict[str, torch.Tensor], needed: list[int]) -> None:
        """Copy tensors ``needed`` out of ``source`` (the layout's bytes: the staging buffer, or a
        read-only slab mapping) into the target, converting dtypes where they differ."""
        cuda = False
        source_t = None
        for i in needed:
            spec = layout.tensors[i]
            dest = target[spec.name].detach()
            if dest.device.type == "cpu" and dest.is_contiguous() and TORCH_TO_WIRE.get(dest.dtype) == spec.dtype:
                # same bytes: a single-threaded numpy memcpy (torch's copy_ splits it across threads)
                if spec.nbytes:
                    copy_bytes(dest.reshape(-1).view(torch.uint8).numpy(), source[spec.offset : spec.offset + spec.nbytes])
                continue
            if dest.is_cuda:
                # host->GPU from pinned memory is asynchronous DMA: stage the bytes there unless they are
                cuda = True
                stage = self.buffer(layout.total_bytes, target)
                if stage.data_ptr() != source.ctypes.data:
                    copy_bytes(stage.numpy()[spec.offset : spec.offset + spec.nbytes], source[spec.offset : spec.offset + spec.nbytes])
                dest.copy_(staged(stage, layout, i), non_blocking=True)
                continue
            if source_t is None:
                source_t = readonly_tensor(source)
            dest.copy_(staged(source_t, layout, i))  # converts dtype
        if cuda:
            torch.cuda.synchronize()  # a CPU-GPU sync point: "applied" means the bytes are on the device
