"""Call routing: a request's calls to the workers through the run's Redis, and their chunks back.

A call (:class:`~buffer.gateway.GatewayCall`, made from its session's context) is pushed onto the
run's call list and answered on this gateway's pub/sub channel, whose one reader task routes the
chunks to the requests waiting on them. A running call fails when its worker dies or the channel
drops, and is cancelled when nobody waits for it; its session's drift check runs on a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import redis.asyncio as aioredis

from buffer.connection import client_kwargs
from buffer.gateway import CallChunk, CallQueue, GatewayCall, LiveWorkers, cancel, forget_cancel, forget_old_cancels
from buffer.keys import RunKeys
from gateway.openai_api import Sampling, bad, retry_later
from gateway.sessions import Session, Sessions
from rlhf_core.config import Config

log = logging.getLogger(__name__)

#: what the asyncio Redis client raises when Redis is away (the builtin ConnectionError is an OSError)
REDIS_DOWN = (OSError, aioredis.RedisError)
#: what a call's queue gets in place of a chunk when the channel from the workers dropped (CallRouter._channel_lost)
LOST: Any = None


class ClientGone(Exception):
    """The client went away before its request was read or its plain call returned: nobody is left
    to answer (not a server error: no traceback)."""


@dataclass
class Choice:
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
    """Where the calls that ran spent their time, summed (``call_phases_s`` of ``/v1/rl/stats``,
    docs/gateway.md): ``gateway_in``, ``to_worker``, ``engine``, ``to_gateway``."""

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


async def cancel_tasks(tasks: list[asyncio.Task]) -> None:
    """Cancel ``tasks`` and wait until each has ended."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(BaseException):
            await t


class CallRouter:
    """The calls of this gateway: made, pushed to the workers, their chunks routed back, watched,
    cancelled when nobody waits for them (routed once :meth:`connect` opened its channel)."""

    def __init__(self, cfg: Config, keys: RunKeys, gateway_id: str, sessions: Sessions, max_context: int) -> None:
        self.cfg, self.keys, self.gateway_id = cfg, keys, gateway_id
        self.sessions, self.max_context = sessions, max_context
        self.redis: Any = None
        self.calls: CallQueue | None = None  # set in connect(), with the async client
        self.workers: LiveWorkers | None = None  # likewise
        self.pending: dict[str, tuple[asyncio.Queue, int]] = {}
        self.phases = CallPhases()
        self.channel_up = False  # subscribed to the workers' chunks: calls are taken only then
        self.cancels_owed: set[str] = set()  # cancellations Redis did not take (down): sent again each second
        self._reader: asyncio.Task | None = None
        self._sending: set[asyncio.Task] = set()  # cancellations on their way to Redis

    async def connect(self) -> None:
        """Open the asyncio Redis client, subscribe to this gateway's channel, start routing its chunks."""
        url = self.cfg.buffer.url
        assert url is not None  # Gateway refuses a config without one
        kwargs = client_kwargs(url, self.cfg.buffer)
        kwargs.pop("retry")  # redis-py's synchronous Retry; the asyncio client's default from a URL: no retries either
        # a Redis that does not answer fails a command within the socket timeout, at most a call's
        # (a 503, not a hang); the channel's reads pass their own timeout
        kwargs["socket_timeout"] = min(kwargs["socket_timeout"], self.cfg.gateway.call_timeout_s)
        self.redis = aioredis.Redis.from_url(url, **kwargs)
        self.calls = CallQueue(self.redis, self.keys)
        self.workers = LiveWorkers(self.redis, self.keys, self.cfg.buffer.lease_timeout_s)
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self.keys.gw_out(self.gateway_id))
        # redis-py reconnects the channel by itself within a read's retries: told, to fail the calls running
        pubsub.connection.register_connect_callback(self._reconnected)
        self.channel_up = True
        self._reader = asyncio.create_task(self._route(pubsub), name="gateway-route")

    async def close(self) -> None:
        await cancel_tasks([*([self._reader] if self._reader else []), *self._sending])
        if self.redis is not None:
            await self.redis.aclose()

    async def need_worker(self) -> None:
        assert self.workers is not None
        if not self.channel_up:
            raise retry_later("the gateway's channel from the workers (Redis pub/sub) is down; retry shortly", "channel_lost")
        if not await self.workers.count():
            raise retry_later("no rollout worker is serving this run right now; retry shortly", "no_worker")

    def make_calls(self, sessions: list[Session], context: Callable[[Session], list[int]], sampling: Sampling) -> list[Choice]:
        """A call per session, its context ``context(session)``; each context is checked as it is
        made (rendering and tokenising hold the event loop: a prompt over the context costs one)."""
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
            assert s.transcript is not None  # context(s) made it
            call = GatewayCall(call_id=f"{uuid.uuid4().hex}", reply_to=self.gateway_id, prompt_ids=list(ctx),
                               max_tokens=min(want, room), temperature=sampling.temperature, top_p=sampling.top_p,
                               stop=sampling.stop, stream=sampling.stream,
                               min_kv_version=s.transcript.oldest_version)
            choices.append(Choice(i, s, call, None))
        return choices

    async def run(self, choices: list[Choice], received: float | None = None,
                  client_gone: Callable[[], Awaitable[bool]] | None = None) -> AsyncGenerator[tuple[Choice, CallChunk]]:
        """Submit the calls and yield their chunks as they come; cancels what is left on exit.
        ``received``: when the request arrived (None: counted from the push); ``client_gone()``
        asked while nothing comes: True ends the calls (:class:`ClientGone`)."""
        queue: asyncio.Queue = asyncio.Queue()
        for c in choices:
            self.pending[c.call.call_id] = (queue, c.index)
        deadline = time.monotonic() + self.cfg.gateway.call_timeout_s
        left = len(choices)
        drift: asyncio.Task | None = None
        try:
            assert self.calls is not None
            pushed = time.time()  # before the push: a worker may start the call before its reply is read
            received = pushed if received is None else received
            await self.calls.submit([c.call for c in choices])
            drift = self._check_drift(choices)
            while left:
                try:
                    index, chunk = await asyncio.wait_for(queue.get(), timeout=min(1.0, max(0.01, deadline - time.monotonic())))
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise retry_later(f"no worker finished the call within gateway.call_timeout_s="
                                          f"{self.cfg.gateway.call_timeout_s}; retry, or raise the limit", "timeout") from None
                    if client_gone is not None and await client_gone():
                        raise ClientGone() from None
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
                self.sessions.counters.calls_aborted += len(unfinished)
                self._cancel(unfinished)

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
        """Pub/sub keeps nothing for a subscriber that is away: each call running may have lost chunks,
        so it fails at once (:data:`LOST`); no call is taken until the channel is back."""
        self.channel_up = False
        for waiting, index in self.pending.values():
            waiting.put_nowait((index, LOST))

    def _cancel(self, call_ids: list[str]) -> None:
        """Ask the workers to abort these calls, on a task of their own (a Redis that does not
        answer holds no call's answer); owed until Redis takes them, the housekeeping sends them
        again every second (and alone while the channel is down)."""
        self.cancels_owed.update(call_ids)
        if self.channel_up:
            task = asyncio.create_task(self.send_cancels())
            self._sending.add(task)  # held until done: the loop keeps only weak references
            task.add_done_callback(self._sending.discard)

    async def send_cancels(self) -> None:
        owed = list(self.cancels_owed)
        if not owed:
            return
        with contextlib.suppress(Exception):
            await cancel(self.redis, self.keys, owed)
            self.cancels_owed.difference_update(owed)

    async def forget_old_cancels(self) -> None:
        """Drop the cancellation marks older than a call may run (a worker that died holding the call never ends it)."""
        await forget_old_cancels(self.redis, self.keys, self.cfg.gateway.call_timeout_s)

    async def _check_holders(self, choices: list[Choice]) -> None:
        """Fail the call when the worker holding one of its unfinished choices died: no heartbeat for
        ``buffer.lease_timeout_s``, or a process of its name started after it took the call."""
        held = [c for c in choices if c.worker and c.final is None]
        if not held:
            return
        assert self.workers is not None
        live = await self.workers.live()

        def died(c: Choice) -> bool:  # silent, or a process of its name younger than the call (the worker's clock)
            started = live.get(c.worker)
            return started is None or started > c.taken_at > 0

        gone = sorted({c.worker for c in held if died(c)})
        if gone:
            raise retry_later(f"the worker serving the call ({', '.join(gone)}) stopped or restarted before it "
                              f"finished (no heartbeat for buffer.lease_timeout_s={self.cfg.buffer.lease_timeout_s} "
                              "s, or a new process of its name); retry", "worker_stopped")

    def _check_drift(self, choices: list[Choice]) -> asyncio.Task | None:
        """The calls' drift checks, on a thread while they are generated (they may tokenise a whole
        conversation); a session that drifted stays so: counted at once."""
        for c in choices:
            conv = c.session.conversation
            if c.session.drift_check is not None:
                assert conv is not None  # a drift check comes from a chat turn of the session's conversation
                if conv.drifted:
                    self.sessions.count_drift(c.session, True)
        checks = [(c.session, c.session.drift_check) for c in choices if c.session.drift_check is not None]
        if not checks:
            return None

        async def run() -> None:
            for s, check in checks:
                try:
                    drift = await asyncio.to_thread(check)
                except Exception:  # noqa: BLE001  # a count: never fails the call
                    log.warning("session %s: the drift check failed", s.session_id, exc_info=True)
                    drift = False
                self.sessions.count_drift(s, drift)  # clears the check: a failed one is not run again

        return asyncio.ensure_future(run())
