"""Real servers for tests: a private redis-server and ZeroMQ sockets that cannot hang a test.

No fakes: integration tests talk to a real ``redis-server`` started here on a random loopback
port in a temp dir (AOF on), which a test may kill and restart.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from buffer.local_server import RedisServer, free_port  # noqa: E402,F401  (one implementation, shared with rlhf-run)


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive TCP ports that were all free a moment ago, for settings
    that give process i the port + i (``rollout.prometheus_port``). Taken below Linux's ephemeral
    range (32768 and up), where the kernel hands out ports to outgoing connections and to
    :func:`free_port`, so the port next to a free one may be some connection's by then."""
    import random
    import socket

    for _ in range(200):
        base = random.randrange(20000, 32768 - count)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports found on {host} between 20000 and 32768")


@contextmanager
def redis_server(workdir: Path, **kwargs) -> Iterator[RedisServer]:
    server = RedisServer(workdir, **kwargs).start()
    try:
        yield server
    finally:
        server.stop()


def zmq_context():
    """A ZeroMQ context whose sockets default to linger=0; ``close()`` closes them all and never
    blocks for ever (:class:`weight_server.sockets.Context`)."""
    from weight_server.sockets import Context

    return Context()


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
