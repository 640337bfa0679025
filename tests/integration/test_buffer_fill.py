"""The prompt producer: fill_prompts walks epochs from a local data set and resumes after a restart."""

from __future__ import annotations

import json

import pytest

from buffer import PromptsExhausted, iter_prompts
from buffer_clients import Clients
from rlhf_core.config import BufferConfig, DataConfig

pytestmark = pytest.mark.integration


@pytest.fixture
def data_cfg(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": i}) + "\n" for i in range(5)))
    return DataConfig(source="jsonl", path=str(path), seed=3)


def _drain(buf: Clients) -> list[tuple[int, int, str]]:
    """Claim and complete everything waiting; return (epoch, index, text) of each prompt."""
    out = []
    for lease in buf.worker.claim("w", 100):
        out.append((lease.prompt.epoch, lease.prompt.index, lease.prompt.text))
        buf.worker.complete(lease, [])
    return out


def test_fill_walks_epochs_tops_up_and_resumes(redis_url, data_cfg):
    source = lambda epoch: iter_prompts(data_cfg, epoch)  # noqa: E731
    process = Clients.connect(redis_url, "fill", BufferConfig())
    process.learner.init_run(batch_size=400, group_size=4, max_staleness=0)
    assert process.producer.fill_prompts(source, epochs=2, low_watermark=3, high_watermark=4) == 4
    assert process.producer.fill_prompts(source, epochs=2, low_watermark=3, high_watermark=4) == 0  # 4 waiting >= 3
    seen = _drain(process)
    assert process.producer.fill_prompts(source, epochs=2, low_watermark=3, high_watermark=4) == 4  # crosses into epoch 1
    assert process.producer.fill_state() == {"epoch": 1, "index": 3, "done": False}
    seen += _drain(process)
    process.close()

    restarted = Clients.connect(redis_url, "fill", BufferConfig())  # a new producer process continues
    assert restarted.producer.fill_prompts(source, epochs=2, low_watermark=3, high_watermark=4) == 2
    assert restarted.producer.fill_state() == {"epoch": 2, "index": 0, "done": True}
    assert restarted.producer.fill_prompts(source, epochs=2, low_watermark=3, high_watermark=4) == 0
    seen += _drain(restarted)
    assert sorted((e, i) for e, i, _ in seen) == [(e, i) for e in range(2) for i in range(5)]
    for epoch in range(2):
        texts = [t for e, i, t in sorted(seen) if e == epoch]
        assert sorted(texts) == [f"q{i}" for i in range(5)]  # each row once per epoch
    orders = [[t for e, _, t in sorted(seen) if e == epoch] for epoch in range(2)]
    assert orders[0] != orders[1]  # reshuffled per epoch (seed 3 gives different orders)
    assert restarted.monitor.metrics()["counters"]["prompts_enqueued"] == 10


def test_fill_with_an_empty_source_says_so(redis_url):
    buf = Clients.connect(redis_url, "empty", BufferConfig())
    buf.learner.init_run(batch_size=4, group_size=4, max_staleness=0)
    with pytest.raises(PromptsExhausted, match="no prompts for epoch 0"):
        buf.producer.fill_prompts(lambda epoch: [], epochs=3, low_watermark=2)


def test_a_cursor_at_or_past_the_last_epoch_is_done(redis_url, data_cfg):
    # epochs=0 returned 0 for ever without marking the cursor done (the learner's producer looped
    # on it and nothing ever said the data was used up); so did a run resumed with fewer epochs
    source = lambda epoch: iter_prompts(data_cfg, epoch)  # noqa: E731
    buf = Clients.connect(redis_url, "past", BufferConfig())
    buf.learner.init_run(batch_size=400, group_size=4, max_staleness=0)
    assert buf.producer.fill_prompts(source, epochs=0, low_watermark=3) == 0
    assert buf.producer.fill_state() == {"epoch": 0, "index": 0, "done": True}
    resumed = Clients.connect(redis_url, "past-resumed", BufferConfig())
    resumed.learner.init_run(batch_size=400, group_size=4, max_staleness=0)
    assert resumed.producer.restore_fill_state({"epoch": 3, "index": 2, "done": False})  # data.epochs=5 then
    assert resumed.producer.fill_prompts(source, epochs=2, low_watermark=3) == 0  # resumed with data.epochs=2
    assert resumed.producer.fill_state() == {"epoch": 3, "index": 2, "done": True}
    # and the other way: a run whose epochs were all queued, resumed with more, goes on
    assert resumed.producer.fill_prompts(source, epochs=5, low_watermark=3, high_watermark=4) == 4  # epoch 3's last 3, then 4's
    assert resumed.producer.fill_state() == {"epoch": 4, "index": 1, "done": False}


def test_a_source_that_raised_is_opened_again_at_the_cursor(redis_url):
    """The open iterator of the epoch ended on the error (a generator that raised is done); the
    next top-up took the dead one for the end of the epoch: 'no prompts for epoch 0' at the
    start, the rest of the epoch skipped further in."""
    from rlhf_core.records import Prompt

    failures = [3]  # the first walk raises at its 4th prompt

    def source(epoch):
        for i in range(6):
            if failures and i == failures[0]:
                failures.pop()
                raise OSError("the file went away for a moment")
            yield Prompt(f"p{i}", f"q{i}", epoch=epoch, index=i)

    buf = Clients.connect(redis_url, "raised", BufferConfig())
    buf.learner.init_run(batch_size=400, group_size=4, max_staleness=0)
    with pytest.raises(OSError):
        buf.producer.fill_prompts(source, epochs=1, low_watermark=10, high_watermark=10)
    assert buf.producer.fill_state() == {"epoch": 0, "index": 0, "done": False}  # nothing enqueued
    assert buf.producer.fill_prompts(source, epochs=1, low_watermark=10, high_watermark=10) == 6
    assert sorted(t for _, _, t in _drain(buf)) == [f"q{i}" for i in range(6)]


def test_a_checkpoints_cursor_starts_a_fresh_run_where_its_prompts_had_reached(redis_url, data_cfg):
    source = lambda epoch: iter_prompts(data_cfg, epoch)  # noqa: E731
    fresh = Clients.connect(redis_url, "fresh", BufferConfig())  # a resume on a new Redis: no cursor yet
    fresh.learner.init_run(batch_size=400, group_size=4, max_staleness=0)
    assert fresh.producer.restore_fill_state({"epoch": 1, "index": 3, "done": False}) is True
    assert fresh.producer.restore_fill_state({"epoch": 0, "index": 0, "done": False}) is False  # never moves a live cursor back
    # epoch 1 from row 3: rows 3 and 4 of that epoch's order, then the run's 2 epochs are done
    assert fresh.producer.fill_prompts(source, epochs=2, low_watermark=3, high_watermark=4) == 2
    assert [(e, i) for e, i, _ in _drain(fresh)] == [(1, 3), (1, 4)]
    assert fresh.producer.fill_state() == {"epoch": 2, "index": 0, "done": True}


def test_a_fresh_buffer_resumed_at_a_version_paces_from_that_version(redis_url):
    # A finished run resumed at version 20 on a fresh Redis: the checkpoint's 20 batches count as
    # admitted, so workers may run the lookahead ahead (1 batch) plus the batch read next, 2 x 8.
    # From 0 admitted the bound was (1 + 20 + 1) x 8 = 176: 20 batches generated at once.
    fresh = Clients.connect(redis_url, "fresh-pace", BufferConfig(lookahead=1))
    fresh.learner.init_run(batch_size=8, group_size=4, max_staleness=2)
    assert fresh.producer.restore_fill_state({"epoch": 0, "index": 40, "done": False}, admitted=20 * 8) is True
    fresh.learner.set_learner_version(20)
    assert fresh.monitor.admission_budget() == (1 + 1) * 8
    assert fresh.producer.restore_fill_state({"epoch": 0, "index": 40, "done": False}, admitted=20 * 8) is False
    assert fresh.monitor.admission_budget() == (1 + 1) * 8  # counted once


def _take_prompts_at_700_per_s(lead_s: float, redis_url: str, run: str) -> list[int]:
    """A producer looking every 0.1 s (a fake clock) while workers take 70 prompts between looks
    (700 prompts/s; the tiny model on 2 CPU cores takes ~600); returns what each take got."""
    from rlhf_core.records import Prompt

    now = [0.0]
    buf = Clients.connect(redis_url, run, BufferConfig())
    buf.learner.init_run(batch_size=400, group_size=4, max_staleness=0)  # a budget of 100 prompts at a time
    buf.producer._filler.clock = lambda: now[0]  # the producer's clock only: Redis and the leases keep real time
    source = lambda epoch: (Prompt(f"p{epoch}-{i}", "x") for i in range(10_000))  # noqa: E731
    got = []
    for _ in range(8):
        buf.producer.fill_prompts(source, epochs=1, low_watermark=32, high_watermark=128, lead_s=lead_s)
        now[0] += 0.1
        leases = buf.worker.claim("w", 70)
        got.append(len(leases))
        for lease in leases:
            buf.worker.complete(lease, [])  # nothing to train on: the budget comes back
    return got


def test_fill_with_a_lead_keeps_up_with_the_rate_workers_take_prompts(redis_url):
    # Without a lead the fixed watermarks (top up to 128 once fewer than 32 wait) run dry:
    # 128 -> 58 (58 >= 32 at the next look: no top-up) -> the take gets 58 of 70 -> 0 -> 128 ...
    assert _take_prompts_at_700_per_s(0.0, redis_url, "nolead")[:3] == [70, 58, 70]
    # With lead_s=0.3 the first look sees no rate yet (128 enqueued); the second measures
    # 70 prompts in 0.1 s = 700/s and raises the low watermark to 700 * 0.3 = 210 and the high
    # one to 128 * 210 / 32 = 840: every later take finds its 70.
    assert _take_prompts_at_700_per_s(0.3, redis_url, "lead") == [70] * 8


def test_the_fillers_rate_is_the_recent_peak_of_prompts_taken():
    from buffer.prompts import RATE_HALF_LIFE_S, Filler

    now = [0.0]
    f = Filler(clock=lambda: now[0])
    assert f.observe(0) == 0.0  # the first look measures nothing
    now[0] = 0.1
    assert f.observe(60) == pytest.approx(600.0)  # 60 prompts in 0.1 s
    now[0] = 0.2
    # 20 in 0.1 s = 200/s measured, below the peak decayed by 0.1 s: 600 * 0.5 ** (0.1 / 5) = 591.7
    assert f.observe(80) == pytest.approx(600 * 0.5 ** (0.1 / RATE_HALF_LIFE_S))
    now[0] = 0.2 + 2 * RATE_HALF_LIFE_S
    assert f.observe(80) == pytest.approx(600 * 0.5 ** (0.1 / RATE_HALF_LIFE_S) / 4)  # two half-lives, nothing taken
    now[0] += 0.1
    assert f.observe(380) == pytest.approx(3000.0)  # 300 in 0.1 s: a faster rate counts at once
    now[0] += 0.001
    assert f.observe(388) == pytest.approx(3000.0)  # 1 ms later (a retried top-up): too soon to measure
    now[0] += 0.099
    # measured from the last look that counted, 0.1 s ago: 20 prompts = 200/s, below 3000 decayed over 0.1 s
    assert f.observe(400) == pytest.approx(3000 * 0.5 ** (0.1 / RATE_HALF_LIFE_S))
