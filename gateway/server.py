"""``rlhf-gateway``: an OpenAI-compatible HTTP front end whose calls the rollout workers serve.

Starlette under uvicorn, one asyncio loop. A call is rendered (chat template; the session's
context, token in and token out: :mod:`gateway.sessions`), pushed to the run's Redis as a
:class:`~buffer.gateway.GatewayCall`, taken by a worker between decoding steps into its
continuous batch beside the run's own prompts, and answered over this gateway's pub/sub channel
(streamed tokens, then the result with behaviour log-probs and per-token policy versions). One
reader task routes the channel's chunks to the waiting requests. A client that goes away
(disconnect mid-stream, or before a plain call returns) gets its calls cancelled: the worker
aborts them and frees their slots. Design and a user's walk-through: docs/gateway.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import anyio
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from buffer import Buffer
from buffer.connection import client_kwargs
from buffer.gateway import (LIVE_TTL_S, CallChunk, CallQueue, GatewayCall, LiveWorkers, cancel, drop_run, forget_cancel,
                            forget_old_cancels, hold_run)
from gateway.openai_api import (AUTH, CONFLICT, INVALID, NOT_FOUND, UNAVAILABLE, ApiError, bad, chat_response,
                                completion_response, finite, logprobs_content, normal_message, parse_chat,
                                parse_completion, parse_json, served_name, sse, usage)
from gateway.sessions import PLAIN_TEMPLATE, Rewarded, Session, SessionError, Sessions
from rlhf_core import metric_names as M
from rlhf_core.config import Config, ConfigError, response_budget, validate
from rlhf_core.dapo import group_filter
from rlhf_core.errors import UserError
from rlhf_core.models import load_tokenizer, model_dir
from rlhf_core.records import Sample
from rlhf_core.wire import WireError
from rlhf_core.cli import freeze_startup_heap, write_json
from rlhf_core.tool_calls import HERMES_CLOSE, HERMES_OPEN, ToolCallParser

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"
GROUP_HEADER = "x-group-id"
RETRY_AFTER_S = 2
#: distinct reward component names a gateway takes, and their length: each is a learner metric
#: ``reward/<name>`` (and a Prometheus gauge) for the rest of the run
MAX_COMPONENTS = 64
MAX_COMPONENT_CHARS = 64
#: the longest session or group id (a header's, or the reward body's group): it goes into sample ids
MAX_ID_CHARS = 200
#: what the asyncio Redis client raises when Redis is away (the builtin ConnectionError is an OSError)
REDIS_DOWN = (OSError, aioredis.RedisError)
#: what a call's queue gets in place of a chunk when the channel from the workers dropped (Gateway._channel_lost)
LOST: Any = None
RECEIVED = "rlhf.received"  # request.scope key: when the request reached the gateway (time.time())
_TOOL_BLOCK = re.compile(re.escape(HERMES_OPEN) + r".*?(" + re.escape(HERMES_CLOSE) + r"|$)", re.DOTALL)


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


def retry_later(message: str, code: str) -> ApiError:
    """503 with ``Retry-After``: the service cannot serve the request now; the same request may succeed later."""
    return ApiError(503, message, UNAVAILABLE, code, headers={"Retry-After": str(RETRY_AFTER_S)})


def redis_down(exc: BaseException) -> ApiError:
    return retry_later(f"the run's Redis did not answer ({type(exc).__name__}); retry shortly", "unavailable")


class ClientGone(Exception):
    """The client went away while sending its request, or before its plain (not streamed) call
    returned (its calls are cancelled): nobody is left to answer (not a server error: no
    traceback in the log)."""


@dataclass
class _Choice:
    """One choice of a call in flight: its session and what has been streamed of it."""

    index: int
    session: Session
    call: GatewayCall
    snapshot: Any
    tokens: list[int] = field(default_factory=list)
    sent_chars: int = 0
    final: CallChunk | None = None
    worker: str = ""  # the worker that took the call off the list (CallChunk.started; "": none now), and when
    taken_at: float = 0.0  # (its clock; 0: it did not say)


@dataclass
class CallPhases:
    """Where the calls that ran spent their time, summed over them (seconds): ``gateway_in`` from
    the request's arrival until its call is pushed (parsing, the session, the template,
    tokenising, the event loop's queue), ``to_worker`` from there to a worker's engine (the push,
    the worker's taker thread, the decoding step it waited for), ``engine`` in the engine
    (waiting for a slot, prefill, decoding), ``to_gateway`` from the engine's end back to the
    gateway (the worker's sender thread, Redis).
    The middle two compare the worker's clock with the gateway's: across hosts they hold the
    clocks' offset, their sum does not."""

    calls: int = 0
    gateway_in_s: float = 0.0
    to_worker_s: float = 0.0
    engine_s: float = 0.0
    to_gateway_s: float = 0.0

    def add(self, received: float, pushed: float, chunk: CallChunk, arrived: float) -> None:
        if chunk.started_at is None or chunk.finished_at is None:
            return
        self.calls += 1
        self.gateway_in_s += pushed - received
        self.to_worker_s += chunk.started_at - pushed
        self.engine_s += chunk.finished_at - chunk.started_at
        self.to_gateway_s += arrived - chunk.finished_at

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in self.__dict__.items()}


class Gateway:
    """The gateway's state and handlers; :func:`make_app` wraps it in a Starlette app."""

    def __init__(self, cfg: Config, gateway_id: str | None = None) -> None:
        validate(cfg)
        if cfg.buffer.url is None or cfg.buffer.run_id == "auto":
            raise ConfigError("rlhf-gateway needs buffer.url=redis://host:port and buffer.run_id=<the run id rlhf-run "
                              "printed> of the run whose workers serve it")
        self.cfg, g = cfg, cfg.gateway
        self.gateway_id = gateway_id or f"gateway-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.model_name = served_name(cfg)
        self.keys_allowed = api_keys(cfg)
        self.tokenizer = load_tokenizer(cfg.model)
        if g.chat_template:
            self.tokenizer.chat_template = g.chat_template
        elif not getattr(self.tokenizer, "chat_template", None):
            self.tokenizer.chat_template = PLAIN_TEMPLATE
        self.parser = ToolCallParser(self.tokenizer)
        config = json.loads((model_dir(cfg.model) / "config.json").read_text())
        # what the workers' engines hold (rollout.max_prompt_tokens + the response budget), at most the model's
        self.max_context = min(int(config.get("max_position_embeddings") or 1 << 30),
                               int(cfg.rollout.max_prompt_tokens) + response_budget(cfg.rollout))
        self.buffer = Buffer.connect(cfg.buffer.url, cfg.buffer.run_id, cfg.buffer)
        self.keys = self.buffer.keys
        self.sessions: Sessions | None = None
        self.redis: Any = None
        self.calls: CallQueue | None = None  # set in start(), with the async client
        self.pending: dict[str, tuple[asyncio.Queue, int]] = {}
        self.workers: LiveWorkers | None = None  # set in start(), with the async client
        self.phases = CallPhases()
        self.channel_up = False  # subscribed to the workers' chunks: calls are taken only then
        self.holds_run = False  # the run's gateway record is this gateway's (claim)
        self.component_names: set[str] = set()  # of the rewards taken (MAX_COMPONENTS)
        self.cancels_owed: set[str] = set()  # cancellations Redis did not take (down): sent again each second
        self._tasks: list[asyncio.Task] = []
        self._sending: set[asyncio.Task] = set()  # cancellations on their way to Redis
        self._appending = asyncio.Lock()
        self.started = time.time()

    # ------------------------------------------------------------------ lifecycle

    def claim(self) -> None:
        """Take the run for this gateway, or refuse to: one gateway per run (a second one would
        take up the first one's kept rewards and its ``gateway.json``). A record whose gateway
        died lapses within :data:`LIVE_TTL_S`, so this waits that long at most; a record
        refreshed meanwhile is a live gateway's."""
        deadline, seen = time.monotonic() + LIVE_TTL_S + 1, None
        while (held := self.buffer.retry(hold_run, self.buffer.redis, self.keys, self.gateway_id)) is not None:
            if (seen is not None and held[0] == seen[0] and held[1] > seen[1]) or time.monotonic() > deadline:
                raise UserError(f"gateway {held[0]} serves run {self.cfg.buffer.run_id} (its record in Redis, "
                                f"{self.keys.gw_live}, is refreshed every second): one gateway per run; stop that one "
                                f"first (one that died frees the run within {LIVE_TTL_S:g} s)")
            if seen is None:
                log.info("gateway: run %s is held by gateway %s; waiting up to %g s for its record to be refreshed (it "
                         "is alive) or to lapse (it died)", self.cfg.buffer.run_id, held[0], LIVE_TTL_S)
            seen = held
            time.sleep(0.2)
        self.holds_run = True

    def release(self) -> None:
        """Free the run for the next gateway (a record that is not this gateway's stays)."""
        if not self.holds_run:
            return
        self.holds_run = False
        try:
            drop_run(self.buffer.redis, self.keys, self.gateway_id)
        except Exception as exc:  # noqa: BLE001  # Redis away: the record lapses by itself
            log.warning("gateway: could not free the run's gateway record (%s); it lapses within %g s", exc, LIVE_TTL_S)

    async def _hold(self) -> None:
        """Refresh this gateway's record of the run every second (it lapses :data:`LIVE_TTL_S` after the last)."""
        taken = False
        while True:
            await asyncio.sleep(1.0)
            try:
                held = await asyncio.to_thread(hold_run, self.buffer.redis, self.keys, self.gateway_id)
            except Exception:  # noqa: BLE001  # Redis away: taken again once it is back, unless another gateway took it
                continue
            if held is not None and not taken:
                log.error("gateway: gateway %s took run %s while this one could not refresh its record for %g s "
                          "(Redis away); both now serve it: stop one", held[0], self.cfg.buffer.run_id, LIVE_TTL_S)
            taken = held is not None

    async def start(self) -> None:
        """Wait for the run (its parameters), subscribe to this gateway's channel, start the tasks."""
        while not await asyncio.to_thread(self.buffer.initialised):
            log.info("gateway: run %s is not initialised yet; waiting for the learner", self.cfg.buffer.run_id)
            await asyncio.sleep(0.5)
        params = await asyncio.to_thread(self.buffer.run_params)
        group_size = int(self.cfg.gateway.group_size or params["group_size"])
        if group_size > int(params["group_size"]):
            raise ConfigError(f"gateway.group_size={group_size} is larger than the run's group_size "
                              f"{params['group_size']}: a group of the buffer holds at most that many samples")
        room = int(params["max_response_tokens"])
        if room < self.cfg.gateway.max_tokens:
            log.warning("gateway: a session holds at most %d response tokens in all, every call's reply and what the "
                        "agent adds between them (rollout.max_episode_tokens; unset: rollout.max_new_tokens): set "
                        "rollout.max_episode_tokens to the episodes your agents run", room)
        self.sessions = Sessions(self.tokenizer, self.cfg.gateway.session_ttl_s, group_size, room)
        await self._recover()
        kwargs = client_kwargs(self.cfg.buffer.url, self.cfg.buffer)
        kwargs.pop("retry")  # redis-py's synchronous Retry; the asyncio client's default from a URL: no retries either
        # a Redis that does not answer fails a command within the socket timeout, at most a call's
        # (a 503, not a hang); the channel's reads pass their own timeout
        kwargs["socket_timeout"] = min(kwargs["socket_timeout"], self.cfg.gateway.call_timeout_s)
        self.redis = aioredis.Redis.from_url(self.cfg.buffer.url, **kwargs)
        self.calls = CallQueue(self.redis, self.keys)
        self.workers = LiveWorkers(self.redis, self.keys, self.cfg.buffer.lease_timeout_s)
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self.keys.gw_out(self.gateway_id))
        # redis-py reconnects the channel by itself within a read's retries: told, to fail the calls running
        pubsub.connection.register_connect_callback(self._reconnected)
        self.channel_up = True
        self._tasks = [asyncio.create_task(self._route(pubsub), name="gateway-route"),
                       asyncio.create_task(self._housekeeping(), name="gateway-expiry"),
                       asyncio.create_task(self._hold(), name="gateway-hold")]

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._sending]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        if self.sessions is not None:  # the last counts: a run's summary is taken after its children stop
            try:
                await asyncio.to_thread(self.buffer.publish_stats, M.GATEWAY_STATS, self.counts())
            except Exception as exc:  # noqa: BLE001  # Redis gone first: the counts of a second ago stay
                log.warning("gateway: its last counts could not be published: %s", exc)
        await asyncio.to_thread(self.release)
        if self.redis is not None:
            await self.redis.aclose()
        self.buffer.close()

    async def _route(self, pubsub: Any) -> None:
        """Deliver the workers' chunks to the requests waiting on them."""
        while True:
            try:
                msg = await pubsub.get_message(timeout=1.0)
            except REDIS_DOWN as exc:
                log.warning("gateway: the channel from the workers failed (%s); resubscribing", exc)
                self._channel_lost()
                await asyncio.sleep(0.5)
                with contextlib.suppress(Exception):
                    await pubsub.subscribe(self.keys.gw_out(self.gateway_id))
                    self.channel_up = True
                continue
            if msg is None or msg.get("type") != "message":
                continue
            try:
                chunk = CallChunk.decode(msg["data"])
            except ValueError as exc:
                log.warning("gateway: dropped an unreadable chunk: %s", exc)
                continue
            waiting = self.pending.get(chunk.call_id)
            if waiting is not None:
                waiting[0].put_nowait((waiting[1], chunk))
            elif chunk.final:
                self.cancels_owed.discard(chunk.call_id)
                with contextlib.suppress(Exception):
                    await forget_cancel(self.redis, self.keys, chunk.call_id)

    def _reconnected(self, connection: Any) -> None:
        log.warning("gateway: the channel from the workers reconnected; chunks published meanwhile are lost")
        self._channel_lost()
        self.channel_up = True

    def _channel_lost(self) -> None:
        """Pub/sub keeps nothing for a subscriber that is away: a call running while the channel
        was down may have lost chunks (its final one: it would wait for gateway.call_timeout_s).
        Each fails at once (:data:`LOST`); no call is taken until the channel is back."""
        self.channel_up = False
        for waiting, index in self.pending.values():
            waiting.put_nowait((index, LOST))

    async def _recover(self) -> None:
        """Take up the rewarded sessions a gateway before this one kept and did not append (it
        stopped or died while their groups were filling): back in their groups, appended when
        full or due. A kept record that does not decode is dead-lettered."""
        assert self.sessions is not None
        for key, raw in (await asyncio.to_thread(self.buffer.rewarded_kept)).items():
            try:
                sample = Sample.decode(raw, max_bytes=self.cfg.buffer.max_record_bytes)
            except WireError as exc:
                await asyncio.to_thread(self.buffer.dead_letter, f"a kept gateway reward does not decode: {exc}",
                                        "gateway", raw)
                await asyncio.to_thread(self.buffer.forget_rewarded, key)
                continue
            self.sessions.recovered(key, sample)
        if self.sessions.counters.rewards_recovered:
            log.info("gateway: %d rewarded session(s) kept by an earlier gateway are back in their %d group(s)",
                     self.sessions.counters.rewards_recovered, len(self.sessions.groups))
        await self._append_due()

    async def _housekeeping(self) -> None:
        """Expire idle sessions, append groups that are due, drop old cancellation marks, publish the gateway's stats."""
        assert self.sessions is not None
        every = min(1.0, self.cfg.gateway.session_ttl_s / 4)
        while True:
            await asyncio.sleep(every)
            try:
                await self._send_cancels()
                self.sessions.expire()
                await self._append_due()
                await forget_old_cancels(self.redis, self.keys, self.cfg.gateway.call_timeout_s)
                await asyncio.to_thread(self.buffer.publish_stats, M.GATEWAY_STATS, self.counts())
            except Exception:  # noqa: BLE001  # Redis away for a moment: the next round retries
                log.exception("gateway: housekeeping failed")

    # ------------------------------------------------------------------ guards

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

    async def need_worker(self) -> None:
        assert self.workers is not None
        if not self.channel_up:
            raise retry_later("the gateway's channel from the workers (Redis pub/sub) is down; retry shortly", "channel_lost")
        if not await self.workers.count():
            raise retry_later("no rollout worker is serving this run right now; retry shortly", "no_worker")

    def session_of(self, request: Request, user: str | None) -> tuple[str, str | None]:
        sid = request.headers.get(SESSION_HEADER) or user or f"s-{uuid.uuid4().hex}"
        group = request.headers.get(GROUP_HEADER) or None
        if len(sid) > MAX_ID_CHARS:
            raise bad(f"a session id is at most {MAX_ID_CHARS} characters", "X-Session-Id")
        if group is not None and len(group) > MAX_ID_CHARS:
            raise bad(f"a group id is at most {MAX_ID_CHARS} characters", "X-Group-Id")
        return sid, group

    # ------------------------------------------------------------------ calls

    def _open(self, sid: str, group: str | None, n: int) -> list[Session]:
        assert self.sessions is not None
        names = [sid] if n == 1 else [f"{sid}/{i}" for i in range(n)]
        group = group if n == 1 else (group or sid)
        try:
            return [self.sessions.open(name, group) for name in names]
        except SessionError as exc:
            raise _session_error(exc) from None

    def _calls(self, sessions: list[Session], context: Callable[[Session], list[int]], sampling: Any) -> list[_Choice]:
        """A call per session, its context ``context(session)``; each context is checked as it is
        made (rendering and tokenising hold the event loop: a prompt over the context costs one)."""
        assert self.sessions is not None
        default = int(self.cfg.gateway.max_tokens)  # as OpenAI: a call that names none may take what is left
        choices = []
        for i, s in enumerate(sessions):
            ctx = context(s)
            if len(ctx) >= self.max_context:
                raise bad(f"the prompt has {len(ctx)} tokens; the model's context is {self.max_context}", "messages",
                          "context_length_exceeded")
            room = min(self.sessions.room(s), self.max_context - len(ctx))
            if room < 1:
                raise bad(f"session '{s.session_id}' is full ({self.sessions.max_response_tokens} response tokens, the run's "
                          "limit per sample); post its reward and start another", "messages", "context_length_exceeded")
            want = sampling.max_tokens or default
            call = GatewayCall(call_id=f"{uuid.uuid4().hex}", reply_to=self.gateway_id, prompt_ids=list(ctx),
                               max_tokens=min(want, room), temperature=sampling.temperature, top_p=sampling.top_p,
                               stop=sampling.stop, stream=sampling.stream,
                               min_kv_version=s.transcript.oldest_version)
            choices.append(_Choice(i, s, call, None))
        return choices

    async def _run(self, choices: list[_Choice], request: Request | None) -> AsyncIterator[tuple[_Choice, CallChunk]]:
        """Submit the calls and yield their chunks as they come; cancels what is left on exit."""
        queue: asyncio.Queue = asyncio.Queue()
        for c in choices:
            self.pending[c.call.call_id] = (queue, c.index)
        deadline = time.monotonic() + self.cfg.gateway.call_timeout_s
        left = len(choices)
        drift: asyncio.Task | None = None
        try:
            assert self.calls is not None
            pushed = time.time()  # before the push: a worker may start the call before its reply is read
            received = request.scope.get(RECEIVED, pushed) if request is not None else pushed
            await self.calls.submit([c.call for c in choices])
            drift = self._check_drift(choices)
            while left:
                try:
                    index, chunk = await asyncio.wait_for(queue.get(), timeout=min(1.0, max(0.01, deadline - time.monotonic())))
                except asyncio.TimeoutError:
                    if time.monotonic() > deadline:
                        raise retry_later(f"no worker finished the call within gateway.call_timeout_s="
                                          f"{self.cfg.gateway.call_timeout_s}; retry, or raise the limit", "timeout") from None
                    if request is not None and await request.is_disconnected():
                        raise ClientGone()
                    await self._check_holders(choices)
                    continue
                if chunk is LOST:
                    raise retry_later("the gateway's channel from the workers (Redis pub/sub) dropped while the call ran, "
                                      "and its tokens may be lost with it; retry", "channel_lost")
                c = choices[index]
                if chunk.started:
                    c.worker, c.taken_at = chunk.worker_id, chunk.started_at or 0.0
                    continue
                if chunk.final:
                    c.final = chunk
                    left -= 1
                    self.phases.add(received, pushed, chunk, time.time())
                yield c, chunk
        finally:
            if drift is not None:  # before the call settles: the session's next call checks from here
                with anyio.CancelScope(shield=True):
                    await drift
            unfinished = [c.call.call_id for c in choices if c.final is None]
            for c in choices:
                self.pending.pop(c.call.call_id, None)
            if unfinished:
                assert self.sessions is not None
                self.sessions.counters.calls_aborted += len(unfinished)
                self._cancel(unfinished)

    def _cancel(self, call_ids: list[str]) -> None:
        """Ask the workers to abort these calls. They are owed until Redis takes them: the
        housekeeping task sends what is owed every second (a call nobody waits for would otherwise
        hold its worker's slot until its last token). They are sent on a task of their own, so a
        Redis that does not answer holds no call's answer; while the channel is down, Redis most
        likely with it, they wait for the housekeeping."""
        self.cancels_owed.update(call_ids)
        if self.channel_up:
            task = asyncio.create_task(self._send_cancels())
            self._sending.add(task)  # held until done: the loop keeps only weak references
            task.add_done_callback(self._sending.discard)

    async def _send_cancels(self) -> None:
        owed = list(self.cancels_owed)
        if not owed:
            return
        with contextlib.suppress(Exception):
            await cancel(self.redis, self.keys, owed)
            self.cancels_owed.difference_update(owed)

    async def _check_holders(self, choices: list[_Choice]) -> None:
        """Fail the call when the worker holding one of its unfinished choices died with it: it
        stopped heartbeating (for ``buffer.lease_timeout_s``, as for the run's prompts), or a
        worker of its name started after it took the call (a restart). The call would
        otherwise wait for ``gateway.call_timeout_s``."""
        held = [c for c in choices if c.worker and c.final is None]
        if not held:
            return
        assert self.workers is not None
        live = await self.workers.live()

        def died(c: _Choice) -> bool:  # silent, or a process of its name younger than the call (the worker's clock)
            started = live.get(c.worker)
            return started is None or started > c.taken_at > 0

        gone = sorted({c.worker for c in held if died(c)})
        if gone:
            raise retry_later(f"the worker serving the call ({', '.join(gone)}) stopped or restarted before it "
                              f"finished (no heartbeat for buffer.lease_timeout_s={self.cfg.buffer.lease_timeout_s} "
                              "s, or a new process of its name); retry", "worker_stopped")

    def _check_drift(self, choices: list[_Choice]) -> asyncio.Task | None:
        """The calls' drift checks on a thread while they are generated (they tokenise up to a
        whole conversation, which would hold the event loop; tokenising releases the GIL). A session
        that drifted stays so (rlhf_core/turns.py): counted at once, no thread."""
        assert self.sessions is not None
        for c in choices:
            if c.session.drift_check is not None and c.session.conversation.drifted:
                self.sessions.count_drift(c.session, True)
        checks = [(c.session, c.session.drift_check) for c in choices if c.session.drift_check is not None]
        if not checks:
            return None

        async def run() -> None:
            assert self.sessions is not None
            for s, check in checks:
                try:
                    drift = await asyncio.to_thread(check)
                except Exception:  # noqa: BLE001  # a count: never fails the call
                    log.warning("session %s: the drift check failed", s.session_id, exc_info=True)
                    drift = False
                self.sessions.count_drift(s, drift)  # clears the check: a failed one is not run again

        return asyncio.ensure_future(run())

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _finish(self, c: _Choice, stops: list[str], tools: bool) -> tuple[str, list[dict[str, Any]], str]:
        """The returned content (stop string and tool-call blocks cut), tool calls, finish reason."""
        assert c.final is not None
        text = self._text(c.final.token_ids)
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

    def _failed(self, choices: list[_Choice]) -> ApiError | None:
        for c in choices:
            if c.final is not None and c.final.error:
                return bad(f"the worker could not run the call: {c.final.error}", "messages", "context_length_exceeded")
            if c.final is not None and c.final.finish_reason == "abort":
                return retry_later("the worker serving the call stopped before it finished; retry", "worker_stopped")
        return None

    def _record(self, c: _Choice) -> None:
        assert self.sessions is not None and c.final is not None
        f = c.final
        self.sessions.record(c.session, f.token_ids, f.logprobs, f.versions, self._text(f.token_ids), f.finish_reason or "stop")

    def _logprobs(self, c: _Choice) -> dict[str, Any]:
        assert c.final is not None
        return logprobs_content(self.tokenizer.convert_ids_to_tokens(c.final.token_ids), c.final.logprobs)

    async def _begin(self, request: Request, user: str | None, sampling: Any, context: Any) -> tuple[str, list[_Choice]]:
        """Open the call's sessions, render their contexts (``context(session)``), make the calls;
        the sessions are put back as they were if anything here fails."""
        assert self.sessions is not None
        sid, group = self.session_of(request, user)
        await self.need_worker()  # first: no await between the sessions' busy check and marking them busy
        sessions = self._open(sid, group, sampling.n)
        snaps = [self.sessions.snapshot(s) for s in sessions]
        try:
            choices = self._calls(sessions, context, sampling)
        except Exception:
            for s, snap in zip(sessions, snaps):
                self.sessions.restore(s, snap)
            raise
        for c, snap in zip(choices, snaps):
            c.snapshot, c.session.busy = snap, True
        self.sessions.counters.calls += 1
        return sid, choices

    def _stream_text(self, c: _Choice, tokens: list[int], stops: list[str]) -> str:
        """The new text of a streamed choice that can be sent now: not what could still become a
        stop string (cut from the reply), not a character whose bytes are incomplete."""
        c.tokens += tokens
        text = self._text(c.tokens)
        safe = len(text) - max(len(x) for x in stops) + 1 if stops else len(text)
        if text.endswith("\ufffd"):
            safe = min(safe, len(text) - 1)
        if safe <= c.sent_chars:
            return ""
        piece, c.sent_chars = text[c.sent_chars:safe], safe
        return piece

    @staticmethod
    def _token_counts(choices: list[_Choice]) -> tuple[int, int]:
        """(prompt, completion) tokens of a call: its prompt once, every finished choice's reply."""
        return len(choices[0].call.prompt_ids), sum(len(c.final.token_ids) for c in choices if c.final)

    def _usage_chunk(self, cid: str, created: int, kind: str, choices: list[_Choice]) -> bytes:
        return sse({"id": cid, "object": kind, "created": created, "model": self.model_name, "choices": [],
                    "usage": usage(*self._token_counts(choices))})

    async def chat(self, request: Request) -> Response:
        req = parse_chat(parse_json(await self.body(request)), self.model_name, self.cfg.gateway.max_tokens,
                         self.cfg.gateway.max_n)
        assert self.sessions is not None
        sessions = self.sessions
        sid, choices = await self._begin(request, req.user, req.sampling,
                                         lambda s: sessions.chat_context(s, req.messages, req.tools))
        tools = bool(req.tools) and req.tool_choice != "none"
        cid, created = f"chatcmpl-{choices[0].call.call_id}", int(time.time())

        def done(c: _Choice) -> tuple[str, list[dict[str, Any]], str, dict[str, Any]]:
            """A finished choice: its content, tool calls, finish reason and message, recorded in its session."""
            text, calls, reason = self._finish(c, req.sampling.stop, tools)
            message: dict[str, Any] = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
            self._record(c)
            c.session.expected = [*req.messages, normal_message(message)]
            return text, calls, reason, message

        def logprobs(c: _Choice) -> dict[str, Any] | None:
            return self._logprobs(c) if req.sampling.logprobs else None

        if not req.sampling.stream:
            def answer(c: _Choice) -> dict[str, Any]:
                _, _, reason, message = done(c)
                return {"index": c.index, "message": message, "finish_reason": reason, "logprobs": logprobs(c)}

            out, prompt, completion = await self._gather(choices, request, answer)
            return JSONResponse(chat_response(cid, self.model_name, out, prompt, completion), headers={"X-Session-Id": sid})

        def chunk(index: int, delta: dict[str, Any], reason: str | None = None, lp: Any = None) -> bytes:
            return sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                        "choices": [{"index": index, "delta": delta, "finish_reason": reason, "logprobs": lp}]})

        def final(c: _Choice) -> bytes:
            sent = c.sent_chars  # what streamed before the end; the rest (or all, with tools) goes now
            text, calls, reason, _ = done(c)
            delta: dict[str, Any] = {"content": text[sent:]} if len(text) > sent else {}
            if calls:
                delta["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(calls)]
            return chunk(c.index, delta, reason, logprobs(c))

        def part(c: _Choice, token_ids: list[int]) -> bytes | None:
            if tools:  # content is sent with the calls at the end, once they are parsed out of it
                c.tokens += token_ids
                return None
            piece = self._stream_text(c, token_ids, req.sampling.stop)
            return chunk(c.index, {"content": piece}) if piece else None

        opening = [chunk(c.index, {"role": "assistant", "content": ""}) for c in choices]
        events = self._sse(choices, req.sampling, cid, created, "chat.completion.chunk", opening, final, part)
        return StreamingResponse(events, media_type="text/event-stream", headers={"X-Session-Id": sid})

    async def completions(self, request: Request) -> Response:
        req = parse_completion(parse_json(await self.body(request)), self.model_name, self.cfg.gateway.max_tokens,
                               self.cfg.gateway.max_n)
        if isinstance(req.prompt, list) and (min(req.prompt) < 0 or max(req.prompt) >= len(self.tokenizer)):
            raise bad(f"prompt token ids must lie in [0, {len(self.tokenizer)})", "prompt")
        assert self.sessions is not None
        sessions = self.sessions
        sid, choices = await self._begin(request, req.user, req.sampling,
                                         lambda s: sessions.completion_context(s, req.prompt))
        cid, created = f"cmpl-{choices[0].call.call_id}", int(time.time())

        def done(c: _Choice) -> tuple[str, str]:
            """A finished choice: its text and finish reason, recorded in its session."""
            assert c.final is not None
            text, _, reason = self._finish(c, req.sampling.stop, False)
            self._record(c)
            sessions.completed(c.session, self._text(c.final.token_ids), text)
            return text, reason

        if not req.sampling.stream:
            def answer(c: _Choice) -> dict[str, Any]:
                text, reason = done(c)
                lp = None
                if req.sampling.logprobs:
                    assert c.final is not None
                    lp = {"tokens": self.tokenizer.convert_ids_to_tokens(c.final.token_ids),
                          "token_logprobs": c.final.logprobs, "top_logprobs": None, "text_offset": None}
                return {"index": c.index, "text": text, "finish_reason": reason, "logprobs": lp}

            out, prompt, completion = await self._gather(choices, request, answer)
            return JSONResponse(completion_response(cid, self.model_name, out, prompt, completion),
                                headers={"X-Session-Id": sid})

        def chunk(index: int, text: str, reason: str | None = None) -> bytes:
            return sse({"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                        "choices": [{"index": index, "text": text, "finish_reason": reason, "logprobs": None}]})

        def final(c: _Choice) -> bytes:
            sent = c.sent_chars
            text, reason = done(c)
            return chunk(c.index, text[sent:], reason)

        def part(c: _Choice, token_ids: list[int]) -> bytes | None:
            piece = self._stream_text(c, token_ids, req.sampling.stop)
            return chunk(c.index, piece) if piece else None

        events = self._sse(choices, req.sampling, cid, created, "text_completion", [], final, part)
        return StreamingResponse(events, media_type="text/event-stream", headers={"X-Session-Id": sid})

    async def _gather(self, choices: list[_Choice], request: Request,
                      answer: Callable[[_Choice], dict[str, Any]]) -> tuple[list[dict[str, Any]], int, int]:
        """A plain call: wait for every choice, then ``answer`` each; returns the answers and the
        prompt and completion token counts. The sessions are settled either way."""
        ok = False
        try:
            async for _ in self._run(choices, request):
                pass
            if (err := self._failed(choices)) is not None:
                raise err
            out = [answer(c) for c in choices]
            ok = True
            return out, *self._token_counts(choices)
        finally:
            self._settle(choices, ok)

    async def _sse(self, choices: list[_Choice], sampling: Any, cid: str, created: int, kind: str, opening: list[bytes],
                   final: Callable[[_Choice], bytes],
                   part: Callable[[_Choice, list[int]], bytes | None]) -> AsyncIterator[bytes]:
        """A streamed call as server-sent events: ``opening``, then ``part`` of each chunk of tokens
        and ``final`` of each finished choice, the usage when asked, ``[DONE]``. An error becomes
        an error event; the sessions are settled either way."""
        ok = False
        try:
            for event in opening:
                yield event
            # closed on the way out, before the sessions are settled (left to the garbage collector,
            # its drift check would still run on a conversation put back)
            async with contextlib.aclosing(self._run(choices, None)) as chunks:
                async for c, got in chunks:
                    if not got.final:
                        if (event := part(c, got.token_ids)) is not None:
                            yield event
                        continue
                    if (err := self._failed([c])) is not None:
                        yield self._error_event(err)
                        return
                    yield final(c)
            ok = True
            if sampling.include_usage:
                yield self._usage_chunk(cid, created, kind, choices)
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
        if self.sessions is not None:
            self.sessions.counters.errors[code or "error"] += 1

    def _settle(self, choices: list[_Choice], ok: bool) -> None:
        assert self.sessions is not None
        for c in choices:
            c.session.busy = False
            if not ok:
                self.sessions.restore(c.session, c.snapshot)
        if not ok:
            self.sessions.counters.calls_failed += 1

    # ------------------------------------------------------------------ rewards, models, health

    async def reward(self, request: Request) -> Response:
        assert self.sessions is not None
        obj = parse_json(await self.body(request))
        sid = request.path_params["session_id"]
        value = obj.get("reward")
        parts = value if isinstance(value, dict) and value else {"": value}
        if not all(finite(v) for v in parts.values()) or not finite(total := sum(float(v) for v in parts.values())):
            raise bad("'reward' must be a finite number, or an object of named finite numbers (summed)", "reward")
        components = {str(k): float(v) for k, v in parts.items()} if parts is value else {}
        if not all(0 < len(k) <= MAX_COMPONENT_CHARS for k in components):
            raise bad(f"reward component names must be 1-{MAX_COMPONENT_CHARS} characters", "reward")
        if taken := sorted(set(components) & M.REWARD_STATS):
            raise bad(f"reward component name(s) {', '.join(map(repr, taken))} are the learner's own reward/<stat> "
                      "metrics (a component is the metric reward/<its name>); rename them", "reward")
        if len(names := self.component_names | set(components)) > MAX_COMPONENTS:
            raise bad(f"'reward' names {len(names) - len(self.component_names)} component(s) this gateway has not seen, "
                      f"past the {MAX_COMPONENTS} distinct component names it takes: a run's reward components are a "
                      "fixed set of names (each is a learner metric reward/<name>)", "reward")
        group = obj.get("group")
        if group is not None and not (isinstance(group, str) and 0 < len(group) <= MAX_ID_CHARS):
            raise bad(f"'group' must be a string of 1-{MAX_ID_CHARS} characters", "group")
        try:
            rewarded = self.sessions.end(sid, total, components, group)
        except SessionError as exc:
            raise _session_error(exc) from None
        self.component_names = names
        # kept before it is acknowledged: a gateway that dies now loses no accepted reward
        keep = asyncio.ensure_future(asyncio.to_thread(self.buffer.keep_rewarded, rewarded.key, rewarded.sample))
        try:
            await asyncio.shield(keep)
        except asyncio.CancelledError:  # the request went away: settle the session when the keep ends
            keep.add_done_callback(lambda done: self._settle_kept(rewarded, done))
            raise
        except Exception as exc:
            self.sessions.reopen(rewarded)
            log.warning("gateway: could not keep the reward of session %s: %s", sid, exc)
            raise retry_later(f"the reward could not be stored ({type(exc).__name__}); post it again", "unavailable") from None
        samples, why = await self._append_due(rewarded)
        status = "filtered" if why else "appended" if samples else "waiting_for_group"
        return JSONResponse({"session": sid, "group": rewarded.group, "reward": total, "status": status,
                             "samples": samples})

    def _settle_kept(self, rewarded: Rewarded, done: asyncio.Future) -> None:
        if done.cancelled() or done.exception() is not None:
            self.sessions.reopen(rewarded)
        else:  # kept: in its group, appended at the next round when that makes it due
            self.sessions.rewarded(rewarded)

    async def _append_due(self, rewarded: Rewarded | None = None) -> tuple[int, str | None]:
        """Add ``rewarded`` (kept) to its group, then append every group that is due (full, or its
        TTL over), each with the deletion of its kept samples (a group that teaches nothing, with
        ``algo.filter_groups``, only the deletion); a group the buffer cannot take now stays and is
        tried again at the next round. Returns the group of ``rewarded``: how many samples it
        appended (0: it waits for more sessions, or was filtered), and why it was filtered (None:
        it was not)."""
        assert self.sessions is not None
        counters, appended_with, filtered = self.sessions.counters, 0, None
        async with self._appending:  # one round at a time: a group is appended by the round that saw it due
            if rewarded is not None:
                self.sessions.rewarded(rewarded)
            for name in self.sessions.due():
                keys, samples = self.sessions.group(name)
                why = group_filter(self.cfg.algo, samples)
                try:
                    entry = await asyncio.to_thread(self.buffer.append_group, "gateway", samples, keys, why)
                    # None: some of its kept samples were appended before (another gateway took them up)
                    still = await asyncio.to_thread(self.buffer.rewarded_kept, keys) if entry is None else {}
                except Exception:  # noqa: BLE001  # Redis away: the samples stay kept; the next round retries
                    log.exception("gateway: appending group %s failed; it is tried again", name)
                    continue
                if entry is None:
                    self.sessions.appended(name, [k for k in keys if k not in still])
                    log.info("gateway: %d sample(s) of group %s were appended before; %d wait for their group",
                             len(keys) - len(still), name, len(still))
                    continue
                self.sessions.appended(name, keys)
                if rewarded is not None and rewarded.key in keys:
                    appended_with, filtered = (0 if why else len(samples)), why
                if why is not None:
                    counters.groups_filtered += 1
                    counters.samples_filtered += len(samples)
                elif entry:
                    counters.groups_appended += 1
                    counters.samples_appended += len(samples)
                else:
                    counters.samples_dead_lettered += len(samples)
                    log.warning("gateway: a group of %d sample(s) was dead-lettered by the buffer (rlhf-monitor shows why)",
                                len(samples))
        return appended_with, filtered

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                         "created": int(self.started), "owned_by": "rlhf-service"}]})

    async def health(self, request: Request) -> Response:
        assert self.workers is not None
        workers, status = None, "channel_lost"  # not subscribed: Redis is likely away too, not asked
        if self.channel_up:
            try:
                workers = await self.workers.count()
                status = "ok" if workers else "no_worker"
            except REDIS_DOWN:
                status = "unavailable"
        body = {"status": status, "workers": workers, "model": self.model_name}
        return JSONResponse(body, status_code=200 if status == "ok" else 503,
                            headers={} if status == "ok" else {"Retry-After": str(RETRY_AFTER_S)})

    async def stats(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse({**self.counts(), "call_phases_s": self.phases.as_dict()})

    def counts(self) -> dict[str, Any]:
        """The counters since this gateway started and its levels now (what it publishes for the
        monitor, the run's exporter and summary)."""
        assert self.sessions is not None
        return {**self.sessions.counters.as_dict(), "sessions_open": len(self.sessions.sessions),
                "groups_waiting": len(self.sessions.groups), "calls_running": len(self.pending)}


def _session_error(exc: SessionError) -> ApiError:
    return ApiError(exc.status, str(exc), {404: NOT_FOUND, 409: CONFLICT}.get(exc.status, INVALID), "session")


def make_app(gw: Gateway, on_ready: Any = None) -> Starlette:
    """The Starlette app; ``on_ready()`` runs once the gateway has joined its run (before the first request)."""
    async def handle(fn: Any, request: Request) -> Response:
        request.scope[RECEIVED] = time.time()
        try:
            return await fn(request)
        except ApiError as exc:
            err = exc
        except REDIS_DOWN as exc:  # Redis away for a moment (a restart): the client may retry, no traceback
            log.warning("gateway: %s %s: Redis did not answer: %s", request.method, request.url.path, exc)
            err = redis_down(exc)
        except ClientGone:
            gw.count_error("client_gone")
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        gw.count_error(err.code)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    def route(path: str, fn: Any, methods: list[str]) -> Route:
        async def endpoint(request: Request) -> Response:
            return await handle(fn, request)
        return Route(path, endpoint, methods=methods)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await gw.stop()

    routes = [route("/v1/chat/completions", gw.chat, ["POST"]), route("/v1/completions", gw.completions, ["POST"]),
              route("/v1/models", gw.models, ["GET"]), route("/health", gw.health, ["GET"]),
              route("/v1/rl/sessions/{session_id:path}/reward", gw.reward, ["POST"]),
              route("/v1/rl/stats", gw.stats, ["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        return JSONResponse(ApiError(status, f"{request.method} {request.url.path} is not an endpoint of this gateway",
                                     NOT_FOUND if status == 404 else INVALID).body(), status_code=status)

    app.add_exception_handler(404, not_found)
    app.add_exception_handler(405, not_found)
    return app


#: the most bytes of a request's line and headers (uvicorn's h11 allows 16 KiB)
MAX_HEAD_BYTES = 64 * 1024
#: the most seconds from a connection's start, or a later request's first byte, to the end of its
#: request's headers (a client sends them at once; uvicorn sets no limit)
HEAD_TIMEOUT_S = 20.0


def _http_protocol() -> Any:
    """uvicorn's httptools protocol with the request head bounded, in size and time: httptools
    buffers the request line and headers without a limit, before any key is checked (one
    connection sending a 200 MB header took 246 MB), and a connection that sends them a byte at
    a time, or nothing, was held for good. A head over :data:`MAX_HEAD_BYTES` is answered 431, one
    not in within :data:`HEAD_TIMEOUT_S` 408, and its connection closed. Without httptools uvicorn
    speaks h11, which bounds the head's size itself."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "h11"

    class BoundedHead(HttpToolsProtocol):
        in_head, head_bytes = False, 0  # a request's head is being received, and its bytes so far
        refused = False  # answered 431 or 408: the connection is closing, nothing more of it is served
        head_timer: asyncio.TimerHandle | None = None  # until the head is in

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_late)

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_in()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.in_head, self.head_bytes = True, 0
            if self.head_timer is None:  # a later request of the connection
                self.head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_late)

        def on_headers_complete(self) -> None:
            self.in_head = False
            self._head_in()
            # the whole head, parsed: the read that completed it (or brought all of it) is not in head_bytes
            if self.refused or len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers) > MAX_HEAD_BYTES:
                self._too_large()
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:  # what the parser still finds after a refusal is dropped
            if not self.refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self.refused:
                super().on_message_complete()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self.in_head or self.transport.is_closing():
                return
            self.head_bytes += len(data)  # what httptools holds of a head still incomplete
            if self.head_bytes > MAX_HEAD_BYTES:
                self._too_large()

        def _too_large(self) -> None:
            if not self.refused:
                self._refuse(b"431 Request Header Fields Too Large",
                             f"the request line and headers are over {MAX_HEAD_BYTES} bytes; send fewer or shorter headers")

        def _head_in(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _head_late(self) -> None:
            self.head_timer = None
            if not self.transport.is_closing():
                self._refuse(b"408 Request Timeout", f"the request line and headers took over {HEAD_TIMEOUT_S:g} s")

        def _refuse(self, status: bytes, message: str) -> None:
            self.refused = True
            msg = message.encode()
            self.transport.write(b"HTTP/1.1 %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
                                 b"connection: close\r\n\r\n%s" % (status, len(msg), msg))
            self.transport.close()

    return BoundedHead


class GatewayServer:
    """The gateway under uvicorn, in this thread (:meth:`run`) or a background one (:meth:`start`)."""

    def __init__(self, cfg: Config, output_dir: str | Path | None = None) -> None:
        import uvicorn

        self.gateway = Gateway(cfg)
        self.gateway.claim()
        self.sock = socket.socket(socket.AF_INET6 if ":" in cfg.gateway.host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((cfg.gateway.host, int(cfg.gateway.port)))
        except OSError as exc:
            self.sock.close()
            self.gateway.release()
            raise UserError(f"gateway: cannot listen on {cfg.gateway.host}:{cfg.gateway.port} ({exc.strerror}); "
                            "pick another gateway.port (0: any free one)") from None
        self.sock.listen(2048)  # a client connecting before uvicorn accepts waits in the backlog, not refused
        host, port = self.sock.getsockname()[:2]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1"
        config = uvicorn.Config(make_app(self.gateway, self._announce), log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5, lifespan="on", http=_http_protocol())
        self.server = uvicorn.Server(config)
        self.output_dir = Path(output_dir) if output_dir else None
        self._thread: threading.Thread | None = None

    def _announce(self) -> None:
        # uvicorn takes uvloop when installed (the `gateway` extra): about a fifth less CPU a call
        log.info("gateway: serving %s (model '%s') for run %s, event loop %s", self.url, self.gateway.model_name,
                 self.gateway.cfg.buffer.run_id, type(asyncio.get_running_loop()).__module__)
        if self.output_dir is not None:
            write_json(self.output_dir / "gateway.json", {"url": self.url, "model": self.gateway.model_name,
                                                                 "pid": os.getpid()})

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT; ``gateway.json`` is written once the run is joined."""
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.gateway.release()

    def start(self, timeout_s: float = 60.0) -> str:
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="gateway",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start (is the run initialised? see the log)")
            time.sleep(0.02)
        return self.url

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
        self.sock.close()
        self.gateway.release()  # also when it never started serving


def run_gateway(cfg: Config, output_dir: str | Path | None = None) -> None:
    """Entry point body: serve until SIGTERM/SIGINT (uvicorn handles both)."""
    server = GatewayServer(cfg, output_dir)
    freeze_startup_heap()
    server.run()
