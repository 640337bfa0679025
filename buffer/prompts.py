"""The prompt queue: enqueue, fill by epochs, leased claims, heartbeats, release, expiry, retiring.

Prompts are entries of the run's ``prompts`` stream, read through the consumer group
``workers``: a claim is a lease (the entry sits in the group's pending list until
:meth:`WorkerClient.complete` acks it with the samples), renewed by heartbeats and taken over by
the next claimer once idle for ``lease_timeout_s`` (docs/architecture.md, Buffer, tells the
rules). A blocked :func:`claim` waits on ``wake:prompts`` from the id the claim script returned,
so no wake-up is lost, capped at :data:`WAIT_CAP_S`. :func:`fill` keeps the queue topped up with
its cursor in Redis.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeGuard, cast

import redis

from buffer import keys as K
from buffer import metrics
from buffer.connection import control_int
from buffer.scripts import claim_keys, complete_keys
from buffer.store import Store
from rlhf_core import metric_names as M
from rlhf_core.errors import UserError
from rlhf_core.records import Prompt
from rlhf_core.wire import WireError

log = logging.getLogger("buffer")

#: Longest single wait on a wake-up stream: expired leases send none, so a blocked claimer re-checks this often.
WAIT_CAP_S = 0.2
ENQUEUE_CHUNK = 512
#: The producer's estimate of the rate prompts leave the queue keeps its peak, halving every this
#: often, measured over at least RATE_MIN_WINDOW_S.
RATE_HALF_LIFE_S = 5.0
RATE_MIN_WINDOW_S = 0.05
#: A consumer is retired once it has not heartbeated for this many lease timeouts and owns no
#: lease; ``last_seen`` and the cut-off are both Redis's clock. A paused worker that was retired
#: learns it at its next heartbeat (:class:`Beats`).
RETIRE_AFTER_LEASES = 10
#: Consumers retired by one script call at most (the rest go at the next sweeps: no long script).
RETIRE_BATCH = 500


@dataclass(frozen=True, eq=False)
class Lease:
    """A claimed prompt. ``lease_id`` is the prompt's stream id; ``how`` is new | reclaimed | released."""

    prompt: Prompt
    lease_id: str
    consumer: str
    delivery_count: int
    how: str = "new"
    learner_version: int = 0  # learner version when the lease was granted (generate with >= this)

    # identity is the stream entry and its holder (Prompt holds a dict, so it is not hashable)
    def __hash__(self) -> int:
        return hash((self.lease_id, self.consumer))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Lease) and (self.lease_id, self.consumer) == (other.lease_id, other.consumer)


def enqueue(store: Store, prompts: Iterable[Prompt]) -> int:
    """Append prompts to the queue (MULTI/EXEC per chunk, so counters match the stream)."""
    k = store.keys
    total = 0
    for chunk in _chunks(prompts, ENQUEUE_CHUNK):
        payloads = [p.encode() for p in chunk]

        def send(payloads=payloads) -> None:
            pipe = store.redis.pipeline(transaction=True)
            _queue(pipe, k, payloads)
            pipe.execute()

        store.retry(send)
        total += len(payloads)
    return total


def _queue(pipe: Any, k: K.RunKeys, payloads: list[bytes]) -> None:
    """Add the encoded prompts to ``pipe``'s MULTI with their counters and a wake-up."""
    for data in payloads:
        pipe.xadd(k.prompts, {K.PROMPT_FIELD: data})
    pipe.hincrby(k.counters, "prompts_enqueued", len(payloads))
    pipe.hincrby(k.counters, "prompts_waiting", len(payloads))
    pipe.xadd(k.wake_prompts, {"e": "enqueue"}, maxlen=K.WAKE_MAXLEN, approximate=True)


def claim(
    store: Store,
    held: dict[str, Lease],
    consumer: str,
    max_prompts: int,
    block_s: float,
    interrupt: Callable[[], bool] | None = None,
) -> list[Lease]:
    """Lease up to ``max_prompts`` prompts (``claim.lua``) into ``held``, waiting up to ``block_s``
    (an undecodable prompt is dead-lettered). ``interrupt`` (a caller with other work, e.g. gateway
    calls): asked after each claim, before waiting; True, or the first wake-up, ends the claim."""
    K.check_consumer(consumer)
    k = store.keys
    lease_ms = str(max(1, int(store.lease_s() * 1000)))
    deadline = time.monotonic() + max(0.0, block_s)
    while True:
        res = store.retry(
            store.scripts.claim,
            keys=claim_keys(k),
            args=[consumer, max(0, int(max_prompts)), lease_ms, repr(time.time()), store.dead_maxlen],
        )
        status, wake_id, version = res[0].decode(), res[1], int(res[2])
        leases: list[Lease] = []
        items = res[4:]
        for i in range(0, len(items), 4):
            lease_id, payload, deliveries, how = items[i].decode(), items[i + 1], int(items[i + 2]), items[i + 3].decode()
            try:
                prompt = Prompt.decode(payload or b"", max_bytes=store.cfg.max_record_bytes)
            except WireError as exc:
                dead_letter_prompt(store, store.run_params(), lease_id, consumer, str(exc), payload or b"")
                held.pop(lease_id, None)
                continue
            leases.append(Lease(prompt, lease_id, consumer, deliveries, how, version))
        if leases:
            for lease in leases:
                held[lease.lease_id] = lease
            return leases
        remaining = deadline - time.monotonic()
        if remaining <= 0 or max_prompts <= 0:
            return []
        if status == "noinit":
            log.debug("run %s is not initialised yet; waiting", k.run_id)
        if interrupt is not None and interrupt():
            return []
        store.wait_on(k.wake_prompts, wake_id, min(remaining, WAIT_CAP_S))
        if interrupt is not None:
            deadline = 0.0  # one more claim (what woke us may be a prompt), then back to the caller


def dead_letter_prompt(store: Store, params: dict[str, Any], lease_id: str, consumer: str, reason: str, payload: bytes) -> None:
    """An undecodable prompt: ack it with no samples (budget returned) and dead-letter it, atomically
    (``complete.lua`` with the prompt itself as the one bad record)."""
    # oldest version 0, no group or prompt id, no filter reason, 0 filtered, 0 good samples, 1 bad record
    args = [lease_id, consumer, repr(time.time()), store.dead_maxlen, params["mode"], params["group_size"], 0, "", "", "", 0,
            0, 1, "prompt", f"undecodable prompt: {reason}", payload]
    store.retry(store.scripts.complete, keys=complete_keys(store.keys, params["mode"]), args=args)


@dataclass
class Beats:
    """This process's heartbeats of one consumer: the running totals (:data:`M.WORKER_SUMMED`) the
    last one sent, and the part the run's ``retired`` sums hold (it was retired while silent)."""

    sent: dict[str, float] | None = None  # None: no heartbeat yet
    base: dict[str, float] = field(default_factory=dict)


def heartbeat(store: Store, held: dict[str, Lease], beats: Beats, consumer: str, version: int | None,
              stats: dict | None) -> list[str]:
    """Renew the leases in ``held`` (this process's leases of ``consumer``); drop from it and
    return the ids lost to other workers."""
    K.check_consumer(consumer)
    ids = list(held)  # a copy: complete() in another thread may drop one meanwhile
    stats = stats or {}
    totals = {k: v for k in M.WORKER_SUMMED if _number(v := stats.get(k))}
    while True:
        shown = {**stats, **{k: v - beats.base.get(k, 0) for k, v in totals.items()}}
        retired, lost = store.retry(
            store.scripts.heartbeat,
            keys=[store.keys.prompts, store.keys.consumers],
            args=[consumer, metrics.pack_consumer(time.time(), version, shown, len(ids)), int(beats.sent is not None), *ids],
        )
        if not retired:
            break
        log.warning("consumer %s of run %s was retired while silent for %d lease timeouts (paused, or cut off from "
                    "Redis): its totals up to its last heartbeat are in the run's retired sums; it goes on from there",
                    consumer, store.keys.run_id, RETIRE_AFTER_LEASES)
        beats.base, beats.sent = beats.sent or {}, None
    beats.sent = totals
    lost_ids = [x.decode() for x in lost]
    for lease_id in lost_ids:
        held.pop(lease_id, None)
    return lost_ids


def redis_time(store: Store) -> float:
    """Redis's clock (seconds since the epoch): the one heartbeats are stamped with."""
    sec, usec = store.retry(store.redis.time)
    return sec + usec / 1e6


def retire(store: Store, before: float) -> list[str]:
    """Retire the consumers last seen before ``before`` (Redis's clock) that own no lease
    (``retire.lua``: their running totals join the ``retired`` hash, their records go). Returns their names."""
    k = store.keys
    args: list[Any] = []
    picked = 0
    consumers = cast(dict[bytes, bytes], store.retry(store.redis.hgetall, k.consumers))  # the client returns bytes
    for name, raw in consumers.items():
        rec = metrics.unpack_record(raw)
        seen = rec.get("last_seen")
        if not isinstance(seen, (int, float)) or seen >= before:
            continue
        picked += 1
        if picked > RETIRE_BATCH:
            break
        stats = rec.get("stats")
        if not isinstance(stats, dict):
            stats = {}
        totals = [(stat, v) for stat in M.WORKER_SUMMED if _addable(v := stats.get(stat))]
        args += [name, hashlib.sha1(raw).hexdigest(), len(totals)]
        for stat, value in totals:
            args += [stat, repr(value)]
    gone = store.retry(store.scripts.retire, keys=[k.prompts, k.consumers, k.retired], args=args)
    return [name.decode() for name in gone]


def _number(x: Any) -> TypeGuard[float]:
    """A finite number (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _addable(x: Any) -> TypeGuard[float]:
    """A number HINCRBYFLOAT can add (not a bool, not NaN or infinite), other than 0."""
    return _number(x) and x != 0


def release(store: Store, held: dict[str, dict[str, Lease]], leases: Iterable[Lease]) -> int:
    """Give ``leases`` back un-done (``release.lua``) and drop them from ``held`` (consumer -> leases)."""
    by_consumer: dict[str, list[str]] = {}
    for lease in leases:
        by_consumer.setdefault(lease.consumer, []).append(lease.lease_id)
    k = store.keys
    n = 0
    for consumer, ids in by_consumer.items():
        n += int(store.retry(store.scripts.release, keys=[k.prompts, k.counters, k.wake_prompts, k.params], args=[consumer, *ids]))
        mine = held.get(consumer, {})
        for lease_id in ids:
            mine.pop(lease_id, None)
    return n


def expire(store: Store, consumer: str) -> int:
    """Expire ``consumer``'s leases now (``expire.lua``): the next claimers reclaim them as after the lease timeout."""
    K.check_consumer(consumer)
    k = store.keys
    return int(store.retry(store.scripts.expire, keys=[k.prompts, k.wake_prompts],
                           args=[consumer, max(1, int(store.lease_s() * 1000))]))


class PromptsExhausted(UserError):
    """The prompt source yielded nothing for an epoch (an empty data set)."""


class Filler:
    """State of :func:`fill` in one process: the open iterator of the current epoch, reused (no
    re-read of the data set) while its position matches the cursor in Redis."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.epoch = -1
        self.index = -1
        self.it: Iterator[Prompt] | None = None
        self.clock = clock
        self.rate = 0.0  # prompts/s taken from the queue: the recent peak, decaying (RATE_HALF_LIFE_S)
        self._taken: tuple[float, int] | None = None  # (clock, prompts taken so far) at the last look

    def observe(self, taken: int) -> float:
        """Update :attr:`rate` from ``taken``, the run's count of prompts taken from the queue so
        far (enqueued - waiting), and return it."""
        now = self.clock()
        if self._taken is not None:
            then, before = self._taken
            if now - then < RATE_MIN_WINDOW_S:
                return self.rate  # too soon to measure: the window goes on from the last look
            decayed = self.rate * 0.5 ** ((now - then) / RATE_HALF_LIFE_S)
            self.rate = max(max(0, taken - before) / (now - then), decayed)
        self._taken = (now, taken)
        return self.rate

    def iterator(self, source_fn: Callable[[int], Iterable[Prompt]], epoch: int, index: int) -> Iterator[Prompt]:
        if self.it is None or (self.epoch, self.index) != (epoch, index):
            self.it = itertools.islice(iter(source_fn(epoch)), index, None)
            self.epoch, self.index = epoch, index
        return self.it

    def advanced(self, epoch: int, index: int) -> None:
        self.epoch, self.index = epoch, index

    def forget(self) -> None:
        self.it = None


def fill(
    store: Store,
    filler: Filler,
    source_fn: Callable[[int], Iterable[Prompt]],
    epochs: int,
    low_watermark: int,
    high_watermark: int | None = None,
    lead_s: float = 0.0,
) -> int:
    """Top up the queue once: if fewer than ``low_watermark`` prompts wait, enqueue up to
    ``high_watermark`` (default twice the low) from epochs ``0 .. epochs-1`` of ``source_fn(epoch)``,
    the cursor moving in the same WATCHed MULTI; returns the number enqueued. ``lead_s``: the
    watermarks cover what workers take in ``lead_s`` at their recent rate (:meth:`Filler.observe`)."""
    high = max(low_watermark, high_watermark if high_watermark is not None else 2 * low_watermark)
    while True:
        try:
            return store.retry(_fill_once, store, filler, source_fn, epochs, low_watermark, high, lead_s)
        except redis.exceptions.WatchError:
            filler.forget()  # another producer moved the cursor; re-read it
            log.debug("fill cursor of run %s moved under us; retrying", store.keys.run_id)
        except BaseException:
            filler.forget()  # nothing was enqueued; a generator that raised is done: re-open it at the cursor
            raise


def _fill_once(store: Store, filler: Filler, source_fn, epochs: int, low: int, high: int, lead_s: float) -> int:
    k = store.keys
    with store.redis.pipeline(transaction=True) as pipe:
        pipe.watch(k.fill)
        state = pipe.hgetall(k.fill)
        raw_waiting, raw_enqueued = pipe.hmget(k.counters, "prompts_waiting", "prompts_enqueued")
        waiting = control_int(raw_waiting, k.counters, "prompts_waiting")
        if lead_s > 0:
            taken = control_int(raw_enqueued, k.counters, "prompts_enqueued") - waiting
            need = math.ceil(filler.observe(taken) * lead_s)
            if need > low:
                low, high = need, max(need, math.ceil(high * need / max(low, 1)))
        epoch = control_int(state.get(b"epoch"), k.fill, "epoch")
        index = control_int(state.get(b"index"), k.fill, "index")
        # "done" is every one of `epochs` enqueued, the cursor at or past the last: a flag that says
        # otherwise (epochs=0, or a run resumed with more or fewer epochs than it had) is rewritten below
        done = epoch >= epochs
        if (state.get(b"done") == b"1") == done and (done or waiting >= low):
            pipe.unwatch()
            return 0
        batch: list[Prompt] = []
        while len(batch) < high - waiting and epoch < epochs:
            it = filler.iterator(source_fn, epoch, index)
            got = list(itertools.islice(it, high - waiting - len(batch)))
            if not got and index == 0:
                raise PromptsExhausted(f"the prompt source yielded no prompts for epoch {epoch}: is the data set empty?")
            batch.extend(got)
            index += len(got)
            filler.advanced(epoch, index)
            if len(batch) < high - waiting:  # this epoch is exhausted
                epoch, index = epoch + 1, 0
                filler.forget()
        done = epoch >= epochs
        pipe.multi()
        if batch:
            _queue(pipe, k, [prompt.encode() for prompt in batch])
        pipe.hset(k.fill, mapping={"epoch": epoch, "index": index, "done": int(done)})
        pipe.execute()
        return len(batch)


def drained(store: Store, epochs: int) -> bool:
    """Every one of ``epochs`` is enqueued (the fill cursor is at or past the last) and every
    prompt completed or dead-lettered (the stream is empty), read in one MULTI. Once true it stays true."""
    k = store.keys

    def read() -> list[Any]:
        pipe = store.redis.pipeline(transaction=True)
        pipe.hget(k.fill, "epoch")
        pipe.xlen(k.prompts)
        return pipe.execute()

    epoch, left = store.retry(read)
    return control_int(epoch, k.fill, "epoch") >= epochs and int(left) == 0


def _chunks(items: Iterable[Prompt], n: int) -> Iterator[list[Prompt]]:
    it = iter(items)
    while chunk := list(itertools.islice(it, n)):
        yield chunk
