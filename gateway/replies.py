"""A call's reply: the tokens a worker sampled as the text, tool calls and finish reason a client reads."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from gateway.openai_api import ApiError, bad, logprobs_content, retry_later
from gateway.routing import Choice
from rlhf_core.tool_calls import HERMES_CLOSE, HERMES_OPEN, ToolCallParser

_TOOL_BLOCK = re.compile(re.escape(HERMES_OPEN) + r".*?(" + re.escape(HERMES_CLOSE) + r"|$)", re.DOTALL)


class Replies:
    """The choices' tokens as text, through the served model's tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.parser = tokenizer, ToolCallParser(tokenizer)

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def finish(self, c: Choice, stops: list[str], tools: bool) -> tuple[str, list[dict[str, Any]], str]:
        """The returned content (stop string and tool-call blocks cut), tool calls, finish reason."""
        assert c.final is not None
        text = self.text(c.final.token_ids)
        reason = "length" if c.final.finish_reason == "length" else "stop"
        if reason == "stop" and stops:
            cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            text = text[:cut] if cut >= 0 else text
        calls: list[dict[str, Any]] = []
        if tools:
            found, _errors = self.parser.parse(self.tokenizer.decode(c.final.token_ids, skip_special_tokens=False))
            calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": f.name, "arguments": json.dumps(f.arguments)}} for f in found]
            if calls:
                text, reason = _TOOL_BLOCK.sub("", text).strip(), "tool_calls"
        return text, calls, reason

    def stream_text(self, c: Choice, tokens: list[int], stops: list[str]) -> str:
        """The new text of a streamed choice that can be sent now: not what could still become a
        stop string (cut from the reply), not a character whose bytes are incomplete."""
        c.tokens += tokens
        text = self.text(c.tokens)
        safe = len(text) - max(len(x) for x in stops) + 1 if stops else len(text)
        if text.endswith("\ufffd"):
            safe = min(safe, len(text) - 1)
        if safe <= c.sent_chars:
            return ""
        piece, c.sent_chars = text[c.sent_chars:safe], safe
        return piece

    def chat_logprobs(self, c: Choice) -> dict[str, Any]:
        assert c.final is not None
        return logprobs_content(self.tokenizer.convert_ids_to_tokens(c.final.token_ids), c.final.logprobs)

    def completion_logprobs(self, c: Choice) -> dict[str, Any]:
        assert c.final is not None
        return {"tokens": self.tokenizer.convert_ids_to_tokens(c.final.token_ids), "token_logprobs": c.final.logprobs,
                "top_logprobs": None, "text_offset": None}


def failed(choices: list[Choice]) -> ApiError | None:
    """The error of the first choice a worker could not finish (None: none)."""
    for c in choices:
        if c.final is not None and c.final.error:
            return bad(f"the worker could not run the call: {c.final.error}", "messages", "context_length_exceeded")
        if c.final is not None and c.final.finish_reason == "abort":
            return retry_later("the worker serving the call stopped before it finished; retry", "worker_stopped")
    return None


def token_counts(choices: list[Choice]) -> tuple[int, int]:
    """(prompt, completion) tokens of a call: its prompt once, every finished choice's reply."""
    return len(choices[0].call.prompt_ids), sum(len(c.final.token_ids) for c in choices if c.final)
