"""Replay mode: samples reused up to ``max_reuse`` times under a Reverb-style rate limiter.

The run is in replay mode when ``max_reuse > 1``, ``samples_per_insert`` is set or
``sampling`` is not ``fifo`` (decided once by ``init_run`` and stored in the run parameters).
Otherwise the FIFO consumer-group path of :mod:`buffer.samples` runs and none of this costs
anything. Workers do not see the difference: ``complete.lua`` also indexes the new entry.

Table: the entries stay in the ``samples`` stream; ``replay:index`` (a sorted set, score
``version * 2**32 + insertion seq``, so ascending = stalest first, FIFO within a version),
``replay:n`` (samples per entry), ``replay:uses`` (committed uses) and ``replay:out`` (entries
in a learner's uncommitted batch) index them. Sampling policies: ``fifo`` (stalest first) and
``uniform`` (ZRANDMEMBER, without replacement within a batch). A draw never returns an entry
that is out; :meth:`Buffer.commit` counts a use and removes entries used ``max_reuse`` times;
a learner that crashes before committing gets its drawn entries put back (the draws are
un-counted) on its first read, so nothing is lost and no use is counted twice.

Rate limiter (Reverb's ``SampleToInsertRatio``, counted in samples)::

    offset   = samples_per_insert * min_size_to_sample
    min_diff = offset - error_buffer        max_diff = offset + error_buffer
    can_insert(n): inserts + n <= min_size_to_sample  or  (inserts + n) * spi - samples <= max_diff
    can_sample(n): size >= min_size_to_sample  and  inserts * spi - (samples + n) >= min_diff

The insert side blocks at admission, not after generation: ``claim.lua`` admits a prompt only
if its group would be insertable counting the groups still being generated (``inflight``), so
a worker never holds a finished group it may not insert; it waits in :meth:`Buffer.claim`
(woken by draws). The sample side waits in :meth:`Buffer.read_batch` (woken by inserts).
When an entry leaves the table before it was drawn ``spi`` times (evicted at ``capacity``, too
stale, corrupt) the draws it still owed are forgiven (added to ``samples``); otherwise a
learner that can never catch up would block inserts forever.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from buffer import keys as K
from buffer.prompts import WAIT_CAP_S
from buffer.samples import Batch, Group, LearnerState, build_batch, decode_entry, groups_per_batch, handed_of

if TYPE_CHECKING:  # pragma: no cover
    from buffer.client import Buffer


# ---- the limiter, as plain functions (the Lua scripts implement the same rules) -------------


def max_diff(spi: float, min_size: int, error_buffer: float) -> float:
    return spi * min_size + error_buffer


def min_diff(spi: float, min_size: int, error_buffer: float) -> float:
    return spi * min_size - error_buffer


def can_insert(inserts: float, samples: float, n: int, spi: float, min_size: int, error_buffer: float) -> bool:
    if inserts + n <= min_size:
        return True
    return (inserts + n) * spi - samples <= max_diff(spi, min_size, error_buffer)


def can_sample(inserts: float, samples: float, size: int, n: int, spi: float, min_size: int, error_buffer: float) -> bool:
    if size < min_size or size < n:
        return False
    return inserts * spi - (samples + n) >= min_diff(spi, min_size, error_buffer)


def insert_room(inserts: float, samples: float, spi: float, min_size: int, error_buffer: float) -> int:
    """The largest n with ``can_insert(n)``: how many more samples may be inserted now."""
    room = math.floor((max_diff(spi, min_size, error_buffer) + samples) / spi) - inserts
    return int(max(room, min_size - inserts))


def admission_budget(params: dict[str, Any], version: int, counters: dict[str, float]) -> int:
    """Samples that may be admitted for generation now (pacing, and the limiter if on)::

        pacing: (ahead + version + 1) * batch_size - admitted,
                ahead = min(max_staleness, lookahead) (lookahead None: max_staleness)
        limiter: insert_room(rl_inserts + inflight, rl_samples)
    """
    ahead = params["max_staleness"]
    if params.get("lookahead") is not None:
        ahead = min(ahead, params["lookahead"])
    budget = (ahead + version + 1) * params["batch_size"] - counters["admitted"]
    spi = params["samples_per_insert"]
    if spi:
        ins = counters["rl_inserts"] + counters["inflight"]
        budget = min(budget, insert_room(ins, counters["rl_samples"], spi, params["min_size_to_sample"], params["error_buffer"]))
    return int(max(0, budget))


# ---- learner side ------------------------------------------------------------------------


def read_batch(buf: "Buffer", consumer: str, learner_version: int, batch_size: int, timeout_s: float) -> Batch | None:
    K.check_consumer(consumer)
    params = buf.run_params()
    st: LearnerState = buf._learners.setdefault(consumer, LearnerState())
    if st.synced_at is None:
        return_undone(buf, consumer, pending(buf, consumer))
        st.synced_at = buf.retry.reconnects
    want = groups_per_batch(batch_size, params["group_size"])
    deadline = time.monotonic() + max(0.0, timeout_s)
    k = buf.keys
    while True:
        res = buf.retry(
            buf.scripts.replay_draw,
            keys=[k.params, k.counters, k.samples, k.replay_index, k.replay_n, k.replay_uses, k.replay_out,
                  k.hist_dropped, k.wake_replay, k.wake_prompts],
            args=[consumer, learner_version, want, params["sampling"]],
        )
        if res[0] == b"ok":
            groups: list[Group] = []
            items = res[1:]
            for i in range(0, len(items), 2):
                flat = items[i + 1] or []
                fields = {flat[j]: flat[j + 1] for j in range(0, len(flat), 2)}
                groups.append(decode_entry(buf, items[i].decode(), fields))
            batch = build_batch(groups, consumer, learner_version)
            st.handed.update(handed_of(batch))
            return batch
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        buf.wait_on(k.wake_replay, res[1], min(remaining, WAIT_CAP_S))


def pending(buf: "Buffer", consumer: str) -> list[str]:
    out = buf.retry(buf.redis.hgetall, buf.keys.replay_out)
    return sorted((k.decode() for k, v in out.items() if v.decode() == consumer), key=_id_key)


def return_undone(buf: "Buffer", consumer: str, ids: list[str]) -> int:
    if not ids:
        return 0
    k = buf.keys
    return int(buf.retry(buf.scripts.replay_return, keys=[k.counters, k.replay_n, k.replay_out, k.wake_replay], args=[consumer, *ids]))


def commit(buf: "Buffer", consumer: str, entries: list[tuple[str, Any, Any, bool, list]]) -> int:
    """entries: (id, good samples or '', lag or '', retire, dead letters)."""
    args: list[Any] = []
    for entry_id, good, lag, retire, bad in entries:
        args += [entry_id, good, lag, int(bool(retire)), len(bad)]
        for _kind, reason, producer, raw in bad:
            args += [reason, producer, raw]
    if not entries:
        return 0
    k = buf.keys
    return int(
        buf.retry(
            buf.scripts.replay_commit,
            keys=[k.params, k.counters, k.samples, k.replay_index, k.replay_n, k.replay_uses, k.replay_out,
                  k.hist_consumed, k.dead, k.version],
            args=[consumer, repr(time.time()), buf.cfg_dead_maxlen, len(entries), *args],
        )
    )


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
