"""Issue 31, item 0: "one message kills a daemon". Each frame that killed or blinded a daemon is sent
by a foreign client into a running federation, on both brokers: the coordinator and the nodes refuse
and count it, and the run finishes with every real node taking part."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from fedmq.broker import CodecError, Kind, Message, Topics, decode, encode
from tests.helpers import frame_with_header as _frame
from tests.helpers import raw_client
from tests.integration.federation import Federation, base_config

pytestmark = pytest.mark.slow

NODES = ("node-000", "node-001", "node-002")
FOREIGN = [f"node-{i}" for i in range(900, 960)]
"""Valid ids that are not the experiment's (it has three nodes): forged online statuses for them."""


def killer_frames(federation: str, sender: str, kind: str) -> list[bytes]:
    """The frames of a few hundred bytes from issue 31 that each ended a daemon, as `sender` of `kind`."""
    deep: object = 1
    for _ in range(600):
        deep = [deep]

    def header(**changes: object) -> dict[object, object]:
        base: dict[object, object] = {
            "kind": kind, "fed": federation, "round": 0, "sender": sender, "id": os.urandom(16), "ts": 1.0,
            "meta": {"task": b"t" * 16, "num_samples": 10}, "tensors": [], "body": 0,
        }  # fmt: skip
        return base | changes

    return [
        _frame(header(tensors=[["model/w", "float32", [0, 2**63], 0, 0]])),  # numpy's ValueError
        _frame(header() | {b"kind": kind}),  # TypeError sorting str and bytes keys
        _frame(header(meta={"task": b"t" * 16, "num_samples": 10, "x": deep})),  # RecursionError in the event log
    ]


def _status(federation: str, node: str) -> bytes:
    meta = {"state": "online", "num_samples": 50, "device": "cpu"}
    return bytes(encode(Message(kind=Kind.NODE_STATUS, federation=federation, round=-1, sender=node, meta=meta)))


async def _wait_online(url: str, t: Topics, nodes: tuple[str, ...]) -> None:
    """Until every one of `nodes` has announced itself online (their retained statuses)."""
    seen: set[str] = set()
    async with raw_client(url) as watcher:
        await watcher.subscribe(t.all_node_status, qos=1)
        async with asyncio.timeout(90):
            async for m in watcher.messages:
                try:
                    msg = decode(bytes(m.payload))  # type: ignore[arg-type]
                except CodecError:
                    continue
                if msg.meta.get("state") == "online":
                    seen.add(msg.sender)
                if seen >= set(nodes):
                    return


async def test_no_single_message_kills_or_blinds_a_daemon(tmp_path: Path, broker_url: str) -> None:
    """Before the coordinator starts: 64 random bytes retained on node-001's status topic, 60 forged
    online statuses for ids not in the experiment, Once it runs: a status for an id whose receipt topic
    would be one byte over MQTT's 65,535, and the killer frames on every node's update and ack topics and on
    node-002's task topic. The coordinator still sees all three nodes (node-001 announces itself again
    to the new run), no foreign id becomes live, and all three nodes take part in the last round."""
    cfg = base_config(nodes=3, rounds=3, deadline_s=20, eval_every=3)
    fed = Federation(tmp_path, broker_url, cfg)
    t = Topics(fed.federation)
    fed.start_nodes(*NODES)
    await _wait_online(broker_url, t, NODES)
    long_id = "n" * (65_535 - len(t.receipt("").encode()) + 1)
    async with raw_client(broker_url) as evil:
        await evil.publish(t.node_status("node-001"), os.urandom(64), qos=1, retain=True)
        for node in FOREIGN:
            await evil.publish(t.node_status(node), _status(fed.federation, node), qos=1, retain=True)
        fed.start_coordinator()
        waiter = asyncio.create_task(asyncio.to_thread(fed.wait))
        await evil.subscribe(t.task("node-002"), qos=1)
        async with asyncio.timeout(90):
            async for m in evil.messages:
                if decode(bytes(m.payload)).round == 1:  # type: ignore[arg-type]
                    break
        # a valid status from an id whose receipt topic would be over MQTT's limit (paho's "topic too
        # long" in the coordinator's driver, exit 1): outside the topic scheme, refused as such; sent
        # first, while round 1 runs, so that it arrives before the federation can finish
        await evil.publish(t.node_status(long_id), _status(fed.federation, long_id), qos=1)
        for node in NODES:
            for frame in killer_frames(fed.federation, node, "update"):
                await evil.publish(t.update(node), frame, qos=1)
            for frame in killer_frames(fed.federation, node, "ack"):
                await evil.publish(t.ack(node), frame, qos=1)
        for frame in killer_frames(fed.federation, "coordinator", "task"):
            await evil.publish(t.task("node-002"), frame, qos=1)
        code = await waiter
        for node in FOREIGN:  # the session's broker keeps no forged retained status after the test
            await evil.publish(t.node_status(node), b"", qos=1, retain=True)
    assert code == 0, fed.log("coordinator.log")
    summary, metrics = fed.summary(), fed.metrics()
    assert summary["state"] == "finished" and summary["rounds_completed"] == 3
    assert summary["nodes"] == 3, summary  # no forged id in the registry, let alone live
    assert all(line["live"] == 3 for line in metrics), metrics
    assert metrics[-1]["accepted"] == list(NODES), metrics[-1]
    rejected = summary["bus"]["rejected"]
    assert rejected.get("unknown-node", 0) >= len(FOREIGN), rejected
    assert rejected.get("bad-tensor", 0) >= 6 and rejected.get("bad-header", 0) >= 12, rejected
    assert rejected.get("unknown-topic", 0) >= 1, rejected
    assert "internal-error" not in rejected and "malformed" not in rejected, rejected
    assert "a retained message: ignored" in (fed.dir / "coordinator.log").read_text(errors="replace")
    node_log = (fed.dir / "node-000.log").read_text(errors="replace")
    assert node_log.count("/node-002/task: bad-") >= 3, node_log


def test_unknown_ids_and_a_bad_retained_status_need_no_broker_to_be_refused() -> None:
    """The pieces of the test above that a unit can show: an id of the wrong form is outside the topic
    scheme, and the frames are the codec's errors (not numpy's, a TypeError or a RecursionError)."""
    t = Topics("fed")
    assert t.route(t.node_status("n" * 65_000)) is None
    for frame in killer_frames("fed", "node-000", "update"):
        with pytest.raises(CodecError):
            decode(frame)


async def test_a_coordinator_whose_bus_client_dies_tells_the_nodes(
    tmp_path: Path, broker_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31: when one frame killed the coordinator's bus client the run ended `failed` and the
    nodes were never told. Should its client die of anything now (here its message fence is made to
    raise), the run still ends `failed`, and a fresh connection publishes that state: the nodes
    (exit_when_done) stop instead of waiting for tasks."""
    import torch

    import fedmq.experiments.build
    from fedmq.experiments.build import build_coordinator, build_nodes
    from fedmq.experiments.config import parse_config
    from fedmq.fednode.daemon import serve_nodes

    monkeypatch.setattr(fedmq.experiments.build, "best_device", lambda: torch.device("cpu"))
    cfg = parse_config(base_config(nodes=2, rounds=200, deadline_s=20))
    federation = f"it-{os.urandom(4).hex()}"
    t = Topics(federation)
    coordinator = build_coordinator(cfg, broker_url, tmp_path / "run", federation=federation)
    rounds: list[int] = []
    coordinator.watchers.append(lambda now, event, commands: rounds.append(coordinator.engine.round))
    nodes = build_nodes(cfg, broker_url, cfg.node_ids(), federation=federation, exit_when_done=True)

    async def broken(raw: object) -> None:
        raise RuntimeError("the coordinator's bus client dies of this")

    async with asyncio.timeout(120), raw_client(broker_url) as evil:
        serving = asyncio.create_task(coordinator.serve())
        hosting = asyncio.create_task(serve_nodes(nodes))
        while not rounds or max(rounds) < 2:
            await asyncio.sleep(0.05)
        assert coordinator._bus is not None
        monkeypatch.setattr(coordinator._bus, "_on_message", broken)
        await evil.publish(t.update("node-000"), b"one message", qos=1)
        summary = await serving
        assert await hosting == []  # every node stopped on the coordinator's word, none on an error
    assert summary.state == "failed"
    assert all(not n.connected.is_set() for n in nodes)


async def test_a_task_lost_before_its_node_resubscribed_is_sent_again(
    tmp_path: Path, broker_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31: after a broker restart a round's tasks reached the broker before the nodes had
    re-subscribed, and were lost. Here node-001 holds no subscription to its task topic while round
    1's task is published (as after a restart), then subscribes and announces itself, as a reconnected
    node does: the coordinator sends the task again and node-001 takes part in round 1, well before
    its deadline."""
    import torch

    import fedmq.experiments.build
    from fedmq.experiments.build import build_coordinator, build_nodes
    from fedmq.experiments.config import parse_config
    from fedmq.fednode.daemon import serve_nodes

    monkeypatch.setattr(fedmq.experiments.build, "best_device", lambda: torch.device("cpu"))
    cfg = parse_config(
        base_config(nodes=3, rounds=3, deadline_s=15, faults={"node-000": {"delay_s": 1.5, "delay_rounds": [0]}})
    )
    federation = f"it-{os.urandom(4).hex()}"
    t = Topics(federation)
    coordinator = build_coordinator(cfg, broker_url, tmp_path / "run", federation=federation)
    nodes = build_nodes(cfg, broker_url, cfg.node_ids(), federation=federation, exit_when_done=True)
    late = nodes[1]
    async with asyncio.timeout(120), raw_client(broker_url) as spy:
        await spy.subscribe(t.task("node-001"), qos=1)
        serving = asyncio.create_task(coordinator.serve())
        hosting = asyncio.create_task(serve_nodes(nodes))
        async for m in spy.messages:
            round = decode(bytes(m.payload)).round  # type: ignore[arg-type]
            if round == 0:  # node-000 holds round 0 open for 1.5 s: time to lose the subscription
                assert late.bus is not None
                await late.bus.unsubscribe(t.task("node-001"))
            elif round == 1:  # published while node-001 was not subscribed: lost for it
                assert late.bus is not None
                await late.bus.subscribe(t.task("node-001"))
                late.bus._generation += 1  # what a reconnection counts, without the will it would fire
                await late.presence.announce()
                break
        summary = await serving
        await hosting
    metrics = json_lines(tmp_path / "run" / "metrics.jsonl")
    assert summary.state == "finished"
    assert metrics[1]["accepted"] == list(NODES), metrics[1]
    assert metrics[1]["round_seconds"] < 10, metrics[1]


def json_lines(path: Path) -> list[dict[str, object]]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
