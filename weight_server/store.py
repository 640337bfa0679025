"""The server's versioned parameter store: uploads in progress and the newest K versions.

Pure bookkeeping (no sockets, no torch): a version becomes visible only at
:meth:`VersionStore.commit`, once its bytes are all there and every tensor hash matches; versions
only grow (an older push is :class:`Refused`); the newest ``keep`` per name are held, each in one
slab (:mod:`weight_server.slabs`) that eviction gives back to the pool.
"""

from __future__ import annotations

import bisect
import secrets
import time
from dataclasses import dataclass, field

from weight_server import protocol as P
from weight_server.protocol import Layout
from weight_server.slabs import Slab, SlabFactory, SlabPool

#: the least the default upload byte cap allows (the cap is twice the largest version held)
DEFAULT_UPLOAD_FLOOR = 1 << 30


class Refused(Exception):
    """A request the store refuses; ``code`` is the protocol error code sent back to the client."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Version:
    name: str
    version: int
    layout: Layout
    slab: Slab
    content_hash: bytes
    begin_mono: float  # server monotonic clock at PUB_BEGIN: the start of weight-sync latency
    visible_mono: float


@dataclass
class Upload:
    id: int
    name: str
    version: int
    layout: Layout
    slab: Slab
    content_hash: bytes
    delta_base: int | None
    changed: tuple[int, ...]
    begin_mono: float
    last_activity: float
    shm: bool = False  # offered its slab file: the publisher may write into it directly
    grace_s: float = 0.0  # added to the idle timeout (a shm publisher sends nothing while it copies)
    segments: list[tuple[int, int]] = field(default_factory=list)
    wire_bytes: int = 0
    # cut-through: every tensor byte below `watermark` is in (a full upload arriving in order),
    # so followers may get those chunks before the commit; out-of-order data or a delta turns it off
    streamable: bool = False
    followers: int = 0  # pending-manifest requests (pulls that followed this upload)
    watermark: int = 0
    parked: list[tuple[bytes, int, int, bool]] = field(default_factory=list)  # (peer, rid, chunk, shm notice) waiting for bytes
    waiters: list[tuple[bytes, int]] = field(default_factory=list)  # (peer, rid) waiting for the commit
    hashed: int = 0  # tensors [0, hashed) are complete and their hashes are in `computed`
    computed: list[bytes] = field(default_factory=list)
    _ends: list[int] = field(default_factory=list)  # tensor byte ranges with data, for the padding test
    _starts: list[int] = field(default_factory=list)

    def data_between(self, start: int, end: int) -> bool:
        """Whether any tensor byte lies in ``[start, end)`` (else the range is alignment padding)."""
        if start >= end:
            return False
        k = bisect.bisect_right(self._ends, start)
        return k < len(self._starts) and self._starts[k] < end

    def advance(self, segments: list[tuple[int, int]]) -> None:
        """Move the watermark over received segments and hash every tensor now complete; a segment
        below it (overlap or reorder) turns streaming off, and the commit hashes everything."""
        for o, n in segments:
            if not self.streamable:
                return
            if o < self.watermark or self.data_between(self.watermark, o):
                self.streamable = False  # out of order: followers wait for the commit instead
                return
            self.watermark = o + n
        tensors = self.layout.tensors
        while self.hashed < len(tensors) and tensors[self.hashed].offset + tensors[self.hashed].nbytes <= self.watermark:
            t = tensors[self.hashed]
            self.computed.append(P.tensor_hash(self.slab.view[t.offset : t.offset + t.nbytes]))
            self.hashed += 1

    def has(self, end: int) -> bool:
        """Every tensor byte below ``end`` has arrived."""
        return self.streamable and (self.watermark >= end or not self.data_between(self.watermark, end))


class VersionStore:
    """Holds the newest ``keep`` versions of each named parameter set and the uploads in progress."""

    def __init__(self, keep: int, max_names: int = 16, slab_factory: SlabFactory | None = None,
                 max_uploads: int = 4, max_upload_bytes: int | None = None,
                 max_version_bytes: int = 64 * 1024**3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self.max_names = max_names
        self.max_uploads = max_uploads  # uploads in progress at once, over all names
        self.max_upload_bytes = max_upload_bytes  # their total bytes (None: see upload_byte_cap)
        self.max_version_bytes = max_version_bytes
        self.pool = SlabPool(factory=slab_factory)
        self.versions: dict[str, dict[int, Version]] = {}
        self.uploads: dict[int, Upload] = {}
        self.aborted: list[Upload] = []

    def newest(self, name: str) -> Version | None:
        held = self.versions.get(name)
        return held[max(held)] if held else None

    def get(self, name: str, version: int | None = None) -> Version | None:
        if version is None:
            return self.newest(name)
        return self.versions.get(name, {}).get(version)

    def held(self) -> dict[str, list[int]]:
        return {name: sorted(vs) for name, vs in self.versions.items() if vs}

    def begin(
        self,
        name: str,
        version: int,
        layout: Layout,
        content_hash: bytes,
        delta_base: int | None = None,
        changed: list[int] | None = None,
        now: float | None = None,
    ) -> Upload | Version:
        """Start an upload; returns the held Version instead when it is a retry of a finished publish."""
        now = time.monotonic() if now is None else now
        if layout.content_hash() != content_hash:
            raise Refused(P.E_HASH, f"content_hash of {name} v{version} does not match its tensor hashes")
        newest = self.newest(name)
        if newest is not None and version <= newest.version:
            if version == newest.version and content_hash == newest.content_hash:
                return newest  # a retried publish whose commit reply was lost
            raise Refused(
                P.E_STALE,
                f"version {version} of {name!r} is not newer than the newest held version {newest.version}; "
                f"versions only grow: publish {newest.version + 1} or above (a restarted learner continues "
                "from WeightPublisher.latest_version() + 1)",
            )
        for up in list(self.uploads.values()):
            if up.name == name:
                if up.version > version:
                    raise Refused(P.E_STALE, f"an upload of {name!r} version {up.version} is in progress; version {version} is older")
                self.abort(up.id)  # a retry, or a newer version superseding an unfinished one
        if name not in self.versions and len(self.versions) >= self.max_names:
            raise Refused(P.E_TOO_LARGE, f"the server already holds {self.max_names} parameter-set names")
        self._check_upload_budget(layout.total_bytes)
        base = None
        if delta_base is not None:
            base = self.get(name, delta_base)
            if base is None or base.layout.signature() != layout.signature():
                raise Refused(
                    P.E_BAD_DELTA,
                    f"delta base {name} v{delta_base} is not held or has other tensors; publish the full version",
                )
            changed = sorted(set(changed or []))
            if changed and not 0 <= changed[0] <= changed[-1] < len(layout.tensors):
                raise Refused(P.E_MALFORMED, f"changed tensor indices out of range 0..{len(layout.tensors) - 1}")
            for i, (t, b) in enumerate(zip(layout.tensors, base.layout.tensors)):
                if i not in changed and t.hash != b.hash:
                    raise Refused(P.E_BAD_DELTA, f"tensor {t.name!r} is marked unchanged but its hash differs from v{delta_base}")
        try:
            slab = self.pool.take(layout.total_bytes)
        except MemoryError:  # raised in the server's loop it stopped the server
            raise Refused(P.E_TOO_LARGE, f"the server cannot allocate the {layout.total_bytes / 2**30:.1f} GiB of {name} "
                                         f"v{version}: its host lacks the memory; run it on a larger one, or lower "
                                         "weight_server.max_version_bytes to refuse such versions at once") from None
        if base is not None:
            unchanged = set(range(len(layout.tensors))) - set(changed or [])
            for i in sorted(unchanged):  # copy from the base slab: a memcpy, no network bytes
                t = layout.tensors[i]
                slab.view[t.offset : t.offset + t.nbytes] = base.slab.view[t.offset : t.offset + t.nbytes]
        up = Upload(
            secrets.randbits(62), name, version, layout, slab, content_hash, delta_base,
            tuple(changed or ()) if base is not None else tuple(range(len(layout.tensors))), now, now,
        )
        if base is None:
            up.streamable = True
            spans = [(t.offset, t.offset + t.nbytes) for t in layout.tensors if t.nbytes]
            up._starts = [a for a, _ in spans]
            up._ends = [b for _, b in spans]
        self.uploads[up.id] = up
        return up

    def _check_upload_budget(self, nbytes: int) -> None:
        """Cap the uploads in progress and their bytes: they pin memory until they commit, abort or expire."""
        busy = self.upload_bytes()
        if len(self.uploads) >= self.max_uploads:
            raise Refused(P.E_BUSY, f"{len(self.uploads)} uploads are in progress (weight_server.max_uploads="
                                    f"{self.max_uploads}); retry when one finishes or expires")
        cap = self.upload_byte_cap()
        if busy + nbytes > cap:
            raise Refused(P.E_BUSY, f"uploads in progress hold {busy} bytes; {nbytes} more would pass the cap of {cap} "
                                    "(weight_server.max_upload_bytes; by default twice the largest version held, "
                                    "at least 1 GiB, or while nothing is held yet, weight_server.max_version_bytes); "
                                    "retry when one finishes or expires, or raise weight_server.max_upload_bytes")

    def upload_byte_cap(self) -> int:
        """The most bytes the uploads in progress may hold together: ``max_upload_bytes`` when set,
        else twice the largest version held (at least 1 GiB), or while nothing is held ``max_version_bytes``."""
        if self.max_upload_bytes is not None:
            return self.max_upload_bytes
        held = [v.layout.total_bytes for vs in self.versions.values() for v in vs.values()]
        return max(2 * max(held), DEFAULT_UPLOAD_FLOOR) if held else self.max_version_bytes

    def upload_bytes(self) -> int:
        # a copy first (one step under the GIL): metrics() sums them on another thread than the loop's
        return sum(up.layout.total_bytes for up in list(self.uploads.values()))

    def pending(self, name: str) -> Upload | None:
        """The upload of ``name`` newer than the newest held version, if any (a follower's chunks
        are served as they arrive when it is streamable, else at its commit)."""
        newest = self.newest(name)
        return next((up for up in self.uploads.values()
                     if up.name == name and (newest is None or up.version > newest.version)), None)

    def upload_of(self, name: str, version: int) -> Upload | None:
        return next((up for up in self.uploads.values() if up.name == name and up.version == version), None)

    def chunk_targets(
        self, upload_id: int, segments: list[tuple[int, int]], now: float | None = None, shm: bool = False,
    ) -> list[memoryview]:
        """Where the data frames of a PUB_CHUNK go (views of the upload's slab); none with ``shm``: the
        publisher wrote those bytes into the slab file it was offered."""
        up = self._upload(upload_id)
        if shm and not up.shm:
            raise Refused(P.E_MALFORMED, f"upload {upload_id} was not offered shared memory; send its bytes as data frames")
        up.last_activity = time.monotonic() if now is None else now
        up.segments.extend(segments)
        up.wire_bytes += sum(n for _, n in segments)
        return [] if shm else [up.slab.view[o : o + n] for o, n in segments]

    def _upload(self, upload_id: int) -> Upload:
        up = self.uploads.get(upload_id)
        if up is None:
            raise Refused(P.E_UNKNOWN_UPLOAD, f"upload {upload_id} is unknown (finished, aborted or the server restarted)")
        return up

    def offer_shm(self, upload_id: int, grace_s: float) -> None:
        """The publisher was offered the upload's slab file: it may send nothing for ``grace_s`` extra seconds."""
        up = self.uploads[upload_id]
        up.shm, up.grace_s = True, grace_s

    def shm_written(self, upload_id: int) -> None:
        """The publisher copied every changed tensor into the slab file: unless PUB_CHUNKs with
        ``shm`` said so piece by piece, count their bytes as received now."""
        up = self._upload(upload_id)
        if not up.shm:
            raise Refused(P.E_MALFORMED, f"upload {upload_id} was not offered shared memory; send its bytes as PUB_CHUNKs")
        if up.segments:
            return
        spans = [(t.offset, t.nbytes) for t in (up.layout.tensors[i] for i in up.changed) if t.nbytes]
        up.segments.extend(spans)
        up.wire_bytes += sum(n for _, n in spans)
        up.streamable = False  # the bytes did not arrive in order: the commit hashes everything

    def received(self, upload_id: int, segments: list[tuple[int, int]]) -> Upload | None:
        """The data frames of a chunk have landed: advance the upload's watermark."""
        up = self.uploads.get(upload_id)
        if up is not None:
            up.advance(segments)
        return up

    def commit(self, upload_id: int, now: float | None = None) -> tuple[Version, list[Version]]:
        """Verify coverage and hashes, make the version visible; returns (version, evicted)."""
        now = time.monotonic() if now is None else now
        up = self._upload(upload_id)
        del self.uploads[upload_id]
        try:
            self._check_coverage(up)
            done = up.computed if up.streamable else []
            rest = [P.tensor_hash(up.slab.view[t.offset : t.offset + t.nbytes]) for t in up.layout.tensors[len(done) :]]
            bad = [t.name for t, h in zip(up.layout.tensors, done + rest) if h != t.hash]
            if bad:
                raise Refused(
                    P.E_HASH,
                    f"{up.name} v{up.version}: {len(bad)} tensor(s) do not match their hash (e.g. {bad[0]!r}); "
                    "the version was dropped and the previous one stays in use",
                )
            newest = self.newest(up.name)
            if newest is not None and up.version <= newest.version:
                raise Refused(P.E_STALE, f"version {up.version} of {up.name!r} was overtaken by version {newest.version}")
        except Refused:
            self._retire(up)
            raise
        ver = Version(up.name, up.version, up.layout, up.slab, up.content_hash, up.begin_mono, now)
        return ver, self.add(ver)

    def add(self, ver: Version) -> list[Version]:
        """Insert a verified version and evict beyond ``keep``; returns the evicted versions."""
        held = self.versions.setdefault(ver.name, {})
        held[ver.version] = ver
        evicted = [held.pop(v) for v in sorted(held)[: max(0, len(held) - self.keep)]]
        for old in evicted:
            self.pool.give(old.slab)
        return evicted

    def abort(self, upload_id: int) -> None:
        up = self.uploads.pop(upload_id, None)
        if up is not None:
            # never recycled: its publisher may still be copying into the file; freed once nothing reads it
            up.slab.tainted = True
            self._retire(up)

    def _retire(self, up: Upload) -> None:
        self.pool.give(up.slab)
        self.aborted.append(up)  # the server tells its parked followers

    def take_aborted(self) -> list[Upload]:
        out, self.aborted = self.aborted, []
        return out

    def expire(self, timeout_s: float, now: float | None = None) -> list[Upload]:
        """Drop uploads that sent nothing for ``timeout_s`` (a publisher that died mid-push)."""
        now = time.monotonic() if now is None else now
        stale = [up for up in self.uploads.values() if now - up.last_activity > timeout_s + up.grace_s]
        for up in stale:
            self.abort(up.id)
        return stale

    @staticmethod
    def _check_coverage(up: Upload) -> None:
        segs = sorted(up.segments)
        starts: list[int] = []
        ends: list[int] = []
        for o, n in segs:
            if ends and o < ends[-1]:
                raise Refused(P.E_BAD_CHUNK, f"{up.name} v{up.version}: overlapping chunk segments at byte {o}")
            if ends and o == ends[-1]:
                ends[-1] = o + n  # merge adjacent segments
            else:
                starts.append(o)
                ends.append(o + n)
        for i in up.changed:
            t = up.layout.tensors[i]
            if t.nbytes == 0:
                continue
            k = bisect.bisect_right(starts, t.offset) - 1
            if k < 0 or ends[k] < t.offset + t.nbytes:
                raise Refused(
                    P.E_INCOMPLETE,
                    f"{up.name} v{up.version}: bytes of tensor {t.name!r} never arrived; the version was dropped",
                )
