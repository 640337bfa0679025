"""What the publisher and the subscriber share: their :class:`Client` base and the :class:`Channel`,
one DEALER connection to the server with request ids (a late reply to an abandoned request is
discarded), timeouts on every wait (a call can fail but never hang), HMAC framing, and a socket
monitor that turns a refused CURVE handshake into a :class:`WeightAuthError` at once.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any, Self

import zmq
from zmq.utils.monitor import recv_monitor_message

from rlhf_core.config import WeightServerConfig
from rlhf_core.wire import WireError
from weight_server import protocol as P
from weight_server.auth import MAC_BYTES, configure_client_socket, signer_for
from weight_server.errors import WeightAuthError
from weight_server.shm_map import ShmMaps
from weight_server.sockets import Context

log = logging.getLogger(__name__)

_monitor_ids = itertools.count()
_AUTH_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_AUTH}
_HANDSHAKE_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL}
_MONITORED = (
    zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)


class NoReply(Exception):
    """No reply (or no connection to send on) within the timeout: the server is down or busy."""


class Client:
    """The config, the shared-memory mappings and a context of its own unless given one; the
    publisher and the subscriber add their sockets (:meth:`_close_sockets`). Not thread-safe."""

    def __init__(self, cfg: WeightServerConfig, ctx: zmq.Context | None) -> None:
        self.cfg = cfg
        cfg.check_shm()
        self._maps = ShmMaps() if cfg.shm == "auto" else None
        self._own_ctx: Context | None = None
        if ctx is None:
            ctx = self._own_ctx = Context()
        self.ctx = ctx

    def _close_sockets(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Close the sockets (linger 0), the mappings and an own context."""
        try:
            self._close_sockets()
        finally:
            self._release()

    def _release(self) -> None:
        """Close the mappings and an own context; also after a failed constructor."""
        try:
            if self._maps is not None:
                self._maps.close()
        finally:
            if self._own_ctx is not None:
                self._own_ctx.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Channel:
    """A DEALER socket to ``address`` with request ids, timeouts, HMAC and auth diagnosis (one per thread)."""

    def __init__(self, address: str, cfg: WeightServerConfig, ctx: zmq.Context, rcvhwm: int = 64) -> None:
        self.address = address
        self.cfg = cfg
        self.ctx = ctx
        self.rcvhwm = rcvhwm
        self.signer = signer_for(cfg)
        self._rids = itertools.count(secrets.randbits(30))
        self._connected = False
        self._handshaken = False
        self._open()

    def _open(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        monitor: zmq.Socket | None = None
        try:
            sock.linger = 0
            # immediate: a request sent while the server is down is refused at once, not replayed later
            sock.immediate = True
            sock.sndhwm = max(2, self.cfg.max_inflight_chunks)
            sock.rcvhwm = self.rcvhwm
            sock.reconnect_ivl = 100
            sock.reconnect_ivl_max = 1000
            sock.maxmsgsize = max(self.cfg.max_frame_bytes, self.cfg.max_manifest_bytes)
            configure_client_socket(sock, self.cfg)
            monitor = sock.get_monitor_socket(_MONITORED, addr=f"inproc://ws-monitor-{id(self)}-{next(_monitor_ids)}")
            sock.connect(self.address)
        except BaseException:
            _close(sock, monitor)
            raise
        self.sock, self.monitor = sock, monitor
        self._connected = self._handshaken = False

    def reset(self) -> None:
        """Drop the socket (and anything queued on it) and connect afresh."""
        self.close()
        self._open()

    def close(self) -> None:
        """Close the socket and its monitor; idempotent. :meth:`reset` opens new ones."""
        _close(self.sock, self.monitor)

    def _wait(self, event: int, timeout_s: float) -> None:
        """Block until the socket is readable/writable; NoReply on timeout, WeightAuthError on a
        refused handshake."""
        poller = zmq.Poller()
        poller.register(self.sock, event)
        poller.register(self.monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._diagnose_timeout(timeout_s)
                raise NoReply(f"no reply from the weight server at {self.address} within {timeout_s:g} s")
            ready = dict(poller.poll(max(1, int(left * 1000))))
            if self.monitor in ready:
                self._read_monitor()
            if self.sock in ready:
                return

    def _read_monitor(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshaken = True
            elif event in _AUTH_FAILED:
                raise WeightAuthError(
                    f"the weight server at {self.address} refused our CURVE client key: add this client's public "
                    "key (weight_server.curve_client_public) to the server's authorised keys"
                )
            elif event in _HANDSHAKE_FAILED:
                raise WeightAuthError(
                    f"CURVE handshake with the weight server at {self.address} failed: weight_server.curve_server_public "
                    "does not match the server's key (or the server does not use auth=curve)"
                )

    def _diagnose_timeout(self, timeout_s: float) -> None:
        self._read_monitor()
        if self.cfg.auth == "curve" and self._connected and not self._handshaken:
            raise WeightAuthError(
                f"no reply within {timeout_s:g} s from {self.address}: wrong CURVE key or server down "
                "(check weight_server.curve_server_public and the client key pair)"
            )

    def send(self, kind: str, data: Sequence[Any] = (), timeout_s: float | None = None, **fields: Any) -> int:
        """Send one message; returns its request id. NoReply if it cannot be queued in time."""
        rid = next(self._rids)
        header = P.encode(kind, rid=rid, **fields)
        frames: list[Any] = [header, *data]
        if self.signer is not None:
            frames.append(self.signer.sign(frames))
        self._wait(zmq.POLLOUT, self.cfg.request_timeout_s if timeout_s is None else timeout_s)
        # The first part is accepted (POLLOUT said so); the rest of a multipart message always follows.
        self.sock.send_multipart(frames, zmq.NOBLOCK, copy=len(data) == 0)
        return rid

    def recv(self, timeout_s: float, into: Callable[[dict[str, Any]], list[memoryview] | None] | None = None) -> dict[str, Any]:
        """Receive one reply. For a CHUNK, ``into(header)`` names the buffers its data frames go to
        (None: discard them; the reply comes back marked ``discarded``)."""
        self._wait(zmq.POLLIN, timeout_s)
        head = self.sock.recv()
        try:
            obj = P.decode(head, P.SERVER_KINDS, self.cfg.max_header_bytes, self.cfg.max_manifest_bytes)
        except WireError as exc:
            self._drain()
            raise WireError(f"unreadable reply from the weight server at {self.address}: {exc}") from None
        views: list[memoryview] = []
        # A CHUNK notice (``shm: true``: the bytes are in the follower's mapping) carries no data
        # frame; under HMAC its next frame is the MAC, which must not be taken for chunk data.
        if obj["kind"] == P.CHUNK and obj.get("shm") is not True and self.sock.rcvmore:
            wanted = into(obj) if into is not None else None
            if wanted is None:  # a late reply to an abandoned request: discard its data unread
                self._drain()
                obj["discarded"] = True
                return obj
            views = wanted
            for view in views:
                got = self.sock.recv_into(view) if self.sock.rcvmore else -1
                if got != len(view):
                    self._drain()
                    raise WireError(f"chunk {obj.get('chunk')}: data frame of {got} bytes, expected {len(view)}")
        rest: list[bytes] = []
        while self.sock.rcvmore:
            if len(rest) > 4:
                self._drain()
                raise WireError("reply has too many frames")
            rest.append(self.sock.recv())
        self._check_auth(obj, [head, *views], rest)
        return obj

    def request(self, kind: str, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send a request and wait for the reply with its id (other replies are discarded)."""
        timeout_s = self.cfg.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        rid = self.send(kind, timeout_s=timeout_s, **fields)
        while True:
            obj = self.recv(max(0.001, deadline - time.monotonic()))
            if obj.get("rid") == rid:
                return obj
            log.debug("discarding a reply to another request: %s", obj.get("kind"))

    def _check_auth(self, obj: dict[str, Any], signed: list[Any], rest: list[bytes]) -> None:
        is_auth_error = obj["kind"] == P.ERROR and P.error_code(obj) == P.E_AUTH
        if self.signer is not None:
            if len(rest) == 1 and len(rest[0]) == MAC_BYTES and self.signer.verify(signed, rest[0]):
                if is_auth_error:
                    raise WeightAuthError(f"the weight server at {self.address} refused our message: {obj.get('message')}")
                return
            if is_auth_error:
                raise WeightAuthError(
                    f"the weight server at {self.address} refused our HMAC: weight_server.secret differs from the "
                    f"server's ({obj.get('message')})"
                )
            if not rest:
                raise WeightAuthError(
                    f"the weight server at {self.address} sent an unsigned reply: it does not use auth=hmac; "
                    "set the same weight_server.auth on every process"
                )
            raise WeightAuthError(
                f"a reply from the weight server at {self.address} failed the HMAC check: weight_server.secret differs "
                "from the server's"
            )
        if is_auth_error:
            raise WeightAuthError(
                f"the weight server at {self.address} requires authentication: {obj.get('message')} "
                "(set weight_server.auth and its keys/secret to match the server)"
            )
        if rest:
            raise WeightAuthError(
                f"the weight server at {self.address} signs its replies (auth=hmac): set weight_server.auth=hmac "
                "and weight_server.secret"
            )

    def _drain(self) -> None:
        while self.sock.rcvmore:
            self.sock.recv_into(bytearray())


def _close(sock: zmq.Socket, monitor: zmq.Socket | None) -> None:
    """Close a channel's socket (linger 0) and its monitor socket, unless closed already."""
    if sock.closed:
        return
    if monitor is not None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        monitor.close(linger=0)
    sock.close(linger=0)
