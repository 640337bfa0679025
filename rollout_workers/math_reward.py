"""``reward=math``: 1.0 when the response's final answer equals the row's reference, else 0.0.

The answer is read from the response by the first of ``extract`` that finds one (all three by
default, in this order):

* ``boxed``: the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched;
* ``answer_is``: what follows the last "The answer is", "Final answer:" or GSM8K's "####", to the
  end of its line (a trailing full stop dropped);
* ``last_number``: the last number of the response (``-1,234.5``, ``3/4``).

The reference is the first of ``reference_fields`` the row has (``ground_truth``, ``answer``,
``solution``; a dotted name reads into a nested column, verl's ``reward_model.ground_truth``): the
text after GSM8K's ``####`` when it has one (``question``/``answer`` rows), else its last
``\\boxed{}`` (MATH's ``problem``/``solution`` rows), else the whole value (``prompt``/
``ground_truth`` rows).

Two plain numbers (``1,000`` and ``1000``, ``0.5`` and ``.50``, ``$72`` and ``72``) are compared
exactly, at once. Anything else (``\\frac{1}{2}`` against ``0.5``, ``x = 3`` against ``3``,
``72\\text{ apples}``) goes to ``math-verify`` (pip install 'rlhf-service[math]') in a child
process, with ``timeout_s`` per answer (:mod:`rollout_workers.math_verifier` says how the limit
is enforced). Every answer's outcome is counted (:class:`MathOutcome`, :meth:`MathReward.counters`):
an answer that cannot be found or parsed, or that times out, scores 0 with its reason; a row
without a reference fails its completions with a message naming the columns looked for.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Mapping, Sequence
from enum import StrEnum
from fractions import Fraction
from typing import Any

from rlhf_core.choices import AnswerExtract
from rlhf_core.config import ConfigError
from rollout_workers.math_verifier import DEFAULT_VERIFIER, VerifierPool
from rollout_workers.reward_tools import ReasonCounts, completion_text

DEFAULT_EXTRACT = (AnswerExtract.boxed, AnswerExtract.answer_is, AnswerExtract.last_number)
DEFAULT_REFERENCE_FIELDS = ("ground_truth", "answer", "solution")
#: a longer answer is not an answer (and would only feed the verifier something slow)
MAX_ANSWER_CHARS = 1000

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"(?:answer\s*(?:is|:)|####)[ \t:]*([^\n]+)", re.I)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_PLAIN = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[-+]?\.\d+")
_FRACTION = re.compile(r"[-+]?\d+/\d+")
_DROP = ("\\$", "$", "\\!", "\\,", "\\;", " ", "\\left", "\\right")


class MathOutcome(StrEnum):
    """Why an answer scored what it did."""

    correct = "correct"
    wrong = "wrong"
    no_answer = "no_answer"  # nothing the extraction looks for is in the response
    unparsed = "unparsed"  # found, but math-verify cannot read it (or the reference)
    timeout = "timeout"  # the comparison ran past timeout_s
    verifier_error = "verifier_error"  # the verifier raised, or its process died
    no_reference = "no_reference"  # the row has none of reference_fields (the completion fails)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` with its braces matched."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for j in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[start:j].strip()
    return None


def extract_answer(text: str, order: Sequence[AnswerExtract] = DEFAULT_EXTRACT) -> str | None:
    """The response's answer by the first method of ``order`` that finds one; None when none does."""
    for how in order:
        if how == AnswerExtract.boxed:
            found = last_boxed(text)
        elif how == AnswerExtract.answer_is:
            matches = _ANSWER_IS.findall(text)
            found = None
            if matches:
                tail = matches[-1].strip()
                found = last_boxed(tail) or tail.removesuffix(".").strip()
        else:
            numbers = _NUMBER.findall(text)
            found = numbers[-1] if numbers else None
        if found:
            return found[:MAX_ANSWER_CHARS + 1]
    return None


def reference_answer(value: Any) -> str | None:
    """A reference column's answer: after ``####``, else its last ``\\boxed{}``, else all of it."""
    if value is None or isinstance(value, bool):
        return None
    text = str(value).strip()
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        text = tail.splitlines()[0].strip() if tail else ""
    else:
        text = last_boxed(text) or text
    return text or None


def plain_number(text: str) -> Fraction | None:
    """``text`` as an exact number when it is a plain one (thousands commas, a currency sign,
    spaces and a trailing full stop allowed); None for anything else."""
    s = text.strip()
    for piece in _DROP:
        s = s.replace(piece, "")
    s = s.removesuffix(".")
    if _FRACTION.fullmatch(s):
        num, den = s.split("/")
        return Fraction(int(num), int(den)) if int(den) else None
    if _PLAIN.fullmatch(s):
        return Fraction(s.replace(",", ""))
    return None


def field_value(columns: Mapping[str, Sequence[Any]], name: str, i: int) -> Any:
    """Completion ``i``'s value of column ``name``; ``a.b`` reads key ``b`` of column ``a`` (a
    nested column arrives as a JSON string)."""
    head, _, rest = name.partition(".")
    values = columns.get(head)
    value = values[i] if values is not None and i < len(values) else None
    for key in rest.split(".") if rest else ():
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                return None
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


class MathReward:
    """The ``math`` reward (see the module docstring). Batched: one call per batch, the answers
    needing math-verify compared in one child process, one at a time."""

    def __init__(self, extract: Sequence[str] = tuple(DEFAULT_EXTRACT), reference_fields: Sequence[str] = DEFAULT_REFERENCE_FIELDS,
                 timeout_s: float = 5.0, verifier: str = DEFAULT_VERIFIER) -> None:
        try:
            self.extract = [AnswerExtract(e) for e in extract]
        except ValueError:
            raise ConfigError(f"reward.functions.math.extract={list(extract)} may hold only "
                              f"{', '.join(e.value for e in AnswerExtract)} (tried in that order)") from None
        if not self.extract or not reference_fields or not 0 < float(timeout_s) < float("inf"):
            raise ConfigError("reward.functions.math needs at least one extract method, at least one reference field "
                              f"and timeout_s > 0 seconds, got {list(extract)}, {list(reference_fields)}, {timeout_s}")
        self.reference_fields = list(reference_fields)
        if verifier == DEFAULT_VERIFIER:
            self.check_at_start({})
        self.pool = VerifierPool(verifier, float(timeout_s))
        try:
            self.pool.warm()
        except RuntimeError as exc:
            raise ConfigError(f"reward.functions.math.verifier={verifier!r}: {exc}") from None
        self.reasons = ReasonCounts()

    @staticmethod
    def check_at_start(spec: Mapping[str, Any]) -> None:
        """``rlhf-run``'s check before anything starts: math-verify is installed."""
        if spec.get("verifier", DEFAULT_VERIFIER) == DEFAULT_VERIFIER and importlib.util.find_spec("math_verify") is None:
            raise ConfigError("reward=math needs math-verify, which is not installed: pip install 'rlhf-service[math]' "
                              "(or pip install 'math-verify[antlr4_9_3]', the ANTLR runtime Hydra uses)")

    def counters(self) -> dict[str, int]:
        return self.reasons.counters()

    def close(self) -> None:
        self.pool.close()

    def __call__(self, completions: Sequence[Any], **columns: Any) -> list[float | Exception]:
        outcomes: list[MathOutcome | None] = [None] * len(completions)
        out: list[float | Exception] = [0.0] * len(completions)
        ask: list[tuple[int, str, str]] = []  # (completion, reference, answer) for math-verify
        for i, completion in enumerate(completions):
            gold = next((r for f in self.reference_fields if (r := reference_answer(field_value(columns, f, i)))), None)
            answer = extract_answer(completion_text(completion), self.extract)
            if gold is None:
                outcomes[i] = MathOutcome.no_reference
                out[i] = ValueError(f"the row has no reference answer in {', '.join(self.reference_fields)} "
                                    "(reward.functions.math.reference_fields)")
            elif answer is None:
                outcomes[i] = MathOutcome.no_answer
            elif len(answer) > MAX_ANSWER_CHARS:
                outcomes[i] = MathOutcome.unparsed
            elif (a := plain_number(answer)) is not None and (g := plain_number(gold)) is not None:
                outcomes[i] = MathOutcome.correct if a == g else MathOutcome.wrong
            else:
                ask.append((i, gold, answer))
        for (i, _, _), (result, _) in zip(ask, self.pool.verify_all([(g, a) for _, g, a in ask])):
            outcomes[i] = MathOutcome(result)
        for i, outcome in enumerate(outcomes):
            if outcome == MathOutcome.correct:
                out[i] = 1.0
        self.reasons.add(o.value for o in outcomes if o is not None)
        return out

