"""Whole federations: a coordinator and node daemons in separate processes over a real broker.

Each test runs against the embedded broker and against mosquitto.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedmq.broker import Topics, decode
from fedmq.broker.codec import encoded_size
from fedmq.broker.message import Kind, Message
from tests.helpers import raw_client
from tests.integration.federation import Federation, base_config

pytestmark = pytest.mark.slow


def test_federation_learns_with_partial_participation_and_chunked_models(tmp_path: Path, broker_url: str) -> None:
    """6 nodes in two processes, C=0.5, every model and update larger than the 16 KiB chunk size:
    the rounds complete, the model learns, and the record matches the metrics."""
    cfg = base_config(nodes=6, fraction=0.5, rounds=8, bus={"chunk_bytes": 16384})
    fed = Federation(tmp_path, broker_url, cfg)
    # the MLP (64 -> 64 -> 10) weighs 4,810 floats, ~19 KB: more than one chunk each way
    model_bytes = encoded_size(
        Message(kind=Kind.MODEL, federation="f", round=0, sender="c", tensors={"w": np.zeros(4810, np.float32)})
    )
    assert model_bytes > 16384
    fed.start_coordinator()
    fed.start_nodes("node-000", "node-001", "node-002", log="nodes-a.log")
    fed.start_nodes("node-003", "node-004", "node-005", log="nodes-b.log")
    assert fed.wait() == 0, fed.log("coordinator.log")
    summary, metrics, record = fed.summary(), fed.metrics(), fed.participation()
    assert summary["state"] == "finished" and summary["rounds_completed"] == 8
    assert summary["final_accuracy"] > 0.75, metrics
    assert metrics[-1]["accuracy"] > metrics[0]["accuracy"]
    for line in metrics:
        assert len(line["selected"]) == max(1, math.floor(0.5 * line["live"])) == 3
        assert line["accepted"] == line["selected"] and line["aggregated"]
    accepted = {n: sum(n in line["accepted"] for line in metrics) for n in record}
    assert {n: r["count"] for n, r in record.items()} == accepted
    for node, r in record.items():
        rounds = [line["round"] for line in metrics if node in line["accepted"]]
        assert r["last_round"] == (rounds[-1] if rounds else -1)
        assert r["intervals"] == list(np.diff(rounds)) and r["num_samples"] > 0
    assert summary["bus"]["rejected"] == {}


def test_straggler_past_the_deadline_is_recorded_late(tmp_path: Path, broker_url: str) -> None:
    """node-002 takes 3 s too long in round 1: the round closes at its 2.5 s deadline without it,
    it is recorded late (not participating), and its update is refused as late when it comes
    (during round 2, which node-000 slows down so that the run is still going)."""
    cfg = base_config(
        nodes=3, rounds=4, deadline_s=2.5,
        faults={"node-002": {"delay_s": 3, "delay_rounds": [1]}, "node-000": {"delay_s": 1.5, "delay_rounds": [2]}},
    )  # fmt: skip
    fed = Federation(tmp_path, broker_url, cfg)
    fed.start_coordinator()
    fed.start_nodes("node-000", "node-001", "node-002")
    assert fed.wait() == 0, fed.log("coordinator.log")
    metrics, record, summary = fed.metrics(), fed.participation(), fed.summary()
    round1 = metrics[1]
    assert round1["late"] == ["node-002"] and round1["accepted"] == ["node-000", "node-001"]
    assert 2.4 < round1["round_seconds"] < 4, round1
    assert all(line["accepted"] == ["node-000", "node-001", "node-002"] for line in (metrics[0], *metrics[2:]))
    assert record["node-002"]["late"] == 1 and record["node-002"]["count"] == 3
    assert record["node-002"]["intervals"] == [2, 1]
    assert summary["late_arrivals"] == 1 and summary["rounds_completed"] == 4


def test_straggler_past_the_deadline_is_carried_into_the_next_round_when_asked(tmp_path: Path, broker_url: str) -> None:
    """policy.late_updates: carry: node-002's round-1 update, 3 s late, arrives during round 2 (which
    node-000 slows down and in which node-002's own training fails), is accepted, and is folded into
    round 2's aggregation one version stale: node-002's participation in round 2."""
    cfg = base_config(
        nodes=3, rounds=4, deadline_s=2.5, policy={"ack_timeout_s": 3, "late_updates": "carry"},
        engine={"staleness": {"fn": "polynomial", "a": 0.5}},
        faults={"node-002": {"delay_s": 3, "delay_rounds": [1], "error_at_round": 2},
                "node-000": {"delay_s": 2, "delay_rounds": [2]}},
    )  # fmt: skip
    fed = Federation(tmp_path, broker_url, cfg)
    fed.start_coordinator()
    fed.start_nodes("node-000", "node-001", "node-002")
    assert fed.wait() == 0, fed.log("coordinator.log")
    metrics, record, summary = fed.metrics(), fed.participation(), fed.summary()
    assert metrics[1]["late"] == ["node-002"] and metrics[1]["accepted"] == ["node-000", "node-001"]
    assert metrics[2]["failed"] == ["node-002"] and metrics[2]["late_folded"] == ["node-002"], metrics[2]
    assert "carried into the next aggregation" in fed.log("coordinator.log")
    assert summary["late_arrivals"] == 0 and summary["bus"]["rejected"] == {}
    assert record["node-002"]["late"] == 1 and record["node-002"]["count"] == 3
    assert record["node-002"]["last_round"] == 3 and record["node-002"]["intervals"] == [2, 1]


def test_node_crashing_mid_round_is_lost_and_the_next_rounds_go_on(tmp_path: Path, broker_url: str) -> None:
    """node-001 drops its connection on receiving round 1's model: its will marks it offline, the
    round does not wait for the deadline, and later rounds sample only live nodes."""
    cfg = base_config(nodes=3, rounds=4, deadline_s=30, faults={"node-001": {"fail_at_round": 1}})
    fed = Federation(tmp_path, broker_url, cfg)
    fed.start_coordinator()
    fed.start_nodes("node-000", "node-001", "node-002")
    assert fed.wait() == 0, fed.log("coordinator.log")
    metrics, record = fed.metrics(), fed.participation()
    assert metrics[1]["lost"] == ["node-001"] and metrics[1]["accepted"] == ["node-000", "node-002"]
    assert metrics[1]["round_seconds"] < 10, "the round waited for a node that was offline"
    assert all(line["selected"] == ["node-000", "node-002"] and line["live"] == 2 for line in metrics[2:])
    assert record["node-001"]["lost"] == 1 and record["node-001"]["last_round"] == 0
    assert fed.summary()["rounds_completed"] == 4


def test_node_whose_training_fails_reports_it_and_the_round_does_not_wait(tmp_path: Path, broker_url: str) -> None:
    """node-001's training raises in round 1: it reports the failure, the round closes without waiting
    for the 30 s deadline, the failure is in the metrics and the record, and node-001 trains again after."""
    cfg = base_config(nodes=3, rounds=3, deadline_s=30, faults={"node-001": {"error_at_round": 1}})
    fed = Federation(tmp_path, broker_url, cfg)
    fed.start_coordinator()
    fed.start_nodes("node-000", "node-001", "node-002")
    assert fed.wait() == 0, fed.log("coordinator.log")
    metrics, record, summary = fed.metrics(), fed.participation(), fed.summary()
    assert metrics[1]["failed"] == ["node-001"] and metrics[1]["accepted"] == ["node-000", "node-002"]
    assert metrics[1]["late"] == [] and metrics[1]["round_seconds"] < 10, metrics[1]
    assert metrics[2]["accepted"] == ["node-000", "node-001", "node-002"]
    assert record["node-001"]["failed"] == 1 and record["node-001"]["count"] == 2
    assert summary["participation_totals"]["failed"] == 1
    assert "fault injection: training error at round 1" in fed.log("node-000.log")


def test_node_joining_late_is_sampled_from_then_on(tmp_path: Path, broker_url: str) -> None:
    """The run starts with 2 of 3 nodes (min_nodes=2); node-002 joins mid-run and is selected in
    every round after it came online (C=1). node-000's 0.3 s a round keeps the run going for about
    9 s after node-002's process is started, which its start-up (Python and torch) needs under load."""
    cfg = base_config(
        nodes=3, rounds=30, eval_every=30, policy={"min_nodes": 2, "ack_timeout_s": 3},
        faults={"node-000": {"delay_s": 0.3}},
    )  # fmt: skip
    fed = Federation(tmp_path, broker_url, cfg)
    fed.start_coordinator()
    fed.start_nodes("node-000", "node-001")
    fed.wait_for_metrics(2)
    fed.start_nodes("node-002")
    assert fed.wait() == 0, fed.log("coordinator.log")
    metrics = fed.metrics()
    joined = next(i for i, line in enumerate(metrics) if "node-002" in line["selected"])
    assert joined >= 2, "node-002 was selected before it started"
    assert joined < len(metrics) - 3, "node-002 was not sampled soon enough after joining"
    assert all("node-002" in line["accepted"] for line in metrics[joined:])
    assert all(line["live"] == 2 for line in metrics[:2])


def test_insufficient_updates_retry_keeps_accepted_updates(tmp_path: Path, broker_url: str) -> None:
    """min_updates=3 with one node crashing: the attempt falls short, the retry carries the two
    accepted updates over instead of discarding them, then the round aggregates... or, with one node
    left, gives up after the retries and logs the discarded updates."""
    cfg = base_config(
        nodes=3, rounds=2, deadline_s=3, faults={"node-002": {"fail_at_round": 0}},
        policy={"min_updates": 3, "max_retries": 1, "ack_timeout_s": 2, "on_insufficient": "retry"},
    )  # fmt: skip
    fed = Federation(tmp_path, broker_url, cfg)
    fed.start_coordinator()
    fed.start_nodes("node-000", "node-001", "node-002")
    fed.wait()
    metrics = fed.metrics()
    first, retry = metrics[0], metrics[1]
    assert (first["round"], first["attempt"], first["aggregated"]) == (0, 0, False)
    assert first["accepted"] == ["node-000", "node-001"] and first["lost"] == ["node-002"]
    assert (retry["round"], retry["attempt"]) == (0, 1) and retry["carried"] == ["node-000", "node-001"]
    assert retry["discarded"] == ["node-000", "node-001"] and not retry["aggregated"]
    assert fed.participation()["node-000"]["count"] == 0, "an update that was not aggregated counted as participation"


def test_same_seed_gives_the_same_run(tmp_path: Path, embedded_broker: str) -> None:
    """Two runs of one config and seed on CPU: identical cohorts, losses and accuracies."""
    results = []
    for i in range(2):
        cfg = base_config(nodes=5, fraction=0.4, rounds=5)
        fed = Federation(tmp_path / f"r{i}", embedded_broker, cfg) if (tmp_path / f"r{i}").mkdir() is None else None
        assert fed is not None
        fed.start_coordinator()
        fed.start_nodes(*[f"node-00{j}" for j in range(5)])
        assert fed.wait() == 0
        results.append([(m["selected"], m["train_loss"], m["accuracy"], m["loss"]) for m in fed.metrics()])
    assert results[0] == results[1]


def test_validation_split_is_held_out_and_names_the_final_model(tmp_path: Path, broker_url: str) -> None:
    """With data.validation_fraction the nodes never see the held-out samples, every evaluation reports
    validation accuracy, and the summary names the model chosen on it with that model's test accuracy."""
    cfg = base_config(nodes=2, rounds=2, data={"dataset": "digits", "validation_fraction": 0.2})
    fed = Federation(tmp_path, broker_url, cfg)
    fed.start_coordinator()
    fed.start_nodes("node-000", "node-001")
    assert fed.wait() == 0, fed.log("coordinator.log")
    summary, metrics = fed.summary(), fed.metrics()
    assert all(0 <= m["val_accuracy"] <= 1 for m in metrics)
    assert summary["final_model"] == "global" and summary["final_model_accuracy"] == summary["final_accuracy"]
    assert summary["models"]["global"]["val_accuracy"] == metrics[-1]["val_accuracy"]
    partition = json.loads((fed.out / "partition.json").read_text())
    assert 1047 < partition["train_samples"] < 1107 and sum(partition["sizes"].values()) == partition["train_samples"]


async def test_nodes_topic_carries_state_changes_and_the_status_topic_every_round(
    tmp_path: Path, broker_url: str
) -> None:
    """Nodes follow coordinator/state, which changes only when the state does (1,000 nodes each
    received every round's status before); watchers still get a status message per round."""
    cfg = base_config(nodes=2, rounds=5, eval_every=5)
    fed = Federation(tmp_path, broker_url, cfg)
    topics = Topics(fed.federation)
    seen: dict[str, list[Message]] = {topics.coordinator_state: [], topics.coordinator_status: []}
    async with raw_client(broker_url) as watcher:
        await watcher.subscribe(topics.coordinator_state, qos=1)
        await watcher.subscribe(topics.coordinator_status, qos=1)
        fed.start_coordinator()
        fed.start_nodes("node-000", "node-001")
        waiter = asyncio.create_task(asyncio.to_thread(fed.wait))
        async with asyncio.timeout(120):
            async for m in watcher.messages:
                seen[m.topic.value].append(decode(bytes(m.payload)))  # type: ignore[arg-type]
                if seen[topics.coordinator_state][-1:] and seen[topics.coordinator_state][-1].meta["state"] in (
                    "finished",
                    "failed",
                ):
                    break
        assert await waiter == 0, fed.log("coordinator.log")
    states = [m.meta["state"] for m in seen[topics.coordinator_state]]
    assert states[-1] == "finished" and len(states) == len(set(states)), states
    done = [m.meta["round_done"] for m in seen[topics.coordinator_status] if "round_done" in m.meta]
    assert done == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("inline_model_bytes", [None, 0], ids=["inline", "broadcast"])
async def test_small_models_ride_in_the_task_and_large_ones_are_broadcast_once(
    tmp_path: Path, broker_url: str, inline_model_bytes: int | None, request: pytest.FixtureRequest
) -> None:
    """By default the MLP's ~19 KB model comes inside each task: no acknowledgement, nothing on the
    round's model topic. With inline_model_bytes 0 every selected node acknowledges and the model is
    published once per round on model/{round}. Receipts go at QoS 0 either way."""
    cfg = base_config(nodes=3, rounds=3, eval_every=3, policy={"inline_model_bytes": inline_model_bytes})
    fed = Federation(tmp_path, broker_url, cfg)
    topics = Topics(fed.federation)
    seen: list[tuple[str, Message]] = []
    receipt_qos: set[int] = set()
    async with raw_client(broker_url) as watcher:
        await watcher.subscribe(f"{topics.prefix}/#", qos=1)
        fed.start_coordinator()
        fed.start_nodes("node-000", "node-001", "node-002")
        waiter = asyncio.create_task(asyncio.to_thread(fed.wait))
        async with asyncio.timeout(120):
            async for m in watcher.messages:
                message = decode(bytes(m.payload))  # type: ignore[arg-type]
                seen.append((m.topic.value, message))
                if message.kind == Kind.RECEIPT:
                    receipt_qos.add(m.qos)  # subscribed at QoS 1: delivered at the QoS it was published with
                if m.topic.value == topics.coordinator_state and message.meta["state"] in ("finished", "failed"):
                    break
        assert await waiter == 0, fed.log("coordinator.log")
    tasks = [msg for topic, msg in seen if msg.kind == Kind.TASK]
    acks = [msg for topic, msg in seen if msg.kind == Kind.ACK]
    broadcasts = [topic for topic, msg in seen if msg.kind == Kind.MODEL]
    assert len(tasks) == 9 and len([msg for _, msg in seen if msg.kind == Kind.UPDATE]) == 9
    if inline_model_bytes is None:
        assert all(t.meta["inline"] and any(n.startswith("model/") for n in t.tensors) for t in tasks), tasks[0].meta
        assert acks == [] and broadcasts == []
    else:
        assert all("inline" not in t.meta and not t.tensors for t in tasks)
        assert len(acks) == 9 and broadcasts == [topics.model(r) for r in range(3)]
    if request.node.callspec.params["broker_url"] == "mosquitto":  # amqtt delivers at the subscription's QoS
        assert receipt_qos == {0}, "receipts are advisory: published at QoS 0"
    summary = fed.summary()
    assert summary["rounds_completed"] == 3 and summary["bus"]["rejected"] == {}
    assert summary["final_accuracy"] > 0.5
