"""ScoringPool: finished samples -> batches (whole groups, at most batch_size, after max_wait or
when flushed) -> scoring threads that take the next batch as soon as they are free; a reward call
past timeout_s abandoned with its samples answered and its thread replaced."""

from __future__ import annotations

import threading
import time

import pytest

from rollout_workers import scoring
from rollout_workers.rewards import CallWatch, RewardFailing
from rollout_workers.scoring import ScoringPool

pytestmark = pytest.mark.timeout(30)


class Job:
    """A scoring job that records each batch and, while ``hold`` is clear, waits inside a reward call."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.started: list[float] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Semaphore(0)

    def __call__(self, items: list[str], watch: CallWatch) -> list[str]:
        self.batches.append(list(items))
        self.started.append(time.monotonic())
        watch.begin("reward function 'slow'")
        self.entered.release()
        self.hold.wait(20)
        watch.end()
        return [f"scored {x}" for x in items]


def pool(job, **kw) -> ScoringPool:
    settings = dict(num_threads=1, batch_size=8, max_wait_s=60.0, timeout_s=None)
    settings.update(kw)
    return ScoringPool(job, lambda key, reason: f"timeout {key}: {reason}", **settings)


def group(name: str, n: int = 4) -> list[tuple[str, str]]:
    return [(f"{name}{i}", f"{name}{i}") for i in range(n)]


def collect(p: ScoringPool, n: int, flush: bool = False) -> dict[str, str]:
    """Poll until ``n`` answers came back (the test's event: answers, not a race between threads)."""
    got: dict[str, str] = {}
    deadline = time.monotonic() + 20
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {len(got)} of {n} answers"
        got.update(p.poll(flush=flush))
        time.sleep(0.001)
    return got


def test_a_full_batch_goes_at_once_and_a_partial_one_waits_for_max_wait_or_a_flush():
    job = Job()
    p = pool(job, batch_size=8)
    p.submit(group("a"))
    assert p.poll() == [] and job.batches == [] and p.in_flight() == 4  # 4 < 8 and not waited 60 s
    p.submit(group("b"))  # now 8 wait: a full batch
    assert collect(p, 8) == {f"{g}{i}": f"scored {g}{i}" for g in "ab" for i in range(4)}
    assert job.batches == [["a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3"]]
    p.submit(group("c"))
    assert collect(p, 4, flush=True) == {f"c{i}": f"scored c{i}" for i in range(4)}  # generation idle: no waiting
    assert job.batches[1] == ["c0", "c1", "c2", "c3"]
    assert (p.batches, p.calls, p.timeouts, p.in_flight()) == (2, 2, 0, 0)


def test_max_wait_releases_a_partial_batch():
    job = Job()
    p = pool(job, batch_size=8, max_wait_s=0.05)
    submitted = time.monotonic()
    p.submit(group("a", 2))
    assert collect(p, 2) == {"a0": "scored a0", "a1": "scored a1"}
    assert job.started[0] - submitted >= 0.05  # not before the oldest waited max_wait


def test_batches_grow_while_every_thread_is_busy_and_a_group_larger_than_a_batch_is_split():
    job = Job()
    job.hold.clear()
    p = pool(job, batch_size=6, max_wait_s=0.0)
    p.submit(group("a", 2))
    p.poll()
    assert job.entered.acquire(timeout=10)  # the only thread is busy with a0, a1
    p.submit(group("b", 4))
    p.submit(group("c", 4))
    assert p.poll() == [] and p.in_flight() == 10  # nothing started: no free thread
    job.hold.set()
    collect(p, 10)
    assert job.batches == [["a0", "a1"], ["b0", "b1", "b2", "b3", "c0", "c1"], ["c2", "c3"]]


def test_a_call_past_the_timeout_is_abandoned_its_samples_answered_and_scoring_goes_on():
    job = Job()
    job.hold.clear()
    p = pool(job, batch_size=4, max_wait_s=0.0, timeout_s=0.2)
    p.submit(group("a"))
    got = collect(p, 4)
    assert set(got) == {"a0", "a1", "a2", "a3"}
    assert got["a0"] == ("timeout a0: reward function 'slow' did not return within reward.timeout_s=0.2 s (a batch of 4 "
                         "sample(s)); the call was abandoned and runs on in the background. Make the reward faster, "
                         "raise reward.timeout_s, or lower reward.batch_size")
    assert (p.timeouts, p.abandoned_running(), p.in_flight()) == (1, 1, 0)
    # the stuck thread does not hold the next batch back: it runs on a fresh thread
    p.submit(group("b"))
    p.poll()
    assert job.entered.acquire(timeout=10) and job.entered.acquire(timeout=10)  # a's call and b's call are both inside
    job.hold.set()
    assert collect(p, 4) == {f"b{i}": f"scored b{i}" for i in range(4)}
    deadline = time.monotonic() + 10
    while p.abandoned_running():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert p.poll() == []  # the abandoned batch's late result is thrown away, never answered twice


def test_too_many_abandoned_calls_still_running_stop_the_worker(monkeypatch):
    monkeypatch.setattr(scoring, "MAX_ABANDONED", 2)
    job = Job()
    job.hold.clear()
    p = pool(job, batch_size=1, max_wait_s=0.0, timeout_s=0.05, num_threads=3)
    p.submit(group("a", 3))
    try:
        with pytest.raises(RewardFailing, match=r"3 reward calls abandoned after reward.timeout_s=0.05 s are still running, "
                                                r"the last because: reward function 'slow' did not return"):
            collect(p, 3)
    finally:
        job.hold.set()


def test_a_bug_in_the_job_is_raised_on_the_main_thread():
    def broken(items, watch):
        raise KeyError("bug")

    p = pool(broken, max_wait_s=0.0)
    p.submit(group("a", 1))
    with pytest.raises(KeyError, match="bug"):
        collect(p, 1)


def test_a_free_thread_takes_the_next_batch_without_waiting_for_the_main_thread():
    # one sample per call on one thread: scoring must not be paced by how often poll() runs
    job = Job()
    p = pool(job, batch_size=1, max_wait_s=0.0)
    p.submit(group("a", 5))
    deadline = time.monotonic() + 20
    while len(job.batches) < 5:  # no poll() meanwhile
        assert time.monotonic() < deadline, job.batches
        time.sleep(0.001)
    assert job.batches == [["a0"], ["a1"], ["a2"], ["a3"], ["a4"]]
    assert collect(p, 5) == {f"a{i}": f"scored a{i}" for i in range(5)} and p.in_flight() == 0


@pytest.mark.parametrize("submitted, max_wait_s, batches", [
    (8, 60.0, [["a0", "a1", "a2", "a3"], ["a4", "a5", "a6", "a7"]]),  # two full batches at once
    (6, 0.05, [["a0", "a1", "a2", "a3"], ["a4", "a5"]]),  # a full batch and 2 left over, due after max_wait
])
def test_samples_left_after_a_thread_took_a_batch_go_to_the_free_thread(submitted, max_wait_s, batches):
    # submit woke one thread; the other slept on until the busy one finished (or the next submit)
    job = Job()
    job.hold.clear()
    p = pool(job, num_threads=2, batch_size=4, max_wait_s=max_wait_s)
    try:
        p.submit(group("a", submitted))  # no poll(): nothing else wakes a thread
        assert job.entered.acquire(timeout=10) and job.entered.acquire(timeout=5), job.batches  # both calls inside at once
        assert sorted(job.batches) == batches
    finally:
        job.hold.set()
    assert len(collect(p, submitted)) == submitted


def test_the_durations_nobody_takes_are_not_kept_for_ever():
    # Each batch's duration waits for take_durations(), which only a worker with a Prometheus
    # exporter calls (rollout.prometheus_port; off by default, and the evaluator never): one float
    # per batch for the whole run.
    p = pool(lambda items, watch: [f"scored {x}" for x in items], batch_size=1, max_wait_s=0.0)
    n = 5000
    p.submit([(f"s{i}", f"s{i}") for i in range(n)])
    collect(p, n, flush=True)
    assert p.batches == n and len(p._durations) <= n // 3
    p.close()
