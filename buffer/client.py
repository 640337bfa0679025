"""The :class:`Buffer` facade: the one object workers, the learner and the monitor use.

It owns the Redis client (injected, or opened by :meth:`Buffer.connect`), the run's key
names, the scripts and the retry policy (bundled in a :class:`~buffer.store.Store`), and
delegates the work to :mod:`buffer.prompts`, :mod:`buffer.samples`, :mod:`buffer.replay`,
:mod:`buffer.metrics` and :mod:`buffer.pacing`, handing each the store, the run parameters and
the piece of client-side state it updates. Nothing below imports this module. Client-side state is
small and only a cache or a courtesy: the leases this process holds (renewed by heartbeat),
the learner's read-but-uncommitted entries, the open iterator of :meth:`fill_prompts`. Every
fact that matters after a crash is in Redis.

Threads: the redis-py client underneath is thread-safe, and one ``Buffer`` may serve different
roles from different threads (the learner reads batches while a producer thread fills the
prompt queue). One consumer name must not be driven from two threads at once; give each
thread its own consumer name, or a lock.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import redis

from buffer import keys as K
from buffer import metrics, pacing, prompts, replay, samples
from buffer.connection import Retrying, connect, control_int, redact
from buffer.prompts import Lease
from buffer.samples import Batch
from buffer.scripts import Scripts, complete_keys, run_many
from buffer.store import Store
from rlhf_core.config import BufferConfig, replay_mode
from rlhf_core.errors import UserError
from rlhf_core.records import Prompt, Sample

log = logging.getLogger("buffer")

_INT_PARAMS = ("batch_size", "group_size", "max_staleness", "max_deliveries", "min_size_to_sample",
               "capacity", "max_reuse", "dead_maxlen")
_OPT_INT_PARAMS = ("max_response_tokens", "vocab_size", "lookahead")
_FLOAT_PARAMS = ("error_buffer", "lease_timeout_s")
_OPT_FLOAT_PARAMS = ("samples_per_insert",)
_STR_PARAMS = ("mode", "sampling")
#: Every field of the run's ``params`` hash (the Lua scripts read some of them by name).
PARAM_NAMES = _INT_PARAMS + _OPT_INT_PARAMS + _FLOAT_PARAMS + _OPT_FLOAT_PARAMS + _STR_PARAMS


class Completion(NamedTuple):
    """A validated, encoded group ready for :meth:`Buffer.complete_many` (from :meth:`Buffer.prepare`)."""

    lease: Lease
    args: list[Any]


class RunNotInitialised(UserError, LookupError):
    """The run has no parameters in Redis yet (the learner/launcher calls ``init_run``)."""


class RunParamsMismatch(UserError, ValueError):
    """``init_run`` was called with parameters that differ from the ones the run already has."""


class Buffer:
    """One run's buffer on one Redis. See the package docstring for the API in one page."""

    def __init__(self, client: redis.Redis, run_id: str | None = None, cfg: BufferConfig | None = None, url: str | None = None) -> None:
        self.cfg = cfg or BufferConfig()
        self.redis = client
        self.keys = K.RunKeys.for_run(run_id or self.cfg.run_id)
        self.url = url or _url_of(client)
        self.retry = Retrying(self.url, self.cfg.max_retry_s)
        self.scripts = Scripts(client)
        self._store = Store(client, self.retry, self.keys, self.scripts, self.cfg)
        self._params: dict[str, Any] | None = None
        self._leases: dict[str, dict[str, Lease]] = {}
        self._beats: dict[str, prompts.Beats] = {}  # per consumer this process heartbeats
        self._learners: dict[str, samples.LearnerState] = {}
        self._filler = prompts.Filler()
        self._next_retire = 0.0  # time.monotonic() of this process's next sweep of dead consumers

    @classmethod
    def connect(cls, url: str | None = None, run_id: str | None = None, cfg: BufferConfig | None = None,
                setting: str = "buffer.url") -> "Buffer":
        """Open a connection (``url`` or ``cfg.url``) and check Redis answers (see :func:`buffer.connection.connect`;
        its errors name ``setting``, where the URL came from)."""
        cfg = cfg or BufferConfig()
        url = url or cfg.url
        if not url:
            raise UserError("no Redis URL: set buffer.url=redis://host:port/0 (rlhf-run starts a private Redis when it is null)")
        client = connect(url, cfg, setting)
        log.info("buffer: run %s on %s", run_id or cfg.run_id, redact(url))
        return cls(client, run_id, cfg, url=url)

    def close(self) -> None:
        self.redis.close()

    @property
    def cfg_dead_maxlen(self) -> int:
        return int(self.cfg.dead_letter_maxlen)

    # ---- run parameters ----------------------------------------------------------------

    def init_run(
        self,
        batch_size: int,
        group_size: int,
        max_staleness: int,
        max_response_tokens: int | None = None,
        vocab_size: int | None = None,
    ) -> dict[str, Any]:
        """Store the run parameters once (the first caller's win) and create the consumer groups.

        Calling it again with the same values is a no-op; with different values it raises
        :class:`RunParamsMismatch` (a new run needs a new ``buffer.run_id``, or :meth:`delete_run`).
        Replay/limiter and lookahead settings come from this process's ``BufferConfig``.
        """
        cfg = self.cfg
        if group_size < 1 or batch_size < group_size:
            raise UserError(f"batch_size {batch_size} must be >= group_size {group_size} >= 1: a batch holds whole groups")
        if max_staleness < 0:
            raise UserError(f"max_staleness must be >= 0, got {max_staleness}")
        spi = cfg.samples_per_insert
        if spi is not None and spi > cfg.max_reuse:
            raise UserError(
                f"buffer.samples_per_insert {spi} exceeds buffer.max_reuse {cfg.max_reuse}: each sample would have to be "
                "drawn more often than it may be used, and the limiter would stall; raise max_reuse or lower samples_per_insert"
            )
        mode = "replay" if replay_mode(cfg) else "fifo"
        wanted: dict[str, Any] = {
            "batch_size": batch_size, "group_size": group_size, "max_staleness": max_staleness,
            "max_response_tokens": max_response_tokens, "vocab_size": vocab_size,
            "max_deliveries": cfg.max_deliveries, "lease_timeout_s": cfg.lease_timeout_s,
            "mode": mode, "sampling": cfg.sampling, "max_reuse": cfg.max_reuse, "samples_per_insert": spi,
            "min_size_to_sample": cfg.min_size_to_sample, "error_buffer": cfg.error_buffer,
            "capacity": cfg.capacity, "dead_maxlen": self.cfg_dead_maxlen, "lookahead": cfg.lookahead,
        }
        assert set(wanted) == set(PARAM_NAMES)
        args: list[Any] = []
        for name, value in wanted.items():
            args += [name, "" if value is None else repr(value) if isinstance(value, float) else value]
        k = self.keys
        flat = self.retry(self.scripts.init_run, keys=[k.params, k.version, k.prompts, k.samples, k.wake_prompts], args=args)
        stored = _parse_params({flat[i]: flat[i + 1] for i in range(0, len(flat), 2)})
        diff = {n: (stored.get(n), v) for n, v in wanted.items() if stored.get(n) != v}
        if diff:
            shown = ", ".join(f"{n}: run has {a!r}, you passed {b!r}" for n, (a, b) in diff.items())
            raise RunParamsMismatch(
                f"run {k.run_id!r} already exists with other parameters ({shown}); use a new buffer.run_id, "
                f"or delete the old run's keys first (Buffer.delete_run / rlhf-monitor)"
            )
        self._params = stored
        return dict(stored)

    def initialised(self) -> bool:
        return self._params is not None or bool(self.retry(self.redis.exists, self.keys.params))

    def run_params(self) -> dict[str, Any]:
        """The run's parameters (cached: they never change once set)."""
        if self._params is None:
            raw = self.retry(self.redis.hgetall, self.keys.params)
            if not raw:
                raise RunNotInitialised(
                    f"run {self.keys.run_id!r} has no parameters in Redis yet: the learner (or rlhf-run) calls "
                    "init_run when it starts; check buffer.run_id and buffer.url match the learner's"
                )
            self._params = _parse_params(raw)
        return dict(self._params)

    # ---- producer ------------------------------------------------------------------------

    def enqueue_prompts(self, items: Iterable[Prompt]) -> int:
        return prompts.enqueue(self._store, items)

    def fill_prompts(
        self,
        source_fn: Callable[[int], Iterable[Prompt]],
        epochs: int,
        low_watermark: int,
        high_watermark: int | None = None,
        lead_s: float = 0.0,
    ) -> int:
        """Top up the prompt queue once (call it periodically, with ``lead_s`` a few times the
        period: the queue then keeps up with the workers' rate); see :func:`buffer.prompts.fill`."""
        return prompts.fill(self._store, self._filler, source_fn, epochs, low_watermark, high_watermark, lead_s)

    def fill_state(self) -> dict[str, int | bool]:
        """The producer cursor: ``{"epoch", "index", "done"}``."""
        raw = self.retry(self.redis.hgetall, self.keys.fill)
        return {"epoch": int(raw.get(b"epoch", 0)), "index": int(raw.get(b"index", 0)), "done": raw.get(b"done") == b"1"}

    def restore_fill_state(self, state: dict[str, Any], admitted: int = 0) -> bool:
        """Set the producer cursor to ``state`` (a learner checkpoint's) when this run has none, so
        a run resumed on a fresh Redis goes on from where its prompts had reached, not from the
        first one (the prompts queued but untrained at that checkpoint are skipped, never trained
        twice). Returns whether it was set.

        ``admitted``: the samples the checkpoint's updates took (updates x batch size), counted as
        admitted on that fresh Redis too: pacing's bound counts from the learner's updates, and
        from 0 admitted it let about ``updates`` batches be generated at once, most then too stale."""
        mapping = {"epoch": int(state["epoch"]), "index": int(state["index"]), "done": int(bool(state.get("done")))}

        def once() -> bool:
            with self.redis.pipeline(transaction=True) as pipe:
                pipe.watch(self.keys.fill)
                if pipe.exists(self.keys.fill):
                    pipe.unwatch()
                    return False
                pipe.multi()
                pipe.hset(self.keys.fill, mapping=mapping)
                pipe.hincrby(self.keys.counters, "admitted", int(admitted))
                pipe.execute()  # a WatchError (a producer got there first) propagates: nothing was set
                return True

        return self.retry(once)

    # ---- worker --------------------------------------------------------------------------

    def claim(self, consumer: str, max_prompts: int, block_s: float = 0.0,
              interrupt: Callable[[], bool] | None = None) -> list[Lease]:
        """Lease up to ``max_prompts`` prompts within the admission budget, waiting up to ``block_s``
        (``interrupt``: return when it says True before a wait, or at the first wake-up, even with
        nothing leased; a worker serving the gateway is woken so for its calls, which are not prompts).

        Prompts of dead consumers (no heartbeat for ``lease_timeout_s``) come back here with a
        higher ``delivery_count``. Generate with weights of version >= ``lease.learner_version``
        to keep pacing's staleness bound.
        """
        held = self._leases.setdefault(consumer, {})
        return prompts.claim(self._store, held, consumer, max_prompts, block_s, self._lease_s(), self.run_params, interrupt)

    def _lease_s(self) -> float:
        """The run's lease timeout (same for every worker); this process's setting until init_run ran."""
        return self._params["lease_timeout_s"] if self._params else self.cfg.lease_timeout_s

    def heartbeat(self, consumer: str, version: int | None = None, stats: dict | None = None) -> list[str]:
        """Renew this process's leases of ``consumer`` and record it for the monitor; once every
        lease timeout, also retire the run's long-dead consumers (:meth:`retire_consumers`).

        Call every ``heartbeat_interval_s``. Returns the lease ids lost to other workers (this
        one was silent for longer than ``lease_timeout_s``): stop working on those.
        """
        beats = self._beats.setdefault(consumer, prompts.Beats())
        lost = prompts.heartbeat(self._store, self._leases.get(consumer, {}), beats, consumer, version, stats)
        if time.monotonic() >= self._next_retire:
            self.retire_consumers()
        return lost

    def retire_consumers(self, before: float | None = None) -> list[str]:
        """Retire the consumers silent since ``before`` (seconds since the epoch on Redis's clock;
        default ``prompts.RETIRE_AFTER_LEASES`` lease timeouts ago) that own no lease: their stats'
        running totals join ``metrics()["retired"]``, their records go (:func:`buffer.prompts.retire`).
        Returns their names."""
        lease_s = self._lease_s()
        self._next_retire = time.monotonic() + lease_s
        if before is None:
            before = prompts.redis_time(self._store) - prompts.RETIRE_AFTER_LEASES * lease_s
        gone = prompts.retire(self._store, before)
        if gone:
            log.info("retired %d consumer(s) of run %s silent since %s: %s", len(gone), self.keys.run_id,
                     time.strftime("%H:%M:%S", time.localtime(before)), ", ".join(gone[:10]) + (" ..." if len(gone) > 10 else ""))
        return gone

    def complete(self, lease: Lease, group: list[Sample], rejected: Iterable[tuple[str, str, bytes]] = (),
                 filtered: str | None = None) -> str:
        """Append the group and ack the prompt atomically. Returns ``appended``, ``empty`` (no
        valid sample: the prompt is acked, its budget returned), ``filtered`` (``filtered`` names
        why the group teaches nothing: acked and budget returned like an empty one, nothing
        appended, counted per reason) or ``duplicate`` (the prompt was already completed; nothing
        written). Invalid samples go to the dead-letter stream, and so do the ``(kind, reason,
        raw)`` records in ``rejected``, in the same atomic step."""
        params = self.run_params()
        args = samples.prepare(self._store, params, lease, group, rejected, filtered)
        res = self.retry(self.scripts.complete, keys=complete_keys(self.keys, params["mode"]), args=args)
        self._leases.get(lease.consumer, {}).pop(lease.lease_id, None)
        return samples.complete_status(res)

    def prepare(self, lease: Lease, group: list[Sample], rejected: Iterable[tuple[str, str, bytes]] = (),
                filtered: str | None = None) -> Completion:
        """Validate and encode a group for :meth:`complete_many` ahead of sending (e.g. in a
        scoring thread, so the thread that talks to Redis only sends). Nothing is written yet."""
        return Completion(lease, samples.prepare(self._store, self.run_params(), lease, group, rejected, filtered))

    def complete_many(self, items: Iterable[Completion | tuple[Lease, list[Sample]]]) -> list[str]:
        """Like :meth:`complete` for several prompts in one round trip (each one atomic on its own).
        Items are ``(lease, samples)`` or :meth:`prepare` results. Safe to retry as a whole."""
        prepared = [it if isinstance(it, Completion) else self.prepare(*it) for it in items]
        keys = complete_keys(self.keys, self.run_params()["mode"])

        results = self.retry(run_many, self.redis, self.scripts.complete, keys=keys, arg_lists=[c.args for c in prepared])
        for c in prepared:
            self._leases.get(c.lease.consumer, {}).pop(c.lease.lease_id, None)
        return [samples.complete_status(r) for r in results]

    def append_group(self, producer: str, group: list[Sample], kept: Sequence[str] = (),
                     filtered: str | None = None) -> str | None:
        """Append a group that no prompt lease produced (rlhf-gateway's episodes) to the sample
        stream, its invalid samples to the dead-letter stream, in one atomic step. Returns the
        stream entry id, or "" when no sample was valid or the group was ``filtered`` (a reason
        of :data:`rlhf_core.dapo.FILTER_REASONS`: counted as a worker's filtered group, nothing
        appended). An appended group counts as admitted, as a prompt's does (it takes a
        prompt's place in the learner's batches: pacing holds the run's own prompts back by as
        much), and a drop gives it back.

        ``kept``: the fields in ``P gw:rewarded`` (:meth:`keep_rewarded`) holding the group's
        samples until now; they are deleted in the same step, and when one of them is gone the
        group was appended before (a retry whose first reply was lost) and None is returned."""
        K.check_consumer(producer)
        args = samples.prepare_external(self._store, self.run_params(), producer, group, kept, filtered)
        k = self.keys
        res = self.retry(self.scripts.append, keys=[k.samples, k.counters, k.dead, k.gw_rewarded, k.params], args=args)
        if res is None:
            return None
        return res.decode() if isinstance(res, bytes) else str(res)

    def keep_rewarded(self, field: str, sample: Sample) -> None:
        """Keep a rewarded gateway session's sample until its group is appended (``kept`` of
        :meth:`append_group`): a gateway that stops or dies meanwhile loses no reward it accepted."""
        self.retry(self.redis.hset, self.keys.gw_rewarded, field, sample.encode())

    def rewarded_kept(self, fields: Sequence[str] | None = None) -> dict[str, bytes]:
        """The kept rewarded samples not yet appended (of ``fields`` only, when given), raw
        (decode with :meth:`Sample.decode`)."""
        k = self.keys.gw_rewarded
        if fields is not None:
            values = self.retry(self.redis.hmget, k, list(fields)) if fields else []
            return {f: v for f, v in zip(fields, values) if v is not None}
        return {f.decode() if isinstance(f, bytes) else str(f): v for f, v in self.retry(self.redis.hgetall, k).items()}

    def forget_rewarded(self, field: str) -> None:
        self.retry(self.redis.hdel, self.keys.gw_rewarded, field)

    def release(self, leases: Lease | Iterable[Lease]) -> int:
        """Give prompts back un-done (shutdown): re-delivered to the next claimer, budget returned,
        not counted as a delivery."""
        return prompts.release(self._store, self._leases, [leases] if isinstance(leases, Lease) else leases)

    def expire_leases(self, consumer: str) -> int:
        """``consumer`` is known dead (its process or its node lost): its leases go to the next
        claimers now, as they would after ``lease_timeout_s`` without its heartbeat (a delivery
        counted, nothing returned to the budget). Returns how many it held."""
        return prompts.expire(self._store, consumer, self._lease_s())

    def dead_letter(self, reason: str, producer: str, raw: bytes, kind: str = "sample") -> None:
        """Record a bad record (e.g. a sample whose reward function raised) in the dead-letter stream."""
        counter = {"sample": "samples_dead_lettered", "prompt": "prompts_dead_lettered"}.get(kind, "entries_dead_lettered")
        k = self.keys

        size, sha = len(raw), hashlib.sha1(raw).hexdigest() if len(raw) > K.DEAD_RAW_MAX else ""
        raw = raw[: K.DEAD_RAW_MAX]  # as the scripts' dead_letter keeps it

        def send() -> None:
            pipe = self.redis.pipeline(transaction=True)
            pipe.xadd(k.dead, {K.D_KIND: kind, K.D_REASON: reason[:4096], K.D_PRODUCER: producer, K.D_RAW: raw,
                               K.D_RAW_BYTES: size, K.D_RAW_SHA1: sha, K.D_SOURCE: "", K.D_TIME: repr(time.time())},
                      maxlen=self.cfg_dead_maxlen, approximate=True)
            pipe.hincrby(k.counters, "dead_letters", 1)
            pipe.hincrby(k.counters, counter, 1)
            pipe.execute()

        self.retry(send)

    def dead_letter_prompt(self, lease_id: str, consumer: str, reason: str, payload: bytes) -> None:
        """An undecodable prompt: ack it with no samples (budget returned) and dead-letter it, atomically."""
        prompts.dead_letter_prompt(self._store, self.run_params(), lease_id, consumer, reason, payload)
        self._leases.get(consumer, {}).pop(lease_id, None)

    def dead_letters(self, count: int = 100) -> list[dict[str, Any]]:
        """The newest dead letters, oldest first: ``{"id", "kind", "reason", "producer", "raw",
        "raw_bytes", "raw_sha1", "source", "ts"}``. ``raw`` is the record's first
        ``keys.DEAD_RAW_MAX`` bytes; ``raw_bytes`` its full size, ``raw_sha1`` (when ``raw`` is a
        prefix) the SHA-1 of the whole record."""
        entries = self.retry(self.redis.xrevrange, self.keys.dead, count=count)
        out = []
        for entry_id, fields in reversed(entries):
            rec: dict[str, Any] = {"id": entry_id.decode()}
            for name in (K.D_KIND, K.D_REASON, K.D_PRODUCER, K.D_SOURCE, K.D_TIME, K.D_RAW_SHA1):
                rec[name] = fields.get(name.encode(), b"").decode("utf-8", "replace")
            rec[K.D_RAW] = fields.get(K.D_RAW.encode(), b"")
            size = fields.get(K.D_RAW_BYTES.encode())
            rec[K.D_RAW_BYTES] = int(size) if size is not None and size.isdigit() else len(rec[K.D_RAW])
            out.append(rec)
        return out

    def admission_budget(self) -> int:
        """Samples that may be admitted for generation now (pacing and, if on, the rate limiter)."""
        params = self.run_params()

        def read() -> list[Any]:  # built per attempt: a failed execute empties the pipeline
            pipe = self.redis.pipeline(transaction=True)
            pipe.get(self.keys.version)
            pipe.get(self.keys.updates)
            pipe.hgetall(self.keys.counters)
            return pipe.execute()

        version, updates, counters = self.retry(read)
        updates = pacing.trained_updates(updates, control_int(version, self.keys.version, ""), self.keys.updates)
        return pacing.admission_budget(params, updates, metrics.read_counters(counters, self.keys.counters))

    # ---- learner -------------------------------------------------------------------------

    def set_learner_version(self, version: int, updates: int | None = None) -> None:
        """Publish the learner's version and the updates its weights hold (``updates``; None: as
        many as the version), together: pacing admits one more batch per update, and a learner
        restarted from a checkpoint numbers its weights past the versions published before."""
        k = self.keys

        def send() -> None:
            pipe = self.redis.pipeline(transaction=True)
            pipe.set(k.version, int(version))
            pipe.set(k.updates, int(version if updates is None else updates))
            pipe.xadd(k.wake_prompts, {"e": "version"}, maxlen=K.WAKE_MAXLEN, approximate=True)
            pipe.execute()

        self.retry(send)

    def learner_version(self) -> int:
        return int(self.retry(self.redis.get, self.keys.version) or 0)

    def read_batch(self, consumer: str, learner_version: int, batch_size: int, timeout_s: float,
                   newest: int = 0) -> Batch | None:
        """``batch_size // group_size`` whole groups no staler than ``max_staleness``, or None on timeout.

        Nothing is acked until :meth:`commit`. The first call of a process re-delivers what this
        consumer name read before a crash and did not commit. ``newest``: the newest version the
        caller has published or is publishing, when above ``learner_version`` (a learner reading
        against an older version after a restart); samples up to it are not "newer than the learner".
        """
        params = self.run_params()
        st = self._learners.setdefault(consumer, samples.LearnerState())
        read = replay.read_batch if params["mode"] == "replay" else samples.read_batch
        return read(self._store, st, params, consumer, learner_version, batch_size, timeout_s, newest)

    def exhausted(self, consumer: str, learner_version: int, batch_size: int, epochs: int) -> bool:
        """True when no batch for ``consumer`` can come any more from the run's prompts: each of
        ``epochs`` is enqueued and every prompt completed (:func:`buffer.prompts.drained`), and what is
        left makes no batch (FIFO: the groups not yet handed out; replay: a draw now is refused,
        and without inserts nothing lifts that). Checked in that order, so a group a worker
        appends meanwhile is seen. Groups no prompt produced (rlhf-gateway's) are not foreseen:
        a run they feed is never exhausted, and must not ask."""
        if not prompts.drained(self._store, epochs):
            return False
        params = self.run_params()
        if params["mode"] == "replay":
            return not replay.can_draw(self._store, params, consumer, learner_version, batch_size)
        st = self._learners.get(consumer) or samples.LearnerState()
        return not samples.can_form_batch(self._store, st, params, batch_size)

    def commit(self, batch: Batch) -> int:
        """Ack a batch once the update that used it is published and checkpointed. Idempotent;
        returns the number of groups newly acked."""
        return self.commit_ids(batch.ids)

    def discard(self, batch: Batch) -> int:
        """Ack a batch of which nothing was trained (the learner dropped every sample): its groups
        leave the buffer with no sample consumed and their admission goes back, so pacing does not
        lose a batch of room for good. Returns the number of groups newly acked."""
        for st in self._learners.values():
            for i in batch.ids:
                if i in st.handed:
                    st.handed[i] = st.handed[i]._replace(good=0, retire=True)
        return self.commit_ids(batch.ids)

    def commit_ids(self, ids: Iterable[str]) -> int:
        """Ack entries by id: what :meth:`commit` does, for a learner that keeps ids (several
        batches, or ids stored in its checkpoint and acked after a restart). Idempotent.

        For ids this process handed out, the read-time staleness and the batch's dead letters
        are recorded; for ids from before a restart, the staleness is taken against the stored
        learner version.
        """
        ids = [i.decode() if isinstance(i, bytes) else str(i) for i in ids]
        if not ids:
            return 0
        known: dict[str, tuple[str, samples.Handed]] = {}
        for consumer, st in self._learners.items():
            for i in ids:
                if i in st.handed:
                    known[i] = (consumer, st.handed[i])
        unknown = samples.Handed("", "", False, [])  # type: ignore[arg-type]  # '' = let the script derive it
        if self.run_params()["mode"] == "replay":
            missing = [i for i in ids if i not in known]
            owners = self.retry(self.redis.hmget, self.keys.replay_out, missing) if missing else []
            for i, owner in zip(missing, owners):
                if owner is not None:
                    known[i] = (owner.decode(), unknown)
            by_consumer: dict[str, list] = {}
            for i in ids:
                if i in known:
                    consumer, h = known[i]
                    by_consumer.setdefault(consumer, []).append((i, h.good, h.lag, h.retire, h.bad))
            n = sum(replay.commit(self._store, c, entries) for c, entries in by_consumer.items())
        else:
            entries = []
            for i in ids:
                h = known.get(i, ("", unknown))[1]
                entries.append((i, h.good, h.lag, h.bad))
            n = samples.commit(self._store, entries)
        for st in self._learners.values():
            for i in ids:
                st.handed.pop(i, None)
            st.carry = [g for g in st.carry if g.entry_id not in set(ids)]
        return n

    def pending_for(self, consumer: str) -> list[str]:
        """Entry ids read by ``consumer`` and not committed: what a restarted learner gets again."""
        K.check_consumer(consumer)
        if self.run_params()["mode"] == "replay":
            return replay.pending(self._store, consumer)
        out: list[str] = []
        start = "-"
        while True:
            rows = self.retry(self.redis.xpending_range, self.keys.samples, K.LEARNER_GROUP, start, "+", 1000, consumername=consumer)
            out += [r["message_id"].decode() for r in rows]
            if len(rows) < 1000:
                return out
            start = "(" + out[-1]

    # ---- monitor / admin -----------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        """One snapshot of counters, gauges, histograms, consumers and published stats (see :func:`buffer.metrics.collect`)."""
        params = self.run_params() if self.initialised() else None
        return metrics.collect(self.redis, self.retry, self.keys, params)

    def publish_stats(self, component: str, stats: dict[str, Any]) -> None:
        """Store a component's latest stats (e.g. the learner's metrics) for the monitor: ``metrics()["stats"][component]``."""
        self.retry(self.redis.hset, self.keys.stats, component, metrics.pack_stats(stats))

    def stats(self, component: str) -> dict[str, Any] | None:
        """One component's latest stats (what :meth:`publish_stats` stored), None when there are none."""
        raw = self.retry(self.redis.hget, self.keys.stats, component)
        return None if raw is None else metrics.unpack_record(raw)

    def set_worker_target(self, workers: int) -> int | None:
        """Ask the run's launcher to keep ``workers`` worker actors (``launcher=ray`` scales to it);
        returns the previous target (None: never set)."""
        if workers < 0:
            raise UserError(f"the number of workers must be >= 0, got {workers}")
        old = self.retry(self.redis.hget, self.keys.control, K.CONTROL_WORKERS)
        self.retry(self.redis.hset, self.keys.control, K.CONTROL_WORKERS, int(workers))
        return None if old is None else control_int(old, self.keys.control, K.CONTROL_WORKERS)

    def worker_target(self) -> int | None:
        """The number of worker actors asked for (:meth:`set_worker_target`); None when never set."""
        raw = self.retry(self.redis.hget, self.keys.control, K.CONTROL_WORKERS)
        return None if raw is None else control_int(raw, self.keys.control, K.CONTROL_WORKERS)

    def delete_run(self) -> int:
        """Delete this run's keys (SCAN by prefix + UNLINK); other runs and keys are untouched."""
        n = 0
        batch: list[bytes] = []
        for key in self.retry(lambda: list(self.redis.scan_iter(match=self.keys.pattern(), count=1000))):
            batch.append(key)
            if len(batch) >= 500:
                n += self.retry(self.redis.unlink, *batch)
                batch = []
        if batch:
            n += self.retry(self.redis.unlink, *batch)
        self._params = None
        self._leases.clear()
        self._beats.clear()
        self._learners.clear()
        self._filler.forget()
        log.info("deleted %d key(s) of run %s", n, self.keys.run_id)
        return n

    # ---- internals -----------------------------------------------------------------------

    def wait_on(self, stream: str, last_id: bytes | str, timeout_s: float) -> None:
        """Block until an entry newer than ``last_id`` lands on ``stream``, or ``timeout_s`` passes."""
        self._store.wait_on(stream, last_id, timeout_s)


def _parse_params(raw: dict) -> dict[str, Any]:
    p = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in raw.items()}
    out: dict[str, Any] = dict(p)
    for name in _INT_PARAMS:
        if name in p:
            out[name] = int(p[name])
    for name in _OPT_INT_PARAMS:
        out[name] = int(p[name]) if p.get(name) else None
    for name in _FLOAT_PARAMS:
        if name in p:
            out[name] = float(p[name])
    for name in _OPT_FLOAT_PARAMS:
        out[name] = float(p[name]) if p.get(name) else None
    return out


def _url_of(client: redis.Redis) -> str:
    kw = client.connection_pool.connection_kwargs
    if kw.get("path"):
        return f"unix://{kw['path']}"
    return f"redis://{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"
