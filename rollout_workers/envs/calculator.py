"""A calculator tool: arithmetic word problems where the policy may call ``calculate``.

For real chat models. The tool is described to the model through the tokenizer's chat template
(``apply_chat_template(..., tools=Calculator.tools)``) and its calls are read in the template's
format (``<tool_call>{"name": "calculate", "arguments": {"expression": "12*7"}}</tool_call>`` for
Qwen2.5/Qwen3/Hermes templates; :data:`Calculator.tool_call_pattern` where the template has none).

Each turn with tool calls gets one ``tool`` message per call: the value, or ``error: ...``. The
first turn without a tool call is the answer: reward 1.0 when its last number equals the prompt's
``metadata[answer_key]`` (within ``tolerance``), else 0.0, and the episode is done.

Prompts come from any data source with the answer in a column: a JSONL line
``{"prompt": "A box holds 12 rows of 7 eggs. How many eggs?", "answer": 84}``::

    rlhf-run model=hf model.path=Qwen/Qwen2.5-0.5B-Instruct data=jsonl data.path=problems.jsonl \\
        rollout.env._target_=rollout_workers.envs.calculator.Calculator rollout.max_turns=4

Expressions are parsed with :mod:`ast` and evaluated node by node over numbers and ``+ - * /
// % **`` with parentheses; nothing the model writes is ever passed to ``eval``. Lengths,
exponents and magnitudes are capped, so a call cannot make the worker spin.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable
from typing import Any

from rlhf_core.records import Prompt
from rollout_workers.environment import HERMES_TOOL_CALL, AssistantTurn, StepResult, string_tool

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e15

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class CalcError(ValueError):
    """An expression the calculator refuses; the message goes back to the model."""


def evaluate(expression: Any) -> int | float:
    """The value of an arithmetic expression, or :class:`CalcError` saying why not."""
    if not isinstance(expression, str):
        raise CalcError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CalcError(f"cannot parse {expression!r}: {type(exc).__name__}") from None
    return _node(tree.body)


def _node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_node(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _node(node.left), _node(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or abs(left) > MAX_MAGNITUDE):
            raise CalcError(f"the power {left} ** {right} is too large (exponents up to {MAX_EXPONENT})")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except (OverflowError, ValueError) as exc:
            raise CalcError(f"{type(exc).__name__}: {exc}") from None
        return _checked(value)
    raise CalcError(f"only numbers, + - * / // % ** and parentheses are allowed, got {type(node).__name__}")


def _checked(value: Any) -> int | float:
    if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)):
        raise CalcError(f"the result {value} is not a real number")
    if abs(value) > MAX_MAGNITUDE:  # int vs float compares exactly, without overflow
        raise CalcError(f"a number is outside +-{MAX_MAGNITUDE:g}")
    return value


def _format(value: int | float) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


class Calculator:
    """See the module docstring. ``answer_key``: the metadata field holding the answer;
    ``tolerance``: how close the answer's number must be."""

    tools = [string_tool("calculate", "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
                         "expression", "e.g. (12 + 3) * 7")]
    tool_call_pattern = HERMES_TOOL_CALL

    def __init__(self, answer_key: str = "answer", tolerance: float = 1e-6) -> None:
        self.answer_key, self.tolerance = answer_key, float(tolerance)
        self.answer: float | None = None

    def reset(self, prompt: Prompt) -> None:
        raw = (prompt.metadata or {}).get(self.answer_key)
        try:
            self.answer = None if raw is None else float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"prompt {prompt.prompt_id}: metadata[{self.answer_key!r}] = {raw!r} is not a number") from None
        return None  # the prompt as it is

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        if name != "calculate":
            return f"error: there is no tool {name!r}; the tool is calculate(expression)"
        try:
            return _format(evaluate(arguments.get("expression")))
        except CalcError as exc:
            return f"error: {exc}"

    def step(self, turn: AssistantTurn) -> StepResult:
        if turn.tool_calls or turn.tool_call_errors:
            results = [self.call(c.name, c.arguments) for c in turn.tool_calls]
            results += [f"error: {e}" for e in turn.tool_call_errors]
            return StepResult([{"role": "tool", "content": r} for r in results])
        numbers = _NUMBER.findall(turn.text.replace(",", ""))
        correct = (self.answer is not None and bool(numbers)
                   and abs(float(numbers[-1]) - self.answer) <= self.tolerance * max(1.0, abs(self.answer)))
        return StepResult(None, 1.0 if correct else 0.0, True)
