"""Issue 31 at the coordinator, without a broker: a node id outside the experiment is refused before
the registry, a retained status that is refused says it is ignored, and an event made from one
message that trips an unforeseen error is that message's refusal, not the run's end."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from fedmq.broker import BusConfig, Envelope, Kind, Message, Topics
from fedmq.coordinator.daemon import Coordinator
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.errors import ProtocolError
from tests.coordinator.engine_helpers import config
from tests.coordinator.test_payloads import PerNode, _model


def _coordinator(tmp_path: Path, **changes: object) -> Coordinator:
    cfg = dataclasses.replace(config(), out_dir=tmp_path, **changes)
    return Coordinator(cfg, BusConfig.from_url("mqtt://127.0.0.1:1"), PerNode(None, model=_model()))


def _status(node: str, *, retained: bool = False, **meta: object) -> Envelope:
    message = Message(
        kind=Kind.NODE_STATUS, federation="f", round=-1, sender=node, meta={"state": "online", "num_samples": 5, **meta}
    )
    return Envelope(Topics("f").node_status(node), message, 100, retained=retained)


def test_a_node_outside_the_experiment_never_reaches_the_registry(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path, nodes=frozenset({"node-000", "node-001"}))
    coordinator._dispatch(_status("node-000"))
    with pytest.raises(ProtocolError) as info:
        coordinator._dispatch(_status("node-900"))
    assert info.value.reason == "unknown-node"
    assert coordinator.registry.live_ids() == ["node-000"]


def test_without_the_experiments_ids_any_valid_id_is_admitted(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path)
    coordinator._dispatch(_status("node-900"))
    assert coordinator.registry.live_ids() == ["node-900"]


async def test_a_refused_retained_status_is_logged_as_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    coordinator = _coordinator(tmp_path)

    class _Bus:
        def __init__(self, envelopes: list[Envelope]) -> None:
            self.envelopes = envelopes
            self.rejected: list[str] = []

        async def messages(self):  # type: ignore[no-untyped-def]
            for envelope in self.envelopes:
                yield envelope

        def reject(self, reason: str, envelope: Envelope, detail: str) -> None:
            self.rejected.append(reason)

    bus = _Bus([_status("node-001", retained=True, state="confused")])
    with caplog.at_level(logging.WARNING):
        await coordinator._receive(bus)  # type: ignore[arg-type]
    assert bus.rejected == ["bad-status"]
    assert "the retained message on fedmq/f/nodes/node-001/status is ignored (bad-status)" in caplog.text


def test_an_event_from_one_message_that_trips_an_error_is_refused_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The driver feeds the events of messages fenced; a run's own events still raise."""
    coordinator = _coordinator(tmp_path)
    coordinator.event_log.start({"federation": "f"})

    def broken(event: e.Event, now: float) -> list[object]:
        raise RecursionError("what one message's meta did to the event log before issue 31")

    monkeypatch.setattr(coordinator.engine, "handle", broken)
    coordinator._feed_fenced(e.NodeSeen("node-000", True, 5))
    assert "error while handling NodeSeen from node-000" in caplog.text
    with pytest.raises(RecursionError):
        coordinator._feed(e.Tick())
    coordinator.event_log.close()
