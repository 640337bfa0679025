"""The gateway's HTTP endpoints, each parsing its request, routing its calls, formatting the answer
(a reply's text, tool calls and finish reason: :class:`Replies`): OpenAI's ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/models``; the gateway's own ``/v1/rl/sessions/{id}/reward`` and
``/v1/rl/stats``; ``/health``.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway.openai_api import AUTH, RETRY_AFTER_S, ApiError, Sampling, bad, normal_message, parse_chat, parse_completion, parse_json, response, retry_later, sse, usage
from gateway.routing import REDIS_DOWN, CallRouter, Choice, ClientGone
from gateway.sessions import MAX_ID_CHARS, Session, Sessions
from gateway.settlement import RewardSettlement, parse_reward
from rlhf_core.config import Config, ConfigError
from rlhf_core.tool_calls import HERMES_CLOSE, HERMES_OPEN, ToolCallParser

SESSION_HEADER = "x-session-id"
GROUP_HEADER = "x-group-id"
RECEIVED = "rlhf.received"  # request.scope key: when the request reached the gateway (time.time())


def api_keys(cfg: Config) -> list[bytes]:
    keys = [str(k) for k in cfg.gateway.api_keys]
    if cfg.gateway.api_key_file:
        path = Path(cfg.gateway.api_key_file).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"gateway.api_key_file={path}: cannot read it ({exc.strerror})") from None
        keys += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    if any(len(k) < 16 for k in keys):
        raise ConfigError("gateway API keys must be at least 16 characters (e.g. `openssl rand -hex 24`)")
    return [k.encode() for k in keys]


def redis_down(exc: BaseException) -> ApiError:
    return retry_later(f"the run's Redis did not answer ({type(exc).__name__}); retry shortly", "unavailable")


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
        tokens = self.tokenizer.convert_ids_to_tokens(c.final.token_ids)
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                            for t, lp in zip(tokens, c.final.logprobs)]}

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


class Handlers:
    """The endpoints over one gateway's sessions, call router and reward settlement."""

    def __init__(self, cfg: Config, model_name: str, keys_allowed: list[bytes], tokenizer: Any, sessions: Sessions,
                 router: CallRouter, settlement: RewardSettlement, counts: Callable[[], dict[str, Any]],
                 started: float) -> None:
        self.cfg, self.model_name, self.keys_allowed, self.started = cfg, model_name, keys_allowed, started
        self.sessions, self.router, self.settlement, self.counts = sessions, router, settlement, counts
        self.replies = Replies(tokenizer)

    async def body(self, request: Request) -> bytes:
        self.authorize(request)
        cap = self.cfg.gateway.max_request_bytes
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > cap:
            raise ApiError(413, f"the request has {size} bytes, over gateway.max_request_bytes={cap}", code="request_too_large")
        data = bytearray()
        try:
            async for part in request.stream():
                data += part
                if len(data) > cap:
                    raise ApiError(413, f"the request is over gateway.max_request_bytes={cap}", code="request_too_large")
        except ClientDisconnect:
            raise ClientGone() from None
        return bytes(data)

    def authorize(self, request: Request) -> None:
        if not self.keys_allowed:
            return
        header = request.headers.get("authorization", "")
        given = header[7:].strip().encode() if header[:7].lower() == "bearer " else b""
        ok = False
        for key in self.keys_allowed:  # every key compared, in constant time each
            ok |= hmac.compare_digest(given, key)
        if not ok:
            raise ApiError(401, "missing or wrong API key: send Authorization: Bearer <key> with a key of "
                                "gateway.api_keys / gateway.api_key_file", AUTH, "invalid_api_key")

    def session_of(self, request: Request, user: str | None) -> tuple[str, str | None]:
        sid = request.headers.get(SESSION_HEADER) or user or f"s-{uuid.uuid4().hex}"
        group = request.headers.get(GROUP_HEADER) or None
        if len(sid) > MAX_ID_CHARS:
            raise bad(f"a session id is at most {MAX_ID_CHARS} characters", "X-Session-Id")
        if group is not None and len(group) > MAX_ID_CHARS:
            raise bad(f"a group id is at most {MAX_ID_CHARS} characters", "X-Group-Id")
        return sid, group

    async def _begin(self, request: Request, user: str | None, sampling: Sampling,
                     context: Callable[[Session], list[int]]) -> tuple[str, list[Choice]]:
        """Open the call's sessions, render their contexts (``context(session)``), make the calls;
        the sessions are put back as they were if anything here fails."""
        sid, group = self.session_of(request, user)
        await self.router.need_worker()  # first: no await between the sessions' busy check and marking them busy
        n = sampling.n
        names = [sid] if n == 1 else [f"{sid}/{i}" for i in range(n)]
        group = group if n == 1 else (group or sid)
        sessions = [self.sessions.open(name, group) for name in names]
        snaps = [self.sessions.snapshot(s) for s in sessions]
        try:
            choices = self.router.make_calls(sessions, context, sampling)
        except Exception:
            for s, snap in zip(sessions, snaps):
                self.sessions.restore(s, snap)
            raise
        for c, snap in zip(choices, snaps):
            c.snapshot, c.session.busy = snap, True
        self.sessions.counters.calls += 1
        return sid, choices

    def _record(self, c: Choice) -> None:
        assert c.final is not None
        f = c.final
        self.sessions.record(c.session, f.token_ids, f.logprobs, f.versions, self.replies.text(f.token_ids),
                             f.finish_reason or "stop")

    def _settle(self, choices: list[Choice], ok: bool) -> None:
        for c in choices:
            c.session.busy = False
            if not ok:
                self.sessions.restore(c.session, c.snapshot)
        if not ok:
            self.sessions.counters.calls_failed += 1

    async def chat(self, request: Request) -> Response:
        req = parse_chat(parse_json(await self.body(request)), self.model_name, self.cfg.gateway.max_tokens,
                         self.cfg.gateway.max_n)
        sessions, replies = self.sessions, self.replies
        sid, choices = await self._begin(request, req.user, req.sampling,
                                         lambda s: sessions.chat_context(s, req.messages, req.tools))
        tools = bool(req.tools) and req.tool_choice != "none"
        cid, created = f"chatcmpl-{choices[0].call.call_id}", int(time.time())

        def done(c: Choice) -> tuple[str, list[dict[str, Any]], str, dict[str, Any]]:
            """A finished choice: its content, tool calls, finish reason and message, recorded in its session."""
            text, calls, reason = replies.finish(c, req.sampling.stop, tools)
            message: dict[str, Any] = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
            self._record(c)
            c.session.expected = [*req.messages, normal_message(message)]
            return text, calls, reason, message

        def logprobs(c: Choice) -> dict[str, Any] | None:
            return replies.chat_logprobs(c) if req.sampling.logprobs else None

        if not req.sampling.stream:
            def answer(c: Choice) -> dict[str, Any]:
                _, _, reason, message = done(c)
                return {"index": c.index, "message": message, "finish_reason": reason, "logprobs": logprobs(c)}

            return await self._gather(choices, request, answer, "chat.completion", cid, sid)

        def chunk(index: int, delta: dict[str, Any], reason: str | None = None, lp: Any = None) -> bytes:
            return sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                        "choices": [{"index": index, "delta": delta, "finish_reason": reason, "logprobs": lp}]})

        def final(c: Choice) -> bytes:
            sent = c.sent_chars  # what streamed before the end; the rest (or all, with tools) goes now
            text, calls, reason, _ = done(c)
            delta: dict[str, Any] = {"content": text[sent:]} if len(text) > sent else {}
            if calls:
                delta["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(calls)]
            return chunk(c.index, delta, reason, logprobs(c))

        def part(c: Choice, token_ids: list[int]) -> bytes | None:
            if tools:  # content is sent with the calls at the end, once they are parsed out of it
                c.tokens += token_ids
                return None
            piece = replies.stream_text(c, token_ids, req.sampling.stop)
            return chunk(c.index, {"content": piece}) if piece else None

        opening = [chunk(c.index, {"role": "assistant", "content": ""}) for c in choices]
        events = self._sse(choices, req.sampling, cid, created, "chat.completion.chunk", opening, final, part)
        return StreamingResponse(events, media_type="text/event-stream", headers={"X-Session-Id": sid})

    async def completions(self, request: Request) -> Response:
        req = parse_completion(parse_json(await self.body(request)), self.model_name, self.cfg.gateway.max_tokens,
                               self.cfg.gateway.max_n)
        sessions, replies = self.sessions, self.replies
        if isinstance(req.prompt, list) and (min(req.prompt) < 0 or max(req.prompt) >= len(replies.tokenizer)):
            raise bad(f"prompt token ids must lie in [0, {len(replies.tokenizer)})", "prompt")
        sid, choices = await self._begin(request, req.user, req.sampling,
                                         lambda s: sessions.completion_context(s, req.prompt))
        cid, created = f"cmpl-{choices[0].call.call_id}", int(time.time())

        def done(c: Choice) -> tuple[str, str]:
            """A finished choice: its text and finish reason, recorded in its session."""
            assert c.final is not None
            text, _, reason = replies.finish(c, req.sampling.stop, False)
            self._record(c)
            sessions.completed(c.session, replies.text(c.final.token_ids), text)
            return text, reason

        if not req.sampling.stream:
            def answer(c: Choice) -> dict[str, Any]:
                text, reason = done(c)
                lp = replies.completion_logprobs(c) if req.sampling.logprobs else None
                return {"index": c.index, "text": text, "finish_reason": reason, "logprobs": lp}

            return await self._gather(choices, request, answer, "text_completion", cid, sid)

        def chunk(index: int, text: str, reason: str | None = None) -> bytes:
            return sse({"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                        "choices": [{"index": index, "text": text, "finish_reason": reason, "logprobs": None}]})

        def final(c: Choice) -> bytes:
            sent = c.sent_chars
            text, reason = done(c)
            return chunk(c.index, text[sent:], reason)

        def part(c: Choice, token_ids: list[int]) -> bytes | None:
            piece = replies.stream_text(c, token_ids, req.sampling.stop)
            return chunk(c.index, piece) if piece else None

        events = self._sse(choices, req.sampling, cid, created, "text_completion", [], final, part)
        return StreamingResponse(events, media_type="text/event-stream", headers={"X-Session-Id": sid})

    async def _gather(self, choices: list[Choice], request: Request, answer: Callable[[Choice], dict[str, Any]],
                      kind: str, cid: str, sid: str) -> Response:
        """A plain call: wait for every choice, then ``answer`` each, in a response of ``kind``.
        The sessions are settled either way."""
        ok = False
        try:
            async for _ in self.router.run(choices, request.scope.get(RECEIVED), request.is_disconnected):
                pass
            if (err := failed(choices)) is not None:
                raise err
            out = [answer(c) for c in choices]
            ok = True
            return JSONResponse(response(kind, cid, self.model_name, out, *token_counts(choices)),
                                headers={"X-Session-Id": sid})
        finally:
            self._settle(choices, ok)

    async def _sse(self, choices: list[Choice], sampling: Sampling, cid: str, created: int, kind: str,
                   opening: list[bytes], final: Callable[[Choice], bytes],
                   part: Callable[[Choice, list[int]], bytes | None]) -> AsyncIterator[bytes]:
        """A streamed call as server-sent events: ``opening``, then ``part`` of each chunk of tokens
        and ``final`` of each finished choice, the usage when asked, ``[DONE]``. An error becomes
        an error event; the sessions are settled either way."""
        ok = False
        try:
            for event in opening:
                yield event
            # closed on the way out, before the sessions are settled (left to the garbage collector,
            # its drift check would still run on a conversation put back)
            async with contextlib.aclosing(self.router.run(choices)) as chunks:
                async for c, got in chunks:
                    if not got.final:
                        if (piece := part(c, got.token_ids)) is not None:
                            yield piece
                        continue
                    if (err := failed([c])) is not None:
                        yield self._error_event(err)
                        return
                    yield final(c)
            ok = True
            if sampling.include_usage:
                yield sse({"id": cid, "object": kind, "created": created, "model": self.model_name, "choices": [],
                           "usage": usage(*token_counts(choices))})
            yield sse("[DONE]")
        except ApiError as exc:
            yield self._error_event(exc)
        except REDIS_DOWN as exc:
            yield self._error_event(redis_down(exc))
        finally:
            self._settle(choices, ok)

    def _error_event(self, err: ApiError) -> bytes:
        """A streamed call's error, as its last event (the stream had begun: status 200)."""
        self.count_error(err.code)
        return sse(err.body())

    def count_error(self, code: str | None) -> None:
        self.sessions.counters.errors[code or "error"] += 1

    async def reward(self, request: Request) -> Response:
        post = parse_reward(parse_json(await self.body(request)), self.settlement.component_names)
        sid = request.path_params["session_id"]
        rewarded, samples, why = await self.settlement.settle(sid, post)
        status = "filtered" if why else "appended" if samples else "waiting_for_group"
        return JSONResponse({"session": sid, "group": rewarded.group, "reward": post.total, "status": status,
                             "samples": samples})

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                         "created": int(self.started), "owned_by": "rlhf-service"}]})

    async def health(self, request: Request) -> Response:
        assert self.router.workers is not None
        workers, status = None, "channel_lost"  # not subscribed: Redis is likely away too, not asked
        if self.router.channel_up:
            try:
                workers = await self.router.workers.count()
                status = "ok" if workers else "no_worker"
            except REDIS_DOWN:
                status = "unavailable"
        body = {"status": status, "workers": workers, "model": self.model_name}
        return JSONResponse(body, status_code=200 if status == "ok" else 503,
                            headers={} if status == "ok" else {"Retry-After": str(RETRY_AFTER_S)})

    async def stats(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse({**self.counts(), "call_phases_s": self.router.phases.as_dict()})
