"""Persisting the newest version of each parameter set as a safetensors file, so a restarted
server serves it again. Written without torch (``safetensors.torch.load_file`` reads it), with the
version and content hash in ``__metadata__``: :func:`load_all` re-hashes and skips a file that
does not match. Writes go tmp + fsync + rename, on a background thread (newest wins).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from weight_server import protocol as P
from weight_server.slabs import Slab
from weight_server.store import Version

log = logging.getLogger(__name__)

FORMAT = "rlhf-weight-server/1"
SUFFIX = ".safetensors"
_ST_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}
_WIRE_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


def path_for(directory: str | os.PathLike, name: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return Path(directory).expanduser() / f"{safe}{SUFFIX}"


def write_version(directory: str | os.PathLike, ver: Version) -> Path:
    """Write ``ver`` atomically (tmp + fsync + rename); returns the file path."""
    header: dict[str, object] = {
        "__metadata__": {
            "format": FORMAT, "name": ver.name, "version": str(ver.version), "content_hash": ver.content_hash.hex(),
        }
    }
    pos = 0
    for t in ver.layout.tensors:
        header[t.name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format recommends an 8-byte aligned data start
    final = path_for(directory, ver.name)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_suffix(final.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in ver.layout.tensors:
            f.write(ver.slab.view[t.offset : t.offset + t.nbytes])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def read_version(
    path: str | os.PathLike, max_tensors: int, max_version_bytes: int, new_slab: Callable[[int], Slab] = Slab,
) -> Version:
    """Load one persisted version into ``new_slab(nbytes)`` (the server's pool: shared memory when
    it can); raises ValueError saying what is wrong."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("file shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise ValueError(f"header of {n} bytes is implausible")
        header = json.loads(f.read(n))
        meta = header.pop("__metadata__", None) or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"not written by the weight server (format {meta.get('format')!r})")
        if len(header) > max_tensors:
            raise ValueError(f"{len(header)} tensors exceed max_tensors {max_tensors}")
        entries, ranges = [], []
        for name in sorted(header):
            spec = header[name]
            dtype = _WIRE_DTYPES.get(spec.get("dtype"))
            if dtype is None:
                raise ValueError(f"tensor {name!r}: dtype {spec.get('dtype')!r} is not supported")
            entries.append((name, dtype, tuple(int(d) for d in spec["shape"])))
            ranges.append(tuple(spec["data_offsets"]))
        layout = P.make_layout(entries)
        if layout.total_bytes > max_version_bytes:
            raise ValueError(f"{layout.total_bytes} bytes exceed max_version_bytes {max_version_bytes}")
        data_start = 8 + n
        slab = new_slab(layout.total_bytes)
        try:
            hashes = _read_tensors(f, layout, ranges, data_start, slab)
        except BaseException:
            slab.discard()  # a shared-memory slab's file would otherwise stay until the server stops
            raise
    layout = layout.with_hashes(hashes)
    digest = layout.content_hash()
    if digest.hex() != meta.get("content_hash"):
        slab.discard()
        raise ValueError("content hash does not match the stored bytes (torn or modified file)")
    now = time.monotonic()
    return Version(str(meta["name"]), int(meta["version"]), layout, slab, digest, now, now)


def _read_tensors(f: Any, layout: P.Layout, ranges: list[tuple[int, ...]], data_start: int, slab: Slab) -> list[bytes]:
    hashes = []
    for t, (begin, end) in zip(layout.tensors, ranges):
        if end - begin != t.nbytes:
            raise ValueError(f"tensor {t.name!r}: {end - begin} bytes stored, shape needs {t.nbytes}")
        f.seek(data_start + begin)
        got = f.readinto(slab.view[t.offset : t.offset + t.nbytes]) if t.nbytes else 0
        if got != t.nbytes:
            raise ValueError(f"tensor {t.name!r}: file truncated")
        hashes.append(P.tensor_hash(slab.view[t.offset : t.offset + t.nbytes]))
    return hashes


def load_all(
    directory: str | os.PathLike, max_tensors: int, max_version_bytes: int, new_slab: Callable[[int], Slab] = Slab,
) -> Iterator[Version]:
    """Every valid persisted version in ``directory``; invalid files are logged and skipped."""
    folder = Path(directory).expanduser()
    if not folder.is_dir():
        return
    for path in sorted(folder.glob(f"*{SUFFIX}")):
        try:
            yield read_version(path, max_tensors, max_version_bytes, new_slab)
        except (ValueError, KeyError, TypeError, OSError) as exc:
            log.warning("ignoring persisted weights %s: %s", path, exc)


class Persister:
    """Writes the newest version per name on a background thread; a newer version replaces a
    pending (not yet started) write of an older one."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._pending: dict[str, Version] = {}
        self._cond = threading.Condition()
        self._stop = False
        self.written: dict[str, int] = {}
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="weight-persist", daemon=True)
        self._thread.start()

    def submit(self, ver: Version) -> None:
        ver.slab.pin()  # the slab must not be recycled while it is being written
        with self._cond:
            old = self._pending.pop(ver.name, None)
            self._pending[ver.name] = ver
            self._cond.notify()
        if old is not None:
            old.slab.unpin()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stop:
                    self._cond.wait()
                if not self._pending:
                    return
                name = next(iter(self._pending))
                ver = self._pending.pop(name)
            try:
                path = write_version(self.directory, ver)
                self.written[ver.name] = ver.version
                log.info("persisted %s v%d to %s", ver.name, ver.version, path)
            except OSError as exc:
                self.errors += 1
                log.error("could not persist %s v%d to %s: %s", ver.name, ver.version, self.directory, exc)
            finally:
                ver.slab.unpin()

    def close(self, timeout: float = 30.0) -> None:
        """Finish pending writes (up to ``timeout`` seconds), then stop the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)
