"""Rank 0's output of each update: one line in ``metrics.jsonl`` (with the newest evaluation and
the group filter's counts merged in), the learner's stats in Redis for the monitor and the run's
exporter, its Prometheus endpoint (``learner.prometheus_port``) and the trackers (``run.loggers``)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from buffer import MonitorClient
from rlhf_core.cli import append_line
from rlhf_core.config import Config
from rlhf_core.dapo import FILTER_REASONS
from rlhf_core.metric_names import (
    EVAL_PREFIX,
    EVAL_STATS,
    EVAL_VERSION,
    METRICS_FILE,
    MISMATCH_LAG0,
    SAMPLES_TRAINED,
    STOPPED_BY,
    UPDATES,
    mismatch_key,
)
from rlhf_core.records import Sample

log = logging.getLogger(__name__)

EVAL_CHECK_S = 1.0  # the learner looks for a new evaluation this often (when eval.every > 0)
STATS_EVERY_S = 0.25  # the learner's stats in Redis (monitor, run exporter) are refreshed at most this often
MISMATCH_WARN_EVERY_S = 600.0  # a train/rollout mismatch warning, then none for this long (the updates over it counted)


class UpdateReporter:
    """Where rank 0's metrics of each update go. ``tracker_state``: the trackers' run ids from
    the checkpoint, which resume their runs."""

    def __init__(self, cfg: Config, buffer: MonitorClient, output_dir: Path, tokenizer: Any,
                 tracker_state: dict[str, str]) -> None:
        self.cfg, self.buffer, self.tokenizer = cfg, buffer, tokenizer
        self.metrics_path = output_dir / METRICS_FILE
        self._tracker_state = tracker_state
        self._last_trained: list[tuple[Sample, int]] = []  # the batch just trained, with staleness (the trackers' table)
        self._last_metrics: dict[str, Any] | None = None  # the newest update's, published at the end if throttled
        self._stats_at = -STATS_EVERY_S
        self._filter_checked = -EVAL_CHECK_S
        self._filter_counts: dict[str, float] = {}
        self._eval_checked, self._eval_seen = -EVAL_CHECK_S, None  # the newest evaluation copied into metrics
        self.exporter = None
        if cfg.learner.prometheus_port is not None:
            from rlhf_core.prometheus import learner_exporter

            self.exporter = learner_exporter(cfg.buffer.run_id)
            self.exporter.serve(cfg.learner.prometheus_port, setting="learner.prometheus_port")
        self.mismatch = MismatchWarning(cfg)
        self.trackers = None
        if cfg.run.loggers:
            from learner.trackers import Trackers

            self.trackers = Trackers(cfg, output_dir, tracker_state)

    def start(self, updates: int, samples_trained: int) -> None:
        """The base of the exporter's counters: 0, or the restored checkpoint's totals."""
        if self.exporter is not None:
            self.exporter.update({UPDATES: updates, SAMPLES_TRAINED: samples_trained})

    def emit(self, metrics: dict[str, Any], version: int, trained: list[tuple[Sample, int]]) -> None:
        """One update's ``metrics`` (``trained``: its samples, each with its staleness): a line in
        metrics.jsonl (a full disk stops the learner with one line naming it, exit 2: a restart
        would meet the same disk), the monitor's stats in Redis, Prometheus, the trackers."""
        if self.cfg.eval.every:
            self._merge_eval(metrics)
        if self.cfg.algo.filter_groups:
            self._merge_filter_counts(metrics)
        append_line(self.metrics_path, json.dumps(metrics))
        self._last_metrics = metrics
        self.mismatch.check(metrics)
        now = time.monotonic()
        if now - self._stats_at >= STATS_EVERY_S:  # its readers sample once a second; a Redis write per update is waste
            self._stats_at = now
            self.buffer.publish_stats("learner", metrics)
        if self.exporter is not None:
            self.exporter.update(metrics)
        if self.trackers is not None:
            self._last_trained = trained
            self.trackers.log_update(metrics, version)
            if self.trackers.due(version):
                self.trackers.log_details(self._sample_rows(), self._worker_stats(), version)

    def finish(self, stopped_by: str) -> None:
        """The final stats, whatever the throttle held back, and why the run stopped (the summary's)."""
        self.buffer.publish_stats("learner", {**(self._last_metrics or {}), STOPPED_BY: stopped_by})

    def tracker_state(self) -> dict[str, str]:
        """The trackers' run ids for the checkpoint (those not in run.loggers now kept too: named
        again, they resume their run)."""
        return {**self._tracker_state, **(self.trackers.state() if self.trackers is not None else {})}

    def _merge_eval(self, metrics: dict[str, Any]) -> None:
        """Copy a new evaluation (the evaluator's record in the buffer, looked at once a second)
        into this update's metrics: metrics.jsonl and the trackers then have it, at this step."""
        now = time.monotonic()
        if now - self._eval_checked < EVAL_CHECK_S:
            return
        self._eval_checked = now
        try:
            stats = self.buffer.stats(EVAL_STATS)
        except Exception:  # noqa: BLE001  # evaluation is a view: it never stops training
            log.debug("no evaluation record", exc_info=True)
            return
        if not stats or stats.get(EVAL_VERSION) == self._eval_seen:
            return
        self._eval_seen = stats.get(EVAL_VERSION)
        metrics.update({k: v for k, v in stats.items() if k.startswith(EVAL_PREFIX)})

    def _merge_filter_counts(self, metrics: dict[str, Any]) -> None:
        """The group filter's counts (``algo.filter_groups``: groups the workers dropped, per reason,
        from the buffer's counters, read at most once a second) into every metrics line:
        ``filter/groups_filtered``, ``filter/groups_filtered_<reason>``, ``filter/filtered_frac``
        (of the groups completed)."""
        now = time.monotonic()
        if now - self._filter_checked >= EVAL_CHECK_S:
            self._filter_checked = now
            try:
                c = self.buffer.metrics()["counters"]
            except Exception:  # noqa: BLE001  # a view: it never stops training
                log.debug("no buffer counters for the filter metrics", exc_info=True)
            else:
                filtered = float(c.get("groups_filtered", 0))
                self._filter_counts = {
                    "filter/groups_filtered": filtered,
                    "filter/samples_filtered": float(c.get("samples_filtered", 0)),
                    **{f"filter/groups_filtered_{r}": float(c.get(f"groups_filtered_{r}", 0)) for r in FILTER_REASONS},
                    "filter/filtered_frac": filtered / max(1.0, filtered + float(c.get("groups_appended", 0))),
                }
        metrics.update(self._filter_counts)

    def _sample_rows(self) -> list[list[Any]]:
        """The trackers' table: prompt and response text, reward, staleness, worker of the batch just trained."""
        def text(ids: Any) -> str:
            ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else str(ids)

        return [[text(s.prompt_ids), text(s.response_ids), float(s.reward), lag, s.worker_id]
                for s, lag in self._last_trained[: self.cfg.run.log_samples]]

    def _worker_stats(self) -> dict[str, Any]:
        """Per-worker stats from the buffer snapshot (empty when Redis does not answer: never stops training)."""
        try:
            consumers = self.buffer.metrics().get("consumers", {})
        except Exception:  # noqa: BLE001
            log.debug("no buffer snapshot for the trackers", exc_info=True)
            return {}
        return {name: c.get("stats", {}) for name, c in consumers.items() if isinstance(c, dict)}

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
        if self.trackers is not None:
            self.trackers.close()


class MismatchWarning:
    """A WARNING when an update's lag-0 train/rollout mismatch, its KL(behaviour || learner) per token
    (``mismatch/lag0_kl_k3``), exceeds ``algo.mismatch_warn``: the first at once, then at most one
    every ``every_s``, counting the updates over the limit since the last. The KL, not the mean
    ``|dlogp|``: it is what the importance weights and the loss feel (a few far-off tokens weigh
    in as they do there), in nats per token, the figure published comparisons of engines report."""

    def __init__(self, cfg: Config, every_s: float = MISMATCH_WARN_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.every_s, self.clock = cfg.algo.mismatch_warn, every_s, clock
        sent = "" if cfg.learner.publish_dtype == "as_trained" else f", weights sent as {cfg.learner.publish_dtype}"
        self.sides = (f"the workers' rollout.engine={cfg.rollout.engine} in model.dtype={cfg.model.dtype}{sent}; "
                      f"the learner in model.dtype={cfg.model.dtype}{' with learner.bf16' if cfg.learner.bf16 else ''}")
        self._warned_at: float | None = None
        self._over = 0  # updates over the limit since the last warning

    def check(self, metrics: dict[str, Any]) -> bool:
        """Look at one update's metrics; True when it warned."""
        kl = metrics.get(mismatch_key(MISMATCH_LAG0, "kl_k3"))
        if kl is None or not metrics.get(mismatch_key(MISMATCH_LAG0, "tokens")) or not kl > self.limit:
            return False
        self._over += 1
        now = self.clock()
        if self._warned_at is not None and now - self._warned_at < self.every_s:
            return False
        dlogp = (metrics.get(mismatch_key(MISMATCH_LAG0, s), 0.0) for s in ("abs_mean", "abs_max"))
        log.warning("train/rollout mismatch: the lag-0 KL(behaviour || learner) is %.3g per token (k3; |dlogp| mean "
                    "%.3g, max %.3g) over algo.mismatch_warn=%g in %d update(s) since the last warning (%s): tokens "
                    "sampled by the very weights the learner holds should match its recomputation; check that both "
                    "sides run the same model, dtype and rollout.temperature/top_k/top_p, or raise "
                    "algo.mismatch_warn if this is expected (docs/operations.md: mismatch)",
                    kl, *dlogp, self.limit, self._over, self.sides)
        self._warned_at, self._over = now, 0
        return True
