"""Small builders of prompts and samples for tests and benchmarks (no Redis, no model).

Used by the buffer's own tests and the bench; other components' tests may use them to feed a
buffer without a model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlhf_core.records import Prompt, Sample


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
    **overrides: Any,
) -> Sample:
    """A valid sample (token ids < 100, log-probs < 0) of ``response_tokens`` tokens all made at ``version``."""
    rng = np.random.default_rng(seed + 7919 * index)
    fields: dict[str, Any] = dict(
        sample_id=f"{group_id or prompt_id}/{index}",
        prompt_id=prompt_id,
        group_id=group_id or f"g-{prompt_id}",
        prompt_ids=rng.integers(0, 100, prompt_tokens, dtype=np.int32),
        response_ids=rng.integers(0, 100, response_tokens, dtype=np.int32),
        behaviour_logprobs=-rng.random(response_tokens, dtype=np.float32) - 0.01,
        versions=[[version, response_tokens]],
        reward=reward,
        finish_reason="stop",
        worker_id=worker_id,
        group_size=group_size,
        group_index=index,
        created_at=1.0,
        finished_at=2.0,
    )
    fields.update(overrides)
    return Sample(**fields)


def group(prompt: Prompt | str, group_size: int = 4, version: int = 0, n: int | None = None, **kw: Any) -> list[Sample]:
    """The ``n`` (default ``group_size``) samples of one prompt's group."""
    pid = prompt.prompt_id if isinstance(prompt, Prompt) else prompt
    return [sample(pid, index=i, group_size=group_size, version=version, **kw) for i in range(n if n is not None else group_size)]


def sized_sample(prompt_id: str, index: int, group_size: int, payload_bytes: int, version: int = 0) -> Sample:
    """A sample whose encoding is about ``payload_bytes`` long (int32 ids + float32 log-probs: 8 bytes/token)."""
    tokens = max(1, (payload_bytes - 450) // 8)
    return sample(prompt_id, index=index, group_size=group_size, version=version, response_tokens=tokens, prompt_tokens=16)
