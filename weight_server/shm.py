"""The server's side of the same-host data path: slab files in a private shared-memory folder, and
the leases that keep a slab from being recycled while a puller maps it.

The folder ``<shm_dir>/rlhf-ws-<pid>-<random>/`` (0700) holds ``token`` (random bytes: a client
that reads the same bytes there sees this server's files), ``lock`` (``flock``-ed for the
server's life, so a later server tells a dead server's folder from a live one) and ``slab-<n>``
files (0600, pages reserved with ``posix_fallocate``: a full tmpfs fails at creation, never with
a SIGBUS). Removed on close; a starting server removes dead servers' folders. :func:`private_dir`
makes such folders under any prefix (the vllm engine's too).
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import mmap
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from weight_server import protocol as P
from weight_server.slabs import Slab

log = logging.getLogger("weight_server")

MAX_LEASES = 4096  # outstanding pull leases; beyond this pulls go over TCP
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # pre-fault the pages once, at creation
_LOCK_FILE = "lock"


def free_bytes(path: str) -> int:
    """Bytes an unprivileged process may still allocate in the filesystem of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def reserve_bytes(path: str) -> int:
    """Room left for everyone else in the shm filesystem (NCCL, DataLoader workers): a tenth of
    it, at most 1 GiB."""
    st = os.statvfs(path)
    return min(1 << 30, st.f_blocks * st.f_frsize // 10)


class ShmDir:
    """A private folder of slab files under ``parent``; raises OSError if it cannot be made."""

    def __init__(self, parent: str, free_space: Callable[[str], int] = free_bytes) -> None:
        self.parent = parent
        self.free_space = free_space
        self.path, self._folder_lock = private_dir(parent, P.SHM_DIR_PREFIX)
        try:
            self.token = secrets.token_bytes(P.SHM_TOKEN_BYTES)
            self.token_path = str(self.path / P.SHM_TOKEN_FILE)
            fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(self.token)
        except OSError:
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        self._seq = itertools.count(1)
        self._lock = threading.Lock()  # the server thread and the pool's spare-making thread both make slabs
        self._warned = False
        self._closed = False

    def new_slab(self, nbytes: int) -> Slab | None:
        """A slab backed by a new file here, or None when the filesystem cannot hold it."""
        if self._closed:
            return None
        size = max(nbytes, 1)
        try:
            room = self.free_space(str(self.path)) - reserve_bytes(str(self.path))
        except OSError:
            room = -1
        if size > room:
            self._no_room(size, max(room, 0), "not enough free space")
            return None
        path = str(self.path / f"{P.SHM_SLAB_PREFIX}{next(self._seq)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            self._no_room(size, room, str(exc))
            return None
        try:
            try:
                os.posix_fallocate(fd, 0, size)  # reserve every page now: ENOSPC here, not SIGBUS later
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)  # a filesystem without fallocate: the free-space check must do
            buf = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            self._no_room(size, room, str(exc))
            return None
        os.close(fd)  # the mapping keeps the file's pages
        return Slab(size, buffer=buf, path=path)

    def _no_room(self, size: int, room: int, why: str) -> None:
        with self._lock:
            warn, self._warned = not (self._warned or self._closed), True  # closed: a spare raced the shutdown
        if warn:  # once per server: every later version would say the same
            log.warning(
                "shared memory %s cannot hold a slab of %.1f MB (%s; %.1f MB usable): that version is served over "
                "TCP only. Give the container a larger /dev/shm (docker run --shm-size=...), point "
                "weight_server.shm_dir at a larger tmpfs, or set weight_server.shm=off to stop trying",
                self.parent, size / 1e6, why, room / 1e6,
            )

    def offer(self, slab: Slab, total_bytes: int, lease: int | None = None, lease_s: float = 0.0) -> P.ShmOffer | None:
        """What a client needs to map ``slab`` (None for an anonymous slab)."""
        if slab.path is None or self._closed:
            return None
        return P.ShmOffer(slab.path, 0, total_bytes, self.token_path, self.token, lease, float(lease_s))

    def close(self) -> None:
        """Remove the folder (the mappings that exist stay valid until their owners unmap them)."""
        if self._closed:
            return
        self._closed = True
        shutil.rmtree(self.path, ignore_errors=True)
        self._folder_lock.close()


def private_dir(parent: str, prefix: str) -> tuple[Path, BinaryIO]:
    """A new folder ``<parent>/<prefix><pid>-<random>`` (0700) with its ``lock`` file, locked while
    the returned file stays open, after :func:`remove_stale`."""
    remove_stale(parent, prefix)
    path = Path(parent) / f"{prefix}{os.getpid()}-{secrets.token_hex(6)}"
    path.mkdir(mode=0o700)
    try:
        lock = os.fdopen(os.open(path / _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600), "r+b", buffering=0)
        fcntl.flock(lock, fcntl.LOCK_EX)  # waits out a sweeper elsewhere testing it this instant
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path, lock


def remove_stale(parent: str, prefix: str = P.SHM_DIR_PREFIX) -> list[str]:
    """Remove the folders dead owners left in ``parent``: named <prefix><pid>-<hex>, this user's,
    whose pid is not running and whose lock no process holds (an owner in another PID namespace holds it)."""
    removed: list[str] = []
    name = re.compile(re.escape(prefix) + r"(\d+)-[0-9a-f]+$")
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        m = name.match(entry.name)
        if not m or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.geteuid() or _pid_alive(int(m.group(1))):
                continue
            if not _lock_is_free(Path(entry.path) / _LOCK_FILE):
                continue
        except OSError:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
        log.info("removed %s, left behind by a process that is no longer running (pid %s)", entry.path, m.group(1))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lock_is_free(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        # No lock file: a server killed between mkdir and its lock, or one being made right now.
        return time.time() - path.parent.stat().st_mtime > 60
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@dataclass
class Lease:
    slab: Slab
    deadline: float
    name: str
    version: int


class Leases:
    """Pull leases: a leased slab is pinned (never recycled); a lease not released by its
    deadline is dropped and its slab tainted (never recycled at all: its reader may still map it)."""

    def __init__(self, limit: int = MAX_LEASES) -> None:
        self.limit = limit
        self.held: dict[int, Lease] = {}

    def take(self, slab: Slab, ttl_s: float, name: str, version: int, now: float | None = None) -> int | None:
        """Pin ``slab`` for a puller; None when too many leases are out (the pull goes over TCP)."""
        if len(self.held) >= self.limit:
            return None
        now = time.monotonic() if now is None else now
        lease = secrets.randbits(62)
        slab.pin()
        self.held[lease] = Lease(slab, now + ttl_s, name, version)
        return lease

    def release(self, lease: int) -> Lease | None:
        held = self.held.pop(lease, None)
        if held is not None:
            held.slab.unpin()
        return held

    def renew(self, slab: Slab, ttl_s: float, now: float | None = None) -> None:
        """Restart the clock of the leases on ``slab`` (a followed upload committed: its pullers
        start reading now)."""
        now = time.monotonic() if now is None else now
        for held in self.held.values():
            if held.slab is slab:
                held.deadline = now + ttl_s

    def expire(self, now: float | None = None) -> list[Lease]:
        now = time.monotonic() if now is None else now
        gone = [lease for lease, held in self.held.items() if now > held.deadline]
        out = []
        for lease in gone:
            held = self.held.pop(lease)
            held.slab.tainted = True
            held.slab.unpin()
            out.append(held)
        return out
