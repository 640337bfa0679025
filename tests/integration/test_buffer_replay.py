"""Replay mode against a real redis-server: the rate limiter blocking both ways, reuse, eviction, sampling."""

from __future__ import annotations

import threading
import time

import pytest

import factories as T
from buffer_clients import Clients
from rlhf_core.config import BufferConfig

pytestmark = pytest.mark.integration

G, B = 4, 8  # 2 groups per batch


def _buf(url: str, run: str, max_staleness: int = 100, **cfg) -> Clients:
    cfg.setdefault("lookahead", None)  # admission up to max_staleness: several batches at version 0
    buf = Clients.connect(url, run, BufferConfig(lease_timeout_s=5.0, **cfg))
    params = buf.learner.init_run(batch_size=B, group_size=G, max_staleness=max_staleness)
    assert params["mode"] == "replay"
    return buf


def _insert(buf: Clients, n: int, version: int = 0, start: int = 0) -> list[str]:
    buf.producer.enqueue_prompts(T.prompts(n, start=start))
    leases = buf.worker.claim("w", n)
    assert len(leases) == n, f"admitted {len(leases)} of {n}"
    for lease in leases:
        assert buf.worker.complete(lease, T.group(lease.prompt, G, version=version)) == "appended"
    return [lease.prompt.prompt_id for lease in leases]


def test_sampler_blocks_below_min_size_and_on_the_ratio_and_wakes_on_insert(redis_url):
    # spi 2, min_size 8, error_buffer 8: min_diff = 2*8 - 8 = 8, max_diff = 24
    buf = _buf(redis_url, "rl-s", samples_per_insert=2, min_size_to_sample=8, error_buffer=8, max_reuse=4)
    assert buf.learner.read_batch("L", 0, B, timeout_s=0.1) is None  # empty
    _insert(buf, 1)
    assert buf.learner.read_batch("L", 0, B, timeout_s=0.1) is None  # size 4 < min_size 8
    _insert(buf, 1, start=1)
    first = buf.learner.read_batch("L", 0, B, timeout_s=0.5)  # inserts 8: 8*2 - (0+8) = 8 >= 8
    assert len(first) == 8
    buf.learner.commit(first)
    assert buf.learner.read_batch("L", 0, B, timeout_s=0.2) is None  # 8*2 - (8+8) = 0 < 8: ratio blocks

    got: list = []
    reader = threading.Thread(target=lambda: got.append(buf.learner.read_batch("L", 0, B, timeout_s=3.0)))
    t0 = time.monotonic()
    reader.start()
    time.sleep(0.15)
    _insert(buf, 1, start=2)  # inserts 12: 24 - (8+8) = 8 >= 8
    reader.join()
    assert got[0] is not None and len(got[0]) == 8
    assert time.monotonic() - t0 < 1.5  # woken by the insert, not by the 3 s timeout
    c = buf.monitor.metrics()["counters"]
    assert (c["rl_inserts"], c["rl_samples"]) == (12, 16)


def test_inserter_blocks_at_admission_and_wakes_on_sampling(redis_url):
    # insert room = floor((max_diff 24 + samples) / 2) - (inserts + in flight)
    buf = _buf(redis_url, "rl-i", samples_per_insert=2, min_size_to_sample=8, error_buffer=8, max_reuse=4)
    buf.producer.enqueue_prompts(T.prompts(10))
    first = buf.worker.claim("w", 10)
    assert len(first) == 3 and buf.monitor.admission_budget() == 0  # room for 12 samples = 3 groups
    assert buf.worker.claim("w", 10, block_s=0.2) == []  # the insert side is blocked
    for lease in first:
        buf.worker.complete(lease, T.group(lease.prompt, G))
    assert buf.worker.claim("w", 10) == []  # completing changes nothing: inserts + in flight is still 12

    got: list = []
    claimer = threading.Thread(target=lambda: got.append(buf.worker.claim("w", 10, block_s=3.0)))
    t0 = time.monotonic()
    claimer.start()
    time.sleep(0.15)
    batch = buf.learner.read_batch("L", 0, B, timeout_s=1.0)  # samples 8: room floor(32/2) - 12 = 4
    claimer.join()
    assert len(batch) == 8 and len(got[0]) == 1
    assert time.monotonic() - t0 < 1.5  # woken by the draw, not by the 3 s timeout
    assert buf.monitor.admission_budget() == 0


def test_each_sample_is_used_exactly_max_reuse_times(redis_url):
    buf = _buf(redis_url, "reuse", max_reuse=3)
    _insert(buf, 2)
    uses = []
    for _ in range(3):
        batch = buf.learner.read_batch("L", 0, B, timeout_s=0.5)
        uses.append(sorted(g.group_id for g in batch.groups))
        assert buf.learner.commit(batch) == 2
    assert uses == [["g-p0", "g-p1"]] * 3
    assert buf.learner.read_batch("L", 0, B, timeout_s=0.1) is None
    c = buf.monitor.metrics()["counters"]
    assert (c["samples_consumed"], c["groups_consumed"], c["replay_size"], c["samples_in_buffer"]) == (24, 6, 0, 0)
    assert buf.redis.xlen(buf.keys.samples) == 0


def test_a_replayed_batch_reports_the_decoding_of_its_records(redis_url, monkeypatch):
    from buffer import replay

    T.fake_decode_clock(monkeypatch, replay)
    buf = _buf(redis_url, "decode", max_reuse=2)
    _insert(buf, 2)
    for _ in range(2):  # each draw decodes its two groups again
        batch = buf.learner.read_batch("L", 0, B, timeout_s=0.5)
        assert batch.decode_s == 2.0
        buf.learner.commit(batch)


def test_capacity_evicts_the_stalest_first(redis_url):
    buf = _buf(redis_url, "cap", max_reuse=2, capacity=8)
    for version in range(4):
        buf.learner.set_learner_version(version)
        _insert(buf, 1, version=version, start=version)
    c = buf.monitor.metrics()["counters"]
    assert (c["samples_evicted"], c["replay_size"], c["samples_in_buffer"]) == (8, 8, 8)
    batch = buf.learner.read_batch("L", 3, B, timeout_s=0.5)
    assert sorted(g.group_id for g in batch.groups) == ["g-p2", "g-p3"]


def test_replay_staleness_drops_per_lag(redis_url):
    buf = _buf(redis_url, "rstale", max_staleness=1, max_reuse=2)
    buf.learner.set_learner_version(3)
    buf.producer.enqueue_prompts(T.prompts(4))
    for lease, version in zip(buf.worker.claim("w", 4), [0, 1, 2, 3]):
        buf.worker.complete(lease, T.group(lease.prompt, G, version=version))
    batch = buf.learner.read_batch("L", 3, B, timeout_s=0.5)
    assert sorted(g.group_id for g in batch.groups) == ["g-p2", "g-p3"]
    assert buf.monitor.metrics()["dropped_stale_hist"] == {2: 4, 3: 4}


def test_uniform_sampling_draws_distinct_groups_and_covers_the_table(redis_url):
    buf = _buf(redis_url, "uni", sampling="uniform", max_reuse=1000)
    inserted = set(_insert(buf, 6))
    seen: set[str] = set()
    for _ in range(30):
        batch = buf.learner.read_batch("L", 0, B, timeout_s=0.5)
        ids = [g.group_id for g in batch.groups]
        assert len(set(ids)) == 2
        seen.update(i.removeprefix("g-") for i in ids)
        buf.learner.commit(batch)
    assert seen == inserted  # 30 draws of 2 out of 6: missing one is a ~(2/3)^30 event
    assert buf.monitor.metrics()["counters"]["samples_consumed"] == 30 * B


def test_replay_learner_crash_puts_drawn_groups_back(redis_url):
    buf = _buf(redis_url, "rcrash", max_reuse=2, samples_per_insert=1, min_size_to_sample=1, error_buffer=100)
    _insert(buf, 2)
    drawn = buf.learner.read_batch("L", 0, B, timeout_s=0.5)
    assert buf.learner.pending_for("L") == sorted(drawn.ids)
    assert buf.monitor.metrics()["counters"]["rl_samples"] == 8
    buf.close()
    restarted = Clients.connect(redis_url, "rcrash", BufferConfig(lease_timeout_s=5.0, lookahead=None))
    again = restarted.learner.read_batch("L", 0, B, timeout_s=0.5)
    assert sorted(again.ids) == sorted(drawn.ids)  # FIFO: the returned groups come first
    assert restarted.monitor.metrics()["counters"]["rl_samples"] == 8  # the lost draw was un-counted
    assert restarted.learner.commit(again) == 2
    assert restarted.monitor.metrics()["counters"]["samples_consumed"] == 8


def test_groups_dropped_as_too_stale_before_any_use_give_their_admission_back(redis_url):
    # FIFO's drop.lua does the same; without it a run with max_reuse 1 deadlocks: the learner
    # waits for groups while claims wait for budget the dropped groups never give back
    buf = _buf(redis_url, "rstale-budget", max_staleness=1, max_reuse=2)
    buf.producer.enqueue_prompts(T.prompts(4))
    leases = buf.worker.claim("w", 4)  # budget (1 + 0 + 1) * 8: all 4 admitted
    for lease in leases[:2]:
        buf.worker.complete(lease, T.group(lease.prompt, G, version=0))
    buf.learner.commit(buf.learner.read_batch("L", 0, B, timeout_s=0.5))  # used once (max_reuse 2: still in the table)
    for lease in leases[2:]:
        buf.worker.complete(lease, T.group(lease.prompt, G, version=0))
    buf.learner.set_learner_version(2)
    assert buf.learner.read_batch("L", 2, B, timeout_s=0.1) is None  # all 4 too stale (lag 2 > 1)
    c = buf.monitor.metrics()["counters"]
    # only the 2 never used are dropped and give their admission back: the used ones were trained
    # on, and age out
    assert (c["groups_dropped_stale"], c["groups_aged_out"], c["budget_returned"], c["admitted"]) == (2, 2, 2 * G, 2 * G)
    assert buf.monitor.admission_budget() == (1 + 2 + 1) * B - 2 * G


def test_trained_groups_that_age_out_are_not_reported_as_dropped_untrained(redis_url):
    # A group trained once and then too stale to draw again was counted in samples_dropped_stale
    # (and its lag histogram): the summary said all of the generated samples 'were dropped: raise
    # algo.max_staleness' for a run that trained every one, and the monitor and Prometheus agreed
    import dataclasses

    from rlhf_core.config import Config
    from rlhf_run.summary import format_summary, summarize

    buf = _buf(redis_url, "aged", max_staleness=1, max_reuse=4)
    _insert(buf, 2)
    buf.learner.commit(buf.learner.read_batch("L", 0, B, timeout_s=0.5))  # both trained once at version 0
    buf.learner.set_learner_version(2)
    assert buf.learner.read_batch("L", 2, B, timeout_s=0.1) is None  # both age out (lag 2 > 1)
    snap = buf.monitor.metrics()
    c = snap["counters"]
    assert (c["samples_appended"], c["samples_consumed"], c["samples_dropped_stale"], c["samples_aged_out"]) == (8, 8, 0, 8)
    assert (c["groups_dropped_stale"], c["groups_aged_out"], snap["dropped_stale_hist"]) == (0, 2, {})
    assert (c["budget_returned"], c["samples_in_buffer"]) == (0, 0)  # trained: their admission stays taken

    cfg = Config()
    cfg = dataclasses.replace(cfg, buffer=buf.store.cfg, algo=dataclasses.replace(cfg.algo, max_staleness=1))
    rows = [{"learner/updates": 1, "learner/samples_trained": 8, "time": 1.0}]
    s = summarize(cfg, rows, [snap], wall_s=5.0, exit_reason="done")
    assert (s["samples_dropped_stale"], s["samples_aged_out"]) == (0, 8)
    text = format_summary(s)
    assert "dropped as too stale" not in text and "were dropped" not in text, text
    assert text.splitlines()[1] == "  steps 1, samples trained 8, generated 8, trained and then aged out 8", text
    buf.close()


def test_groups_evicted_before_any_use_give_their_admission_back(redis_url):
    buf = _buf(redis_url, "cap-budget", max_reuse=2, capacity=8)
    _insert(buf, 2)
    buf.learner.commit(buf.learner.read_batch("L", 0, B, timeout_s=0.5))  # both used once
    for version in (1, 2):  # each evicts one of the used groups: trained on, nothing given back
        _insert(buf, 1, version=version, start=1 + version)
    assert buf.monitor.metrics()["counters"]["budget_returned"] == 0
    _insert(buf, 1, version=3, start=4)  # evicts g-p2, never used
    c = buf.monitor.metrics()["counters"]
    assert (c["samples_evicted"], c["budget_returned"], c["admitted"]) == (12, G, 4 * G)
