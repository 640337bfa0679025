"""Torch-side helpers: named tensors in, wire dtypes, zero-copy byte views, staged tensors out.

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


def to_wire(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A contiguous CPU tensor in the transfer dtype (floating tensors only are cast). No copy when
    the tensor already is one."""
    t = t.detach()
    target = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return t.to(device="cpu", dtype=target).contiguous()


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
    """The tensors a pull writes into: an nn.Module's state_dict (shares storage with its
    parameters and buffers) or a dict of preallocated tensors.

    A module's tied weights (e.g. ``lm_head.weight`` sharing ``embed_tokens.weight``, as in
    Qwen2-0.5B) appear once, under their first name: ``named_parameters`` order, which is what a
    learner publishes, so an alias is never asked for and is updated through the tensor it shares.
    """
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
