"""What the built-in batched rewards (``math``, ``code_tests``) share: a completion's text, and
why each answer scored what it did, counted (``correct``, ``no_answer``, ``timeout``, ...) for
the worker's heartbeat (``reward_reasons`` in ``rlhf-monitor --once --json``'s worker stats).

A reward object that has a ``counters()`` method returning ``{reason: count}`` is read by
:meth:`rollout_workers.rewards.Scorer.counters`; any user reward may have one. Light: no torch.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any


class ReasonCounts:
    """A thread-safe tally of reasons (scoring threads count into it, the heartbeat reads it)."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, reasons: Iterable[str]) -> None:
        with self._lock:
            self._counts.update(reasons)

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def completion_text(completion: Any) -> str:
    """A completion as TRL passes it: its text, or the content of its last chat turn."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], Mapping):
        return str(completion[-1].get("content") or "")
    return str(completion)
