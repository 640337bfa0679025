"""The live view of a run: a thread samples the buffer once a second, keeps the snapshots in
``timeline.jsonl`` and shows the live line from them and from the learner's ``metrics.jsonl``.
This module owns ``timeline.jsonl``: its writer, its reader and the views of one snapshot the
summary and the monitor share.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rlhf_core import metric_names as M
from rlhf_core.cli import append_line
from rlhf_core.config import Config
from rlhf_core.dapo import FilterStall
from rlhf_core.errors import UserError

log = logging.getLogger(__name__)

TIMELINE_FILE = "timeline.jsonl"
SAMPLE_INTERVAL_S = 1.0
PROBE_RETRY_S = 2.0

#: timeline.jsonl gets a snapshot once max(SAMPLE_INTERVAL_S, elapsed / TIMELINE_SPAN) passed
#: since the one written before: about 1,000 (1 + ln(T / 1,000 s)) lines for a run of T seconds
#: (5,500 for a day) instead of one a second
TIMELINE_SPAN = 1000
#: snapshots the end-of-run report reads back from timeline.jsonl at most (evenly thinned)
TIMELINE_MAX_POINTS = 1000


class MetricsTail:
    """The newest line of the learner's ``metrics.jsonl``, read incrementally: each call parses
    only what was appended since the last one (a long run's file is tens of MB)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.last: dict[str, Any] = {}

    def poll(self) -> dict[str, Any]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.last
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()  # an unfinished line waits for the rest
        for line in reversed(lines):
            try:
                self.last = json.loads(line)
                break
            except json.JSONDecodeError:
                continue
        return self.last


class Eta:
    """Time left to ``learner.max_updates`` from the rate of updates since the first one seen
    (start-up excluded; a resumed run counts from its checkpoint's updates), capped by what is
    left of ``run.max_seconds``."""

    def __init__(self, target: int, started: float, max_seconds: float | None = None) -> None:
        self.target, self.started, self.max_seconds = target, started, max_seconds
        self.first: tuple[float, int] | None = None  # (time, version) when updates were first seen

    def text(self, now: float, updates: int) -> str:
        if self.first is None or updates < self.first[1]:
            self.first = (now, updates)
        t0, u0 = self.first
        left = None
        if updates > u0 and now > t0:
            left = (self.target - updates) * (now - t0) / (updates - u0)
        if self.max_seconds is not None:
            budget = max(0.0, self.started + self.max_seconds - now)
            left = budget if left is None else min(left, budget)
        if left is None:
            return "eta -"
        left = max(0.0, left)
        return f"eta {int(left) // 3600}:{int(left) % 3600 // 60:02d}:{int(left) % 60:02d}"


class Timeline:
    """``timeline.jsonl``, thinned as the run goes on (:data:`TIMELINE_SPAN`); the newest snapshot
    held back is written at :meth:`close`. The buffer's counters and the workers' totals only grow,
    so a rate between any two lines is right."""

    def __init__(self, path: Path, started: float) -> None:
        self.started = started
        self.path = path  # appended to: a resumed run continues its file
        self.written: float | None = None  # time of the last snapshot written
        self.held: dict[str, Any] | None = None  # the newest snapshot not written

    def add(self, snap: dict[str, Any]) -> bool:
        """Write ``snap`` if it is due (returns whether it was), else hold it until the next."""
        now = float(snap["time"])
        gap = max(SAMPLE_INTERVAL_S, (now - self.started) / TIMELINE_SPAN)
        if self.written is not None and now - self.written < gap - SAMPLE_INTERVAL_S / 2:
            self.held = snap
            return False
        self._write(snap)
        return True

    def _write(self, snap: dict[str, Any]) -> None:
        append_line(self.path, json.dumps(snap, default=str))  # a full disk: DiskFull naming the file
        self.written, self.held = float(snap["time"]), None

    def close(self) -> None:
        if self.held is not None:
            self._write(self.held)


def read_timeline(path: Path, max_points: int = TIMELINE_MAX_POINTS) -> list[dict[str, Any]]:
    """The snapshots of ``timeline.jsonl``, read line by line: at most ``max_points`` of them plus the
    last one, evenly thinned (every k-th line, k doubling whenever they would be more)."""
    if not path.exists():
        return []
    kept: list[str] = []
    tail: list[str] = []  # the last two lines: the very last may be cut by a crash
    stride = 1
    with path.open() as f:
        for i, line in enumerate(line for line in f if line.strip()):
            if i % stride == 0:
                kept.append(line)
                if len(kept) > max_points:
                    kept, stride = kept[::2], stride * 2
            tail = [*tail[-1:], line]
    rows = [row for row in map(_json_or_none, kept) if row is not None]
    for line in reversed(tail):
        row = _json_or_none(line)
        if row is not None:
            if all(line is not k for k in kept[-2:]):  # not read above already
                rows.append(row)
            break
    return rows


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every whole line of a JSON-lines file (one being written as it is read ends in a cut line)."""
    return [row for row in map(_json_or_none, path.read_text().splitlines()) if row is not None] if path.exists() else []


def _json_or_none(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


class RestartDrops:
    """Samples dropped as too stale right after a learner restart that numbered its weights past the
    updates they hold (a checkpoint older than the versions it had published), told apart from the
    run's other drops (fed the buffer's snapshots in order): the samples generated before the
    restart are that many versions further behind it. A restart's drops are those counted until its
    learner has trained ``max_staleness + 2`` updates past where the dead one was."""

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        self.restarts: list[dict[str, int]] = []  # {version, updates, skipped, samples_dropped_stale}
        self._last: tuple[int, int, int] | None = None  # the previous snapshot's version, updates, drops
        self._open: tuple[dict[str, int], int] | None = None  # the restart whose drops still count, drops before it

    def add(self, snap: dict[str, Any]) -> None:
        version, updates = snap.get("learner_version"), snap.get("learner_updates")
        if version is None or updates is None:  # a snapshot from before the buffer knew the updates
            return
        dropped = int(snap.get("counters", {}).get("samples_dropped_stale", 0))
        # (a learner at version 0 lost nothing: such a snapshot is a run's start, or a fresh Redis's)
        if self._last is not None and self._last[0] > 0 and version - updates > self._last[0] - self._last[1]:
            # version and updates: the dead learner's last; skipped: versions numbered without an update
            restart = {"version": self._last[0], "updates": self._last[1],
                       "skipped": version - updates - (self._last[0] - self._last[1]), "samples_dropped_stale": 0}
            self.restarts.append(restart)
            self._open = (restart, self._last[2])
        self._last = (version, updates, dropped)
        if self._open is not None:
            restart, before = self._open
            restart["samples_dropped_stale"] = max(0, dropped - before)
            if updates >= restart["updates"] + self.max_staleness + 2:
                self._open = None

    def text(self) -> str:
        """The live line's words for the newest restart's drops ("" when none)."""
        r = next((r for r in reversed(self.restarts) if r["samples_dropped_stale"]), None)
        return "" if r is None else (f"  dropped stale {r['samples_dropped_stale']} after the learner restart at "
                                     f"version {r['version']} (made before it)")


class Progress:
    """Samples the buffer once a second on its own thread (so the launcher's supervision never
    waits on Redis), writes the snapshots to ``timeline.jsonl`` and shows a live line (rich on a
    terminal; a plain line every 10 s otherwise). Only the first and the latest snapshots stay in
    memory. ``error``: a :class:`~rlhf_core.errors.UserError` the sampling met other than Redis
    being unreachable (the launcher ends the run with it)."""

    def __init__(self, cfg: Config, output_dir: Path, weight_server: Any = None) -> None:
        self.cfg = cfg
        self.weight_server = weight_server  # embedded server: its numbers are forwarded to Redis
        self.output_dir = output_dir
        self.started = time.time()
        self.first: dict[str, Any] | None = None
        self.latest: dict[str, Any] | None = None
        self.error: Exception | None = None
        self.unreachable_since: float | None = None
        self._tail = MetricsTail(output_dir / M.METRICS_FILE)
        self._eta = Eta(cfg.learner.max_updates, self.started, cfg.run.max_seconds)
        self._filter_stall = FilterStall() if cfg.algo.filter_groups else None  # every group filtered: say so
        self._timeline = Timeline(output_dir / TIMELINE_FILE, self.started)
        self._restarts = RestartDrops(cfg.algo.max_staleness)
        self._last_print = 0.0
        self._buffer: Any = None
        self._live = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.prometheus = None  # the run's scrape target (run.prometheus_port), fed every snapshot
        if cfg.run.prometheus_port is not None:
            from rlhf_run.run_exporter import RunExporter

            self.prometheus = RunExporter(cfg.buffer.run_id)
            self.prometheus_port = self.prometheus.serve(cfg.run.prometheus_port)
        if cfg.run.progress and sys.stdout.isatty():
            from rich.live import Live

            self._live = Live("", refresh_per_second=2, transient=False)
            self._live.start()

    def start(self) -> Progress:
        self._thread = threading.Thread(target=self._loop, name="progress", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        failed = False
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            try:
                self.update()
            except Exception:  # a bug in a view of the snapshot must not stop the sampling for good
                if not failed:
                    log.exception("the progress thread's sampling failed (said once; it goes on every second)")
                failed = True

    def _buf(self):
        if self._buffer is None:
            from buffer import MonitorClient

            # a short retry budget: an outage shows up within seconds (the children keep their own)
            cfg = dataclasses.replace(self.cfg.buffer, max_retry_s=min(self.cfg.buffer.max_retry_s, PROBE_RETRY_S))
            self._buffer = MonitorClient.connect(self.cfg.buffer.url, self.cfg.buffer.run_id, cfg)
        return self._buffer

    def update(self) -> None:
        """One sample: buffer snapshot -> timeline, live line. Called by the thread (and once at the end)."""
        from buffer import BufferUnavailable

        with self._lock:
            now = time.time()
            try:
                if self.weight_server is not None:
                    self._buf().publish_stats(M.WEIGHT_SERVER_STATS, weight_server_stats(self.weight_server.metrics()))
                snap = self._buf().metrics()
            except BufferUnavailable as exc:  # Redis restarting: skip beats, say so once
                if self.unreachable_since is None:
                    self.unreachable_since = now
                    log.warning("buffer unreachable: %s", exc)
                return
            except UserError as exc:  # corrupt control state: the run must end
                self.error = exc
                return
            except Exception as exc:  # a transient hiccup: skip a beat
                log.debug("metrics unavailable: %s", exc)
                return
            self.unreachable_since = None
            snap["time"] = now
            self.first = self.first or snap
            self.latest = snap
            stall = self._filter_stall and self._filter_stall.observe(now, snap.get("counters", {}))
            if stall:
                log.warning(stall)
            try:
                self._timeline.add(snap)
            except UserError as exc:  # its disk is full: the run must end (so would the learner's next line)
                self.error = self.error or exc
            self._restarts.add(snap)
            if self.prometheus is not None:
                self.prometheus.update(snap)
            line = self.line(snap)
        if self._live is not None:
            self._live.update(line)
        elif self.cfg.run.progress and now - self._last_print >= 10:
            self._last_print = now
            print(line, flush=True)

    def line(self, snap: dict[str, Any]) -> str:
        last = self._tail.poll()
        reward = last.get(M.REWARD_MEAN)
        workers = list(worker_stats(snap, self.cfg.buffer.lease_timeout_s).values())
        gen_tps = sum(float(w.get(M.WORKER_TOKENS_PER_S, 0.0)) for w in workers)
        scoring = reward_cost(workers)
        now, version = time.time(), int(last.get(M.VERSION, 0))
        eta = self._eta.text(now, int(last.get(M.UPDATES, version)))  # updates count towards learner.max_updates
        return (
            f"[{now - self.started:6.0f}s] version {version:>4}/{self.cfg.learner.max_updates}  {eta}"
            f"  reward {reward if reward is None else f'{reward:.3f}'}"
            f"  trained {last.get(M.SAMPLES_TRAINED, 0)}"
            f"  staleness(mean) {last.get(M.STALENESS_MEAN, 0):.2f}"
            f"  gen {gen_tps:.0f} tok/s  buffered {snap.get('depth', {}).get('samples_in_buffer', '?')}"
            + self._restarts.text()
            + (f"  scoring {scoring['scoring_share']:.0%} busy, {scoring['reward_calls_per_s']:.0f} calls/s"
               if scoring["scoring_share"] is not None else "")
        )

    def timeline(self) -> list[dict[str, Any]]:
        """The run's snapshots from ``timeline.jsonl``, evenly thinned (for the report at the end)."""
        return read_timeline(self.output_dir / TIMELINE_FILE)

    def close(self) -> None:
        """Stop sampling, take one last sample (the workers' final heartbeats) and write it,
        release everything."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=35)  # one sample may wait on Redis's retry budget
        self.update()
        if self._live is not None:
            self._live.stop()
        try:
            self._timeline.close()
        except UserError as exc:
            self.error = self.error or exc
        if self.prometheus is not None:
            self.prometheus.close()
        if self._buffer is not None:
            self._buffer.close()


def weight_server_stats(metrics: dict[str, Any], name: str = "policy") -> dict[str, Any]:
    """A flat view of the weight server's metrics for the monitor: the newest version's bytes,
    publish duration, pulls and publish->applied latency (mean and max over workers)."""
    versions = metrics.get("versions", {}).get(name, {})
    out: dict[str, Any] = {f"ws/{k}": v for k, v in metrics.get("counters", {}).items()}
    if versions:
        newest = max(versions, key=int)
        rec = versions[newest]
        lat = [a["latency_s"] for a in rec.get("applied", {}).values() if a.get("latency_s") is not None]
        out.update({"version": int(newest), **{k: rec.get(k) for k in ("bytes", "publish_duration_s", "pulls")},
                    "sync_latency_s": sum(lat) / len(lat) if lat else None,
                    "sync_latency_max_s": max(lat) if lat else None, "workers_applied": len(lat)})
    return out


def reward_cost(workers: list[dict[str, Any]]) -> dict[str, Any]:
    """What scoring costs, from the workers' heartbeat stats: the share of their scoring threads'
    time spent scoring (mean over workers; near 1: the reward is the bottleneck), reward calls/s
    (summed), and the calls abandoned after reward.timeout_s and empty responses so far; with
    ``reasons``, why the built-in rewards scored what they did (``math/no_answer``: count, summed)."""
    shares = [float(w[M.WORKER_SCORE_SHARE]) for w in workers if w.get(M.WORKER_SCORE_SHARE) is not None]
    reasons: dict[str, int] = {}
    for w in workers:
        for reason, n in (w.get("reward_reasons") or {}).items():
            reasons[reason] = reasons.get(reason, 0) + int(n)
    return {"scoring_share": sum(shares) / len(shares) if shares else None,
            "reward_calls_per_s": sum(float(w.get(M.WORKER_REWARD_CALLS_PER_S, 0.0)) for w in workers),
            **{k: sum(int(w.get(k, 0)) for w in workers) for k in ("reward_timeouts", "empty_responses")},
            **({"reasons": dict(sorted(reasons.items()))} if reasons else {})}


def worker_stats(snap: dict[str, Any], timeout_s: float) -> dict[str, dict[str, Any]]:
    """The stats of the consumers that heartbeated within ``timeout_s`` (``buffer.lease_timeout_s``):
    a worker's record stays in the buffer for a while after it left."""
    return {n: w.get("stats", {}) for n, w in snap.get("consumers", {}).items()
            if isinstance(w, dict) and float(w.get("age_s", 0.0)) <= timeout_s}


def every_worker(snap: dict[str, Any]) -> list[dict[str, Any]]:
    """The stats of every worker of the run, to sum running totals over: each consumer's record, and
    the workers the buffer retired as one record of their summed totals (``WorkerClient.retire_consumers``)."""
    out = [w.get("stats") or {} for w in snap.get("consumers", {}).values() if isinstance(w, dict)]
    retired = (snap.get("retired") or {}).get("stats")
    return out + [retired] if retired else out
