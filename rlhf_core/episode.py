"""A multi-turn episode as one token sequence with a loss mask: token in, token out.

An episode is trained as ONE sample whose response is everything after the prompt::

    prompt | policy turn 1 | observation 1 | policy turn 2 | ... | policy turn n
    mask     1 1 1 1 1       0 0 0 0 0 0     1 1 1 1          ...   1 1 1

The policy's tokens are kept exactly as sampled (never decoded and re-tokenised). Tokens it did
not sample get mask 0, behaviour log-prob 0 and the version of the policy token before them, so
the oldest version over all response tokens is the oldest over the policy's. Tokens before the
first policy turn belong to the prompt. :class:`Transcript` knows nothing of engines or templates:
the worker's episodes and the gateway's sessions both build samples with it (docs/multi_turn.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlhf_core.records import Sample, rle_encode


@dataclass
class Transcript:
    """The token sequence of one episode, built turn by turn: ``prompt_ids`` grows until the first
    policy token, then every token goes to the response with its mask, log-prob and version;
    ``turns``: ``(start, end)`` of each policy turn in the response."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_ids = [int(t) for t in self.prompt_ids]

    @property
    def context_ids(self) -> list[int]:
        """Everything so far: what the next policy turn is generated from."""
        return self.prompt_ids + self.response_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.mask)

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version of its tokens (the one its staleness counts from); None before
        the first policy token. What a next turn may reuse K/V from (``GenRequest.min_kv_version``)."""
        return min(self.versions) if self.versions else None

    def add_policy(self, token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        """Append one policy turn exactly as sampled: ``[n]`` ids, behaviour log-probs, versions."""
        if not len(token_ids) == len(logprobs) == len(versions):
            raise ValueError(f"a policy turn needs one log-prob and one version per token, got {len(token_ids)} "
                             f"tokens, {len(logprobs)} log-probs, {len(versions)} versions")
        start = len(self.response_ids)
        self.response_ids.extend(int(t) for t in token_ids)
        self.logprobs.extend(float(x) for x in logprobs)
        self.versions.extend(int(v) for v in versions)
        self.mask.extend([1] * len(token_ids))
        if len(token_ids):
            self.turns.append((start, len(self.response_ids)))

    def add_observation(self, token_ids: Sequence[int]) -> None:
        """Append tokens the policy did not sample (mask 0, log-prob 0, the version before them);
        before the first policy token they extend the prompt."""
        ids = [int(t) for t in token_ids]
        if not self.response_ids:
            self.prompt_ids.extend(ids)
            return
        self.response_ids.extend(ids)
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([self.versions[-1]] * len(ids))
        self.mask.extend([0] * len(ids))

    def policy_segments(self) -> list[list[int]]:
        """The ids of each policy turn, as sampled."""
        return [self.response_ids[a:b] for a, b in self.turns]

    def to_sample(self, *, sample_id: str, prompt_id: str, group_id: str, reward: float = 0.0,
                  finish_reason: str = "stop", worker_id: str = "", group_size: int = 1, group_index: int = 0,
                  created_at: float = 0.0, finished_at: float = 0.0, reward_components: dict[str, float] | None = None,
                  metadata: dict[str, Any] | None = None, ref_logprobs: np.ndarray | None = None) -> Sample:
        """The episode as a :class:`~rlhf_core.records.Sample` with its ``loss_mask``."""
        return Sample(
            sample_id=sample_id, prompt_id=prompt_id, group_id=group_id,
            prompt_ids=np.asarray(self.prompt_ids, dtype=np.int32),
            response_ids=np.asarray(self.response_ids, dtype=np.int32),
            behaviour_logprobs=np.asarray(self.logprobs, dtype=np.float32),
            versions=rle_encode(self.versions), reward=float(reward),
            reward_components=dict(reward_components or {}), finish_reason=finish_reason, worker_id=worker_id,
            group_size=group_size, group_index=group_index, created_at=created_at, finished_at=finished_at,
            metadata=dict(metadata or {}), loss_mask=np.asarray(self.mask, dtype=np.uint8), ref_logprobs=ref_logprobs,
        )
