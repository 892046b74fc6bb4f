"""Per-node message and byte budgets (issue 31, item 6), on a clock the test turns."""

from __future__ import annotations

import pytest

from fedmq.coordinator import budgets
from fedmq.coordinator.budgets import NodeBudgets, Rate, node_budgets
from fedmq.coordinator.config import RoundPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_node_gets_its_burst_then_its_rate_and_others_are_untouched() -> None:
    clock = Clock()
    limits = NodeBudgets(Rate(per_s=10, burst=5), None, clock=clock)
    assert [limits.admit("a", 1) for _ in range(7)] == [None] * 5 + ["messages"] * 2
    assert limits.admit("b", 1) is None  # another node's budget is its own
    clock.now = 0.25  # 2.5 messages' worth of refill
    assert [limits.admit("a", 1) for _ in range(3)] == [None, None, "messages"]
    clock.now = 100.0  # refilled to the burst, never beyond
    assert [limits.admit("a", 1) for _ in range(6)] == [None] * 5 + ["messages"]


def test_the_byte_budget_refuses_without_charging_the_message_budget() -> None:
    clock = Clock()
    limits = NodeBudgets(Rate(per_s=1, burst=2), Rate(per_s=100, burst=1000), clock=clock)
    assert limits.admit("a", 900) is None
    assert limits.admit("a", 200) == "bytes"  # 100 bytes left
    assert limits.admit("a", 100) is None  # the refusal above cost no message token
    assert limits.admit("a", 1) == "messages"
    assert limits.admit("a", 5000) == "bytes"  # over the burst: refused whatever the messages say


def test_flood_of_invented_ids_keeps_the_table_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budgets, "MAX_NODES_TRACKED", 100)
    clock = Clock()
    limits = NodeBudgets(Rate(per_s=1, burst=3), None, clock=clock)
    for i in range(1000):
        limits.admit(f"n{i}", 1)
        clock.now += 0.001
    assert len(limits._buckets) <= 100
    clock.now += 10  # all refilled: forgotten at the next new id, and a forgotten node starts full
    limits.admit("fresh", 1)
    assert len(limits._buckets) == 1
    assert [limits.admit("n5", 1) for _ in range(4)] == [None] * 3 + ["messages"]


def test_the_policy_sets_the_budgets_and_the_byte_default_follows_the_largest_transfer() -> None:
    limits = node_budgets(RoundPolicy(node_messages_per_s=20, node_message_burst=40), max_transfer_bytes=1000)
    assert limits.messages == Rate(per_s=20, burst=40)
    assert limits.bytes == Rate(per_s=4000, burst=16000)
    # a byte rate below one transfer a second still lets the largest transfer through, once
    small = node_budgets(RoundPolicy(node_bytes_per_s=10), max_transfer_bytes=1000)
    assert small.bytes == Rate(per_s=10, burst=1000) and small.admit("a", 1000) is None
    assert node_budgets(RoundPolicy(node_messages_per_s=None), 1000).messages is None
