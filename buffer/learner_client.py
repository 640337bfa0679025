"""The learner's client: set up the run, tell workers its version, read batches (FIFO,
:mod:`buffer.samples`, or replay, :mod:`buffer.replay`) and ack them once trained."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from buffer import keys as K
from buffer import prompts, replay, samples
from buffer.client import BufferClient
from buffer.samples import Batch
from buffer.store import PARAM_NAMES, Store, parse_params
from rlhf_core.config import replay_mode
from rlhf_core.errors import UserError


class RunParamsMismatch(UserError, ValueError):
    """``init_run`` was called with parameters that differ from the ones the run already has."""


class LearnerClient(BufferClient):
    """Initialises the run, publishes the learner's version, reads batches and commits or discards them."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self._learners: dict[str, samples.LearnerState] = {}

    def init_run(self, batch_size: int, group_size: int, max_staleness: int, max_response_tokens: int | None = None,
                 vocab_size: int | None = None) -> dict[str, Any]:
        """Store the run parameters once (the first caller's win; other values raise
        :class:`RunParamsMismatch`) and create the consumer groups. Replay, limiter and lookahead
        settings come from this process's ``BufferConfig``."""
        cfg = self.store.cfg
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
            "capacity": cfg.capacity, "dead_maxlen": self.store.dead_maxlen, "lookahead": cfg.lookahead,
        }
        assert set(wanted) == set(PARAM_NAMES)
        args: list[Any] = []
        for name, value in wanted.items():
            args += [name, "" if value is None else repr(value) if isinstance(value, float) else value]
        k = self.keys
        flat = self.retry(self.store.scripts.init_run, keys=[k.params, k.version, k.prompts, k.samples, k.wake_prompts], args=args)
        stored = parse_params({flat[i]: flat[i + 1] for i in range(0, len(flat), 2)})
        diff = {n: (stored.get(n), v) for n, v in wanted.items() if stored.get(n) != v}
        if diff:
            shown = ", ".join(f"{n}: run has {a!r}, you passed {b!r}" for n, (a, b) in diff.items())
            raise RunParamsMismatch(
                f"run {k.run_id!r} already exists with other parameters ({shown}); use a new buffer.run_id, "
                f"or delete the old run's keys first (MonitorClient.delete_run / rlhf-monitor)"
            )
        self.store.cached_params = stored
        return dict(stored)

    def set_learner_version(self, version: int, updates: int | None = None) -> None:
        """Publish the learner's version and the updates its weights hold (None: the version),
        together: pacing counts the updates (:mod:`buffer.pacing`)."""
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
        """``batch_size // group_size`` whole groups no staler than ``max_staleness``, or None on
        timeout; unacked until :meth:`commit` (a process's first call re-delivers the uncommitted).
        ``newest``: the newest version the caller published, when above ``learner_version``."""
        params = self.run_params()
        st = self._learners.setdefault(consumer, samples.LearnerState())
        read = replay.read_batch if params["mode"] == "replay" else samples.read_batch
        return read(self.store, st, params, consumer, learner_version, batch_size, timeout_s, newest)

    def exhausted(self, consumer: str, learner_version: int, batch_size: int, epochs: int) -> bool:
        """True when no batch for ``consumer`` can come any more from the run's prompts (every prompt
        completed, then what is left makes no batch). A run that rlhf-gateway feeds must not ask."""
        if not prompts.drained(self.store, epochs):
            return False
        params = self.run_params()
        if params["mode"] == "replay":
            return not replay.can_draw(self.store, params, consumer, learner_version, batch_size)
        st = self._learners.get(consumer) or samples.LearnerState()
        return not samples.can_form_batch(self.store, st, params, batch_size)

    def commit(self, batch: Batch) -> int:
        """Ack a batch once the update that used it is published and checkpointed. Idempotent;
        returns the number of groups newly acked."""
        return self.commit_ids(batch.ids)

    def discard(self, batch: Batch) -> int:
        """Ack a batch of which nothing was trained: its groups leave with no sample consumed and
        their admission goes back. Returns the number of groups newly acked."""
        for st in self._learners.values():
            for i in batch.ids:
                if i in st.handed:
                    st.handed[i] = st.handed[i]._replace(good=0, retire=True)
        return self.commit_ids(batch.ids)

    def commit_ids(self, ids: Iterable[str]) -> int:
        """Ack entries by id (ids kept in a checkpoint, acked after a restart). Idempotent. Ids this
        process handed out record their read-time staleness and dead letters; others are taken
        against the stored learner version."""
        ids = [i.decode() if isinstance(i, bytes) else str(i) for i in ids]
        if not ids:
            return 0
        known = {i: (consumer, st.handed[i]) for consumer, st in self._learners.items() for i in ids if i in st.handed}
        unknown = samples.Handed("", "", False, [])  # type: ignore[arg-type]  # '' = let the script derive it
        if self.run_params()["mode"] == "replay":
            missing = [i for i in ids if i not in known]
            owners = self.retry(self.redis.hmget, self.keys.replay_out, missing) if missing else []
            for i, owner in zip(missing, owners):
                if owner is not None:
                    known[i] = (owner.decode() if isinstance(owner, bytes) else str(owner), unknown)
            by_consumer: dict[str, list] = {}
            for i in ids:
                if i in known:
                    consumer, h = known[i]
                    by_consumer.setdefault(consumer, []).append((i, h.good, h.lag, h.retire, h.bad))
            n = sum(replay.commit(self.store, c, entries) for c, entries in by_consumer.items())
        else:
            entries = []
            for i in ids:
                h = known.get(i, ("", unknown))[1]
                entries.append((i, h.good, h.lag, h.bad))
            n = samples.commit(self.store, entries)
        for st in self._learners.values():
            for i in ids:
                st.handed.pop(i, None)
            st.carry = [g for g in st.carry if g.entry_id not in set(ids)]
        return n

    def pending_for(self, consumer: str) -> list[str]:
        """Entry ids read by ``consumer`` and not committed: what a restarted learner gets again."""
        K.check_consumer(consumer)
        if self.run_params()["mode"] == "replay":
            return replay.pending(self.store, consumer)
        out: list[str] = []
        start = "-"
        while True:
            rows = self.retry(self.redis.xpending_range, self.keys.samples, K.LEARNER_GROUP, start, "+", 1000, consumername=consumer)
            out += [m.decode() if isinstance(m := r["message_id"], bytes) else str(m) for r in rows]
            if len(rows) < 1000:
                return out
            start = "(" + out[-1]
