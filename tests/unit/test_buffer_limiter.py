"""The pacing rule and the Reverb-style limiter as plain arithmetic (buffer.pacing; its Lua twins
are checked against it on a real Redis in tests/integration/test_buffer_pacing.py)."""

from __future__ import annotations

from buffer import pacing
from buffer.samples import groups_per_batch

# spi 2, min_size 8, error_buffer 8: offset 16, min_diff 8, max_diff 24
SPI, MIN, ERR = 2.0, 8, 8.0


def test_diffs():
    assert (pacing.min_diff(SPI, MIN, ERR), pacing.max_diff(SPI, MIN, ERR)) == (8.0, 24.0)


def test_can_insert():
    assert pacing.can_insert(0, 0, 8, SPI, MIN, ERR)  # 0 + 8 <= min_size: always
    assert pacing.can_insert(8, 0, 4, SPI, MIN, ERR)  # 12*2 - 0 = 24 <= 24
    assert not pacing.can_insert(8, 0, 5, SPI, MIN, ERR)  # 13*2 - 0 = 26 > 24
    assert pacing.can_insert(12, 8, 4, SPI, MIN, ERR)  # 16*2 - 8 = 24 <= 24


def test_can_sample():
    assert not pacing.can_sample(4, 0, 4, 4, SPI, MIN, ERR)  # size 4 < min_size 8
    assert pacing.can_sample(8, 0, 8, 8, SPI, MIN, ERR)  # 8*2 - (0+8) = 8 >= 8
    assert not pacing.can_sample(8, 8, 8, 8, SPI, MIN, ERR)  # 16 - 16 = 0 < 8
    assert pacing.can_sample(12, 8, 12, 8, SPI, MIN, ERR)  # 24 - 16 = 8 >= 8


def test_insert_room_is_the_largest_insertable_n():
    for inserts, samples in [(0, 0), (8, 0), (12, 8), (30, 40), (3, 0)]:
        room = pacing.insert_room(inserts, samples, SPI, MIN, ERR)
        assert pacing.can_insert(inserts, samples, room, SPI, MIN, ERR)
        assert not pacing.can_insert(inserts, samples, room + 1, SPI, MIN, ERR)
    assert pacing.insert_room(0, 0, SPI, MIN, ERR) == 12  # floor((24 + 0) / 2) - 0


def _params(**kw):
    p = {"max_staleness": 2, "batch_size": 8, "samples_per_insert": None, "min_size_to_sample": MIN, "error_buffer": ERR}
    p.update(kw)
    return p


def _counters(admitted=0, inflight=0, rl_inserts=0, rl_samples=0):
    return {"admitted": admitted, "inflight": inflight, "rl_inserts": rl_inserts, "rl_samples": rl_samples}


def test_pacing_budget():
    # (max_staleness 2 + version 0 + 1) * batch 8 = 24 samples may ever be admitted at version 0
    assert pacing.admission_budget(_params(), 0, _counters()) == 24
    assert pacing.admission_budget(_params(), 0, _counters(admitted=24)) == 0
    # each published version admits one more batch
    assert pacing.admission_budget(_params(), 1, _counters(admitted=24)) == 8
    # max_staleness 0: exactly one batch ahead, i.e. synchronous
    assert pacing.admission_budget(_params(max_staleness=0), 5, _counters(admitted=40)) == 8
    assert pacing.admission_budget(_params(), 0, _counters(admitted=30)) == 0  # never negative


def test_budget_is_the_tighter_of_pacing_and_limiter():
    p = _params(samples_per_insert=SPI, max_staleness=100)
    # limiter room: floor((24 + 0) / 2) - (0 + 4 in flight) = 8; pacing: 101 * 8 = 808
    assert pacing.admission_budget(p, 0, _counters(admitted=4, inflight=4)) == 8


def test_groups_per_batch_rule():
    assert groups_per_batch(32, 4) == 8
    assert groups_per_batch(30, 4) == 7  # whole groups adding up to at most batch_size
    assert groups_per_batch(2, 4) == 1  # at least one group
