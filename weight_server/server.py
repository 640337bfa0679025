"""The weight server: a ROUTER for publish/pull requests and a PUB for announcements.

One thread owns both sockets and runs a poll loop: requests are answered in arrival order, the
newest versions re-announced every ``announce_interval_s``, idle uploads expired. Upload chunks
are received with ``recv_into`` straight into the upload's slab and pulled chunks sent zero-copy
(tracked); on the same host slabs are files of a private shared-memory folder
(:mod:`weight_server.shm`). A frame that fails to decode or validate gets an ERROR reply; the
loop never dies of it. :meth:`start` runs the loop on a thread, :meth:`serve_forever` in the
caller's until SIGTERM/SIGINT (the CLI).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from rlhf_core.cli import write_json
from rlhf_core.config import ConfigError, WeightServerConfig
from rlhf_core.wire import WireError, optional, unpack
from weight_server import protocol as P
from weight_server.auth import ZapHandler, signer_for
from weight_server.endpoint import Endpoint, peer
from weight_server.handlers import Handlers
from weight_server.metrics import ServerMetrics
from weight_server.persist import Persister, load_all
from weight_server.shm import ShmDir, free_bytes
from weight_server.sockets import Context
from weight_server.store import Refused, Version, VersionStore

log = logging.getLogger("weight_server")

_MAX_BATCH = 64  # messages handled per poll wake-up before ZAP and timers get a turn


class WeightServer:
    """Versioned parameter store served over ZeroMQ. Binds in the constructor (port 0 = random).
    ``shm_free_space(path)``: the bytes the shm filesystem can still take (tests pass a small number)."""

    def __init__(
        self, cfg: WeightServerConfig, ctx: zmq.Context | None = None, shm_free_space: Callable[[str], int] = free_bytes,
    ) -> None:
        self.cfg = cfg
        self._closed = False
        self.persister: Persister | None = None
        self.shm: ShmDir | None = None
        self.endpoint: Endpoint | None = None
        cfg.check()
        signer = signer_for(cfg)
        if cfg.chunk_bytes < 1 or cfg.max_inflight_chunks < 1:
            raise ConfigError(
                f"weight_server.chunk_bytes ({cfg.chunk_bytes}) and max_inflight_chunks ({cfg.max_inflight_chunks}) "
                "must both be >= 1"
            )
        if cfg.chunk_bytes > cfg.max_frame_bytes:
            raise ConfigError(f"weight_server.chunk_bytes {cfg.chunk_bytes} exceeds max_frame_bytes {cfg.max_frame_bytes}")
        self._own_ctx: Context | None = None
        if ctx is None:
            # two I/O threads: an upload arriving and chunks leaving for followers need not queue behind each other
            ctx = self._own_ctx = Context(io_threads=2)
        self.ctx = ctx
        self.zap: ZapHandler | None = None
        self._metrics = ServerMetrics()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self.zap = ZapHandler(self.ctx, cfg) if cfg.auth == "curve" else None  # before any CURVE bind
            self.endpoint = Endpoint(cfg, self.ctx, self._metrics, signer)
            self.address, self.pub_address = self.endpoint.address, self.endpoint.pub_address
            self._open_shm(shm_free_space)
            self.store = VersionStore(cfg.keep_versions, slab_factory=self.shm.new_slab if self.shm is not None else None,
                                      max_uploads=cfg.max_uploads, max_upload_bytes=cfg.max_upload_bytes,
                                      max_version_bytes=cfg.max_version_bytes)
            self._held: dict[str, list[int]] = {}  # replaced (never mutated) so metrics() may read it from any thread
            self.persister = Persister(cfg.persist_dir) if cfg.persist_dir else None
            if cfg.persist_dir:
                self._restore(cfg.persist_dir)
            self._said_out_of_files = False
            self.handlers = Handlers(cfg, self.store, self._metrics, self.endpoint, self._committed, self.metrics, self.shm)
            if cfg.address_file:
                target = Path(cfg.address_file).expanduser()
                target.parent.mkdir(parents=True, exist_ok=True)
                write_json(target, {"address": self.address, "pub_address": self.pub_address, "pid": os.getpid()})
        except BaseException:
            self._close()
            raise
        log.info(
            "weight server listening on %s (announcements on %s; bound to %s), auth=%s, keeping %d version(s), shm %s",
            self.address, self.pub_address, self.endpoint.host, cfg.auth, cfg.keep_versions,
            self.shm.path if self.shm is not None else "off",
        )

    def _open_shm(self, shm_free_space: Callable[[str], int]) -> None:
        """The private shared-memory folder for version slabs; without one every byte goes over TCP."""
        if self.cfg.shm != "auto":
            return
        try:
            self.shm = ShmDir(self.cfg.shm_dir, shm_free_space)
        except OSError as exc:
            log.warning(
                "no shared memory for weights: cannot make a folder in weight_server.shm_dir=%s (%s); every byte goes "
                "over TCP (set weight_server.shm_dir to a writable tmpfs, or weight_server.shm=off to silence this)",
                self.cfg.shm_dir, exc,
            )

    def _restore(self, persist_dir: str) -> None:
        """Serve the versions a previous server persisted, as if they had just been published."""
        cfg = self.cfg
        for ver in load_all(persist_dir, cfg.max_tensors, cfg.max_version_bytes, self.store.pool.take):
            self.store.add(ver)
            lay = ver.layout
            self._metrics.published(
                ver.name, ver.version, lay.total_bytes, lay.data_bytes, 0, len(lay.tensors), 0, False,
                ver.begin_mono, ver.visible_mono, 0.0, source="disk",
            )
            log.info("serving %s v%d (%d bytes) restored from %s", ver.name, ver.version, lay.data_bytes, persist_dir)
        self._held = self.store.held()

    def start(self) -> WeightServer:
        """Run the loop on a daemon thread; returns self."""
        if self._thread is not None:
            raise RuntimeError("the weight server is already running")
        self._thread = threading.Thread(target=self._loop, name="weight-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Run the loop in this thread until stop(), SIGTERM or SIGINT."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, lambda signum, frame: self._stop.set())
        try:
            self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop, join its thread and close everything. A loop thread still running after
        ``timeout`` keeps its sockets (closing them under it is not safe) and is logged."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.error("the weight server's thread did not stop within %g s; leaving its sockets open", timeout)
                return
        self._close()

    def __enter__(self) -> WeightServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def metrics(self) -> dict[str, Any]:
        """Per version: bytes, publish duration, pulls, per-worker applied latency; plus counters."""
        snap = self._metrics.snapshot(self._held)
        if self.zap is not None:
            snap["counters"]["auth_refused"] += self.zap.refused
        snap["counters"]["anonymous_slabs"] += self.store.pool.anonymous
        snap["uploads"] = {"in_progress": len(self.store.uploads), "bytes": self.store.upload_bytes()}
        return snap

    def _committed(self, ver: Version) -> None:
        self._held = self.store.held()
        if self.persister is not None:
            self.persister.submit(ver)

    def _close(self) -> None:
        """Close what the constructor opened (all of it, or as far as it got), even if a step fails."""
        if self._closed:
            return
        self._closed = True
        try:
            self._metrics.log.flush()  # the log ends on the last version published and applied
            if self.persister is not None:
                self.persister.close()
        finally:
            if self.endpoint is not None:
                self.endpoint.close()
            if self.zap is not None:
                self.zap.close()
            if self._own_ctx is not None:
                self._own_ctx.close()
            if self.shm is not None:
                self.shm.close()

    @property
    def _end(self) -> Endpoint:
        """The endpoint (None only while the server is built, or after a failed constructor)."""
        assert self.endpoint is not None
        return self.endpoint

    def _loop(self) -> None:
        poller = zmq.Poller()
        router = self._end.router
        poller.register(router, zmq.POLLIN)
        if self.zap is not None:
            poller.register(self.zap.sock, zmq.POLLIN)
        next_announce = next_expire = time.monotonic()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(100))
                if self.zap is not None and self.zap.sock in events:
                    while self.zap.sock.poll(0):
                        self.zap.handle()
                if router in events:
                    for _ in range(_MAX_BATCH):
                        if not self._recv_one():
                            break
                        self.handlers.flush_aborted()
                now = time.monotonic()
                if now >= next_announce:
                    next_announce = now + self.cfg.announce_interval_s
                    for name in self.store.held():
                        self._end.announce(self.store.newest(name))
                if now >= next_expire:
                    next_expire = now + 1.0
                    for up in self.store.expire(self.cfg.upload_timeout_s, now):
                        self._metrics.count("uploads_aborted")
                        log.warning("dropped upload of %s v%d: no chunk for %.0f s", up.name, up.version, self.cfg.upload_timeout_s)
                    self.handlers.flush_aborted()
                    self.handlers.expire_leases(now)
                    self.store.pool.collect()
                    self._check_open_files()
        finally:
            if self._thread is None:
                self._close()

    def _check_open_files(self) -> None:
        """Count a second in which this process has no file descriptor left, and say it once: ZeroMQ
        then fails every accept silently, so new subscribers wait without an error."""
        try:
            os.close(os.open(os.devnull, os.O_RDONLY))
            return
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                return
        self._metrics.count("out_of_files")
        if self._said_out_of_files:
            return
        self._said_out_of_files = True
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        log.warning(
            "weight server out of file descriptors (this process may open %d, hard limit %d): it accepts no new "
            "subscriber or puller until some close, and they wait without an error, keeping old weights; raise the "
            "limit of open files (ulimit -Hn, systemd LimitNOFILE=) and restart it. Said once; counted as "
            "out_of_files (seconds) in its metrics", soft, hard,
        )

    def _recv_one(self) -> bool:
        """Receive and handle one message; False when none is waiting."""
        end = self._end
        try:
            ident = end.router.recv(zmq.NOBLOCK)
        except zmq.Again:
            return False
        if not end.router.rcvmore:
            return True  # an empty message: nothing to answer
        head = end.router.recv(copy=False)
        try:
            obj = P.decode(head.buffer, P.CLIENT_KINDS, self.cfg.max_header_bytes, self.cfg.max_manifest_bytes)
        except WireError as exc:
            end.drain()
            self._metrics.count("malformed")
            code = P.E_TOO_LARGE if len(head.buffer) > self.cfg.max_header_bytes else P.E_MALFORMED
            log.warning("malformed message from %s: %s", peer(head), exc)
            end.error(ident, _loose_rid(head.bytes), code, f"malformed message: {exc}")
            return True
        try:
            self._dispatch(ident, obj, head)
        except Exception as exc:  # one request's failure must not end the loop that serves every other
            end.drain()
            self._metrics.count("internal_errors")
            log.exception("the weight server failed on a %s from %s", obj["kind"], peer(head))
            end.error(ident, obj.get("rid"), P.E_INTERNAL,
                      f"the weight server failed on this {obj['kind']}: {type(exc).__name__}: {exc} (see its log)")
        return True

    def _dispatch(self, ident: bytes, obj: dict[str, Any], head: Any) -> None:
        if obj["kind"] == P.PUB_CHUNK:
            self._on_pub_chunk(ident, obj, head)
            return
        end = self._end
        extra = end.recv_rest()
        if extra is None:
            self._metrics.count("malformed")
            end.error(ident, obj.get("rid"), P.E_MALFORMED, f"a {obj['kind']} message has too many frames")
            return
        if not end.authentic(ident, obj, head, [head.buffer], extra):
            return
        try:
            self.handlers.table[obj["kind"]](ident, obj)
        except WireError as exc:
            self._metrics.count("malformed")
            log.warning("invalid %s from %s: %s", obj["kind"], peer(head), exc)
            end.error(ident, obj.get("rid"), P.E_MALFORMED, f"invalid {obj['kind']}: {exc}")
        except Refused as exc:
            self.handlers.refused(ident, obj, exc)

    def _on_pub_chunk(self, ident: bytes, obj: dict[str, Any], head: Any) -> None:
        """A chunk of an upload: its data frames land in the upload's slab (``shm: true``: the publisher
        wrote them there); the watermark advances and parked followers are answered."""
        end = self._end
        try:
            upload = P.req_int(obj, "upload")
            via_shm = optional(obj, "shm", bool, False)
            up = self.store.uploads.get(upload)
            total = up.layout.total_bytes if up else 0
            segments = P.parse_segments(obj, total) if up else []
            targets = self.store.chunk_targets(upload, segments, shm=via_shm)
        except (WireError, Refused) as exc:
            end.drain()
            code = exc.code if isinstance(exc, Refused) else P.E_MALFORMED
            if code == P.E_MALFORMED:
                self._metrics.count("malformed")
            end.error(ident, None, code, f"chunk refused: {exc}")
            return
        problem = end.recv_data(targets)  # the data lands in the upload's slab; nothing is visible before commit
        extra = end.recv_rest() if problem is None else None
        if extra is None:
            if problem is None:
                problem = "chunk has too many frames"
            end.drain()
            self.store.abort(upload)
            self._metrics.count("uploads_aborted")
            self._metrics.count("malformed")
            end.error(ident, None, P.E_BAD_CHUNK, f"upload {upload} aborted: {problem}")
            return
        if not end.authentic(ident, obj, head, [head.buffer, *targets], extra):
            self.store.abort(upload)  # unauthenticated bytes may have been written into it
            self._metrics.count("uploads_aborted")
            return
        self.store.received(upload, segments)
        assert up is not None  # chunk_targets refused an unknown upload
        if up.parked:
            self.handlers.chunk_arrived(up)


def _loose_rid(data: bytes) -> int | None:
    """The request id of a header that failed validation, if it can be read at all (for the reply)."""
    try:
        rid = unpack(data, max_bytes=64 * 1024).get("rid")
    except WireError:
        return None
    return rid if isinstance(rid, int) else None

