"""The buffer's role clients, each with only what its role calls (docs/architecture.md, Buffer).

The clients of a process share its :class:`~buffer.store.Store` and hold only their own
client-side state; every fact that matters after a crash is in Redis. The redis-py client is
thread-safe, so they may serve different threads, but one consumer name must not be driven from
two threads at once.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Self

from buffer import keys as K
from buffer import metrics, prompts, samples
from buffer.connection import control_int
from buffer.store import Store
from rlhf_core.config import BufferConfig
from rlhf_core.errors import UserError
from rlhf_core.records import Prompt, Sample

log = logging.getLogger("buffer")


class BufferClient:
    """One role's view of one run's buffer; what every role does. See the package docstring for the API."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.redis, self.keys, self.retry = store.redis, store.keys, store.retry

    @classmethod
    def connect(cls, url: str | None = None, run_id: str | None = None, cfg: BufferConfig | None = None,
                setting: str = "buffer.url") -> Self:
        """A client over a new store (:meth:`buffer.store.Store.connect`)."""
        return cls(Store.connect(url, run_id, cfg, setting))

    def close(self) -> None:
        self.store.close()

    def initialised(self) -> bool:
        return self.store.initialised()

    def run_params(self) -> dict[str, Any]:
        """The run's parameters (cached: they never change once set)."""
        return self.store.run_params()

    def publish_stats(self, component: str, stats: dict[str, Any]) -> None:
        """Store a component's latest stats (e.g. the learner's metrics) for the monitor: ``metrics()["stats"][component]``."""
        self.retry(self.redis.hset, self.keys.stats, component, metrics.pack_stats(stats))

    def dead_letter(self, reason: str, producer: str, raw: bytes) -> None:
        """Record a bad sample (e.g. one whose reward function raised) in the dead-letter stream."""
        k = self.keys

        size, sha = len(raw), hashlib.sha1(raw).hexdigest() if len(raw) > K.DEAD_RAW_MAX else ""
        raw = raw[: K.DEAD_RAW_MAX]  # as the scripts' dead_letter keeps it

        def send() -> None:
            pipe = self.redis.pipeline(transaction=True)
            pipe.xadd(k.dead, {K.D_KIND: "sample", K.D_REASON: reason[:4096], K.D_PRODUCER: producer, K.D_RAW: raw,
                               K.D_RAW_BYTES: size, K.D_RAW_SHA1: sha, K.D_SOURCE: "", K.D_TIME: repr(time.time())},
                      maxlen=self.store.dead_maxlen, approximate=True)
            pipe.hincrby(k.counters, "dead_letters", 1)
            pipe.hincrby(k.counters, "samples_dead_lettered", 1)
            pipe.execute()

        self.retry(send)


class ProducerClient(BufferClient):
    """Fills the run's prompt queue, with its cursor in Redis so a restarted producer goes on."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self._filler = prompts.Filler()

    def enqueue_prompts(self, items: Iterable[Prompt]) -> int:
        return prompts.enqueue(self.store, items)

    def fill_prompts(self, source_fn: Callable[[int], Iterable[Prompt]], epochs: int, low_watermark: int,
                     high_watermark: int | None = None, lead_s: float = 0.0) -> int:
        """Top up the prompt queue once (call it periodically, with ``lead_s`` a few times the
        period: the queue then keeps up with the workers' rate); see :func:`buffer.prompts.fill`."""
        return prompts.fill(self.store, self._filler, source_fn, epochs, low_watermark, high_watermark, lead_s)

    def fill_state(self) -> dict[str, int | bool]:
        """The producer cursor: ``{"epoch", "index", "done"}``."""
        raw = self.retry(self.redis.hgetall, self.keys.fill)
        return {"epoch": int(raw.get(b"epoch", 0)), "index": int(raw.get(b"index", 0)), "done": raw.get(b"done") == b"1"}

    def restore_fill_state(self, state: dict[str, Any], admitted: int = 0) -> bool:
        """Set the producer cursor to a learner checkpoint's ``state`` when this run has none (a resume
        on a fresh Redis), with the ``admitted`` samples its updates took. Returns whether it was set."""
        def once() -> bool:
            with self.redis.pipeline(transaction=True) as pipe:
                pipe.watch(self.keys.fill)
                if pipe.exists(self.keys.fill):
                    pipe.unwatch()
                    return False
                pipe.multi()
                pipe.hset(self.keys.fill, mapping={"epoch": int(state["epoch"]), "index": int(state["index"]),
                                                   "done": int(bool(state.get("done")))})
                pipe.hincrby(self.keys.counters, "admitted", int(admitted))
                pipe.execute()  # a WatchError (a producer got there first) propagates: nothing was set
                return True

        return self.retry(once)


class GatewayClient(BufferClient):
    """Appends rlhf-gateway's rewarded episodes as groups, keeping each accepted reward until then."""

    def append_group(self, producer: str, group: list[Sample], kept: Sequence[str] = (),
                     filtered: str | None = None) -> str | None:
        """Append a group that no prompt lease produced (rlhf-gateway's episodes), its invalid
        samples dead-lettered, in one atomic step (``append.lua``). Returns the stream entry id, ""
        when no sample was valid or the group was ``filtered`` (a reason of
        :data:`rlhf_core.dapo.FILTER_REASONS`), or None when one of ``kept`` (its fields in ``P
        gw:rewarded``, deleted in the same step) is gone: the group was appended before."""
        K.check_consumer(producer)
        args = samples.prepare_external(self.store, self.run_params(), producer, group, kept, filtered)
        k = self.keys
        res = self.retry(self.store.scripts.append, keys=[k.samples, k.counters, k.dead, k.gw_rewarded, k.params], args=args)
        return None if res is None else res.decode() if isinstance(res, bytes) else str(res)

    def keep_rewarded(self, field: str, sample: Sample) -> None:
        """Keep a rewarded gateway session's sample until its group is appended (``kept`` of :meth:`append_group`)."""
        self.retry(self.redis.hset, self.keys.gw_rewarded, field, sample.encode())

    def rewarded_kept(self, fields: Sequence[str] | None = None) -> dict[str, bytes]:
        """The kept rewarded samples not yet appended (of ``fields`` only, when given), raw
        (decode with :meth:`Sample.decode`)."""
        k = self.keys.gw_rewarded
        if fields is not None:
            values = self.retry(self.redis.hmget, k, list(fields)) if fields else []
            return {f: v for f, v in zip(fields, values) if isinstance(v, bytes)}  # None: not kept
        return {f.decode() if isinstance(f, bytes) else str(f): v for f, v in self.retry(self.redis.hgetall, k).items()
                if isinstance(v, bytes)}

    def forget_rewarded(self, field: str) -> None:
        self.retry(self.redis.hdel, self.keys.gw_rewarded, field)


class MonitorClient(BufferClient):
    """Reads the run's state for people and launchers, and steers it: the worker target, a dead
    worker's leases, deleting the run."""

    def metrics(self) -> dict[str, Any]:
        """One snapshot of counters, gauges, histograms, consumers and published stats (see :func:`buffer.metrics.collect`)."""
        params = self.run_params() if self.initialised() else None
        return metrics.collect(self.redis, self.retry, self.keys, params)

    def stats(self, component: str) -> dict[str, Any] | None:
        """One component's latest stats (what :meth:`publish_stats` stored), None when there are none."""
        raw = self.retry(self.redis.hget, self.keys.stats, component)
        return metrics.unpack_record(raw) if isinstance(raw, bytes) else None

    def dead_letters(self, count: int = 100) -> list[dict[str, Any]]:
        """The newest dead letters, oldest first: ``{"id", "kind", "reason", "producer", "raw",
        "raw_bytes", "raw_sha1", "source", "ts"}`` (``raw``: the first ``keys.DEAD_RAW_MAX`` bytes)."""
        entries = self.retry(self.redis.xrevrange, self.keys.dead, count=count) or []
        out = []
        for entry_id, got in reversed(entries):
            fields: dict[Any, Any] = got or {}
            rec: dict[str, Any] = {"id": entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)}
            for name in (K.D_KIND, K.D_REASON, K.D_PRODUCER, K.D_SOURCE, K.D_TIME, K.D_RAW_SHA1):
                rec[name] = fields.get(name.encode(), b"").decode("utf-8", "replace")
            rec[K.D_RAW] = fields.get(K.D_RAW.encode(), b"")
            size = fields.get(K.D_RAW_BYTES.encode())
            rec[K.D_RAW_BYTES] = int(size) if size is not None and size.isdigit() else len(rec[K.D_RAW])
            out.append(rec)
        return out

    def admission_budget(self) -> int:
        """Samples that may be admitted for generation now (pacing and, if on, the rate limiter): the snapshot's."""
        return int(self.metrics()["admission_budget"])

    def set_worker_target(self, workers: int) -> int | None:
        """Ask the run's launcher to keep ``workers`` worker actors (``launcher=ray`` scales to it);
        returns the previous target (None: never set)."""
        if workers < 0:
            raise UserError(f"the number of workers must be >= 0, got {workers}")
        old = self.retry(self.redis.hget, self.keys.control, K.CONTROL_WORKERS)
        self.retry(self.redis.hset, self.keys.control, K.CONTROL_WORKERS, int(workers))
        return None if old is None else control_int(old, self.keys.control, K.CONTROL_WORKERS)

    def expire_leases(self, consumer: str) -> int:
        """``consumer`` is known dead: its leases go to the next claimers now, as after
        ``lease_timeout_s`` (:func:`buffer.prompts.expire`). Returns how many it held."""
        return prompts.expire(self.store, consumer)

    def delete_run(self) -> int:
        """Delete this run's keys (SCAN by prefix + UNLINK), no other; close this process's other clients of the run."""
        found = self.retry(lambda: list(self.redis.scan_iter(match=self.keys.pattern(), count=1000)))
        n = sum(self.retry(self.redis.unlink, *found[i:i + 500]) for i in range(0, len(found), 500))
        self.store.cached_params = None
        log.info("deleted %d key(s) of run %s", n, self.keys.run_id)
        return n
