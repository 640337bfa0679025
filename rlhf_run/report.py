"""What a run shows: a live progress line, and at the end a summary, summary.json and plots.

Sources: the learner's ``metrics.jsonl`` (one line per update, written by ``learner.reporting``)
and the buffer's counters in Redis (sampled here once a second, and written to ``timeline.jsonl``
ever more sparsely as the run goes on: :class:`Timeline`). The keys both sides use are named in
:mod:`rlhf_core.metric_names`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rlhf_core import metric_names as M
from rlhf_core.config import Config
from rlhf_core.dapo import FilterStall
from rlhf_core.cli import append_line
from rlhf_core.errors import UserError, disk_writes

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
TIMELINE_FILE = "timeline.jsonl"
SAMPLE_INTERVAL_S = 1.0
PROBE_RETRY_S = 2.0
#: timeline.jsonl gets a snapshot once max(SAMPLE_INTERVAL_S, elapsed / TIMELINE_SPAN) passed
#: since the one written before: about 1,000 (1 + ln(T / 1,000 s)) lines for a run of T seconds
#: (5,500 for a day) instead of one a second
TIMELINE_SPAN = 1000
#: snapshots the end-of-run report reads back from timeline.jsonl at most (evenly thinned)
TIMELINE_MAX_POINTS = 1000


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    """Every update's metrics line (read once, at the end of a run)."""
    path = output_dir / M.METRICS_FILE
    if not path.exists():
        return []
    by_update: dict[Any, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line being written as we read
            continue
        # an update re-trained after a crash appears twice; the later line is the real one
        by_update[row.get(M.UPDATES, len(by_update))] = row
    return list(by_update.values())


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
    """``timeline.jsonl``, thinned as the run goes on: a snapshot (its ``time``, seconds since the
    epoch) is written when at least max(SAMPLE_INTERVAL_S, elapsed / TIMELINE_SPAN) passed since
    the one written before (within half a sampling interval; elapsed: since ``started``), and the
    newest one held back is written at :meth:`close`. The buffer's counters and the workers'
    totals only grow, so a rate between any two lines is right; sparser lines are rates over
    longer windows."""

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
    """The snapshots of ``timeline.jsonl`` (a run's, or several launches' of a resumed run), read
    line by line: at most ``max_points`` of them plus the last one, evenly thinned (every k-th
    line, k doubling whenever they would be more), so a long run's file never sits in memory whole."""
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


def _json_or_none(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


class RestartDrops:
    """Samples dropped as too stale right after a learner restart that numbered its weights past
    the updates they hold, told apart from the run's other drops (fed the buffer's snapshots in
    order). Such a learner restored a checkpoint older than the versions it had published, and
    publishes it above them (no number names two sets of weights): the samples generated before
    the restart, by the weights the crash lost or older ones, are then that many versions further
    behind it, and some are too stale to train on. Pacing counts the updates, so this stops once
    they are read: a restart's drops are those counted until its learner has trained
    ``max_staleness + 2`` updates past where the dead one was (all that was admitted before it)."""

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
    waits on Redis), writes the snapshots to ``timeline.jsonl`` (ever more sparsely: :class:`Timeline`)
    and shows a live line (rich, when stdout is a terminal; a plain line every 10 s otherwise).
    Memory stays bounded: the first and the latest snapshots are kept, the rest is on disk.

    ``error``: a :class:`~rlhf_core.errors.UserError` the sampling met other than Redis being
    unreachable (corrupt control state, a full disk under ``timeline.jsonl``): the launcher ends
    the run with it.
    """

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
        self._buffer = None
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

    def start(self) -> "Progress":
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


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def weight_server_stats(metrics: dict[str, Any], name: str = "policy") -> dict[str, Any]:
    """A flat view of the weight server's metrics for the monitor: the newest version's bytes,
    publish duration, pulls and publish->applied latency (mean and max over workers)."""
    versions = metrics.get("versions", {}).get(name, {})
    out: dict[str, Any] = {f"ws/{k}": v for k, v in metrics.get("counters", {}).items()}
    if versions:
        newest = max(versions, key=int)
        rec = versions[newest]
        lat = [a["latency_s"] for a in rec.get("applied", {}).values() if a.get("latency_s") is not None]
        out.update({
            "version": int(newest),
            "bytes": rec.get("bytes"),
            "publish_duration_s": rec.get("publish_duration_s"),
            "pulls": rec.get("pulls"),
            "sync_latency_s": sum(lat) / len(lat) if lat else None,
            "sync_latency_max_s": max(lat) if lat else None,
            "workers_applied": len(lat),
        })
    return out


def reward_cost(workers: list[dict[str, Any]]) -> dict[str, Any]:
    """What scoring costs, from the workers' heartbeat stats: the share of their scoring threads'
    time spent scoring (mean over workers; near 1: the reward is the bottleneck), reward calls/s
    (summed), and the calls abandoned after reward.timeout_s and empty responses so far."""
    shares = [float(w[M.WORKER_SCORE_SHARE]) for w in workers if w.get(M.WORKER_SCORE_SHARE) is not None]
    return {
        "scoring_share": sum(shares) / len(shares) if shares else None,
        "reward_calls_per_s": sum(float(w.get(M.WORKER_REWARD_CALLS_PER_S, 0.0)) for w in workers),
        "reward_timeouts": sum(int(w.get("reward_timeouts", 0)) for w in workers),
        "empty_responses": sum(int(w.get("empty_responses", 0)) for w in workers),
    }


def appended_per_s(timeline: list[dict[str, Any]], since: float | None = None) -> float | None:
    """Samples appended to the buffer per second (by workers and by the gateway), from the first
    snapshot (after ``since``) that counts more than the first one did (start-up left out, also
    on a resume whose Redis data counts the launch before) to the last that counts less than the
    final total (the end of the run left out: the final checkpoint and the workers' drain append
    nothing), or the first that counts it when that leaves one snapshot. Neither end's interval,
    in which appends began or ended, is counted: snapshots far apart (timeline.jsonl is thinned
    as a run goes on) would stretch the window over idle time. None without two snapshots."""
    points = [(float(snap["time"]), int(snap["counters"]["samples_appended"])) for snap in timeline
              if "samples_appended" in snap.get("counters", {}) and "time" in snap
              and (since is None or snap["time"] >= since)]
    points = [p for p in points if p[1] > points[0][1]] if points else []
    below = [p for p in points if p[1] < points[-1][1]]
    points = below if len(below) >= 2 else points[:next((i + 1 for i, p in enumerate(points) if p[1] == points[-1][1]), 0)]
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def sync_latency_s(timeline: list[dict[str, Any]]) -> float | None:
    """Publish -> applied, averaged over the run's versions: each version the snapshots saw
    applied (its mean over workers, from the last snapshot that names it, when most workers had
    it) stands for itself and the versions since the one seen before it, which fell between
    snapshots (a second apart, and sparser as timeline.jsonl is thinned: counted once each, the
    run's first versions, seen densely, would outweigh the rest). The newest version's alone, at
    the end of a run, is one version's and may have reached few workers or none (None)."""
    by_version: dict[int, float] = {}
    for snap in timeline:
        ws = (snap.get("stats") or {}).get(M.WEIGHT_SERVER_STATS) or {}
        if ws.get("sync_latency_s") is not None and isinstance(ws.get("version"), int):
            by_version[ws["version"]] = float(ws["sync_latency_s"])
    total = weight = 0.0
    before = None
    for version, latency in sorted(by_version.items()):
        w = 1 if before is None else version - before
        total, weight, before = total + w * latency, weight + w, version
    return total / weight if weight else None


def worker_stats(snap: dict[str, Any], timeout_s: float) -> dict[str, dict[str, Any]]:
    """The stats of the consumers that heartbeated within ``timeout_s`` (``buffer.lease_timeout_s``):
    a worker's record stays in the buffer for a while after it left (a resumed run's workers of
    the launch before, one scaled down), and its rate over its uptime is not generation now."""
    return {n: w.get("stats", {}) for n, w in snap.get("consumers", {}).items()
            if isinstance(w, dict) and float(w.get("age_s", 0.0)) <= timeout_s}


def every_worker(snap: dict[str, Any]) -> list[dict[str, Any]]:
    """The stats of every worker of the run, to sum running totals over (tokens generated, time
    busy): each consumer's record, and the workers the buffer retired (long dead) as one record of
    their summed totals (``M.WORKER_SUMMED``; ``WorkerClient.retire_consumers``)."""
    out = [w.get("stats") or {} for w in snap.get("consumers", {}).values() if isinstance(w, dict)]
    retired = (snap.get("retired") or {}).get("stats")
    return out + [retired] if retired else out


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(cfg: Config, rows: list[dict[str, Any]], timeline: list[dict[str, Any]], wall_s: float,
              exit_reason: str, since: float | None = None) -> dict[str, Any]:
    """``rows``: every update of the run; rates count those after ``since`` (this launch's start:
    a resumed run's rows before the stop would stretch the window over the pause)."""
    rewards = [r.get(M.REWARD_MEAN) for r in rows]
    k = max(1, min(5, len(rows) // 4 or 1))
    samples = rows[-1].get(M.SAMPLES_TRAINED, 0) if rows else 0
    last_snap = timeline[-1] if timeline else {}
    workers = worker_stats(last_snap, cfg.buffer.lease_timeout_s)
    # the buffer's count (the workers' samples and the gateway's): the workers' own counters restart
    # with each worker process and know nothing of the gateway's
    counters = last_snap.get("counters", {})
    gen_samples = counters.get("samples_appended", sum(int(s.get(M.WORKER_SAMPLES, 0)) for s in workers.values()))
    gen_rate = appended_per_s(timeline, since)
    # a resumed run whose Redis data was removed at its clean finish: the buffer counts from 0 again
    launch = [snap for snap in timeline if since is not None and snap.get("time", 0.0) >= since]
    counts_restarted = bool(launch) and any(r.get(M.TIME, 0.0) < since for r in rows) \
        and not int(launch[0].get("counters", {}).get("samples_appended", 0))
    staleness_means = [r.get(M.STALENESS_MEAN) for r in rows]
    staleness_max = max((r.get(M.STALENESS_MAX, 0) for r in rows), default=0)
    restarts = RestartDrops(cfg.algo.max_staleness)
    for snap in timeline:
        restarts.add(snap)
    compute = sum(r.get(M.TIME_COMPUTE_S, 0.0) for r in rows)
    wait = sum(r.get(M.TIME_WAIT_S, 0.0) for r in rows)
    read = sum(r.get(M.TIME_READ_S, 0.0) for r in rows)
    publish = sum(r.get(M.TIME_PUBLISH_S, 0.0) for r in rows)
    # the learner's active window (first to last update), so start-up time does not dilute the rate
    window = [r for r in rows if since is None or r.get(M.TIME, 0.0) >= since] or rows
    active_s = (window[-1].get(M.TIME, 0.0) - window[0].get(M.TIME, 0.0)) if len(window) > 1 else 0.0
    active_samples = samples - (window[0].get(M.SAMPLES_TRAINED, 0) if window else 0)
    return {
        "run_id": cfg.buffer.run_id,
        "exit_reason": exit_reason,
        # the learner's own reason (its last stats record): budget | time | data | signal
        "stopped_by": last_snap.get("stats", {}).get(M.LEARNER_STATS, {}).get(M.STOPPED_BY),
        "max_staleness": cfg.algo.max_staleness,
        "steps": len(rows),
        "samples_trained": samples,
        "samples_generated": gen_samples,
        "generated_this_launch": counts_restarted,  # samples_generated counts this launch's alone
        "samples_dropped_stale": int(counters.get("samples_dropped_stale", 0)),  # never trained on
        "samples_aged_out": int(counters.get("samples_aged_out", 0)),  # replay mode: trained, then too stale
        # learner restarts that numbered their weights past the updates they hold, with the stale drops that followed
        "learner_restarts": restarts.restarts,
        "reward_start": _mean(rewards[:k]),
        "reward_end": _mean(rewards[-k:]),
        "reward_max": max((r for r in rewards if r is not None), default=None),
        "staleness_mean": _mean(staleness_means),
        "staleness_max": staleness_max,
        "wall_s": wall_s,
        "training_window_s": active_s,
        "throughput": {
            "trained_samples_per_s": active_samples / active_s if active_s else 0.0,
            # the buffer's appends over the run's snapshots; without two of them, each worker's own
            # rate over its uptime, summed
            "generated_samples_per_s": gen_rate if gen_rate is not None else
            sum(float(w.get(M.WORKER_SAMPLES_PER_S, 0.0)) for w in workers.values()),
            "generated_tokens_per_s": sum(float(w.get(M.WORKER_TOKENS_PER_S, 0.0)) for w in workers.values()),
            "learner_compute_s": compute,
            "learner_wait_s": wait,
            "learner_read_s": read,
            "learner_publish_s": publish,
            "learner_tflops": _mean([r.get(M.TRAIN_TFLOPS) for r in rows]),
            "learner_mfu": _mean([r.get(M.MFU) for r in rows]),  # None without a known device peak
            "weight_sync_latency_s": sync_latency_s(timeline),
        },
        "rewards": reward_cost(list(workers.values())),
        # rlhf-gateway's last stats (its counts since it last started; None: no gateway)
        "gateway": last_snap.get("stats", {}).get(M.GATEWAY_STATS),
        "dead_letters": counters.get("dead_letters"),
        "leases_reclaimed": counters.get("prompts_reclaimed"),
        # the buffer's own counters at the end, for audits (appended = consumed + stale + left)
        "buffer_counters": counters,
    }


#: the learner's stop reasons (``rlhf_core.metric_names.STOP_REASONS``) as the summary says them
STOP_REASONS = {M.STOP_BUDGET: "learner.max_updates reached", M.STOP_TIME: "run.max_seconds reached",
                M.STOP_DATA: "every prompt of data.epochs trained on", M.STOP_SIGNAL: "stopped by a signal"}


def format_summary(s: dict[str, Any]) -> str:
    def f(x: Any) -> str:
        return "n/a" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))

    t = s["throughput"]
    why = STOP_REASONS.get(s.get("stopped_by") or "", s.get("stopped_by"))
    lines = [
        f"run {s['run_id']} ({s['exit_reason'] or 'done'}{f': {why}' if why else ''}) in {s['wall_s']:.0f} s",
        f"  steps {s['steps']}, samples trained {s['samples_trained']}, generated {s['samples_generated']}"
        + (" (this launch: the buffer's counts restarted with the run's Redis)" if s.get("generated_this_launch") else "")
        + (f", dropped as too stale {s['samples_dropped_stale']}" if s.get("samples_dropped_stale") else "")
        + (f", trained and then aged out {s['samples_aged_out']}" if s.get("samples_aged_out") else ""),
        f"  reward {f(s['reward_start'])} -> {f(s['reward_end'])} (max {f(s['reward_max'])})",
        f"  staleness mean {f(s['staleness_mean'])}, max {f(s['staleness_max'])} (limit {s['max_staleness']})",
        f"  throughput: generated {t['generated_tokens_per_s']:.0f} tok/s ({t['generated_samples_per_s']:.1f} samples/s), "
        f"trained {t['trained_samples_per_s']:.1f} samples/s; learner compute {t['learner_compute_s']:.0f} s, "
        f"reading batches {t['learner_read_s']:.1f} s, waiting {t['learner_wait_s']:.0f} s, "
        f"publishing {t['learner_publish_s']:.1f} s (on its own thread)",
    ]
    dropped, generated = s.get("samples_dropped_stale") or 0, s["samples_generated"] or 0
    restarts = [r for r in s.get("learner_restarts") or [] if r["samples_dropped_stale"]]
    if restarts:
        after = sum(r["samples_dropped_stale"] for r in restarts)
        dropped -= after
        at = "; ".join(f"at version {r['version']}, {r['samples_dropped_stale']} dropped, the restored weights numbered "
                       f"{r['skipped']} versions ahead" for r in restarts)
        lines.append(f"  {after} of the samples dropped as too stale followed a learner restart ({at}): the learner "
                     "restored a checkpoint older than the versions it had published and numbered its weights past "
                     "them, so what was generated before the restart was that many versions behind it. Expected once "
                     "per restart (fewer with a smaller learner.checkpoint_every), not a reason to raise "
                     "algo.max_staleness")
    if generated and dropped > 0.1 * generated:
        lines.append(f"  {dropped / generated:.0%} of the generated samples were more than algo.max_staleness="
                     f"{s['max_staleness']} versions behind the learner when it read them, and were dropped: raise "
                     "algo.max_staleness (gateway episodes: a group is appended at its last session's reward, so "
                     "reward a group's sessions close together)")
    ev = s.get("eval") or {}
    if ev:
        first, last = ev["first"], ev["last"]
        passes = ", ".join(f"{k.removeprefix(M.EVAL_PREFIX)} {f(last[k])}" for k in last if k.startswith("eval/pass@"))
        lines.append(f"  eval: reward {f(first.get(M.EVAL_REWARD_MEAN))} (version {first.get(M.EVAL_VERSION)}) -> "
                     f"{f(last.get(M.EVAL_REWARD_MEAN))} (version {last.get(M.EVAL_VERSION)}), {passes} "
                     f"({ev['evaluations']} evaluations)")
    r = s.get("rewards") or {}
    if r.get("scoring_share") is not None and r.get("reward_calls_per_s"):  # none: agents' rewards only (gateway)
        lines.append(f"  rewards: scoring busy {r['scoring_share']:.0%} of the workers' scoring-thread time, "
                     f"{r['reward_calls_per_s']:.1f} reward calls/s, {r['reward_timeouts']} call(s) timed out, "
                     f"{r['empty_responses']} empty response(s)")
    g = s.get("gateway") or {}
    if g:
        errors = ", ".join(f"{code} {n}" for code, n in M.gateway_errors(g).items())
        lines.append(f"  gateway (since it last started): {g.get('calls', 0)} calls ({g.get('calls_failed', 0)} failed), "
                     f"sessions {g.get('sessions_rewarded', 0)} rewarded and {g.get('sessions_expired', 0)} expired, "
                     f"{g.get('groups_appended', 0)} groups appended; errors answered: {errors or 'none'}")
    return "\n".join(lines)


#: the span the live view's (``rlhf-monitor``) and ``throughput.png``'s rates are measured over
#: (the gateway appends a group at once: over one refresh the rate jumps with every group)
RATE_WINDOW_S = 10.0


def time_origin(rows: list[dict[str, Any]], timeline: list[dict[str, Any]]) -> float:
    """The plots' 0 s: the first snapshot of the run, or the start of the learner's first update
    when that is earlier (a resumed run's rows are older than this launch's snapshots)."""
    first_update = rows[0].get(M.TIME, 0.0) - rows[0].get(M.TIME_COMPUTE_S, 0.0) if rows else math.inf
    return min(first_update, timeline[0]["time"] if timeline else math.inf)


def throughput_series(rows: list[dict[str, Any]], timeline: list[dict[str, Any]]) -> dict[str, tuple[list, list]]:
    """The curves of ``throughput.png``, label -> (seconds since :func:`time_origin`, samples/s):
    the buffer's appends and the learner's trained samples over the last :data:`RATE_WINDOW_S` of
    snapshots, both counted as they happen (the workers' token counts move only at their
    heartbeats, and the learner's per-update rate is per second of compute)."""
    t0 = time_origin(rows, timeline)
    snaps = [s for s in timeline if "time" in s]
    counts = {"generated (workers)": [int(s.get("counters", {}).get("samples_appended", 0)) for s in snaps],
              "trained (learner)": [int((s.get("stats") or {}).get(M.LEARNER_STATS, {}).get(M.SAMPLES_TRAINED) or 0)
                                    for s in snaps]}
    series: dict[str, tuple[list, list]] = {}
    for label, n in counts.items():
        ts, rates, j = [], [], 0
        for i in range(1, len(snaps)):
            while snaps[j + 1]["time"] <= snaps[i]["time"] - RATE_WINDOW_S:
                j += 1
            ts.append(snaps[i]["time"] - t0)
            rates.append(max(0, n[i] - n[j]) / max(snaps[i]["time"] - snaps[j]["time"], 1e-9))
        series[label] = (ts, rates)
    return series


def plot(output_dir: Path, rows: list[dict[str, Any]], timeline: list[dict[str, Any]]) -> list[Path]:
    """PNG plots with labelled axes. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    if not rows:
        return written
    t0 = time_origin(rows, timeline)
    wall = [r.get(M.TIME, 0.0) - t0 for r in rows]
    samples = [r.get(M.SAMPLES_TRAINED, 0) for r in rows]
    reward = [r.get(M.REWARD_MEAN, float("nan")) for r in rows]

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(wall, reward)
    axes[0].set_xlabel("wall-clock time (s)")
    axes[0].set_ylabel("mean reward of the batch")
    axes[1].plot(samples, reward)
    axes[1].set_xlabel("samples trained")
    axes[1].set_ylabel("mean reward of the batch")
    fig.suptitle("Reward")
    fig.tight_layout()
    written.append(_save(fig, output_dir / "reward.png"))

    kl_key = next((k for k in M.KL_KEYS if k in rows[-1]), None)
    if kl_key:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r.get(M.VERSION, i) for i, r in enumerate(rows)], [r.get(kl_key, float("nan")) for r in rows])
        ax.set_xlabel("learner version")
        ax.set_ylabel(kl_key)
        ax.set_title("KL")
        fig.tight_layout()
        written.append(_save(fig, output_dir / "kl.png"))

    hists = [r.get(M.STALENESS_HIST) for r in rows]
    if any(hists):
        width = 1 + max(len(h) for h in hists if h)
        import numpy as np

        grid = np.zeros((width, len(rows)))
        for j, h in enumerate(hists):
            for lag, count in enumerate(h or []):
                grid[lag, j] = count
        fig, ax = plt.subplots(figsize=(7, 3.5))
        im = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest")
        ax.set_xlabel("learner update")
        ax.set_ylabel("staleness (versions)")
        ax.set_title("Staleness of trained samples over time")
        fig.colorbar(im, ax=ax, label="samples")
        fig.tight_layout()
        written.append(_save(fig, output_dir / "staleness.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (ts, values) in throughput_series(rows, timeline).items():
        ax.plot(ts, values, label=label)
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel(f"samples/s (over the last {RATE_WINDOW_S:.0f} s)")
    ax.set_title("Throughput per stage")
    ax.legend()
    fig.tight_layout()
    written.append(_save(fig, output_dir / "throughput.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(cfg: Config, output_dir: Path, progress: Progress | None, exit_reason: str) -> str:
    rows = read_metrics(output_dir)
    timeline = progress.timeline() if progress else read_timeline(output_dir / TIMELINE_FILE)
    wall = time.time() - (progress.started if progress else time.time())
    summary = summarize(cfg, rows, timeline, wall, exit_reason, since=progress.started if progress else None)
    evals = read_jsonl(output_dir / M.EVAL_FILE)
    if evals:  # the evaluator's records (eval.every > 0): the first and the newest
        summary["eval"] = {"first": evals[0], "last": evals[-1], "evaluations": len(evals)}
    try:
        summary["plots"] = [p.name for p in plot(output_dir, rows, timeline)]
    except Exception as exc:  # a plot must never lose the summary
        log.warning("plots failed: %s", exc)
        summary["plots"] = []
    try:
        with disk_writes(output_dir / SUMMARY_FILE):
            (output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    except UserError as exc:  # a full disk: the summary is still printed, and the run's own outcome stands
        log.error("%s", exc)
    return format_summary(summary)
