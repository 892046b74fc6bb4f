"""Issue 31 at the coordinator, without a broker: a node id outside the experiment is refused before
the registry, a retained status that is refused says it is ignored, and an event made from one
message that trips an unforeseen error is that message's refusal, not the run's end."""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmq.broker import BusConfig, Envelope, Kind, Message, Topics, decode, encode
from fedmq.coordinator.drivers import inbox
from fedmq.coordinator.drivers.mqtt import Coordinator
from fedmq.coordinator.drivers.outbox import Queued
from fedmq.coordinator.drivers.task_frames import TaskFrame
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.errors import ProtocolError
from fedmq.coordinator.observers.reporting import Evaluator
from fedmq.coordinator.storage.persistence import Persistence
from fedmq.coordinator.storage.run_dir import RunDir
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.tensors import arrays_sha256
from fedmq.fedcore.training import TrainSettings
from tests.coordinator.engine_helpers import config
from tests.coordinator.test_payloads import PerNode, Shared, _configure, _ctx, _model


def _coordinator(tmp_path: Path, **changes: object) -> Coordinator:
    cfg = dataclasses.replace(config(), out_dir=tmp_path, **changes)
    return Coordinator(cfg, BusConfig.from_url("mqtt://127.0.0.1:1"), PerNode(None, model=_model()))


def _dispatch(coordinator: Coordinator, envelope: Envelope) -> None:
    """What the receiver does with one message once it is within its node's budget."""
    coordinator.inbox.dispatch(envelope, coordinator.topics.route(envelope.topic))


def _status(node: str, *, retained: bool = False, **meta: object) -> Envelope:
    message = Message(
        kind=Kind.NODE_STATUS, federation="f", round=-1, sender=node, meta={"state": "online", "num_samples": 5, **meta}
    )
    return Envelope(Topics("f").node_status(node), message, 100, retained=retained)


def test_a_node_outside_the_experiment_never_reaches_the_registry(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path, nodes=frozenset({"node-000", "node-001"}))
    _dispatch(coordinator, _status("node-000"))
    with pytest.raises(ProtocolError) as info:
        _dispatch(coordinator, _status("node-900"))
    assert info.value.reason == "unknown-node"
    assert coordinator.registry.live_ids() == ["node-000"]


def test_without_the_experiments_ids_any_valid_id_is_admitted(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path)
    _dispatch(coordinator, _status("node-900"))
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
        await coordinator.inbox.receive(bus)  # type: ignore[arg-type]
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


async def test_a_task_is_sent_again_to_a_node_that_announces_itself_while_holding_it(tmp_path: Path) -> None:
    """Issue 31: after a broker restart a round's task reached the broker before its node had
    re-subscribed, and was lost. A live node announcing itself on a new connection while its task is
    unanswered gets the same frame again (a node that had it drops it by message id); once it
    acknowledged or answered, or when it announces itself again on the same connection (to a new
    coordinator run), nothing is sent."""
    coordinator = _coordinator(tmp_path)

    class _Bus:
        def __init__(self) -> None:
            self.sent: list[tuple[str, bytes]] = []

        async def publish_many(self, topics: list[str], frames: dict[str, bytearray], **kw: object) -> list[str]:
            self.sent += [(t, bytes(frames[t])) for t in topics]
            return []

        async def publish_frame(self, topic: str, frame: bytearray, **kw: object) -> int:
            self.sent.append((topic, bytes(frame)))
            return len(frame)

    bus = _Bus()
    coordinator._attach(bus)  # type: ignore[arg-type]
    t = Topics("f")
    _dispatch(coordinator, _status("node-000", connection=1))
    _dispatch(coordinator, _status("node-001", connection=1))
    task, other = b"t" * 16, b"u" * 16  # each node's own task id, in frames that share the rest
    message = Message(kind=Kind.TASK, federation="f", round=1, sender="coordinator", meta={"task": task})
    frame = TaskFrame(encode(message), task, 10.0)
    await coordinator.outbox.publish_tasks([Queued("node-000", task, 1, frame), Queued("node-001", other, 1, frame)])
    assert [decode(f).meta["task"] for _, f in bus.sent] == [task, other]

    _dispatch(coordinator, _status("node-000", connection=1))  # the same connection: it has its task
    await coordinator.background.settle()
    assert len(bus.sent) == 2
    _dispatch(coordinator, _status("node-000", connection=2))
    await coordinator.background.settle()
    assert bus.sent[2:] == [(t.task("node-000"), bytes(frame.frame))]
    ack = Message(kind=Kind.ACK, federation="f", round=1, sender="node-000", meta={"task": task})
    _dispatch(coordinator, Envelope(t.ack("node-000"), ack, 10))
    _dispatch(coordinator, _status("node-000", connection=3))
    await coordinator.background.settle()
    assert len(bus.sent) == 3  # acknowledged: not again
    _dispatch(coordinator, _status("node-001", connection=2, retained=True))
    await coordinator.background.settle()
    assert bus.sent[3:] == [(t.task("node-001"), bytes(frame.for_task(other)))]


def test_a_large_per_node_task_frame_is_not_held_to_send_again(tmp_path: Path) -> None:
    """Kept frames are bounded: up to an inline model's size and a header, not a per-node payload of
    any size held through every node's training."""
    coordinator = _coordinator(tmp_path)
    limit = min(coordinator.config.policy.inline_model_bytes, coordinator.bus_config.chunk_bytes // 2)
    assert coordinator.outbox.held_for_resend(bytearray(limit + 100))
    assert not coordinator.outbox.held_for_resend(bytearray(limit + 10_000))


async def test_a_retained_ack_or_update_is_refused_and_cleared(tmp_path: Path) -> None:
    """Issue 31, item 9: the broker replays a node's retained ack or update to every coordinator that
    subscribes. Such a message is refused as `retained` (before anything else is read of it) and an
    empty retained publish clears the broker's copy; a retained status is a node's announcement."""
    coordinator = _coordinator(tmp_path)
    cleared: list[tuple[str, bytes, bool]] = []

    class _Bus:
        async def publish_frame(self, topic: str, frame: bytes, *, retain: bool = False, **kw: object) -> int:
            cleared.append((topic, bytes(frame), retain))
            return 0

    coordinator._attach(_Bus())  # type: ignore[arg-type]
    t = Topics("f")
    update = Message(kind=Kind.UPDATE, federation="f", round=0, sender="node-000", meta={"task": b"t" * 16})
    ack = Message(kind=Kind.ACK, federation="f", round=0, sender="node-000", meta={"task": b"t" * 16})
    for topic, message in ((t.update("node-000"), update), (t.ack("node-000"), ack)):
        with pytest.raises(ProtocolError) as info:
            _dispatch(coordinator, Envelope(topic, message, 10, retained=True))
        assert info.value.reason == "retained"
    _dispatch(coordinator, _status("node-000", retained=True))
    await coordinator.background.settle()
    assert cleared == [(t.update("node-000"), b"", True), (t.ack("node-000"), b"", True)]
    assert isinstance(coordinator._events.get_nowait(), e.NodeSeen) and coordinator._events.empty()  # the status only


async def test_tasks_and_models_expire_when_the_engines_configure_says(tmp_path: Path) -> None:
    """Issue 30, item 4: the engine decides deadlines. Every frame of a step (its tasks, the model
    broadcast, a model sent to a late acknowledger, a task sent again to a reconnected node) expires
    after its `Configure`'s `expiry_s`, not after a deadline the daemon reads from the config (10 s)."""
    cfg = dataclasses.replace(config(policy={"inline_model_bytes": 0}), out_dir=tmp_path)
    coordinator = Coordinator(cfg, BusConfig.from_url("mqtt://127.0.0.1:1"), Shared(None, model=_model()))
    expiries: list[tuple[str, float]] = []

    class _Bus:
        async def publish_many(self, topics: list[str], frames: object, *, expiry_s: float, **kw: object) -> list[str]:
            expiries.extend((topic, expiry_s) for topic in topics)
            return []

        async def publish_frame(self, topic: str, frame: bytearray, *, expiry_s: float, **kw: object) -> int:
            expiries.append((topic, expiry_s))
            return len(frame)

    coordinator._attach(_Bus())  # type: ignore[arg-type]
    _dispatch(coordinator, _status("node-000", connection=1))
    spec = c.TaskSpec("node-000", b"t" * 16, 0, 0, 0, b"m" * 16)
    command = c.Configure(1, _ctx(("node-000",)), (spec,), TrainSettings().to_meta(), expiry_s=123.0)
    assert coordinator.config.policy.deadline_s != command.expiry_s
    assert not coordinator.outbox.keep(_configure(coordinator, command)).inline  # a broadcast step
    coordinator.outbox.send_task(c.SendTask(1, "node-000"))
    coordinator.outbox.flush()
    coordinator.outbox.broadcast(c.Broadcast(1, 0))
    coordinator.outbox.resend(c.Resend(1, "node-000"))

    await coordinator.background.settle()
    _dispatch(coordinator, _status("node-000", connection=2))  # unanswered: its task goes again
    await coordinator.background.settle()
    t = Topics("f")
    assert sorted(expiries) == sorted(
        [
            (t.task("node-000"), 123.0),
            (t.model(0), 123.0),
            (t.direct_model("node-000"), 123.0),
            (t.task("node-000"), 123.0),
        ]
    )


async def test_a_large_update_is_read_off_the_event_loop_before_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30, item 4: the daemon reads an update (decoding, decompression, checks, the log's digest)
    before the engine, a large one in a worker thread; the event the engine gets carries what was read.
    A small one is read on the spot, a node's report of a failed training not at all."""
    monkeypatch.setattr(inbox, "OFF_LOOP_BYTES", 1000)
    coordinator = _coordinator(tmp_path)
    threads: list[str] = []
    read = coordinator.inbox._ingest

    def recorded(message: Message) -> object:
        threads.append(threading.current_thread().name)
        return read(message)

    monkeypatch.setattr(coordinator.inbox, "_ingest", recorded)
    t = Topics("f")

    def sent(size: int, **meta: object) -> Envelope:
        message = Message(
            kind=Kind.UPDATE, federation="f", round=0, sender="node-000",
            meta={"task": b"t" * 16, "num_samples": 5, **meta}, tensors={"model/w": np.ones(2, np.float32)},
        )  # fmt: skip
        return Envelope(t.update("node-000"), message, size)

    _dispatch(coordinator, sent(100))
    small = coordinator._events.get_nowait()
    assert isinstance(small, e.UpdateArrived) and small.ingested is not None and threads == ["MainThread"]
    _dispatch(coordinator, sent(5000))
    assert coordinator._events.empty()  # being read
    await coordinator.inbox.ingests.settle()
    large = coordinator._events.get_nowait()
    assert isinstance(large, e.UpdateArrived) and large.ingested is not None and threads[1] != "MainThread"
    assert large.ingested.sha256 == arrays_sha256(large.message.tensors)
    _dispatch(coordinator, sent(5000, failed="out of memory"))
    failed = coordinator._events.get_nowait()
    assert isinstance(failed, e.UpdateArrived) and failed.ingested is None and len(threads) == 2


def test_the_coordinator_evaluates_and_stores_with_the_parts_it_is_handed(tmp_path: Path) -> None:
    """The composition root hands the coordinator its evaluator and persistence: with no evaluator its
    engine schedules no evaluation; with one holding a test split it does; the run directory is the
    persistence's, not the config's, when one is handed in."""
    bare = _coordinator(tmp_path / "bare")
    assert bare.evaluator.test is None and bare.run_dir.root == tmp_path / "bare"
    cfg = dataclasses.replace(config(), out_dir=tmp_path / "config")
    half = PerNode(None, model=_model())
    test = TensorDataset(x=torch.zeros(4, 3), y=torch.zeros(4, dtype=torch.long), num_classes=2)
    handed = Coordinator(
        cfg,
        BusConfig.from_url("mqtt://127.0.0.1:1"),
        half,
        evaluator=Evaluator(half, test, None),
        persistence=Persistence(RunDir(tmp_path / "handed"), half),
    )
    assert handed.evaluator.test is test and handed.run_dir.root == tmp_path / "handed"
    assert not bare.engine.evaluates and handed.engine.evaluates
