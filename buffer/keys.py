"""Every Redis key of a run, in one place.

All keys of run ``R`` live under ``rlhf:{R}:``. The braces are a Redis Cluster hash tag: every
key of a run hashes to one slot, so the Lua scripts (which touch several keys at once) also run
on a cluster. Several runs (a Hydra multirun sweep) share one Redis without touching each
other, and :meth:`RunKeys.pattern` finds exactly one run's keys for an explicit delete.

Layout (``P = rlhf:{run_id}:``)::

    P params          hash    run parameters written once by init_run (batch/group size, staleness, limiter, ...)
    P version         string  learner version: the number its newest published weights go by (staleness is
                              measured against it); a restarted learner may number its weights past the
                              updates they hold, so no number names two sets of weights
    P updates         string  updates the learner's published weights hold (restored from its checkpoint
                              after a restart), written with ``version``; pacing counts these (a run's data
                              without the key: the version)
    P counters        hash    monotonic counters and gauges (names in buffer.metrics.COUNTERS)
    P prompts         stream  prompt queue; consumer group ``workers`` holds the leases
    P samples         stream  one entry per completed group; consumer group ``learner`` (FIFO mode)
    P dead            stream  dead letters (kind, reason, producer, raw bytes), capped with MAXLEN ~
    P wake:prompts    stream  wake-ups for blocked claimers (prompts enqueued, budget returned, version bumped)
    P wake:replay     stream  wake-ups for the replay limiter (inserts and draws)
    P hist:consumed   hash    staleness lag -> samples consumed
    P hist:dropped    hash    staleness lag -> samples dropped as too stale
    P consumers       hash    consumer name -> msgpack {clock, version, stats, leases, last_seen (Redis's clock)}
    P retired         hash    consumers retired from ``consumers`` (long silent, no lease left): their
                              stats' running totals summed (stat -> sum) and ``consumers`` -> how many
    P stats           hash    component (learner, weight_server, ...) -> msgpack of its latest stats
    P fill            hash    prompt producer cursor {epoch, index, done}
    P replay:index    zset    replay table: sample-entry id -> version * 2**32 + insertion seq
    P replay:n        hash    entry id -> samples in the entry
    P replay:uses     hash    entry id -> committed uses
    P replay:out      hash    entry id -> learner consumer holding it in an uncommitted batch
    P control         hash    settings changed from outside while the run goes on: ``workers`` (the
                              number of worker actors a ``launcher=ray`` run keeps; ``rlhf-monitor workers=N``)
    P gw:calls        list    generation calls of rlhf-gateway, oldest at the tail (``buffer.gateway``)
    P gw:cancel       hash    call id -> time: calls whose client went away (the worker aborts them; kept gateway.call_timeout_s at most)
    P gw:out:<id>     channel pub/sub, not a key: the tokens of one gateway's calls (``RunKeys.gw_out``)
    P gw:rewarded     hash    key -> msgpack Sample: rewarded sessions kept until their group is appended (``gateway.sessions``)
    P gw:live         string  the id of the run's gateway, refreshed every second, lapsing without (``buffer.gateway.hold_run``)

The fields of the stream entries are defined at the end of this module; the Lua scripts get
all of these names through the preamble built in :mod:`buffer.scripts`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from rlhf_core.errors import UserError

PREFIX = "rlhf"

#: Consumer groups (one per stream that has readers).
WORKERS_GROUP = "workers"
LEARNER_GROUP = "learner"
#: Pseudo-consumer that owns prompts given back with ``release``; claimers take them first.
RELEASED_CONSUMER = "__released__"
#: The field of the ``retired`` hash counting the consumers retired (its other fields are stats).
RETIRED_COUNT = "consumers"

# A run id or consumer name is part of keys and of a SCAN pattern: no glob characters, no braces
# (hash tag), no whitespace. Hydra multirun names such as ``sweep/algo.max_staleness=2`` are fine.
_NAME = re.compile(r"^[A-Za-z0-9_.,=+@/:-]{1,200}$")


class BadName(UserError, ValueError):
    """A run id or consumer name that cannot be used in Redis keys."""


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _NAME.match(run_id):
        raise BadName(
            f"run id {run_id!r} cannot be used as a Redis key prefix: use 1-200 characters from "
            "letters, digits and _ . , = + @ / : - (no spaces, braces or glob characters * ? [ ])"
        )
    return run_id


def check_consumer(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or name == RELEASED_CONSUMER:
        raise BadName(
            f"consumer name {name!r} is not usable: use 1-200 characters from letters, digits and "
            f"_ . , = + @ / : - (and not the reserved {RELEASED_CONSUMER!r})"
        )
    return name


@dataclass(frozen=True)
class RunKeys:
    """The key names of one run. Build with ``RunKeys.for_run(run_id)``."""

    run_id: str
    prefix: str
    params: str
    version: str
    updates: str
    counters: str
    prompts: str
    samples: str
    dead: str
    wake_prompts: str
    wake_replay: str
    hist_consumed: str
    hist_dropped: str
    consumers: str
    retired: str
    stats: str
    fill: str
    replay_index: str
    replay_n: str
    replay_uses: str
    replay_out: str
    control: str
    gw_calls: str
    gw_cancel: str
    gw_rewarded: str
    gw_live: str

    @classmethod
    def for_run(cls, run_id: str) -> RunKeys:
        check_run_id(run_id)
        p = f"{PREFIX}:{{{run_id}}}:"
        # each key is its field's name with ':' for '_' (wake_prompts -> P wake:prompts)
        return cls(run_id, p, *(p + f.name.replace("_", ":") for f in fields(cls)[2:]))

    def gw_out(self, gateway_id: str) -> str:
        """The pub/sub channel of one gateway's call chunks (a channel, so not in :meth:`all`)."""
        return f"{self.prefix}gw:out:{check_consumer(gateway_id)}"

    def pattern(self) -> str:
        """SCAN pattern matching exactly this run's keys (run ids hold no glob characters)."""
        return self.prefix + "*"

    def all(self) -> list[str]:
        return [v for k, v in self.__dict__.items() if k not in ("run_id", "prefix")]


#: control hash: the number of worker actors the run's launcher keeps (rlhf-monitor workers=N sets it)
CONTROL_WORKERS = "workers"

# ---- stream entry layouts (the fields of the entries in the streams above) ----------------
#: prompts stream: one field holding the encoded rlhf_core.records.Prompt
PROMPT_FIELD = "d"
#: samples stream: one entry per completed group; sample i of the group is field f"s{i}"
F_GROUP = "g"  # group id
F_PROMPT_ID = "p"  # prompt id
F_VERSION = "v"  # oldest token version over the group's samples (staleness filter reads only this)
F_COUNT = "n"  # samples in this entry (a partial group has fewer than group_size)
F_PRODUCER = "w"  # worker (consumer) that completed the group
F_TIME = "t"  # completion time, seconds since the epoch
SAMPLE_FIELD_PREFIX = "s"
#: dead stream
D_KIND = "kind"  # sample | prompt | entry
D_REASON = "reason"
D_PRODUCER = "producer"
D_RAW = "raw"  # the bytes as received (never decoded further), the first DEAD_RAW_MAX of them
D_RAW_BYTES = "raw_bytes"  # the record's full size
D_RAW_SHA1 = "raw_sha1"  # SHA-1 of the whole record (when the stored bytes are a prefix)
D_SOURCE = "source"  # stream id of the prompt or sample entry it came from, if any
D_TIME = "ts"
#: bytes of a dead record kept in the dead-letter stream
DEAD_RAW_MAX = 64 * 1024
#: wake streams are notifications only; keep the last few hundred
WAKE_MAXLEN = 256
