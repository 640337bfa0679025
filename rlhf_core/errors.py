"""The base class of errors a user can cause and fix (bad config, unreachable server, wrong key).

Entry points catch it and print its message without a traceback; anything else is a bug and
keeps its traceback. The exit code tells a supervisor (``rlhf-run``) whether a restart can help:
2 for an error that needs a fix (a restart would repeat it), 75 (EX_TEMPFAIL) for a server that
stayed unreachable past the retry budget (a restart later may find it back).
"""


class UserError(Exception):
    """An error whose message says what was wrong and what to do."""

    exit_code = 2


class Unavailable(UserError):
    """A server this process needs stayed unreachable past its retry budget."""

    exit_code = 75
