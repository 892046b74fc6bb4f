"""Errors of the coordinator daemon."""

from __future__ import annotations


class ProtocolError(ValueError):
    """A message broke the protocol (wrong round, not selected, bad meta). `reason` is its counter key."""

    def __init__(self, reason: str, detail: str, *, node_id: str | None = None, round: int | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.node_id = node_id
        self.round = round


class CoordinatorError(RuntimeError):
    """The federation cannot go on (no nodes came, a checkpoint cannot be read)."""
