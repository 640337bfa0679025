"""Weight-server metrics: per version bytes, publish duration, pulls and per-worker sync latency.

Updated by the server thread, read from any thread (a lock and a deep copy). Weight-sync latency
is taken on the server's monotonic clock, from PUB_BEGIN to the worker's APPLIED report. The log
is paced (:class:`PacedLog`): a small model publishes tens of versions a second.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("weight_server")

#: Seconds between two INFO lines about the same recurring event; the ones between go to DEBUG.
LOG_EVERY_S = 10.0

#: Counter names (defined once; the launcher forwards them to Redis/Prometheus).
COUNTERS = (
    "published",          # versions made visible
    "duplicate_publishes",  # retried publishes of a version already held (answered without transfer)
    "stale_refused",      # pushes of a version <= the newest held
    "hash_mismatch",      # uploads dropped because bytes did not match their hash
    "incomplete",         # uploads committed with missing bytes
    "uploads_aborted",    # uploads superseded, timed out or refused mid-way
    "uploads_refused",    # upload starts refused: weight_server.max_uploads / max_upload_bytes in progress
    "malformed",          # frames that failed to decode or validate
    "internal_errors",    # requests the server failed on (logged with their traceback; the loop goes on)
    "auth_refused",       # messages or peers refused by HMAC or CURVE
    "pulls",              # manifests served (a pull starts with one)
    "pulls_tcp",          # pulls whose bytes went over TCP (no shm offered, or the client could not use it)
    "pulls_shm",          # pulls that read the slab from shared memory (counted when the lease is released)
    "shm_fallbacks",      # shm offered to a puller that could not use it (token or mapping failed): TCP instead
    "shm_leases_expired",  # leases never released in time (a dead or stuck puller); their slabs are not recycled
    "publishes_shm",      # uploads whose bytes the publisher copied into shared memory
    "anonymous_slabs",    # slabs the shm folder had no room for (those versions go over TCP only)
    "chunks_served",
    "bytes_served",
    "dropped_replies",    # replies to peers whose queue was full or who went away
    "out_of_files",       # seconds in which the server had no file descriptor left (it accepted no new peer)
)


@dataclass
class _Pace:
    """One key of a :class:`PacedLog`."""

    last_info: float  # when its last INFO line was written
    between: int = 0  # events after that line and before the held one
    slowest: float = 0.0  # the slowest of those
    held: tuple[str, tuple[Any, ...], float] | None = None  # the newest event not at INFO: (msg, args, seconds)

    def hold(self, msg: str, args: tuple[Any, ...], seconds: float) -> None:
        if self.held is not None:  # the event held so far is one between now
            self.between += 1
            self.slowest = max(self.slowest, self.held[2])
        self.held = (msg, args, seconds)

    def since(self) -> tuple[int, float]:
        """(count, slowest) of every event after the last INFO line, the held one included."""
        if self.held is None:
            return self.between, self.slowest
        return self.between + 1, max(self.slowest, self.held[2])


class PacedLog:
    """INFO lines for an event that recurs many times a second, per key: the first at once, then at
    most one each ``every_s`` saying how many came between and the slowest; the others go to DEBUG.
    :meth:`flush` writes each key's last event not yet at INFO (the log ends on the final state). Thread-safe."""

    def __init__(self, logger: logging.Logger, every_s: float = LOG_EVERY_S, clock: Any = time.monotonic) -> None:
        self.logger, self.every_s, self.clock = logger, float(every_s), clock
        self._keys: dict[Any, _Pace] = {}
        self._lock = threading.Lock()

    def event(self, key: Any, seconds: float, msg: str, *args: Any) -> None:
        """One event of ``key`` that took ``seconds``; ``msg % args`` describes it."""
        now = self.clock()
        with self._lock:
            pace = self._keys.get(key)
            since: tuple[int, float] | None = None
            if pace is not None and now - pace.last_info < self.every_s:
                pace.hold(msg, args, seconds)
            else:
                since = pace.since() if pace is not None else (0, 0.0)
                self._keys[key] = _Pace(now)
        if since is None:  # held
            self.logger.debug(msg, *args)
        else:
            self._info(msg, args, *since)

    def flush(self) -> None:
        lines = []
        with self._lock:
            for key, pace in self._keys.items():
                if pace.held is not None:
                    lines.append((*pace.held[:2], pace.between, pace.slowest))
                    self._keys[key] = _Pace(pace.last_info)
        for msg, args, count, slowest in lines:
            self._info(msg, args, count, slowest)

    def _info(self, msg: str, args: tuple[Any, ...], count: int, slowest: float) -> None:
        if count:
            msg += " (%d more since the line before, the slowest %.3f s)"
            args = (*args, count, slowest)
        self.logger.info(msg, *args)


class ServerMetrics:
    def __init__(self, history: int = 32, log_every_s: float = LOG_EVERY_S) -> None:
        self.history = history
        self.counters: Counter[str] = Counter({k: 0 for k in COUNTERS})
        self.versions: dict[str, OrderedDict[int, dict[str, Any]]] = {}
        self.log = PacedLog(log, log_every_s)  # published versions (per name) and applies (per worker and name)
        self._lock = threading.Lock()

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n

    def published(
        self, name: str, version: int, total_bytes: int, data_bytes: int, wire_bytes: int, tensors: int,
        changed: int, delta: bool, begin_mono: float, visible_mono: float, verify_s: float, source: str = "publish",
        followers: int = 0,
    ) -> dict[str, Any]:
        rec = {
            "bytes": data_bytes,
            "layout_bytes": total_bytes,
            "wire_bytes": wire_bytes,
            "tensors": tensors,
            "changed_tensors": changed,
            "delta": delta,
            "source": source,
            "published_at": time.time(),
            "publish_duration_s": visible_mono - begin_mono,
            "verify_s": verify_s,
            "pulls": followers,  # pulls that followed the upload (cut-through) count too
            "pulls_shm": 0,
            "chunks_served": 0,
            "bytes_served": 0,
            "applied": {},
            "_begin_mono": begin_mono,
        }
        with self._lock:
            per = self.versions.setdefault(name, OrderedDict())
            per[version] = rec
            while len(per) > self.history:
                per.popitem(last=False)
            if source == "publish":
                self.counters["published"] += 1
                self.counters["pulls"] += followers
        return rec

    def pulled(self, name: str, version: int) -> None:
        with self._lock:
            self.counters["pulls"] += 1
            rec = self._record(name, version)
            if rec is not None:
                rec["pulls"] += 1

    def pull_path(self, name: str, version: int, shm: bool, fallback: bool = False) -> None:
        """A pull's bytes came over shared memory (``shm``) or TCP (``fallback``: after an shm offer)."""
        with self._lock:
            self.counters["pulls_shm" if shm else "pulls_tcp"] += 1
            if fallback:
                self.counters["shm_fallbacks"] += 1
            rec = self._record(name, version)
            if rec is not None and shm:
                rec["pulls_shm"] += 1

    def served(self, name: str, version: int, nbytes: int) -> None:
        with self._lock:
            self.counters["chunks_served"] += 1
            self.counters["bytes_served"] += nbytes
            rec = self._record(name, version)
            if rec is not None:
                rec["chunks_served"] += 1
                rec["bytes_served"] += nbytes

    def applied(self, name: str, version: int, worker: str, apply_s: float | None, now_mono: float) -> float | None:
        """Record that ``worker`` applied ``version``; returns the publish->applied latency (s)."""
        with self._lock:
            rec = self._record(name, version)
            if rec is None or worker in rec["applied"]:
                return None  # unknown version (evicted from history) or a repeated report
            latency = now_mono - rec["_begin_mono"]
            rec["applied"][worker] = {"latency_s": latency, "apply_s": apply_s}
        self.log.event(("applied", worker, name), latency, "worker %s applied %s v%d %.3f s after publish began",
                       worker, name, version, latency)
        return latency

    def _record(self, name: str, version: int) -> dict[str, Any] | None:
        """``version`` of ``name`` as published; None when unknown or evicted from the history."""
        per = self.versions.get(name)
        return None if per is None else per.get(version)

    def snapshot(self, held: dict[str, list[int]]) -> dict[str, Any]:
        with self._lock:
            versions = {
                name: {v: {k: val for k, val in rec.items() if not k.startswith("_")} for v, rec in per.items()}
                for name, per in self.versions.items()
            }
            return {"held": held, "counters": dict(self.counters), "versions": copy.deepcopy(versions)}
