"""The Prometheus targets (learner, worker, run), scraped over HTTP and parsed with prometheus_client's
own parser: types, histogram buckets, counters that never go down, labels; and the Grafana
dashboard's queries name only metrics these targets export."""

from __future__ import annotations

import json
import math
import re
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from promlint import lint, promtool
from rlhf_core import metric_names as M
from rlhf_core.errors import UserError
from rlhf_core.prometheus import GENERATION, WEIGHT_SYNC, learner_exporter, metric_name, prometheus_key, worker_exporter
from rlhf_run.run_exporter import RunExporter

ROOT = Path(__file__).resolve().parents[2]
INPUTS = json.loads((Path(__file__).parent / "data" / "prometheus_inputs.json").read_text())


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, family: str, sample: str, **labels: str) -> float:
    """The value of ``sample`` in ``family`` whose labels include ``labels``."""
    hits = [s.value for s in fams[family].samples if s.name == sample and labels.items() <= s.labels.items()]
    assert len(hits) == 1, (family, sample, labels, fams[family].samples)
    return hits[0]


def test_names_are_conventional():
    assert metric_name("rlhf_learner", "loss/clip_frac") == "rlhf_learner_loss_clip_frac"
    assert metric_name("rlhf_worker", "tokens-per.s") == "rlhf_worker_tokens_per_s"


def test_record_keys_take_base_units_and_leave_rates_to_prometheus():
    assert prometheus_key(M.TIME_COMPUTE_S) == "learner/time_compute_seconds"
    assert prometheus_key("uptime_s") == "uptime_seconds"
    assert prometheus_key("t_generate") == "generate_seconds"  # a worker's seconds generating, a running total
    assert prometheus_key(M.TIME) == "learner/last_update_timestamp_seconds"
    assert prometheus_key("loss/total") == "loss"
    assert prometheus_key(M.WORKER_TOKENS_PER_S) is None and prometheus_key(M.SAMPLES_PER_S) is None
    assert prometheus_key(M.WORKER_TOKENS) == "tokens" and prometheus_key("score_share") == "score_share"


def test_learner_target_over_http_counters_gauges_histograms():
    ex = learner_exporter("run-a")
    port = ex.serve(0)
    try:
        ex.update({M.UPDATES: 0, M.SAMPLES_TRAINED: 0})  # the totals a fresh learner starts from (UpdateReporter.start)
        ex.update({M.VERSION: 1, M.UPDATES: 1, M.SAMPLES_TRAINED: 32, M.TIME_COMPUTE_S: 0.3, M.NUM_TOKENS: 190,
                   M.TOKENS_PER_S: 633.3, M.STALENESS_HIST: [20, 10, 2], M.REWARD_MEAN: 0.25, "note": "text",
                   "bad": math.nan})
        ex.update({M.VERSION: 2, M.UPDATES: 2, M.SAMPLES_TRAINED: 64, M.TIME_COMPUTE_S: 0.7, M.NUM_TOKENS: 210,
                   M.TOKENS_PER_S: 300.0, M.STALENESS_HIST: [16, 12, 3, 1], M.REWARD_MEAN: 0.5})
        fams = families(scrape(port))
    finally:
        ex.close()
    assert fams["rlhf_learner_updates"].type == "counter"
    assert value(fams, "rlhf_learner_updates", "rlhf_learner_updates_total", run="run-a") == 2
    assert value(fams, "rlhf_learner_samples_trained", "rlhf_learner_samples_trained_total") == 64
    assert fams["rlhf_learner_version"].type == "gauge" and value(fams, "rlhf_learner_version", "rlhf_learner_version") == 2
    assert value(fams, "rlhf_reward_mean", "rlhf_reward_mean") == 0.5  # the last update's
    assert not any("note" in name or "bad" in name for name in fams)
    # staleness: lag 0 observed 20 + 16 = 36 times, lag 1 10 + 12 = 22, lag 2 2 + 3 = 5, lag 3 once
    stale = "rlhf_learner_staleness_versions"
    assert fams[stale].type == "histogram"
    buckets = {s.labels["le"]: s.value for s in fams[stale].samples if s.name == f"{stale}_bucket"}
    assert buckets["0.0"] == 36 and buckets["1.0"] == 36 + 22 and buckets["2.0"] == 58 + 5
    assert buckets["3.0"] == buckets["64.0"] == buckets["+Inf"] == 64
    assert value(fams, stale, f"{stale}_count") == 64
    assert value(fams, stale, f"{stale}_sum") == 0 * 36 + 1 * 22 + 2 * 5 + 3 * 1
    # step time: 0.3 s falls in le=0.5, 0.7 s in le=1.0
    step = {s.labels["le"]: s.value for s in fams["rlhf_learner_step_seconds"].samples if s.name.endswith("_bucket")}
    assert (step["0.25"], step["0.5"], step["1.0"], step["+Inf"]) == (0, 1, 2, 2)
    assert value(fams, "rlhf_learner_time_compute_seconds", "rlhf_learner_time_compute_seconds") == 0.7  # the gauge stays
    # the row's tokens/s is Prometheus's rate of tokens trained over compute seconds: (190 + 210) / (0.3 + 0.7)
    assert value(fams, "rlhf_learner_tokens_trained", "rlhf_learner_tokens_trained_total") == 190 + 210
    assert value(fams, "rlhf_learner_step_seconds", "rlhf_learner_step_seconds_sum") == pytest.approx(0.3 + 0.7)
    assert not any(name.endswith("_per_s") for name in fams)


def _trained(ex) -> float:
    return value(families(ex.render()), "rlhf_learner_samples_trained", "rlhf_learner_samples_trained_total")


def test_counter_never_goes_down_across_a_restart():
    ex = learner_exporter("r")
    for total in (0, 100, 200):
        ex.update({M.SAMPLES_TRAINED: total})
    # the total goes back to 150 (a record that restarted): the counter stays at 200 ...
    ex.update({M.SAMPLES_TRAINED: 150})
    assert _trained(ex) == 200
    # ... and grows with the total again: 200 + (170 - 150)
    ex.update({M.SAMPLES_TRAINED: 170})
    assert _trained(ex) == 220


def prometheus_increase(scraped: list[float]) -> float:
    """What Prometheus's increase() adds up over scraped values of one series (a drop is a reset from 0)."""
    return sum(b - a if b >= a else b for a, b in zip(scraped, scraped[1:]))


def test_a_restored_learner_counts_only_what_it_trains():
    # The learner's target lives in its process: a crash restart or a resume builds a new exporter,
    # whose totals start at the checkpoint's. Counted whole, the new counter started at 150 after
    # 200: Prometheus read a reset and increase() counted the 150 again (260 for 100 + 10 trained)
    scraped = []
    first = learner_exporter("r")
    for total in (0, 100, 200):  # from a fresh start; it crashes at 200
        first.update({M.SAMPLES_TRAINED: total})
        scraped.append(_trained(first))
    second = learner_exporter("r")  # restored from the checkpoint at 150, then trains 10
    for total in (150, 160):
        second.update({M.SAMPLES_TRAINED: total})
        scraped.append(_trained(second))
    assert scraped == [0, 100, 200, 0, 10]
    # trained: 200, then 10 (the re-trained 150..200 aside): 200 + 0 (the reset) + 10
    assert prometheus_increase(scraped) == 210


def test_worker_target_labels_and_latency_histograms():
    ex = worker_exporter('w"0', "run-a")
    port = ex.serve(0)
    try:
        ex.update({M.WORKER_TOKENS: 120, M.WORKER_TOKENS_PER_S: 40.5, M.WORKER_UPTIME: 3.0, "t_generate": 2.5,
                   "version": None, "active": 3})
        for seconds in (0.02, 0.2, 3.0):
            ex.observe(GENERATION, seconds)
        ex.observe(WEIGHT_SYNC, 0.04)
        fams = families(scrape(port))
    finally:
        ex.close()
    tokens = fams["rlhf_worker_tokens"]
    assert tokens.type == "counter"
    assert tokens.samples[0].labels == {"worker": 'w"0', "run": "run-a"}  # escaped and parsed back
    assert "rlhf_worker_tokens_per_s" not in fams  # rate(rlhf_worker_tokens_total) is
    assert value(fams, "rlhf_worker_uptime_seconds", "rlhf_worker_uptime_seconds") == 3.0
    assert value(fams, "rlhf_worker_generate_seconds", "rlhf_worker_generate_seconds_total") == 0  # its first total: the base
    assert "rlhf_worker_version" not in fams  # None before the first weights
    gen = {s.labels["le"]: s.value for s in fams["rlhf_worker_generation_seconds"].samples if s.name.endswith("_bucket")}
    # 0.02 s <= 0.025, 0.2 s <= 0.25, 3.0 s <= 5.0
    assert (gen["0.01"], gen["0.025"], gen["0.25"], gen["2.5"], gen["5.0"], gen["+Inf"]) == (0, 1, 2, 2, 3, 3)
    assert value(fams, "rlhf_worker_weight_sync_seconds", "rlhf_worker_weight_sync_seconds_count") == 1


def test_every_running_total_of_a_worker_is_named_a_total():
    import dataclasses
    from types import SimpleNamespace

    from rollout_workers.episodes import EpisodeStats
    from rollout_workers.prompts import PromptCounters
    from rollout_workers.stats import ENGINE_COUNTERS, WorkerStats

    counts = {f.name for f in dataclasses.fields(WorkerStats) if f.name != "started"}
    counts |= set(PromptCounters().as_dict()) | {"weight_pulls", "weight_timeouts"} | set(ENGINE_COUNTERS)
    counts |= set(EpisodeStats().as_dict(SimpleNamespace(calls=0, timeouts=0)))
    assert counts == set(M.WORKER_TOTALS)


def _zeroed(x):
    """``x`` with every number 0: the same records at the start of a run."""
    if isinstance(x, dict):
        return {k: _zeroed(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_zeroed(v) for v in x]
    return 0 if isinstance(x, (int, float)) and not isinstance(x, bool) else x


def test_run_target_from_a_snapshot():
    target = RunExporter("r1")
    snap = json.loads(json.dumps(INPUTS["snapshot"]))
    # the first snapshot a process takes is the base of its counters (a monitor attached mid-run,
    # a resumed run's Redis): nothing of it is growth
    target.update(snap)
    assert value(families(target.render()), "rlhf_run_samples_appended", "rlhf_run_samples_appended_total") == 0
    target = RunExporter("r1")
    target.update(_zeroed(snap))  # this run's start
    target.update(snap)
    port = target.serve(0)
    try:
        fams = families(scrape(port))
        assert fams["rlhf_run_samples_appended"].type == "counter"
        assert value(fams, "rlhf_run_samples_appended", "rlhf_run_samples_appended_total", run="r1") == 3972
        assert fams["rlhf_run_depth_samples_in_buffer"].type == "gauge"
        assert value(fams, "rlhf_run_prompts_waiting", "rlhf_run_prompts_waiting") == 0  # a level: a gauge
        # consumed samples by lag {0: 108, 1: 424, 2: 1068}: le=0 108, le=1 532, le=2 and up 1600
        stale = "rlhf_run_staleness_versions"
        assert fams[stale].type == "histogram"
        buckets = {s.labels["le"]: s.value for s in fams[stale].samples if s.name == f"{stale}_bucket"}
        assert (buckets["0.0"], buckets["1.0"], buckets["2.0"], buckets["+Inf"]) == (108, 532, 1600, 1600)
        assert value(fams, stale, f"{stale}_sum") == 424 + 2 * 1068
        assert value(fams, "rlhf_run_worker_tokens", "rlhf_run_worker_tokens_total", worker="worker-1") == 14149
        assert value(fams, "rlhf_run_learner_samples_trained", "rlhf_run_learner_samples_trained_total") == 14400
        assert value(fams, "rlhf_run_weight_server_ws_pulls", "rlhf_run_weight_server_ws_pulls_total") == 83
        # in base units, and no rates (rate() of the counters is): the records' own names are the monitor's
        latency = snap["stats"][M.WEIGHT_SERVER_STATS]["sync_latency_s"]
        assert value(fams, "rlhf_run_weight_server_sync_latency_seconds", "rlhf_run_weight_server_sync_latency_seconds") == latency
        assert value(fams, "rlhf_run_learner_loss", "rlhf_run_learner_loss") == snap["stats"][M.LEARNER_STATS]["loss/total"]
        assert not any(name.endswith("_per_s") for name in fams)
        # the gateway's running totals are counters, its levels gauges, its errors one counter by code
        assert value(fams, "rlhf_run_gateway_calls", "rlhf_run_gateway_calls_total") == 512
        assert fams["rlhf_run_gateway_sessions_open"].type == "gauge"
        assert value(fams, "rlhf_run_gateway_errors", "rlhf_run_gateway_errors_total", code="worker_stopped") == 4
        assert value(fams, "rlhf_run_gateway_errors", "rlhf_run_gateway_errors_total", code="channel_lost") == 1
        # worker-1 restarts (its totals from 0): its counter holds, then grows by what the new process adds
        snap["consumers"]["worker-1"]["stats"][M.WORKER_TOKENS] = 40
        target.update(snap)
        snap["consumers"]["worker-1"]["stats"][M.WORKER_TOKENS] = 100
        target.update(snap)
        fams = families(scrape(port))
        assert value(fams, "rlhf_run_worker_tokens", "rlhf_run_worker_tokens_total", worker="worker-1") == 14149 + 60
    finally:
        target.close()


def test_a_port_in_use_names_the_setting_and_close_frees_the_port():
    ex = learner_exporter("r")
    port = ex.serve(0)
    with pytest.raises(UserError, match="learner.prometheus_port"):
        learner_exporter("r").serve(port, setting="learner.prometheus_port")
    ex.close()
    with socket.socket() as s:  # free again
        s.bind(("127.0.0.1", port))


# ---- the Grafana dashboard

_NOT_METRICS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
                "le", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: label matchers, ranges, strings, grouping
    clauses, functions and keywords removed."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"(?<![\w:.])[A-Za-z_:][\w:]*", expr):  # not the unit of a number (5m)
        rest = expr[m.end():].lstrip()
        if not rest.startswith("(") and m.group() not in _NOT_METRICS:  # a function is followed by "("
            names.add(m.group())
    return names


def test_the_mismatch_gauges_say_what_they_measure():
    # the learner's own target and the run's (from the learner's stats in Redis) take their HELP
    # text from metric_names.METRIC_HELP; other gauges keep their key
    learner, run = families(targets()["learner"]), families(targets()["run"])
    assert len(M.METRIC_HELP) == 10
    for key, doc in M.METRIC_HELP.items():
        short = key.removeprefix("mismatch/")
        assert learner[f"rlhf_mismatch_{short}"].type == "gauge" and learner[f"rlhf_mismatch_{short}"].documentation == doc
        assert run[f"rlhf_run_learner_mismatch_{short}"].documentation == doc
    assert learner["rlhf_mismatch_lag0_kl_k3"].documentation.startswith(
        "train/rollout mismatch over the update's tokens at lag 0 (sampled by the weights the learner holds): KL(behaviour")
    assert value(learner, "rlhf_mismatch_lagged_tokens", "rlhf_mismatch_lagged_tokens") == 168
    assert learner["rlhf_reward_mean"].documentation == "'reward/mean'"


def test_promql_names_are_extracted():
    expr = 'histogram_quantile(0.95, sum by (le, worker) (rate(a_bucket{run=~"$run", x="y{z}"}[5m]))) / b_total offset 5m'
    assert promql_metric_names(expr) == {"a_bucket", "b_total"}


def targets() -> dict[str, str]:
    """The expositions of the learner's, a worker's and the run's target (the weight server's and the
    gateway's stats are the run target's) fed a real run's records."""
    learner = learner_exporter("r1")
    learner.update({M.UPDATES: 0, M.SAMPLES_TRAINED: 0})
    learner.update(INPUTS["learner_row"])
    worker = worker_exporter("worker-0", "r1")
    worker.update(INPUTS["snapshot"]["consumers"]["worker-0"]["stats"])
    worker.observe(GENERATION, 0.1)
    worker.observe(WEIGHT_SYNC, 0.01)
    run = RunExporter("r1")
    run.update(INPUTS["snapshot"])
    return {"learner": learner.render(), "worker": worker.render(), "run": run.render()}


def exposed_samples() -> dict[str, str]:
    """{sample name: its family's type} of the three targets."""
    out = {}
    for text in targets().values():
        for fam in text_string_to_metric_families(text):
            out.update({s.name: fam.type for s in fam.samples})
    return out


BAD = """# HELP a_time_s seconds, abbreviated
# TYPE a_time_s gauge
a_time_s 1.0
# HELP a_tokens_per_s a rate as a gauge
# TYPE a_tokens_per_s gauge
a_tokens_per_s 2.0
# HELP a_loss_total a level named as a counter
# TYPE a_loss_total gauge
a_loss_total 3.0
# HELP a_calls a counter without _total
# TYPE a_calls counter
a_calls 4.0
# HELP a_wait_milliseconds_total not the base unit
# TYPE a_wait_milliseconds_total counter
a_wait_milliseconds_total 5.0
# TYPE a_undocumented gauge
a_undocumented 6.0
"""


def test_the_naming_rules_catch_each_fault():
    assert lint(BAD) == [
        "a_time_s (gauge): abbreviated unit 's'",
        "a_tokens_per_s (gauge): abbreviated unit 's'",
        "a_loss_total (gauge): only a counter's name ends in _total",
        "a_calls (counter): a counter's name ends in _total",
        "a_wait_milliseconds_total (counter): 'milliseconds': use the base unit 'seconds'",
        "a_undocumented (gauge): no HELP text",
    ]


@pytest.mark.parametrize("target", ["learner", "worker", "run"])
def test_each_target_follows_prometheus_naming_rules(target):
    text = targets()[target]
    assert len(list(text_string_to_metric_families(text))) > 10  # a target fed something
    assert lint(text) == []


def test_promtool_finds_every_target_clean():
    if promtool(BAD) is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    assert len(promtool(BAD)) == 6  # it runs, and reads what it is given
    assert {name: promtool(text) for name, text in targets().items()} == {"learner": [], "worker": [], "run": []}


def test_grafana_dashboard_queries_name_exported_metrics():
    dash = json.loads((ROOT / "docs" / "grafana" / "rlhf.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(dash["panels"]) >= 9 and all(exprs)
    exposed = exposed_samples()
    used = set().union(*(promql_metric_names(e) for e in exprs))
    missing = sorted(used - set(exposed))
    assert not missing, f"the dashboard queries metrics no target exports: {missing}"
    for name in used:  # a suffix names the right kind: _bucket of a histogram, _total of a counter
        if name.endswith("_bucket"):
            assert exposed[name] == "histogram", name
        if name.endswith("_total"):
            assert exposed[name] == "counter", name
    quantiles = [e for e in exprs if "histogram_quantile" in e]
    assert {n for e in quantiles for n in promql_metric_names(e)} >= {
        "rlhf_learner_staleness_versions_bucket", "rlhf_learner_step_seconds_bucket",
        "rlhf_worker_weight_sync_seconds_bucket", "rlhf_worker_generation_seconds_bucket"}
