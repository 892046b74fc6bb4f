"""The secure-aggregation messages (`fedcore.protocol.SecAgg*`): each round-trips through its meta,
and what comes off the wire malformed is refused with `bad-secagg` (or `bad-task` for a task's
settings), never let through to the engine or the node's key handling."""

from __future__ import annotations

from typing import Any

import pytest

from fedmq.fedcore import protocol
from fedmq.fedcore.protocol import ProtocolError, Task
from fedmq.fedcore.secagg import SecAggSettings
from fedmq.fedcore.training import TrainSettings

TASK = b"t" * 16
KEY = b"k" * 32
SHARE = b"s" * 34

EXAMPLES: list[Any] = [
    protocol.SecAggKeys(task_id=TASK, encryption_key=KEY, mask_key=b"m" * 32),
    protocol.SecAggDirectory(
        task_id=TASK, neighbours={"node-001": (KEY, KEY), "node-002": (KEY, b"x" * 32)}, weight_total=99
    ),
    protocol.SecAggShares(task_id=TASK, commitment=KEY, shares={"node-001": b"c" * 96}),
    protocol.SecAggShared(task_id=TASK, shares={"node-001": b"c" * 96, "node-002": b"d" * 96}),
    protocol.SecAggUnmask(task_id=TASK, survivors=("node-001",), dropped=("node-002",)),
    protocol.SecAggReveal(task_id=TASK, seed_shares={"node-001": SHARE}, key_shares={"node-002": SHARE}),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_each_message_round_trips_through_its_meta(message: Any) -> None:
    kind = next(k for k, cls in protocol.MESSAGES.items() if cls is type(message))
    assert protocol.parse(kind, message.to_meta()) == message


MALFORMED = [
    (protocol.SecAggKeys, {"task": TASK, "encryption_key": KEY, "mask_key": b"short"}),
    (protocol.SecAggKeys, {"task": b"t", "encryption_key": KEY, "mask_key": KEY}),
    (protocol.SecAggDirectory, {"task": TASK, "neighbours": {"n": [KEY]}, "weight_total": 5}),
    (protocol.SecAggDirectory, {"task": TASK, "neighbours": {"n": [KEY, KEY]}, "weight_total": 0}),
    (protocol.SecAggDirectory, {"task": TASK, "neighbours": {"": [KEY, KEY]}, "weight_total": 5}),
    (protocol.SecAggDirectory, {"task": TASK, "neighbours": [], "weight_total": 5}),
    (protocol.SecAggShares, {"task": TASK, "commitment": KEY, "shares": {"n": b"x" * 10_000}}),
    (protocol.SecAggShares, {"task": TASK, "commitment": KEY, "shares": {"n": "not bytes"}}),
    (protocol.SecAggShared, {"task": TASK, "shares": {"n" * 65: b"c"}}),
    (protocol.SecAggUnmask, {"task": TASK, "survivors": ["a", "a"], "dropped": []}),
    (protocol.SecAggUnmask, {"task": TASK, "survivors": "a", "dropped": []}),
    (protocol.SecAggReveal, {"task": TASK, "seed_shares": {"a": b"s" * 33}, "key_shares": {}}),
    (protocol.SecAggReveal, {"task": TASK, "seed_shares": {}, "key_shares": None}),
]


@pytest.mark.parametrize(("cls", "meta"), MALFORMED)
def test_malformed_messages_are_refused(cls: Any, meta: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError) as caught:
        cls.from_meta(meta)
    assert caught.value.reason == "bad-secagg"


def _task(**secure: Any) -> dict[str, Any]:
    meta = Task(task_id=TASK, model_topic="fedmq/f/model/0", settings=TrainSettings()).to_meta()
    return meta | {"secure_aggregation": secure}


def test_a_task_carries_the_secure_aggregation_settings() -> None:
    settings = SecAggSettings(neighbours=4, threshold=0.6, clip=2.0)
    task = Task(task_id=TASK, model_topic="fedmq/f/model/0", settings=TrainSettings(), secure_aggregation=settings)
    assert Task.from_meta(task.to_meta()).secure_aggregation == settings
    assert "secure_aggregation" not in Task(task_id=TASK, model_topic="t", settings=TrainSettings()).to_meta()


@pytest.mark.parametrize(
    "secure",
    [
        {"neighbours": 4, "threshold": 0.5},
        {"neighbours": "4", "threshold": 0.5, "clip": 1.0},
        {"neighbours": -1, "threshold": 0.5, "clip": 1.0},
        {"neighbours": 4, "threshold": 2.0, "clip": 1.0},
        {"neighbours": 4, "threshold": 0.5, "clip": float("inf")},
    ],
)
def test_a_task_with_bad_secure_aggregation_settings_is_refused(secure: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError) as caught:
        Task.from_meta(_task(**secure))
    assert caught.value.reason == "bad-task"
