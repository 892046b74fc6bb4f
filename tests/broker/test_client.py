"""The bus client against real brokers over TCP (the embedded amqtt and mosquitto)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import subprocess

import aiomqtt
import numpy as np
import pytest

from fedmq.broker import BusClient, BusConfig, BusError, Kind, Message, Topics, Will, encode
from fedmq.broker.servers.mosquitto import free_port, start_mosquitto
from tests.helpers import next_message, raw_client


def config(url: str, **overrides: object) -> BusConfig:
    return BusConfig.from_url(url, **overrides)


def update(fed: str, sender: str = "n1", **tensors: np.ndarray) -> Message:
    return Message(kind=Kind.UPDATE, federation=fed, round=1, sender=sender, meta={"k": 1}, tensors=tensors)


async def test_client_small_message_round_trip(
    broker_url: str, federation: str, request: pytest.FixtureRequest
) -> None:
    """A message published by one client reaches a subscriber with every field intact; MQTT v5 is used
    where the broker speaks it (mosquitto) and 3.1.1 where it does not (amqtt)."""
    t = Topics(federation)
    async with (
        BusClient(config(broker_url), client_id=f"{federation}-a", federation=federation) as a,
        BusClient(config(broker_url), client_id=f"{federation}-b", federation=federation) as b,
    ):
        await a.subscribe(t.all_updates)
        sent = update(federation, w=np.arange(10, dtype=np.float32))
        await b.publish(t.update("n1"), sent)
        got = await next_message(a)
        assert got.topic == t.update("n1")
        assert (got.message.kind, got.message.sender, got.message.meta) == (Kind.UPDATE, "n1", {"k": 1})
        assert got.message.message_id == sent.message_id
        assert np.array_equal(got.message.tensors["w"], np.arange(10, dtype=np.float32))
        assert a.protocol == {"embedded": "3.1.1", "mosquitto": "5"}[request.node.callspec.params["broker_url"]]


async def test_a_live_retained_publish_keeps_its_flag_where_asked_and_v5_allows(
    broker_url: str, federation: str, request: pytest.FixtureRequest
) -> None:
    """Issue 31, item 9: MQTT clears the retain flag of a message delivered at once, so a coordinator
    could tell a node's retained update only when the broker replayed it later. Subscribed
    `retain_as_published` (the coordinator's acks and updates), a v5 client sees the flag live too;
    over 3.1.1 (amqtt) it cannot, and the other subscriptions are as before. Both survive a
    reconnection (the subscriptions are restored with their options)."""
    t = Topics(federation)
    async with (
        BusClient(config(broker_url), client_id=f"{federation}-a", federation=federation) as a,
        BusClient(config(broker_url), client_id=f"{federation}-b", federation=federation) as b,
        BusClient(config(broker_url), client_id=f"{federation}-c", federation=federation) as c,
    ):
        await a.subscribe(t.all_updates, retain_as_published=True)
        await b.subscribe(t.all_updates)
        await c.publish(t.update("n1"), update(federation), retain=True)
        kept = (await next_message(a)).retained
        assert not (await next_message(b)).retained
        assert kept == (request.node.callspec.params["broker_url"] == "mosquitto")
        await c.publish_frame(t.update("n1"), b"", round=-1, retain=True)  # cleared: no message
        BusClient._drop_socket(a._client)  # a new connection, its subscription restored
        async with asyncio.timeout(30):
            while not (a.connected and a.stats.reconnects >= 1):
                await asyncio.sleep(0.05)
        await c.publish(t.update("n2"), update(federation, sender="n2"), retain=True)
        got = await next_message(a, timeout=30)
        assert got.topic == t.update("n2") and got.retained == kept
        await c.publish_frame(t.update("n2"), b"", round=-1, retain=True)


async def test_client_large_frame_is_chunked_and_arrives_intact(broker_url: str, federation: str) -> None:
    """A 20 MB model crosses the broker as concurrent chunks and decodes to the same bytes."""
    t = Topics(federation)
    cfg = config(broker_url, chunk_bytes=256 * 1024)
    weights = np.random.default_rng(0).standard_normal(5_000_000).astype(np.float32)
    async with (
        BusClient(cfg, client_id=f"{federation}-a", federation=federation) as a,
        BusClient(cfg, client_id=f"{federation}-b", federation=federation) as b,
    ):
        await a.subscribe(t.model(0))
        size = await b.publish(t.model(0), update(federation, w=weights))
        got = await next_message(a, timeout=60)
        assert size > 20_000_000 and got.size == size
        assert hashlib.sha256(got.message.tensors["w"].tobytes()).digest() == hashlib.sha256(weights.tobytes()).digest()
        assert b.stats.published == -(-size // cfg.chunk_bytes)
        assert a.stats.rejected == {}


async def test_client_never_publishes_over_the_broker_limit(broker_url: str, federation: str) -> None:
    """With a 80 KB limit every MQTT message on the wire stays under it, and the frame still arrives."""
    t = Topics(federation)
    cfg = config(broker_url, max_message_bytes=80_000, chunk_bytes=64 * 1024)
    async with raw_client(broker_url) as spy, BusClient(cfg, client_id=f"{federation}-b", federation=federation) as b:
        await spy.subscribe(f"{t.prefix}/#", qos=1)
        await b.publish(t.model(0), update(federation, w=np.ones(300_000, np.float32)))
        sizes = []
        async with asyncio.timeout(20):
            async for m in spy.messages:
                sizes.append(len(m.payload))  # type: ignore[arg-type]
                if sum(sizes) >= 1_200_000:
                    break
        assert max(sizes) <= 80_000 and len(sizes) >= 19


async def test_client_redelivered_message_is_dropped_once(broker_url: str, federation: str) -> None:
    """The same message id twice (a QoS 1 redelivery or a replay) reaches the consumer once."""
    t = Topics(federation)
    async with (
        BusClient(config(broker_url), client_id=f"{federation}-a", federation=federation) as a,
        BusClient(config(broker_url), client_id=f"{federation}-b", federation=federation) as b,
    ):
        await a.subscribe(t.all_updates)
        first = update(federation)
        await b.publish(t.update("n1"), first)
        await b.publish(t.update("n1"), first)
        await b.publish(t.update("n1"), update(federation))
        assert (await next_message(a)).message.message_id == first.message_id
        assert (await next_message(a)).message.message_id != first.message_id
        assert a.stats.duplicates == 1


async def test_client_bad_input_is_counted_and_the_client_goes_on(broker_url: str, federation: str) -> None:
    """Garbage, truncated, corrupted, wrong-version, wrong-federation and oversized payloads are rejected
    by reason; an empty one, MQTT's deletion of a retained message, is no message and no rejection."""
    t = Topics(federation)
    cfg = config(broker_url, max_message_bytes=200_000, chunk_bytes=65_536)
    good = bytes(encode(update(federation)))
    corrupted = good[:-1] + bytes([good[-1] ^ 0xFF])
    async with BusClient(cfg, client_id=f"{federation}-a", federation=federation) as a, raw_client(broker_url) as raw:
        await a.subscribe(t.all_updates)
        for payload in [
            b"not a frame at all",
            b"",
            b"FMQ\x02",
            corrupted,
            b"FMQ\x09" + good[4:],
            bytes(encode(update("another-federation"))),
            b"\x00" * 300_000,
        ]:
            await raw.publish(t.update("n1"), payload, qos=1)
        await raw.publish(t.update("n1"), good, qos=1)
        got = await next_message(a)
        assert got.message.sender == "n1" and got.message.federation == federation
        assert dict(a.stats.rejected) == {
            "bad-magic": 1, "truncated": 1, "checksum": 1, "wrong-version": 1, "wrong-federation": 1, "oversized": 1,
        }  # fmt: skip


def issue31_frames(federation: str) -> dict[str, bytes]:
    """Frames of a few hundred bytes that each killed a daemon's bus client before issue 31 (item 0)."""
    import msgpack

    from fedmq.broker.codec import ALIGN, FORMAT_VERSION, PREFIX, PREFIX_BYTES, checksum

    def frame(header: dict[object, object]) -> bytes:
        packed = msgpack.packb(header, use_bin_type=True)
        start = (PREFIX_BYTES + len(packed) + ALIGN - 1) // ALIGN * ALIGN
        buf = bytearray(start)
        buf[PREFIX_BYTES : PREFIX_BYTES + len(packed)] = packed
        PREFIX.pack_into(buf, 0, b"FMQ", FORMAT_VERSION, len(packed), checksum(buf))
        return bytes(buf)

    base: dict[object, object] = {
        "kind": "update", "fed": federation, "round": 1, "sender": "n1", "id": b"\x01" * 16, "ts": 1.0,
        "meta": {}, "tensors": [], "body": 0,
    }  # fmt: skip
    deep: object = 1
    for _ in range(600):
        deep = [deep]
    return {
        "zero-size-huge-dim": frame(base | {"tensors": [["w", "float32", [0, 2**63], 0, 0]]}),
        "bytes-header-key": frame(base | {b"kind": "update"}),
        "deep-meta": frame(base | {"meta": {"x": deep}, "id": b"\x02" * 16}),
    }


async def test_client_issue31_frames_are_rejected_and_the_client_goes_on(broker_url: str, federation: str) -> None:
    """Issue 31: each of these frames made `decode` raise something other than CodecError, which
    ended the client's connection loop (and the daemon with it). Now each is a counted rejection."""
    t = Topics(federation)
    async with (
        BusClient(config(broker_url), client_id=f"{federation}-a", federation=federation) as a,
        raw_client(broker_url) as raw,
    ):
        await a.subscribe(t.all_updates)
        for payload in issue31_frames(federation).values():
            await raw.publish(t.update("n1"), payload, qos=1)
        await raw.publish(t.update("n1"), bytes(encode(update(federation))), qos=1)
        got = await next_message(a)
        assert got.message.sender == "n1"
        assert dict(a.stats.rejected) == {"bad-tensor": 1, "bad-header": 2}


async def test_client_an_unforeseen_error_on_one_message_is_counted_not_fatal(
    broker_url: str, federation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever a message trips in the receiving path (here a decoder that raises RuntimeError for one
    payload) is counted as internal-error and logged; the next message still arrives."""
    import fedmq.broker.client as client_module

    real = client_module.decode

    def flaky(data: object, *, verify: bool = True) -> Message:
        if bytes(data)[-4:] == b"boom":  # type: ignore[call-overload]
            raise RuntimeError("a bug in a check")
        return real(data, verify=verify)  # type: ignore[arg-type]

    monkeypatch.setattr(client_module, "decode", flaky)
    t = Topics(federation)
    async with (
        BusClient(config(broker_url), client_id=f"{federation}-a", federation=federation) as a,
        raw_client(broker_url) as raw,
    ):
        await a.subscribe(t.all_updates)
        await raw.publish(t.update("n1"), b"FMQ\x02boom", qos=1)
        await raw.publish(t.update("n1"), bytes(encode(update(federation))), qos=1)
        got = await next_message(a)
        assert got.message.sender == "n1" and a.stats.rejected == {"internal-error": 1}
        assert a.connected


async def test_client_that_dies_fires_its_will(
    broker_url: str, federation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bus client whose connection loop fails (here: its message fence itself raising) drops the
    connection without a DISCONNECT, so the broker publishes its will: the daemon's retained status
    goes offline with it instead of staying `online` (issue 31)."""
    t = Topics(federation)
    offline = Message(kind=Kind.NODE_STATUS, federation=federation, round=-1, sender="n1", meta={"state": "offline"})
    online = Message(kind=Kind.NODE_STATUS, federation=federation, round=-1, sender="n1", meta={"state": "online"})

    async def broken(raw: object) -> None:
        raise RuntimeError("the client dies of this")

    async with BusClient(config(broker_url), client_id=f"{federation}-c", federation=federation) as watcher:
        await watcher.subscribe(t.all_node_status)
        node = _with_will(broker_url, federation, offline)
        async with node, raw_client(broker_url) as raw:
            await node.subscribe(t.task("n1"))
            await node.publish(t.node_status("n1"), online, retain=True)
            assert (await next_message(watcher)).message.meta == {"state": "online"}
            monkeypatch.setattr(node, "_on_message", broken)  # this client only, not the watcher
            await raw.publish(t.task("n1"), b"anything", qos=1)
            got = await next_message(watcher)
            assert got.topic == t.node_status("n1") and got.message.meta == {"state": "offline"}
            with pytest.raises(BusError, match="the client dies of this"):
                await next_message(node)


def _with_will(broker_url: str, federation: str, will: Message) -> BusClient:
    """Node n1's client, whose will publishes `will` on its status topic."""
    topic = Topics(federation).node_status("n1")
    return BusClient(config(broker_url), client_id=f"{federation}-n1", federation=federation, will=Will(topic, will))


async def test_client_incomplete_transfer_is_abandoned(broker_url: str, federation: str) -> None:
    """Chunks of a transfer that never completes are dropped at the transfer timeout and counted."""
    from fedmq.broker.chunking import split

    t = Topics(federation)
    cfg = config(broker_url, transfer_timeout_s=0.5)
    frame = encode(update(federation, w=np.ones(100_000, np.float32)))
    chunks = list(split(frame, chunk_bytes=65_536, federation=federation, sender="n1", round=1))
    async with BusClient(cfg, client_id=f"{federation}-a", federation=federation) as a, raw_client(broker_url) as raw:
        await a.subscribe(t.all_updates)
        for chunk in chunks[:-1]:
            await raw.publish(t.update("n1"), bytes(encode(chunk)), qos=1)
        async with asyncio.timeout(10):
            while a.stats.rejected.get("transfer-timeout", 0) == 0:
                await asyncio.sleep(0.05)
        assert a._reassembler.in_flight_bytes == 0


async def test_client_will_is_published_when_a_client_vanishes(broker_url: str, federation: str) -> None:
    """A client that drops its connection without a goodbye shows offline through its last will."""
    t = Topics(federation)
    offline = Message(kind=Kind.NODE_STATUS, federation=federation, round=-1, sender="n1", meta={"state": "offline"})
    async with BusClient(config(broker_url), client_id=f"{federation}-c", federation=federation) as watcher:
        await watcher.subscribe(t.all_node_status)
        node = _with_will(broker_url, federation, offline)
        async with node:
            node.abort()
            got = await next_message(watcher)
        assert got.topic == t.node_status("n1") and got.message.meta == {"state": "offline"}


async def test_client_connect_to_nothing_fails_with_advice() -> None:
    """No broker on the port: a BusError that says how to start one, within the connect timeout."""
    cfg = BusConfig(port=free_port(), connect_timeout_s=1.5)
    with pytest.raises(BusError, match="fedmq broker"):
        async with BusClient(cfg, client_id="lonely", federation="f"):
            pass


def _restartable_mosquitto(slow_s: float) -> tuple[int, subprocess.Popen[bytes], BusConfig, BusConfig]:
    """A mosquitto of a test's own (to restart), a quick client's config and a slow one's: the publisher
    retries later than the subscriber, so that the restarted broker (which keeps no sessions) has the
    subscription back before the held publish goes out."""
    from fedmq.broker.servers.mosquitto import find_mosquitto

    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    port = free_port()
    proc = start_mosquitto(port)
    cfg = BusConfig(port=port, reconnect_initial_s=0.1, reconnect_max_s=0.5, operation_timeout_s=30)
    return port, proc, cfg, cfg.with_(reconnect_initial_s=slow_s, reconnect_max_s=slow_s)


async def test_client_reconnects_and_resubscribes_after_broker_restart(federation: str) -> None:
    """mosquitto restarts on the same port: the client reconnects, resubscribes, and a publish made
    during the outage completes once the broker is back."""
    port, proc, cfg, slow = _restartable_mosquitto(slow_s=2.0)
    t = Topics(federation)
    try:
        async with (
            BusClient(cfg, client_id=f"{federation}-a", federation=federation) as a,
            BusClient(slow, client_id=f"{federation}-b", federation=federation) as b,
        ):
            await a.subscribe(t.all_updates)
            proc.terminate()
            proc.wait(10)
            pending = asyncio.create_task(b.publish(t.update("n1"), update(federation)))
            await asyncio.sleep(0.5)
            assert not pending.done()
            proc = start_mosquitto(port)
            for _ in range(200):
                if a.connected and a.stats.reconnects >= 1:
                    break
                await asyncio.sleep(0.05)
            await asyncio.wait_for(pending, 20)
            got = await next_message(a, timeout=20)
            assert got.message.sender == "n1"
            assert a.stats.reconnects >= 1 and b.stats.reconnects >= 1
    finally:
        proc.terminate()
        proc.wait(10)


def _mosquitto_with(extra: str) -> tuple[subprocess.Popen[bytes], int]:
    from fedmq.broker.servers.mosquitto import find_mosquitto, render_config

    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    import tempfile
    from pathlib import Path

    port = free_port()
    conf = Path(tempfile.mkdtemp(prefix="fedmq-test-")) / "mosquitto.conf"
    conf.write_text(render_config(port=port) + extra)
    return start_mosquitto(port, config_file=conf), port


async def test_client_chunks_below_the_maximum_packet_the_broker_announces(federation: str) -> None:
    """mosquitto with max_packet_size 64 KiB announces it in its CONNACK (MQTT v5): a client configured
    for 1 MiB chunks sends a 400 KB frame in chunks that fit, instead of being disconnected."""
    proc, port = _mosquitto_with("max_packet_size 65536\n")
    t = Topics(federation)
    cfg = BusConfig(port=port)
    try:
        async with (
            BusClient(cfg, client_id=f"{federation}-a", federation=federation) as a,
            BusClient(cfg, client_id=f"{federation}-b", federation=federation) as b,
        ):
            assert b.protocol == "5" and b.max_message_bytes == 65536 and b.chunk_bytes < 65536 - 1024
            await a.subscribe(t.all_updates)
            sent = update(federation, w=np.arange(100_000, dtype=np.float32))
            assert await b.publish(t.update("n1"), sent) > 4 * 65536
            got = await next_message(a, timeout=10)
            assert np.array_equal(got.message.tensors["w"], sent.tensors["w"])
    finally:
        proc.terminate()
        proc.wait(10)


async def test_a_client_back_from_offline_gets_its_session_but_not_the_expired_messages(federation: str) -> None:
    """MQTT v5 session expiry and message expiry: what was published to a node while it was away
    arrives when it reconnects under its id, except what expired meanwhile (a task whose deadline passed)."""
    proc, port = _mosquitto_with("")
    t = Topics(federation)
    cfg = BusConfig(port=port)
    try:
        node = BusClient(cfg, client_id=f"{federation}-node", federation=federation)
        async with node:
            await node.subscribe(t.task("n1"))
        async with BusClient(cfg, client_id=f"{federation}-coordinator", federation=federation) as coordinator:
            stale = Message(kind=Kind.TASK, federation=federation, round=1, sender="coordinator", meta={"n": 1})
            fresh = Message(kind=Kind.TASK, federation=federation, round=2, sender="coordinator", meta={"n": 2})
            await coordinator.publish(t.task("n1"), stale, expiry_s=1)
            await coordinator.publish(t.task("n1"), fresh, expiry_s=60)
        await asyncio.sleep(2.2)
        async with node:  # the same client id: the broker kept the session and queued the tasks
            got = await next_message(node, timeout=5)
            assert got.message.round == 2
            with pytest.raises(TimeoutError):
                await next_message(node, timeout=1)
    finally:
        proc.terminate()
        proc.wait(10)


async def test_publish_many_sends_one_frame_to_every_topic_and_waits_for_their_acks(
    broker_url: str, federation: str
) -> None:
    """300 topics, one frame (more than paho's 64 in flight): the call returns once the broker has
    acknowledged all. The frame carries one message id, so a client subscribed to all 300 topics takes
    it once and drops the rest as duplicates, while each node's own client (one topic) gets its copy.
    A chunked frame takes the general path."""
    t = Topics(federation)
    topics = [t.task(f"n{i:03d}") for i in range(300)]
    own = [0, 150, 299]
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(
            BusClient(config(broker_url), client_id=f"{federation}-a", federation=federation)
        )
        b = await stack.enter_async_context(
            BusClient(config(broker_url, chunk_bytes=4096), client_id=f"{federation}-b", federation=federation)
        )
        nodes = [
            await stack.enter_async_context(BusClient(config(broker_url), client_id=f"{federation}-n{i}", federation=federation))
            for i in own
        ]  # fmt: skip
        await a.subscribe(f"fedmq/{federation}/nodes/+/task")
        for node, i in zip(nodes, own, strict=True):
            await node.subscribe(topics[i])
        frame = encode(update(federation, "coordinator", w=np.arange(8, dtype=np.float32)))
        assert await b.publish_many(topics, frame, round=1) == []
        assert b.stats.published == 300 and b.stats.bytes_out == 300 * len(frame)
        for node, i in zip(nodes, own, strict=True):
            assert (await next_message(node, timeout=20)).topic == topics[i]
        assert (await next_message(a, timeout=20)).topic in topics
        for _ in range(200):
            if a.stats.duplicates == 299:
                break
            await asyncio.sleep(0.05)
        assert a.stats.received == 300 and a.stats.duplicates == 299
        big = encode(update(federation, "coordinator", w=np.zeros(5000, np.float32)))  # 20 KB: 5 chunks
        assert await b.publish_many([topics[i] for i in own], big, round=2) == []
        for node in nodes:
            assert (await next_message(node, timeout=20)).size == len(big)


async def test_publish_many_resends_what_a_lost_connection_left_unacknowledged(federation: str) -> None:
    """The broker restarts while a batch waits: what it had not acknowledged goes out again on the
    next connection, and the subscriber receives the frame."""
    port, proc, cfg, slow = _restartable_mosquitto(slow_s=1.5)
    t = Topics(federation)
    topics = [t.task(f"n{i:03d}") for i in range(200)]
    try:
        async with (
            BusClient(cfg, client_id=f"{federation}-a", federation=federation) as a,
            BusClient(slow, client_id=f"{federation}-b", federation=federation) as b,
        ):
            await a.subscribe(topics[-1])
            proc.terminate()
            proc.wait(10)
            frame = encode(update(federation, "coordinator"))
            pending = asyncio.create_task(b.publish_many(topics, frame, round=1))
            await asyncio.sleep(0.5)
            assert not pending.done()
            proc = start_mosquitto(port)
            assert await asyncio.wait_for(pending, 25) == []
            assert (await next_message(a, timeout=20)).topic == topics[-1]
            assert b.stats.published == 200 and b.stats.reconnects >= 1
    finally:
        proc.terminate()
        proc.wait(10)


async def test_a_connecting_client_gets_only_its_own_subscriptions_retained_messages(
    broker_url: str, federation: str
) -> None:
    """amqtt 0.12 sent a newly connected client the retained messages of every topic filter any
    session had subscribed to, not only its own (a retained node status reached a coordinator that
    subscribed to updates only). Client a holds a subscription to a retained topic; client b, which
    subscribes elsewhere, must get nothing from it, and gets it once it subscribes itself."""
    held, elsewhere = f"fedmq/{federation}/nodes/n1/status", f"fedmq/{federation}/updates/+"
    async with raw_client(broker_url) as a:
        await a.subscribe(held, qos=1)
        await a.publish(held, b"retained status", qos=1, retain=True)
        await _raw_next(a)  # a's own copy: the broker holds it now
        try:
            async with raw_client(broker_url) as b:
                await b.subscribe(elsewhere, qos=1)
                with pytest.raises(TimeoutError):
                    await _raw_next(b, timeout=1.0)
                await b.subscribe(held, qos=1)
                message = await _raw_next(b)
                assert message.topic.value == held and message.retain
        finally:
            await a.publish(held, b"", qos=1, retain=True)  # leave nothing retained


async def _raw_next(client: aiomqtt.Client, timeout: float = 10.0) -> aiomqtt.Message:
    async with asyncio.timeout(timeout):
        return await anext(aiter(client.messages))
