"""Capped exponential backoff with a time budget, shared by every client that retries
(the buffer's Redis calls and connection, the weight publisher)."""

from __future__ import annotations

import time


class Backoff:
    """Delays ``start, 2*start, 4*start, ...`` capped at ``cap``, until ``budget_s`` is spent: a
    caller sleeps each :meth:`next_delay` between tries and gives up when it is None."""

    def __init__(self, start: float, cap: float, budget_s: float) -> None:
        self.start, self.cap, self.budget_s = start, cap, budget_s
        self.began = time.monotonic()
        self.delay = start
        self.attempts = 0

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.began

    def next_delay(self) -> float | None:
        """The next delay, or None when sleeping it would overrun the budget."""
        if self.elapsed + self.delay > self.budget_s:
            return None
        delay = self.delay
        self.delay = min(self.delay * 2, self.cap)
        self.attempts += 1
        return delay
