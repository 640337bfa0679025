"""Memory for versions: one contiguous slab per version, recycled once nothing reads it.

An evicted slab is reused for a later upload of its size once ZeroMQ has sent from it (tracked
zero-copy sends) and no shared-memory lease pins it: fresh pages cost more than the transfer.
A slab is anonymous memory or a file mapping (``weight_server.shm``); a file slab a reader may map
without a lease is *tainted*: never recycled, its file removed once nothing sends from it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger("weight_server")


class Slab:
    """One contiguous byte buffer holding a version (or an upload in progress): anonymous memory,
    or ``buffer`` (a shared mapping of the file ``path``)."""

    def __init__(self, nbytes: int, buffer: Any = None, path: str | None = None) -> None:
        self.array = np.empty(max(nbytes, 1), dtype=np.uint8) if buffer is None else np.frombuffer(buffer, dtype=np.uint8)
        self.view = self.array.data
        self.path = path
        self.tainted = False  # someone may map it outside a lease: never recycle it
        self.trackers: list[Any] = []  # zmq.MessageTracker of zero-copy sends still reading this slab
        self._pins = 0
        self._lock = threading.Lock()

    def discard(self) -> None:
        """Remove the backing file (mappings that exist stay valid until they are unmapped)."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    @property
    def capacity(self) -> int:
        return len(self.array)

    def pin(self) -> None:
        with self._lock:
            self._pins += 1

    def unpin(self) -> None:
        with self._lock:
            self._pins -= 1

    def track(self, tracker: Any) -> None:
        self.trackers.append(tracker)
        if len(self.trackers) > 256:
            self.trackers = [t for t in self.trackers if not t.done]

    def idle(self) -> bool:
        self.trackers = [t for t in self.trackers if not t.done]
        with self._lock:
            return self._pins == 0 and not self.trackers


SlabFactory = Callable[[int], "Slab | None"]


class SlabPool:
    """Recycles slabs of evicted versions once nothing reads them. ``factory(nbytes)`` makes a
    file-backed slab, or None (no room in shared memory: the version lives in anonymous memory)."""

    def __init__(self, max_free: int = 2, factory: SlabFactory | None = None) -> None:
        self.max_free = max_free
        self.factory = factory
        self.free: list[Slab] = []
        self.retiring: list[Slab] = []
        self.anonymous = 0  # slabs taken in anonymous memory although a file was wanted
        self._made: list[Slab] = []  # spares a background thread made, not yet in `free`
        self._making = False
        self._lock = threading.Lock()

    def prepare(self, nbytes: int) -> None:
        """Make a file slab for the next upload of ``nbytes`` on a background thread unless a free one
        fits (making one for a large model would stall the requests behind its PUB_BEGIN)."""
        self.collect()
        if self.factory is None or self._making or any(s.path is not None and self._fits(s, nbytes) for s in self.free):
            return
        self._making = True
        threading.Thread(target=self._make, args=(self.factory, nbytes), name="weight-slab", daemon=True).start()

    def _make(self, factory: SlabFactory, nbytes: int) -> None:
        slab = None
        try:
            slab = factory(nbytes)
        except Exception:  # noqa: BLE001  # the upload that wants it makes its own; later ones try again
            log.exception("weight server: a spare slab of %d bytes could not be made", nbytes)
        finally:
            with self._lock:
                if slab is not None:
                    self._made.append(slab)
                self._making = False

    @staticmethod
    def _fits(slab: Slab, nbytes: int) -> bool:
        return nbytes <= slab.capacity <= 2 * max(nbytes, 1)

    def take(self, nbytes: int) -> Slab:
        self.collect()
        fits = [s for s in self.free if self._fits(s, nbytes)]
        filed = [s for s in fits if s.path is not None]
        if filed or (fits and self.factory is None):
            return self._reuse(min(filed or fits, key=lambda s: s.capacity))
        made = self.factory(nbytes) if self.factory is not None else None
        if made is not None:
            return made
        if self.factory is not None:
            self.anonymous += 1  # no room for a file: this version lives in anonymous memory
        return self._reuse(min(fits, key=lambda s: s.capacity)) if fits else Slab(nbytes)

    def _reuse(self, slab: Slab) -> Slab:
        self.free.remove(slab)
        return slab

    def give(self, slab: Slab) -> None:
        self.retiring.append(slab)
        self.collect()

    def collect(self) -> None:
        with self._lock:
            made, self._made = self._made, []
        self.free.extend(made)
        still = []
        for slab in self.retiring:
            if not slab.idle():
                still.append(slab)
            elif slab.tainted:
                slab.discard()
            else:
                self.free.append(slab)
        self.retiring = still
        for slab in self.free[: max(0, len(self.free) - self.max_free)]:  # oldest first
            slab.discard()
        del self.free[: max(0, len(self.free) - self.max_free)]
