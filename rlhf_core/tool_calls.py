"""Reading the tool calls a policy turn wrote. Never raises: a call it cannot read becomes an
error message for the environment, never a crash.

The format, the first that applies: the tokenizer's ``response_template``
(``tokenizer.parse_response``); the Hermes / Qwen ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` when the chat template writes ``<tool_call>``; the environment's
``tool_call_pattern`` (group 1, or the whole match, holds the call's JSON); else none. A call's
JSON is ``{"name": str, "arguments": object}`` (``arguments`` may be a JSON string, as OpenAI
sends it; ``parameters`` is accepted for ``arguments``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.DOTALL)
#: longest excerpt of an unreadable call quoted back to the environment
QUOTE_CHARS = 200


@dataclass
class ToolCall:
    """One call the policy wrote: ``name`` and ``arguments`` as parsed, ``text`` as written."""

    name: str
    arguments: dict[str, Any]
    text: str = ""


def _quote(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "...")


def call_from_json(body: str, index: int) -> ToolCall | str:
    """One call from its JSON text, or the message saying why it cannot be read."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"tool call {index} is not valid JSON ({exc.msg} at character {exc.pos}): {_quote(body)}"
    return call_from_object(obj, index, body)


def call_from_object(obj: Any, index: int, text: str = "") -> ToolCall | str:
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):  # OpenAI's {"type": "function", "function": {...}}
        obj = obj["function"]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return f'tool call {index} needs {{"name": "<tool>", "arguments": {{...}}}}, got {_quote(text or str(obj))}'
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        written = args
        try:
            args = json.loads(written) if written.strip() else {}
        except json.JSONDecodeError as exc:
            return f"tool call {index} ({obj['name']}): its arguments are not valid JSON ({exc.msg}): {_quote(written)}"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"tool call {index} ({obj['name']}): arguments must be an object, got {type(args).__name__}"
    return ToolCall(obj["name"], args, text)


class ToolCallParser:
    """Parses tool calls in the format the tokenizer's ``response_template`` or ``chat_template``
    defines, else the environment's ``pattern``; ``tools`` serve ``parse_response``'s argument casting."""

    def __init__(self, tokenizer: Any, pattern: str | None = None, tools: Sequence[dict] | None = None) -> None:
        self.tokenizer, self.tools = tokenizer, list(tools) if tools else None
        template = getattr(tokenizer, "chat_template", None)
        template_text = template if isinstance(template, str) else " ".join(map(str, (template or {}).values())) \
            if isinstance(template, dict) else ""
        if getattr(tokenizer, "response_template", None):
            self.format = "response_template"
        elif HERMES_OPEN in template_text:
            self.format = "hermes"
        elif pattern:
            self.format = "pattern"
        else:
            self.format = "none"
        self.pattern = re.compile(pattern, re.DOTALL) if pattern else None

    def parse(self, text: str, prefix: str = "") -> tuple[list[ToolCall], list[str]]:
        """``(calls, errors)`` in ``text`` (the turn decoded with its special tokens); ``prefix``:
        the context before the turn (``parse_response`` needs it). Never raises."""
        try:
            if self.format == "response_template":
                return self._parse_template(text, prefix)
            if self.format == "hermes":
                return self._parse_hermes(text)
            if self.format == "pattern":
                return self._parse_pattern(text)
        except Exception as exc:  # noqa: BLE001  # a parser bug or odd input must not end the worker
            return [], [f"the tool calls could not be parsed ({type(exc).__name__}: {exc})"]
        return [], []

    def _split(self, found: list[ToolCall | str]) -> tuple[list[ToolCall], list[str]]:
        return [c for c in found if isinstance(c, ToolCall)], [e for e in found if isinstance(e, str)]

    def _parse_hermes(self, text: str) -> tuple[list[ToolCall], list[str]]:
        found: list[ToolCall | str] = [call_from_json(m.group(1), i) for i, m in enumerate(_HERMES.finditer(text))]
        tail = text[text.rfind(HERMES_CLOSE) + len(HERMES_CLOSE):] if HERMES_CLOSE in text else text
        if HERMES_OPEN in tail:  # opened and never closed (cut by the length limit, or forgotten)
            body = tail[tail.index(HERMES_OPEN) + len(HERMES_OPEN):]
            found.append(f"tool call {len(found)} has no closing {HERMES_CLOSE}: {_quote(body)}")
        return self._split(found)

    def _parse_pattern(self, text: str) -> tuple[list[ToolCall], list[str]]:
        assert self.pattern is not None
        return self._split([call_from_json(m.group(1) if m.groups() else m.group(0), i)
                            for i, m in enumerate(self.pattern.finditer(text))])

    def _parse_template(self, text: str, prefix: str) -> tuple[list[ToolCall], list[str]]:
        message = self.tokenizer.parse_response(text, prefix=prefix, tools=self.tools)
        calls = message.get("tool_calls") or [] if isinstance(message, dict) else []
        return self._split([call_from_object(c, i, json.dumps(c, default=str)) for i, c in enumerate(calls)])
