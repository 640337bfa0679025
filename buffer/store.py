"""One process's connection to one run: the :class:`Store` every role client and every module
below them share (the injected Redis client, retry policy, keys, scripts, config, run parameters).
The modules import one way (docs/architecture.md, Buffer; ``tests/unit/test_import_rules.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from buffer.connection import Retrying, connect, redact
from buffer.keys import RunKeys
from buffer.scripts import Scripts
from rlhf_core.config import BufferConfig
from rlhf_core.errors import UserError

log = logging.getLogger("buffer")

_INT_PARAMS: tuple[str, ...] = ("batch_size", "group_size", "max_staleness", "max_deliveries", "min_size_to_sample",
                                "capacity", "max_reuse", "dead_maxlen")
_OPT_INT_PARAMS: tuple[str, ...] = ("max_response_tokens", "vocab_size", "lookahead")
_FLOAT_PARAMS: tuple[str, ...] = ("error_buffer", "lease_timeout_s")
_OPT_FLOAT_PARAMS: tuple[str, ...] = ("samples_per_insert",)
_STR_PARAMS = ("mode", "sampling")
#: Every field of the run's ``params`` hash (the Lua scripts read some of them by name).
PARAM_NAMES = _INT_PARAMS + _OPT_INT_PARAMS + _FLOAT_PARAMS + _OPT_FLOAT_PARAMS + _STR_PARAMS


class RunNotInitialised(UserError, LookupError):
    """The run has no parameters in Redis yet (the learner/launcher calls ``init_run``)."""


class Store:
    """One run's keys on one Redis: the client, the retry policy, the key names, the scripts,
    this process's buffer config and the run parameters once read (they never change once set)."""

    def __init__(self, client: redis.Redis, run_id: str | None = None, cfg: BufferConfig | None = None,
                 url: str | None = None) -> None:
        self.cfg = cfg or BufferConfig()
        self.redis = client
        self.keys = RunKeys.for_run(run_id or self.cfg.run_id)
        self.url = url or _url_of(client)
        self.retry = Retrying(self.url, self.cfg.max_retry_s)
        self.scripts = Scripts(client)
        self.cached_params: dict[str, Any] | None = None  # None: not read yet (or the run was deleted)

    @classmethod
    def connect(cls, url: str | None = None, run_id: str | None = None, cfg: BufferConfig | None = None,
                setting: str = "buffer.url") -> Store:
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
    def dead_maxlen(self) -> int:
        """MAXLEN ~ of the dead-letter stream (counters keep the totals)."""
        return int(self.cfg.dead_letter_maxlen)

    def wait_on(self, stream: str, last_id: bytes | str, timeout_s: float) -> None:
        """Block until an entry newer than ``last_id`` lands on ``stream``, or ``timeout_s`` passes."""
        ms = max(1, int(timeout_s * 1000))
        self.retry(self.redis.xread, {stream: last_id}, count=1, block=ms)

    def initialised(self) -> bool:
        return self.cached_params is not None or bool(self.retry(self.redis.exists, self.keys.params))

    def run_params(self) -> dict[str, Any]:
        """The run's parameters (cached: they never change once set)."""
        if self.cached_params is None:
            raw = self.retry(self.redis.hgetall, self.keys.params)
            if not raw:
                raise RunNotInitialised(
                    f"run {self.keys.run_id!r} has no parameters in Redis yet: the learner (or rlhf-run) calls "
                    "init_run when it starts; check buffer.run_id and buffer.url match the learner's"
                )
            self.cached_params = parse_params(raw)
        return dict(self.cached_params)

    def lease_s(self) -> float:
        """The run's lease timeout (same for every worker); this process's setting until the parameters were read."""
        return self.cached_params["lease_timeout_s"] if self.cached_params else self.cfg.lease_timeout_s


def parse_params(raw: dict) -> dict[str, Any]:
    """The ``params`` hash as stored (bytes) -> the run parameters, typed."""
    p = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in raw.items()}
    out: dict[str, Any] = dict(p)
    for names, kind in ((_INT_PARAMS, int), (_FLOAT_PARAMS, float)):
        out.update({name: kind(p[name]) for name in names if name in p})
    for names, kind in ((_OPT_INT_PARAMS, int), (_OPT_FLOAT_PARAMS, float)):
        out.update({name: kind(p[name]) if p.get(name) else None for name in names})
    return out


def _url_of(client: redis.Redis) -> str:
    kw = client.connection_pool.connection_kwargs
    if kw.get("path"):
        return f"unix://{kw['path']}"
    return f"redis://{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"
