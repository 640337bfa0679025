"""``reward=code_tests``: the share of a row's tests that the response's program passes, each
test one execution in the sandbox (:mod:`rollout_workers.sandbox`).

The program is the response's last fenced code block (```python ... ```), or, without one, the
whole response (``extract``: ``auto``; ``fenced`` takes fenced blocks only and scores a response
without one 0, ``whole`` always takes the whole response). The tests are the row's
``tests_field`` column (``tests``), in one of the usual shapes:

* stdin/stdout pairs, ``[{"input": "1 2\\n", "output": "3\\n"}, ...]`` or APPS/TACO's
  ``{"inputs": [...], "outputs": [...]}``: the program runs once per pair with the input on its
  stdin, and passes when it exits 0 having printed the output (lines compared without their
  trailing whitespace, trailing blank lines ignored). The verdict is the worker's, outside the
  sandbox: a program cannot fake it.
* assert statements, ``["assert add(1, 2) == 3", ...]`` (MBPP's ``test_list``): the program
  followed by the statement and a line printing a random token runs once per statement, and
  passes when it exits 0 with that token as its last line of output, so exiting early
  (``os._exit(0)``) fails. The statement runs in the program's process: a program that reads its
  own source can still fake a pass; stdin/stdout tests cannot be faked.

A row's tests may also come as a JSON string of either shape (how a nested column reaches the
reward). Every test's outcome is counted (:class:`CodeOutcome`: ``passed``, ``wrong_output``,
the execution's status when it did not end well, ``no_code`` for a response without a program) in
:meth:`CodeTests.counters`. A row without tests fails its completions
with a message naming the column.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from rlhf_core.choices import CodeExtract
from rlhf_core.config import ConfigError
from rlhf_core.config.sandbox import SandboxConfig
from rollout_workers.reward_tools import ReasonCounts, completion_text
from rollout_workers.sandbox import Sandbox, SandboxResult, SandboxStatus, shared_sandbox

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.S)
_CODE_LANGS = ("", "python", "py", "python3")


class CodeOutcome(StrEnum):
    """How one test of a program went: passed, or why not (how its execution ended)."""

    passed = "passed"
    wrong_output = "wrong_output"  # it ran to the end, but printed something else (or not the assert's token)
    failed = SandboxStatus.failed.value
    timeout = SandboxStatus.timeout.value
    memory = SandboxStatus.memory.value
    output_limit = SandboxStatus.output_limit.value
    crashed = SandboxStatus.crashed.value
    error = SandboxStatus.error.value
    no_code = "no_code"  # the response holds no program (extract=fenced and no fenced block): nothing ran


@dataclass(frozen=True)
class CodeTest:
    """One test: ``stdin`` and the ``expected`` output, or an ``assertion`` run after the program."""

    stdin: str = ""
    expected: str | None = None
    assertion: str | None = None


def extract_program(text: str, mode: CodeExtract = CodeExtract.auto) -> str | None:
    """The program of a response (see the module docstring); None when there is none."""
    if mode != CodeExtract.whole:
        blocks = [code for lang, code in _FENCE.findall(text) if lang.lower() in _CODE_LANGS]
        if blocks:
            return blocks[-1]
        if mode == CodeExtract.fenced:
            return None
    return text if text.strip() else None


def parse_tests(value: Any) -> list[CodeTest]:
    """A row's tests in any of the shapes of the module docstring; ValueError saying what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = [value]  # one assert statement
    if isinstance(value, Mapping) and "inputs" in value and "outputs" in value:
        ins, outs = value["inputs"], value["outputs"]
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
            raise ValueError("'inputs' and 'outputs' must be lists of one length")
        value = [{"input": i, "output": o} for i, o in zip(ins, outs)]
    if not isinstance(value, list):
        raise ValueError(f"tests must be a list (of asserts or of input/output pairs), got {type(value).__name__}")
    tests = []
    for t in value:
        if isinstance(t, str):
            tests.append(CodeTest(assertion=t))
        elif isinstance(t, Mapping) and "output" in t:
            tests.append(CodeTest(stdin=_text(t.get("input", "")), expected=_text(t["output"])))
        else:
            raise ValueError(f"a test must be an assert statement or {{'input': ..., 'output': ...}}, got {t!r:.80}")
    return tests


def _text(v: Any) -> str:
    return "\n".join(map(str, v)) if isinstance(v, list) else str(v)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def judge(test: CodeTest, result: SandboxResult, token: str = "") -> CodeOutcome:
    """How the test went, from its execution's result (``token``: what an assert test prints last)."""
    if result.status != SandboxStatus.ok:
        return CodeOutcome(result.status.value)
    if test.assertion is not None:
        right = _lines(result.stdout)[-1:] == [token]
    else:
        right = _lines(result.stdout) == _lines(test.expected or "")
    return CodeOutcome.passed if right else CodeOutcome.wrong_output


@dataclass(frozen=True)
class PlannedRun:
    """One test of one program, as the sandbox runs it: the source (the program, and for an
    assert test the statement and the line printing ``token``) and its stdin."""

    test: CodeTest
    token: str
    source: str
    stdin: str


def plan(program: str, tests: Sequence[CodeTest]) -> list[PlannedRun]:
    runs = []
    for test in tests:
        token = secrets.token_hex(16)
        source = program if test.assertion is None else f"{program}\n\n{test.assertion}\nprint({token!r})\n"
        runs.append(PlannedRun(test, token, source, test.stdin))
    return runs


def run_planned(sandbox: Sandbox, runs: Sequence[PlannedRun]) -> list[CodeOutcome]:
    """Each run's verdict (:func:`judge`), the runs ``sandbox.pool_size`` at a time."""
    results = sandbox.run_all([(r.source, r.stdin) for r in runs])
    return [judge(r.test, result, r.token) for r, result in zip(runs, results)]


class CodeTests:
    """The ``code_tests`` reward (see the module docstring). ``sandbox``: the run's sandbox
    settings (``${sandbox}`` in ``conf/reward/code_tests.yaml``); ``max_tests``: at most this many
    of a row's tests are run (null: all)."""

    def __init__(self, sandbox: Any = None, tests_field: str = "tests", extract: str = "auto",
                 max_tests: int | None = None) -> None:
        self.sandbox: Sandbox = shared_sandbox(SandboxConfig.of(sandbox))
        self.sandbox.check()
        self.tests_field, self.max_tests = tests_field, max_tests
        try:
            self.extract = CodeExtract(extract)
        except ValueError:
            raise ConfigError(f"reward.functions.code_tests.extract={extract!r} is not one of "
                              f"{', '.join(e.value for e in CodeExtract)}") from None
        self.reasons = ReasonCounts()

    @staticmethod
    def check_at_start(spec: Mapping[str, Any]) -> None:
        """``rlhf-run``'s check before anything starts: the sandbox runs here, or one line says why not."""
        shared_sandbox(SandboxConfig.of(spec.get("sandbox"))).check()

    def counters(self) -> dict[str, int]:
        return self.reasons.counters()

    def __call__(self, completions: Sequence[Any], **columns: Any) -> list[float | Exception]:
        rows = columns.get(self.tests_field) or [None] * len(completions)
        out: list[float | Exception | None] = [None] * len(completions)
        runs: list[PlannedRun] = []
        owners: list[int] = []  # the completion of each run
        for i, (completion, raw) in enumerate(zip(completions, rows)):
            try:
                tests = parse_tests(raw) if raw is not None else []
            except ValueError as exc:
                out[i] = ValueError(f"the row's {self.tests_field!r} cannot be read: {exc}")
                continue
            if not tests:
                out[i] = ValueError(f"the row has no tests in column {self.tests_field!r} "
                                    "(reward.functions.code_tests.tests_field)")
                continue
            program = extract_program(completion_text(completion), self.extract)
            if program is None:
                self.reasons.add([CodeOutcome.no_code.value])
                out[i] = 0.0
                continue
            planned = plan(program, tests[: self.max_tests])
            runs += planned
            owners += [i] * len(planned)
        verdicts = run_planned(self.sandbox, runs)
        self.reasons.add(v.value for v in verdicts)
        passed: dict[int, list[bool]] = {}
        for i, verdict in zip(owners, verdicts):
            passed.setdefault(i, []).append(verdict == CodeOutcome.passed)
        for i, flags in passed.items():
            out[i] = sum(flags) / len(flags)
        return [0.0 if v is None else v for v in out]

