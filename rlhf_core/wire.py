"""Wire format: msgpack records ``{"schema_version": 2, "kind": "<kind>", ...fields}`` with raw
tensors ``{"dtype": "float32", "shape": [3], "data": <raw little-endian bytes>}``.

Nothing is ever unpickled or evaluated; decoding untrusted bytes raises :class:`WireError` (a
``ValueError``) saying what was wrong. The kinds are defined by the modules that own them
(:mod:`rlhf_core.records`, ``weight_server.protocol``); this module knows the envelope and tensors.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

#: The version this build writes. 2 added the sample's optional ``loss_mask`` (multi-turn
#: episodes); a field a version adds is optional, so every version in
#: :data:`READABLE_SCHEMA_VERSIONS` still decodes (a record of version 1 has no mask: all ones).
SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)

#: Default cap on one encoded record. A sample of a few thousand tokens is a few tens of KB;
#: anything near this cap is a bug or an attack. Callers may pass their own cap.
DEFAULT_MAX_RECORD_BYTES = 64 * 1024 * 1024
#: Maps and arrays one record may hold: ``CONTAINERS_BASE`` and one per ``BYTES_PER_CONTAINER``
#: bytes of it (an empty one is a byte on the wire and some 60 in Python; a weight manifest, the
#: densest real record, holds about one per 50 bytes).
CONTAINERS_BASE = 1024
BYTES_PER_CONTAINER = 16

# dtype names on the wire -> numpy dtype (always little-endian). bfloat16 has no numpy
# dtype; it is carried as its raw 2-byte words and only torch-side code may view it.
_NP_DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype("<f8"),
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "int16": np.dtype("<i2"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
DTYPE_ITEMSIZE: dict[str, int] = {name: dt.itemsize for name, dt in _NP_DTYPES.items()}
DTYPE_ITEMSIZE["bfloat16"] = 2
WIRE_DTYPES = frozenset(DTYPE_ITEMSIZE)

assert sys.byteorder == "little", "the wire format assumes a little-endian host"


class WireError(ValueError):
    """Bytes or a record that do not form a valid message. The message says what was wrong."""


class _TooManyContainers(Exception):
    """Raised inside msgpack's hooks by :func:`unpack` (turned into a WireError there)."""


@functools.lru_cache(maxsize=64)
def _np_dtype_name(dtype: np.dtype) -> str:
    # cached: this runs for every tensor of every sample on the append hot path
    for name, dt in _NP_DTYPES.items():
        if dt == dtype.newbyteorder("<") or dt == dtype:
            return name
    raise WireError(f"dtype {dtype} cannot go on the wire; use one of {sorted(WIRE_DTYPES)}")


def encode_tensor(array: Any) -> dict[str, Any]:
    """Encode a numpy array (or anything ``np.asarray`` takes) as a wire tensor map."""
    arr = np.asarray(array)
    name = _np_dtype_name(arr.dtype)
    arr = np.ascontiguousarray(arr, dtype=_NP_DTYPES[name])
    return {"dtype": name, "shape": list(arr.shape), "data": arr.tobytes()}


def check_tensor_header(obj: Any, field: str) -> tuple[str, tuple[int, ...], bytes | bytearray]:
    """Validate a wire tensor map; return (dtype, shape, data). Shared with torch-side decoders."""
    if not isinstance(obj, Mapping):
        raise WireError(f"field {field!r}: expected a tensor map, got {type(obj).__name__}")
    for key in ("dtype", "shape", "data"):
        if key not in obj:
            raise WireError(f"field {field!r}: tensor map is missing {key!r}")
    dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if dtype not in WIRE_DTYPES:
        raise WireError(f"field {field!r}: unknown dtype {dtype!r}; expected one of {sorted(WIRE_DTYPES)}")
    if not isinstance(shape, (list, tuple)) or not all(type(d) is int and d >= 0 for d in shape):
        raise WireError(f"field {field!r}: shape must be a list of non-negative ints, got {shape!r}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"field {field!r}: tensor data must be bytes, got {type(data).__name__}")
    expected = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
    if len(data) != expected:
        raise WireError(
            f"field {field!r}: shape {list(shape)} of {dtype} needs {expected} bytes, got {len(data)}"
        )
    return dtype, tuple(shape), bytes(data) if isinstance(data, memoryview) else data


def decode_tensor(obj: Any, field: str = "tensor", dtype: str | None = None, ndim: int | None = None) -> np.ndarray:
    """Decode a wire tensor map into a read-only numpy array, checking dtype and rank if given."""
    name, shape, data = check_tensor_header(obj, field)
    if dtype is not None and name != dtype:
        raise WireError(f"field {field!r}: expected dtype {dtype}, got {name}")
    if ndim is not None and len(shape) != ndim:
        raise WireError(f"field {field!r}: expected {ndim} dimension(s), got shape {list(shape)}")
    if name == "bfloat16":
        raise WireError(f"field {field!r}: bfloat16 tensors can only be decoded to torch")
    return np.frombuffer(data, dtype=_NP_DTYPES[name]).reshape(shape)


def pack(obj: Mapping[str, Any]) -> bytes:
    """Serialise a map with msgpack (bin type for bytes, no extension types)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes | bytearray | memoryview, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> dict[str, Any]:
    """Parse untrusted msgpack bytes into a map, or raise WireError saying why not."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise WireError(f"record of {len(data)} bytes exceeds the cap of {max_bytes} bytes")
    if len(data) == 0:
        raise WireError("empty record")
    allowed = CONTAINERS_BASE + len(data) // BYTES_PER_CONTAINER
    left = allowed

    def count(container: Any) -> Any:  # called for every map and array as it is built
        nonlocal left
        left -= 1
        if left < 0:
            raise _TooManyContainers
        return container

    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_bin_len=max_bytes,
            max_str_len=max_bytes,
            max_array_len=max_bytes,
            max_map_len=max_bytes,
            max_ext_len=0,
            list_hook=count,
            object_hook=count,
        )
    except _TooManyContainers:
        raise WireError(f"record of {len(data)} bytes holds more than {allowed} maps and arrays "
                        f"({CONTAINERS_BASE} and one per {BYTES_PER_CONTAINER} bytes)") from None
    except msgpack.ExtraData as exc:
        raise WireError(f"record has {len(exc.extra)} trailing bytes after the msgpack object") from None
    except (msgpack.OutOfData, ValueError) as exc:
        if isinstance(exc, msgpack.OutOfData) or "truncated" in str(exc).lower() or "Unpack failed" in str(exc):
            raise WireError(f"truncated or malformed msgpack ({len(data)} bytes): {exc}") from None
        raise WireError(f"malformed msgpack: {exc}") from None
    except Exception as exc:  # msgpack raises a zoo of types on garbage (TypeError, FormatError, ...)
        raise WireError(f"malformed msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise WireError(f"a record must be a msgpack map, got {type(obj).__name__}")
    return obj


def encode_record(kind: str, fields: Mapping[str, Any]) -> bytes:
    """Wrap ``fields`` in the envelope (schema version + kind) and serialise."""
    return pack({"schema_version": SCHEMA_VERSION, "kind": kind, **fields})


def decode_record(
    data: bytes | bytearray | memoryview,
    kind: str | tuple[str, ...],
    max_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> dict[str, Any]:
    """Parse and check the envelope of an untrusted record; return its map.

    ``kind`` is the expected kind (or a tuple of accepted kinds).
    """
    obj = unpack(data, max_bytes=max_bytes)
    version = obj.get("schema_version")
    if version is None:
        raise WireError("record has no 'schema_version'")
    if version not in READABLE_SCHEMA_VERSIONS or isinstance(version, bool):
        raise WireError(
            f"schema_version {version!r} is not supported (this build reads "
            f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}); "
            "upgrade the older side so producers and consumers run the same release"
        )
    got = obj.get("kind")
    accepted = (kind,) if isinstance(kind, str) else kind
    if got not in accepted:
        raise WireError(f"expected a record of kind {' or '.join(accepted)!s}, got kind {got!r}")
    return obj


def require(obj: Mapping[str, Any], field: str, types: type | tuple[type, ...]) -> Any:
    """Fetch a required field of a decoded record with a type check, or raise WireError."""
    if field not in obj:
        raise WireError(f"{obj.get('kind', 'record')} record is missing field {field!r}")
    value = obj[field]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        names = "/".join(t.__name__ for t in _as_tuple(types))
        raise WireError(f"field {field!r}: expected {names}, got {type(value).__name__}")
    return value


def optional(obj: Mapping[str, Any], field: str, types: type | tuple[type, ...], default: Any = None) -> Any:
    """Like :func:`require` but a missing or nil field gives ``default``."""
    if obj.get(field) is None:
        return default
    return require(obj, field, types)


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)
