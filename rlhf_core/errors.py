"""The base class of errors a user can cause and fix (bad config, unreachable server, wrong key).

Entry points print its message without a traceback; anything else is a bug. The exit code tells a
supervisor whether a restart can help: 2 for an error that needs a fix (:class:`DiskFull` too),
75 (EX_TEMPFAIL) for a server that stayed unreachable, ``STOPPED_EARLY_EXIT`` (128 + SIGTERM) for
a learner stopped by a signal before its budget was spent (not finished).
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STOPPED_EARLY_EXIT = 143
#: a write the disk cannot hold: full, over a quota, over a file-size limit
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class UserError(Exception):
    """An error whose message says what was wrong and what to do."""

    exit_code = 2


class ConfigError(UserError, ValueError):
    """A setting (or a combination of settings) a user can fix. The message says how."""


class DiskFull(UserError):
    """A file the disk cannot hold; the message names it and the room left."""


def free_space(path: str | Path) -> str:
    """``'12.5 MiB free on its disk'`` for the file system holding ``path`` (or its nearest
    folder that exists)."""
    for p in (Path(path), *Path(path).parents):
        try:
            return f"{shutil.disk_usage(p).free / 2**20:.1f} MiB free on its disk"
        except OSError:
            continue
    return "its disk unreadable"


def disk_full(path: str | Path, exc: OSError) -> DiskFull:
    """The one line for a write to ``path`` that failed with ``exc`` (one of :data:`DISK_FULL`).
    A restart would only fail again: the process stops with it (exit 2) and is not restarted."""
    return DiskFull(f"cannot write {path} ({exc.strerror or exc}); {free_space(path)}: make room there (or move the "
                    "run's output to a larger disk), then continue the run: rlhf-run resume=<its output folder>")


@contextmanager
def disk_writes(path: str | Path) -> Iterator[None]:
    """Turn a write inside that the disk cannot hold into :func:`disk_full` naming its file (the
    error's, else ``path``); put it outside the ``open``, so that the flush at close is covered."""
    try:
        yield
    except OSError as exc:
        if exc.errno in DISK_FULL:
            raise disk_full(exc.filename or path, exc) from exc
        raise


class Unavailable(UserError):
    """A server this process needs stayed unreachable past its retry budget."""

    exit_code = 75


class FailureWindow:
    """The share of failures over the last ``window`` events: :meth:`record` returns True once at
    least ``min_count`` events (default: a full window) are in and more than ``max_share`` failed."""

    def __init__(self, window: int, max_share: float, min_count: int | None = None) -> None:
        from collections import deque

        self.window, self.max_share = int(window), float(max_share)
        self.min_count = self.window if min_count is None else int(min_count)
        self.recent: deque[bool] = deque(maxlen=self.window)
        self.failures = 0  # in the window
        self.last_reason = ""

    def record(self, failed: bool, reason: str = "") -> bool:
        if len(self.recent) == self.window:
            self.failures -= self.recent[0]
        self.recent.append(failed)
        self.failures += failed
        if failed:
            self.last_reason = reason
        return len(self.recent) >= self.min_count and self.failures > self.max_share * len(self.recent)
