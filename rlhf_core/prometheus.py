"""Prometheus endpoints on ``prometheus_client``: the learner's, each worker's, and the run's.

An :class:`Exporter` owns its own ``CollectorRegistry`` and serves it at
``http://host:port/metrics``. It is fed the component's flat metrics dict:

* keys named as running totals become counters (``learner/samples_trained`` ->
  ``rlhf_learner_samples_trained_total``), raised by how much the total grew since the first
  value this process saw (a restored learner's totals are no growth); a total that goes down
  (its process restarted) raises nothing until it grows again, so a counter never goes down;
* a key of ``sums`` also feeds a counter that adds up its values;
* the key of a :class:`Hist` feeds a histogram (a list counts the observations of 0, 1, 2 ...);
  :meth:`Exporter.observe` feeds one directly;
* every other finite number becomes a gauge (``reward/mean`` -> ``rlhf_reward_mean``), its HELP
  text the key's entry in ``docs`` (the learner's: ``metric_names.METRIC_HELP``), else the key.

Names follow Prometheus's rules (:func:`prometheus_key`); a rate such as ``tokens_per_s`` is not
exported. The run's own target is ``rlhf_run.run_exporter``.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from rlhf_core import metric_names as M
from rlhf_core.errors import UserError

log = logging.getLogger(__name__)

_BAD = re.compile(r"[^a-zA-Z0-9_]")

LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)  # staleness, in learner versions
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def metric_name(prefix: str, key: str) -> str:
    """``("rlhf_worker", "weight_updates")`` -> ``rlhf_worker_weight_updates``; ``loss/clip_frac`` -> ``..._loss_clip_frac``."""
    name = _BAD.sub("_", f"{prefix}_{key}").strip("_")
    return re.sub(r"_+", "_", name)


#: (pattern, replacement) applied in turn to a record's key to name it in Prometheus; None: not
#: exported. Prometheus asks for base units, and computes a rate itself from the counter it is the rate of.
_PROMETHEUS_KEYS = (
    (re.compile(r"_per_s$"), None),  # tokens_per_s: rate(..._tokens_total)
    (re.compile(r"_s$"), "_seconds"),
    (re.compile(r"^t_(\w+)$"), r"\1_seconds"),  # a worker's time totals (t_generate, t_wait ...)
    (re.compile(r"/total$"), ""),  # loss/total is a level, and only a counter's name ends in _total
    (re.compile(rf"^{M.TIME}$"), "learner/last_update_timestamp_seconds"),  # the learner row's wall clock
)


def prometheus_key(key: str) -> str | None:
    """The key a record's ``key`` has in Prometheus (``learner/time_compute_s`` ->
    ``learner/time_compute_seconds``), None for a rate, which Prometheus computes with ``rate()``."""
    for pattern, replacement in _PROMETHEUS_KEYS:
        if pattern.search(key):
            if replacement is None:
                return None
            key = pattern.sub(replacement, key)
    return key


def number(value: Any) -> float | None:
    """A finite number (bools count as 0/1), else None."""
    if isinstance(value, (bool, int, float)) and math.isfinite(value):
        return float(value)
    return None


@dataclass(frozen=True)
class Hist:
    """A histogram ``<prefix>_<name>``, fed from the metrics dict's ``key`` (None: by observe())."""

    name: str
    doc: str
    buckets: tuple[float, ...]
    key: str | None = None


class Totals:
    """Running totals -> how much their counter grows: the first total is the base, a total below
    the last (a restart) adds nothing and is the new base."""

    def __init__(self) -> None:
        self._last: dict[Hashable, float] = {}
        self._counts: dict[Hashable, float] = {}

    def growth(self, series: Hashable, total: float) -> float:
        last = self._last.get(series)
        self._last[series] = total
        return 0.0 if last is None else max(0.0, total - last)

    def count(self, series: Hashable, total: float) -> float:
        """The counter's value after this total: the sum of the growths so far."""
        self._counts[series] = self._counts.get(series, 0.0) + self.growth(series, total)
        return self._counts[series]


class Exporter:
    def __init__(self, prefix: str, labels: Mapping[str, str] | None = None, totals: tuple[str, ...] = (),
                 histograms: tuple[Hist, ...] = (), sums: Mapping[str, str] | None = None,
                 docs: Mapping[str, str] | None = None) -> None:
        self.prefix = prefix
        self._docs = dict(docs or {})  # key -> its HELP text
        self.labels = dict(labels or {})
        self.registry = CollectorRegistry()
        self._totals = frozenset(totals)
        self._sums = dict(sums or {})  # key -> the key of the counter its values add up to
        self._growth = Totals()
        self._metrics: dict[str, Any] = {}  # name -> the labelled series
        self._skipped: set[str] = set()
        self._lock = threading.Lock()
        self._serving: tuple[WSGIServer, threading.Thread] | None = None  # (server, its thread) once serving
        self._hists = {h.name: self._series(Histogram, metric_name(prefix, h.name), h.doc, buckets=h.buckets)
                       for h in histograms}
        self._hist_keys = {h.key: h.name for h in histograms if h.key}

    def _series(self, kind: type, name: str, doc: str, **kw: Any) -> Any:
        series = self._metrics.get(name)
        if series is None:
            series = kind(name, doc, labelnames=sorted(self.labels), registry=self.registry, **kw)
            series = series.labels(**self.labels) if self.labels else series
            self._metrics[name] = series
        return series

    def update(self, metrics: Mapping[str, Any]) -> None:
        """Feed one metrics dict (see the module docstring); non-numbers and NaN are skipped."""
        with self._lock:
            for key, value in metrics.items():
                if key in self._skipped:
                    continue
                try:
                    self._feed(key, value)
                except ValueError as exc:  # its name is taken by another metric of this registry
                    self._skipped.add(key)
                    log.warning("Prometheus: %r is not exported: %s", key, exc)

    def _feed(self, key: str, value: Any) -> None:
        if key in self._hist_keys:
            hist = self._hists[self._hist_keys[key]]
            if isinstance(value, (list, tuple)):  # value[i]: how many observations of i
                for observed, n in enumerate(value):
                    for _ in range(int(n)):
                        hist.observe(observed)
            elif number(value) is not None:
                hist.observe(number(value))
        x = number(value)
        if x is None:
            return
        if key in self._sums:
            total = self._series(Counter, metric_name(self.prefix, self._sums[key]), f"the sum of every {key!r}")
            total.inc(max(0.0, x))
        exported = prometheus_key(key)
        if exported is None:
            return
        name = metric_name(self.prefix, exported)
        if key in self._totals:
            self._series(Counter, name, f"running total {key!r}").inc(self._growth.growth(key, x))
        else:
            self._series(Gauge, name, self._docs.get(key, f"{key!r}")).set(x)

    def observe(self, hist: str, value: float) -> None:
        """One observation of the histogram named ``hist`` (a :class:`Hist`'s name)."""
        self._hists[hist].observe(value)

    def render(self) -> str:
        return generate_latest(self.registry).decode()

    def serve(self, port: int, host: str = "127.0.0.1", setting: str = "the port") -> int:
        """Serve ``/metrics`` on a daemon thread; returns the bound port (0 picks a free one)."""
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except (OSError, OverflowError) as exc:  # in use, or not a port number
            raise UserError(f"cannot serve Prometheus metrics on {host}:{port}: {getattr(exc, 'strerror', None) or exc}. Set {setting} "
                            "to a free port (0 picks any)") from exc
        self._serving = server, thread
        bound = int(server.server_port)
        log.info("Prometheus metrics at http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._serving is not None:
            server, thread = self._serving
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._serving = None


def learner_exporter(run_id: str) -> Exporter:
    """The learner's metrics row: ``rlhf_learner_*``, ``rlhf_reward_*``, ``rlhf_loss_*`` ..., and
    ``rlhf_learner_tokens_trained_total``: the policy tokens of every update's batch, whose ``rate()``
    over that of ``rlhf_learner_step_seconds_sum`` is the row's ``learner/tokens_per_s``."""
    return Exporter("rlhf", {"run": run_id}, totals=M.LEARNER_TOTALS, histograms=(
        Hist("learner_staleness_versions", "versions between a trained sample's oldest token and the policy it "
             "trains", LAG_BUCKETS, key=M.STALENESS_HIST),
        Hist("learner_step_seconds", "compute time of one update (forward, backward, optimizer)", SECONDS_BUCKETS,
             key=M.TIME_COMPUTE_S),
    ), sums={M.NUM_TOKENS: "learner/tokens_trained"}, docs=M.METRIC_HELP)


WEIGHT_SYNC = "weight_sync_seconds"
GENERATION = "generation_seconds"
SCORING = "scoring_batch_seconds"


def worker_exporter(worker_id: str, run_id: str) -> Exporter:
    """A worker's heartbeat stats: ``rlhf_worker_*``, and its latency histograms."""
    return Exporter("rlhf_worker", {"worker": worker_id, "run": run_id}, totals=M.WORKER_TOTALS, histograms=(
        Hist(WEIGHT_SYNC, "pulling and applying one new weight version", SECONDS_BUCKETS),
        Hist(GENERATION, "per sample: from its prompt entering the engine to the response finished", SECONDS_BUCKETS),
        Hist(SCORING, "per scoring batch: every reward call over its samples (and reference log-probs)", SECONDS_BUCKETS),
    ))
