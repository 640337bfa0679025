"""``count_up`` in turns: the built-in task as an episode, with an environment that helps.

The single-turn task (:mod:`rlhf_core.tasks`): the prompt is a digit (``"7:"``) and the reward is
the fraction of the first six characters that continue the count (``"890123"``). Here the policy
writes one position per turn and, after each turn, the environment answers ``"|<digit>"``: the
digit the NEXT position should hold. Its first observation puts the first one after the prompt::

    prompt:     7 : | 8
    response:   8 | 9 9 | 0 0 | 1 1 | 2 2 | 3 3      (turn, observation, turn, ...; done after 6 turns)
    loss mask:  1 0 0 1 0 0 1 0 0 1 0 0 1 0 0 1

so a policy that copies the environment's last digit scores 1.0. With ``hints=false`` the
environment answers ``"|?"`` at the same places: the same tokens to train on, no information (the
no-tool baseline; ``bench/multi_turn.py`` trains both). The reward, when the episode is done, is
:func:`rlhf_core.tasks.count_up_reward` of each turn's first character (none counts as wrong).
"""

from __future__ import annotations

from typing import Any

from rlhf_core.records import Prompt
from rlhf_core.tasks import count_up_reward
from rollout_workers.environment import AssistantTurn, StepResult

PLACEHOLDER = "?"


class CountUpHints:
    """See the module docstring. ``target_len``: positions (turns) per episode; ``hints``: whether
    the environment says the next digit (false: the no-tool baseline); ``separator``: what opens
    each of its answers."""

    def __init__(self, target_len: int = 6, hints: bool = True, separator: str = "|") -> None:
        if target_len < 1:
            raise ValueError(f"target_len must be >= 1, got {target_len}")
        self.target_len, self.hints, self.separator = int(target_len), bool(hints), str(separator)
        self.start = 0
        self.written = ""
        self.prompt_text = ""

    def _answer(self, position: int) -> str:
        digit = str((self.start + 1 + position) % 10)
        return f"{self.separator}{digit if self.hints else PLACEHOLDER}"

    def reset(self, prompt: Prompt) -> str:
        meta: dict[str, Any] = prompt.metadata or {}
        self.start = int(meta.get("start", int(prompt.text[0]) if prompt.text[:1].isdigit() else 0))
        self.written, self.prompt_text = "", prompt.text
        return prompt.text + self._answer(0)

    def step(self, turn: AssistantTurn) -> StepResult:
        self.written += turn.text[:1] or " "
        if len(self.written) >= self.target_len:
            reward = count_up_reward(self.prompt_text, self.written, [], {"start": self.start}, target_len=self.target_len)
            return StepResult(None, reward, True)
        return StepResult(self._answer(len(self.written)), None, False)
