"""The copy-free paho paths: the same packets decoded as paho decodes them, and large messages intact
through real brokers (every other bus test goes through these paths too)."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt import _packet
from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from fedmq.broker import BusClient, BusConfig, Kind, Message, Topics, paho_fast
from tests.helpers import next_message

V311, V5 = MQTTProtocolVersion.MQTTv311, MQTTProtocolVersion.MQTTv5


def publish_body(topic: bytes, payload: bytes, *, qos: int, v5: bool, props: Properties | None = None) -> bytes:
    """A PUBLISH packet after its fixed header, built by hand as the MQTT spec lays it out."""
    body = struct.pack("!H", len(topic)) + topic
    if qos:
        body += struct.pack("!H", 4242)
    if v5:
        body += (props or Properties(PacketTypes.PUBLISH)).pack()
    return body + payload


def decode_both(header: int, body: bytes, protocol: MQTTProtocolVersion) -> tuple[object, object]:
    paho_fast._local.zero_copy = True
    try:
        fast = paho_fast.decode_publish(header, bytearray(body), protocol)
    finally:
        paho_fast._local.zero_copy = False
    return fast, paho_fast._original_decode_publish(header, bytearray(body), protocol)


@pytest.mark.parametrize("protocol", [V311, V5])
@pytest.mark.parametrize("qos", [0, 1])
def test_decode_publish_matches_paho_and_does_not_copy_the_payload(protocol: MQTTProtocolVersion, qos: int) -> None:
    props = Properties(PacketTypes.PUBLISH)
    props.MessageExpiryInterval = 30
    props.UserProperty = ("key", "välue")  # a string property: paho's parser needs bytes, not a view
    payload = bytes(range(256)) * 40
    body = publish_body(b"fedmq/t/model/3", payload, qos=qos, v5=protocol == V5, props=props)
    header = 0x30 | (qos << 1) | 0x01 | 0x08
    fast, slow = decode_both(header, body, protocol)
    assert isinstance(fast.payload, memoryview) and bytes(fast.payload) == slow.payload == payload
    for field in ("dup", "qos", "retain", "topic", "mid"):
        assert getattr(fast, field) == getattr(slow, field), field
    if protocol == V5:
        assert fast.properties.MessageExpiryInterval == 30
        assert fast.properties.UserProperty == slow.properties.UserProperty == [("key", "välue")]


def test_decode_publish_is_paho_s_own_outside_a_fast_client() -> None:
    """Another paho client in the same process gets paho's decoding (bytes payloads), untouched."""
    body = publish_body(b"a/b", b"xyz", qos=0, v5=False)
    assert paho_fast.decode_publish(0x30, bytearray(body), V311).payload == b"xyz"
    assert isinstance(paho_fast.decode_publish(0x30, bytearray(body), V311).payload, bytes)


@pytest.mark.parametrize(
    ("body", "protocol"),
    [
        (b"\x00", V311),  # no room for the topic length
        (b"\x00\x09abc", V311),  # the topic runs past the end
        (b"\x00\x00payload", V311),  # an empty topic in 3.1.1
        (b"\x00\x01a\x7f", V5),  # properties longer than the packet
    ],
)
def test_decode_publish_malformed_raises_malformed_packet(body: bytes, protocol: MQTTProtocolVersion) -> None:
    paho_fast._local.zero_copy = True
    try:
        with pytest.raises(_packet.MalformedPacket):
            paho_fast.decode_publish(0x30, bytearray(body), protocol)
    finally:
        paho_fast._local.zero_copy = False


def test_speed_up_only_on_the_paho_versions_it_mirrors(monkeypatch: pytest.MonkeyPatch) -> None:
    class Holder:
        def __init__(self) -> None:
            self._client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)

    assert paho_fast.supported("2.2.0") and paho_fast.supported("2.1.3")
    assert not paho_fast.supported("2.3.0") and not paho_fast.supported("3.0.0")
    holder = Holder()
    assert paho_fast.speed_up(holder) is paho_fast.supported()
    assert type(holder._client) is (paho_fast.FastClient if paho_fast.supported() else mqtt.Client)
    monkeypatch.setattr(paho_fast, "supported", lambda version="": False)
    other = Holder()
    assert paho_fast.speed_up(other) is False and type(other._client) is mqtt.Client


async def test_one_large_unchunked_message_arrives_intact(broker_url: str, federation: str) -> None:
    """A 6 MB frame sent as one MQTT message (chunking off) is read over many recv_into calls and
    decodes to the same bytes; and a chunked one too, reassembled without a second checksum pass."""
    t = Topics(federation)
    weights = np.random.default_rng(1).standard_normal(1_500_000).astype(np.float32)
    digest = hashlib.sha256(weights.tobytes()).digest()
    for chunk_bytes in (16 * 2**20, 2**18):
        cfg = BusConfig.from_url(broker_url, chunk_bytes=chunk_bytes)
        async with (
            BusClient(cfg, client_id=f"{federation}-rx-{chunk_bytes}", federation=federation) as rx,
            BusClient(cfg, client_id=f"{federation}-tx-{chunk_bytes}", federation=federation) as tx,
        ):
            await rx.subscribe(t.model(0))
            sent = Message(
                kind=Kind.MODEL, federation=federation, round=0, sender="coordinator", tensors={"w": weights}
            )
            size = await tx.publish(t.model(0), sent)
            got = await next_message(rx, timeout=60)
            assert got.size == size and got.message.message_id == sent.message_id
            assert hashlib.sha256(got.message.tensors["w"].tobytes()).digest() == digest
            assert rx.stats.rejected == {}
            assert tx.stats.published == (1 if chunk_bytes > size else -(-size // chunk_bytes))


def test_scatter_packet_slices_across_its_two_parts() -> None:
    packet = paho_fast._Scatter(b"HEAD", memoryview(b"payload"))
    assert len(packet) == 11 and b"".join(packet.buffers()) == b"HEADpayload"
    assert b"".join(packet[2:].buffers()) == b"ADpayload" and len(packet[2:]) == 9
    assert b"".join(packet[2:][3:].buffers()) == b"ayload" and len(packet[5:]) == 6
    with pytest.raises(TypeError):
        packet[1:3]


@pytest.mark.parametrize("protocol", [mqtt.MQTTv311, mqtt.MQTTv5])
@pytest.mark.parametrize("qos", [0, 1])
def test_a_large_publish_goes_out_as_the_same_bytes_paho_sends(protocol: int, qos: int) -> None:
    """FastClient sends header and payload from where they lie (sendmsg); the bytes on the wire are
    exactly paho's own packet, properties and message id included."""
    import socket

    props = Properties(PacketTypes.PUBLISH)
    props.MessageExpiryInterval = 30
    payload = bytes(np.random.default_rng(2).integers(0, 256, paho_fast.SCATTER_BYTES + 123, dtype=np.uint8))
    wires = []
    for cls in (mqtt.Client, paho_fast.FastClient):
        client = cls(mqtt.CallbackAPIVersion.VERSION2, protocol=protocol)
        a, b = socket.socketpair()
        with a, b:
            a.setblocking(False)
            b.settimeout(5)
            client._sock = a
            properties = props if protocol == mqtt.MQTTv5 else None
            info = mqtt.MQTTMessageInfo(7)
            assert client._send_publish(7, b"fedmq/f/model/1", payload, qos, False, False, info, properties) == 0
            wire = bytearray()
            while len(wire) < len(payload):
                wire += b.recv(1 << 20)
            client._sock = None
        wires.append(bytes(wire))
    assert wires[0] == wires[1]


def _fast_client_on(sock: object) -> paho_fast.FastClient:
    """A FastClient reading from and writing to `sock` (one end of a socket pair), as if connected."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.__class__ = paho_fast.FastClient
    client._sock = sock  # type: ignore[assignment]
    return client  # type: ignore[return-value]


def _frame(command: int, body: bytes) -> bytes:
    """An MQTT packet: its command byte, its remaining length (1 to 4 bytes), `body`."""
    length, out = len(body), bytearray([command])
    while True:
        byte, length = length % 128, length // 128
        out.append(byte | (128 if length else 0))
        if not length:
            return bytes(out) + body


@pytest.mark.parametrize("piece", [1, 7, 1000, 10**6])
def test_buffered_read_hands_paho_every_packet_whole_however_the_bytes_arrive(piece: int) -> None:
    """Small packets many to a read, one split across reads, one larger than the read-ahead buffer
    (read into its own), an empty one: paho handles each once, whole and in order, whatever size the
    bytes come in (a thread sends them `piece` bytes at a time)."""
    import socket
    import threading
    import time

    a, b = socket.socketpair()
    a.setblocking(False)
    client = _fast_client_on(a)
    seen: list[tuple[int, bytes]] = []

    def handle() -> mqtt.MQTTErrorCode:
        seen.append((client._in_packet["command"], bytes(client._in_packet["packet"])))
        return mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS

    client._packet_handle = handle  # type: ignore[method-assign]
    packets = [(0x40, struct.pack("!H", i)) for i in range(500)]  # PUBACKs
    packets += [(0x32, b"x" * 70_000), (0xD0, b""), (0x32, bytes(range(256)) * 2000), (0x40, b"\x00\x01")]
    stream = b"".join(_frame(c, body) for c, body in packets)
    sender = threading.Thread(target=lambda: [b.sendall(stream[i : i + piece]) for i in range(0, len(stream), piece)])
    sender.start()
    deadline = time.monotonic() + 60
    while len(seen) < len(packets) and time.monotonic() < deadline:
        assert client._packet_read() in (mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS, mqtt.MQTTErrorCode.MQTT_ERR_AGAIN)
    sender.join()
    assert seen == packets
    assert client._packet_read() == mqtt.MQTTErrorCode.MQTT_ERR_AGAIN  # nothing left, nothing held back
    a.close()
    b.close()


def test_buffered_read_refuses_a_remaining_length_of_five_bytes() -> None:
    import socket

    a, b = socket.socketpair()
    a.setblocking(False)
    client = _fast_client_on(a)
    b.send(bytes([0x30, 0xFF, 0xFF, 0xFF, 0xFF, 0x7F]))
    assert client._packet_read() == mqtt.MQTTErrorCode.MQTT_ERR_PROTOCOL
    a.close()
    b.close()


def test_queued_packets_leave_in_one_write_in_order_and_qos0_publishes_count_as_sent() -> None:
    """Forty packets queued (QoS 1 and QoS 0 PUBLISHes, a large scattered one among them) go out in one
    sendmsg, in order, byte for byte; each QoS 0 PUBLISH then calls on_publish and is marked published."""
    import socket

    a, b = socket.socketpair()
    client = _fast_client_on(a)
    client._protocol = mqtt.MQTTv5
    client.on_socket_register_write = lambda c, u, sock: None  # an event loop writes later, as aiomqtt's does
    published: list[int] = []
    client.on_publish = lambda c, u, mid, rc, props: published.append(mid)
    expected, infos = b"", []
    for i in range(40):
        payload = bytes([i]) * (100_000 if i == 20 else 10)
        qos = i % 2
        info = mqtt.MQTTMessageInfo(i + 1)
        infos.append((qos, info))
        client._send_publish(i + 1, b"t/%d" % i, payload, qos, False, False, info, None)
    for packet in client._out_packet:
        rest = packet["packet"]
        expected += b"".join(bytes(x) for x in rest.buffers()) if isinstance(rest, paho_fast._Scatter) else bytes(rest)
    calls: list[int] = []
    real = a.sendmsg
    counting = {"sendmsg": lambda self, bufs: calls.append(len(bufs)) or real(bufs), "close": lambda self: None}
    client._sock = type("S", (), counting)()  # type: ignore[assignment]
    assert client._packet_write() == mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
    got = b""
    while len(got) < len(expected):
        got += b.recv(1 << 20)
    assert got == expected and len(calls) == 1 and not client._out_packet
    assert published == [i + 1 for i in range(40) if i % 2 == 0]
    assert all(info.is_published() == (qos == 0) for qos, info in infos)
    a.close()
    b.close()


def test_the_read_ahead_buffer_starts_small_and_grows_while_reads_fill_it() -> None:
    """A connection's buffer starts at READ_AHEAD bytes (10,000 of them in one process must stay
    small) and doubles, up to READ_AHEAD_MAX, each time a read fills it: 5,000 PUBACKs sent at once
    are read in a few large pieces, every one handled."""
    import socket

    a, b = socket.socketpair()
    a.setblocking(False)
    client = _fast_client_on(a)
    seen: list[bytes] = []
    client._packet_handle = lambda: (
        seen.append(bytes(client._in_packet["packet"])) or mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
    )  # type: ignore[method-assign]
    b.sendall(b"".join(_frame(0x40, struct.pack("!H", i % 65536)) for i in range(5000)))
    while len(seen) < 5000:
        assert client._packet_read() in (mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS, mqtt.MQTTErrorCode.MQTT_ERR_AGAIN)
    assert seen == [struct.pack("!H", i) for i in range(5000)]
    assert paho_fast.READ_AHEAD < len(client._read_ahead.data) <= paho_fast.READ_AHEAD_MAX
    a.close()
    b.close()
