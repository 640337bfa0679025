"""The run's Prometheus target: one scrape target per run, fed from its Redis snapshot.

``rlhf-run`` serves it on ``run.prometheus_port`` (its progress thread feeds it the snapshot it
takes once a second); ``rlhf-monitor prometheus_port=...`` serves it for a run it watches. Every
series has the label ``run``:

* ``rlhf_run_<name>_total``: the buffer's running totals (``samples_appended``,
  ``samples_consumed``, ``dead_letters`` ...); ``rlhf_run_<name>``: its levels
  (``prompts_waiting``, ``admitted``, ``inflight`` ...); ``rlhf_run_depth_<name>``: the
  snapshot's depth; ``rlhf_run_version``, ``rlhf_run_admission_budget``;
* ``rlhf_run_staleness_versions`` / ``rlhf_run_dropped_staleness_versions``: histograms of the
  samples the learner consumed / the buffer dropped as too stale, by lag, read whole from Redis;
* per worker (label ``worker``): ``rlhf_run_worker_{version,leases,heartbeat_age_seconds}`` and
  its heartbeat stats as ``rlhf_run_worker_<key>`` (``rlhf_run_worker_tokens_total`` ...), until
  the buffer retires the worker (long dead); ``rlhf_run_workers_retired`` counts those;
* the stats the learner, the weight server and the gateway publish: ``rlhf_run_learner_<key>``
  (the key without its ``learner/``: ``rlhf_run_learner_samples_trained_total``,
  ``rlhf_run_learner_reward_mean``), ``rlhf_run_weight_server_<key>`` and
  ``rlhf_run_gateway_<key>`` (``rlhf_run_gateway_calls_total``; its errors answered as
  ``rlhf_run_gateway_errors_total`` with the label ``code``).

A record's key is named as the learner's and the workers' own targets name it
(:func:`~rlhf_core.prometheus.prometheus_key`). Totals go through
:class:`~rlhf_core.prometheus.Totals`, as theirs do: counters start at 0 in this process and
never go down (docs/architecture.md, Observability). The histograms are Redis's, read whole.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from buffer.metrics import LEVELS
from rlhf_core import metric_names as M
from rlhf_core.prometheus import LAG_BUCKETS, Exporter, Totals, metric_name, number, prometheus_key

PREFIX = "rlhf_run"
_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


class _Families:
    """The metric families of one snapshot; a name or series seen twice keeps its first value."""

    def __init__(self, run_id: str, totals: Totals) -> None:
        self.run_id, self.totals = run_id, totals
        self.by_name: dict[str, Any] = {}
        self.series: set[tuple] = set()

    def add(self, kind: str, name: str, doc: str, value: Any, **labels: str) -> None:
        x = number(value)
        key = (name, *labels.items())
        if x is None or key in self.series:
            return
        fam = self.by_name.get(name)
        if fam is None:
            fam = self.by_name[name] = _FAMILIES[kind](name, doc, labels=["run", *labels])
        elif fam.type != kind:
            return
        self.series.add(key)
        fam.add_metric([self.run_id, *labels.values()], self.totals.count(key, x) if kind == "counter" else x)

    def lag_histogram(self, name: str, doc: str, hist: dict[Any, Any]) -> None:
        counts = {int(lag): int(n) for lag, n in hist.items()}
        buckets = [(floatToGoString(le), sum(n for lag, n in counts.items() if lag <= le)) for le in LAG_BUCKETS]
        fam = self.by_name[name] = HistogramMetricFamily(name, doc, labels=["run"])
        fam.add_metric([self.run_id], [*buckets, ("+Inf", sum(counts.values()))],
                       sum_value=sum(lag * n for lag, n in counts.items()))


class RunExporter:
    """A prometheus_client collector: :meth:`update` turns a ``MonitorClient.metrics()`` snapshot into
    metric families, and a scrape serves the latest ones."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.exporter = Exporter(PREFIX, {"run": run_id})
        self._totals = Totals()
        self._families: list[Any] = []
        self._lock = threading.Lock()
        self.exporter.registry.register(self)

    def describe(self) -> list[Any]:
        return []  # the names depend on the snapshot

    def collect(self) -> list[Any]:
        with self._lock:
            return list(self._families)

    def serve(self, port: int, host: str = "127.0.0.1", setting: str = "run.prometheus_port") -> int:
        return self.exporter.serve(port, host, setting)

    def render(self) -> str:
        return self.exporter.render()

    def close(self) -> None:
        self.exporter.close()

    def update(self, snap: dict[str, Any]) -> None:
        f = _Families(self.run_id, self._totals)
        for name, value in snap.get("counters", {}).items():
            level = name in LEVELS
            f.add("gauge" if level else "counter", metric_name(PREFIX, name),
                  f"buffer {'level' if level else 'total'} {name}", value)
        for name, value in snap.get("depth", {}).items():
            f.add("gauge", metric_name(f"{PREFIX}_depth", name), f"buffer depth: {name}", value)
        f.add("gauge", f"{PREFIX}_version", "the learner version the buffer holds", snap.get("learner_version"))
        f.add("gauge", f"{PREFIX}_admission_budget", "samples that may still be admitted", snap.get("admission_budget"))
        f.lag_histogram(f"{PREFIX}_staleness_versions", "samples consumed by the learner, by versions behind",
                        snap.get("staleness_hist", {}))
        f.lag_histogram(f"{PREFIX}_dropped_staleness_versions", "samples dropped as too stale, by versions behind",
                        snap.get("dropped_stale_hist", {}))
        for worker, rec in snap.get("consumers", {}).items():
            self._worker(f, worker, rec)
        # a retired worker's series end (the buffer keeps its totals summed, not per worker)
        f.add("gauge", f"{PREFIX}_workers_retired", "long-dead workers the buffer retired",
              (snap.get("retired") or {}).get("consumers"))
        for component, stats in snap.get("stats", {}).items():
            self._published(f, component, stats)
        with self._lock:
            self._families = list(f.by_name.values())

    @staticmethod
    def _worker(f: _Families, worker: str, rec: dict[str, Any]) -> None:
        p = f"{PREFIX}_worker"
        f.add("gauge", f"{p}_version", "the worker's weight version", rec.get("version"), worker=worker)
        f.add("gauge", f"{p}_leases", "prompts the worker holds", rec.get("leases"), worker=worker)
        f.add("gauge", f"{p}_heartbeat_age_seconds", "since the last heartbeat", rec.get("age_s"), worker=worker)
        for key, value in (rec.get("stats") or {}).items():
            exported = prometheus_key(key)
            if exported is not None:
                kind = "counter" if key in M.WORKER_TOTALS else "gauge"
                f.add(kind, metric_name(p, exported), f"worker stats {key!r}", value, worker=worker)

    @staticmethod
    def _published(f: _Families, component: str, stats: dict[str, Any]) -> None:
        prefix = metric_name(PREFIX, component)
        gateway = component == M.GATEWAY_STATS
        for key, value in stats.items():
            if gateway and key.startswith(M.GATEWAY_ERRORS):
                f.add("counter", f"{prefix}_errors", "gateway requests answered with an error, by code", value,
                      code=key.removeprefix(M.GATEWAY_ERRORS))
                continue
            exported = prometheus_key(key)
            if exported is None:
                continue
            # the weight server's counters arrive as ws/<name> (rlhf_run.progress.weight_server_stats)
            total = key in M.LEARNER_TOTALS or key.startswith("ws/") or (gateway and key not in M.GATEWAY_LEVELS)
            short = exported.removeprefix(f"{component}/")
            f.add("counter" if total else "gauge", metric_name(prefix, short),
                  M.METRIC_HELP.get(key, f"{component} stats {key!r}"), value)
