"""Capped exponential backoff with a time budget."""

from __future__ import annotations

from rlhf_core.retry import Backoff


def test_delays_double_up_to_the_cap():
    b = Backoff(0.05, 0.3, budget_s=100)
    # 0.05 -> 0.1 -> 0.2 -> 0.4 capped at 0.3 -> 0.3
    assert [b.next_delay() for _ in range(5)] == [0.05, 0.1, 0.2, 0.3, 0.3]
    assert b.attempts == 5


def test_budget_ends_the_retries(monkeypatch):
    import rlhf_core.retry as retry

    now = [1000.0]
    monkeypatch.setattr(retry.time, "monotonic", lambda: now[0])
    b = Backoff(1.0, 4.0, budget_s=5.0)
    assert b.next_delay() == 1.0  # elapsed 0 + 1 <= 5
    now[0] += 1.0
    assert b.next_delay() == 2.0  # elapsed 1 + 2 <= 5
    now[0] += 2.0
    assert b.next_delay() is None  # elapsed 3 + 4 > 5: give up instead of overrunning
    assert b.attempts == 2
