"""The weight server's two sockets: the ROUTER it answers requests on and the PUB it announces on.

Binding, the addresses clients connect to, a request's remaining frames, the HMAC check, and
every outgoing frame (replies, a chunk's data zero-copy and tracked, errors, announcements): the
:class:`~weight_server.handlers.Replies` port of the handlers. Owned by the server's loop thread.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from rlhf_core.config import ConfigError, WeightServerConfig
from weight_server import protocol as P
from weight_server.auth import MAC_BYTES, Signer, configure_server_socket
from weight_server.metrics import ServerMetrics
from weight_server.store import Upload, Version

log = logging.getLogger("weight_server")

_MAX_EXTRA_FRAMES = 8


class Endpoint:
    """Binds in the constructor; a bind that fails closes what was made and raises ConfigError."""

    def __init__(self, cfg: WeightServerConfig, ctx: zmq.Context, metrics: ServerMetrics, signer: Signer | None) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.signer = signer
        self._metrics = metrics
        self._sockets: list[zmq.Socket] = []
        self._auth_log_at = 0.0
        try:
            self.host = self._bind()
        except BaseException:
            self.close()
            raise

    def _bind(self) -> str:
        """Bind the ROUTER and the PUB socket, set the addresses clients use and return the host bound to."""
        cfg = self.cfg
        host = "127.0.0.1" if cfg.host == "localhost" else cfg.host
        self.router = self._socket(zmq.ROUTER)
        # Each honest puller has at most max_inflight_chunks replies queued; the high-water mark
        # leaves room for that and drops (counts) replies to a peer that ignores its credit.
        self.router.sndhwm = 4 * cfg.max_inflight_chunks + 16
        self.router.rcvhwm = 4 * cfg.max_inflight_chunks + 16
        self.router.router_mandatory = True  # a reply to a vanished peer raises instead of vanishing
        self.router.maxmsgsize = max(cfg.max_frame_bytes, cfg.max_manifest_bytes)
        self.pub = self._socket(zmq.PUB)
        self.pub.sndhwm = 1000
        bind_host = f"[{host}]" if ":" in host else host
        if ":" in host:
            self.router.ipv6 = self.pub.ipv6 = True
        for sock, port, setting in ((self.router, cfg.port, "port"), (self.pub, cfg.pub_port, "pub_port")):
            try:
                sock.bind(f"tcp://{bind_host}:{port}")
            except zmq.ZMQError as exc:
                raise ConfigError(
                    f"weight server cannot bind tcp://{bind_host}:{port} (weight_server.{setting}): {exc}; "
                    "choose a free port, or 0 for a random one"
                ) from None
        connect_host = "127.0.0.1" if host in ("0.0.0.0", "*") else ("[::1]" if host in ("::", "::1") else bind_host)
        self.port = _port_of(self.router)
        self.pub_port = _port_of(self.pub)
        self.address = f"tcp://{connect_host}:{self.port}"
        self.pub_address = f"tcp://{connect_host}:{self.pub_port}"
        return host

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        self._sockets.append(sock)
        sock.linger = 0
        configure_server_socket(sock, self.cfg)
        return sock

    def close(self) -> None:
        for sock in self._sockets:
            sock.close(linger=0)

    def recv_rest(self) -> list[bytes] | None:
        """The request's remaining frames; None (and the rest drained) when there are too many."""
        frames: list[bytes] = []
        while self.router.rcvmore:
            if len(frames) >= _MAX_EXTRA_FRAMES:
                self.drain()
                return None
            frames.append(self.router.recv())
        return frames

    def drain(self) -> None:
        while self.router.rcvmore:
            self.router.recv_into(bytearray())  # discard without allocating a Python copy

    def recv_data(self, targets: list[memoryview]) -> str | None:
        """Receive one data frame straight into each of ``targets``; the problem when the frames
        do not match them (fewer frames, or a frame of another size)."""
        for view in targets:
            if not self.router.rcvmore:
                return f"chunk declares {len(targets)} segments but has fewer data frames"
            got = self.router.recv_into(view)
            if got != len(view):
                return f"a data frame of {got} bytes does not match its segment of {len(view)} bytes"
        return None

    def authentic(self, ident: bytes, obj: dict[str, Any], head: Any, signed: list[Any], extra: list[bytes]) -> bool:
        """Check the HMAC frame (auth=hmac) or the absence of stray frames; reply and count if not."""
        if self.signer is None:
            if not extra:
                return True
            reason = "unexpected trailing frame: this server runs without HMAC (auth=none or curve); use the same weight_server.auth"
        else:
            if len(extra) == 1 and len(extra[0]) == MAC_BYTES and self.signer.verify(signed, extra[0]):
                return True
            reason = "HMAC check failed: weight_server.secret differs from the server's (or auth is not hmac)"
        self._metrics.count("auth_refused")
        now = time.monotonic()
        if now - self._auth_log_at > 5.0:  # rate-limited: a misconfigured worker must not flood the log
            self._auth_log_at = now
            log.warning("refused %s from %s: %s", obj.get("kind"), peer(head), reason)
        self.error(ident, obj.get("rid"), P.E_AUTH, reason)
        return False

    def send(self, ident: bytes, header: bytes, data: memoryview | None = None, slab: Any = None) -> None:
        frames: list[Any] = [header] if data is None else [header, data]
        mac = self.signer.sign(frames) if self.signer is not None else None
        try:
            self.router.send(ident, zmq.SNDMORE | zmq.NOBLOCK)
            if data is None:
                self.router.send(header, zmq.SNDMORE if mac else 0)
            else:
                self.router.send(header, zmq.SNDMORE)
                tracker = self.router.send(data, zmq.SNDMORE if mac else 0, copy=False, track=True)
                if slab is not None:
                    slab.track(tracker)
            if mac:
                self.router.send(mac)
        except (zmq.Again, zmq.ZMQError) as exc:  # queue full (peer ignores credits) or peer gone
            self._metrics.count("dropped_replies")
            log.debug("dropped a reply: %s", exc)

    def error(self, ident: bytes, rid: Any, code: str, message: str) -> None:
        rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else None
        self.send(ident, P.encode(P.ERROR, rid=rid, code=code, message=message))

    def announce(self, ver: Version | Upload | None, pending: bool = False) -> None:
        if ver is None:
            return
        frames: list[Any] = [
            ver.name.encode(),
            P.encode(
                P.ANNOUNCE, name=ver.name, version=ver.version, content_hash=ver.content_hash,
                total_bytes=ver.layout.total_bytes, pending=pending,
            ),
        ]
        if self.signer is not None:
            frames.append(self.signer.sign(frames[1:]))
        try:
            self.pub.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass


def _port_of(sock: zmq.Socket) -> int:
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return int(endpoint.rsplit(":", 1)[1])


def peer(frame: Any) -> str:
    """The sender's address of a received frame, for logs."""
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError):
        return "unknown peer"
