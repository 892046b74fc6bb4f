"""The task as a node holds it: parsed from the coordinator's message once, checked against its header
and its deadline, and the key of the group it trains in (``hosting.vectorize``); and the model it
brings, checked against the node's schema.

A part of the node daemon (`fednode.daemon`) kept apart so that the trainers (`fednode.trainer`, a site
aggregator's) read the same task without the daemon.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from fedmq.broker import Message, Topics
from fedmq.fedcore import protocol
from fedmq.fedcore.algorithms.base import Payload
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.protocol import ProtocolError
from fedmq.fedcore.secagg import SecAggSettings
from fedmq.fedcore.tensors import TensorSpec, schema_mismatch, split_groups
from fedmq.fedcore.training import TrainSettings

TaskError = ProtocolError
"""What the node rejects a message with (the protocol's error: its reason is the counter)."""


@dataclass(frozen=True, slots=True)
class Task:
    round: int
    attempt: int
    task_id: bytes
    model_topic: str
    settings: TrainSettings
    received_at: float
    inline: bool = False
    """The task carries the model itself (small models): no subscription, no acknowledgement."""
    version: int | None = None
    """The model version the task was built from, echoed as the update's `base_version` (None from
    a coordinator that sends none)."""
    frame_bytes: int = 0
    """The size of the task's frame as received (the scenario's link time counts it)."""
    deadline_s: float | None = None
    """How long after its `sent_at` the task may still be acted on (None: always)."""
    method: str | None = None
    """The coordinator's method digest (None: it named none)."""
    model_id: bytes | None = None
    """The id the task's model broadcast carries (None from older coordinators, whose broadcast
    quoted the task id)."""
    secure: SecAggSettings | None = None
    """With secure aggregation, its settings: the update is masked (`fedcore.secure_task`)."""

    @property
    def model_key(self) -> bytes:
        """What the task's model quotes: its `model_id`, or (older coordinators) the task id."""
        return self.task_id if self.model_id is None else self.model_id

    @property
    def group_key(self) -> tuple[int, int, bytes, TrainSettings]:
        """Nodes train together only for one task: one round attempt, one broadcast, one set of settings."""
        return (self.round, self.attempt, self.model_key, self.settings)


def parse_task(message: Message, topics: Topics, size: int = 0) -> Task:
    """The task the message carries (`protocol.Task`), checked against its header: the model topic
    must be its round's, the round not negative, and tensors only in a task that carries the model."""
    spec = protocol.Task.from_meta(message.meta)
    if spec.model_topic != topics.model(message.round):
        raise TaskError("bad-task", f"model topic {spec.model_topic!r} does not belong to round {message.round}")
    if message.round < 0:
        raise TaskError("wrong-round", f"round {message.round}")
    if message.tensors and not spec.inline:
        raise TaskError("bad-task", "tensors in a task that does not say it carries the model")
    return Task(
        message.round, spec.attempt, spec.task_id, spec.model_topic, spec.settings, time.monotonic(),
        spec.inline, spec.version, size, spec.deadline_s, spec.method, spec.model_id, spec.secure_aggregation,
    )  # fmt: skip


def check_deadline(task: Task, sent_at: float, clock_skew_s: float) -> None:
    """Refuse (as ``expired-task``: logged and counted, not acted on) a task that arrives after the
    coordinator gave up on it: more than its ``deadline_s`` after its ``sent_at``, plus `clock_skew_s`
    for the two machines' clocks. Such a task was queued in the node's session while it was away (on an
    MQTT v5 broker the message expiry normally drops it first); a task without ``deadline_s`` never
    expires."""
    deadline = task.deadline_s
    if deadline is None:
        return
    age = time.time() - sent_at
    if age > deadline + clock_skew_s:
        raise TaskError(
            "expired-task",
            f"round {task.round}'s task arrived {age:.1f} s after it was sent, past its deadline of"
            f" {deadline:g} s (+ {clock_skew_s:g} s allowed for clock skew): not trained on"
            " (if fresh tasks expire, this machine's clock is ahead: synchronise it)",
        )


def parse_model(message: Message, schema: Mapping[str, TensorSpec]) -> Payload:
    """The model a task or broadcast carries, as the node half's payload: its tensors in their groups,
    the model's checked against the node's `schema` (a wrong shape is refused before training)."""
    try:
        groups = split_groups(message.tensors)
    except AlgorithmError as exc:
        raise TaskError("bad-model", str(exc)) from exc
    if "model" in groups:
        mismatch = schema_mismatch(groups["model"], schema)
        if mismatch is not None:
            raise TaskError(mismatch[0], f"broadcast model: {mismatch[1]}")
    meta = message.meta.get("payload", {})
    if not isinstance(meta, dict):
        raise TaskError("bad-model", "payload meta must be a map")
    return Payload(tensors=groups, meta=meta)
