"""What the modules below the :class:`~buffer.Buffer` facade are given: one run on one Redis.

:mod:`buffer.prompts`, :mod:`buffer.samples`, :mod:`buffer.replay` and :mod:`buffer.metrics`
take a :class:`Store` (or, for ``metrics``, the parts of one it reads) and the plain values they
need (the run parameters, the client-side state they update), never the facade, so imports in
the package run one way, each module importing only ones below it::

    client                      the facade: run parameters, client-side state, delegation
    replay -> samples -> prompts    the work, as functions of a Store
    store                       client + retry policy + keys + scripts + config
    scripts                     the Lua, with names generated from metrics, pacing and keys
    metrics -> pacing           counter names and the snapshot; the pacing rule
    keys, connection            key names; connecting and retrying

As in rq, the Redis client is injected by whoever builds the store, never global.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from buffer.connection import Retrying
from buffer.keys import RunKeys
from buffer.scripts import Scripts
from rlhf_core.config import BufferConfig


@dataclass(frozen=True)
class Store:
    """One run's keys on one Redis: the client, the retry policy, the key names, the scripts and
    this process's buffer config. Holds no state of its own beyond what it is given."""

    redis: redis.Redis
    retry: Retrying
    keys: RunKeys
    scripts: Scripts
    cfg: BufferConfig

    @property
    def dead_maxlen(self) -> int:
        """MAXLEN ~ of the dead-letter stream (counters keep the totals)."""
        return int(self.cfg.dead_letter_maxlen)

    def wait_on(self, stream: str, last_id: bytes | str, timeout_s: float) -> None:
        """Block until an entry newer than ``last_id`` lands on ``stream``, or ``timeout_s`` passes."""
        ms = max(1, int(timeout_s * 1000))
        self.retry(self.redis.xread, {stream: last_id}, count=1, block=ms)
