"""A worker's ear on the server's announcements: the newest version of one parameter set.

The server repeats the newest committed version on its PUB socket and announces an upload as it
starts (``pending``: cut-through). A SUB socket never blocks: while the server is down the newest
version heard stays the answer.
"""

from __future__ import annotations

import logging

import zmq

from rlhf_core.config import WeightServerConfig
from rlhf_core.wire import WireError, decode_record
from weight_server import protocol as P
from weight_server.auth import MAC_BYTES, Signer, configure_client_socket
from weight_server.errors import WeightAuthError

log = logging.getLogger(__name__)


class Announcements:
    """Versions of ``name`` announced on ``pub_address``. Not thread-safe (one per thread)."""

    def __init__(
        self, pub_address: str, cfg: WeightServerConfig, ctx: zmq.Context, name: str, signer: Signer | None,
    ) -> None:
        self.cfg = cfg
        self.name = name
        self.signer = signer
        self.committed: int | None = None  # newest committed version heard of
        self.pending: int | None = None  # newest version whose upload has started (cut-through)
        self.sub = ctx.socket(zmq.SUB)
        try:
            self.sub.linger = 0
            self.sub.rcvhwm = 1000
            self.sub.maxmsgsize = cfg.max_header_bytes + 4096
            configure_client_socket(self.sub, cfg)
            self.sub.setsockopt(zmq.SUBSCRIBE, name.encode())
            self.sub.connect(pub_address)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.sub.close(linger=0)

    def poll(self, timeout_ms: int = 0, pending: bool = False) -> int | None:
        """The newest version announced so far (None: none heard yet), waiting at most
        ``timeout_ms`` for one; ``pending=True`` also counts uploads that have only started."""
        if self.sub.poll(timeout_ms):
            while True:
                try:
                    frames = self.sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got = self._parse(frames)
                if got is None:
                    continue
                version, is_pending = got
                if is_pending:
                    self.pending = version if self.pending is None else max(self.pending, version)
                elif self.committed is None or version > self.committed:
                    self.committed = version
        if pending and self.pending is not None and (self.committed is None or self.pending > self.committed):
            return self.pending
        return self.committed

    def saw_commit(self, version: int) -> None:
        """A followed upload committed: count it as announced (its announcement may come later)."""
        self.committed = version if self.committed is None else max(self.committed, version)

    def _parse(self, frames: list[bytes]) -> tuple[int, bool] | None:
        if self.signer is not None:
            if len(frames) != 3 or len(frames[2]) != MAC_BYTES or not self.signer.verify(frames[1:2], frames[2]):
                raise WeightAuthError(
                    "an announcement from the weight server failed the HMAC check: weight_server.secret differs "
                    "from the server's"
                )
        elif len(frames) != 2:
            log.warning("ignoring an announcement of %d frames (is the server using auth=hmac?)", len(frames))
            return None
        try:
            obj = decode_record(frames[1], P.ANNOUNCE, max_bytes=self.cfg.max_header_bytes)
            if P.req_name(obj) != self.name:
                return None
            return P.req_int(obj, "version"), obj.get("pending") is True
        except WireError as exc:
            log.warning("ignoring a malformed announcement: %s", exc)
            return None
