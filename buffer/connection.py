"""Connecting to Redis: URLs (redis://, rediss://, unix://, ACL user:password), TLS, retries.

Failures a user can fix get their own error saying what to do: :class:`BufferUnavailable`
(Redis unreachable, or down longer than ``buffer.max_retry_s`` during a run),
:class:`BufferAuthError` (credentials refused), :class:`BufferOutOfMemory` and
:class:`BufferDiskError` (Redis refused writes past ``buffer.max_retry_s`` for want of memory or
disk; until then they are retried, as nothing ran). A Redis whose ``maxmemory-policy`` may evict
the run's keys is refused at :func:`connect`. Transient errors are retried with capped exponential
backoff and one log line per attempt; redis-py's own silent retries are off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rlhf_core.config import BufferConfig
from rlhf_core.errors import Unavailable, UserError
from rlhf_core.retry import Backoff

log = logging.getLogger("buffer")

T = TypeVar("T")

#: First and largest pause between retries (seconds): a Redis restart is ridden out within ~2 s of its end.
BACKOFF_START_S = 0.05
BACKOFF_CAP_S = 2.0
#: Socket read timeout: every blocking command we send blocks for a few seconds at most.
SOCKET_TIMEOUT_S = 30.0

_TRANSIENT = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, ConnectionError, TimeoutError)
_AUTH = (redis.exceptions.AuthenticationError, redis.exceptions.AuthenticationWrongNumberOfArgsError)


class BufferUnavailable(Unavailable, ConnectionError):
    """Redis cannot be reached. The message names the address and how to start Redis."""


class BufferAuthError(UserError, PermissionError):
    """Redis refused the user name / password (or the ACL user lacks a permission)."""


class BufferOutOfMemory(UserError):
    """Redis stayed out of memory (``maxmemory`` reached under ``noeviction``) past
    ``buffer.max_retry_s``: it refused every write meanwhile, so nothing was half done."""


class BufferDiskError(UserError):
    """Redis refused writes past ``buffer.max_retry_s`` because it cannot write its data to disk
    (``MISCONF``: its append-only file or snapshot failed, a full disk); nothing was half done."""


class CorruptStateError(UserError):
    """A key the service keeps for itself holds a value or type the service never writes (another
    client changed it). Processes stop with it; nothing is repaired behind the user."""


#: Prefix of the error the Lua scripts raise on a corrupt control value (``ctl`` in the preamble).
CORRUPT_MARK = "RLHF_CORRUPT"
_CORRUPT_REPLIES = ("WRONGTYPE", "hash value is not an integer", "value is not an integer")


def corrupt_state(detail: str) -> CorruptStateError:
    return CorruptStateError(
        f"the run's control state in Redis is corrupt: {detail}. Another client wrote to the service's own "
        "keys (rlhf:{<run id>}:*). Stop the run, inspect the key with redis-cli (TYPE / HGETALL / GET), then "
        "restore Redis from its append-only file or start a new run (buffer.run_id); keep other clients off "
        "the run's keys with a Redis ACL (docs/operations.md)"
    )


def control_int(raw: bytes | str | None, key: str, name: str) -> int:
    """An integer the service stored under ``key`` (a hash field ``name``, or the value itself);
    :class:`CorruptStateError` naming both when it is not one; 0 when unset."""
    if raw is None or raw == b"" or raw == "":
        return 0
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else str(raw)
    try:
        return int(text)
    except ValueError:
        where = f"{key} {name}" if name else key
        raise corrupt_state(f"{where} holds {text[:40]!r}, not an integer") from None


def _keys_of(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> list[str]:
    """The keys a call touches, for naming them in an error: a script's ``keys``, a pipeline's
    queued commands, or a command's first argument (a key, or a {stream: id} mapping)."""
    if kwargs.get("keys"):
        return [str(k) for k in kwargs["keys"]]
    stack = getattr(getattr(fn, "__self__", None), "command_stack", None)
    if stack:
        return list(dict.fromkeys(str(cmd[0][1]) for cmd in stack if len(cmd[0]) > 1))
    if args and isinstance(args[0], dict):
        return [str(k) for k in args[0]]
    return [str(args[0])] if args and isinstance(args[0], (str, bytes)) else []


def _corrupt_reply(exc: redis.exceptions.ResponseError, keys: list[str]) -> CorruptStateError | None:
    text = str(exc)
    if CORRUPT_MARK in text:
        return corrupt_state(text.split(CORRUPT_MARK, 1)[1].split(" script:", 1)[0].strip())
    if any(mark in text for mark in _CORRUPT_REPLIES):
        where = f" on one of {keys}" if keys else ""
        return corrupt_state(f"Redis replied {text.split(' script:', 1)[0]!r}{where}")
    return None


def redact(url: str) -> str:
    """The URL with its password replaced by ``***`` (safe for logs and error messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))


def address(url: str) -> tuple[str, str]:
    """(human-readable address, suggested start command) for error messages."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix socket {parts.path}", f"redis-server --port 0 --unixsocket {parts.path}"
    port = parts.port or 6379
    host = parts.hostname or "localhost"
    # the same data dir and append-only file, or the restarted server starts empty
    start = f"redis-server --port {port} --dir <its data dir> --appendonly yes"
    if parts.scheme == "rediss":
        start = f"redis-server --port 0 --tls-port {port} --tls-cert-file ... --tls-key-file ... --tls-ca-cert-file ..."
    return f"{host}:{port}", start


def client_kwargs(url: str, cfg: BufferConfig, setting: str = "buffer.url") -> dict[str, Any]:
    """Keyword arguments for ``redis.Redis.from_url`` (TLS options only for rediss://); ``setting``:
    the setting ``url`` came from, named in the errors."""
    scheme = urlsplit(url).scheme
    if scheme not in ("redis", "rediss", "unix"):
        raise BufferUnavailable(f"{setting} {redact(url)!r} must start with redis://, rediss:// or unix://")
    kwargs: dict[str, Any] = {
        "socket_connect_timeout": max(0.1, min(cfg.connect_timeout_s, 10.0)),
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_keepalive": True,
        # Retries are ours (logged, capped, bounded in time); redis-py's would retry silently.
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 30,
        # RESP2: the reply shapes the buffer parses (RESP3 turns stream replies into maps)
        "protocol": 2,
    }
    if scheme == "rediss":
        kwargs["ssl_ca_certs"] = cfg.ssl_ca_certs
        kwargs["ssl_certfile"] = cfg.ssl_certfile
        kwargs["ssl_keyfile"] = cfg.ssl_keyfile
    elif any((cfg.ssl_ca_certs, cfg.ssl_certfile, cfg.ssl_keyfile)):
        log.warning("buffer.ssl_* options are set but buffer.url is not rediss://; they are ignored")
    return kwargs


def auth_error(url: str, exc: Exception, setting: str = "buffer.url") -> BufferAuthError:
    where, _ = address(url)
    user = urlsplit(url).username
    who = f"user {unquote(user)!r}" if user else "the default user"
    return BufferAuthError(
        f"Redis at {where} refused the credentials of {who} ({exc}): check the user and password in "
        f"{setting} (redis://USER:PASSWORD@host:port/db; now {redact(url)}); the password must match "
        "the server's requirepass or an ACL user"
    )


def out_of_memory(url: str, max_retry_s: float) -> BufferOutOfMemory:
    return BufferOutOfMemory(
        f"Redis at {address(url)[0]} is out of memory (used memory > maxmemory) and refused writes for "
        f"buffer.max_retry_s={max_retry_s:g} s: raise its maxmemory (redis-cli CONFIG SET maxmemory <bytes>, 0 for no limit), free memory in "
        "it, or give the run a Redis of its own; nothing was half written, so resume the run (rlhf-run resume=...) "
        "or restart this process once it has room"
    )


def _disk_refusal(exc: redis.exceptions.ResponseError) -> bool:
    """Redis refusing writes (and PING) because its last write of the append-only file or a
    snapshot failed."""
    return str(exc).startswith("MISCONF")


def disk_refused(url: str, exc: Exception, max_retry_s: float) -> BufferDiskError:
    return BufferDiskError(
        f"Redis at {address(url)[0]} cannot write its data to disk and refused writes for buffer.max_retry_s="
        f"{max_retry_s:g} s ({exc}): make room on the disk of its data folder (rlhf-run's own Redis keeps it in "
        "redis/ of the run's output folder); nothing was half written, so resume the run (rlhf-run resume=...) once "
        "it has room"
    )


#: Policies that evict any key when maxmemory is reached: the run's keys (none has a TTL, so the
#: volatile-* policies never pick them) would vanish without an error, samples with them.
_EVICTING = ("allkeys-lru", "allkeys-lfu", "allkeys-random")


def check_no_eviction(client: redis.Redis, url: str) -> None:
    """Refuse a Redis that would evict the run's keys when full. A user who may not run INFO
    (an ACL without @dangerous, docs/operations.md) is not checked."""
    try:
        info = client.info("memory")
    except redis.exceptions.NoPermissionError:
        return
    policy = str(info.get("maxmemory_policy", "noeviction"))
    if int(info.get("maxmemory", 0) or 0) > 0 and policy in _EVICTING:
        raise UserError(
            f"Redis at {address(url)[0]} has maxmemory-policy {policy} with maxmemory {info['maxmemory']}: when "
            "full it deletes keys of the run (samples, leases, counters) without an error; give the run a Redis "
            "with maxmemory-policy noeviction (redis-cli CONFIG SET maxmemory-policy noeviction) or a volatile-* "
            "policy, or no maxmemory (docs/operations.md)"
        )


class Retrying:
    """Runs Redis calls, retrying transient errors for up to ``max_retry_s`` per call.
    ``reconnects`` counts the retried connection errors, so a caller that keeps client-side state
    about server state (the learner's delivered entries) knows to re-sync."""

    def __init__(self, url: str, max_retry_s: float) -> None:
        self.url = url
        self.max_retry_s = max_retry_s
        self.reconnects = 0

    def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        backoff = Backoff(BACKOFF_START_S, BACKOFF_CAP_S, self.max_retry_s)
        while True:
            keys = _keys_of(fn, args, kwargs)  # before the call: a pipeline forgets its commands
            try:
                return fn(*args, **kwargs)
            except _AUTH as exc:
                raise auth_error(self.url, exc) from None
            except redis.exceptions.NoPermissionError as exc:
                raise BufferAuthError(
                    f"Redis at {address(self.url)[0]} denied a command to this ACL user ({exc}): grant it "
                    "+@all on the run's keys (~rlhf:*), or use a user with more permissions"
                ) from None
            except redis.exceptions.ResponseError as exc:
                # Out of memory, or of disk (MISCONF): refused before anything ran (our scripts are
                # flagged, a MULTI is refused whole), so sending it again is safe.
                oom = isinstance(exc, redis.exceptions.OutOfMemoryError)
                if not oom and not _disk_refusal(exc):
                    corrupt = _corrupt_reply(exc, keys)
                    if corrupt is None:
                        raise
                    raise corrupt from None
                delay = backoff.next_delay()
                if delay is None:
                    raise (out_of_memory(self.url, self.max_retry_s) if oom else disk_refused(self.url, exc, self.max_retry_s)) from None
                what = ("is out of memory (used memory > maxmemory)", "raise its maxmemory or free memory in it") if oom else \
                    (f"cannot write to disk ({exc})", "make room on the disk of its data folder")
                log.warning("redis at %s %s and refused %s; retrying in %.2f s (attempt %d, giving up after %g s): %s",
                            address(self.url)[0], what[0], keys or "a command", delay, backoff.attempts, self.max_retry_s, what[1])
                time.sleep(delay)
            except _TRANSIENT as exc:
                delay = backoff.next_delay()
                if delay is None:
                    where, cmd = address(self.url)
                    raise BufferUnavailable(
                        f"lost Redis at {where} and it did not come back within buffer.max_retry_s="
                        f"{self.max_retry_s:g} s ({type(exc).__name__}: {exc}); is redis-server still "
                        f"running? restart it (e.g. `{cmd}`) and restart this process"
                    ) from None
                log.warning(
                    "redis at %s: %s: %s; retrying in %.2f s (attempt %d, giving up after %g s)",
                    address(self.url)[0], type(exc).__name__, exc, delay, backoff.attempts, self.max_retry_s,
                )
                self.reconnects += 1
                time.sleep(delay)


def connect(url: str, cfg: BufferConfig, setting: str = "buffer.url") -> redis.Redis:
    """Open a client and check Redis answers within ``cfg.connect_timeout_s``; the errors name
    ``setting``, the setting ``url`` came from (``rlhf-monitor``'s is ``url``)."""
    client = redis.Redis.from_url(url, **client_kwargs(url, cfg, setting))
    where, cmd = address(url)
    backoff = Backoff(BACKOFF_START_S, BACKOFF_CAP_S, cfg.connect_timeout_s)
    while True:
        try:
            client.ping()
            break
        except _AUTH as exc:
            client.close()
            raise auth_error(url, exc, setting) from None
        except redis.exceptions.ResponseError as exc:
            if _disk_refusal(exc):  # it answers (refusing even PING): its writes are retried as they come
                break
            raise
        except _TRANSIENT as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if "SSL" in str(exc) or "certificate" in str(exc).lower():
                client.close()
                raise BufferUnavailable(
                    f"cannot open a TLS connection to Redis at {where} ({reason}): check buffer.ssl_ca_certs, "
                    "buffer.ssl_certfile and buffer.ssl_keyfile, and that the server has TLS on that port"
                ) from None
            delay = backoff.next_delay()
            if delay is None:
                client.close()
                raise BufferUnavailable(
                    f"cannot reach Redis at {where} ({reason}) within {cfg.connect_timeout_s:g} s: is "
                    f"redis-server running? start one with `{cmd}`, or fix {setting} (now {redact(url)})"
                ) from None
            log.info("waiting for Redis at %s (%s); retrying in %.2f s", where, reason, delay)
            time.sleep(delay)
    try:
        check_no_eviction(client, url)
    except UserError:
        client.close()
        raise
    return client
