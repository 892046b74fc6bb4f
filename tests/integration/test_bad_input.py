"""A hostile client injects malformed, oversized, duplicated, replayed, spoofed and out-of-round
messages into a running federation: both daemons reject each with a counted reason and go on, and
a refused message on a node's behalf never keeps the node's own update out of its round."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedmq.broker import CodecError, Kind, Message, Topics, decode, encode
from fedmq.experiments.build import load_split, shards
from fedmq.experiments.config import parse_config
from tests.helpers import raw_client, raw_client_with_coordinator_up
from tests.integration.federation import Federation, base_config

pytestmark = pytest.mark.slow


async def test_daemons_survive_and_count_every_kind_of_bad_message(tmp_path: Path, broker_url: str) -> None:
    cfg = base_config(
        nodes=3, rounds=5, deadline_s=8, eval_every=5,
        bus={"max_message_bytes": 262_144, "chunk_bytes": 65_536},
        # in round 1 node-000 and node-001 answer late enough that the forged updates for them arrive
        # first even on a loaded machine (0.3 s was once not enough for node-000 in CI)
        faults={n: {"delay_s": 3.0, "delay_rounds": [1]} for n in ("node-000", "node-001")},
    )  # fmt: skip
    fed = Federation(tmp_path, broker_url, cfg)
    t = Topics(fed.federation)
    fed.start_coordinator()
    fed.start_nodes("node-000", "node-001", "node-002")
    waiter = asyncio.create_task(asyncio.to_thread(fed.wait))
    attacked_round = None
    async with raw_client(broker_url) as evil:
        await evil.subscribe(f"{t.prefix}/#", qos=1)
        async with asyncio.timeout(60):
            async for m in evil.messages:
                payload = bytes(m.payload)  # type: ignore[arg-type]
                topic = m.topic.value
                route = t.route(topic)
                if route is None or route.channel not in ("node-task", "updates"):
                    continue
                try:
                    msg = decode(payload)
                except CodecError:
                    continue  # our own garbage coming back
                # node-002's own update, on its own topic: our forged one in node-002's name on node-001's
                # topic comes back to this subscription too, and replaying that was refused as wrong-sender
                # again, not as a duplicate (once on a loaded machine, when it came back first)
                mine = route.node == "node-002" and msg.sender == "node-002"
                if route.channel == "updates" and attacked_round is not None and mine:
                    await evil.publish(topic, payload, qos=1)  # a verbatim replay: dropped by message id
                    # the same update under a fresh message id, after node-002's was taken: a duplicate
                    fresh = dataclasses.replace(msg, message_id=b"f" * 16)
                    await evil.publish(topic, bytes(encode(fresh)), qos=1)
                    break
                if route.channel != "node-task" or msg.round != 1 or route.node != "node-001":
                    continue
                attacked_round = msg.round
                task = msg.meta["task"]
                good = Message(
                    kind=Kind.UPDATE, federation=fed.federation, round=1, sender="node-001",
                    meta={"task": task, "num_samples": 10}, tensors={"model/w": np.zeros(3, np.float32)},
                )  # fmt: skip
                frame = bytes(encode(good))
                attacks = [
                    (t.update("node-001"), b"garbage that is not a frame"),
                    (t.update("node-001"), frame[:-1] + bytes([frame[-1] ^ 1])),
                    (t.update("node-001"), b"FMQ\x07" + frame[4:]),
                    (t.update("node-001"), bytes(encode(dataclasses.replace(good, federation="elsewhere")))),
                    (t.update("node-001"), b"\x00" * 300_000),
                    (t.update("node-001"), bytes(encode(dataclasses.replace(good, round=7, message_id=b"r" * 16)))),
                    (t.update("node-001"), bytes(encode(dataclasses.replace(good, sender="node-002", message_id=b"s" * 16)))),
                    (t.update("node-001"), bytes(encode(dataclasses.replace(good, kind=Kind.ACK, message_id=b"k" * 16)))),
                    (t.update("node-001"), bytes(encode(dataclasses.replace(good, meta={"task": task}, message_id=b"n" * 16)))),
                    # a second bad answer, fresh message id: refused too, node-001's task still open
                    (t.update("node-001"), bytes(encode(dataclasses.replace(good, message_id=b"d" * 16)))),
                    # node-001's task id on node-000's behalf: foreign-task, each node's id is its own (issue 31)
                    (t.update("node-000"), bytes(encode(dataclasses.replace(good, sender="node-000")))),
                    (t.task("node-002"), b"not a task"),
                    (t.task("node-002"), bytes(encode(Message(kind=Kind.TASK, federation=fed.federation, round=1,
                                                              sender="coordinator", meta={"task": b"x"})))),
                    (t.task("node-002"), bytes(encode(Message(kind=Kind.TASK, federation=fed.federation, round=1,
                                                              sender="mallory", meta={})))),
                    # tensors in a task that does not say it carries the model; an inline model of the wrong shape
                    (t.task("node-002"), bytes(encode(dataclasses.replace(
                        msg, message_id=b"t" * 16, tensors={"model/w": np.zeros(3, np.float32)},
                        meta={k: v for k, v in msg.meta.items() if k != "inline"})))),
                    (t.task("node-002"), bytes(encode(dataclasses.replace(
                        msg, message_id=b"i" * 16, meta={**msg.meta, "task": b"i" * 16, "inline": True, "payload": {}},
                        tensors={"model/w": np.zeros(3, np.float32)})))),
                ]  # fmt: skip
                for topic_, data in attacks:
                    await evil.publish(topic_, data, qos=1)
    assert await waiter == 0, fed.log("coordinator.log")
    summary, metrics = fed.summary(), fed.metrics()
    assert summary["state"] == "finished" and summary["rounds_completed"] == 5
    rejected = summary["bus"]["rejected"]
    for reason in ["bad-magic", "checksum", "wrong-version", "wrong-federation", "oversized", "wrong-round",
                   "wrong-sender", "unexpected-kind", "bad-update", "wrong-shape", "duplicate-update",
                   "foreign-task"]:  # fmt: skip
        assert rejected.get(reason, 0) >= 1, (reason, rejected)
    assert summary["bus"]["duplicates"] >= 1
    # the forged updates for node-000 and node-001 did not answer for them: their own came later and were taken
    assert metrics[1]["rejected"] == [] and metrics[1]["accepted"] == ["node-000", "node-001", "node-002"]
    assert all(line["aggregated"] for line in metrics)
    node_log = fed.log("node-000.log")
    node_rejects = set(re.findall(r"rejected message on \S+/node-002/task: ([a-z-]+)", node_log))
    assert {"truncated", "bad-task", "wrong-sender", "wrong-shape"} <= node_rejects, node_rejects
    assert "node-002" in metrics[-1]["accepted"]


async def test_forged_update_claiming_1e11_samples_is_refused_and_the_real_one_taken(
    tmp_path: Path, broker_url: str
) -> None:
    """Issue 16: an anonymous client answers node-001's round-1 task first, with the model's tensors
    scaled and 10^11 samples. It is refused (samples-over-limit: above node-001's shard, its limit),
    node-001's own update for that round is accepted after it, and the model is not replaced."""
    cfg = base_config(nodes=3, rounds=3, deadline_s=8, faults={"node-001": {"delay_s": 2.0, "delay_rounds": [1]}})
    fed = Federation(tmp_path, broker_url, cfg)
    t = Topics(fed.federation)
    fed.start_coordinator()
    fed.start_nodes("node-000", "node-001", "node-002")
    waiter = asyncio.create_task(asyncio.to_thread(fed.wait))
    async with raw_client(broker_url) as evil:
        await evil.subscribe(t.task("node-001"), qos=1)
        async with asyncio.timeout(60):
            async for m in evil.messages:
                task = decode(bytes(m.payload))  # type: ignore[arg-type]
                if task.round != 1:
                    continue
                assert task.tensors, "the test expects the model inside the task (inline)"
                forged = Message(
                    kind=Kind.UPDATE, federation=fed.federation, round=1, sender="node-001",
                    meta={"task": task.meta["task"], "num_samples": 10**11, "train_seconds": 1.0},
                    tensors={k: np.asarray(v) * -1000.0 for k, v in task.tensors.items()},
                )  # fmt: skip
                await evil.publish(t.update("node-001"), bytes(encode(forged)), qos=1)
                break
    assert await waiter == 0, fed.log("coordinator.log")
    summary, metrics = fed.summary(), fed.metrics()
    assert summary["state"] == "finished" and summary["rounds_completed"] == 3
    # above node-001's shard (its limit) before its announcement is even consulted
    assert summary["bus"]["rejected"] == {"samples-over-limit": 1}, summary["bus"]["rejected"]
    assert summary["refused_updates"] == {"samples-over-limit": 1}
    assert metrics[1]["accepted"] == ["node-000", "node-001", "node-002"] and metrics[1]["rejected"] == []
    assert all(line["aggregated"] for line in metrics)
    assert metrics[1]["accuracy"] > 0.5 and summary["final_accuracy"] > 0.5, metrics
    assert "samples-over-limit" in fed.log("coordinator.log")
    assert fed.participation()["node-001"]["rejected"] == 0


Handler = Callable[[Any, Any], Awaitable[None]]
"""What the insider does with one message it receives: (its client, the MQTT message)."""


async def _play_insider(fed: Federation, broker_url: str, *, announces: int, topics: list[str], handle: Handler) -> int:
    """node-002 played by a raw client with valid credentials' worth of topics: it subscribes to `topics`,
    announces `announces` samples, the honest node-000 and node-001 start, and it `handle`s every
    message until the run ends. Returns the coordinator's exit code; its retained status is cleared."""
    t = Topics(fed.federation)
    async with raw_client(broker_url) as insider:
        status = Message(
            kind=Kind.NODE_STATUS, federation=fed.federation, round=-1, sender="node-002",
            meta={"state": "online", "num_samples": announces},
        )  # fmt: skip
        await insider.subscribe([(topic, 1) for topic in topics])
        await insider.publish(t.node_status("node-002"), bytes(encode(status)), qos=1, retain=True)
        fed.start_nodes("node-000", "node-001")
        waiter = asyncio.create_task(asyncio.to_thread(fed.wait))
        while not waiter.done():
            try:
                async with asyncio.timeout(0.5):
                    m = await anext(aiter(insider.messages))
            except TimeoutError:
                continue
            await handle(insider, m)
        await insider.publish(t.node_status("node-002"), b"", qos=1, retain=True)
    return await waiter


async def _insider(
    fed: Federation, broker_url: str, *, announces: int, claims: int, scale: Callable[[int], float]
) -> tuple[int, int]:
    """The insider (`_play_insider`) answering every task it gets with the task's model times
    `scale(round)`, claiming `claims` samples. Returns (the coordinator's exit code, the tasks it answered)."""
    t = Topics(fed.federation)
    answered = 0

    async def forge(insider: Any, m: Any) -> None:
        nonlocal answered
        task = decode(bytes(m.payload))
        forged = Message(
            kind=Kind.UPDATE, federation=fed.federation, round=task.round, sender="node-002",
            meta={"task": task.meta["task"], "num_samples": claims, "train_seconds": 1.0},
            tensors={k: np.asarray(v) * scale(task.round) for k, v in task.tensors.items()},
        )  # fmt: skip
        await insider.publish(t.update("node-002"), bytes(encode(forged)), qos=1)
        answered += 1

    code = await _play_insider(fed, broker_url, announces=announces, topics=[t.task("node-002")], handle=forge)
    return code, answered


async def test_an_insider_announcing_1e11_samples_never_goes_live(tmp_path: Path, broker_url: str) -> None:
    """Issue 31, item 1: an insider (node-002's identity) announced 10^11 samples in its own status
    and claimed them in its updates, accepted because the claim was checked only against its own
    announcement; with `mean` one such update ended the run. The experiment's partition now bounds
    each node's announcement by its shard: node-002 is refused and never selected, the honest nodes
    finish the run, and the insider's forged updates, had it got a task, would have been refused too."""
    cfg = base_config(nodes=3, rounds=3, deadline_s=8, policy={"min_nodes": 2})
    fed = Federation(tmp_path, broker_url, cfg)
    fed.start_coordinator()
    code, answered = await _insider(fed, broker_url, announces=10**11, claims=10**11, scale=lambda _: -1000.0)
    assert code == 0, fed.log("coordinator.log")
    summary, metrics = fed.summary(), fed.metrics()
    assert answered == 0 and all("node-002" not in line["selected"] for line in metrics)
    assert summary["state"] == "finished" and summary["bus"]["rejected"].get("samples-over-limit", 0) >= 1
    assert "node-002 announces 100000000000 samples, above its limit of" in fed.log("coordinator.log")
    assert summary["final_accuracy"] > 0.5, metrics


async def test_a_poisoned_round_is_rolled_back_and_its_node_excluded(tmp_path: Path, broker_url: str) -> None:
    """Issue 31, item 2: after one -1000x update with `mean` the accuracy fell to 0.10, the honest
    nodes trained to NaN and the run ground on for ever. With policy.reject_below the collapsed
    model is never published: the round runs again on the last good model; the insider (node-002,
    announcing its true shard size, answering round 0 honestly), whose update stands out by its
    norm, is excluded after its first rejected model (exclude_after 1), and the honest nodes, who
    shared the round with it, finish the run."""
    policy = {"min_nodes": 3, "reject_below": 0.5, "exclude_after": 1}
    cfg = base_config(nodes=3, rounds=4, deadline_s=8, policy=policy)
    experiment = parse_config(cfg)
    shard = len(shards(experiment, load_split(experiment))["node-002"])
    fed = Federation(tmp_path, broker_url, cfg)
    fed.start_coordinator()
    # round 0: the model back unchanged; then the model x -1000
    code, _ = await _insider(fed, broker_url, announces=shard, claims=shard, scale=lambda r: 1.0 if r == 0 else -1000.0)
    assert code == 0, fed.log("coordinator.log")
    summary, metrics = fed.summary(), fed.metrics()
    rejected = [line for line in metrics if "model_rejected" in line]
    assert len(rejected) == 1 and rejected[0]["round"] == 1 and rejected[0]["excluded"] == ["node-002"]
    assert "fell below 0.5 of the best so far" in rejected[0]["model_rejected"]
    assert rejected[0]["suspects"] == ["node-000", "node-001", "node-002"] and rejected[0]["outliers"] == ["node-002"]
    later = [line for line in metrics if (line["round"], line["attempt"]) > (1, 0)]
    assert later and all("node-002" not in line["selected"] for line in later)
    assert summary["state"] == "finished" and summary["rounds_completed"] == 4
    assert summary["final_accuracy"] > 0.5, metrics


async def test_forged_chunk_headers_no_longer_lock_out_the_real_updates(tmp_path: Path, broker_url: str) -> None:
    """Issue 31, item 7: two chunk frames declaring 1 GiB each took the coordinator's whole
    reassembly budget (2 GiB), and every node's chunked update was refused memory-bound until they
    timed out. The coordinator now bounds a transfer by what an update may hold (its schema): the
    forged headers are refused at once as oversized, and every real, chunked update is taken."""
    cfg = base_config(nodes=3, rounds=2, bus={"chunk_bytes": 4096}, policy={"min_nodes": 3})
    fed = Federation(tmp_path, broker_url, cfg)
    t = Topics(fed.federation)
    async with raw_client_with_coordinator_up(fed, broker_url) as evil:
        for node in ("node-000", "node-001"):
            header = Message(
                kind=Kind.CHUNK, federation=fed.federation, round=0, sender=node,
                meta={"xfer": os.urandom(16), "index": 0, "count": 2**18, "total": 2**30, "offset": 0},
                tensors={"data": np.zeros(4096, np.uint8)},
            )  # fmt: skip
            await evil.publish(t.update(node), bytes(encode(header)), qos=1)
    fed.start_nodes("node-000", "node-001", "node-002")
    assert await asyncio.to_thread(fed.wait) == 0, fed.log("coordinator.log")
    summary, metrics = fed.summary(), fed.metrics()
    assert [sorted(line["accepted"]) for line in metrics] == [["node-000", "node-001", "node-002"]] * 2, metrics
    assert summary["bus"]["rejected"].get("oversized", 0) == 2, summary["bus"]["rejected"]


async def test_an_insider_quoting_another_nodes_task_id_or_the_broadcasts_is_refused(
    tmp_path: Path, broker_url: str
) -> None:
    """Issue 31, item 4: every node of a round attempt got the same task id, and the model broadcast,
    which every node may read, carried it. The insider (node-002, a raw client) reads node-000's task
    (as any client can on this unsecured broker; under --secure only through a leak) and the
    broadcast, and on its own topic sends the model x -1000 quoting node-000's task id, then quoting
    the broadcast's id, then an update whose sender is node-000: each is refused with its reason
    (foreign-task, foreign-task, wrong-sender) and none is aggregated; its honest update, quoting its
    own id, is taken. Before, the first was taken (node-000's id was node-002's too)."""
    cfg = base_config(nodes=3, rounds=2, deadline_s=10, policy={"min_nodes": 3, "inline_model_bytes": 0})
    experiment = parse_config(cfg)
    shard = len(shards(experiment, load_split(experiment))["node-002"])
    fed = Federation(tmp_path, broker_url, cfg)
    t = Topics(fed.federation)
    fed.start_coordinator()
    seen: dict[int, dict[str, Message]] = {}
    done: set[int] = set()

    def update(round: int, task: object, tensors: dict[str, np.ndarray], sender: str = "node-002") -> bytes:
        forged = Message(
            kind=Kind.UPDATE, federation=fed.federation, round=round, sender=sender,
            meta={"task": task, "num_samples": shard, "train_seconds": 1.0}, tensors=tensors,
        )  # fmt: skip
        return bytes(encode(forged))

    async def quote(insider: Any, m: Any) -> None:
        message = decode(bytes(m.payload))
        route = t.route(m.topic.value)
        assert route is not None
        got = seen.setdefault(message.round, {})
        got["model" if route.channel == "model" else str(route.node)] = message
        if route.node == "node-002":  # its own task: acknowledged with its own id, as a node does
            ack = Message(
                kind=Kind.ACK, federation=fed.federation, round=message.round, sender="node-002",
                meta={"task": message.meta["task"]},
            )  # fmt: skip
            await insider.publish(t.ack("node-002"), bytes(encode(ack)), qos=1)
        if message.round in done or set(got) != {"node-000", "node-002", "model"}:
            return
        done.add(message.round)
        own, other, model = got["node-002"].meta["task"], got["node-000"].meta["task"], got["model"]
        assert own != other and "task" not in model.meta and model.meta["model_id"] not in (own, other)
        poison = {k: np.asarray(v) * -1000.0 for k, v in model.tensors.items()}
        for frame in (
            update(message.round, other, poison),
            update(message.round, model.meta["model_id"], poison),
            update(message.round, own, poison, sender="node-000"),
            update(message.round, own, {k: np.asarray(v) for k, v in model.tensors.items()}),
        ):
            await insider.publish(t.update("node-002"), frame, qos=1)

    topics = [t.task("node-002"), t.task("node-000"), f"{t.prefix}/model/+"]
    code = await _play_insider(fed, broker_url, announces=shard, topics=topics, handle=quote)
    assert code == 0, fed.log("coordinator.log")
    summary, metrics = fed.summary(), fed.metrics()
    assert done == {0, 1}, seen.keys()
    rejected = summary["bus"]["rejected"]
    assert rejected.get("foreign-task") == 4 and rejected.get("wrong-sender") == 2, rejected
    assert summary["refused_updates"] == {"foreign-task": 4}, summary["refused_updates"]
    assert all(sorted(line["accepted"]) == ["node-000", "node-001", "node-002"] for line in metrics), metrics
    assert all(line["rejected"] == [] and line["aggregated"] for line in metrics), metrics
    assert summary["final_accuracy"] > 0.5, metrics
    log = fed.log("coordinator.log")
    assert "node-002 quotes the task id sent to another node" in log and "quotes the model broadcast's id" in log


async def test_a_retained_update_or_ack_is_refused_and_cleared(tmp_path: Path, broker_url: str) -> None:
    """Issue 31, item 9: a node may publish with the retain flag on its own update and ack topics (the
    ACL cannot forbid the flag), and the broker replays the stored message to every coordinator that
    subscribes. Left there before the coordinator starts, a retained update (node-001's) and ack
    (node-000's) are refused as `retained`, and cleared: nothing is replayed to the next subscriber,
    and the run, the nodes' own updates included, goes as if they had never been sent."""
    cfg = base_config(nodes=3, rounds=1, deadline_s=10, policy={"min_nodes": 3})
    fed = Federation(tmp_path, broker_url, cfg)
    t = Topics(fed.federation)
    left = {
        t.update("node-001"): Message(
            kind=Kind.UPDATE, federation=fed.federation, round=0, sender="node-001",
            meta={"task": os.urandom(16), "num_samples": 10}, tensors={"model/w": np.zeros(3, np.float32)},
        ),
        t.ack("node-000"): Message(
            kind=Kind.ACK, federation=fed.federation, round=0, sender="node-000", meta={"task": os.urandom(16)}
        ),
    }  # fmt: skip
    async with raw_client(broker_url) as evil:
        for topic, message in left.items():
            await evil.publish(topic, bytes(encode(message)), qos=1, retain=True)
    fed.start_coordinator()
    fed.start_nodes("node-000", "node-001", "node-002")
    assert await asyncio.to_thread(fed.wait) == 0, fed.log("coordinator.log")
    summary, metrics = fed.summary(), fed.metrics()
    assert summary["bus"]["rejected"] == {"retained": 2}, summary["bus"]["rejected"]
    assert sorted(metrics[0]["accepted"]) == ["node-000", "node-001", "node-002"], metrics
    assert "clearing the retained message a client left on" in fed.log("coordinator.log")
    async with raw_client(broker_url) as later:
        await later.subscribe([(topic, 1) for topic in left])
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.5):
                await anext(aiter(later.messages))
