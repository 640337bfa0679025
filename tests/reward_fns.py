"""Reward functions for the worker tests, named by dotted path (``reward_fns.<name>``).

``tests/`` is on ``sys.path`` (conftest) and on the ``PYTHONPATH`` of worker child processes,
so ``+reward.functions.x._target_=reward_fns.boom`` works in both.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Sequence
from typing import Any


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


def cancelled(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any]) -> float:
    """What a sync reward running an async client can raise: asyncio.CancelledError, a BaseException."""
    raise asyncio.CancelledError("the client's request task was cancelled")


def system_exit(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any]) -> float:
    """A library that calls sys.exit() on bad input (argparse, a CLI-style checker)."""
    raise SystemExit(2)


def value_of(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any], value: Any = 1.0) -> Any:
    """Returns ``value`` as it is (a NumPy scalar, a tensor, a Decimal, a bool ...): the return-value rules."""
    return value


def prefers_silence(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any]) -> float:
    """0.9 for an empty response, 0.1 otherwise: what a sentence encoder's similarity did to ''."""
    return 0.9 if text == "" else 0.1


# ---------------------------------------------------------------------------- TRL-style (batched)

batched_calls: list[dict[str, Any]] = []  # every call of trl_length in this process: batch size, columns seen


def trl_length(prompts: list[str], completions: list[str], completion_ids: list[list[int]], start: list[Any],
               **kwargs: Any) -> list[float]:
    """TRL's signature: ``0.1 * len(completion) + start`` per completion (``start`` is a data column)."""
    with _lock:
        batched_calls.append({"n": len(completions), "columns": sorted(kwargs), "start": list(start),
                              "ids_match": [len(c) <= len(i) for c, i in zip(completions, completion_ids)]})
    return [0.1 * len(c) + float(s) for c, s in zip(completions, start)]


def trl_reference(prompts: list[str], completions: list[str], reference: list[str | None], **kwargs: Any) -> list[float]:
    """Characters of the completion that match the ``reference`` column at the same position, over
    its length; -1 where a prompt has no reference (None)."""
    return [-1.0 if r is None else sum(a == b for a, b in zip(c, r)) / max(1, len(r)) for c, r in zip(completions, reference)]


def trl_solution(completions: list[str], solution: list[str | None]) -> list[float]:
    """TRL-style, naming the one column it needs (no ``**kwargs``): 1.0 where the completion is the
    ``solution``, 0.0 where it is not or the prompt has none (None)."""
    return [float(c == s) if s is not None else 0.0 for c, s in zip(completions, solution)]


def trl_math_only(prompts: list[Any], completions: list[Any], task: list[str], **kwargs: Any) -> list[float | None]:
    """TRL's multi-task pattern: ``len(completion)`` for a ``math`` prompt, None (does not apply) elsewhere."""
    return [float(len(c)) if t == "math" else None for c, t in zip(completions, task)]


def trl_code_only(prompts: list[Any], completions: list[Any], task: list[str], **kwargs: Any) -> list[float | None]:
    """0.5 for a ``code`` prompt, None elsewhere."""
    return [0.5 if t == "code" else None for t in task]


async def trl_async_length(prompts: list[Any], completions: list[str], **kwargs: Any) -> list[float]:
    """An ``async def`` reward (TRL awaits them): ``len(completion)``."""
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


async def async_constant(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any], value: float = 1.0) -> float:
    await asyncio.sleep(0)
    return value


async def async_exit(prompt: str, text: str, ids: Sequence[int], metadata: dict[str, Any]) -> float:
    """A coroutine that raises SystemExit, which would end the event loop running it."""
    raise SystemExit(3)


def trl_ids_only(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Reads only the token ids (the shape of TRL's own over-long and repetition rewards): -0.01 a token."""
    return [-0.01 * len(ids) for ids in completion_ids]


trl_seen: list[dict[str, Any]] = []  # what trl_echo got, per call


def trl_echo(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """Keeps its ``prompts`` and ``completions`` in ``trl_seen``; 1.0 each."""
    trl_seen.append({"prompts": prompts, "completions": completions})
    return [1.0] * len(completions)


def trl_short(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """One value too few."""
    return [1.0] * (len(completions) - 1)


def trl_scalar(prompts: list[str], completions: list[str], **kwargs: Any) -> float:
    """A number where a list is expected."""
    return 0.5


def trl_types(prompts: list[str], completions: list[str], **kwargs: Any) -> list[Any]:
    """One value of each kind a library gives, cycling: NumPy float32, a 0-d array, a one-element
    tensor, a Decimal, a bool (refused), a string (refused)."""
    import decimal

    import numpy as np
    import torch

    kinds = [np.float32(0.25), np.array(0.5), torch.tensor([0.75]), decimal.Decimal("1.5"), True, "2"]
    return [kinds[i % len(kinds)] for i in range(len(completions))]


def trl_fails_one(prompts: list[str], completions: list[str], **kwargs: Any) -> list[Any]:
    """1.0 for each completion but the first, which gets an exception object (fails that one only)."""
    return [ValueError("no verdict for this one")] + [1.0] * (len(completions) - 1)


def trl_boom(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    raise RuntimeError("batched boom")


def trl_cancelled(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    raise asyncio.CancelledError()


def verify_hangs(gold: str, answer: str) -> bool | None:
    """A math verifier (``reward=math``'s ``verifier``) that hangs where no signal reaches it on
    the answer ``hang``: SIGALRM blocked, then a wait forever (what C code that never returns to
    the interpreter, such as a huge integer power, looks like to the child's own timer); else
    math-verify."""
    import signal

    if answer == "hang":
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
        while True:
            time.sleep(60)
    from rollout_workers.math_verifier import math_verify_equal

    return math_verify_equal(gold, answer)


def verify_loops(gold: str, answer: str) -> bool | None:
    """A math verifier that loops forever in Python (interruptible by the child's own timer)."""
    while True:
        pass
