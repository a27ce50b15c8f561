"""The project's error types.

`DlocoError` is the one base class of every error this project raises on purpose.  Wire input that
cannot be trusted fails with `ProtocolError`, which carries a short machine-readable `reason`
(``"checksum"``, ``"version"``, ...) so that a receiver can count rejections by reason and log one
line, as in::

    try:
        message = protocol.decode(frames)
    except protocol.ProtocolError as error:
        rejected[error.reason] += 1
"""

from __future__ import annotations


class DlocoError(Exception):
    """Base class of every error raised on purpose by this project."""


class ProtocolError(DlocoError):
    """Input from the wire is malformed, inconsistent or not allowed.

    `reason` is a stable identifier suitable as a metric label; the message says what was wrong,
    with the offending value.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class EncodeError(DlocoError, ValueError):
    """Local input handed to an encoder is not encodable (a caller bug, never wire input)."""


class ConfigError(DlocoError, ValueError):
    """A configuration value is out of its domain; the message names the field and the value."""


def require(condition: bool, message: str) -> None:
    """Raise ConfigError(message) unless `condition` holds (for `__post_init__` validation)."""
    if not condition:
        raise ConfigError(message)
