"""Lease keeping: the prompts this worker holds in the buffer (claim, release, heartbeat).

A heartbeat thread renews the leases every ``buffer.heartbeat_interval_s`` (also during a long
step, a weight pull or the shutdown drain), with the worker's stats, and learns which ones another
worker took over; the main thread takes those (:meth:`LeaseKeeper.take_lost`) and abandons their
groups. The buffer client is not thread-safe for one consumer: both threads use it under one lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from buffer import Lease, WorkerClient
from rollout_workers.stats import WorkerStats

log = logging.getLogger(__name__)

BUSY_CLAIM_BACKOFF_S = 0.05  # a busy worker whose claim got nothing retries after this (not every step)


class LeaseKeeper:
    """See the module docstring. ``stats_record()`` builds what each heartbeat carries; ``stats``
    counts the time spent waiting for prompts and the prompts released."""

    def __init__(self, buffer: WorkerClient, worker_id: str, interval_s: float, stats: WorkerStats,
                 stats_record: Callable[[], dict[str, Any]]) -> None:
        self.buffer, self.worker_id, self.interval_s = buffer, worker_id, interval_s
        self.stats, self.stats_record = stats, stats_record
        self._lock = threading.Lock()
        self._lost: set[str] = set()  # lease ids a heartbeat found taken over; guarded by _lock
        self._last_stats: dict[str, Any] = {"version": None}  # the last stats record that built
        self._next_claim_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def using(self) -> Iterator[WorkerClient]:
        """The buffer, under the lock the heartbeat thread takes too."""
        with self._lock:
            yield self.buffer

    def group_size(self) -> int | None:
        """The run's group size; None until the learner has initialised the run."""
        with self._lock:
            return int(self.buffer.run_params()["group_size"]) if self.buffer.initialised() else None

    def claim(self, max_prompts: int, block_s: float, waiting: AbstractContextManager[Any] | None = None) -> list[Lease]:
        """Up to ``max_prompts`` leases, waiting up to ``block_s`` for them inside ``waiting`` (which
        yields the claim's ``interrupt``). A claim that may not wait and got nothing is tried again
        only after BUSY_CLAIM_BACKOFF_S."""
        now = time.monotonic()
        if max_prompts <= 0 or (block_s == 0 and now < self._next_claim_at):
            return []
        with self._lock, waiting or contextlib.nullcontext(None) as interrupt:
            leases = self.buffer.claim(self.worker_id, max_prompts=max_prompts, block_s=block_s, interrupt=interrupt)
        self.stats.t_wait += time.monotonic() - now
        if not leases:
            self._next_claim_at = time.monotonic() + BUSY_CLAIM_BACKOFF_S
        return leases

    def take_lost(self) -> set[str]:
        """The lease ids heartbeats found taken over since the last call."""
        with self._lock:
            lost, self._lost = self._lost, set()
        return lost

    def keep(self, lease_id: str) -> None:
        """``lease_id`` is held again (this worker claimed it back): a loss a heartbeat found for its
        old delivery does not count."""
        with self._lock:
            self._lost.discard(lease_id)

    def release(self, leases: list[Lease], why: str, which: str) -> None:
        """Give ``leases`` back to the buffer, re-delivered at once (best effort: on a crash Redis may
        be away, and then they simply expire)."""
        if not leases:
            return
        try:
            with self._lock:
                n = self.buffer.release(leases)
        except Exception as exc:
            log.warning("worker %s: could not release %d prompt(s) (%s); they come back after the lease timeout",
                        self.worker_id, len(leases), exc)
            return
        self.stats.released += n
        log.info("worker %s: %s; released %d %s prompt(s)", self.worker_id, why, n, which)

    # ------------------------------------------------------------------ heartbeat

    def start(self) -> None:
        """A heartbeat now, then one every interval on a thread of its own until :meth:`stop`."""
        self.heartbeat()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No more heartbeats from the thread: to the buffer, the worker goes silent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.heartbeat()

    def heartbeat(self) -> None:
        """Renew the leases, with the worker's stats. Stats that fail to build (read here while the
        main thread changes what they count) go out as the last ones that built, so the leases of a
        working worker never expire over them."""
        try:
            stats = self.stats_record()
        except Exception as exc:  # noqa: BLE001
            log.warning("worker %s: its stats failed (%s: %s); heartbeating with the last ones", self.worker_id,
                        type(exc).__name__, exc)
            stats = self._last_stats
        self._last_stats = stats
        try:
            with self._lock:
                self._lost.update(self.buffer.heartbeat(self.worker_id, stats["version"], stats))
        except Exception as exc:  # Redis away for longer than the client's retries: the main loop will notice
            log.warning("worker %s: heartbeat failed: %s", self.worker_id, exc)
