"""The clients' side of the same-host data path: map a server's slab file, once proven to be the
server's, and move tensor bytes in or out of it.

:meth:`ShmMaps.open` compares the offer's token with the server's token file before it opens
anything else (another host, container or user sees no such file or other bytes, and the caller
falls back to TCP); files are opened without following links, must be regular files of this
user, and are mapped once per file. Nothing read is trusted before its tensor hashes match.
"""

from __future__ import annotations

import hmac
import logging
import mmap
import os
import stat
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

from weight_server import protocol as P

log = logging.getLogger(__name__)

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


class ShmUnavailable(Exception):
    """The offered shared memory cannot be used by this process (the message says why)."""


class ShmMaps:
    """Verified, cached mappings of weight-server slab files (one per client; not thread-safe).
    Mappings of files the server removed are dropped at the next open (each keeps its file open)."""

    def __init__(self, max_files: int = 4) -> None:
        self.max_files = max_files
        self._maps: OrderedDict[str, tuple[tuple[int, int, int, bool], int, mmap.mmap]] = OrderedDict()
        self._warned: set[tuple[str, str]] = set()

    def open(self, offer: P.ShmOffer, writable: bool) -> np.ndarray:
        """The offered bytes ``[offset, offset + size)`` as a uint8 array (read-only unless
        ``writable``). Raises ShmUnavailable saying why it cannot be used here."""
        check_token(offer)
        self._drop_removed()
        try:
            fd = os.open(offer.path, (os.O_RDWR if writable else os.O_RDONLY) | _OPEN_FLAGS)
        except OSError as exc:
            raise ShmUnavailable(f"cannot open {offer.path}: {exc.strerror}") from None
        keep = False
        try:
            st = _own_file(fd, offer.path)
            if st.st_size < offer.offset + offer.size:
                raise ShmUnavailable(f"{offer.path} holds {st.st_size} bytes, fewer than the offered {offer.offset + offer.size}")
            key = (st.st_dev, st.st_ino, st.st_size, writable)
            cached = self._maps.get(offer.path)
            if cached is not None and cached[0] == key:
                self._maps.move_to_end(offer.path)
                buf = cached[2]
            else:
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
                try:
                    buf = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=prot)
                except OSError as exc:
                    raise ShmUnavailable(f"cannot map {offer.path}: {exc.strerror}") from None
                self._forget(offer.path)
                self._maps[offer.path] = (key, fd, buf)
                keep = True
                while len(self._maps) > self.max_files:
                    self._forget(next(iter(self._maps)))
        finally:
            if not keep:
                os.close(fd)
        arr = np.frombuffer(buf, dtype=np.uint8, count=offer.size, offset=offer.offset)
        if not writable:
            arr.flags.writeable = False  # the pages are mapped read-only: a write would crash the process
        return arr

    def _forget(self, path: str) -> None:
        entry = self._maps.pop(path, None)
        if entry is not None:
            os.close(entry[1])  # the mapping itself goes when no array uses it any more

    def _drop_removed(self) -> None:
        for path, (_, fd, _) in list(self._maps.items()):
            if os.fstat(fd).st_nlink == 0:
                self._forget(path)

    def warn_once(self, who: str, offer: P.ShmOffer, exc: Exception) -> None:
        """Log why an offer was not usable, once per server folder and reason."""
        key = (os.path.dirname(offer.token_path), type(exc).__name__ + str(exc).split(":")[0])
        if key in self._warned:
            log.debug("%s: shared memory not usable (%s); using TCP", who, exc)
            return
        self._warned.add(key)
        log.warning(
            "%s: the weight server offered shared memory in %s but it is not usable here (%s); moving the bytes over "
            "TCP instead (normal for a client on another host or in another container; weight_server.shm=off stops "
            "the offers)", who, os.path.dirname(offer.token_path), exc,
        )

    def close(self) -> None:
        for path in list(self._maps):
            self._forget(path)


def check_token(offer: P.ShmOffer) -> None:
    """Raise ShmUnavailable unless ``offer.token_path`` is a file of this user holding ``offer.token``."""
    try:
        fd = os.open(offer.token_path, os.O_RDONLY | _OPEN_FLAGS)
    except FileNotFoundError:
        raise ShmUnavailable(f"no file {offer.token_path} here: the server's shared memory is not this machine's") from None
    except OSError as exc:
        raise ShmUnavailable(f"cannot read {offer.token_path}: {exc.strerror}") from None
    try:
        _own_file(fd, offer.token_path)
        data = os.read(fd, P.SHM_TOKEN_BYTES + 1)
    finally:
        os.close(fd)
    if not hmac.compare_digest(data, offer.token):
        raise ShmUnavailable(f"token mismatch: {offer.token_path} belongs to another server (another host or container)")


def _own_file(fd: int, path: str) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise ShmUnavailable(f"{path} is not a regular file of this user")
    return st


COPY_BLOCK = 8 << 20  # one memcpy of hundreds of MB out of a shm mapping runs at half the speed of 8 MB pieces


def copy_bytes(dst: np.ndarray, src: Any) -> None:
    """``dst[:] = src`` (uint8, equal lengths) in COPY_BLOCK pieces: single-threaded memcpy that
    releases the GIL."""
    src = src if isinstance(src, np.ndarray) else np.frombuffer(src, dtype=np.uint8)
    for start in range(0, len(dst), COPY_BLOCK):
        np.copyto(dst[start : start + COPY_BLOCK], src[start : start + COPY_BLOCK])


def copy_and_hash(dst: np.ndarray, src: np.ndarray, layout: P.Layout, indices: Iterable[int]) -> dict[int, bytes]:
    """Copy tensors ``indices`` from ``src`` to the same offsets of ``dst``, hashing each piece of
    ``dst`` right after it is written (still in cache); returns {i: hash}."""
    out = {}
    for i in indices:
        t = layout.tensors[i]
        h = P.tensor_hasher()
        for start in range(t.offset, t.offset + t.nbytes, COPY_BLOCK):
            end = min(start + COPY_BLOCK, t.offset + t.nbytes)
            np.copyto(dst[start:end], src[start:end])
            h.update(dst[start:end])
        out[i] = h.digest()
    return out


def hash_tensors(data: np.ndarray, layout: P.Layout, indices: Iterable[int]) -> dict[int, bytes]:
    """{i: hash of tensor i's bytes in ``data``} for ``indices``."""
    out = {}
    for i in indices:
        t = layout.tensors[i]
        out[i] = P.tensor_hash(data[t.offset : t.offset + t.nbytes])
    return out
