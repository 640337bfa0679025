"""The weight-server wire protocol: message kinds, the byte layout of a version, its content hash.

Every message is a multipart ZeroMQ message ``[header, *data, (mac)]``:

``header`` is one :mod:`rlhf_core.wire` record, capped at ``max_header_bytes`` (``max_manifest_bytes``
for :data:`MANIFEST_KINDS`); ``data`` raw tensor bytes, never serialised; ``mac`` (``auth=hmac``
only) an HMAC-SHA256 over the preceding frames (``auth.Signer``).

Client -> server (DEALER -> ROUTER); every request carries ``rid`` and its reply echoes it::

    LATEST      {rid, name}                                  -> LATEST_REP {rid, name, version, versions, content_hash}
    PUB_BEGIN   {rid, name, version, tensors: [[name, dtype, shape, hash16]], content_hash,
                 delta_base: int|nil, changed: [index]|nil, shm: bool}
                                                             -> PUB_READY {rid, upload, shm: offer|nil} | PUB_DONE (same
                                                                version and hash already held) | ERROR
    PUB_CHUNK   {upload, seq, segments: [[offset, length]], shm: bool} + one frame per segment (none
                 with shm: the publisher wrote those bytes into the offered slab file)
                                                             -> nothing (ERROR only if it is refused)
    PUB_COMMIT  {rid, upload, shm: bool}                     -> PUB_DONE {rid, name, version, bytes,
                                                                wire_bytes, duration_s, content_hash} | ERROR
    MANIFEST_REQ{rid, name, version: int|nil, pending: bool, shm: bool}
                                                             -> MANIFEST {rid, name, version, tensors, content_hash,
                                                                total_bytes, chunk_bytes, pending, shm: offer|nil} | ERROR
    FETCH       {rid, name, version, chunk, shm: bool}       -> CHUNK {rid, version, chunk, offset, shm} + 1 frame
                                                                (none with shm: the bytes are in the slab file) | ERROR
    WAIT_COMMIT {rid, name, version}                         -> COMMITTED {rid, name, version, content_hash}
                                                                once the version is visible | ERROR (aborted)
    SHM_RELEASE {rid, lease, via: "shm"|"tcp"|nil}           -> SHM_RELEASED {rid, lease} | ERROR (unknown_lease)
                (via: how the pull got its bytes after the offer; nil: none)
    APPLIED     {name, version, worker, apply_s, lease: int|nil}
                                                             -> nothing (a metric; releases ``lease`` as SHM_RELEASE via shm)
    METRICS_REQ {rid}                                        -> METRICS {rid, metrics}

Server -> subscribers (PUB -> SUB), topic frame = the parameter-set name::

    ANNOUNCE    {name, version, content_hash, total_bytes, pending}
                pending=false: the version is visible (re-sent every announce_interval_s);
                pending=true: an upload of it has started (sent once, at PUB_BEGIN)

A version is one flat byte range: tensors in name order, each starting at a multiple of
:data:`ALIGN` bytes; pulls fetch it in ``chunk_bytes`` pieces with at most
``max_inflight_chunks`` FETCHes outstanding (credit-based flow control). Cut-through: a follower
may FETCH a *pending* upload's chunks as they arrive (answered when the bytes are in) and applies
nothing before its own hash check and COMMITTED. Shared memory (same host, ``shm: true``): a
client may be offered the slab file (:class:`ShmOffer`), trusted only once it read the same token
bytes from the server's token file; a puller's offer carries a lease, released with SHM_RELEASE
(or APPLIED) and expired after ``lease_s``. docs/architecture.md (Weight server) tells the rest.
"""

from __future__ import annotations

import math
import posixpath
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from rlhf_core.wire import DTYPE_ITEMSIZE, WIRE_DTYPES, WireError, decode_record, encode_record, optional, require

# Client -> server.
LATEST = "ws.latest"
PUB_BEGIN = "ws.pub_begin"
PUB_CHUNK = "ws.pub_chunk"
PUB_COMMIT = "ws.pub_commit"
MANIFEST_REQ = "ws.manifest_req"
FETCH = "ws.fetch"
APPLIED = "ws.applied"
METRICS_REQ = "ws.metrics_req"
WAIT_COMMIT = "ws.wait_commit"
SHM_RELEASE = "ws.shm_release"
CLIENT_KINDS = (LATEST, PUB_BEGIN, PUB_CHUNK, PUB_COMMIT, MANIFEST_REQ, FETCH, APPLIED, METRICS_REQ, WAIT_COMMIT, SHM_RELEASE)

# Server -> client.
LATEST_REP = "ws.latest_rep"
PUB_READY = "ws.pub_ready"
PUB_DONE = "ws.pub_done"
MANIFEST = "ws.manifest"
CHUNK = "ws.chunk"
METRICS = "ws.metrics"
COMMITTED = "ws.committed"
SHM_RELEASED = "ws.shm_released"
ERROR = "ws.error"
SERVER_KINDS = (LATEST_REP, PUB_READY, PUB_DONE, MANIFEST, CHUNK, METRICS, COMMITTED, SHM_RELEASED, ERROR)

# Server -> subscribers.
ANNOUNCE = "ws.announce"

#: Kinds whose header carries a whole tensor list; they may use up to ``max_manifest_bytes``.
MANIFEST_KINDS = frozenset({PUB_BEGIN, MANIFEST})

# Error codes of ERROR replies.
E_MALFORMED = "malformed"
E_TOO_LARGE = "too_large"
E_AUTH = "auth"
E_STALE = "stale_version"
E_NOT_FOUND = "not_found"
E_BAD_DELTA = "bad_delta_base"
E_UNKNOWN_UPLOAD = "unknown_upload"
E_BAD_CHUNK = "bad_chunk"
E_HASH = "hash_mismatch"
E_INCOMPLETE = "incomplete"
E_ABORTED = "aborted"
E_UNKNOWN_LEASE = "unknown_lease"
E_INTERNAL = "internal"  # the server failed on the request (a bug, or the host out of something): see its log
E_BUSY = "busy"  # too many uploads (or bytes of them) in progress: retry after the others finish or expire

ALIGN = 64
HASH_BYTES = 16
MAX_NAME_CHARS = 1024
MAX_NDIM = 16
MAX_SEGMENTS = 4096

# Shared memory: the server's folder is <shm_dir>/rlhf-ws-<pid>-<random>/ holding `token` and slab-<n> files.
SHM_DIR_PREFIX = "rlhf-ws-"
SHM_TOKEN_FILE = "token"
SHM_SLAB_PREFIX = "slab-"
SHM_TOKEN_BYTES = 32
MAX_PATH_CHARS = 4096
RELEASE_VIA = ("shm", "tcp", None)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a version: its bytes are ``[offset, offset + nbytes)`` of the flat layout."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int
    hash: bytes = b""

    def to_wire(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.hash]


@dataclass(frozen=True)
class Layout:
    """The flat byte layout of a version: tensors in name order, aligned to :data:`ALIGN` bytes."""

    tensors: tuple[TensorSpec, ...]
    total_bytes: int

    @property
    def data_bytes(self) -> int:
        """Bytes of tensor data (the layout without alignment padding)."""
        return sum(t.nbytes for t in self.tensors)

    def signature(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """Names, dtypes and shapes: two layouts with equal signatures have identical offsets."""
        return tuple((t.name, t.dtype, t.shape) for t in self.tensors)

    def hashes(self) -> list[bytes]:
        return [t.hash for t in self.tensors]

    def with_hashes(self, hashes: Sequence[bytes]) -> Layout:
        specs = tuple(TensorSpec(t.name, t.dtype, t.shape, t.nbytes, t.offset, h) for t, h in zip(self.tensors, hashes))
        return Layout(specs, self.total_bytes)

    def content_hash(self) -> bytes:
        return content_hash(self.tensors)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def make_layout(entries: Iterable[tuple[str, str, Sequence[int]] | Sequence[Any]], hashes: Sequence[bytes] | None = None) -> Layout:
    """Compute offsets for ``(name, dtype, shape)`` entries (already in strictly increasing name order)."""
    specs: list[TensorSpec] = []
    offset = 0
    for i, entry in enumerate(entries):
        name, dtype, shape = entry[0], entry[1], tuple(int(d) for d in entry[2])
        nbytes = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
        specs.append(TensorSpec(name, dtype, shape, nbytes, offset, hashes[i] if hashes is not None else b""))
        offset = align(offset + nbytes)
    return Layout(tuple(specs), offset)


def chunk_count(total_bytes: int, chunk_bytes: int) -> int:
    return max(1, -(-total_bytes // chunk_bytes)) if total_bytes else 0


def chunk_range(index: int, total_bytes: int, chunk_bytes: int) -> tuple[int, int]:
    """(offset, length) of pull chunk ``index``."""
    start = index * chunk_bytes
    return start, min(chunk_bytes, total_bytes - start)


def chunks_covering(layout: Layout, indices: Iterable[int], chunk_bytes: int) -> list[int]:
    """The pull chunks that hold any byte of the tensors ``indices`` (sorted)."""
    needed: set[int] = set()
    for i in indices:
        t = layout.tensors[i]
        if t.nbytes:
            needed.update(range(t.offset // chunk_bytes, (t.offset + t.nbytes - 1) // chunk_bytes + 1))
    return sorted(needed)


@dataclass(frozen=True)
class ShmOffer:
    """Where an upload's or a version's bytes lie in shared memory: ``[offset, offset + size)`` of
    the file ``path``; ``token`` must equal the bytes of ``token_path`` before any of it is trusted.
    ``lease`` (pulls only) is released with SHM_RELEASE; the server expires it after ``lease_s``."""

    path: str
    offset: int
    size: int
    token_path: str
    token: bytes
    lease: int | None = None
    lease_s: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        return {
            "path": self.path, "offset": self.offset, "size": self.size, "token_path": self.token_path,
            "token": self.token, "lease": self.lease, "lease_s": self.lease_s,
        }


def lease_seconds(request_timeout_s: float, nbytes: int) -> float:
    """How long a pull may hold its lease: a reply timeout plus the bytes at 1 GB/s."""
    return request_timeout_s + nbytes / 1e9


def parse_shm_offer(obj: dict[str, Any], field: str, total_bytes: int, leased: bool) -> ShmOffer | None:
    """Validate the shape of the ``shm`` field of a PUB_READY (``leased=False``) or MANIFEST
    (``leased=True``): a slab file of a server's folder, beside its token file."""
    raw = obj.get(field)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise WireError(f"field {field!r} must be a map, got {type(raw).__name__}")
    path, token_path = require(raw, "path", str), require(raw, "token_path", str)
    for name, value in (("path", path), ("token_path", token_path)):
        if not (0 < len(value) <= MAX_PATH_CHARS and posixpath.isabs(value)) or posixpath.normpath(value) != value:
            raise WireError(f"{field}.{name} must be a normalised absolute path of at most {MAX_PATH_CHARS} characters")
    folder = posixpath.dirname(path)
    if (
        posixpath.dirname(token_path) != folder
        or posixpath.basename(token_path) != SHM_TOKEN_FILE
        or not posixpath.basename(folder).startswith(SHM_DIR_PREFIX)
        or not posixpath.basename(path).startswith(SHM_SLAB_PREFIX)
    ):
        raise WireError(f"{field}: {path!r} is not a slab file beside the token of a weight-server folder")
    offset, size = req_int(raw, "offset"), req_int(raw, "size")
    if size != total_bytes:
        raise WireError(f"{field}.size {size} does not match the version's {total_bytes} bytes")
    token = require(raw, "token", bytes)
    if len(token) != SHM_TOKEN_BYTES:
        raise WireError(f"{field}.token must be {SHM_TOKEN_BYTES} bytes, got {len(token)}")
    lease = optional_int(raw, "lease")
    if leased and lease is None:
        raise WireError(f"{field}: an offer to a puller must carry a lease")
    lease_s = float(optional(raw, "lease_s", (int, float), 0.0))
    return ShmOffer(path, offset, size, token_path, token, lease, lease_s)


def tensor_hash(data: Any) -> bytes:
    """xxh3-128 of one tensor's bytes (a buffer: bytes, memoryview, numpy array)."""
    return xxhash.xxh3_128_digest(data)


def tensor_hasher() -> Any:
    """A streaming form of :func:`tensor_hash` (``update`` piece by piece, then ``digest``)."""
    return xxhash.xxh3_128()


def content_hash(tensors: Iterable[TensorSpec]) -> bytes:
    """The hash of a version: xxh3-128 over the length-prefixed (name, dtype, shape, tensor hash) of every tensor."""
    h = xxhash.xxh3_128()
    for t in tensors:
        name = t.name.encode()
        h.update(struct.pack("<I", len(name)) + name)
        h.update(struct.pack("<B", len(t.dtype)) + t.dtype.encode())
        h.update(struct.pack(f"<B{len(t.shape)}Q", len(t.shape), *t.shape))
        h.update(t.hash)
    return h.digest()


# Headers: encode, and decode untrusted bytes with caps.


def encode(kind: str, **fields: Any) -> bytes:
    return encode_record(kind, fields)


def decode(data: bytes | memoryview, kinds: Sequence[str], max_header_bytes: int, max_manifest_bytes: int) -> dict[str, Any]:
    """Decode one header frame, enforcing the size caps; raises WireError saying what was wrong."""
    size = len(data)
    cap = max(max_header_bytes, max_manifest_bytes)
    if size > cap:
        raise WireError(f"header of {size} bytes exceeds the cap of {cap} bytes (max_manifest_bytes)")
    obj = decode_record(data, tuple(kinds), max_bytes=cap)
    if size > max_header_bytes and obj["kind"] not in MANIFEST_KINDS:
        raise WireError(f"{obj['kind']} header of {size} bytes exceeds max_header_bytes {max_header_bytes}")
    return obj


def error_code(obj: dict[str, Any]) -> str:
    return str(obj.get("code", "error"))


def req_int(obj: dict[str, Any], field: str, minimum: int = 0) -> int:
    value = require(obj, field, int)
    if value < minimum:
        raise WireError(f"field {field!r} must be >= {minimum}, got {value}")
    return value


def req_name(obj: dict[str, Any], field: str = "name") -> str:
    value = require(obj, field, str)
    if not 0 < len(value) <= MAX_NAME_CHARS:
        raise WireError(f"field {field!r} must be 1-{MAX_NAME_CHARS} characters, got {len(value)}")
    return value


def req_hash(obj: dict[str, Any], field: str) -> bytes:
    value = require(obj, field, bytes)
    if len(value) != HASH_BYTES:
        raise WireError(f"field {field!r} must be {HASH_BYTES} bytes, got {len(value)}")
    return value


def parse_tensor_list(obj: dict[str, Any], field: str, max_tensors: int, max_version_bytes: int) -> Layout:
    """Validate a ``[[name, dtype, shape, hash16], ...]`` list and lay it out."""
    items = require(obj, field, list)
    if len(items) > max_tensors:
        raise WireError(f"{len(items)} tensors exceed max_tensors {max_tensors}")
    entries: list[tuple[str, str, tuple[int, ...]]] = []
    hashes: list[bytes] = []
    prev = None
    for i, item in enumerate(items):
        if not isinstance(item, list) or len(item) != 4:
            raise WireError(f"{field}[{i}] must be [name, dtype, shape, hash], got {type(item).__name__}")
        name, dtype, shape, digest = item
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise WireError(f"{field}[{i}]: tensor name must be a string of 1-{MAX_NAME_CHARS} characters")
        if prev is not None and name <= prev:
            raise WireError(f"{field}[{i}]: tensor names must be unique and sorted; {name!r} follows {prev!r}")
        prev = name
        if dtype not in WIRE_DTYPES:
            raise WireError(f"{field}[{i}] ({name}): unknown dtype {dtype!r}; expected one of {sorted(WIRE_DTYPES)}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**48 for d in shape)
        ):
            raise WireError(f"{field}[{i}] ({name}): shape must be a list of at most {MAX_NDIM} non-negative ints")
        if not isinstance(digest, bytes) or len(digest) != HASH_BYTES:
            raise WireError(f"{field}[{i}] ({name}): hash must be {HASH_BYTES} bytes")
        entries.append((name, dtype, tuple(shape)))
        hashes.append(digest)
    layout = make_layout(entries, hashes)
    if layout.total_bytes > max_version_bytes:
        raise WireError(f"version of {layout.total_bytes} bytes exceeds max_version_bytes {max_version_bytes}")
    return layout


def parse_segments(obj: dict[str, Any], total_bytes: int) -> list[tuple[int, int]]:
    """Validate the ``segments`` of a PUB_CHUNK: in-bounds, increasing, non-overlapping."""
    items = require(obj, "segments", list)
    if not 0 < len(items) <= MAX_SEGMENTS:
        raise WireError(f"a chunk must have 1-{MAX_SEGMENTS} segments, got {len(items)}")
    out: list[tuple[int, int]] = []
    end = -1
    for item in items:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in item)
        ):
            raise WireError("each segment must be [offset, length] (two ints)")
        offset, length = item
        if offset < 0 or length <= 0 or offset + length > total_bytes:
            raise WireError(f"segment [{offset}, {length}] lies outside the version's {total_bytes} bytes")
        if offset < end:
            raise WireError(f"segment at {offset} overlaps or precedes the previous one (ends at {end})")
        end = offset + length
        out.append((offset, length))
    return out


def manifest_fields(layout: Layout) -> dict[str, Any]:
    return {
        "tensors": [t.to_wire() for t in layout.tensors],
        "content_hash": layout.content_hash(),
        "total_bytes": layout.total_bytes,
    }


def optional_int(obj: dict[str, Any], field: str) -> int | None:
    value = optional(obj, field, int)
    if value is not None and value < 0:
        raise WireError(f"field {field!r} must be >= 0, got {value}")
    return value
