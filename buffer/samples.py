"""The sample stream: atomic group completion by workers, FIFO batch consumption by the learner.

One stream entry holds one completed group (fields in :mod:`buffer.keys`), so a group is
appended, read, dropped and acked as a unit. A worker's :func:`prepare` validates each sample
and one ``complete.lua`` call appends the good ones, dead-letters the bad ones and acks the
prompt. In FIFO mode the learner reads entries through the consumer group ``learner``; they stay
pending until :func:`commit` (after the update is published and checkpointed), so a learner
that crashes gets them again. Groups staler than ``max_staleness`` are dropped (``drop.lua``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack

from buffer import keys as K
from buffer.connection import control_int
from buffer.prompts import Lease
from buffer.store import Store
from rlhf_core.dapo import FILTER_REASONS
from rlhf_core.records import MAX_VERSION, Sample, validate_sample
from rlhf_core.wire import WireError

log = logging.getLogger("buffer")

#: Longest single XREADGROUP BLOCK of the learner (it wakes as soon as an entry arrives).
READ_BLOCK_CAP_S = 2.0
HISTORY_CHUNK = 256
#: Most samples one stream entry may name (a group); larger counts mark the entry malformed.
MAX_GROUP_SAMPLES = 1 << 16


class GroupSlice(NamedTuple):
    """Where one group sits in ``Batch.samples``: samples[start:end]."""

    group_id: str
    start: int
    end: int
    entry_id: str
    lag: int  # learner_version - oldest token version of the group


@dataclass
class Group:
    """A decoded stream entry: the usable samples of one group and what was wrong with the rest."""

    entry_id: str
    group_id: str
    prompt_id: str
    producer: str
    samples: list[Sample]
    bad: list[tuple[str, str, str, bytes]] = field(default_factory=list)  # (kind, reason, producer, raw)
    oldest_version: int = 0

    def lag(self, learner_version: int) -> int:
        return learner_version - self.oldest_version


@dataclass
class Batch:
    """Whole groups for one update: ``samples`` (each group contiguous), one :class:`GroupSlice`
    per group (a partial group is shorter), ``ids`` for ``commit_ids``, and ``staleness``:
    ``{"min", "max", "mean", "hist": {lag: samples}}`` over the samples."""

    samples: list[Sample]
    groups: list[GroupSlice]
    ids: list[str]
    consumer: str
    learner_version: int
    staleness: dict[str, Any]
    dead: dict[str, list[tuple[str, str, str, bytes]]] = field(default_factory=dict, repr=False)
    retire: set[str] = field(default_factory=set, repr=False)
    # seconds spent decoding and validating since the batch before, not waiting (learner/time_read_s)
    decode_s: float = 0.0

    @property
    def group_sizes(self) -> list[int]:
        return [g.end - g.start for g in self.groups]

    def __len__(self) -> int:
        return len(self.samples)


def groups_per_batch(batch_size: int, group_size: int) -> int:
    """The batch rule: ``batch_size // group_size`` whole groups (at least one)."""
    return max(1, batch_size // group_size)


def prepare(store: Store, params: Mapping[str, Any], lease: Lease, samples: list[Sample],
            rejected: Iterable[tuple[str, str, bytes]] = (), filtered: str | None = None) -> list[Any]:
    """Validate and encode a group; return the ``complete.lua`` arguments (``rejected``,
    ``filtered``: see :meth:`buffer.WorkerClient.complete`)."""
    n_filtered, samples = _filtered(filtered, samples)
    good, bad = _check_group(store, params, samples, "complete()")
    for kind, reason, raw in rejected:
        bad += [kind, reason, raw]
    oldest = min((s.oldest_version for s, _ in good), default=0)
    group_id = samples[0].group_id if samples else ""
    head = [lease.lease_id, lease.consumer, repr(time.time()), store.dead_maxlen, params["mode"], params["group_size"],
            oldest, group_id, lease.prompt.prompt_id, filtered or "", n_filtered, len(good), len(bad) // 3]
    return head + [raw for _, raw in good] + bad


def _check_group(store: Store, params: Mapping[str, Any], samples: list[Sample], caller: str
                 ) -> tuple[list[tuple[Sample, bytes]], list[Any]]:
    """Encode and validate one group: ``(good (sample, bytes) pairs, flat [kind, reason, raw, ...])``."""
    max_bytes = store.cfg.max_record_bytes
    group_ids = {s.group_id for s in samples}
    if len(group_ids) > 1:
        raise ValueError(f"{caller} got samples of several groups {sorted(group_ids)}: pass one group per call")
    if len(samples) > params["group_size"]:
        raise ValueError(f"{caller} got {len(samples)} samples but the run's group_size is {params['group_size']}")
    good: list[tuple[Sample, bytes]] = []
    bad: list[Any] = []
    for s in samples:
        raw = s.encode()
        try:
            if len(raw) > max_bytes:
                raise WireError(f"record of {len(raw)} bytes exceeds buffer.max_record_bytes={max_bytes}")
            validate_sample(s, vocab_size=params["vocab_size"], max_response_tokens=params["max_response_tokens"])
        except WireError as exc:
            bad += ["sample", str(exc), raw]
            continue
        good.append((s, raw))
    return good, bad


def prepare_external(store: Store, params: Mapping[str, Any], producer: str, samples: list[Sample],
                     kept: Sequence[str] = (), filtered: str | None = None) -> list[Any]:
    """Validate and encode a group that no prompt lease produced; return the ``append.lua``
    arguments (FIFO mode only; ``kept``, ``filtered``: see :meth:`buffer.GatewayClient.append_group`)."""
    if params["mode"] != "fifo":
        raise ValueError(f"groups without a prompt lease need buffer.mode=fifo, this run uses {params['mode']}")
    if not samples:
        raise ValueError("append_group() got no samples")
    group_id, prompt_id = samples[0].group_id, samples[0].prompt_id
    n_filtered, samples = _filtered(filtered, samples)
    good, bad = _check_group(store, params, samples, "append_group()")
    oldest = min((s.oldest_version for s, _ in good), default=0)
    head = [producer, repr(time.time()), store.dead_maxlen, oldest, group_id, prompt_id,
            len(good), len(bad) // 3, len(kept), filtered or "", n_filtered]
    return head + [raw for _, raw in good] + bad + list(kept)


def _filtered(filtered: str | None, samples: list[Sample]) -> tuple[int, list[Sample]]:
    """``(samples filtered, samples to append)`` for a group ``filtered`` names a reason for, or not."""
    if filtered is None:
        return 0, samples
    if filtered not in FILTER_REASONS:
        raise ValueError(f"filter reason {filtered!r} is not one of {FILTER_REASONS}")
    return len(samples), []


def complete_status(res: list[Any]) -> str:
    """``complete.lua`` reply -> appended | filtered | empty | duplicate."""
    if int(res[0]) == 0:
        return "duplicate"
    if len(res) > 2 and res[2]:
        return "filtered"
    return "appended" if res[1] else "empty"


def newest_version(store: Store, learner_version: int) -> int:
    """The newest policy version that can exist: the learner's, or the one stored in Redis when
    newer (a restarted learner reads against its checkpoint's older version)."""
    stored = store.retry(store.redis.get, store.keys.version)
    return max(int(learner_version), control_int(stored, store.keys.version, ""))


def decode_entry(entry_id: str, fields: dict[bytes, bytes] | None, params: Mapping[str, Any], max_record_bytes: int,
                 newest: int | None = None) -> Group:
    """Decode and validate one stream entry against the run parameters and ``newest``
    (:func:`newest_version`). Never raises: what is wrong goes to ``Group.bad`` (logged once)."""
    fields = fields or {}
    producer = _text(fields.get(K.F_PRODUCER.encode()), "?")
    try:
        count = _field_int(fields, K.F_COUNT, 1, MAX_GROUP_SAMPLES)
        _field_int(fields, K.F_VERSION, 0, MAX_VERSION)
        raws = [fields[f"{K.SAMPLE_FIELD_PREFIX}{i}".encode()] for i in range(count)]
        group_id = _text(fields[K.F_GROUP.encode()], "")
        prompt_id = _text(fields[K.F_PROMPT_ID.encode()], "")
    except (KeyError, ValueError, TypeError) as exc:
        raw = msgpack.packb({k: v for k, v in fields.items()}, use_bin_type=True)
        reason = f"malformed sample-stream entry (missing or bad field: {exc}); was it written by another program?"
        log.warning("dead-lettering stream entry %s from %s: %s", entry_id, producer, reason)
        return Group(entry_id, "", "", producer, [], [("entry", reason, producer, raw)])
    group = Group(entry_id, group_id, prompt_id, producer, [])
    for raw in raws:
        try:
            sample = Sample.decode(raw, max_bytes=max_record_bytes)
            validate_sample(sample, vocab_size=params["vocab_size"], max_response_tokens=params["max_response_tokens"])
            if newest is not None and sample.newest_version > newest:
                raise WireError(f"policy version {sample.newest_version} is newer than the learner's version "
                                f"{newest}; versions come only from the learner, so the record is from "
                                "another run or a corrupted worker")
        except WireError as exc:
            group.bad.append(("sample", str(exc), producer, raw))
            continue
        group.samples.append(sample)
    if group.bad:
        log.warning("dead-lettering %d of %d sample(s) of stream entry %s from %s, e.g.: %s",
                    len(group.bad), len(raws), entry_id, producer, group.bad[0][1])
    if group.samples:
        group.oldest_version = min(s.oldest_version for s in group.samples)
    return group


def _field_int(fields: Mapping[bytes, bytes], name: str, low: int, high: int) -> int:
    """A stream field that must be a decimal integer in ``[low, high]`` (raises ValueError)."""
    text = fields[name.encode()].decode("ascii", "replace")
    if not text.isdigit() or not low <= int(text) <= high:
        raise ValueError(f"{name}={text[:40]!r} is not an integer in [{low}, {high}]")
    return int(text)


def build_batch(groups: list[Group], consumer: str, learner_version: int) -> Batch:
    samples: list[Sample] = []
    slices: list[GroupSlice] = []
    hist: dict[int, int] = {}
    for g in groups:
        lag = g.lag(learner_version)
        if g.samples:
            slices.append(GroupSlice(g.group_id, len(samples), len(samples) + len(g.samples), g.entry_id, lag))
            samples.extend(g.samples)
            hist[lag] = hist.get(lag, 0) + len(g.samples)
    lags = [s.lag for s in slices for _ in range(s.end - s.start)]
    staleness = {
        "min": min(lags, default=0),
        "max": max(lags, default=0),
        "mean": sum(lags) / len(lags) if lags else 0.0,
        "hist": dict(sorted(hist.items())),
    }
    dead = {g.entry_id: g.bad for g in groups if g.bad}
    return Batch(samples, slices, [g.entry_id for g in groups], consumer, learner_version, staleness, dead,
                 retire={g.entry_id for g in groups if g.bad})


class Handed(NamedTuple):
    """What commit needs to know about an entry handed out in a batch (kept until committed)."""

    good: int  # samples trained on
    lag: int  # staleness when read (the histogram records read-time staleness)
    retire: bool  # replay: remove after this use (it held bad samples)
    bad: list[tuple[str, str, str, bytes]]  # dead letters to record with the commit


def handed_of(batch: Batch) -> dict[str, Handed]:
    by_id = {g.entry_id: g for g in batch.groups}
    out = {}
    for entry_id in batch.ids:
        g = by_id.get(entry_id)
        good, lag = (g.end - g.start, g.lag) if g is not None else (0, 0)
        out[entry_id] = Handed(good, lag, entry_id in batch.retire, batch.dead.get(entry_id, []))
    return out


@dataclass
class LearnerState:
    """One learner consumer in this process: read-but-unbatched groups, entries handed out in
    uncommitted batches, and when its pending list was last re-read."""

    carry: list[Group] = field(default_factory=list)
    handed: dict[str, Handed] = field(default_factory=dict)
    synced_at: int | None = None  # Store.retry.reconnects when last synced; None: never
    decode_s: float = 0.0  # reading and decoding since the last batch was handed out


def read_batch(store: Store, st: LearnerState, params: Mapping[str, Any], consumer: str, learner_version: int,
               batch_size: int, timeout_s: float, newest: int = 0) -> Batch | None:
    """FIFO mode: the next batch of ``consumer`` (see :meth:`buffer.LearnerClient.read_batch`), or None on timeout."""
    K.check_consumer(consumer)
    want = groups_per_batch(batch_size, params["group_size"])
    deadline = time.monotonic() + max(0.0, timeout_s)
    floor = max(learner_version, newest)
    while True:
        if st.synced_at != store.retry.reconnects:  # re-reading what was delivered before counts as reading
            t0 = time.perf_counter()
            _resync(store, params, consumer, st, newest_version(store, floor))
            st.decode_s += time.perf_counter() - t0
        _filter(store, st, learner_version, params["max_staleness"])
        if len(st.carry) >= want:
            t0 = time.perf_counter()
            chosen, st.carry = st.carry[:want], st.carry[want:]
            batch = build_batch(chosen, consumer, learner_version)
            st.handed.update(handed_of(batch))
            batch.decode_s, st.decode_s = st.decode_s + time.perf_counter() - t0, 0.0
            return batch
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        block_ms = max(1, int(min(remaining, READ_BLOCK_CAP_S) * 1000))
        stored, res = store.retry(_read_new, store.redis, consumer, want - len(st.carry), block_ms,
                                  keys=[store.keys.version, store.keys.samples])
        ceiling = max(floor, control_int(stored, store.keys.version, ""))
        t0 = time.perf_counter()
        for entry_id, fields in stream_entries(res):
            st.carry.append(decode_entry(_text(entry_id), fields, params, store.cfg.max_record_bytes, ceiling))
        st.decode_s += time.perf_counter() - t0


def can_form_batch(store: Store, st: LearnerState, params: Mapping[str, Any], batch_size: int) -> bool:
    """FIFO mode: whether the groups in the sample stream not handed out by ``st``'s consumer make
    a batch (groups too stale or unusable count until a read drops them)."""
    groups = int(store.retry(store.redis.xlen, store.keys.samples))
    return groups - len(st.handed) >= groups_per_batch(batch_size, params["group_size"])


def _read_new(client: Any, consumer: str, count: int, block_ms: int, keys: list[str]) -> list[Any]:
    """The stored learner version (``keys[0]``) and up to ``count`` new entries of the sample
    stream (``keys[1]``), in one round trip (a pipeline per call: a retried one forgets its commands)."""
    pipe = client.pipeline(transaction=False)
    pipe.get(keys[0])
    pipe.xreadgroup(K.LEARNER_GROUP, consumer, {keys[1]: ">"}, count=count, block=block_ms)
    return pipe.execute()


def _resync(store: Store, params: Mapping[str, Any], consumer: str, st: LearnerState, ceiling: int) -> None:
    """Re-read this consumer's pending entries (a restarted learner, or replies lost in a
    reconnect) that this process has not handed out or carried yet, oldest first."""
    reconnects = store.retry.reconnects
    known = set(st.handed) | {g.entry_id for g in st.carry}
    cursor = "0-0"
    found: list[Group] = []
    while True:
        res = store.retry(store.redis.xreadgroup, K.LEARNER_GROUP, consumer, {store.keys.samples: cursor}, count=HISTORY_CHUNK)
        entries = stream_entries(res)
        if not entries:
            break
        for entry_id, fields in entries:
            eid = _text(entry_id)
            cursor = eid
            if eid in known:
                continue
            if not fields:  # deleted while pending: nothing left to train on
                store.retry(store.redis.xack, store.keys.samples, K.LEARNER_GROUP, eid)
                continue
            found.append(decode_entry(eid, fields, params, store.cfg.max_record_bytes, ceiling))
    if found:
        log.info("learner %s: %d group(s) read before a restart or reconnect are delivered again", consumer, len(found))
    st.carry = found + st.carry
    st.synced_at = reconnects


def _filter(store: Store, st: LearnerState, learner_version: int, max_staleness: int) -> None:
    """Drop carried groups that are too stale or hold nothing usable (``drop.lua``)."""
    keep: list[Group] = []
    args: list[Any] = []
    n = 0
    for g in st.carry:
        if not g.samples:
            why, lag = "bad", 0
        elif g.lag(learner_version) > max_staleness:
            why, lag = "stale", g.lag(learner_version)
        else:
            keep.append(g)
            continue
        n += 1
        args += [g.entry_id, why, lag, len(g.bad)]
        for kind, reason, producer, raw in g.bad:
            args += [kind, reason, producer, raw]
    if not n:
        return
    k = store.keys
    store.retry(
        store.scripts.drop,
        keys=[k.samples, k.counters, k.hist_dropped, k.dead, k.params, k.wake_prompts],
        args=[repr(time.time()), store.dead_maxlen, n, *args],
    )
    st.carry = keep


def commit(store: Store, entries: Iterable[tuple[str, int | str, int | str, list]]) -> int:
    """Ack (id, good samples or '', lag or '', dead letters) entries; returns how many were new."""
    args: list[Any] = []
    n = 0
    for entry_id, good, lag, bad in entries:
        n += 1
        args += [entry_id, good, lag, len(bad)]
        for _kind, reason, producer, raw in bad:
            args += [reason, producer, raw]
    if not n:
        return 0
    k = store.keys
    done = store.retry(
        store.scripts.commit,
        keys=[k.samples, k.counters, k.hist_consumed, k.dead, k.version, k.params, k.wake_prompts],
        args=[repr(time.time()), store.dead_maxlen, n, *args],
    )
    return int(done)


def stream_entries(res: Any) -> list[tuple[bytes, dict | None]]:
    """The entries of a one-stream XREAD/XREADGROUP reply, in RESP2 (list) or RESP3 (map) shape."""
    if not res:
        return []
    if isinstance(res, dict):  # RESP3: {stream: [[entries]]}
        (value,) = res.values()
        return list(value[0]) if value and isinstance(value[0], list) else list(value)
    return list(res[0][1])


def _text(value: Any, default: str = "") -> str:
    if value is None:
        return default
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
