"""Reward functions for the worker tests, named by dotted path (``reward_fns.<name>``).

``tests/`` is on ``sys.path`` (conftest) and on the ``PYTHONPATH`` of worker child processes,
so ``+reward.functions.x._target_=reward_fns.boom`` works in both.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Sequence


def constant(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any], value: float = 1.0) -> float:
    return value


def per_token(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any], scale: float = 1.0) -> float:
    """``scale * len(response_ids)``."""
    return scale * len(ids)


def parts(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any]) -> dict[str, float]:
    return {"a": 1.0, "b": -2.0}


def boom(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any]) -> float:
    raise ValueError("boom")


def nan(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any]) -> float:
    return float("nan")


def inf_part(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any]) -> dict[str, float]:
    return {"ok": 1.0, "bad": float("inf")}


def word(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any]) -> str:
    return "0.5"  # a string, even a numeric one, is not a reward


def empty(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any]) -> dict[str, float]:
    return {}


def echo_metadata(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any], key: str = "answer") -> float:
    return float(metadata[key])


class CallCounter:
    """A class target: instantiated once with the config's kwargs, then called per sample."""

    def __init__(self, start: int = 0) -> None:
        self.calls = start

    def __call__(self, prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any]) -> float:
        self.calls += 1
        return float(self.calls)


_first_seen: set[str] = set()
_lock = threading.Lock()


def flaky(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any]) -> float:
    """1.0, except the FIRST sample scored of a prompt whose metadata says ``fail``: ``raise``
    raises, ``nan`` returns NaN, so such a group loses exactly one sample; ``always`` raises for
    every sample. Keyed by
    ``metadata["tag"]`` (unique per prompt and test) in this process."""
    mode = metadata.get("fail")
    if mode == "always":
        raise RuntimeError(f"always failing for {metadata['tag']}")
    if mode:
        with _lock:
            first = metadata["tag"] not in _first_seen
            _first_seen.add(metadata["tag"])
        if first and mode == "raise":
            raise RuntimeError(f"flaky failure for {metadata['tag']}")
        if first and mode == "nan":
            return float("nan")
    return 1.0


def slow(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any], delay_s: float = 0.25) -> float:
    """1.0 after ``delay_s``: keeps a group in flight for a while (scoring is per sample, in order)."""
    time.sleep(delay_s)
    return 1.0


_scored = 0


def gate(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any], path: str = "", free: int = 4) -> float:
    """1.0 at once for the first ``free`` samples this process scores; every later one waits
    while the file ``path`` exists. With ``rollout.slots=1`` a worker generates and scores one
    group at a time, so it completes exactly ``free / group_size`` groups and then holds the
    next prompt's lease until the test removes the file: a state a test can wait on."""
    global _scored
    with _lock:
        _scored += 1
        waits = _scored > free
    while waits and os.path.exists(path):
        time.sleep(0.01)
    return 1.0


def exit_process(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any]) -> float:
    """Ends the worker process at its first scoring with exit code 3 (a crash, not a user error)."""
    os._exit(3)
