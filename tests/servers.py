"""Real servers for tests: a private redis-server and ZeroMQ sockets that cannot hang a test.

No fakes: integration tests talk to a real ``redis-server`` started here on a random loopback
port in a temp dir (AOF on), which a test may kill and restart.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server child process on a random port, with its data in ``workdir``."""

    def __init__(self, workdir: Path, password: str | None = None, appendonly: bool = True) -> None:
        self.workdir = Path(workdir)
        self.password = password
        self.appendonly = appendonly
        self.port = 0
        self.proc: subprocess.Popen | None = None
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: apt-get install redis-server (the README's commands do this)")
        self.binary = binary

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, port: int | None = None) -> "RedisServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        for attempt in range(5):
            self.port = port or free_port()
            args = [
                self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
                "--save", "", "--daemonize", "no", "--logfile", str(self.workdir / "redis.log"),
            ]
            if self.password:
                args += ["--requirepass", self.password]
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_ready(5.0):
                return self
            self.stop()
            if port is not None:
                break
        raise RuntimeError(f"redis-server did not start; see {self.workdir / 'redis.log'}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    if self.password:
                        s.sendall(f"AUTH {self.password}\r\n".encode())
                        s.recv(64)
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.02)
        return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop by PID (SIGTERM lets Redis flush; SIGKILL simulates a crash)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def restart(self, sig: int = signal.SIGKILL) -> "RedisServer":
        """Kill (by default without a chance to save) and start again on the same port and data dir."""
        port = self.port
        self.stop(sig)
        return self.start(port=port)


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
