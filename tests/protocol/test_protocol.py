"""The protocol's messages: each malformed meta is refused with the reason its receiver counts."""

from __future__ import annotations

from typing import Any

import pytest

from fedmq.fedcore.protocol import (
    Announcement,
    CoordinatorStatus,
    ProtocolError,
    Receipt,
    RunState,
    Task,
    Update,
    UpdateFailed,
    parse,
)
from fedmq.fedcore.training import TrainSettings

TASK = bytes(16)


def _reason(cls: Any, meta: Any) -> str:
    with pytest.raises(ProtocolError) as info:
        cls.from_meta(meta)
    return info.value.reason


def test_run_states_are_the_wire_spellings() -> None:
    assert [s.value for s in RunState] == ["starting", "waiting", "running", "finished", "failed", "stopped", "offline"]
    assert RunState.FINISHED == "finished" and f"{RunState.STOPPED}" == "stopped"
    assert {s for s in RunState if s.final} == {RunState.FINISHED, RunState.FAILED, RunState.STOPPED}
    assert {s for s in RunState if s.active} == {RunState.WAITING, RunState.RUNNING}


@pytest.mark.parametrize(
    "meta",
    [
        {},
        {"state": "busy"},
        {"state": "online", "num_samples": -1},
        {"state": "online", "num_samples": True},
        {"state": "online", "device": "x" * 65},
        {"state": "online", "label_histogram": [1, -1]},
        {"state": "online", "label_histogram": "1,2"},
        {"state": "online", "method": "fedprox"},
        ["state", "online"],
    ],
)
def test_a_malformed_announcement_is_a_bad_status(meta: Any) -> None:
    assert _reason(Announcement, meta) == "bad-status"


def test_an_announcement_ignores_a_connection_that_is_not_a_count() -> None:
    """The coordinator never refused one (it only asks whether the count grew)."""
    assert Announcement.from_meta({"state": "online", "connection": "2"}).connection is None


def test_a_minimal_coordinator_status_parses_and_a_malformed_one_is_a_bad_status() -> None:
    status = CoordinatorStatus.from_meta({"state": "finished", "run_id": "r1"})
    assert (
        status.state is RunState.FINISHED
        and status.state.final
        and status.to_meta() == {"state": "finished", "run_id": "r1"}
    )
    for meta in ({"state": "done"}, {"state": "running", "run_id": 3}, {"state": "running", "round": "1"},
                 {"state": "running", "accuracy": "high"}, {"state": "running", "method": []}):  # fmt: skip
        assert _reason(CoordinatorStatus, meta) == "bad-status"


def test_a_relays_status_says_rounds_nil() -> None:
    status = CoordinatorStatus(state=RunState.RUNNING, round=2, rounds=None, model_version=2)
    assert status.to_meta() == {"state": "running", "round": 2, "rounds": None, "model_version": 2}


def _task(**meta: Any) -> dict[str, Any]:
    return {"task": TASK, "attempt": 0, "model_topic": "fedmq/f/model/1", "settings": TrainSettings().to_meta(), **meta}


@pytest.mark.parametrize(
    "meta",
    [
        _task(task=b"short"),
        _task(task="0" * 16),
        _task(model_topic=None),
        _task(attempt=-1),
        _task(inline="yes"),
        _task(version=-1),
        _task(version=True),
        _task(settings={"lr": -1.0}),
        _task(settings={"unknown": 1}),
        _task(deadline_s=0),
        _task(deadline_s="10"),
    ],
)
def test_a_malformed_task_is_a_bad_task(meta: Any) -> None:
    assert _reason(Task, meta) == "bad-task"


def test_an_inline_tasks_payload_must_be_a_map() -> None:
    assert _reason(Task, _task(inline=True, payload=[1])) == "bad-model"
    assert Task.from_meta(_task(inline=True)).payload == {}


def test_a_tasks_method_digest_that_is_not_a_string_is_kept_as_text() -> None:
    """It matches no node's digest, so the node refuses the task as a method mismatch, as it always did."""
    assert Task.from_meta(_task(method=7)).method == "7"


def _update(**meta: Any) -> dict[str, Any]:
    return {"task": TASK, "num_samples": 10, "train_seconds": 0.5, "payload": {}, **meta}


@pytest.mark.parametrize(
    "meta",
    [
        _update(num_samples=0),
        _update(num_samples=10**12),
        _update(num_samples=2.0),
        _update(train_seconds=float("nan")),
        _update(train_seconds=-1),
        _update(site={"nodes": 11}),
        _update(site={"nodes": -1}),
        _update(site=[3]),
        _update(payload=[]),
    ],
)
def test_a_malformed_update_is_a_bad_update(meta: Any) -> None:
    assert _reason(Update, meta) == "bad-update"


def test_an_updates_task_is_read_leniently() -> None:
    """The coordinator has matched it to a task it sent before it parses the update."""
    assert Update.from_meta(_update(task="t")).task_id is None


def test_an_updates_base_version_must_be_an_integer() -> None:
    assert _reason(Update, _update(base_version="3")) == "wrong-base-version"


def test_a_failure_report_is_cut_to_500_characters_and_needs_its_task() -> None:
    failed = parse("update", {"task": TASK, "failed": "x" * 600})
    assert isinstance(failed, UpdateFailed) and len(failed.reason) == 500
    assert UpdateFailed.from_meta({"task": TASK, "failed": 3}).reason == "3"
    assert UpdateFailed.from_meta({"task": 3, "failed": "boom"}).task_id is None
    assert _reason(UpdateFailed, {"task": TASK}) == "bad-update"


def test_a_malformed_receipt_is_a_bad_receipt() -> None:
    good = {"status": "late", "reason": "", "task": None, "update_id": TASK}
    assert Receipt.from_meta(good).to_meta() == good
    for change in ({"status": "lost"}, {"reason": 1}, {"task": "t"}, {"update_id": None}):
        assert _reason(Receipt, good | change) == "bad-receipt"


def test_a_kind_without_a_protocol_message_is_unexpected() -> None:
    with pytest.raises(ProtocolError) as info:
        parse("chunk", {})
    assert info.value.reason == "unexpected-kind"
