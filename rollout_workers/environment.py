"""The environment protocol of multi-turn episodes, and the records that cross it.

An environment is a class named by ``rollout.env._target_``; the other keys of ``rollout.env`` are
its constructor's keyword arguments. The worker makes one instance per episode and calls, off its
main thread (a thread pool, or one event loop for ``async def`` methods)::

    first = env.reset(prompt)        # Prompt -> first observation (None: the prompt as it is)
    result = env.step(turn)          # AssistantTurn -> StepResult(observation, reward, done)
    ...                              # until done, or rollout.max_turns turns
    env.close()                      # if it has one, when the episode ends however it ends

Observations (:data:`rlhf_core.turns.Observation`), the optional ``tools`` and
``tool_call_pattern`` attributes and how the episode's reward is made up: docs/multi_turn.md.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlhf_core.config import ConfigError, env_target, to_plain
from rlhf_core.records import Prompt
from rlhf_core.tool_calls import ToolCall
from rlhf_core.turns import EnvContractError, Observation
from rollout_workers.user_code import import_env_target


@dataclass
class AssistantTurn:
    """One policy turn, as the environment sees it. ``text``: decoded without special tokens;
    ``raw_text``: with them; ``finish_reason``: ``stop`` or ``length``; ``index``: 0 for the first
    turn; ``tool_call_errors``: one message per call the parser could not read (answer it with an
    error observation)."""

    text: str
    raw_text: str
    token_ids: list[int]
    finish_reason: str
    index: int
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_errors: list[str] = field(default_factory=list)


@dataclass
class StepResult:
    """What ``step`` returns: the next observation (ignored when ``done``), an optional reward
    (summed over the episode), and whether the episode is over."""

    observation: Observation = None
    reward: float | None = None
    done: bool = False


class Environment(Protocol):
    """What the worker needs of an environment (see the module docstring)."""

    def reset(self, prompt: Prompt) -> Observation | Awaitable[Observation]: ...

    def step(self, turn: AssistantTurn) -> StepResult | tuple | Awaitable[StepResult | tuple]: ...


#: an environment's ``tool_call_pattern`` where the chat template has no tool format: the Hermes tags, as plain text
HERMES_TOOL_CALL = r"<tool_call>(.*?)</tool_call>"


def string_tool(name: str, description: str, argument: str, about: str) -> dict[str, Any]:
    """The JSON schema of a tool taking one string argument, for an environment's ``tools``."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {argument: {"type": "string", "description": about}},
                       "required": [argument]},
    }}


def as_step_result(value: Any) -> StepResult:
    """Normalise what ``step`` returned: a StepResult, ``(obs, reward, done)`` or ``(obs, done)``."""
    if isinstance(value, StepResult):
        result = value
    elif isinstance(value, tuple) and len(value) == 3:
        result = StepResult(value[0], value[1], bool(value[2]))
    elif isinstance(value, tuple) and len(value) == 2:
        result = StepResult(value[0], None, bool(value[1]))
    else:
        raise EnvContractError(f"step() returned {type(value).__name__}; return a StepResult(observation, reward, done) "
                                "or a tuple (observation, reward, done)")
    reward = result.reward
    if reward is not None:
        if isinstance(reward, bool) or type(reward).__name__.startswith("bool"):
            raise EnvContractError(f"step() returned reward {reward!r}: booleans are not rewards (return 1.0 or 0.0)")
        try:
            result.reward = float(reward)  # Python, NumPy and torch scalars
        except (TypeError, ValueError):
            raise EnvContractError(f"step() returned reward {reward!r} ({type(reward).__name__}), not a number") from None
        if not math.isfinite(result.reward):
            raise EnvContractError(f"step() returned reward {reward!r}, not a finite number")
    return result


class EnvFactory:
    """Makes one environment per episode from ``rollout.env`` (class and keyword arguments). Built
    before the model loads: a path or keyword arguments that do not fit are a :class:`ConfigError`."""

    def __init__(self, rollout: Any) -> None:
        cls = import_env_target(rollout)
        if cls is None:
            raise ConfigError("rollout.env has no _target_: no environment to run")
        self.cls, self.path = cls, env_target(rollout)
        env = rollout.env
        items = env.items() if isinstance(env, Mapping) else ()
        self.kwargs = {str(k): to_plain(v) for k, v in items if k != "_target_"}
        try:
            inspect.signature(cls).bind(**self.kwargs)
        except TypeError as exc:
            raise ConfigError(f"rollout.env: {self.path}({', '.join(f'{k}=...' for k in self.kwargs)}) does not fit its "
                              f"constructor: {exc}; set only the keys it takes (+rollout.env.<key>=value)") from None
        except ValueError:  # a signature inspect cannot read (a C extension): let the first episode tell
            pass

    def make(self) -> Any:
        return self.cls(**self.kwargs)
