"""Errors raised by the weight-server clients; those a user can cause and fix subclass
:class:`~rlhf_core.errors.UserError`, and their messages say what to do.
"""

from __future__ import annotations

from rlhf_core.errors import Unavailable, UserError


class WeightServerError(Exception):
    """The server answered with an error this client cannot recover from (``code`` names it)."""

    def __init__(self, message: str, code: str = "error") -> None:
        super().__init__(message)
        self.code = code


class WeightAuthError(UserError):
    """Authentication failed: wrong CURVE key, wrong HMAC secret, or auth settings that differ."""


class StaleVersionError(UserError, ValueError):
    """A publish of a version that is not newer than the newest one the server holds."""


class WeightServerUnavailable(Unavailable, TimeoutError):
    """No reply from the weight server within the retry budget."""


class WeightIntegrityError(WeightServerError):
    """Published bytes did not match their content hash even after a retry."""


class TensorMismatchError(UserError, ValueError):
    """The tensors of a pulled version do not fit the target (names, shapes or dtypes differ)."""
