"""The base class of errors a user can cause and fix (bad config, unreachable server, wrong key).

Entry points catch it and print its message without a traceback; anything else is a bug and
keeps its traceback.
"""


class UserError(Exception):
    """An error whose message says what was wrong and what to do."""
