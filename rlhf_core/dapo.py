"""DAPO's two sample-level rules (Yu et al. 2025, "DAPO: an open-source LLM reinforcement
learning system at scale"): the group filter and the over-long reward shaping.

* **Group filter** (``algo.filter_groups``): a group whose rewards are all equal has zero
  group-relative advantage and teaches nothing. :func:`filter_reason` names why a finished group
  is dropped (:data:`FILTER_REASONS`); the worker completes it as *filtered* (its admission
  returned, so batches stay full) and the buffer counts it per reason.
* **Over-long shaping** (``algo.overlong=shaping``): a soft length penalty for responses that run
  into the last ``buffer`` tokens of ``max_len`` (:func:`overlong_penalty`, DAPO eq. 13).

The worker, the learner and the gateway import it, so it lives in the shared leaf.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the buffer and the launcher read the names here without loading torch
    import torch

#: Why a group is filtered; each has the buffer counter ``groups_filtered_<reason>``.
#: ``zero_variance``: every reward of the group is the same (DAPO: accuracy 0 or 1).
#: ``all_truncated``: with ``algo.overlong=mask``, every response was truncated, so every loss weight is 0.
FILTER_REASONS = ("zero_variance", "all_truncated")

#: Rewards closer than this count as equal (a reward model's float noise is not a learning signal).
REWARD_TOLERANCE = 1e-6


def filter_reason(rewards: Sequence[float], truncated: Sequence[bool], *, overlong: str = "none") -> str | None:
    """Why a finished group teaches nothing (one of :data:`FILTER_REASONS`), or None to keep it:
    ``rewards`` of its scored samples, ``truncated`` per sample (finish reason ``length``),
    ``overlong``: ``algo.overlong``. An empty group is kept (completed as empty anyway); a group of
    one sample has no baseline, so zero variance."""
    if not rewards:
        return None
    if overlong == "mask" and all(truncated):
        return "all_truncated"
    if max(rewards) - min(rewards) <= REWARD_TOLERANCE:
        return "zero_variance"
    return None


def group_filter(algo: Any, samples: Sequence[Any]) -> str | None:
    """:func:`filter_reason` for a finished group of ``samples`` (with ``reward`` and
    ``finish_reason``) under ``algo``, or None when ``algo.filter_groups`` is off."""
    if not algo.filter_groups:
        return None
    return filter_reason([s.reward for s in samples], [s.finish_reason == "length" for s in samples],
                         overlong=algo.overlong)


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, buffer: int) -> torch.Tensor:
    """DAPO's soft over-long punishment (eq. 13) for responses of ``lengths`` tokens ``[B]``::

        expected = max_len - buffer
        R(len) = 0                           if len <= expected
               = (expected - len) / buffer   if expected < len <= max_len
               = -1                          if len > max_len

    Returns ``[B]`` float32 penalties in [-1, 0], added to the rewards.
    """
    import torch

    if not 0 < buffer < max_len:
        raise ValueError(f"the over-long buffer must be in (0, max_len={max_len}), got {buffer}")
    expected = max_len - buffer
    penalty = (expected - lengths.to(torch.float32)) / buffer
    return penalty.clamp(min=-1.0, max=0.0)


#: seconds in which every finished group was filtered before the run says so on the console
STALL_WARN_S = 60.0


class FilterStall:
    """Notices a run whose every finished group is filtered (the learner gets no batch and the run
    would stall silently): fed the buffer's counters, :meth:`observe` returns the warning once per
    such stretch of ``stretch_s`` seconds, and again after the next appended group and a new stretch."""

    def __init__(self, stretch_s: float = STALL_WARN_S) -> None:
        self.stretch_s = float(stretch_s)
        self._since: tuple[float, int, dict[str, int]] | None = None  # (time, filtered, per reason) of the last append
        self._appended = -1
        self._warned = False

    def observe(self, now: float, counters: dict[str, int | float]) -> str | None:
        appended, filtered = int(counters.get("groups_appended", 0)), int(counters.get("groups_filtered", 0))
        per_reason = {r: int(counters.get(f"groups_filtered_{r}", 0)) for r in FILTER_REASONS}
        if appended != self._appended or self._since is None:
            self._appended, self._since, self._warned = appended, (now, filtered, per_reason), False
            return None
        t0, f0, r0 = self._since
        if self._warned or now - t0 < self.stretch_s or filtered == f0:
            return None
        self._warned = True
        reasons = ", ".join(f"{r} {per_reason[r] - r0[r]}" for r in FILTER_REASONS if per_reason[r] > r0[r])
        return (f"every group finished in the last {now - t0:.0f} s was filtered ({filtered - f0} groups: {reasons}) and "
                "none reached the learner: the task is too easy or too hard for the policy (all rewards equal). Use "
                "prompts of mixed difficulty, a larger algo.group_size or a graded reward, or set algo.filter_groups=false")
