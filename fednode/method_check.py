"""The node's method against the coordinator's: a node that trains another objective than the one the
coordinator aggregates would spoil the model, so tasks for another method are refused, and the first
status that names another method is said once, loudly, with what differs.

A part of the node daemon (`fednode.daemon`); the coordinator makes the same check of each announcement.
"""

from __future__ import annotations

import logging
from typing import Any

from fedmq.fedcore.algorithms.fingerprint import MethodFingerprint
from fedmq.fedcore.protocol import ProtocolError


class MethodCheck:
    """This node's method fingerprint, checked against the coordinator's statuses and tasks."""

    def __init__(self, fingerprint: MethodFingerprint, log: logging.LoggerAdapter[Any]) -> None:
        self.fingerprint = fingerprint
        self.log = log
        self._warned: str | None = None

    def coordinator_runs(self, announced: Any) -> None:
        """Say once, loudly, that the coordinator runs another method (its tasks will be refused); a
        status naming none says nothing, and an unreadable one is refused as ``bad-status``."""
        if announced is None:
            return
        try:
            theirs = MethodFingerprint.from_meta(announced)
        except ValueError as exc:
            raise ProtocolError("bad-status", str(exc)) from None
        if theirs.digest != self.fingerprint.digest and self._warned != theirs.digest:
            self._warned = theirs.digest
            self.log.error(
                "the coordinator runs %s; this node runs %s (differences: %s): its tasks will be refused;"
                " start the node with the coordinator's experiment file",
                theirs.describe(),
                self.fingerprint.describe(),
                self.fingerprint.differences(theirs, "here", "at the coordinator"),
            )

    def mismatch(self, digest: str | None) -> str | None:
        """Why a task for the method `digest` is not this node's (None: it is ours, or names none)."""
        if digest is None or digest == self.fingerprint.digest:
            return None
        return (
            f"method-mismatch: the task is for method fingerprint {str(digest)[:32]!r}; this node runs"
            f" {self.fingerprint.describe()} (fingerprint {self.fingerprint.digest})"
        )
