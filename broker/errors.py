"""Errors raised by the bus. Every rejection carries a short machine-readable `reason`,
which daemons count and log, so that a bad message is data, not a crash."""

from __future__ import annotations


class BusError(Exception):
    """The broker connection failed, or a publish or subscribe could not complete."""

    def __init__(self, message: str, *, topic: str | None = None) -> None:
        super().__init__(message)
        self.topic = topic

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base} (topic {self.topic})" if self.topic else base


class MessageTooLarge(BusError):
    """A frame would exceed the broker's configured message limit; brokers drop those silently."""


class CodecError(ValueError):
    """A frame could not be decoded or failed validation.

    `reason` is one of a small fixed vocabulary (``truncated``, ``bad-magic``, ``wrong-version``,
    ``checksum``, ``bad-header``, ``bad-tensor``, ``oversized``, ...), used as a counter key.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class CredentialsError(ValueError):
    """A credentials file, password file or TLS file is missing, unreadable or malformed: the user's
    mistake, reported with what to fix (exit code 2), not a broker failure."""
