"""The one place tests (and the buffer bench) build prompts and samples: no Redis, no model.

``sample()`` makes a valid record (token ids < 100, log-probs < 0). Leave the tokens out and
they are drawn from ``seed`` and ``index`` (a buffer test needs a sample of some size); give
``prompt_ids``, ``response_ids`` and the rest as plain lists when the numbers matter (a
learner test checks collated tensors against them).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlhf_core.records import Prompt, Sample, rle_encode


def prompts(n: int, start: int = 0, epoch: int = 0) -> list[Prompt]:
    return [Prompt(f"p{i}", f"count from {i}", epoch=epoch, index=i) for i in range(start, start + n)]


def sample(
    prompt_id: str = "p0",
    group_id: str | None = None,
    index: int = 0,
    group_size: int = 4,
    version: int = 0,
    response_tokens: int = 8,
    prompt_tokens: int = 4,
    reward: float = 1.0,
    worker_id: str = "w0",
    seed: int = 0,
    *,
    prompt_ids: Sequence[int] | None = None,
    response_ids: Sequence[int] | None = None,
    behaviour_logprobs: Sequence[float] | None = None,
    token_versions: Sequence[int] | None = None,
    ref_logprobs: Sequence[float] | None = None,
    **fields: Any,
) -> Sample:
    """A valid sample of ``prompt_id``'s group ``group_id`` (default ``g-<prompt_id>``).

    Tokens left out are drawn at random: ``response_tokens`` response tokens all made at
    ``version``. Given ones are used as they are (any sequence); given ``response_ids`` without
    ``behaviour_logprobs`` get -1.0 per token. ``token_versions`` is the policy version of each
    response token; ``fields`` sets any other ``Sample`` field.
    """
    rng = np.random.default_rng(seed + 7919 * index)
    drawn_prompt = rng.integers(0, 100, prompt_tokens, dtype=np.int32)
    drawn_response = rng.integers(0, 100, response_tokens, dtype=np.int32)
    drawn_logprobs = -rng.random(response_tokens, dtype=np.float32) - 0.01
    response = drawn_response if response_ids is None else np.asarray(response_ids, dtype=np.int32)
    n = len(response)
    if behaviour_logprobs is None:
        behaviour_logprobs = drawn_logprobs if response_ids is None else np.full(n, -1.0, dtype=np.float32)
    group_id = group_id or f"g-{prompt_id}"
    record: dict[str, Any] = dict(
        sample_id=f"{group_id}/{index}",
        prompt_id=prompt_id,
        group_id=group_id,
        prompt_ids=drawn_prompt if prompt_ids is None else np.asarray(prompt_ids, dtype=np.int32),
        response_ids=response,
        behaviour_logprobs=np.asarray(behaviour_logprobs, dtype=np.float32),
        versions=rle_encode(token_versions) if token_versions is not None else [[version, n]],
        reward=float(reward),
        finish_reason="stop",
        worker_id=worker_id,
        group_size=group_size,
        group_index=index,
        ref_logprobs=None if ref_logprobs is None else np.asarray(ref_logprobs, dtype=np.float32),
        created_at=1.0,
        finished_at=2.0,
    )
    record.update(fields)
    return Sample(**record)


def group(prompt: Prompt | str, group_size: int = 4, version: int = 0, n: int | None = None, **kw: Any) -> list[Sample]:
    """The ``n`` (default ``group_size``) samples of one prompt's group."""
    pid = prompt.prompt_id if isinstance(prompt, Prompt) else prompt
    return [sample(pid, index=i, group_size=group_size, version=version, **kw) for i in range(n if n is not None else group_size)]


def sized_sample(prompt_id: str, index: int, group_size: int, payload_bytes: int, version: int = 0) -> Sample:
    """A sample whose encoding is about ``payload_bytes`` long (int32 ids + float32 log-probs: 8 bytes/token)."""
    tokens = max(1, (payload_bytes - 450) // 8)
    return sample(prompt_id, index=index, group_size=group_size, version=version, response_tokens=tokens, prompt_tokens=16)


def fake_decode_clock(monkeypatch: Any, module: Any) -> None:
    """``module``'s decode_entry advances its perf_counter by exactly 1.0 per entry (and nothing else
    does): a batch's ``decode_s`` then counts the entries decoded for it, whatever the wait."""
    import time
    import types

    from buffer import samples

    clock = [0.0]
    real = samples.decode_entry

    def decode(*args: Any, **kwargs: Any) -> Any:
        clock[0] += 1.0
        return real(*args, **kwargs)

    names = {n: getattr(time, n) for n in dir(time) if not n.startswith("_")}
    monkeypatch.setattr(module, "time", types.SimpleNamespace(**{**names, "perf_counter": lambda: clock[0]}))
    monkeypatch.setattr(module, "decode_entry", decode)


class LogSeen(logging.Handler):
    """Sets ``event`` when a record whose message contains ``text`` is logged (from any thread):
    a test waits on it instead of sleeping."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text, self.event = text, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()
