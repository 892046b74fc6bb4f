"""A flood on one node's own topic (issue 31, item 6): 40,000 small frames in 20 s were each
validated, written to the event log (16.9 MB) and logged, and slowed rounds 5 to 30 times. The
coordinator now drops what a node sends beyond its message budget before the engine and the event
log see it, counts it, and logs a few lines; the node's own messages pass again once it slows down."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fedmq.broker import Kind, Message, Topics, encode
from tests.helpers import raw_client_with_coordinator_up
from tests.integration.federation import Federation, base_config

pytestmark = pytest.mark.slow

FLOOD = 3000


async def test_a_flood_on_a_nodes_topic_is_dropped_over_budget_and_the_node_still_trains(
    tmp_path: Path, broker_url: str
) -> None:
    cfg = base_config(nodes=3, rounds=2, deadline_s=20, policy={"min_nodes": 3})
    fed = Federation(tmp_path, broker_url, cfg)
    t = Topics(fed.federation)
    async with raw_client_with_coordinator_up(fed, broker_url) as evil:
        for _ in range(FLOOD):  # each a decodable update of its own id: without a budget, each an event
            forged = Message(
                kind=Kind.UPDATE, federation=fed.federation, round=0, sender="node-002",
                meta={"task": b"f" * 16, "num_samples": 10, "train_seconds": 1.0},
            )  # fmt: skip
            await evil.publish(t.update("node-002"), bytes(encode(forged)), qos=0)
    fed.start_nodes("node-000", "node-001", "node-002")
    assert await asyncio.to_thread(fed.wait) == 0, fed.log("coordinator.log")
    summary, metrics = fed.summary(), fed.metrics()
    # node-002's budget refilled while the nodes started: its real updates were taken in every round
    assert [sorted(line["accepted"]) for line in metrics] == [["node-000", "node-001", "node-002"]] * 2, metrics
    dropped = summary["bus"]["rejected"].get("over-budget", 0)
    # the default budget: a burst of 500 then 50 a second; what passed was refused by the engine
    assert dropped >= FLOOD // 2, summary["bus"]["rejected"]
    events = (fed.out / "events.jsonl").read_text().splitlines()
    # what passed: its event and the engine's refusal each, beside node-002's real messages
    assert sum("node-002" in line for line in events) < 2 * (FLOOD - dropped) + 50, len(events)
    log = fed.log("coordinator.log")
    assert 1 <= log.count("is over its message budget") <= 5, log
