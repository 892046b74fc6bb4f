"""Validating an update message against the round it claims and the schema the algorithm expects."""

from __future__ import annotations

import math

from broker import Message
from coordinator.errors import ProtocolError
from coordinator.rounds import RoundState
from fedcore.algorithms.base import NodeUpdate, Payload
from fedcore.errors import AlgorithmError
from fedcore.tensors import non_finite, schema_mismatch, split_groups

MAX_SAMPLES = 10**12


def parse_update(message: Message, state: RoundState, received_at: float) -> NodeUpdate:
    """A NodeUpdate for `state`, or ProtocolError with the reason to count."""
    node = message.sender
    meta = message.meta
    num_samples = meta.get("num_samples")
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or not 0 < num_samples < MAX_SAMPLES:
        raise ProtocolError("bad-update", f"num_samples {num_samples!r} is not a positive integer", node_id=node)
    train_seconds = meta.get("train_seconds", 0.0)
    if not isinstance(train_seconds, int | float) or not math.isfinite(train_seconds) or train_seconds < 0:
        raise ProtocolError("bad-update", f"train_seconds {train_seconds!r} is invalid", node_id=node)
    payload_meta = meta.get("payload", {})
    if not isinstance(payload_meta, dict):
        raise ProtocolError("bad-update", "payload meta must be a map", node_id=node)
    try:
        groups = split_groups(message.tensors)
    except AlgorithmError as exc:
        raise ProtocolError("bad-update", str(exc), node_id=node) from exc
    if groups.keys() != state.schema.keys():
        raise ProtocolError(
            "wrong-shape", f"tensor groups {sorted(groups)} != expected {sorted(state.schema)}", node_id=node
        )
    for group, expected in state.schema.items():
        mismatch = schema_mismatch(groups[group], expected)
        if mismatch is not None:
            raise ProtocolError(mismatch[0], f"{group}: {mismatch[1]}", node_id=node)
        bad = non_finite(groups[group])
        if bad is not None:
            raise ProtocolError("non-finite", f"{group}/{bad} holds NaN or inf", node_id=node)
    sent = state.task_sent_at.get(node, state.started)
    return NodeUpdate(
        node_id=node,
        round=message.round,
        num_samples=num_samples,
        payload=Payload(tensors=groups, meta=payload_meta),
        train_seconds=float(train_seconds),
        rtt_seconds=max(received_at - sent, 0.0),
    )
