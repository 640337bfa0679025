"""The server's request handlers: what each client message does to the store and what it answers.

Socket-free: replies go through a :class:`Replies` port. A handler raises ``WireError`` for an
invalid request and ``Refused`` for one the store declines; the server answers both with ERROR.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from rlhf_core.config import WeightServerConfig
from rlhf_core.wire import WireError, optional, require
from weight_server import protocol as P
from weight_server.metrics import ServerMetrics
from weight_server.shm import Leases, ShmDir
from weight_server.slabs import Slab
from weight_server.store import Refused, Upload, Version, VersionStore

log = logging.getLogger("weight_server")

MAX_PARKED = 4096  # fetches waiting for an upload's bytes; each honest follower parks <= max_inflight_chunks
_REFUSAL_COUNTERS = {P.E_STALE: "stale_refused", P.E_HASH: "hash_mismatch", P.E_INCOMPLETE: "incomplete",
                     P.E_BUSY: "uploads_refused"}

Handler = Callable[[bytes, dict[str, Any]], None]


class Replies(Protocol):
    def send(self, ident: bytes, header: bytes, data: memoryview | None = None, slab: Any = None) -> None: ...

    def error(self, ident: bytes, rid: Any, code: str, message: str) -> None: ...

    def announce(self, item: Version | Upload, pending: bool = False) -> None: ...


class Handlers:
    def __init__(
        self, cfg: WeightServerConfig, store: VersionStore, metrics: ServerMetrics, replies: Replies,
        on_commit: Callable[[Version], None], snapshot: Callable[[], dict[str, Any]], shm: ShmDir | None = None,
    ) -> None:
        self.cfg = cfg
        self.shm = shm  # None: shm=off, or no usable shm folder; every byte goes over TCP
        self.leases = Leases()
        self.store = store
        self.metrics = metrics
        self.out = replies
        self.on_commit = on_commit
        self.snapshot = snapshot
        self.table: dict[str, Handler] = {
            P.LATEST: self.latest, P.PUB_BEGIN: self.pub_begin, P.PUB_COMMIT: self.pub_commit,
            P.MANIFEST_REQ: self.manifest_req, P.FETCH: self.fetch, P.WAIT_COMMIT: self.wait_commit,
            P.APPLIED: self.applied, P.METRICS_REQ: self.metrics_req, P.SHM_RELEASE: self.shm_release,
        }

    def refused(self, ident: bytes, obj: dict[str, Any], exc: Refused) -> None:
        counter = _REFUSAL_COUNTERS.get(exc.code)
        if counter:
            self.metrics.count(counter)
        # a subscriber asking for the newest version before the first is published (every run's start) is no fault
        quiet = exc.code == P.E_NOT_FOUND and obj.get("version") is None
        log.log(logging.INFO if quiet else logging.WARNING, "refused %s: %s", obj["kind"], exc)
        self.out.error(ident, obj.get("rid"), exc.code, str(exc))

    def latest(self, ident: bytes, obj: dict[str, Any]) -> None:
        name = P.req_name(obj)
        ver = self.store.newest(name)
        self.out.send(ident, P.encode(
            P.LATEST_REP, rid=obj.get("rid"), name=name, version=ver.version if ver else None,
            versions=self.store.held().get(name, []), content_hash=ver.content_hash if ver else None,
        ))

    def pub_begin(self, ident: bytes, obj: dict[str, Any]) -> None:
        name, version = P.req_name(obj), P.req_int(obj, "version")
        layout = P.parse_tensor_list(obj, "tensors", self.cfg.max_tensors, self.cfg.max_version_bytes)
        content = P.req_hash(obj, "content_hash")
        delta_base = P.optional_int(obj, "delta_base")
        changed = optional(obj, "changed", list)
        if changed is not None and not all(isinstance(i, int) and not isinstance(i, bool) for i in changed):
            raise WireError("field 'changed' must be a list of tensor indices")
        want_shm = optional(obj, "shm", bool, False)
        result = self.store.begin(name, version, layout, content, delta_base, changed)
        if isinstance(result, Version):
            self.metrics.count("duplicate_publishes")
            self.out.send(ident, self._done_header(obj.get("rid"), result, wire_bytes=0, duplicate=True))
            return
        offer = self.shm.offer(result.slab, layout.total_bytes) if want_shm and self.shm is not None else None
        if offer is not None:
            self.store.offer_shm(result.id, P.lease_seconds(self.cfg.request_timeout_s, layout.total_bytes))
        self.out.send(ident, P.encode(
            P.PUB_READY, rid=obj.get("rid"), upload=result.id, shm=offer.to_wire() if offer is not None else None,
        ))
        self.out.announce(result, pending=True)  # followers may start fetching now (cut-through)

    def chunk_arrived(self, up: Upload) -> None:
        """Answer the parked fetches whose bytes are now all in (cut-through)."""
        still = []
        for peer, rid, index, notice in up.parked:
            offset, length = P.chunk_range(index, up.layout.total_bytes, self.cfg.chunk_bytes)
            if up.has(offset + length):
                self._send_chunk(peer, rid, up.name, up.version, index, up.slab, up.layout.total_bytes, notice)
            else:
                still.append((peer, rid, index, notice))
        up.parked = still

    def pub_commit(self, ident: bytes, obj: dict[str, Any]) -> None:
        upload = P.req_int(obj, "upload")
        via_shm = optional(obj, "shm", bool, False)
        if via_shm:
            self.store.shm_written(upload)
        up = self.store.uploads.get(upload)
        wire_bytes = up.wire_bytes if up else 0
        t0 = time.monotonic()
        ver, evicted = self.store.commit(upload)
        if via_shm:
            self.metrics.count("publishes_shm")
        # Pullers that leased the upload's slab while following it read from now on.
        self.leases.renew(ver.slab, P.lease_seconds(self.cfg.request_timeout_s, ver.layout.total_bytes))
        self.store.pool.prepare(ver.layout.total_bytes)  # the next version's slab, off this thread
        verify_s = time.monotonic() - t0
        lay = ver.layout
        delta = up is not None and up.delta_base is not None
        changed = len(up.changed) if up else len(lay.tensors)
        rec = self.metrics.published(
            ver.name, ver.version, lay.total_bytes, lay.data_bytes, wire_bytes, len(lay.tensors), changed, delta,
            ver.begin_mono, ver.visible_mono, verify_s, followers=up.followers if up else 0,
        )
        self.out.announce(ver)
        if up is not None:  # followers: the rest of their chunks, then the go-ahead
            for peer, rid, index, notice in up.parked:
                self._send_chunk(peer, rid, ver.name, ver.version, index, ver.slab, lay.total_bytes, notice)
            for peer, rid in up.waiters:
                self.out.send(peer, P.encode(P.COMMITTED, rid=rid, name=ver.name, version=ver.version, content_hash=ver.content_hash))
            up.parked, up.waiters = [], []
        self.on_commit(ver)
        dur = rec["publish_duration_s"]
        self.metrics.log.event(
            ("published", ver.name), dur,
            "published %s v%d: %s in %d tensors (%d sent%s), %.3f s (%.2f GB/s), hash %s; holding %s",
            ver.name, ver.version, _size(lay.data_bytes), len(lay.tensors), changed, ", delta" if delta else "",
            dur, wire_bytes / max(dur, 1e-9) / 1e9, ver.content_hash.hex()[:16], self.store.held()[ver.name],
        )
        if evicted:
            log.debug("evicted %s", [f"{v.name} v{v.version}" for v in evicted])
        self.out.send(ident, self._done_header(obj.get("rid"), ver, wire_bytes=wire_bytes, duration_s=dur))

    def flush_aborted(self) -> None:
        """Followers parked on an upload that will never commit get an ERROR (they keep their weights)."""
        for up in self.store.take_aborted():
            msg = f"upload of {up.name} v{up.version} was aborted; keep the current version"
            for peer, rid, _, _ in up.parked:
                self.out.error(peer, rid, P.E_ABORTED, msg)
            for peer, rid in up.waiters:
                self.out.error(peer, rid, P.E_ABORTED, msg)
            up.parked, up.waiters = [], []

    @staticmethod
    def _done_header(rid: Any, ver: Version, wire_bytes: int, duration_s: float = 0.0, duplicate: bool = False) -> bytes:
        return P.encode(
            P.PUB_DONE, rid=rid, name=ver.name, version=ver.version, bytes=ver.layout.data_bytes,
            wire_bytes=wire_bytes, duration_s=duration_s, content_hash=ver.content_hash, duplicate=duplicate,
        )

    def manifest_req(self, ident: bytes, obj: dict[str, Any]) -> None:
        name, version = P.req_name(obj), P.optional_int(obj, "version")
        want_shm = optional(obj, "shm", bool, False)
        if optional(obj, "pending", bool, False):
            up = self.store.pending(name)
            if up is not None and version in (None, up.version):
                up.followers += 1
                self._send_manifest(ident, obj.get("rid"), name, up.version, up.slab, up.layout, want_shm, pending=True)
                return
        ver = self.store.get(name, version)
        if ver is None:
            held = self.store.held().get(name, [])
            what = f"version {version} of {name!r} is not held (held: {held})" if version is not None else f"no version of {name!r} is held yet"
            raise Refused(P.E_NOT_FOUND, what)
        self.metrics.pulled(name, ver.version)
        self._send_manifest(ident, obj.get("rid"), name, ver.version, ver.slab, ver.layout, want_shm, pending=False)

    def _send_manifest(self, ident: bytes, rid: Any, name: str, version: int, slab: Slab, layout: P.Layout, want_shm: bool,
                       pending: bool) -> None:
        offer = self._lease(slab, name, version, layout.total_bytes, pending) if want_shm else None
        if offer is None:
            self.metrics.pull_path(name, version, shm=False)
        self.out.send(ident, P.encode(
            P.MANIFEST, rid=rid, name=name, version=version, chunk_bytes=self.cfg.chunk_bytes,
            pending=pending, shm=offer, **P.manifest_fields(layout),
        ))

    def _lease(self, slab: Slab, name: str, version: int, total: int, pending: bool) -> dict[str, Any] | None:
        """Lease ``slab`` to a puller and describe it (None: anonymous slab, shm off, or too many
        leases out; the pull goes over TCP). A follower's lease also covers the upload's wait."""
        if self.shm is None or slab.path is None:
            return None
        ttl = P.lease_seconds(self.cfg.request_timeout_s, total) + (self.cfg.upload_timeout_s if pending else 0.0)
        lease = self.leases.take(slab, ttl, name, version)
        if lease is None:
            log.warning("%d shared-memory leases are out; this pull of %s v%d goes over TCP", len(self.leases.held), name, version)
            return None
        offer = self.shm.offer(slab, total, lease, ttl)
        return offer.to_wire() if offer is not None else None

    def shm_release(self, ident: bytes, obj: dict[str, Any]) -> None:
        lease = P.req_int(obj, "lease")
        via = optional(obj, "via", str)
        if via not in P.RELEASE_VIA:
            raise WireError(f"field 'via' must be one of {P.RELEASE_VIA}, got {via!r}")
        self._release_lease(lease, via)
        self.out.send(ident, P.encode(P.SHM_RELEASED, rid=obj.get("rid"), lease=lease))

    def _release_lease(self, lease: int, via: str | None) -> None:
        held = self.leases.release(lease)
        if held is None:
            raise Refused(
                P.E_UNKNOWN_LEASE,
                f"lease {lease} is unknown: already released, expired (a pull must release within its lease_s) "
                "or the server restarted",
            )
        if via is not None:
            self.metrics.pull_path(held.name, held.version, shm=via == "shm", fallback=via == "tcp")

    def expire_leases(self, now: float) -> None:
        """Drop leases their pullers never released; those slabs are never recycled."""
        for held in self.leases.expire(now):
            log.warning(
                "a shared-memory lease on %s v%d was not released in time (dead or stuck worker); its slab will not be reused",
                held.name, held.version,
            )
            # counted after the warning, so whoever sees the count (a test, a dashboard) sees the log too
            self.metrics.count("shm_leases_expired")

    def fetch(self, ident: bytes, obj: dict[str, Any]) -> None:
        """A chunk's bytes, or with ``shm: true`` (a follower that maps the slab) only the notice
        that they are in: answered at once when they are, else parked until they arrive."""
        name, version, index = P.req_name(obj), P.req_int(obj, "version"), P.req_int(obj, "chunk")
        notice = optional(obj, "shm", bool, False)
        rid: Any = obj.get("rid")  # echoed back as the client sent it
        ver = self.store.get(name, version)
        up = self.store.upload_of(name, version) if ver is None else None
        held = ver if ver is not None else up
        if held is None:
            raise Refused(P.E_NOT_FOUND, f"version {version} of {name!r} is no longer held (held: {self.store.held().get(name, [])})")
        total = held.layout.total_bytes
        if index >= P.chunk_count(total, self.cfg.chunk_bytes):
            raise WireError(f"chunk {index} is out of range for {name} v{version}")
        if notice and held.slab.path is None:
            raise WireError(f"{name} v{version} is not in shared memory; fetch its chunks without shm")
        if up is None:  # a committed version
            self._send_chunk(ident, rid, name, version, index, held.slab, total, notice)
            return
        offset, length = P.chunk_range(index, total, self.cfg.chunk_bytes)
        if up.has(offset + length):
            self._send_chunk(ident, rid, name, version, index, up.slab, total, notice)
        elif len(up.parked) >= MAX_PARKED:
            raise Refused(P.E_TOO_LARGE, f"too many fetches are waiting for {name} v{version}")
        else:
            up.parked.append((ident, rid, index, notice))  # answered when the bytes arrive (or at commit)

    def _send_chunk(
        self, ident: bytes, rid: Any, name: str, version: int, index: int, slab: Any, total: int, notice: bool = False,
    ) -> None:
        offset, length = P.chunk_range(index, total, self.cfg.chunk_bytes)
        header = P.encode(P.CHUNK, rid=rid, version=version, chunk=index, offset=offset, shm=notice)
        if notice:  # the follower reads the bytes from its mapping of the slab
            self.out.send(ident, header)
            return
        self.out.send(ident, header, slab.view[offset : offset + length], slab)
        self.metrics.served(name, version, length)

    def wait_commit(self, ident: bytes, obj: dict[str, Any]) -> None:
        name, version = P.req_name(obj), P.req_int(obj, "version")
        ver = self.store.get(name, version)
        if ver is not None:
            self.out.send(ident, P.encode(P.COMMITTED, rid=obj.get("rid"), name=name, version=version, content_hash=ver.content_hash))
            return
        up = self.store.upload_of(name, version)
        if up is None:
            raise Refused(P.E_NOT_FOUND, f"version {version} of {name!r} is neither held nor being uploaded")
        if len(up.waiters) >= MAX_PARKED:
            raise Refused(P.E_TOO_LARGE, f"too many followers are waiting for {name} v{version}")
        rid: Any = obj.get("rid")  # echoed back as the client sent it
        up.waiters.append((ident, rid))

    def applied(self, ident: bytes, obj: dict[str, Any]) -> None:
        name, version = P.req_name(obj), P.req_int(obj, "version")
        worker = require(obj, "worker", str)[:256]
        apply_s = optional(obj, "apply_s", float)
        lease = P.optional_int(obj, "lease")
        if lease is not None:  # released before the report is recorded: whoever sees the one sees the other
            try:
                self._release_lease(lease, "shm")
            except Refused as exc:  # no answer to send: only logged
                log.warning("worker %s applied %s v%d: %s", worker, name, version, exc)
        self.metrics.applied(name, version, worker, apply_s, time.monotonic())

    def metrics_req(self, ident: bytes, obj: dict[str, Any]) -> None:
        snap = self.snapshot()
        # msgpack map keys must be strings on our wire (strict_map_key)
        snap["versions"] = {n: {str(v): rec for v, rec in per.items()} for n, per in snap["versions"].items()}
        self.out.send(ident, P.encode(P.METRICS, rid=obj.get("rid"), metrics=snap))


def _size(nbytes: int) -> str:
    """Bytes for a log line: a LoRA adapter of a few kB shows as such, not as 0.0 MB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
