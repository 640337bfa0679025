"""A "run my code" tool: the policy runs Python programs in the sandbox and sees what they print.

Each turn that calls the ``run_python`` tool (a tool call in the chat template's format, or,
for a model without tools, a fenced ```python block) runs that program in the sandbox
(:mod:`rollout_workers.sandbox`, the run's ``sandbox`` settings) and gets back its exit status,
stdout and stderr, cut to ``max_observation_chars``. The first turn with no program is the
policy's final answer and ends the episode. When the row has tests (the ``tests_field`` column,
in any shape ``reward=code_tests`` reads), the episode's reward is the share of them the LAST
program it ran passes (0 when it ran none); without tests the environment gives no reward and
the run's reward functions score the episode::

    rlhf-run model=hf model.path=Qwen/Qwen2.5-0.5B-Instruct data=jsonl data.path=tasks.jsonl \\
        rollout.env._target_=rollout_workers.envs.python_tool.PythonTool '+rollout.env.sandbox=${sandbox}' \\
        rollout.max_turns=4

(``${sandbox}`` hands the environment the run's ``sandbox`` settings, ``sandbox=none`` included.)
A program's failure, timeout or runaway output is an observation like any other: the policy
learns from it, the worker is untouched.
"""

from __future__ import annotations

from typing import Any

from rlhf_core.choices import CodeExtract
from rlhf_core.config.sandbox import SandboxConfig
from rlhf_core.records import Prompt
from rollout_workers.code_reward import CodeOutcome, extract_program, parse_tests, plan, run_planned
from rollout_workers.environment import HERMES_TOOL_CALL, AssistantTurn, StepResult, string_tool
from rollout_workers.sandbox import SandboxResult, shared_sandbox


def describe(result: SandboxResult, limit: int) -> str:
    """What the policy is told about a run: its status, then stdout and stderr, each cut to ``limit``."""
    parts = [result.reason]
    for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        if text:
            cut = text if len(text) <= limit else text[:limit] + f"\n... ({len(text) - limit} more characters)"
            parts.append(f"{name}:\n{cut}")
    return "\n".join(parts)


class PythonTool:
    """See the module docstring. ``sandbox``: the run's sandbox settings (``${sandbox}``)."""

    tools = [string_tool("run_python", "Run a Python 3 program in a sandbox (no network, no files but /tmp) and return its output.",
                         "code", "the whole program")]
    tool_call_pattern = HERMES_TOOL_CALL

    def __init__(self, sandbox: Any = None, tests_field: str = "tests", max_observation_chars: int = 2000) -> None:
        self.sandbox = shared_sandbox(SandboxConfig.of(sandbox))
        self.tests_field, self.limit = tests_field, int(max_observation_chars)
        self.tests: list = []
        self.last_program: str | None = None

    @staticmethod
    def check_at_start(spec: Any) -> None:
        """``rlhf-run``'s check before anything starts: the sandbox runs here, or one line says why not."""
        shared_sandbox(SandboxConfig.of(spec.get("sandbox"))).check()

    def reset(self, prompt: Prompt) -> None:
        raw = (prompt.metadata or {}).get(self.tests_field)
        self.tests = parse_tests(raw) if raw is not None else []
        self.last_program = None
        return None  # the prompt as it is

    def step(self, turn: AssistantTurn) -> StepResult:
        programs = [c.arguments.get("code") for c in turn.tool_calls if c.name == "run_python"]
        errors = [f"error: {e}" for e in turn.tool_call_errors]
        errors += [f"error: there is no tool {c.name!r}; the tool is run_python(code)" for c in turn.tool_calls
                   if c.name != "run_python"]
        if not turn.tool_calls and not turn.tool_call_errors:
            fenced = extract_program(turn.text, CodeExtract.fenced)
            if fenced is None:
                return StepResult(None, self._final_reward(), True)
            programs = [fenced]
        results = [self.sandbox.run(str(code)) if isinstance(code, str) else None for code in programs]
        self.last_program = next((str(c) for c in reversed(programs) if isinstance(c, str)), self.last_program)
        said = [describe(r, self.limit) if r is not None else "error: run_python needs code: a string" for r in results]
        if not turn.tool_calls:
            return StepResult(said[0] if said else None)
        return StepResult([{"role": "tool", "content": text} for text in [*said, *errors]])

    def _final_reward(self) -> float | None:
        if not self.tests:
            return None
        if self.last_program is None:
            return 0.0
        verdicts = run_planned(self.sandbox, plan(self.last_program, self.tests))
        return sum(v == CodeOutcome.passed for v in verdicts) / len(verdicts)
