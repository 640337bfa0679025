"""The base class of errors a user can cause and fix (bad config, unreachable server, wrong key).

Entry points catch it and print its message without a traceback; anything else is a bug and
keeps its traceback. The exit code tells a supervisor (``rlhf-run``) whether a restart can help:
2 for an error that needs a fix (a restart would repeat it), 75 (EX_TEMPFAIL) for a server that
stayed unreachable past the retry budget (a restart later may find it back). A learner stopped
by a signal before its budget was spent exits ``STOPPED_EARLY_EXIT`` (128 + SIGTERM, the shell's
code for it), not 0: its supervisor must not take the run for finished.
"""

STOPPED_EARLY_EXIT = 143


class UserError(Exception):
    """An error whose message says what was wrong and what to do."""

    exit_code = 2


class Unavailable(UserError):
    """A server this process needs stayed unreachable past its retry budget."""

    exit_code = 75


class FailureWindow:
    """The share of failures over the last ``window`` events (scorings, samples checked).

    :meth:`record` returns True once at least ``min_count`` events (default: a full window) are
    in the window and more than ``max_share`` of them failed: the caller then stops with its own
    error. Failures now and then stay under the share.
    """

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
