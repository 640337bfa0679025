"""The learner's side: publish a version of named tensors to the weight server.

``publish`` hashes every tensor, sends PUB_BEGIN with the manifest, then the bytes: PUB_CHUNKs of
zero-copy frames (small tensors packed together), bounded by the socket's high-water mark, or on
the same host a copy into the upload's slab file the server offered (:mod:`weight_server.protocol`
tells both). A publish that fails for want of the server is retried whole with backoff for
``retry_timeout_s``; a retry of a version that did land is recognised by its hash.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from rlhf_core.config import ConfigError, WeightServerConfig
from rlhf_core.retry import Backoff
from rlhf_core.wire import WireError
from weight_server import protocol as P
from weight_server.client import Channel, Client, NoReply
from weight_server.errors import StaleVersionError, WeightIntegrityError, WeightServerError, WeightServerUnavailable
from weight_server.shm_map import ShmUnavailable, copy_bytes
from weight_server.tensors import TORCH_TO_WIRE, byte_view, named_tensors, transfer_dtype

log = logging.getLogger(__name__)

SMALL_TENSOR_BYTES = 64 * 1024  # tensors below this are packed together (copied) instead of one frame each
_MAX_BACKOFF_S = 5.0
_RETRYABLE = (P.E_HASH, P.E_INCOMPLETE, P.E_BAD_CHUNK, P.E_UNKNOWN_UPLOAD)


@dataclass(frozen=True)
class PublishStats:
    name: str
    version: int
    bytes: int  # tensor bytes in the transfer dtype
    wire_bytes: int  # bytes actually sent (less than `bytes` for a delta publish)
    tensors: int
    changed_tensors: int
    duration_s: float  # from the call to the server's commit reply
    content_hash: str
    retries: int
    duplicate: bool  # the server already held this exact version (a retry whose first reply was lost)
    via: str = "tcp"  # how the bytes went: "shm" (into the server's shared memory), "tcp", or "none" (duplicate)


class _DeltaRefused(Exception):
    pass


class _Transient(Exception):
    pass


class _Busy(Exception):
    """The server's upload budget is held by other uploads: retried until they finish or expire."""


class WeightPublisher(Client):
    """Publishes versions to the server at ``address``. Not thread-safe (one per thread)."""

    def __init__(self, address: str, cfg: WeightServerConfig | None = None, ctx: zmq.Context | None = None) -> None:
        cfg = cfg or WeightServerConfig()
        if cfg.chunk_bytes > cfg.max_frame_bytes:
            raise ConfigError(f"weight_server.chunk_bytes {cfg.chunk_bytes} exceeds max_frame_bytes {cfg.max_frame_bytes}")
        super().__init__(cfg, ctx)
        try:
            self.channel = Channel(address, self.cfg, self.ctx)
        except BaseException:
            self._release()
            raise
        # name -> (version, layout signature, tensor hashes) of the last successful publish (delta base)
        self._last: dict[str, tuple[int, tuple, list[bytes]]] = {}
        self._scratch: dict[str, torch.Tensor] = {}

    def _close_sockets(self) -> None:
        self.channel.close()

    def latest_version(self, name: str = "policy") -> int | None:
        """The newest version the server holds (None: none yet). Retries while the server is down."""
        rep = self._with_retries(lambda: self.channel.request(P.LATEST, name=name), f"asking for the latest {name!r}")
        return rep.get("version")

    def publish(
        self, version: int, tensors: Any, name: str = "policy", dtype: torch.dtype | str | None = None, delta: bool = False,
    ) -> PublishStats:
        """Publish ``tensors`` (mapping, (name, tensor) pairs, or nn.Module) as ``version``; ``dtype``
        casts floating tensors for transfer, ``delta`` sends only those whose hash changed since the
        previous version. StaleVersionError when ``version`` is not newer than the newest held."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        t0 = time.monotonic()
        tdtype = transfer_dtype(dtype)
        wire = [(n, self._wire_tensor(n, t, tdtype)) for n, t in named_tensors(tensors)]
        views = [byte_view(t) for _, t in wire]
        hashes = [P.tensor_hash(v) for v in views]
        layout = P.make_layout([(n, TORCH_TO_WIRE[t.dtype], tuple(t.shape)) for n, t in wire], hashes)
        if len(layout.tensors) > self.cfg.max_tensors:
            raise ConfigError(f"{len(layout.tensors)} tensors exceed weight_server.max_tensors {self.cfg.max_tensors}")
        base, changed = None, None
        last = self._last.get(name)
        if delta and last is not None and last[0] < version and last[1] == layout.signature():
            base, changed = last[0], [i for i, (h, old) in enumerate(zip(hashes, last[2])) if h != old]
        attempts = 0

        def attempt() -> dict[str, Any]:
            nonlocal attempts, base, changed
            attempts += 1
            try:
                return self._attempt(name, version, layout, views, base, changed)
            except _DeltaRefused:
                log.info("delta publish of %s v%d refused (base v%s not held); sending the full version", name, version, base)
                base, changed = None, None
                return self._attempt(name, version, layout, views, None, None)

        rep = self._with_retries(attempt, f"publishing {name!r} v{version}")
        self._last[name] = (version, layout.signature(), hashes)
        stats = PublishStats(
            name=name, version=version, bytes=layout.data_bytes, wire_bytes=int(rep.get("wire_bytes", 0)),
            tensors=len(layout.tensors), changed_tensors=len(layout.tensors) if changed is None else len(changed),
            duration_s=time.monotonic() - t0, content_hash=layout.content_hash().hex(), retries=attempts - 1,
            duplicate=bool(rep.get("duplicate")), via=rep.get("via", "none"),
        )
        log.debug("published %s", stats)
        return stats

    def _wire_tensor(self, name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        t = t.detach()
        target = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if t.device.type == "cpu" and t.dtype == target and t.is_contiguous():
            return t  # zero-copy: its bytes go on the wire as they are
        # A reused scratch buffer per tensor: fresh pages cost more than the copy itself.
        buf = self._scratch.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != target:
            buf = torch.empty(t.shape, dtype=target, pin_memory=t.device.type == "cuda")
            self._scratch[name] = buf
        buf.copy_(t)  # a GPU->CPU sync point when t lives on the GPU
        return buf

    def _attempt(
        self, name: str, version: int, layout: P.Layout, views: list[memoryview], base: int | None, changed: list[int] | None,
    ) -> dict[str, Any]:
        rep = self.channel.request(
            P.PUB_BEGIN, name=name, version=version, tensors=[t.to_wire() for t in layout.tensors],
            content_hash=layout.content_hash(), delta_base=base, changed=changed, shm=self._maps is not None,
        )
        if rep["kind"] == P.PUB_DONE:
            return rep  # the server already holds exactly this version
        if rep["kind"] == P.ERROR:
            code, message = _refusal(rep)
            if code == P.E_BAD_DELTA and base is not None:
                raise _DeltaRefused(message)
            if code == P.E_BUSY:  # other uploads hold the server's upload budget until they finish or expire
                raise _Busy(message)
            raise WeightServerError(f"publish of {name!r} v{version} refused: {message}", code)
        if rep["kind"] != P.PUB_READY or not isinstance(rep.get("upload"), int):
            raise WeightServerError(f"unexpected reply {rep['kind']} to PUB_BEGIN from {self.channel.address}", P.E_MALFORMED)
        upload = rep["upload"]
        indices = changed if changed is not None else range(len(layout.tensors))
        via_shm = self._copy_to_shm(rep, upload, layout, views, indices)
        if not via_shm:
            for seq, (segments, frames) in enumerate(plan_chunks(layout, views, indices, self.cfg.chunk_bytes)):
                self.channel.send(P.PUB_CHUNK, data=frames, upload=upload, seq=seq, segments=segments)
        # The server re-hashes every byte before answering: allow for it beyond the usual timeout.
        rep = self.channel.request(
            P.PUB_COMMIT, timeout_s=self.cfg.request_timeout_s + layout.total_bytes / 1e9, upload=upload, shm=via_shm,
        )
        if rep["kind"] == P.ERROR:
            code, message = _refusal(rep)
            if code in _RETRYABLE:
                raise _Transient(f"{code}: {message}")
            raise WeightServerError(f"publish of {name!r} v{version} failed: {message}", code)
        if rep["kind"] != P.PUB_DONE:
            raise WeightServerError(f"unexpected reply {rep['kind']} to PUB_COMMIT from {self.channel.address}", P.E_MALFORMED)
        rep["via"] = "shm" if via_shm else "tcp"
        return rep

    def _copy_to_shm(self, ready: dict[str, Any], upload: int, layout: P.Layout, views: list[memoryview], indices: Any) -> bool:
        """Copy the tensors into the upload's slab file, when offered one this process can prove is
        the server's, with a data-less PUB_CHUNK every ``chunk_bytes`` or so. False: send chunks."""
        if self._maps is None:
            return False
        try:
            offer = P.parse_shm_offer(ready, "shm", layout.total_bytes, leased=False)
        except WireError as exc:
            log.warning("ignoring a malformed shared-memory offer from %s: %s; sending over TCP", self.channel.address, exc)
            return False
        if offer is None:
            return False
        try:
            slab = self._maps.open(offer, writable=True)
        except ShmUnavailable as exc:
            self._maps.warn_once("publisher", offer, exc)
            return False
        segments: list[list[int]] = []
        pending, seq = 0, 0
        for i in indices:
            t = layout.tensors[i]
            if not t.nbytes:
                continue
            copy_bytes(slab[t.offset : t.offset + t.nbytes], views[i])
            segments.append([t.offset, t.nbytes])
            pending += t.nbytes
            if pending >= self.cfg.chunk_bytes or len(segments) >= P.MAX_SEGMENTS:
                self.channel.send(P.PUB_CHUNK, upload=upload, seq=seq, segments=segments, shm=True)
                segments, pending, seq = [], 0, seq + 1
        if segments:
            self.channel.send(P.PUB_CHUNK, upload=upload, seq=seq, segments=segments, shm=True)
        return True

    def _with_retries(self, fn: Any, what: str) -> dict[str, Any]:
        backoff = Backoff(0.1, _MAX_BACKOFF_S, self.cfg.retry_timeout_s)
        integrity_failures = 0
        while True:
            try:
                return fn()
            except (NoReply, _Transient, _Busy) as exc:
                if isinstance(exc, _Transient):
                    integrity_failures += 1
                    if integrity_failures >= 3:
                        raise WeightIntegrityError(f"{what}: the server rejected the bytes {integrity_failures} times ({exc})") from None
                self.channel.reset()  # drop anything queued for the dead connection
                delay = backoff.next_delay()
                if delay is None and isinstance(exc, _Busy):
                    raise WeightServerError(f"{what}: the server stayed busy for {self.cfg.retry_timeout_s:g} s "
                                            f"(weight_server.retry_timeout_s): {exc}", P.E_BUSY) from None
                if delay is None:
                    raise WeightServerUnavailable(
                        f"{what}: no answer from the weight server at {self.channel.address} for "
                        f"{self.cfg.retry_timeout_s:g} s (weight_server.retry_timeout_s); is `rlhf-weight-server` running there?"
                    ) from None
                log.warning("%s: %s; retrying in %.1f s", what, exc, delay)
                time.sleep(delay)


def _refusal(rep: dict[str, Any]) -> tuple[str, str]:
    """An ERROR reply's code and message; :class:`StaleVersionError` for a stale version."""
    code, message = P.error_code(rep), str(rep.get("message"))
    if code == P.E_STALE:
        raise StaleVersionError(f"publish refused: {message}")
    return code, message


def plan_chunks(
    layout: P.Layout, views: Sequence[memoryview], indices: Any, chunk_bytes: int, small: int = SMALL_TENSOR_BYTES,
) -> Iterator[tuple[list[list[int]], list[Any]]]:
    """Split the bytes of tensors ``indices`` into chunks of at most ``chunk_bytes``: yields
    ``(segments, frames)``, a ``[offset, length]`` of the flat layout per data frame. Large tensors
    go as zero-copy slices, runs of small neighbours packed (with their padding) into one frame."""
    segments: list[list[int]] = []
    frames: list[Any] = []
    size = 0
    pack: bytearray | None = None
    pack_start = 0

    def add(offset: int, frame: Any) -> Iterator[tuple[list[list[int]], list[Any]]]:
        nonlocal segments, frames, size
        n = len(frame)
        if frames and size + n > chunk_bytes:
            yield segments, frames
            segments, frames, size = [], [], 0
        segments.append([offset, n])
        frames.append(frame)
        size += n

    for i in indices:
        spec = layout.tensors[i]
        if spec.nbytes == 0:
            continue
        view = views[i]
        if spec.nbytes < small:
            end = pack_start + len(pack) if pack is not None else -1
            if pack is not None and 0 <= spec.offset - end < P.ALIGN and spec.offset + spec.nbytes - pack_start <= chunk_bytes:
                pack.extend(bytes(spec.offset - end))
                pack.extend(view)
                continue
            if pack is not None:
                yield from add(pack_start, pack)
            pack, pack_start = bytearray(view), spec.offset
            continue
        if pack is not None:
            yield from add(pack_start, pack)
            pack = None
        for start in range(0, spec.nbytes, chunk_bytes):
            yield from add(spec.offset + start, view[start : start + chunk_bytes])
    if pack is not None:
        yield from add(pack_start, pack)
    if frames:
        yield segments, frames
