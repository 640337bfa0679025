"""Real servers for tests: a private redis-server and ZeroMQ sockets that cannot hang a test.

No fakes: integration tests talk to a real ``redis-server`` started here on a random loopback
port in a temp dir (AOF on), which a test may kill and restart.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


from buffer.local_server import RedisServer, free_port  # noqa: E402,F401  (one implementation, shared with rlhf-run)


@contextmanager
def redis_server(workdir: Path, **kwargs) -> Iterator[RedisServer]:
    server = RedisServer(workdir, **kwargs).start()
    try:
        yield server
    finally:
        server.stop()


def zmq_context():
    """A ZeroMQ context whose sockets default to linger=0 (closing never blocks)."""
    import zmq

    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    return ctx


def recv_with_timeout(sock, timeout_ms: int = 5000, multipart: bool = False):
    """Receive or raise TimeoutError: a test can fail but never hang."""
    import zmq

    if not sock.poll(timeout_ms, zmq.POLLIN):
        raise TimeoutError(f"no message within {timeout_ms} ms")
    return sock.recv_multipart() if multipart else sock.recv()


def wait_for(predicate, timeout_s: float, what: str, interval: float = 0.02):
    """Poll ``predicate`` until it returns something truthy (returned), or fail after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval)
