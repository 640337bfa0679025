"""rlhf-gateway's traffic through Redis: its generation calls to the workers, their tokens back,
cancellations. The records and keys are defined here, once, for the gateway (``gateway/``) and
the worker (``rollout_workers/gateway_calls.py``).

    gateway --LPUSH P gw:calls--> any worker with a free slot (RPOP, between decoding steps)
    worker  --PUBLISH P gw:out:<gateway id>--> the gateway that made the call (stream deltas, then the result)
    gateway --HSET P gw:cancel--> the worker serving it aborts the call at its next step (and removes the mark)

A call is a :class:`GatewayCall` (token ids); a worker answers with :class:`CallChunk` records: a
``started`` one when it takes the call (the gateway then fails the call if that worker dies), one
per decoding step of a streamed call, and a ``final`` one with every token id, log-prob and
version (or an error). Pushing a call wakes workers blocked waiting for prompts (``P
wake:prompts``). One gateway serves a run at a time: it holds ``P gw:live`` (:func:`hold_run`).
Records are msgpack maps checked field by field (:mod:`rlhf_core.wire`), never pickled.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from buffer.keys import WAKE_MAXLEN, BadName, RunKeys, check_consumer
from rlhf_core.wire import WireError, decode_record, encode_record, optional, require

KIND_CALL = "gateway_call"
KIND_CHUNK = "gateway_chunk"
#: wake-up reason written to ``P wake:prompts`` with each call
WAKE_REASON = "gateway"
#: most tokens a call's prompt or result may carry on the wire
MAX_CALL_TOKENS = 1 << 20


def _int_list(obj: dict[str, Any], name: str) -> list[int]:
    # types and bound checked in C (map, min): a call carries its session's whole context
    values = require(obj, name, list)
    if len(values) > MAX_CALL_TOKENS or (values and (set(map(type, values)) != {int} or min(values) < 0)):
        raise WireError(f"field {name!r}: expected at most {MAX_CALL_TOKENS} integers >= 0")
    return values


def _optional_time(obj: dict[str, Any], name: str) -> float | None:
    value = optional(obj, name, (int, float))
    if value is not None and not math.isfinite(value):
        raise WireError(f"field {name!r}: expected a finite number of seconds or null, got {value}")
    return None if value is None else float(value)


def _float_list(obj: dict[str, Any], name: str) -> list[float]:
    values = require(obj, name, list)
    if len(values) > MAX_CALL_TOKENS or not set(map(type, values)) <= {int, float}:  # type(True) is bool: refused
        raise WireError(f"field {name!r}: expected at most {MAX_CALL_TOKENS} numbers")
    return list(map(float, values))


@dataclass
class GatewayCall:
    """One generation the gateway asks of a worker (token ids in; sampling settings as the client sent them)."""

    call_id: str
    reply_to: str  # the gateway's id: chunks go to RunKeys.gw_out(reply_to)
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    created_at: float = field(default_factory=time.time)
    # the oldest policy version of the session's tokens (None at first): the K/V the engine may reuse
    min_kv_version: int | None = None

    def encode(self) -> bytes:
        return encode_record(KIND_CALL, {
            "call_id": self.call_id, "reply_to": self.reply_to, "prompt_ids": list(map(int, self.prompt_ids)),
            "max_tokens": int(self.max_tokens), "temperature": float(self.temperature), "top_p": float(self.top_p),
            "stop": list(self.stop), "stream": bool(self.stream), "created_at": float(self.created_at),
            "min_kv_version": None if self.min_kv_version is None else int(self.min_kv_version)})

    @classmethod
    def decode(cls, data: bytes) -> GatewayCall:
        obj = decode_record(data, KIND_CALL)
        stop = optional(obj, "stop", list, [])
        if not all(isinstance(s, str) for s in stop):
            raise WireError("field 'stop': expected a list of strings")
        max_tokens = require(obj, "max_tokens", int)
        if max_tokens < 1:
            raise WireError(f"field 'max_tokens': must be >= 1, got {max_tokens}")
        reply_to = require(obj, "reply_to", str)
        try:  # it names the channel the chunks go to (RunKeys.gw_out): refused here, not when answering
            check_consumer(reply_to)
        except BadName as exc:
            raise WireError(f"field 'reply_to': {exc}") from None
        min_kv_version = optional(obj, "min_kv_version", int)
        if min_kv_version is not None and min_kv_version < 0:
            raise WireError(f"field 'min_kv_version': a policy version is >= 0, got {min_kv_version}")
        return cls(call_id=require(obj, "call_id", str), reply_to=reply_to,
                   prompt_ids=_int_list(obj, "prompt_ids"), max_tokens=max_tokens,
                   temperature=float(require(obj, "temperature", (int, float))),
                   top_p=float(require(obj, "top_p", (int, float))), stop=stop,
                   stream=bool(optional(obj, "stream", bool, False)),
                   created_at=float(optional(obj, "created_at", (int, float), 0.0)), min_kv_version=min_kv_version)


@dataclass
class CallChunk:
    """A worker's answer to a call: new token ids of a streamed call, or (``final``) the whole
    result: every token id with its behaviour log-prob and the policy version that sampled it,
    how it finished, or the error that kept it from running."""

    call_id: str
    token_ids: list[int]
    final: bool = False
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort, on the final chunk
    error: str | None = None  # the call could not run (e.g. longer than the worker's context)
    worker_id: str = ""
    # wall clock: when the worker queued the call in its engine and when it finished (a final chunk),
    # or took it (a started chunk)
    started_at: float | None = None
    finished_at: float | None = None

    @property
    def started(self) -> bool:
        """The worker ``worker_id`` took the call off the list, at ``started_at`` (a chunk with no
        tokens, not final); with no worker, it gave the call back unstarted (it stopped)."""
        return not self.final and not self.token_ids

    def encode(self) -> bytes:
        return encode_record(KIND_CHUNK, {
            "call_id": self.call_id, "token_ids": list(map(int, self.token_ids)), "final": self.final,
            "logprobs": list(map(float, self.logprobs)), "versions": list(map(int, self.versions)),
            "finish_reason": self.finish_reason, "error": self.error, "worker_id": self.worker_id,
            "started_at": self.started_at, "finished_at": self.finished_at})

    @classmethod
    def decode(cls, data: bytes) -> CallChunk:
        obj = decode_record(data, KIND_CHUNK)
        chunk = cls(call_id=require(obj, "call_id", str), token_ids=_int_list(obj, "token_ids"),
                    final=bool(require(obj, "final", bool)), versions=_int_list(obj, "versions"),
                    logprobs=_float_list(obj, "logprobs"),
                    finish_reason=optional(obj, "finish_reason", str), error=optional(obj, "error", str),
                    worker_id=optional(obj, "worker_id", str, ""),
                    started_at=_optional_time(obj, "started_at"), finished_at=_optional_time(obj, "finished_at"))
        if chunk.final and chunk.error is None and not len(chunk.token_ids) == len(chunk.logprobs) == len(chunk.versions):
            raise WireError(f"a final chunk needs one log-prob and one version per token, got {len(chunk.token_ids)} "
                            f"tokens, {len(chunk.logprobs)} log-probs, {len(chunk.versions)} versions")
        if any(not x <= 0.0 for x in chunk.logprobs):
            raise WireError("field 'logprobs': behaviour log-probs must be <= 0 (and not NaN)")
        return chunk


class WorkerChannel:
    """The worker's side (synchronous redis-py client): take calls, answer, see cancellations."""

    def __init__(self, client: Any, keys: RunKeys) -> None:
        self.redis, self.keys = client, keys

    def wait_take(self, n: int, block_s: float) -> list[bytes]:
        """Wait up to ``block_s`` for a first call (``BRPOP``), then take up to ``n`` - 1 more;
        oldest first, as raw records (:meth:`GatewayCall.decode` each)."""
        got = self.redis.brpop([self.keys.gw_calls], timeout=block_s)
        if not got:
            return []
        more = self.redis.rpop(self.keys.gw_calls, n - 1) if n > 1 else None
        return [got[1], *(more or [])]

    def wake(self) -> None:
        """Wake the workers waiting for prompts (this one's main thread: calls were fetched for it)."""
        _wake(self.redis, self.keys)

    def give_back(self, raws: list[bytes]) -> None:
        """Calls taken and never started, back at the tail (the oldest end: taken first again)."""
        self.redis.rpush(self.keys.gw_calls, *reversed(raws))

    def send(self, chunks: list[tuple[str, CallChunk]], running: list[tuple[str, str]]) -> list[str]:
        """Send ``chunks`` (``(gateway id, chunk)`` pairs) and return the calls among ``running``
        (``(call id, gateway id)`` pairs) to abort, in one round trip: those marked in ``P gw:cancel``
        and those whose gateway is gone (nobody listens on its channel). An aborted call takes its mark."""
        if not chunks and not running:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for gateway_id, chunk in chunks:
            pipe.publish(self.keys.gw_out(gateway_id), chunk.encode())
        aborted = [chunk.call_id for _, chunk in chunks if chunk.final and chunk.finish_reason == "abort"]
        if aborted:
            pipe.hdel(self.keys.gw_cancel, *aborted)
        gateways = sorted({gateway_id for _, gateway_id in running})
        if running:
            pipe.hmget(self.keys.gw_cancel, [call_id for call_id, _ in running])
            pipe.pubsub_numsub(*map(self.keys.gw_out, gateways))
        res = pipe.execute()
        if not running:
            return []
        gone = {g for g, (_, listeners) in zip(gateways, res[-1]) if not listeners}
        return [call_id for (call_id, gateway_id), mark in zip(running, res[-2]) if mark is not None or gateway_id in gone]


class CallQueue:
    """The gateway's side of ``P gw:calls`` (async redis client): :meth:`submit` queues calls and
    wakes workers waiting for prompts. Calls submitted while a round trip is under way go together
    in the next one (one ``LPUSH`` and one wake-up), in the order they were submitted."""

    def __init__(self, client: Any, keys: RunKeys) -> None:
        self.client, self.keys = client, keys
        self._queued: list[tuple[list[bytes], asyncio.Future]] = []
        self._sender: asyncio.Task | None = None
        self.round_trips = 0

    async def submit(self, calls: Sequence[GatewayCall]) -> None:
        """Queue ``calls``; returns once Redis holds them (raises what the round trip raised)."""
        loop = asyncio.get_running_loop()
        queued: asyncio.Future = loop.create_future()
        self._queued.append(([c.encode() for c in calls], queued))
        if self._sender is None or self._sender.done():
            self._sender = loop.create_task(self._send(), name="gateway-submit")
        await queued

    async def _send(self) -> None:
        while self._queued:
            batch, self._queued = self._queued, []
            pipe = self.client.pipeline(transaction=False)
            pipe.lpush(self.keys.gw_calls, *(c for calls, _ in batch for c in calls))
            _wake(pipe, self.keys)
            try:
                await pipe.execute()
                error = None
            except Exception as exc:  # noqa: BLE001  # each caller gets it (the gateway answers 503)
                error = exc
            self.round_trips += 1
            for _, queued in batch:
                if queued.done():  # its request was cancelled meanwhile
                    continue
                if error is None:
                    queued.set_result(None)
                else:
                    queued.set_exception(error)


#: a gateway refreshes its record of the run (``P gw:live``) every second; it lapses this long after
#: the last refresh, so a gateway that died frees the run by then
LIVE_TTL_S = 5.0
_HOLD = """local v = redis.call('GET', KEYS[1])
if v == false or v == ARGV[1] then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return false end
return {v, redis.call('PTTL', KEYS[1])}"""
_DROP = "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end"


def hold_run(client: Any, keys: RunKeys, gateway_id: str) -> tuple[str, float] | None:
    """Take the run's gateway record for ``gateway_id``, or refresh it (synchronous client): None
    when it is this gateway's now, else the gateway that holds it and the seconds its record has
    left. One gateway per run: each takes up the run's kept rewards when it starts."""
    held = client.eval(_HOLD, 1, keys.gw_live, gateway_id, int(LIVE_TTL_S * 1000))
    if not held:
        return None
    holder, left_ms = held
    return (holder.decode() if isinstance(holder, bytes) else str(holder)), max(0, int(left_ms)) / 1000


def drop_run(client: Any, keys: RunKeys, gateway_id: str) -> None:
    """Free the run's gateway record, if it is ``gateway_id``'s (a gateway that stops)."""
    client.eval(_DROP, 1, keys.gw_live, gateway_id)


def _wake(client: Any, keys: RunKeys) -> Any:
    return client.xadd(keys.wake_prompts, {"e": WAKE_REASON}, maxlen=WAKE_MAXLEN, approximate=True)


async def cancel(client: Any, keys: RunKeys, call_ids: Sequence[str]) -> None:
    """Ask the workers serving ``call_ids`` to abort them (one round trip); a call still on the list is
    aborted at the first check after a worker starts it (within ``CANCEL_CHECK_S`` of the worker)."""
    if call_ids:
        await client.hset(keys.gw_cancel, mapping=dict.fromkeys(call_ids, repr(time.time())))


async def forget_cancel(client: Any, keys: RunKeys, call_id: str) -> None:
    """The cancelled call has ended (its final chunk came): its mark is no longer needed."""
    await client.hdel(keys.gw_cancel, call_id)


async def forget_old_cancels(client: Any, keys: RunKeys, older_than_s: float) -> None:
    """Drop the marks older than ``older_than_s`` (a call's timeout): nobody waits for their calls,
    some of which never end (a worker died holding them)."""
    cutoff = time.time() - older_than_s
    old = [call_id for call_id, at in (await client.hgetall(keys.gw_cancel)).items() if not _time(at) >= cutoff]
    if old:
        await client.hdel(keys.gw_cancel, *old)


def _time(value: bytes) -> float:
    try:
        return float(value)
    except ValueError:  # not the gateway's: as old as can be
        return -math.inf


async def live_workers(client: Any, keys: RunKeys, within_s: float) -> dict[str, float]:
    """Workers (not learners, not the evaluator) that heartbeated within ``within_s`` seconds on
    Redis's clock, each with when its process started (its own clock; 0 when its record does not
    say): a worker restarted under its name started after the calls its predecessor held."""
    async with client.pipeline(transaction=False) as pipe:
        raw, (sec, usec) = await pipe.hgetall(keys.consumers).time().execute()
    now, live = sec + usec / 1e6, {}
    for name, rec in raw.items():
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name.startswith(("learner", "eval")):
            continue
        try:
            obj = msgpack.unpackb(rec, raw=False)
            seen = float(obj.get("last_seen", 0))
            clock, uptime = obj.get("clock"), (obj.get("stats") or {}).get("uptime_s")
        except Exception:  # noqa: BLE001  # a garbled record is not a live worker
            continue
        if now - seen <= within_s:
            live[name] = float(clock) - float(uptime) if isinstance(clock, (int, float)) and isinstance(uptime, (int, float)) else 0.0
    return live


class LiveWorkers:
    """:func:`live_workers`, read again once it is ``max_age_s`` old (at once while there are
    none), and once however many calls ask together (agents' turns arrive together)."""

    def __init__(self, client: Any, keys: RunKeys, within_s: float, max_age_s: float = 1.0) -> None:
        self.client, self.keys, self.within_s, self.max_age_s = client, keys, within_s, max_age_s
        self._last: tuple[float, dict[str, float]] = (0.0, {})  # (read at, live workers)
        self._reading: asyncio.Future | None = None

    async def count(self) -> int:
        return len(await self.live())

    async def live(self) -> dict[str, float]:
        """The live workers, each with when its process started (:func:`live_workers`)."""
        read_at, live = self._last
        if live and time.monotonic() - read_at <= self.max_age_s:
            return live
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read())
        return await asyncio.shield(self._reading)  # a caller that goes away leaves the read to the others

    async def _read(self) -> dict[str, float]:
        try:
            live = await live_workers(self.client, self.keys, self.within_s)
            self._last = (time.monotonic(), live)
            return live
        finally:
            self._reading = None
