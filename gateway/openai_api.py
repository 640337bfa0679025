"""The OpenAI wire shapes the gateway speaks: request checks, responses, stream chunks, errors.

Only what an OpenAI client sends and reads is modelled; unknown request fields are ignored
(clients send many, e.g. ``frequency_penalty: 0``). A field the gateway cannot honour with a
value that would change the result (``logit_bias``, ``response_format`` other than text, ``echo``,
``best_of`` > 1) is refused rather than silently ignored.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the error types of OpenAI's error body
INVALID = "invalid_request_error"
AUTH = "authentication_error"
NOT_FOUND = "not_found_error"
CONFLICT = "conflict_error"
UNAVAILABLE = "service_unavailable"
#: the seconds a 503's ``Retry-After`` asks a client to wait
RETRY_AFTER_S = 2


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "code", "param"}}`` with ``status``."""

    def __init__(self, status: int, message: str, type_: str = INVALID, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def served_name(cfg: Any) -> str:
    """The model id clients send (and ``GET /v1/models`` lists): ``gateway.model_name``, else
    ``model.path``'s last folder, else ``model.name``."""
    if cfg.gateway.model_name:
        return str(cfg.gateway.model_name)
    return Path(str(cfg.model.path)).name if cfg.model.path else str(cfg.model.name)


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, INVALID, code, param)


def retry_later(message: str, code: str) -> ApiError:
    """503 with ``Retry-After``: the service cannot serve the request now; the same request may succeed later."""
    return ApiError(503, message, UNAVAILABLE, code, headers={"Retry-After": str(RETRY_AFTER_S)})


@dataclass
class Sampling:
    """What a call asks of the sampler, after the caps."""

    n: int
    max_tokens: int | None  # None: the gateway's default
    temperature: float
    top_p: float
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: bool


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    sampling: Sampling
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    user: str | None = None


@dataclass
class CompletionRequest:
    model: str
    prompt: str | list[int]
    sampling: Sampling
    user: str | None = None


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, or more digits or nesting than Python reads
        raise bad(f"the request body is not valid JSON ({exc}); send a JSON object", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise bad(f"the request body must be a JSON object, got {type(obj).__name__}", code="invalid_json")
    return obj


def finite(value: Any) -> bool:
    """A JSON number that is a finite float (not a bool, not an integer too large for a float)."""
    try:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:
        return False


def _number(obj: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = obj.get(name)
    if value is None:
        return default
    if not finite(value) or not low <= value <= high:
        raise bad(f"'{name}' must be a number in [{low}, {high}], got {value!r}", name)
    return float(value)


def _int(obj: dict[str, Any], name: str, cap: int, what: str) -> int | None:
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad(f"'{name}' must be an integer >= 1, got {value!r}", name)
    if value > cap:
        raise bad(f"'{name}' is {value}, over this gateway's cap of {cap} ({what})", name, "over_cap")
    return value


def parse_sampling(obj: dict[str, Any], max_tokens_cap: int, n_cap: int) -> Sampling:
    for name in ("logit_bias", "functions"):
        if obj.get(name):
            raise bad(f"'{name}' is not supported by this gateway (the policy's own distribution is what it trains on)", name,
                      "unsupported")
    fmt = obj.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("'response_format' other than {\"type\": \"text\"} is not supported", "response_format", "unsupported")
    if obj.get("echo") or (obj.get("best_of") not in (None, 1)):
        raise bad("'echo' and 'best_of' > 1 are not supported", "echo", "unsupported")
    tokens = _int(obj, "max_completion_tokens", max_tokens_cap, "gateway.max_tokens") or \
        _int(obj, "max_tokens", max_tokens_cap, "gateway.max_tokens")
    stop = obj.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise bad(f"'stop' must be a string or a list of at most 4 strings, got {stop!r}", "stop")
    if any(s == "" for s in stops):
        raise bad("'stop' must not contain the empty string", "stop")
    options = obj.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    lp = obj.get("logprobs")
    return Sampling(n=_int(obj, "n", n_cap, "gateway.max_n") or 1, max_tokens=tokens,
                    temperature=_number(obj, "temperature", 1.0, 0.0, 2.0), top_p=_number(obj, "top_p", 1.0, 1e-9, 1.0),
                    stop=stops, stream=bool(obj.get("stream")), include_usage=bool(options.get("include_usage")),
                    logprobs=bool(lp) if not isinstance(lp, int) or isinstance(lp, bool) else lp > 0)


def _check_model(obj: dict[str, Any], served: str) -> str:
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required: the id GET /v1/models lists", "model", "missing_model")
    if model != served:
        raise ApiError(400, f"model '{model}' is not served here; this gateway serves '{served}' (GET /v1/models)",
                       INVALID, "model_not_found", "model")
    return model


def _user(obj: dict[str, Any]) -> str | None:
    user = obj.get("user")
    return user if isinstance(user, str) and user else None


def parse_chat(obj: dict[str, Any], served: str, max_tokens_cap: int, n_cap: int) -> ChatRequest:
    model = _check_model(obj, served)
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"messages[{i}] needs a 'role' of system, developer, user, assistant or tool", f"messages[{i}]")
        content = m.get("content")
        if not (content is None or isinstance(content, str) or isinstance(content, list)):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) and isinstance(
                c.get("function"), dict) for c in calls)):
            raise bad(f"messages[{i}].tool_calls must be a list of {{\"id\", \"type\": \"function\", \"function\": "
                      "{\"name\", \"arguments\"}} objects, as the gateway returned them", f"messages[{i}].tool_calls")
    tools = obj.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise bad("'tools' must be a list of tool objects", "tools")
    return ChatRequest(model, [normal_message(m) for m in messages], parse_sampling(obj, max_tokens_cap, n_cap),
                       tools or None, obj.get("tool_choice"), _user(obj))


def parse_completion(obj: dict[str, Any], served: str, max_tokens_cap: int, n_cap: int) -> CompletionRequest:
    model = _check_model(obj, served)
    prompt = obj.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        pass
    elif not isinstance(prompt, str) or not prompt:
        raise bad("'prompt' must be a non-empty string (or one list of token ids); batches of prompts are not supported",
                  "prompt")
    return CompletionRequest(model, prompt, parse_sampling(obj, max_tokens_cap, n_cap), _user(obj))


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))


def normal_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message as the chat template gets it and as sessions compare it: role, content as text,
    tool calls as ``{"id", "type", "function": {"name", "arguments" (an object)}}``, tool call id
    (their shape checked by :func:`parse_chat`)."""
    out: dict[str, Any] = {"role": m["role"], "content": _text(m.get("content"))}
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c["function"]
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):  # not JSON, or more digits or nesting than Python reads: kept as text
                pass
        calls.append({"id": c.get("id", ""), "type": "function",
                      "function": {"name": fn.get("name", ""), "arguments": args}})
    if calls:
        out["tool_calls"] = calls
    if m.get("tool_call_id"):
        out["tool_call_id"] = str(m["tool_call_id"])
    if m.get("name"):
        out["name"] = str(m["name"])
    return out


def response(kind: str, call_id: str, model: str, choices: list[dict[str, Any]], prompt_tokens: int,
             completion_tokens: int) -> dict[str, Any]:
    """A plain call's answer; ``kind``: ``chat.completion`` or ``text_completion``."""
    return {"id": call_id, "object": kind, "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: dict[str, Any] | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
