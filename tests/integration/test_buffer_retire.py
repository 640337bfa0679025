"""Retiring long-dead consumers against a real redis-server: a run whose workers come and go keeps
a bounded consumer table, its sums over workers stay exact, and leases are never dropped."""

from __future__ import annotations

import io
import time
import uuid

import msgpack
import pytest

import factories as T
from buffer import WorkerClient
from buffer_clients import Clients
from rlhf_core import metric_names as M
from rlhf_core.config import BufferConfig
from rlhf_run.progress import every_worker

pytestmark = pytest.mark.integration

LEASE_S = 0.3


@pytest.fixture
def buf(redis_url):
    b = Clients.connect(redis_url, "retire", BufferConfig(lease_timeout_s=LEASE_S, heartbeat_interval_s=0.1))
    b.learner.init_run(batch_size=64, group_size=4, max_staleness=4)
    yield b
    b.close()


def _since_now() -> float:
    """A time strictly after every heartbeat sent so far (their last_seen is taken before the call)."""
    t = time.time()
    while time.time() <= t:
        pass
    return time.time()


def _group_consumers(buf: Clients) -> dict[str, int]:
    """The prompts' consumer group's consumers and how many leases each owns."""
    return {c["name"].decode(): int(c["pending"]) for c in buf.redis.xinfo_consumers(buf.keys.prompts, "workers")}


def _sum(snap: dict, stat: str) -> float:
    return sum(w.get(stat, 0) for w in every_worker(snap))


def test_workers_that_come_and_go_are_retired_and_sums_over_the_run_stay_exact(buf):
    # Each hand-started rlhf-worker has a name of its own (host-pid-uuid): it heartbeats, works, sends
    # its last heartbeat and exits. A survivor's heartbeats sweep. 25 such restarts once left 25
    # records (and group consumers) for the whole run.
    buf.producer.enqueue_prompts(T.prompts(25))
    sent: dict[str, dict] = {}  # each worker's last stats: what sums over the run must add up to
    for gen in range(25):
        name = f"host-{gen}-{uuid.uuid4().hex[:6]}"
        buf.worker.heartbeat(name, 0, {M.WORKER_TOKENS: 0, M.WORKER_UPTIME: 0.25})
        (lease,) = buf.worker.claim(name, 1)
        assert buf.worker.complete(lease, T.group(lease.prompt)) == "appended"
        sent[name] = {M.WORKER_TOKENS: 100 + gen, M.WORKER_SAMPLES: 4, M.WORKER_UPTIME: 1.25, "t_wait": 0.5,
                      M.WORKER_TOKENS_PER_S: 80.0}
        buf.worker.heartbeat(name, 0, sent[name])  # its last one: the process exits
        dead_since = _since_now()
        sent["worker-0"] = {M.WORKER_TOKENS: 1000 + gen, M.WORKER_SAMPLES: 0, M.WORKER_UPTIME: 10.0 + gen}
        buf.worker.heartbeat("worker-0", 0, sent["worker-0"])
        assert buf.worker.retire_consumers(before=dead_since) == [name]
        snap = buf.monitor.metrics()
        assert set(snap["consumers"]) == {"worker-0"}  # bounded: the live one
        assert _group_consumers(buf) == {}  # the retired one's group consumer went with it
        assert snap["retired"]["consumers"] == gen + 1
        for stat in (M.WORKER_TOKENS, M.WORKER_SAMPLES, M.WORKER_UPTIME, "t_wait"):
            assert _sum(snap, stat) == sum(s.get(stat, 0) for s in sent.values()), stat
    # levels (a rate over a dead worker's uptime) are not summed
    assert M.WORKER_TOKENS_PER_S not in snap["retired"]["stats"]
    assert snap["retired"]["stats"][M.WORKER_TOKENS] == sum(100 + g for g in range(25))
    assert snap["counters"]["samples_appended"] == 25 * 4


def test_a_dead_worker_holding_leases_is_retired_only_once_a_claimer_took_them_over(buf):
    buf.producer.enqueue_prompts(T.prompts(2))
    held = buf.worker.claim("dead", 2)
    buf.worker.heartbeat("dead", 0, {M.WORKER_TOKENS: 50})  # then SIGKILLed: its leases stay in the group
    dead_since = _since_now()
    assert buf.worker.retire_consumers(before=dead_since) == []  # deleting its consumer would drop 2 prompts
    assert "dead" in buf.monitor.metrics()["consumers"] and _group_consumers(buf) == {"dead": 2}
    got = []
    deadline = time.monotonic() + 30
    while len(got) < 2 and time.monotonic() < deadline:  # idle for the lease timeout, then taken over
        got += buf.worker.claim("survivor", 2 - len(got), block_s=LEASE_S * 4)
    assert sorted(lease.lease_id for lease in got) == sorted(lease.lease_id for lease in held)
    assert all(lease.how == "reclaimed" for lease in got)
    assert buf.worker.retire_consumers(before=dead_since) == ["dead"]
    snap = buf.monitor.metrics()
    assert "dead" not in snap["consumers"] and snap["retired"] == {"consumers": 1, "stats": {M.WORKER_TOKENS: 50}}
    # the survivor (no heartbeat record: a bare claimer) keeps its group consumer while it owns leases
    assert _group_consumers(buf) == {"survivor": 2}
    for lease in got:
        assert buf.worker.complete(lease, T.group(lease.prompt)) == "appended"
    assert buf.monitor.metrics()["counters"]["samples_appended"] == 8
    assert buf.worker.retire_consumers(before=dead_since) == [] and _group_consumers(buf) == {}  # owns nothing: its next claim makes it again
    buf.producer.enqueue_prompts(T.prompts(1, start=2))
    assert len(buf.worker.claim("survivor", 1)) == 1 and _group_consumers(buf) == {"survivor": 1}


def test_a_workers_heartbeats_retire_the_consumers_dead_for_ten_lease_timeouts(buf, redis_url):
    # records as workers' heartbeats leave them: one silent 11 lease timeouts, one 5
    sec, usec = buf.redis.time()
    now = sec + usec / 1e6
    buf.redis.hset(buf.keys.consumers, mapping={
        "gone": msgpack.packb({"last_seen": now - 11 * LEASE_S, "stats": {M.WORKER_TOKENS: 7}, "leases": 0}),
        "late": msgpack.packb({"last_seen": now - 5 * LEASE_S, "stats": {M.WORKER_TOKENS: 5}, "leases": 0}),
    })
    worker = WorkerClient.connect(redis_url, "retire", BufferConfig(lease_timeout_s=LEASE_S))
    worker.heartbeat("new", 0, {M.WORKER_TOKENS: 1})  # a worker's first heartbeat sweeps
    snap = buf.monitor.metrics()
    assert set(snap["consumers"]) == {"late", "new"}
    assert snap["retired"] == {"consumers": 1, "stats": {M.WORKER_TOKENS: 7}}
    assert _sum(snap, M.WORKER_TOKENS) == 13
    worker.close()


def test_the_monitor_and_the_run_exporter_show_the_retired(buf):
    from rich.console import Console

    from rlhf_run import monitor
    from rlhf_run.run_exporter import RunExporter

    buf.worker.heartbeat("old", 0, {M.WORKER_TOKENS: 9, M.WORKER_SAMPLES: 4})
    dead_since = _since_now()
    buf.worker.heartbeat("worker-0", 0, {M.WORKER_TOKENS: 3, M.WORKER_SAMPLES: 2})
    assert buf.worker.retire_consumers(before=dead_since) == ["old"]
    snap = monitor.snapshot(buf.monitor)
    out = io.StringIO()
    Console(file=out, width=200).print(monitor.render(snap))
    assert "(1 retired)" in out.getvalue() and "worker-0" in out.getvalue()
    exporter = RunExporter("retire")
    exporter.update(snap)
    text = exporter.render()
    exporter.close()
    assert 'rlhf_run_workers_retired{run="retire"} 1.0' in text
    assert 'worker="worker-0"' in text and 'worker="old"' not in text


def _clock(offset_s: float):
    """The ``time`` module as a host whose clock is ``offset_s`` off sees it."""
    import types

    real = time.time
    return types.SimpleNamespace(**{**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")},
                                    "time": lambda: real() + offset_s})


def test_a_worker_whose_clock_is_off_is_neither_retired_early_nor_kept_when_dead(buf, redis_url, monkeypatch):
    # Each process heartbeats with the clock of its host; the sweeper compared it with its own.
    # A worker's host an hour behind looked silent for an hour: retired while it worked, its next
    # heartbeat made its record again and the run's sums counted its totals twice.
    from buffer import prompts

    worker = WorkerClient.connect(redis_url, "retire", BufferConfig(lease_timeout_s=LEASE_S))
    try:
        monkeypatch.setattr(prompts, "time", _clock(-3600.0))
        worker.heartbeat("behind", 0, {M.WORKER_TOKENS: 10})
        assert buf.worker.retire_consumers() == []  # ten lease timeouts ago, on Redis's clock
        worker.heartbeat("behind", 0, {M.WORKER_TOKENS: 25})
        snap = buf.monitor.metrics()
        assert snap["retired"]["consumers"] == 0 and _sum(snap, M.WORKER_TOKENS) == 25
        assert 0 <= snap["consumers"]["behind"]["age_s"] < 60
        # a host an hour ahead: once it is silent it is retired like any other
        monkeypatch.setattr(prompts, "time", _clock(3600.0))
        worker.heartbeat("ahead", 0, {M.WORKER_TOKENS: 7})
        dead_since = _since_now()
        worker.heartbeat("behind", 0, {M.WORKER_TOKENS: 25})
        assert buf.worker.retire_consumers(before=dead_since) == ["ahead"]
        snap = buf.monitor.metrics()
        assert set(snap["consumers"]) == {"behind"} and _sum(snap, M.WORKER_TOKENS) == 25 + 7
    finally:
        worker.close()


def test_a_worker_retired_while_paused_and_resumed_counts_its_totals_once(buf, redis_url):
    # SIGSTOPped past ten lease timeouts: the sweep adds its totals to the retired sums; resumed,
    # it heartbeated its running totals again, and the sums counted those up to the pause twice.
    worker = WorkerClient.connect(redis_url, "retire", BufferConfig(lease_timeout_s=LEASE_S))
    try:
        worker.heartbeat("paused", 0, {M.WORKER_TOKENS: 10, M.WORKER_UPTIME: 1.0, M.WORKER_TOKENS_PER_S: 10.0})
        assert buf.worker.retire_consumers(before=_since_now()) == ["paused"]
        worker.heartbeat("paused", 0, {M.WORKER_TOKENS: 25, M.WORKER_UPTIME: 5.0, M.WORKER_TOKENS_PER_S: 5.0})
        snap = buf.monitor.metrics()
        assert _sum(snap, M.WORKER_TOKENS) == 25 and _sum(snap, M.WORKER_UPTIME) == 5.0
        # its record holds what came since the sweep; a level (a rate) is left as the worker said it
        assert snap["consumers"]["paused"]["stats"] == {M.WORKER_TOKENS: 15, M.WORKER_UPTIME: 4.0,
                                                        M.WORKER_TOKENS_PER_S: 5.0}
        worker.heartbeat("paused", 0, {M.WORKER_TOKENS: 30, M.WORKER_UPTIME: 6.0})
        assert _sum(buf.monitor.metrics(), M.WORKER_TOKENS) == 30
        # paused and swept a second time: still once
        assert buf.worker.retire_consumers(before=_since_now()) == ["paused"]
        worker.heartbeat("paused", 0, {M.WORKER_TOKENS: 31, M.WORKER_UPTIME: 7.0})
        snap = buf.monitor.metrics()
        assert _sum(snap, M.WORKER_TOKENS) == 31 and snap["retired"]["consumers"] == 2
    finally:
        worker.close()
