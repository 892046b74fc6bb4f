"""Errors of the coordinator daemon."""

from __future__ import annotations

from fedmq.fedcore.protocol import ProtocolError

__all__ = ["CoordinatorError", "ProtocolError"]


class CoordinatorError(RuntimeError):
    """The federation cannot go on (no nodes came, a checkpoint cannot be read)."""
