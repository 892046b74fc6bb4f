"""Secure aggregation over a real broker (issue 32, items 1 and 4), on mosquitto and the embedded
broker: coordinator and nodes as processes, every `secagg-*` step over MQTT.

- a secure run equals the same experiment in process (`build_local`), round for round: the
  unmasking is exact, so the daemons' models are the simulation's, whose round equals the plain
  round within the quantisation's bound (`tests/experiments/test_secure_simulate.py`);
- the coordinator's event log holds no node's unmasked update: every update that reached it carries
  only the masked vector;
- a node that shares and then misses the deadline is unmasked from its neighbours' shares; more
  dropouts than the threshold allows end the round without a model, with the reason;
- a node's keys and shares replayed into a later round are refused, and the run goes on."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fedmq.broker import Topics, decode, encode
from fedmq.broker.message import new_message_id
from fedmq.experiments.config import parse_config
from fedmq.experiments.local import build_local
from fedmq.experiments.replay import replay_run
from fedmq.fedcore import masked as m
from tests.helpers import raw_client_with_coordinator_up
from tests.integration.federation import Federation, base_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
NODES = ("node-000", "node-001", "node-002", "node-003")


def _config(**changes: Any) -> dict[str, Any]:
    defaults = {"nodes": 4, "rounds": 2, "deadline_s": 15, "privacy": {"secure_aggregation": {"timeout_s": 10}}}
    return base_config(**(defaults | changes))


def _events(fed: Federation) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (fed.out / "events.jsonl").read_text().splitlines()]


def _in_process(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    fed = build_local(parse_config(cfg), device=torch.device("cpu"))
    return fed.run()


def test_a_secure_run_over_the_broker_equals_the_in_process_run(tmp_path: Path, broker_url: str) -> None:
    cfg = _config()
    fed = Federation(tmp_path, broker_url, cfg)
    fed.start_coordinator()
    fed.start_nodes(*NODES)
    assert fed.wait() == 0, fed.log("coordinator.log")
    lines = fed.metrics()
    assert [line["secagg_survivors"] for line in lines] == [4, 4], lines
    local = _in_process(fed.config)
    assert [line["train_loss"] for line in lines] == [line["train_loss"] for line in local]
    assert [line["accuracy"] for line in lines] == [line["accuracy"] for line in local]
    updates = [e for e in _events(fed) if e.get("ev") == "UpdateArrived"]
    assert len(updates) == 8 and all(u["tensors"] == 1 for u in updates)  # the masked vector, nothing else
    steps = {e["kind"] for e in _events(fed) if e.get("ev") == "SecAggArrived"}
    assert steps == {"secagg-keys", "secagg-shares", "secagg-reveal"}
    outcome = replay_run(fed.out)  # the updates recomputed unmasked: the same models, bit for bit
    assert outcome.ok and outcome.report.final_model_sha256 == fed.summary()["model_sha256"]


def test_a_node_that_misses_the_deadline_after_sharing_is_unmasked_without_it(tmp_path: Path, broker_url: str) -> None:
    """node-003 shares its seeds, then its update comes 4 s late: the three others are summed (its
    masks removed with its reconstructed key), and its late masked update is refused."""
    cfg = _config(rounds=1, deadline_s=4, faults={"node-003": {"delay_s": 8}})
    fed = Federation(tmp_path, broker_url, cfg)
    fed.start_coordinator()
    fed.start_nodes(*NODES)
    assert fed.wait(timeout=180) == 0, fed.log("coordinator.log")
    [line] = fed.metrics()
    assert line["aggregated"] and line["accepted"] == ["node-000", "node-001", "node-002"], line
    assert line["secagg_dropped"] == 1 and line["secagg_survivors"] == 3
    local = _in_process(fed.config)  # the simulation models the delay too
    assert local[0]["accepted"] == line["accepted"] and local[0]["accuracy"] == line["accuracy"]


def test_more_dropouts_than_the_threshold_allows_end_the_round_without_a_model(tmp_path: Path, broker_url: str) -> None:
    """Every node's secrets need all three of its neighbours' shares (threshold 1.0): with node-003
    late, no survivor's self-mask can be rebuilt, so the round ends unaggregated and says why."""
    secure = {"secure_aggregation": {"timeout_s": 10, "threshold": 1.0}}
    policy = {"ack_timeout_s": 3, "on_insufficient": "skip"}
    cfg = _config(rounds=1, deadline_s=4, faults={"node-003": {"delay_s": 8}}, privacy=secure, policy=policy)
    fed = Federation(tmp_path, broker_url, cfg)
    fed.start_coordinator()
    fed.start_nodes(*NODES)
    fed.wait(timeout=180)
    [line] = fed.metrics()
    assert not line["aggregated"] and "needs 3 shares" in line["secure_aggregation_failed"], line
    assert fed.summary()["rounds_completed"] == 0


async def test_keys_and_shares_replayed_into_a_later_round_are_refused(tmp_path: Path, broker_url: str) -> None:
    cfg = _config(rounds=3)
    fed = Federation(tmp_path, broker_url, cfg)
    topics = Topics(fed.federation)
    async with raw_client_with_coordinator_up(fed, broker_url) as spy:
        await spy.subscribe(topics.all_secagg, qos=1)
        fed.start_nodes(*NODES)
        captured: list[tuple[str, bytes]] = []
        async with asyncio.timeout(120):
            async for message in spy.messages:
                if message.topic.matches(topics.all_secagg) and isinstance(message.payload, bytes | bytearray):
                    captured.append((str(message.topic), bytes(message.payload)))
                if len(fed.metrics()) >= 1 and len(captured) >= 8:
                    break
        for topic, frame in captured[:8]:  # round 0's keys and shares into round 1 or 2, as new messages
            again = dataclasses.replace(decode(frame), message_id=new_message_id())
            await spy.publish(topic, bytes(encode(again)), qos=1)
    assert await asyncio.to_thread(fed.wait) == 0, fed.log("coordinator.log")
    lines, rejected = fed.metrics(), fed.summary()["bus"]["rejected"]
    assert [line["aggregated"] for line in lines] == [True] * 3, lines
    replays = sum(rejected.get(r, 0) for r in ("secagg-out-of-step", "duplicate-secagg", "wrong-round"))
    assert replays >= 1, rejected


def test_the_masked_schema_is_what_the_coordinator_checks() -> None:
    """A plain update's tensors are not a masked vector: the engine's schema with secure aggregation
    is one int32 tensor of the model's floating entries."""
    from fedmq.coordinator.halfcalls import update_schema
    from fedmq.experiments.build import coordinator_config, coordinator_half, load_split

    cfg = parse_config(_config())
    split = load_split(cfg)
    half = coordinator_half(cfg, split)
    schema = update_schema(half, coordinator_config(cfg, Path(".")))
    assert list(schema) == [m.GROUP] and schema[m.GROUP][m.TENSOR].dtype == torch.int32
