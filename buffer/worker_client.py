"""The rollout worker's client: lease prompts, keep the leases alive (:mod:`buffer.prompts`), append
each finished group and ack its prompt in one script (:mod:`buffer.samples`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from buffer import prompts, samples
from buffer.client import BufferClient
from buffer.prompts import Lease
from buffer.scripts import complete_keys, run_many
from buffer.store import Store
from rlhf_core.records import Sample

log = logging.getLogger("buffer")


class Completion(NamedTuple):
    """A validated, encoded group ready for :meth:`WorkerClient.complete_many` (from :meth:`WorkerClient.prepare`)."""

    lease: Lease
    args: list[Any]


class WorkerClient(BufferClient):
    """Claims prompts within the admission budget, heartbeats their leases, completes or releases them."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self._leases: dict[str, dict[str, Lease]] = {}
        self._beats: dict[str, prompts.Beats] = {}  # per consumer this process heartbeats
        self._next_retire = 0.0  # time.monotonic() of this process's next sweep of dead consumers

    def claim(self, consumer: str, max_prompts: int, block_s: float = 0.0,
              interrupt: Callable[[], bool] | None = None) -> list[Lease]:
        """Lease up to ``max_prompts`` prompts within the admission budget, waiting up to
        ``block_s`` (``interrupt``: see :func:`buffer.prompts.claim`). Generate with weights of
        version >= ``lease.learner_version`` to keep pacing's staleness bound."""
        held = self._leases.setdefault(consumer, {})
        return prompts.claim(self.store, held, consumer, max_prompts, block_s, interrupt)

    def heartbeat(self, consumer: str, version: int | None = None, stats: dict | None = None) -> list[str]:
        """Renew this process's leases of ``consumer`` and record it for the monitor (once a lease
        timeout, also :meth:`retire_consumers`). Returns the lease ids lost to other workers: stop those."""
        beats = self._beats.setdefault(consumer, prompts.Beats())
        lost = prompts.heartbeat(self.store, self._leases.get(consumer, {}), beats, consumer, version, stats)
        if time.monotonic() >= self._next_retire:
            self.retire_consumers()
        return lost

    def retire_consumers(self, before: float | None = None) -> list[str]:
        """Retire the consumers silent since ``before`` (Redis's clock; default
        ``prompts.RETIRE_AFTER_LEASES`` lease timeouts ago) that own no lease (:func:`buffer.prompts.retire`).
        Returns their names."""
        lease_s = self.store.lease_s()
        self._next_retire = time.monotonic() + lease_s
        if before is None:
            before = prompts.redis_time(self.store) - prompts.RETIRE_AFTER_LEASES * lease_s
        gone = prompts.retire(self.store, before)
        if gone:
            log.info("retired %d consumer(s) of run %s silent since %s: %s", len(gone), self.keys.run_id,
                     time.strftime("%H:%M:%S", time.localtime(before)), ", ".join(gone[:10]) + (" ..." if len(gone) > 10 else ""))
        return gone

    def complete(self, lease: Lease, group: list[Sample], rejected: Iterable[tuple[str, str, bytes]] = (),
                 filtered: str | None = None) -> str:
        """Append the group and ack the prompt atomically, invalid samples and the ``(kind, reason,
        raw)`` records of ``rejected`` dead-lettered. Returns ``appended``, ``empty`` (no valid
        sample: budget returned), ``filtered`` (``filtered`` names why the group teaches nothing:
        as empty, counted per reason) or ``duplicate`` (already completed; nothing written)."""
        params = self.run_params()
        args = samples.prepare(self.store, params, lease, group, rejected, filtered)
        res = self.retry(self.store.scripts.complete, keys=complete_keys(self.keys, params["mode"]), args=args)
        self._leases.get(lease.consumer, {}).pop(lease.lease_id, None)
        return samples.complete_status(res)

    def prepare(self, lease: Lease, group: list[Sample], rejected: Iterable[tuple[str, str, bytes]] = (),
                filtered: str | None = None) -> Completion:
        """Validate and encode a group for :meth:`complete_many` ahead of sending (in a scoring thread)."""
        return Completion(lease, samples.prepare(self.store, self.run_params(), lease, group, rejected, filtered))

    def complete_many(self, items: Iterable[Completion | tuple[Lease, list[Sample]]]) -> list[str]:
        """Like :meth:`complete` for several prompts in one round trip (each one atomic on its own).
        Items are ``(lease, samples)`` or :meth:`prepare` results. Safe to retry as a whole."""
        prepared = [it if isinstance(it, Completion) else self.prepare(*it) for it in items]
        keys = complete_keys(self.keys, self.run_params()["mode"])

        results = self.retry(run_many, self.redis, self.store.scripts.complete, keys=keys, arg_lists=[c.args for c in prepared])
        for c in prepared:
            self._leases.get(c.lease.consumer, {}).pop(c.lease.lease_id, None)
        return [samples.complete_status(r) for r in results]

    def release(self, leases: Lease | Iterable[Lease]) -> int:
        """Give prompts back un-done (shutdown): re-delivered to the next claimer, budget returned,
        not counted as a delivery."""
        return prompts.release(self.store, self._leases, [leases] if isinstance(leases, Lease) else leases)
