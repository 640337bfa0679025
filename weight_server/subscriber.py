"""The worker's side: hear announcements, pull a version, verify it, apply it in place.

A pull asks for the manifest, then fetches the chunks with at most ``max_inflight_chunks``
requests outstanding (credit-based flow control) straight into one staging buffer, or on the same
host reads the version's slab file under a lease (:mod:`weight_server.protocol`). Nothing reaches
the target before every tensor hash matches: a worker keeps its weights otherwise. Calls never
hang: while the server is down ``pull`` returns None after ``request_timeout_s``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, TypedDict

import numpy as np
import torch
import zmq

from rlhf_core.config import WeightServerConfig
from rlhf_core.wire import WireError
from weight_server import protocol as P
from weight_server.announcements import Announcements
from weight_server.client import Channel, Client, NoReply
from weight_server.shm_map import ShmUnavailable, copy_and_hash, copy_bytes, hash_tensors
from weight_server.tensors import Staging, check_target, staged, target_of

log = logging.getLogger(__name__)

_NO_RID = -1  # request ids count up from a non-negative number: a reply without one matches none


class PullStats(TypedDict):
    """A subscriber's counters (``WeightSubscriber.stats``)."""

    pulls: int
    pulls_tcp: int
    pulls_shm: int
    shm_fallbacks: int
    bytes_received: int
    bytes_shm: int
    integrity_failures: int
    timeouts: int
    last_pull_s: float | None


class WeightSubscriber(Client):
    """Pulls versions of the parameter set ``name``. Not thread-safe (one per thread)."""

    def __init__(
        self, address: str, pub_address: str, cfg: WeightServerConfig | None = None, worker_id: str = "w0",
        name: str = "policy", ctx: zmq.Context | None = None,
    ) -> None:
        super().__init__(cfg or WeightServerConfig(), ctx)
        self.worker_id = worker_id
        self.name = name
        channel = None
        try:
            channel = Channel(address, self.cfg, self.ctx, rcvhwm=2 * self.cfg.max_inflight_chunks + 16)
            self.announcements = Announcements(pub_address, self.cfg, self.ctx, name, channel.signer)
        except BaseException:
            try:
                if channel is not None:
                    channel.close()
            finally:
                self._release()
            raise
        self.channel = channel
        self.version: int | None = None  # the version last pulled (and applied, when pulled into a target)
        self._staging = Staging()
        self._applied: tuple[Any, int, tuple, list[bytes]] | None = None  # (target, version, signature, hashes)
        self.stats: PullStats = {
            "pulls": 0, "pulls_tcp": 0, "pulls_shm": 0, "shm_fallbacks": 0, "bytes_received": 0, "bytes_shm": 0,
            "integrity_failures": 0, "timeouts": 0, "last_pull_s": None,
        }

    def _close_sockets(self) -> None:
        self.channel.close()
        self.announcements.close()

    def poll_announcement(self, timeout_ms: int = 0, pending: bool = False) -> int | None:
        """The newest version announced so far (None: none yet); non-blocking by default, cheap between
        decoding steps. ``pending=True`` also counts uploads that have only started (a pull follows them)."""
        return self.announcements.poll(timeout_ms, pending)

    def pull(
        self, version: int | None = None, into: Any = None, skip_unchanged: bool = True, follow: bool = True,
    ) -> tuple[int, dict[str, torch.Tensor] | None] | None:
        """Fetch the newest (or the named) version, verify it, and apply it.

        ``into``: an nn.Module or a dict of preallocated tensors, updated in place (names must
        match; dtypes may differ). ``skip_unchanged``: tensors whose hash equals what was last
        applied into the same target are not fetched. ``follow`` (``version`` None): an upload in
        progress newer than the newest version is followed as its bytes arrive (cut-through).
        Returns ``(version, None)`` after an in-place pull, ``(version, {name: tensor})`` when
        ``into`` is None, or None when nothing was applied (the current weights stay in use).
        """
        t0 = time.monotonic()
        try:
            result = self._pull(version, into, skip_unchanged, follow and version is None, retry_newest=version is None)
        except NoReply as exc:
            self.stats["timeouts"] += 1
            log.warning("worker %s: %s; keeping v%s", self.worker_id, exc, self.version)
            self.channel.reset()
            return None
        self.stats["last_pull_s"] = time.monotonic() - t0
        return result

    def _pull(self, version: int | None, into: Any, skip_unchanged: bool, follow: bool, retry_newest: bool) -> Any:
        man = self.channel.request(P.MANIFEST_REQ, name=self.name, version=version, pending=follow, shm=self._maps is not None)
        if man["kind"] == P.ERROR:
            log.info("worker %s: no pull: %s", self.worker_id, man.get("message"))
            return None
        try:
            layout, v, chunk_bytes = self._parse_manifest(man)
            offer = P.parse_shm_offer(man, "shm", layout.total_bytes, leased=True)
        except WireError as exc:
            self.stats["integrity_failures"] += 1
            log.error("worker %s: rejected a manifest: %s; keeping v%s", self.worker_id, exc, self.version)
            return None
        if offer is None:
            return self._pull_tcp(man, layout, v, chunk_bytes, into, skip_unchanged, follow, retry_newest)
        lease = offer.lease
        assert lease is not None  # parse_shm_offer(leased=True) refuses an offer without one
        # the lease pins the slab on the server: released on every way out (with the APPLIED report
        # of an applied shm pull) but when the server stopped answering (it expires the lease)
        via, released = None, False
        try:
            plan = self._plan(layout, v, into, skip_unchanged)
            if plan is None:
                result = v, None  # already applied
            elif (slab := self._map(offer)) is None:
                via = "tcp"
                result = self._pull_tcp(man, layout, v, chunk_bytes, into, skip_unchanged, follow, retry_newest)
            else:
                result, via, released = self._pull_shm(man, layout, v, chunk_bytes, slab, into, lease, *plan)
        except NoReply:
            raise
        except BaseException:
            self._release_lease(lease, via)
            raise
        if not released:
            self._release_lease(lease, via)
        return result

    def _plan(self, layout: P.Layout, v: int, into: Any, skip_unchanged: bool) -> tuple[Any, list[int]] | None:
        """(target tensors or None, indices of the tensors to move); None when ``v`` is already
        applied into ``into``."""
        target = target_of(into) if into is not None else None
        if target is not None:
            check_target(layout, target)
        needed = list(range(len(layout.tensors)))
        prev = self._applied
        if target is not None and skip_unchanged and prev is not None and prev[0] is into and prev[2] == layout.signature():
            needed = [i for i, t in enumerate(layout.tensors) if t.hash != prev[3][i]]
            if not needed and prev[1] == v:
                return None
        return target, needed

    def _pull_tcp(
        self, man: dict[str, Any], layout: P.Layout, v: int, chunk_bytes: int, into: Any, skip_unchanged: bool,
        follow: bool, retry_newest: bool,
    ) -> Any:
        plan = self._plan(layout, v, into, skip_unchanged)
        if plan is None:
            return v, None  # already applied
        target, needed = plan
        staging = self._staging.buffer(layout.total_bytes, target)
        buf = staging.numpy().data
        error, hashes = self._fetch(layout, v, chunk_bytes, needed, buf)
        if error is not None:
            self.channel.reset()  # abandon the other outstanding fetches
            if retry_newest and P.error_code(error) in (P.E_NOT_FOUND, P.E_ABORTED):
                log.info("worker %s: v%d went away mid-pull (%s); pulling the newest instead", self.worker_id, v, P.error_code(error))
                return self._pull(None, into, skip_unchanged, follow, retry_newest=False)
            log.warning("worker %s: pull of v%d failed: %s", self.worker_id, v, error.get("message"))
            return None
        if not self._verified(layout, v, needed, hashes) or not self._committed(man, layout, v):
            return None
        self.stats["pulls_tcp"] += 1
        return self._finish(layout, v, staging, target, into, needed)

    def _pull_shm(
        self, man: dict[str, Any], layout: P.Layout, v: int, chunk_bytes: int, slab: np.ndarray, into: Any,
        lease: int, target: Any, needed: list[int],
    ) -> tuple[Any, str | None, bool]:
        """Read version ``v`` from the leased slab mapping, hashing every needed tensor there (or as it
        is copied into the staging buffer; ``into=None`` gets its own copy, never a view of a slab).
        Returns (result, "shm" or None when no bytes were read, whether the APPLIED report released ``lease``)."""
        staging = None
        if target is None or any(t.is_cuda for t in target.values()):
            staging = self._staging.buffer(layout.total_bytes, target)  # owned (into=None) or pinned (GPU)
        if man.get("pending") is True:
            error, hashes = self._fetch(layout, v, chunk_bytes, needed, slab, notices=True)
            if error is not None:
                self.channel.reset()
                log.info("worker %s: followed upload of v%d went away (%s); keeping v%s", self.worker_id, v,
                         error.get("message"), self.version)
                return None, None, False
            if not self._committed(man, layout, v):
                return None, None, False
            if staging is not None:
                for i in needed:
                    t = layout.tensors[i]
                    copy_bytes(staging.numpy()[t.offset : t.offset + t.nbytes], slab[t.offset : t.offset + t.nbytes])
        elif staging is not None:  # hashed while hot, from the copy that is then applied or handed out
            hashes = copy_and_hash(staging.numpy(), slab, layout, needed)
        else:
            hashes = hash_tensors(slab, layout, needed)
        self.stats["bytes_shm"] += sum(layout.tensors[i].nbytes for i in needed)
        if not self._verified(layout, v, needed, hashes):
            return None, "shm", False
        self.stats["pulls_shm"] += 1
        result = self._finish(layout, v, staging if staging is not None else slab, target, into, needed, lease)
        return result, "shm", target is not None

    def _map(self, offer: P.ShmOffer) -> np.ndarray | None:
        """The offered slab, mapped read-only; None (pull over TCP) when it cannot be, or when this
        subscriber has shared memory off and did not ask for the offer."""
        if self._maps is None:
            return None
        try:
            return self._maps.open(offer, writable=False)
        except ShmUnavailable as exc:
            self.stats["shm_fallbacks"] += 1
            self._maps.warn_once(f"worker {self.worker_id}", offer, exc)
            return None

    def _release_lease(self, lease: int, via: str | None) -> None:
        """Give the slab back to the server (recyclable again). Best effort: a lease the server
        cannot hear about expires there after its lease_s."""
        try:
            rep = self.channel.request(P.SHM_RELEASE, lease=lease, via=via)
        except NoReply:
            log.warning("worker %s: no answer releasing shared-memory lease %d; the server expires it", self.worker_id, lease)
            return
        if rep["kind"] != P.SHM_RELEASED:
            log.warning("worker %s: releasing shared-memory lease %d: %s", self.worker_id, lease, rep.get("message"))

    def _verified(self, layout: P.Layout, v: int, needed: list[int], hashes: dict[int, bytes]) -> bool:
        bad = [layout.tensors[i].name for i in needed if hashes[i] != layout.tensors[i].hash]
        if bad:
            self.stats["integrity_failures"] += 1
            log.error(
                "worker %s: %s v%d failed verification (%d tensor(s), e.g. %r); not applied, keeping v%s",
                self.worker_id, self.name, v, len(bad), bad[0], self.version,
            )
        return not bad

    def _committed(self, man: dict[str, Any], layout: P.Layout, v: int) -> bool:
        """For a followed upload (pending manifest): wait until the server committed it."""
        if man.get("pending") is not True:
            return True
        rep = self.channel.request(
            P.WAIT_COMMIT, timeout_s=self.cfg.request_timeout_s + layout.total_bytes / 1e9, name=self.name, version=v,
        )
        if rep["kind"] != P.COMMITTED or rep.get("content_hash") != layout.content_hash():
            log.warning("worker %s: followed upload of v%d did not commit (%s); keeping v%s",
                        self.worker_id, v, rep.get("message"), self.version)
            return False
        self.announcements.saw_commit(v)
        return True

    def _finish(self, layout: P.Layout, v: int, source: Any, target: Any, into: Any, needed: list[int],
                lease: int | None = None) -> Any:
        """Verified bytes in ``source`` (a staging tensor, or the slab mapping): returned (``into=None``)
        or applied into the target and reported (releasing the slab's ``lease`` with the report)."""
        self.stats["pulls"] += 1
        if target is None:
            self.version = v
            return v, {layout.tensors[i].name: staged(source, layout, i) for i in range(len(layout.tensors))}
        t_apply = time.monotonic()
        self._staging.apply(layout, source.numpy() if isinstance(source, torch.Tensor) else source, target, needed)
        apply_s = time.monotonic() - t_apply
        self._applied = (into, v, layout.signature(), layout.hashes())
        self.version = v
        self.report_applied(v, apply_s, lease)
        return v, None

    def _fetch(
        self, layout: P.Layout, v: int, chunk_bytes: int, needed: list[int], buf: Any, notices: bool = False,
    ) -> tuple[dict[str, Any] | None, dict[int, bytes]]:
        """Fetch the chunks holding tensors ``needed`` into ``buf`` with at most ``max_inflight_chunks``
        requests outstanding, hashing each tensor once its bytes are in (``notices``: ``buf`` is the
        upload's slab mapping, the server only says when each chunk is there). Returns (the ERROR
        reply that stopped it, if any; {tensor index: hash})."""
        order = P.chunks_covering(layout, needed, chunk_bytes)
        chunks = deque(order)
        outstanding: dict[int, int] = {}  # request id -> chunk index
        arrived: set[int] = set()
        prefix = 0  # order[:prefix] have all arrived
        to_hash = deque(sorted(needed, key=lambda i: layout.tensors[i].offset))
        hashes: dict[int, bytes] = {}

        def place(header: dict[str, Any]) -> list[memoryview] | None:
            chunk = outstanding.get(header.get("rid", _NO_RID))
            if chunk is None or header.get("chunk") != chunk or header.get("version") != v:
                return None
            offset, length = P.chunk_range(chunk, layout.total_bytes, chunk_bytes)
            return [buf[offset : offset + length]] if header.get("offset") == offset else None

        while chunks or outstanding:
            while chunks and len(outstanding) < self.cfg.max_inflight_chunks:  # spend the credits
                c = chunks.popleft()
                outstanding[self.channel.send(P.FETCH, name=self.name, version=v, chunk=c, shm=notices)] = c
            rep = self.channel.recv(self.cfg.request_timeout_s, into=place)
            if rep["kind"] == P.ERROR:
                return rep, hashes
            if rep["kind"] != P.CHUNK or rep.get("discarded"):
                continue
            chunk = outstanding.get(rep.get("rid", _NO_RID))
            if chunk is None or rep.get("chunk") != chunk or rep.get("version") != v or (rep.get("shm") is True) != notices:
                continue  # a late reply to an abandoned request, or one without the data asked for
            del outstanding[rep["rid"]]
            arrived.add(chunk)
            if not notices:
                self.stats["bytes_received"] += P.chunk_range(chunk, layout.total_bytes, chunk_bytes)[1]
            while prefix < len(order) and order[prefix] in arrived:
                prefix += 1
            covered = min(layout.total_bytes, order[prefix - 1] * chunk_bytes + chunk_bytes) if prefix else 0
            while to_hash and layout.tensors[to_hash[0]].offset + layout.tensors[to_hash[0]].nbytes <= covered:
                i = to_hash.popleft()
                t = layout.tensors[i]
                hashes[i] = P.tensor_hash(buf[t.offset : t.offset + t.nbytes])
        for i in to_hash:  # tensors of zero bytes, or whatever the prefix rule left
            t = layout.tensors[i]
            hashes[i] = P.tensor_hash(buf[t.offset : t.offset + t.nbytes])
        return None, hashes

    def _parse_manifest(self, man: dict[str, Any]) -> tuple[P.Layout, int, int]:
        if man["kind"] != P.MANIFEST or man.get("name") != self.name:
            raise WireError(f"expected a manifest of {self.name!r}, got {man['kind']}")
        layout = P.parse_tensor_list(man, "tensors", self.cfg.max_tensors, self.cfg.max_version_bytes)
        v = P.req_int(man, "version")
        chunk_bytes = P.req_int(man, "chunk_bytes", minimum=1)
        if chunk_bytes > self.cfg.max_frame_bytes:
            raise WireError(f"chunk_bytes {chunk_bytes} exceeds max_frame_bytes {self.cfg.max_frame_bytes}")
        if P.req_hash(man, "content_hash") != layout.content_hash() or man.get("total_bytes") != layout.total_bytes:
            raise WireError(f"v{v}: content hash or size does not match the tensor list")
        return layout, v, chunk_bytes

    def report_applied(self, version: int, apply_s: float | None = None, lease: int | None = None) -> None:
        """Tell the server this worker applied ``version`` (the weight-sync latency metric), releasing
        ``lease`` with it; no answer awaited, dropped when the server is down (a lease then expires)."""
        try:
            self.channel.send(P.APPLIED, timeout_s=0.2, name=self.name, version=int(version), worker=self.worker_id,
                              apply_s=apply_s, lease=lease)
        except NoReply:
            pass
