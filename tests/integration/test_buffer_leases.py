"""Prompt leases against a real redis-server: heartbeats, a killed worker, release, dead letters, blocking."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import factories as T
from buffer import WorkerClient
from buffer_clients import Clients
from rlhf_core.config import BufferConfig

pytestmark = pytest.mark.integration

LEASE_S = 0.6


@pytest.fixture
def buf(redis_url):
    b = Clients.connect(redis_url, "leases", BufferConfig(lease_timeout_s=LEASE_S, heartbeat_interval_s=0.1, max_deliveries=3))
    b.learner.init_run(batch_size=64, group_size=4, max_staleness=4)  # budget (4+0+1)*64 = 320 samples = 80 prompts
    yield b
    b.close()


WORKER = textwrap.dedent(
    f"""
    import sys, time
    from buffer import WorkerClient
    from rlhf_core.config import BufferConfig
    buf = WorkerClient.connect(sys.argv[1], "leases", BufferConfig(lease_timeout_s={LEASE_S!r}))
    leases = buf.claim("doomed", 3, block_s=5.0)
    print(" ".join(lease.lease_id for lease in leases), flush=True)
    while True:
        buf.heartbeat("doomed", version=0)
        time.sleep(0.1)
    """
)


@pytest.mark.timeout(30)
def test_killed_worker_leases_are_redelivered_once(buf, redis_url):
    buf.producer.enqueue_prompts(T.prompts(8))
    proc = subprocess.Popen([sys.executable, "-c", WORKER, redis_url], stdout=subprocess.PIPE, text=True)
    try:
        doomed_ids = proc.stdout.readline().split()
        assert len(doomed_ids) == 3
        # while it heartbeats, its leases stay put well past the lease timeout
        time.sleep(LEASE_S * 1.5)
        first = buf.worker.claim("survivor", 10, block_s=0)
        assert len(first) == 5 and not {lease.lease_id for lease in first} & set(doomed_ids)
        assert all(lease.how == "new" and lease.delivery_count == 1 for lease in first)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    for lease in first:
        assert buf.worker.complete(lease, T.group(lease.prompt)) == "appended"
    assert buf.worker.claim("survivor", 10, block_s=0) == []  # not expired yet
    t0 = time.monotonic()
    again = buf.worker.claim("survivor", 10, block_s=LEASE_S * 4)
    waited = time.monotonic() - t0
    assert sorted(lease.lease_id for lease in again) == sorted(doomed_ids)
    assert all(lease.how == "reclaimed" and lease.delivery_count == 2 for lease in again)
    assert waited < LEASE_S + 1.0  # woken by the periodic re-check, not at the end of block_s
    for lease in again:
        assert buf.worker.complete(lease, T.group(lease.prompt)) == "appended"
    c = buf.monitor.metrics()["counters"]
    assert (c["prompts_claimed"], c["prompts_reclaimed"], c["prompts_acked"]) == (8, 3, 8)
    assert (c["groups_appended"], c["samples_appended"], c["completions_duplicate"]) == (8, 32, 0)
    batch = buf.learner.read_batch("learner", 0, 32, timeout_s=1.0)
    assert sorted(s.prompt_id for s in batch.samples) == sorted(f"p{i}" for i in range(8) for _ in range(4))
    assert c["admitted"] == 32 and c["inflight"] == 0  # each prompt admitted once, despite re-delivery


def test_zombie_completion_after_reclaim_is_a_duplicate(buf):
    buf.producer.enqueue_prompts(T.prompts(1))
    (slow,) = buf.worker.claim("slow", 1)
    time.sleep(LEASE_S + 0.05)
    (fast,) = buf.worker.claim("fast", 1)
    assert fast.lease_id == slow.lease_id and fast.delivery_count == 2
    assert buf.worker.heartbeat("slow") == [slow.lease_id]  # the slow worker learns it lost the lease
    assert buf.worker.complete(fast, T.group(fast.prompt, version=1)) == "appended"
    assert buf.worker.complete(slow, T.group(slow.prompt, version=0)) == "duplicate"
    c = buf.monitor.metrics()["counters"]
    assert (c["groups_appended"], c["samples_appended"], c["completions_duplicate"]) == (1, 4, 1)


def test_heartbeat_does_not_steal_back_and_records_consumer(buf):
    buf.producer.enqueue_prompts(T.prompts(2))
    leases = buf.worker.claim("w", 2)
    assert buf.worker.heartbeat("w", version=7, stats={"tokens_per_s": 12.5}) == []
    rec = buf.monitor.metrics()["consumers"]["w"]
    assert (rec["version"], rec["stats"], rec["leases"]) == (7, {"tokens_per_s": 12.5}, 2)
    assert 0 <= rec["age_s"] < 5
    time.sleep(LEASE_S + 0.05)
    taken = buf.worker.claim("other", 1)
    assert [lease.lease_id for lease in taken] == [leases[0].lease_id]
    assert buf.worker.heartbeat("w") == [leases[0].lease_id]
    assert buf.worker.heartbeat("w") == []  # the lost lease is forgotten; the other one is still held
    time.sleep(LEASE_S / 2)
    assert buf.worker.heartbeat("w") == [] and buf.worker.heartbeat("other") == []
    time.sleep(LEASE_S / 2 + 0.05)
    assert buf.worker.claim("third", 5) == []  # lease 1 renewed in time, lease 0 belongs to `other`


def test_release_redelivers_without_counting_a_delivery(buf):
    buf.producer.enqueue_prompts(T.prompts(3))
    leases = buf.worker.claim("w1", 3)
    budget = buf.monitor.admission_budget()
    assert buf.worker.release(leases[:2]) == 2
    assert buf.monitor.admission_budget() == budget + 8  # two groups' reservation returned
    got = buf.worker.claim("w2", 5)
    assert [(lease.lease_id, lease.how, lease.delivery_count) for lease in got] == [(lease.lease_id, "released", 1) for lease in leases[:2]]
    assert buf.monitor.admission_budget() == budget  # admitted again
    assert buf.worker.release(leases[:2]) == 0  # w1 no longer holds them
    c = buf.monitor.metrics()["counters"]
    assert (c["prompts_released"], c["prompts_claimed"], c["budget_returned"]) == (2, 3, 8)


def test_prompt_that_keeps_killing_workers_is_dead_lettered(buf):
    buf.producer.enqueue_prompts(T.prompts(1))
    for attempt in range(1, 4):
        got = buf.worker.claim(f"victim{attempt}", 1, block_s=LEASE_S * 3)
        assert [lease.delivery_count for lease in got] == [attempt]
        budget_while_held = buf.monitor.admission_budget()
    assert buf.worker.claim("victim4", 1, block_s=LEASE_S + 0.3) == []
    dead = buf.monitor.dead_letters()
    assert len(dead) == 1 and dead[0]["kind"] == "prompt" and "delivered 4 times" in dead[0]["reason"]
    assert dead[0]["producer"] == "victim3" and b"count from 0" in dead[0]["raw"]
    assert buf.monitor.admission_budget() == budget_while_held + 4  # its reservation returned
    c = buf.monitor.metrics()["counters"]
    assert (c["prompts_dead_lettered"], c["prompts_reclaimed"], c["dead_letters"], c["inflight"]) == (1, 2, 1, 0)


def test_blocking_claim_waits_without_busy_loop_and_wakes_on_enqueue(buf):
    before = _script_calls(buf)
    t0 = time.monotonic()
    assert buf.worker.claim("w", 1, block_s=0.5) == []
    assert 0.5 <= time.monotonic() - t0 < 1.5
    calls = _script_calls(buf) - before
    assert 2 <= calls <= 5  # one check per wake-up cap (0.2 s), not a spin

    timer = threading.Timer(0.15, lambda: buf.producer.enqueue_prompts(T.prompts(1)))
    timer.start()
    t0 = time.monotonic()
    got = buf.worker.claim("w", 1, block_s=3.0)
    timer.join()
    assert len(got) == 1 and time.monotonic() - t0 < 1.5  # woken by the enqueue, not at block_s=3


def test_claim_waits_for_the_run_to_be_initialised(redis_url):
    cfg = BufferConfig(lease_timeout_s=LEASE_S, heartbeat_interval_s=0.1)
    worker, run = WorkerClient.connect(redis_url, "late", cfg), Clients.connect(redis_url, "late", cfg)

    def start() -> None:
        run.learner.init_run(batch_size=8, group_size=4, max_staleness=0)
        run.producer.enqueue_prompts(T.prompts(3))

    timer = threading.Timer(0.2, start)
    timer.start()
    got = worker.claim("w", 5, block_s=3.0)
    timer.join()
    assert [lease.prompt.prompt_id for lease in got] == ["p0", "p1"]  # 8 samples of budget = 2 prompts of 4


def _script_calls(buf: Clients) -> int:
    stats = buf.redis.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


def test_a_late_completion_of_a_released_prompt_takes_its_reservation_back(buf):
    # A pauses past its lease, B reclaims the prompt and stops (releasing it: its reservation goes
    # back), A runs again and completes it: the group lands once and is admitted once
    buf.producer.enqueue_prompts(T.prompts(1))
    (a,) = buf.worker.claim("A", 1)
    time.sleep(LEASE_S + 0.05)
    (b,) = buf.worker.claim("B", 1)
    assert b.lease_id == a.lease_id and b.how == "reclaimed"
    assert buf.worker.release([b]) == 1
    assert buf.worker.complete(a, T.group(a.prompt)) == "appended"
    c = buf.monitor.metrics()["counters"]
    assert (c["groups_appended"], c["admitted"], c["inflight"], c["prompts_acked"]) == (1, 4, 0, 1)
    assert buf.worker.claim("C", 5) == []  # not delivered again
    assert buf.worker.complete(b, T.group(b.prompt)) == "duplicate"


def test_expired_leases_behind_many_released_prompts_are_reclaimed(redis_url):
    # more released prompts than one page of the pending list wait for budget ahead of the
    # leases of a dead worker: claims must page past them to reach those leases
    buf = Clients.connect(redis_url, "released-page", BufferConfig(lease_timeout_s=0.3, lookahead=1))
    buf.learner.init_run(batch_size=40, group_size=1, max_staleness=1)  # bound at version 0: 80 prompts
    buf.producer.enqueue_prompts(T.prompts(100))
    released = buf.worker.claim("A", 70)
    dead = buf.worker.claim("D", 10)
    for i in range(70):  # gateway groups take the budget the release gives back
        buf.gateway.append_group("gateway", T.group(f"gw{i}", 1))
    assert buf.worker.release(released) == 70 and buf.monitor.admission_budget() == 0
    time.sleep(0.4)
    got = buf.worker.claim("C", 1)
    assert [(lease.how, lease.lease_id in {d.lease_id for d in dead}) for lease in got] == [("reclaimed", True)]
    buf.close()


def test_a_dead_consumers_leases_are_taken_over_at_once_and_land_once(redis_url):
    # a launcher saw the holder's process die: its leases go to the next claimer now, not after
    # the lease timeout (30 s here); its prompts stay admitted; if the dead one completes anyway
    # (its last write was on the wire), the first completion lands and the other is a duplicate
    buf = Clients.connect(redis_url, "expire", BufferConfig(lease_timeout_s=30.0))
    buf.learner.init_run(batch_size=16, group_size=4, max_staleness=1)
    buf.producer.enqueue_prompts(T.prompts(3))
    dead, (alive,) = buf.worker.claim("dead", 2), buf.worker.claim("alive", 1)
    budget = buf.monitor.admission_budget()
    assert buf.worker.claim("survivor", 5) == []  # nothing to take before the holder is known dead
    assert buf.monitor.expire_leases("dead") == 2
    assert buf.monitor.admission_budget() == budget  # still admitted: no reservation moves
    got = buf.worker.claim("survivor", 5)
    assert [(lease.lease_id, lease.how, lease.delivery_count) for lease in got] == [(lease.lease_id, "reclaimed", 2) for lease in dead]
    assert buf.monitor.expire_leases("dead") == 0 and buf.monitor.admission_budget() == budget
    assert buf.worker.complete(dead[0], T.group(dead[0].prompt)) == "appended"  # the dead one's late write
    assert buf.worker.heartbeat("survivor") == [dead[0].lease_id]  # the survivor learns it need not finish it
    assert [buf.worker.complete(lease, T.group(lease.prompt)) for lease in got] == ["duplicate", "appended"]
    assert buf.worker.complete(dead[1], T.group(dead[1].prompt)) == "duplicate"
    assert buf.worker.complete(alive, T.group(alive.prompt)) == "appended"  # another consumer's: untouched
    c = buf.monitor.metrics()["counters"]
    assert (c["groups_appended"], c["completions_duplicate"], c["prompts_reclaimed"], c["prompts_released"]) == (3, 2, 2, 0)
    assert (c["admitted"], c["inflight"]) == (12, 0)  # each prompt admitted once
    batch = buf.learner.read_batch("learner", 0, 12, timeout_s=1.0)
    assert sorted(s.prompt_id for s in batch.samples) == sorted(f"p{i}" for i in range(3) for _ in range(4))
    buf.close()


def test_expired_leases_count_towards_max_deliveries(buf):
    # a prompt whose every holder dies (it kills them) is dead-lettered, as after lease timeouts
    buf.producer.enqueue_prompts(T.prompts(1))
    for attempt in range(1, 4):
        assert [lease.delivery_count for lease in buf.worker.claim(f"victim{attempt}", 1)] == [attempt]
        assert buf.monitor.expire_leases(f"victim{attempt}") == 1
    assert buf.worker.claim("victim4", 1) == []
    dead = buf.monitor.dead_letters()
    assert len(dead) == 1 and "delivered 4 times" in dead[0]["reason"] and dead[0]["producer"] == "victim3"
    c = buf.monitor.metrics()["counters"]
    assert (c["prompts_dead_lettered"], c["prompts_reclaimed"], c["inflight"]) == (1, 2, 0)
