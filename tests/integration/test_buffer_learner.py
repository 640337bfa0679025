"""Learner consumption against a real redis-server: re-delivery, staleness filter, pacing, partial groups."""

from __future__ import annotations

import pytest

import factories as T
from buffer import MonitorClient
from buffer_clients import Clients
from rlhf_core.config import BufferConfig

pytestmark = pytest.mark.integration


def _connect(url: str, run: str = "learn") -> Clients:
    # lookahead=None: admission up to max_staleness, so a test can produce several batches at version 0
    return Clients.connect(url, run, BufferConfig(lease_timeout_s=5.0, lookahead=None))


def _produce(buf: Clients, n_prompts: int, version: int = 0, group_size: int = 4, start: int = 0) -> list[str]:
    """Enqueue, claim and complete ``n_prompts`` groups made at ``version``; return their prompt ids."""
    buf.producer.enqueue_prompts(T.prompts(n_prompts, start=start))
    leases = buf.worker.claim("w", n_prompts)
    assert len(leases) == n_prompts
    for lease in leases:
        assert buf.worker.complete(lease, T.group(lease.prompt, group_size, version=version)) == "appended"
    return [lease.prompt.prompt_id for lease in leases]


def test_learner_crash_before_commit_gets_the_batch_again(redis_url):
    buf = _connect(redis_url)
    buf.learner.init_run(batch_size=8, group_size=4, max_staleness=8)
    _produce(buf, 4)
    first = buf.learner.read_batch("learner-0", 0, 8, timeout_s=1.0)
    assert [g.group_id for g in first.groups] == ["g-p0", "g-p1"]
    buf.close()  # crash: no commit

    restarted = _connect(redis_url)
    assert restarted.learner.pending_for("learner-0") == first.ids
    again = restarted.learner.read_batch("learner-0", 0, 8, timeout_s=1.0)
    assert again.ids == first.ids and [s.sample_id for s in again.samples] == [s.sample_id for s in first.samples]
    assert restarted.learner.commit(again) == 2
    assert restarted.learner.commit(again) == 0  # idempotent
    nxt = restarted.learner.read_batch("learner-0", 0, 8, timeout_s=1.0)
    assert [g.group_id for g in nxt.groups] == ["g-p2", "g-p3"]
    assert restarted.learner.read_batch("learner-0", 0, 8, timeout_s=0.1) is None  # nothing handed out twice
    restarted.learner.commit(nxt)
    c = restarted.monitor.metrics()["counters"]
    assert (c["samples_consumed"], c["groups_consumed"], c["samples_in_buffer"], c["groups_in_buffer"]) == (16, 4, 0, 0)
    assert restarted.learner.pending_for("learner-0") == []


def test_commit_ids_from_a_checkpoint_after_restart(redis_url):
    buf = _connect(redis_url)
    buf.learner.init_run(batch_size=8, group_size=4, max_staleness=8)
    _produce(buf, 4)
    trained = buf.learner.read_batch("learner-0", 0, 8, timeout_s=1.0)
    checkpoint_ids = list(trained.ids)  # the learner stored these with its checkpoint, then died before commit
    buf.close()

    restarted = _connect(redis_url)
    assert restarted.learner.commit_ids(checkpoint_ids) == 2
    assert restarted.learner.commit_ids(checkpoint_ids) == 0
    nxt = restarted.learner.read_batch("learner-0", 1, 8, timeout_s=1.0)
    assert [g.group_id for g in nxt.groups] == ["g-p2", "g-p3"]  # the trained batch is not replayed
    assert restarted.monitor.metrics()["counters"]["samples_consumed"] == 8


def test_prefetching_a_second_batch_before_commit_does_not_repeat(redis_url):
    buf = _connect(redis_url)
    buf.learner.init_run(batch_size=8, group_size=4, max_staleness=8)
    _produce(buf, 6)
    a = buf.learner.read_batch("L", 0, 8, timeout_s=1.0)
    b = buf.learner.read_batch("L", 0, 8, timeout_s=1.0)
    c = buf.learner.read_batch("L", 0, 8, timeout_s=1.0)
    assert not set(a.ids) & set(b.ids) and not set(b.ids) & set(c.ids)
    assert buf.learner.read_batch("L", 0, 8, timeout_s=0.05) is None
    assert [buf.learner.commit(x) for x in (b, a, c)] == [2, 2, 2]


def test_staleness_filter_drops_and_counts_per_lag(redis_url):
    buf = _connect(redis_url)
    buf.learner.init_run(batch_size=8, group_size=4, max_staleness=2)
    # pacing would not admit this much; raise the learner version so the budget allows 6 prompts
    buf.learner.set_learner_version(5)
    buf.producer.enqueue_prompts(T.prompts(6))
    leases = buf.worker.claim("w", 6)
    for lease, version in zip(leases, [0, 1, 2, 3, 4, 5]):
        buf.worker.complete(lease, T.group(lease.prompt, version=version))
    budget = buf.monitor.admission_budget()
    batch = buf.learner.read_batch("L", 5, 8, timeout_s=1.0)
    assert [g.group_id for g in batch.groups] == ["g-p3", "g-p4"]
    assert [g.lag for g in batch.groups] == [2, 1]
    assert batch.staleness == {"min": 1, "max": 2, "mean": 1.5, "hist": {1: 4, 2: 4}}
    assert all(5 - s.oldest_version <= 2 for s in batch.samples)
    buf.learner.commit(batch)
    m = buf.monitor.metrics()
    assert m["dropped_stale_hist"] == {3: 4, 4: 4, 5: 4}
    assert m["staleness_hist"] == {1: 4, 2: 4}
    assert (m["counters"]["samples_dropped_stale"], m["counters"]["groups_dropped_stale"]) == (12, 3)
    assert buf.monitor.admission_budget() == budget + 12  # dropped groups return their reservation


@pytest.mark.parametrize("max_staleness,lookahead", [(0, 1), (2, None), (2, 1), (3, 2)])
def test_pacing_bounds_staleness_without_dropping_in_a_steady_run(redis_url, max_staleness, lookahead):
    """Workers generate with the newest weights and finish in order; the learner publishes one
    version per batch. Admission alone keeps every sample within max_staleness: nothing dropped.
    The lookahead caps how far ahead of the learner's next read workers may run: min(2, 1) = 1
    batch ahead, so samples are at most 1 version stale although 2 would be allowed."""
    B, G, steps = 8, 4, 12
    ahead = max_staleness if lookahead is None else min(max_staleness, lookahead)
    buf = Clients.connect(redis_url, f"pace{max_staleness}-{lookahead}", BufferConfig(lease_timeout_s=5.0, lookahead=lookahead))
    buf.learner.init_run(batch_size=B, group_size=G, max_staleness=max_staleness)
    assert buf.store.run_params()["lookahead"] == lookahead
    buf.producer.enqueue_prompts(T.prompts(400))
    version = 0
    admitted_per_step = []
    lags: list[int] = []
    for _ in range(steps):
        leases = buf.worker.claim("w", 1000)  # everything the budget allows, at the current version
        admitted_per_step.append(len(leases))
        for lease in leases:
            buf.worker.complete(lease, T.group(lease.prompt, G, version=lease.learner_version))
        assert buf.monitor.admission_budget() == 0
        batch = buf.learner.read_batch("L", version, B, timeout_s=1.0)
        lags += [version - s.oldest_version for s in batch.samples]
        buf.learner.commit(batch)
        version += 1
        buf.learner.set_learner_version(version)
    # first claim: the batch read next plus `ahead` more; then one batch per version
    assert admitted_per_step == [(ahead + 1) * B // G] + [B // G] * (steps - 1)
    assert len(lags) == steps * B and max(lags) <= max_staleness
    if ahead == 0:
        assert set(lags) == {0}  # strictly synchronous: every batch is on-policy
    else:
        assert max(lags) == ahead  # the tighter of the two bounds is the one reached
    c = buf.monitor.metrics()["counters"]
    assert (c["samples_dropped_stale"], c["samples_consumed"]) == (0, steps * B)


def test_a_learner_restarted_past_its_checkpoint_paces_by_the_updates_its_weights_hold(redis_url):
    """The learner publishes versions 1-6, checkpoints after update 4 and dies. Restarted, it
    publishes checkpoint 4's weights as version 7 (no number names two sets of weights) and trains
    the two lost updates again as versions 8 and 9. The samples the lost weights made are too
    stale for version 9 and dropped; from then on a steady run drops nothing. Paced by the version
    (7 = 4 updates + 3), three batches more were admitted at every step, each dropped when read."""
    B, G = 8, 4
    buf = Clients.connect(redis_url, "renumbered", BufferConfig(lease_timeout_s=5.0, lookahead=1))
    buf.learner.init_run(batch_size=B, group_size=G, max_staleness=2)
    buf.producer.enqueue_prompts(T.prompts(400))

    def generate(b: Clients) -> int:
        """Workers: everything the budget allows, made with the weights the leases name."""
        leases = b.worker.claim("w", 1000)
        for lease in leases:
            b.worker.complete(lease, T.group(lease.prompt, G, version=lease.learner_version))
        return len(leases)

    for version in range(6):
        generate(buf)
        batch = buf.learner.read_batch("L", version, B, timeout_s=1.0)
        if version < 4:  # committed with checkpoint 4; updates 5 and 6 are lost with the crash
            buf.learner.commit(batch)
        buf.learner.set_learner_version(version + 1)
    assert generate(buf) == B // G  # while the learner is down, the budget version 6 gave
    buf.close()

    restarted = Clients.connect(redis_url, "renumbered", BufferConfig(lease_timeout_s=5.0, lookahead=1))
    version, updates = 7, 4
    restarted.learner.set_learner_version(version, updates)
    assert restarted.monitor.admission_budget() == 0  # what was admitted for the lost updates is still there
    for _ in range(2):  # the lost updates' batches, read again against the checkpoint's version
        batch = restarted.learner.read_batch("L", 4, B, timeout_s=1.0, newest=version)
        restarted.learner.commit(batch)
        version, updates = version + 1, updates + 1
        restarted.learner.set_learner_version(version, updates)
    # the two batches the weights of versions 5 and 6 made are too stale for version 9 (lag 4 and 3)
    assert restarted.learner.read_batch("L", version, B, timeout_s=0.1) is None
    assert restarted.monitor.metrics()["counters"]["samples_dropped_stale"] == 2 * B
    assert restarted.monitor.admission_budget() == 2 * B  # the batch read next and the lookahead's
    admitted, dropped = [], []
    for _ in range(8):
        admitted.append(generate(restarted))
        restarted.learner.commit(restarted.learner.read_batch("L", version, B, timeout_s=1.0))
        dropped.append(restarted.monitor.metrics()["counters"]["samples_dropped_stale"])
        version, updates = version + 1, updates + 1
        restarted.learner.set_learner_version(version, updates)
    assert dropped == [2 * B] * 8, dropped  # nothing more
    assert admitted == [2 * B // G] + [B // G] * 7, admitted  # then a batch per update
    assert restarted.monitor.metrics()["learner_updates"] == updates == 14


def test_partial_groups_stay_whole_and_report_their_size(redis_url):
    buf = _connect(redis_url)
    buf.learner.init_run(batch_size=12, group_size=4, max_staleness=8)
    buf.producer.enqueue_prompts(T.prompts(3))
    leases = buf.worker.claim("w", 3)
    sizes = [4, 2, 3]  # the worker dead-lettered samples whose reward function failed
    for lease, n in zip(leases, sizes):
        assert buf.worker.complete(lease, T.group(lease.prompt, 4, n=n)) == "appended"
    batch = buf.learner.read_batch("L", 0, 12, timeout_s=1.0)
    assert batch.group_sizes == [4, 2, 3] and len(batch) == 9
    for g in batch.groups:
        assert {s.group_id for s in batch.samples[g.start:g.end]} == {g.group_id}
    assert buf.learner.commit(batch) == 3
    assert buf.monitor.metrics()["counters"]["samples_consumed"] == 9


def test_read_batch_times_out_and_keeps_what_it_read(redis_url):
    buf = _connect(redis_url)
    buf.learner.init_run(batch_size=12, group_size=4, max_staleness=8)
    _produce(buf, 2)
    assert buf.learner.read_batch("L", 0, 12, timeout_s=0.2) is None  # 2 of 3 groups so far
    _produce(buf, 1, start=2)
    batch = buf.learner.read_batch("L", 0, 12, timeout_s=1.0)
    assert [g.group_id for g in batch.groups] == ["g-p0", "g-p1", "g-p2"]


def test_a_batch_reports_the_decoding_of_its_records_and_not_the_wait(redis_url, monkeypatch):
    from buffer import samples

    T.fake_decode_clock(monkeypatch, samples)
    buf = _connect(redis_url)
    buf.learner.init_run(batch_size=12, group_size=4, max_staleness=8)
    _produce(buf, 2)
    assert buf.learner.read_batch("L", 0, 12, timeout_s=0.2) is None  # decodes 2 groups, waits 0.2 s for a third
    _produce(buf, 1, start=2)
    batch = buf.learner.read_batch("L", 0, 12, timeout_s=1.0)
    # the two groups carried from the call that timed out count with the one read now; the wait does not
    assert batch.decode_s == 3.0
    _produce(buf, 3, start=3)
    assert buf.learner.read_batch("L", 0, 12, timeout_s=1.0).decode_s == 3.0  # nothing counted twice
    buf.close()  # a crash before commit: a restarted learner re-reads the two batches, one at a time
    restarted = _connect(redis_url)
    assert restarted.learner.read_batch("L", 0, 12, timeout_s=1.0).decode_s == 6.0  # all six re-read before the first
    assert restarted.learner.read_batch("L", 0, 12, timeout_s=1.0).decode_s == 0.0  # carried: decoded for the first


def test_commit_ids_later_records_read_time_staleness(redis_url):
    """The learner commits at checkpoint time, versions later: the histogram keeps the lag at read time."""
    buf = _connect(redis_url)
    buf.learner.init_run(batch_size=8, group_size=4, max_staleness=8)
    buf.learner.set_learner_version(1)
    buf.producer.enqueue_prompts(T.prompts(2))
    for lease in buf.worker.claim("w", 2):
        buf.worker.complete(lease, T.group(lease.prompt, version=0))
    batch = buf.learner.read_batch("L", 1, 8, timeout_s=1.0)
    buf.learner.set_learner_version(4)  # three more updates before the checkpoint
    assert buf.learner.commit_ids(batch.ids) == 2
    assert buf.monitor.metrics()["staleness_hist"] == {1: 8}


def test_publish_stats_reaches_the_monitor_snapshot(redis_url):
    buf = _connect(redis_url)
    buf.learner.init_run(batch_size=8, group_size=4, max_staleness=0)
    buf.learner.publish_stats("learner", {"learner/samples_per_s": 12.5, "staleness/hist": [3, 1], "odd": object})
    stats = buf.monitor.metrics()["stats"]["learner"]
    assert stats["learner/samples_per_s"] == 12.5 and stats["staleness/hist"] == [3, 1]
    assert stats["odd"] == str(object)


def test_the_monitor_leaves_out_workers_gone_longer_than_the_lease_timeout(redis_url):
    import msgpack

    from rlhf_run import monitor

    buf = Clients.connect(redis_url, "gone", BufferConfig(lease_timeout_s=30.0))
    buf.learner.init_run(batch_size=8, group_size=4, max_staleness=1)
    # worker-1 heartbeated last 120 s ago (the launch before a resume, or scaled down), worker-0 now:
    # the run's lease timeout (30 s) says worker-1 left, so its rates over its uptime are not shown
    sec, _ = buf.redis.time()
    buf.redis.hset(buf.keys.consumers, "worker-1", msgpack.packb(
        {"last_seen": sec - 120.0, "version": 0, "stats": {"tokens_per_s": 914.0, "samples_per_s": 30.0}, "leases": 0}))
    buf.worker.heartbeat("worker-0", 0, {"tokens_per_s": 1306.0, "samples_per_s": 40.0})
    # a monitor of its own (it learns the lease timeout from the run, not from its config)
    watcher = MonitorClient.connect(redis_url, "gone", BufferConfig(lease_timeout_s=1000.0))
    snap = monitor.snapshot(watcher)
    assert snap["consumers"]["worker-1"]["age_s"] > 100
    # 'generated tok/s' and, with one snapshot, 'generated samples/s': worker-0's alone, not 2,220 and 70
    assert (snap["generated_tokens_per_s"], snap["generated_samples_per_s"]) == (1306.0, 40.0)
    watcher.close()
    buf.close()


def _learner_trains_while_the_monitor_waits(buf: Clients, monkeypatch) -> list[float]:
    """The learner has trained 32 samples; during the monitor's wait between two snapshots it
    trains 32 more (the wait's length is recorded; no real wait)."""
    from rlhf_run import monitor

    buf.learner.publish_stats("learner", {"learner/samples_trained": 32, "learner/samples_per_s": 320.0})
    waits: list[float] = []

    def an_update_meanwhile(seconds: float) -> None:
        waits.append(seconds)
        buf.learner.publish_stats("learner", {"learner/samples_trained": 64, "learner/samples_per_s": 320.0})

    monkeypatch.setattr(monitor.time, "sleep", an_update_meanwhile)
    return waits


def test_monitor_once_gives_the_trained_rate_over_one_refresh_in_its_json(redis_url, monkeypatch):
    # --once took one snapshot, so 'trained samples/s' (which needs two) was always '-' / null
    import io
    import json

    from rlhf_run import monitor

    buf = _connect(redis_url, "once")
    buf.learner.init_run(batch_size=8, group_size=4, max_staleness=1)
    waits = _learner_trains_while_the_monitor_waits(buf, monkeypatch)
    out = io.StringIO()
    monitor.run_monitor(redis_url, "once", once=True, as_json=True, refresh_s=1.0, out=out)
    snap = json.loads(out.getvalue())
    assert waits == [1.0]  # two snapshots, one refresh apart
    (t0, n0), (t1, n1) = snap["trained_window"]
    assert (n0, n1) == (32, 64)
    # 32 samples trained between the two snapshots, not the learner's 320 a second of compute
    assert snap["trained_samples_per_s"] == pytest.approx(32 / (t1 - t0))
    buf.close()


def test_monitor_once_piped_shows_names_whole(redis_url, monkeypatch):
    # piped to a file, rich laid the table out in 80 columns: "run-20261206-10…", "worker…"
    import io

    from rlhf_run import monitor

    run_id, worker = "run-20261206-101500-ab12cd34ef", "worker-3-on-host-gpu-node-17.cluster.example.org"
    buf = _connect(redis_url, run_id)
    buf.learner.init_run(batch_size=8, group_size=4, max_staleness=1)
    buf.worker.heartbeat(worker, 0, {"tokens_per_s": 1306.0, "samples_per_s": 40.0})
    _learner_trains_while_the_monitor_waits(buf, monkeypatch)
    out = io.StringIO()  # not a terminal, as a pipe or a file
    monitor.run_monitor(redis_url, run_id, once=True, out=out)
    text = out.getvalue()
    assert run_id in text and worker in text and "…" not in text, text
    row = next(line for line in text.splitlines() if "trained samples/s" in line)
    assert row.split("trained samples/s")[1].split()[0] != "-", row
    buf.close()


@pytest.mark.parametrize("mode", ["fifo", "replay"])
def test_a_discarded_batch_leaves_the_buffer_and_gives_its_admission_back(redis_url, mode):
    # The learner dead-lettered every sample of a batch (their stop tokens contradict its
    # tokenizer): nothing was trained, the version does not move. Acked as trained, the batch
    # kept its 8 samples of admission for good: pacing would lose a batch of room each time.
    cfg = {"lookahead": None} if mode == "fifo" else {"lookahead": None, "max_reuse": 2}
    buf = Clients.connect(redis_url, f"discard-{mode}", BufferConfig(lease_timeout_s=5.0, **cfg))
    assert buf.learner.init_run(batch_size=8, group_size=4, max_staleness=8)["mode"] == mode
    _produce(buf, 4)
    before = buf.monitor.admission_budget()
    batch = buf.learner.read_batch("learner-0", 0, 8, timeout_s=1.0)
    assert buf.learner.discard(batch) == 2 and buf.learner.discard(batch) == 0  # idempotent, as commit
    c = buf.monitor.metrics()["counters"]
    assert (c["budget_returned"], c["admitted"], c["samples_consumed"]) == (8, 8, 0)
    assert buf.monitor.admission_budget() == before + 8 and buf.learner.pending_for("learner-0") == []
    nxt = buf.learner.read_batch("learner-0", 0, 8, timeout_s=1.0)  # the discarded groups do not come back
    assert [g.group_id for g in nxt.groups] == ["g-p2", "g-p3"]
    assert buf.learner.commit(nxt) == 2 and buf.monitor.metrics()["counters"]["budget_returned"] == 8  # trained: kept
    buf.close()


@pytest.mark.parametrize("mode", ["fifo", "replay"])
def test_the_buffer_is_exhausted_once_no_batch_can_come_from_the_prompts(redis_url, mode):
    # A run whose data.epochs ran out before learner.max_updates waited for batches for ever: no
    # stop reason covered it. 3 prompts of one epoch, groups of 4, batches of 8 (2 groups).
    cfg = {"lookahead": None} if mode == "fifo" else {"lookahead": None, "max_reuse": 2}
    buf = Clients.connect(redis_url, f"exhausted-{mode}", BufferConfig(lease_timeout_s=5.0, **cfg))
    assert buf.learner.init_run(batch_size=8, group_size=4, max_staleness=8)["mode"] == mode

    def exhausted() -> bool:
        return buf.learner.exhausted("learner-0", 0, 8, epochs=1)

    assert not exhausted()  # the producer has not filled yet
    assert buf.producer.fill_prompts(lambda epoch: T.prompts(3, epoch=epoch), epochs=1, low_watermark=8) == 3
    assert buf.producer.fill_state()["done"] and not exhausted()  # every epoch queued, 3 prompts waiting
    leases = buf.worker.claim("w", 3)
    for lease in leases[:2]:
        buf.worker.complete(lease, T.group(lease.prompt))
    first = buf.learner.read_batch("learner-0", 0, 8, timeout_s=1.0)
    assert len(first.groups) == 2
    assert not exhausted()  # a worker holds the last prompt: its group may still make a batch
    buf.worker.complete(leases[2], T.group(leases[2].prompt))
    if mode == "fifo":
        assert exhausted()  # one group left (the batch read is handed out): no batch of two
        buf.learner.commit(first)
        assert exhausted() and buf.learner.read_batch("learner-0", 0, 8, timeout_s=0.2) is None
    else:
        assert exhausted()  # one free group; the two drawn are out until committed
        buf.learner.commit(first)  # used once of max_reuse 2: back in the table
        assert not exhausted()
        second = buf.learner.read_batch("learner-0", 0, 8, timeout_s=1.0)
        assert [g.group_id for g in second.groups] == [g.group_id for g in first.groups]  # stalest first
        buf.learner.commit(second)  # used up: removed
        assert exhausted() and buf.learner.read_batch("learner-0", 0, 8, timeout_s=0.2) is None  # one group left
    buf.close()
