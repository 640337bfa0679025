"""Replay mode: samples reused up to ``max_reuse`` times under a Reverb-style rate limiter.

The run is in replay mode when ``max_reuse > 1``, ``samples_per_insert`` is set or ``sampling``
is not ``fifo`` (decided by ``init_run``); else the FIFO path of :mod:`buffer.samples` runs.
Entries stay in the ``samples`` stream, indexed by ``replay:index`` (score ``version * 2**32 +
insertion seq``: ascending is stalest first), ``replay:n``, ``replay:uses`` and ``replay:out``
(drawn into a learner's uncommitted batch; never drawn again until committed or returned).
Policies: ``fifo`` and ``uniform`` (ZRANDMEMBER). A commit counts a use and removes entries used
``max_reuse`` times; a learner that crashes gets its drawn entries put back on its first read.
The limiter's rule lives in :mod:`buffer.pacing`; a refused draw waits in :func:`read_batch`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, cast

from buffer import keys as K
from buffer.prompts import WAIT_CAP_S
from buffer.samples import Batch, Group, LearnerState, build_batch, decode_entry, groups_per_batch, handed_of, newest_version
from buffer.store import Store


def read_batch(store: Store, st: LearnerState, params: Mapping[str, Any], consumer: str, learner_version: int,
               batch_size: int, timeout_s: float, newest: int = 0) -> Batch | None:
    """Replay mode: the next batch of ``consumer`` (see :meth:`buffer.LearnerClient.read_batch`), or None on timeout."""
    K.check_consumer(consumer)
    if st.synced_at is None:
        return_undone(store, consumer, pending(store, consumer))
        st.synced_at = store.retry.reconnects
    want = groups_per_batch(batch_size, params["group_size"])
    deadline = time.monotonic() + max(0.0, timeout_s)
    k = store.keys
    while True:
        res = store.retry(store.scripts.replay_draw, keys=_draw_keys(store),
                          args=[consumer, learner_version, want, params["sampling"]])
        if res[0] == b"ok":
            groups: list[Group] = []
            ceiling = newest_version(store, max(learner_version, newest))
            t0 = time.perf_counter()
            items = res[1:]
            for i in range(0, len(items), 2):
                flat = items[i + 1] or []
                fields = {flat[j]: flat[j + 1] for j in range(0, len(flat), 2)}
                groups.append(decode_entry(items[i].decode(), fields, params, store.cfg.max_record_bytes, ceiling))
            batch = build_batch(groups, consumer, learner_version)
            st.handed.update(handed_of(batch))
            batch.decode_s = time.perf_counter() - t0
            return batch
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        store.wait_on(k.wake_replay, res[1], min(remaining, WAIT_CAP_S))


def can_draw(store: Store, params: Mapping[str, Any], consumer: str, learner_version: int, batch_size: int) -> bool:
    """Whether :func:`read_batch` would draw a batch now (``replay_draw.lua``'s dry run: the same
    gates, too stale entries removed as a draw removes them, nothing drawn)."""
    want = groups_per_batch(batch_size, params["group_size"])
    res = store.retry(store.scripts.replay_draw, keys=_draw_keys(store),
                      args=[consumer, learner_version, want, params["sampling"], 1])
    return res[0] == b"ok"


def _draw_keys(store: Store) -> list[str]:
    k = store.keys
    return [k.params, k.counters, k.samples, k.replay_index, k.replay_n, k.replay_uses, k.replay_out,
            k.hist_dropped, k.wake_replay, k.wake_prompts]


def pending(store: Store, consumer: str) -> list[str]:
    """Entries drawn by ``consumer`` and not committed, oldest first."""
    out = cast(dict[bytes, bytes], store.retry(store.redis.hgetall, store.keys.replay_out))  # the client returns bytes
    return sorted((k.decode() for k, v in out.items() if v.decode() == consumer), key=_id_key)


def return_undone(store: Store, consumer: str, ids: list[str]) -> int:
    """Put entries ``consumer`` drew and did not commit back into the table, un-counting the draws."""
    if not ids:
        return 0
    k = store.keys
    return int(store.retry(store.scripts.replay_return, keys=[k.counters, k.replay_n, k.replay_out, k.wake_replay], args=[consumer, *ids]))


def commit(store: Store, consumer: str, entries: list[tuple[str, Any, Any, bool, list]]) -> int:
    """entries: (id, good samples or '', lag or '', retire, dead letters)."""
    args: list[Any] = []
    for entry_id, good, lag, retire, bad in entries:
        args += [entry_id, good, lag, int(bool(retire)), len(bad)]
        for _kind, reason, producer, raw in bad:
            args += [reason, producer, raw]
    if not entries:
        return 0
    k = store.keys
    return int(
        store.retry(
            store.scripts.replay_commit,
            keys=[k.params, k.counters, k.samples, k.replay_index, k.replay_n, k.replay_uses, k.replay_out,
                  k.hist_consumed, k.dead, k.version, k.wake_prompts],
            args=[consumer, repr(time.time()), store.dead_maxlen, len(entries), *args],
        )
    )


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
