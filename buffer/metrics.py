"""Counters and gauges kept in Redis for the monitor, and :func:`collect` that reads them.

Every counter lives in the run's ``counters`` hash and is changed only inside the Lua script or
MULTI/EXEC block that does the work it counts, so counts are exact even across crashes. The Lua
scripts name them through the preamble's ``C`` table (generated from :data:`COUNTERS`), so a
misspelt name fails loudly. Histograms (hashes lag -> samples): ``hist:consumed``, ``hist:dropped``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
import redis

from buffer import pacing
from buffer.connection import Retrying, control_int, corrupt_state
from buffer.keys import CONTROL_WORKERS, RETIRED_COUNT, WORKERS_GROUP, RunKeys
from rlhf_core.dapo import FILTER_REASONS

COUNTERS = (
    "prompts_enqueued",
    "prompts_claimed",  # first deliveries
    "prompts_reclaimed",  # re-delivered after a lease expired
    "prompts_released",  # given back un-done
    "prompts_dead_lettered",
    "prompts_waiting",  # gauge: enqueued, never delivered
    "completions_empty",  # completed with no valid sample
    "completions_duplicate",  # a completion of a prompt already completed
    "admitted",  # gauge: samples admitted by pacing (group_size per prompt or gateway group), net of give-backs
    "inflight",  # gauge: samples being generated
    "budget_returned",  # admission given back, in samples
    "groups_appended",  # samples_appended likewise
    "samples_appended",
    "groups_consumed",
    "samples_consumed",
    "groups_dropped_stale",  # too stale when read, never trained on
    "samples_dropped_stale",
    "groups_aged_out",  # replay: trained on, then too stale to be drawn again
    "samples_aged_out",
    "samples_evicted",
    "samples_dead_lettered",
    "entries_dead_lettered",
    "dead_letters",  # all kinds
    "groups_removed",  # left the sample stream: consumed, dropped, evicted or used up
    "samples_removed",
    "replay_size",  # gauge: samples in the replay table
    "replay_seq",
    "rl_inserts",  # the replay rate limiter's (rl_samples may be fractional)
    "rl_samples",
    "groups_filtered",  # completed without being appended: algo.filter_groups
    "samples_filtered",
    "groups_external",  # appended without a prompt lease (rlhf-gateway's), in groups_appended too
    *(f"groups_filtered_{reason}" for reason in FILTER_REASONS),
)

#: Counters that hold floats (HINCRBYFLOAT); all others are integers.
FLOAT_COUNTERS = frozenset({"rl_samples"})

#: The gauges among the counters hash's fields and the derived values (the rest only grow).
LEVELS = frozenset({"prompts_waiting", "admitted", "inflight", "replay_size", "samples_in_buffer", "groups_in_buffer"})


def _num(raw: bytes | str | None, name: str, key: str) -> int | float:
    if raw is None:
        return 0
    if name not in FLOAT_COUNTERS:
        return control_int(raw, key, name)
    try:
        return float(raw)
    except ValueError:
        raise corrupt_state(f"{key} {name} holds {raw[:40]!r}, not a number") from None


def read_counters(raw: dict[bytes, bytes], key: str = "counters") -> dict[str, int | float]:
    """The counters hash (``key``: its name, for errors) and the values derived from it (not
    stored, so the worker's hot path writes less): ``prompts_acked``, ``samples_in_buffer``, ``groups_in_buffer``."""
    out: dict[str, int | float] = {name: 0 for name in COUNTERS}
    for k, v in raw.items():
        name = k.decode("utf-8", "replace") if isinstance(k, bytes) else k
        out[name] = _num(v, name, key)
    out["prompts_acked"] = out["groups_appended"] + out["completions_empty"] + out["groups_filtered"]
    out["samples_in_buffer"] = out["samples_appended"] - out["samples_removed"]
    out["groups_in_buffer"] = out["groups_appended"] - out["groups_removed"]
    return out


def read_hist(raw: dict[bytes, bytes], key: str = "histogram") -> dict[int, int]:
    """A lag histogram hash {lag: samples}; a field or value that is not an integer raises
    :class:`~buffer.connection.CorruptStateError` naming ``key``."""
    pairs = ((control_int(k, key, "field"), control_int(v, key, k.decode("utf-8", "replace") if isinstance(k, bytes) else k))
             for k, v in raw.items())
    return dict(sorted((lag, n) for lag, n in pairs if n != 0))


def pack_consumer(clock: float, version: int | None, stats: dict[str, Any] | None, leases: int) -> bytes:
    """The per-consumer record the monitor shows, less its ``last_seen``: the map header counts one
    entry more, which ``heartbeat.lua`` appends with Redis's clock (``clock`` is the consumer's own)."""
    fields = {"clock": clock, "version": version, "stats": stats or {}, "leases": leases}
    packer = msgpack.Packer(use_bin_type=True)
    return packer.pack_map_header(len(fields) + 1) + b"".join(packer.pack(k) + packer.pack(v) for k, v in fields.items())


def pack_stats(stats: dict[str, Any]) -> bytes:
    """A component's stats (numbers, strings, lists) as msgpack; other values become strings."""
    return msgpack.packb(stats, use_bin_type=True, default=str)


def unpack_record(raw: bytes) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=False, max_ext_len=0)
    except Exception:  # noqa: BLE001  # a garbled record must not break the monitor
        return {"error": "unreadable record"}
    return obj if isinstance(obj, dict) else {"error": "unreadable record"}


def read_retired(raw: dict[bytes, bytes], key: str = "retired") -> dict[str, Any]:
    """The retired consumers' hash as ``{"consumers": how many, "stats": {stat: sum}}`` (integral
    sums as ints); a value that is not a number raises :class:`~buffer.connection.CorruptStateError`."""
    stats: dict[str, int | float] = {}
    for k, v in raw.items():
        name = k.decode("utf-8", "replace")
        try:
            x = float(v)
        except ValueError:
            raise corrupt_state(f"{key} {name} holds {v[:40]!r}, not a number") from None
        stats[name] = int(x) if x.is_integer() else x
    return {"consumers": int(stats.pop(RETIRED_COUNT, 0)), "stats": stats}


def collect(client: redis.Redis, retry: Retrying, keys: RunKeys, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """One snapshot for the monitor (``params``: the run parameters, None before ``init_run``). Shapes::

        {"run_id": str, "learner_version": int, "learner_updates": int, "admission_budget": int, "mode": "fifo"|"replay",
         "counters": {name: number}, "depth": {...}, "staleness_hist": {lag: samples},
         "dropped_stale_hist": {lag: samples}, "consumers": {name: {last_seen, age_s, version, stats, leases}},
         "retired": {"consumers": int, "stats": {stat: sum}},   # consumers retired (buffer.prompts.retire)
         "stats": {component: {...}},   # what publish_stats stored
         "control": {"workers": int | None}}   # the worker actors asked for (MonitorClient.set_worker_target)
    """
    k = keys

    def read() -> list[Any]:  # built per attempt: a failed execute empties the pipeline
        pipe = client.pipeline(transaction=True)
        pipe.hgetall(k.counters)
        pipe.get(k.version)
        pipe.get(k.updates)
        pipe.hgetall(k.hist_consumed)
        pipe.hgetall(k.hist_dropped)
        pipe.hgetall(k.consumers)
        pipe.hgetall(k.retired)
        pipe.xlen(k.dead)
        pipe.hgetall(k.stats)
        pipe.hget(k.control, CONTROL_WORKERS)
        pipe.time()  # heartbeats are stamped on Redis's clock: ages are taken on it too
        return pipe.execute()

    counters_raw, version, updates, hist_c, hist_d, consumers_raw, retired_raw, dead_len, stats_raw, workers_raw, now = \
        retry(read)
    pel = retry(client.xpending, k.prompts, WORKERS_GROUP) if params else None
    counters = read_counters(counters_raw, k.counters)
    learner_version = control_int(version, k.version, "")
    learner_updates = pacing.trained_updates(updates, learner_version, k.updates)
    now = now[0] + now[1] / 1e6
    consumers = {}
    for name, raw in consumers_raw.items():
        rec = unpack_record(raw)
        if "last_seen" in rec:
            rec["age_s"] = round(now - float(rec["last_seen"]), 3)
        consumers[name.decode()] = rec
    leased = int(pel["pending"]) if isinstance(pel, dict) else 0
    return {
        "run_id": k.run_id,
        "learner_version": learner_version,
        "learner_updates": learner_updates,  # below the version after a learner restart renumbered its weights
        "admission_budget": pacing.admission_budget(params, learner_updates, counters) if params else 0,
        "mode": params["mode"] if params else "fifo",
        "counters": counters,
        "depth": {
            "prompts_waiting": counters["prompts_waiting"],
            "prompts_leased": leased,
            "samples_inflight": counters["inflight"],
            "samples_in_buffer": counters["samples_in_buffer"],
            "groups_in_buffer": counters["groups_in_buffer"],
            "replay_size": counters["replay_size"],
            "dead_letters": int(dead_len),
        },
        "staleness_hist": read_hist(hist_c, k.hist_consumed),
        "dropped_stale_hist": read_hist(hist_d, k.hist_dropped),
        "consumers": consumers,
        "retired": read_retired(retired_raw, k.retired),
        "stats": {name.decode(): unpack_record(raw) for name, raw in stats_raw.items()},
        # what was asked of the launcher from outside (rlhf-monitor workers=N); None: never
        "control": {"workers": None if workers_raw is None else control_int(workers_raw, k.control, CONTROL_WORKERS)},
    }
