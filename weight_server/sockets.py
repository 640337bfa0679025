"""A ZeroMQ context that closes the sockets made from it and never blocks for ever doing so.

A plain ``zmq.Context`` that the garbage collector finds in a reference cycle with its open
sockets hangs the collecting thread: its ``term()`` runs before the sockets' finalizers, and
pyzmq tracks them in a WeakSet the collector clears first. :class:`Context` holds its sockets
strongly, closes them with linger 0 on ``close()`` (and ``with``, and collection), and waits for
termination at most ``timeout_s``. Close it from the thread that used its sockets, or after it ended.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

import zmq

log = logging.getLogger(__name__)

TERM_TIMEOUT_S = 5.0

_exiting = False  # at interpreter exit daemon threads may still be using sockets: leave them be


def _notice_exit() -> None:
    global _exiting
    _exiting = True


atexit.register(_notice_exit)


class Context(zmq.Context):
    """``zmq.Context`` whose sockets default to linger 0 and are closed by :meth:`close`."""

    _open: list[zmq.Socket]  # declared here: pyzmq takes any other attribute for a context option

    def __init__(self, io_threads: int = 1) -> None:
        super().__init__(io_threads)
        self._open = []
        self.setsockopt(zmq.LINGER, 0)  # closing never waits for unsent messages

    def socket(self, socket_type: int, *args: Any, **kwargs: Any) -> zmq.Socket:
        sock = super().socket(socket_type, *args, **kwargs)
        self._open = [s for s in self._open if not s.closed]
        self._open.append(sock)
        return sock

    def close(self, timeout_s: float = TERM_TIMEOUT_S) -> bool:
        """Close every socket made here (linger 0), then terminate the context, waiting at most
        ``timeout_s``; False (logged) when a socket made elsewhere keeps it open."""
        if self.closed:
            return True
        for sock in self._open:
            sock.close(linger=0)
        self._open = []
        # term() in a thread of its own: it releases the GIL while it waits, so the wait can be bounded
        term = threading.Thread(target=self.term, name="zmq-term", daemon=True)
        term.start()
        term.join(timeout_s)
        if term.is_alive():
            log.warning("a ZeroMQ context did not terminate within %g s: a socket made from it outside "
                        "Context.socket is still open; leaving it", timeout_s)
            return False
        return True

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not self.closed and not _exiting:
            self.close()
