"""Atomic append+ack under injected failures, and a Redis killed and restarted (AOF) mid-run."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import redis

import factories as T
from buffer import keys as K
from buffer_clients import Clients
from rlhf_core.config import BufferConfig
from servers import wait_for

pytestmark = pytest.mark.integration

LEASE_S = 0.4


class SimulatedCrash(BaseException):
    """The worker process dies here (not an error the buffer may catch and retry)."""


def _connect(url: str) -> Clients:
    return Clients.connect(url, "dur", BufferConfig(lease_timeout_s=LEASE_S, heartbeat_interval_s=0.1, max_retry_s=20.0,
                                                   lookahead=None))  # admission up to max_staleness


def _state(buf: Clients) -> tuple[int, int, int]:
    """(groups in the sample stream, prompts still leased, prompts acked), read straight from Redis."""
    k = buf.keys
    leased = buf.redis.xpending(k.prompts, K.WORKERS_GROUP)["pending"]
    return buf.redis.xlen(k.samples), leased, buf.monitor.metrics()["counters"]["prompts_acked"]


def test_crash_between_append_and_ack_leaves_nothing_partial(redis_url):
    buf = _connect(redis_url)
    buf.learner.init_run(batch_size=8, group_size=4, max_staleness=4)
    buf.producer.enqueue_prompts(T.prompts(1))
    (lease,) = buf.worker.claim("w1", 1)
    real = buf.store.scripts.complete

    def crash_in_flight(*args, **kwargs):
        # the samples are validated and encoded, the call is about to go out: the worker dies
        raise SimulatedCrash()

    buf.store.scripts.__dict__["complete"] = crash_in_flight
    with pytest.raises(SimulatedCrash):
        buf.worker.complete(lease, T.group(lease.prompt))
    buf.store.scripts.__dict__["complete"] = real
    assert _state(buf) == (0, 1, 0)  # no samples, prompt still leased, not acked
    # the lease expires and another worker does the prompt: exactly one group lands
    other = _connect(redis_url)
    (again,) = other.worker.claim("w2", 1, block_s=LEASE_S * 3)
    assert again.lease_id == lease.lease_id and again.delivery_count == 2
    assert other.worker.complete(again, T.group(again.prompt)) == "appended"
    assert _state(buf) == (1, 0, 1)


def test_lost_reply_is_retried_without_a_duplicate(redis_url):
    buf = _connect(redis_url)
    buf.learner.init_run(batch_size=8, group_size=4, max_staleness=4)
    buf.producer.enqueue_prompts(T.prompts(2))
    leases = buf.worker.claim("w1", 2)
    real = buf.store.scripts.complete
    calls = {"n": 0}

    def reply_lost(*args, **kwargs):
        calls["n"] += 1
        result = real(*args, **kwargs)  # Redis ran the script...
        if calls["n"] == 1:
            raise redis.exceptions.ConnectionError("connection reset (injected after the script ran)")
        return result  # ...and the retry finds the prompt already completed

    buf.store.scripts.__dict__["complete"] = reply_lost
    assert buf.worker.complete(leases[0], T.group(leases[0].prompt)) == "duplicate"
    assert calls["n"] == 2
    assert buf.worker.complete(leases[1], T.group(leases[1].prompt)) == "appended"
    assert _state(buf) == (2, 0, 2)
    c = buf.monitor.metrics()["counters"]
    assert (c["samples_appended"], c["groups_appended"], c["completions_duplicate"]) == (8, 2, 1)


@pytest.mark.timeout(60)
def test_redis_killed_during_completions_every_prompt_lands_exactly_once(redis_server, caplog):
    n = 60
    buf = _connect(redis_server.url)
    buf.learner.init_run(batch_size=n * 4, group_size=4, max_staleness=0)
    buf.producer.enqueue_prompts(T.prompts(n))
    leases = buf.worker.claim("w", n)
    assert len(leases) == n
    midway, down = threading.Event(), threading.Event()
    results: list[str] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for i, lease in enumerate(leases):
                results.append(buf.worker.complete(lease, T.group(lease.prompt)))
                if i == n // 3:
                    midway.set()
                    down.wait(10)  # the next completion meets the dead server, however slow this host
                time.sleep(0.004)
        except BaseException as exc:  # noqa: BLE001  # reported below
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    assert midway.wait(10)
    port = redis_server.port
    redis_server.stop(signal.SIGKILL)  # crash: only what the AOF (fsync always) holds survives
    down.set()
    wait_for(lambda: buf.store.retry.reconnects >= 1, 10, "the worker to meet the dead server")
    redis_server.start(port=port)
    t.join(30)
    assert not errors and len(results) == n  # the worker was mid-run when Redis died, and rode it out
    assert any("retrying in" in r.getMessage() for r in caplog.records if r.name == "buffer")
    # a completion whose reply died with the server reports "duplicate" on retry; none is lost
    assert results.count("appended") + results.count("duplicate") == n
    groups, leased, acked = _state(buf)
    assert (groups, leased, acked) == (n, 0, n)
    batch = buf.learner.read_batch("L", 0, n * 4, timeout_s=2.0)
    assert sorted(g.group_id for g in batch.groups) == sorted(f"g-p{i}" for i in range(n))
    assert buf.monitor.metrics()["counters"]["samples_appended"] == n * 4


@pytest.mark.timeout(60)
def test_restart_with_aof_loses_no_sample_and_no_lease(redis_server):
    worker_proc = _connect(redis_server.url)
    learner_proc = _connect(redis_server.url)
    learner_proc.learner.init_run(batch_size=8, group_size=4, max_staleness=4)
    learner_proc.producer.enqueue_prompts(T.prompts(20))
    leases = worker_proc.worker.claim("w", 8)
    for lease in leases[:4]:
        worker_proc.worker.complete(lease, T.group(lease.prompt))
    in_training = learner_proc.learner.read_batch("L", 0, 8, timeout_s=1.0)  # read, not committed

    redis_server.restart(signal.SIGKILL)

    # both clients reconnect on their next call and carry on where they were
    assert learner_proc.learner.pending_for("L") == in_training.ids
    assert worker_proc.worker.heartbeat("w", version=0) == []  # still holds its 4 unfinished leases
    for lease in leases[4:]:
        assert worker_proc.worker.complete(lease, T.group(lease.prompt)) == "appended"
    assert learner_proc.learner.commit(in_training) == 2
    rest = [learner_proc.learner.read_batch("L", 0, 8, timeout_s=1.0) for _ in range(3)]
    assert [learner_proc.learner.commit(b) for b in rest] == [2, 2, 2]
    seen = [g.group_id for b in [in_training, *rest] for g in b.groups]
    assert sorted(seen) == sorted(f"g-p{i}" for i in range(8))
    c = learner_proc.monitor.metrics()["counters"]
    assert (c["prompts_enqueued"], c["prompts_waiting"], c["prompts_acked"], c["samples_consumed"]) == (20, 12, 8, 32)
    assert (c["samples_in_buffer"], c["inflight"], c["admitted"]) == (0, 0, 32)
    remaining = worker_proc.worker.claim("w", 20)
    assert sorted(lease.prompt.prompt_id for lease in remaining) == [f"p{i}" for i in range(8, 10)]  # budget (4+0+1)*8 - 32 = 8 samples = 2 prompts


def test_complete_many_is_one_round_trip_and_survives_a_server_that_forgot_the_scripts(redis_url):
    buf = _connect(redis_url)
    buf.learner.init_run(batch_size=8, group_size=4, max_staleness=4)
    buf.producer.enqueue_prompts(T.prompts(4))
    leases = buf.worker.claim("w1", 4)
    buf.worker.complete_many([(leases[0], T.group(leases[0].prompt))])  # the script is loaded once here
    buf.redis.config_resetstat()
    statuses = buf.worker.complete_many([(lease, T.group(lease.prompt)) for lease in leases[1:3]])
    assert statuses == ["appended", "appended"]
    calls = {k: v["calls"] for k, v in buf.redis.info("commandstats").items()}
    # two EVALSHA in one pipeline and nothing else: no SCRIPT EXISTS before it
    assert calls.get("cmdstat_evalsha") == 2 and "cmdstat_script|exists" not in calls, calls
    # a restarted (or flushed) server has no scripts: NOSCRIPT -> load -> the same call runs once
    buf.redis.script_flush()
    assert buf.worker.complete_many([(leases[3], T.group(leases[3].prompt))]) == ["appended"]
    assert _state(buf) == (4, 0, 4)
