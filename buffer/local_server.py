"""A private redis-server child process: random loopback port (or another interface, with a
password), data in a temp dir, AOF on.

`rlhf-run` uses it when no ``buffer.url`` is given, and the integration tests use it (they
kill and restart it by PID). It is stopped by PID, never by a shutdown command to some other
Redis.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from rlhf_core.cli import die_with_parent as _die_with_parent
from rlhf_core.errors import UserError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server child process on a random port, with its data in ``workdir``."""

    def __init__(self, workdir: str | os.PathLike, password: str | None = None, appendonly: bool = True,
                 fsync: str = "always", die_with_parent: bool = False, host: str = "127.0.0.1") -> None:
        self.workdir = Path(workdir)
        # another interface than loopback (other machines' workers reach it): only with a password
        if host not in ("127.0.0.1", "localhost") and not password:
            raise UserError(f"a redis-server bound to {host} is reachable from other machines: give it a password")
        self.host = host
        self.die_with_parent = die_with_parent  # SIGTERM (flush the AOF, exit) when the starting process dies
        self.password = password
        self.appendonly = appendonly
        self.fsync = fsync  # always: a SIGKILL loses nothing (tests); everysec: at most a second (runs)
        self.port = 0
        self.proc: subprocess.Popen | None = None
        binary = shutil.which("redis-server")
        if binary is None:
            raise UserError(
                "redis-server is not installed; install it (Debian: apt-get install -y redis-server, "
                "or run ./quickstart.sh which does) or pass buffer.url=redis://host:port of a running Redis"
            )
        self.binary = binary

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "server not running"
        return self.proc.pid

    def start(self, port: int | None = None) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            self.port = port or free_port(self.host)
            args = self.args()
            # own process group: a Ctrl-C aimed at the launcher does not kill Redis before the
            # children have written their final state
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True,
                                         preexec_fn=_die_with_parent(signal.SIGTERM) if self.die_with_parent else None)
            if self._wait_ready(10.0):
                return self
            self.stop()
            if port is not None:
                break
        raise UserError(f"redis-server did not start; see {self.workdir / 'redis.log'}")

    def args(self) -> list[str]:
        """The command line of this server (port, data dir, append-only file)."""
        args = [
            self.binary, "--port", str(self.port), "--bind", self.host, "--protected-mode", "yes",
            "--dir", str(self.workdir),
            "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", self.fsync,
            "--save", "", "--daemonize", "no", "--logfile", str(self.workdir / "redis.log"),
        ]
        if self.password:
            args += ["--requirepass", self.password]
        return args

    def restart_command(self) -> str:
        """What to type to bring this server back on the same port and data (its AOF)."""
        return shlex.join(self.args())

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
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

    def restart(self, sig: int = signal.SIGKILL) -> RedisServer:
        """Kill (by default without a chance to save) and start again on the same port and data dir."""
        port = self.port
        self.stop(sig)
        return self.start(port=port)
