"""The typed message that crosses the bus: an envelope of primitives plus named numpy arrays.

The bus knows nothing about learning: `tensors` are plain numpy arrays and `meta` holds msgpack
primitives. Converting torch tensors is the shared core's job.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np


class Kind(StrEnum):
    """Message kinds of the fedmq protocol (see docs/protocol.md)."""

    NODE_STATUS = "node-status"  # node online/offline, with its announcement; retained
    COORDINATOR_STATUS = "coordinator-status"  # round, model version, state; retained
    TASK = "task"  # coordinator -> one selected node
    ACK = "ack"  # node -> coordinator: task received, subscribed to the model topic
    MODEL = "model"  # coordinator -> selected nodes, one publish fanned out by the broker
    UPDATE = "update"  # node -> coordinator: the result of local training
    RECEIPT = "receipt"  # coordinator -> node: what became of its update
    CHUNK = "chunk"  # one piece of a frame larger than the chunk size
    SECAGG_KEYS = "secagg-keys"  # node -> coordinator: secure aggregation, its public keys
    SECAGG_DIRECTORY = "secagg-directory"  # coordinator -> node: its neighbours' keys
    SECAGG_SHARES = "secagg-shares"  # node -> coordinator: its encrypted shares for its neighbours
    SECAGG_SHARED = "secagg-shared"  # coordinator -> node: the shares addressed to it
    SECAGG_UNMASK = "secagg-unmask"  # coordinator -> node: which shares to reveal
    SECAGG_REVEAL = "secagg-reveal"  # node -> coordinator: the revealed shares


MESSAGE_ID_BYTES = 16


def new_message_id() -> bytes:
    """A random 128-bit id; receivers drop a second delivery of the same id."""
    return os.urandom(MESSAGE_ID_BYTES)


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """One protocol message. Decoded tensors are read-only views on the received bytes."""

    kind: Kind
    federation: str
    round: int
    sender: str
    meta: Mapping[str, Any] = field(default_factory=dict)
    tensors: Mapping[str, np.ndarray] = field(default_factory=dict)
    message_id: bytes = field(default_factory=new_message_id)
    sent_at: float = field(default_factory=time.time)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data carried (not counting the header)."""
        return sum(int(a.nbytes) for a in self.tensors.values())
