"""A remote reward: an LLM judge behind an OpenAI-compatible chat API (``POST .../chat/completions``).

``conf/reward/judge.yaml``; a batched reward function (TRL's signature) whose requests go out at
once, up to ``concurrency``::

    rlhf-run reward=judge reward.functions.judge.url=http://127.0.0.1:8000/v1 \\
        reward.functions.judge.model=Qwen2.5-7B-Instruct

Options: ``model`` (the server's model name; null: left out of the request); ``template``, the
user turn (after ``system``, if given): ``{prompt}`` the question (a chat prompt's last user turn),
``{response}`` the completion, any data column such as ``{reference}``; the reward is the first
number of the reply (``pattern``; its first group when it has one) times ``scale``. Connection
errors, timeouts (``timeout_s`` per request) and HTTP 408, 409, 429 and 5xx but 501 and 505 are
retried ``max_retries`` times, backing off from ``backoff_s`` doubling up to ``max_backoff_s`` (a
``Retry-After`` is waited for, up to it). The key: ``api_key`` or, better, the environment variable
``api_key_env``. A completion whose judging fails gets a :class:`JudgeError` in place of its number
(that sample alone is dead-lettered). ``reward.timeout_s`` limits a whole batch: see
``conf/reward/judge.yaml``. docs/architecture.md (Rollout workers: Rewards) says the rest.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

MAX_REPLY_BYTES = 1 << 20
RETRY_STATUS = frozenset({408, 409, 429})  # and every 5xx but FINAL_5XX
FINAL_5XX = frozenset({501, 505})  # Not Implemented, HTTP Version Not Supported: a retry cannot change them
RETRY_AFTER_STATUS = frozenset({429, 503})
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
DEFAULT_TEMPLATE = (
    "Rate how well the answer responds to the question, from 0 (useless) to 10 (perfect).\n\n"
    "Question:\n{prompt}\n\nAnswer:\n{response}\n\nReply with the number only."
)


class JudgeError(Exception):
    """One completion could not be judged (the message says why and what to check)."""


class ChatJudge:
    """An LLM judge as a batched reward function; see the module docstring for every option."""

    def __init__(self, url: str, model: str | None = None, template: str = DEFAULT_TEMPLATE, system: str | None = None,
                 api_key: str | None = None, api_key_env: str | None = None, timeout_s: float = 30.0,
                 max_retries: int = 2, backoff_s: float = 0.5, max_backoff_s: float = 8.0, concurrency: int = 8,
                 temperature: float = 0.0, max_tokens: int = 16, pattern: str = r"[-+]?\d+(?:\.\d+)?",
                 scale: float = 1.0) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"url must be http(s)://host[:port]/v1 (the API's base) or the full .../chat/completions "
                             f"address, got {url!r}")
        path = parsed.path.rstrip("/")
        self.endpoint = url.rstrip("/") if path.endswith("/chat/completions") else url.rstrip("/") + "/chat/completions"
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0 or concurrency < 1:
            raise ValueError(f"need timeout_s > 0, max_retries >= 0, backoff_s >= 0 and concurrency >= 1, got "
                             f"{timeout_s}, {max_retries}, {backoff_s}, {concurrency}")
        if api_key_env and not api_key:
            api_key = os.environ.get(api_key_env)
            if not api_key:
                raise ValueError(f"api_key_env={api_key_env!r} names an environment variable that is not set: export "
                                 "it in the worker's environment, or leave api_key_env out for a server without keys")
        self.model, self.template, self.system = model, template, system
        self.timeout_s, self.max_retries = float(timeout_s), int(max_retries)
        self.backoff_s, self.max_backoff_s = float(backoff_s), float(max_backoff_s)
        self.temperature, self.max_tokens, self.scale = float(temperature), int(max_tokens), float(scale)
        self.pattern = re.compile(pattern)
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        # a judge on this machine must not be sent through the environment's HTTP proxy
        handlers = [urllib.request.ProxyHandler({})] if parsed.hostname in LOOPBACK else []
        self._opener = urllib.request.build_opener(*handlers)
        self.concurrency = int(concurrency)
        self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="judge")

    def __call__(self, prompts: Sequence[str | list[dict[str, Any]]], completions: Sequence[str | list[dict[str, Any]]],
                 **columns: Any) -> list[float | JudgeError]:
        """TRL's batched signature: a prompt and a completion as text, or as chat turns (TRL's
        conversational form): the question is then the last user turn, the response the last turn."""
        n = len(prompts)
        data = {k: v for k, v in columns.items() if k != "completion_ids" and isinstance(v, list) and len(v) == n}
        rows = [{k: v[i] for k, v in data.items()} for i in range(n)]
        return list(self._pool.map(self.judge, map(_question, prompts), map(_text, completions), rows))

    def judge(self, prompt: str, completion: str, row: dict[str, Any] | None = None) -> float | JudgeError:
        """One completion's score, or the JudgeError that says why there is none."""
        # a column the batch has but this prompt lacks is None: missing here too, never the text "None"
        known = {k: v for k, v in (row or {}).items() if v is not None}
        try:
            text = self.template.format_map({**known, "prompt": prompt, "response": completion})
        except (KeyError, IndexError) as exc:
            return JudgeError(f"the judge's template names {{{exc.args[0]}}}, which this prompt's data does not have "
                              "(placeholders: {prompt}, {response} and the data set's columns)")
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [{"role": "user", "content": text}]
        body = {"model": self.model, "messages": messages, "temperature": self.temperature, "max_tokens": self.max_tokens}
        if self.model is None:  # a server of one model (vLLM's, llama.cpp's) answers with it
            del body["model"]
        try:
            reply = self._post(json.dumps(body).encode())
            return self._score(reply)
        except JudgeError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - fails this completion, never its batch-mates
            return JudgeError(f"judging failed: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ HTTP

    def _post(self, data: bytes) -> bytes:
        last, wait = "", 0.0
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(wait)
            backoff = min(self.backoff_s * 2 ** attempt, self.max_backoff_s)  # before the next attempt
            wait = backoff
            request = urllib.request.Request(self.endpoint, data=data, headers=self.headers, method="POST")
            try:
                with self._opener.open(request, timeout=self.timeout_s) as response:
                    return response.read(MAX_REPLY_BYTES + 1)
            except urllib.error.HTTPError as exc:
                try:  # the body of an error reply can stall or break like any other read
                    last = f"HTTP {exc.code} {exc.reason}: {exc.read(300).decode('utf-8', 'replace').strip()!r}"
                except (OSError, http.client.HTTPException, ValueError) as read_exc:
                    last = f"HTTP {exc.code} {exc.reason} (its body could not be read: {type(read_exc).__name__}: {read_exc})"
                if exc.code in (401, 403):
                    raise JudgeError(f"{self.endpoint} refused the request ({last}): check api_key / api_key_env") from None
                if exc.code not in RETRY_STATUS and not (exc.code >= 500 and exc.code not in FINAL_5XX):
                    raise JudgeError(f"{self.endpoint} answered {last}; check url and model") from None
                if exc.code in RETRY_AFTER_STATUS:
                    wait = min(max(backoff, _retry_after(exc.headers.get("Retry-After") if exc.headers else None)), self.max_backoff_s)
            except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as exc:
                reason = getattr(exc, "reason", exc)
                last = f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__
        raise JudgeError(f"no answer from {self.endpoint} after {self.max_retries + 1} attempt(s) (timeout_s="
                         f"{self.timeout_s:g} each), the last: {last}")

    def _score(self, raw: bytes) -> float:
        if len(raw) > MAX_REPLY_BYTES:
            raise JudgeError(f"the reply from {self.endpoint} is larger than {MAX_REPLY_BYTES} bytes")
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise JudgeError(f"the reply from {self.endpoint} is not a chat completion (choices[0].message.content): "
                             f"{raw[:200]!r}") from None
        if not isinstance(content, str):
            raise JudgeError(f"the reply's choices[0].message.content is {type(content).__name__}, not text")
        match = self.pattern.search(content)
        number = None if match is None else match.group(1 if self.pattern.groups else 0)  # a group that took no part: None
        if number is None:
            raise JudgeError(f"the judge's reply {content[:200]!r} holds no number (pattern {self.pattern.pattern!r})")
        try:
            return float(number) * self.scale
        except ValueError:
            raise JudgeError(f"the judge's reply {content[:200]!r}: {number!r} is not a number") from None


def _text(turns: str | list[dict[str, Any]], role: str | None = None) -> str:
    """Text as it is; of chat turns, the content of the last one (of ``role``, when given)."""
    if isinstance(turns, str):
        return turns
    contents = [t.get("content") for t in turns if isinstance(t, dict) and role in (None, t.get("role"))]
    return contents[-1] if contents and isinstance(contents[-1], str) else ""


def _question(prompt: str | list[dict[str, Any]]) -> str:
    """A text prompt as it is; a chat prompt's last user turn."""
    return _text(prompt, "user")


def _retry_after(value: str | None) -> float:
    """Seconds a ``Retry-After`` header asks for (delay-seconds or an HTTP date); 0 without a usable one."""
    if not value:
        return 0.0
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return 0.0
    return max(0.0, when.timestamp() - time.time()) if when.tzinfo is not None else 0.0
