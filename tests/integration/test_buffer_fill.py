"""The prompt producer: fill_prompts walks epochs from a local data set and resumes after a restart."""

from __future__ import annotations

import json

import pytest

from buffer import Buffer, PromptsExhausted, iter_prompts
from rlhf_core.config import BufferConfig, DataConfig

pytestmark = pytest.mark.integration


@pytest.fixture
def data_cfg(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": i}) + "\n" for i in range(5)))
    return DataConfig(source="jsonl", path=str(path), seed=3)


def _drain(buf: Buffer) -> list[tuple[int, int, str]]:
    """Claim and complete everything waiting; return (epoch, index, text) of each prompt."""
    out = []
    for lease in buf.claim("w", 100):
        out.append((lease.prompt.epoch, lease.prompt.index, lease.prompt.text))
        buf.complete(lease, [])
    return out


def test_fill_walks_epochs_tops_up_and_resumes(redis_url, data_cfg):
    source = lambda epoch: iter_prompts(data_cfg, epoch)  # noqa: E731
    producer = Buffer.connect(redis_url, "fill", BufferConfig())
    producer.init_run(batch_size=400, group_size=4, max_staleness=0)
    assert producer.fill_prompts(source, epochs=2, low_watermark=3, high_watermark=4) == 4
    assert producer.fill_prompts(source, epochs=2, low_watermark=3, high_watermark=4) == 0  # 4 waiting >= 3
    seen = _drain(producer)
    assert producer.fill_prompts(source, epochs=2, low_watermark=3, high_watermark=4) == 4  # crosses into epoch 1
    assert producer.fill_state() == {"epoch": 1, "index": 3, "done": False}
    seen += _drain(producer)
    producer.close()

    restarted = Buffer.connect(redis_url, "fill", BufferConfig())  # a new producer process continues
    assert restarted.fill_prompts(source, epochs=2, low_watermark=3, high_watermark=4) == 2
    assert restarted.fill_state() == {"epoch": 2, "index": 0, "done": True}
    assert restarted.fill_prompts(source, epochs=2, low_watermark=3, high_watermark=4) == 0
    seen += _drain(restarted)
    assert sorted((e, i) for e, i, _ in seen) == [(e, i) for e in range(2) for i in range(5)]
    for epoch in range(2):
        texts = [t for e, i, t in sorted(seen) if e == epoch]
        assert sorted(texts) == [f"q{i}" for i in range(5)]  # each row once per epoch
    orders = [[t for e, _, t in sorted(seen) if e == epoch] for epoch in range(2)]
    assert orders[0] != orders[1]  # reshuffled per epoch (seed 3 gives different orders)
    assert restarted.metrics()["counters"]["prompts_enqueued"] == 10


def test_fill_with_an_empty_source_says_so(redis_url):
    buf = Buffer.connect(redis_url, "empty", BufferConfig())
    buf.init_run(batch_size=4, group_size=4, max_staleness=0)
    with pytest.raises(PromptsExhausted, match="no prompts for epoch 0"):
        buf.fill_prompts(lambda epoch: [], epochs=3, low_watermark=2)


def test_a_checkpoints_cursor_starts_a_fresh_run_where_its_prompts_had_reached(redis_url, data_cfg):
    source = lambda epoch: iter_prompts(data_cfg, epoch)  # noqa: E731
    fresh = Buffer.connect(redis_url, "fresh", BufferConfig())  # a resume on a new Redis: no cursor yet
    fresh.init_run(batch_size=400, group_size=4, max_staleness=0)
    assert fresh.restore_fill_state({"epoch": 1, "index": 3, "done": False}) is True
    assert fresh.restore_fill_state({"epoch": 0, "index": 0, "done": False}) is False  # never moves a live cursor back
    # epoch 1 from row 3: rows 3 and 4 of that epoch's order, then the run's 2 epochs are done
    assert fresh.fill_prompts(source, epochs=2, low_watermark=3, high_watermark=4) == 2
    assert [(e, i) for e, i, _ in _drain(fresh)] == [(1, 3), (1, 4)]
    assert fresh.fill_state() == {"epoch": 2, "index": 0, "done": True}
