"""Fewer copies on paho-mqtt's paths for large messages, for the connections fedmq makes.

paho-mqtt 2.x reads a packet by `recv`-ing a new bytes object (of the packet's full remaining size,
so a fresh 1 MiB allocation per call) and appending it to the packet, then copies the payload three
more times (``struct.unpack`` of ``"!H{n}s"`` and ``"!{slen}s{n}s"``, the message id, the properties
slice); it sends by slicing the remaining bytearray, a copy after every partial write. On 1 MiB
chunks that was most of a receiver's CPU (``fedmq bench transport``). Here a packet is read with
``recv_into`` into one buffer of its size, a PUBLISH's payload is a memoryview on that buffer, and
an outgoing packet is sent through memoryview slices. Everything else is paho's own code.

`speed_up` swaps the class of one aiomqtt client's paho client for `FastClient`, only for paho
versions this was written against; on any other version it leaves paho as it is (and says so once
in the log), so an upgrade can only lose speed, never correctness. The zero-copy PUBLISH decoder
goes into paho's module only when an entry point calls `install` (`broker.tuning.tune_process`).
"""

from __future__ import annotations

import logging
import ssl
import struct
import threading
from typing import Any

import paho.mqtt
import paho.mqtt.client as mqtt
from paho.mqtt import _packet
from paho.mqtt.enums import MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties, VariableByteIntegers

logger = logging.getLogger(__name__)

SUPPORTED = ("2.1.", "2.2.")
"""paho-mqtt releases whose `_packet_read`, `_packet_queue` and `decode_publish` this mirrors."""

_PUBLISH = 0x30
_original_decode_publish = _packet.decode_publish
_local = threading.local()  # set while a FastClient handles a packet: only its PUBLISHes skip copies
_warned = False


def supported(version: str = paho.mqtt.__version__) -> bool:
    return version.startswith(SUPPORTED)


def decode_publish(header: int, packet: bytes | bytearray, protocol: MQTTProtocolVersion) -> _packet.PublishPacket:
    """paho's `decode_publish`, whose payload is a memoryview on `packet` when a FastClient reads it."""
    if not getattr(_local, "zero_copy", False):
        return _original_decode_publish(header, packet, protocol)
    try:
        view = memoryview(packet)
        (slen,) = struct.unpack_from("!H", view, 0)
        pos = 2 + slen
        if pos > len(view):
            raise _packet.MalformedPacket("topic overruns the packet")
        topic = bytes(view[2:pos])
        if protocol != MQTTProtocolVersion.MQTTv5 and len(topic) == 0:
            raise _packet.MalformedPacket("topic can't be empty in MQTTv3")
        qos = (header & 0x06) >> 1
        mid = 0
        if qos > 0:
            (mid,) = struct.unpack_from("!H", view, pos)
            pos += 2
        properties = None
        if protocol == MQTTProtocolVersion.MQTTv5:
            length, length_bytes = VariableByteIntegers.decode(bytes(view[pos : pos + 4]))
            end = pos + length_bytes + length
            if end > len(view):
                raise _packet.MalformedPacket("properties overrun the packet")
            properties = Properties(PacketTypes.PUBLISH)
            properties.unpack(bytes(view[pos:end]))  # small: copied, so paho's parsers get bytes
            pos = end
        return _packet.PublishPacket(
            dup=bool(header & 0x08),
            qos=qos,
            retain=bool(header & 0x01),
            topic=topic,
            mid=mid,
            properties=properties,
            payload=view[pos:],  # type: ignore[arg-type]
        )
    except (struct.error, ValueError, TypeError, IndexError) as exc:
        raise _packet.MalformedPacket(str(exc)) from exc


SCATTER_BYTES = 64 * 1024
"""PUBLISH payloads from this size on are sent from where they lie, after their header, not copied
behind it into one packet."""


class _Scatter:
    """An outgoing packet in two parts, the header and the payload: what paho's queue needs of a
    packet (its length, and its tail from a position after a partial write)."""

    __slots__ = ("body", "head", "pos")

    def __init__(self, head: bytes | bytearray, body: memoryview, pos: int = 0) -> None:
        self.head, self.body, self.pos = head, body, pos

    def __len__(self) -> int:
        return len(self.head) + len(self.body) - self.pos

    def __getitem__(self, item: slice) -> _Scatter:
        if not isinstance(item, slice) or item.stop is not None or item.step is not None:
            raise TypeError("a scattered packet only slices as packet[pos:]")
        return _Scatter(self.head, self.body, self.pos + (item.start or 0))

    def buffers(self) -> list[memoryview]:
        head = memoryview(self.head)
        if self.pos < len(head):
            return [head[self.pos :], self.body]
        return [self.body[self.pos - len(head) :]]


class FastClient(mqtt.Client):
    """paho's client with a copy-free receive and send of large packets (no new state)."""

    def _packet_queue(
        self, command: int, packet: bytes | bytearray, mid: int, qos: int, info: mqtt.MQTTMessageInfo | None = None
    ) -> MQTTErrorCode:
        # a memoryview: paho's `packet[pos:]` after a partial write is then a view, not a copy
        queued = packet if isinstance(packet, _Scatter) else memoryview(packet)
        return super()._packet_queue(command, queued, mid, qos, info)  # type: ignore[arg-type]

    def _send_publish(
        self,
        mid: int,
        topic: bytes,
        payload: bytes | bytearray = b"",
        qos: int = 0,
        retain: bool = False,
        dup: bool = False,
        info: mqtt.MQTTMessageInfo | None = None,
        properties: Properties | None = None,
    ) -> MQTTErrorCode:
        """paho's packet for a large payload, but the payload stays where it is: `_sock_send` sends
        header and payload with one sendmsg (TLS, which has no sendmsg, joins them)."""
        if len(payload) < SCATTER_BYTES or not isinstance(topic, bytes) or self._sock is None:
            return super()._send_publish(mid, topic, payload, qos, retain, dup, info, properties)
        packed_properties = b""
        if self._protocol == mqtt.MQTTv5:
            packed_properties = b"\x00" if properties is None else properties.pack()
        head = bytearray([_PUBLISH | ((dup & 0x1) << 3) | (qos << 1) | retain])
        remaining = 2 + len(topic) + (2 if qos > 0 else 0) + len(packed_properties) + len(payload)
        self._pack_remaining_length(head, remaining)
        self._pack_str16(head, topic)
        if qos > 0:
            head.extend(struct.pack("!H", mid))
        head.extend(packed_properties)
        self._easy_log(mqtt.MQTT_LOG_DEBUG, "Sending PUBLISH (d%d, q%d, r%d, m%d), '%s', ... (%d bytes)",
                       dup, qos, retain, mid, topic, len(payload))  # fmt: skip
        return self._packet_queue(_PUBLISH, _Scatter(head, memoryview(payload)), mid, qos, info)  # type: ignore[arg-type]

    def _sock_send(self, buf: Any) -> int:
        if not isinstance(buf, _Scatter):
            return super()._sock_send(buf)
        sock = self._sock
        if sock is None:
            raise ConnectionError("self._sock is None")
        if isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "sendmsg"):
            return super()._sock_send(b"".join(buf.buffers()))
        return int(sock.sendmsg(buf.buffers()))

    def _packet_read(self) -> MQTTErrorCode:
        sock = self._sock
        if sock is None or not hasattr(sock, "recv_into"):  # websockets: paho's own path
            return super()._packet_read()
        inp: Any = self._in_packet
        if inp["command"] == 0 or inp["have_remaining"] == 0:
            rc = self._read_fixed_header(inp)
            if rc is not None:
                return rc
        count = 100  # as paho: do not stay in this loop forever on a huge message
        while inp["to_process"] > 0:
            view = memoryview(inp["packet"])[inp["remaining_length"] - inp["to_process"] :]
            try:
                n = sock.recv_into(view, inp["to_process"])
            except (BlockingIOError, ssl.SSLWantReadError):
                return MQTTErrorCode.MQTT_ERR_AGAIN
            except ssl.SSLWantWriteError:
                self._call_socket_register_write()
                return MQTTErrorCode.MQTT_ERR_AGAIN
            except OSError as err:
                self._easy_log(mqtt.MQTT_LOG_ERR, "failed to receive on socket: %s", err)
                return MQTTErrorCode.MQTT_ERR_CONN_LOST
            finally:
                view.release()
            if n == 0:
                return MQTTErrorCode.MQTT_ERR_CONN_LOST
            inp["to_process"] -= n
            with self._msgtime_mutex:
                self._last_bytes_received = mqtt.time_func()
            count -= 1
            if count == 0:
                return MQTTErrorCode.MQTT_ERR_AGAIN
        inp["pos"] = 0
        _local.zero_copy = (inp["command"] & 0xF0) == _PUBLISH
        try:
            rc = self._packet_handle()
        except _packet.MalformedPacket as exc:
            self._easy_log(mqtt.MQTT_LOG_DEBUG, "Received malformed packet: %s", exc)
            rc = MQTTErrorCode.MQTT_ERR_PROTOCOL
        finally:
            _local.zero_copy = False
        self._in_packet = {
            "command": 0,
            "have_remaining": 0,
            "remaining_count": [],
            "remaining_mult": 1,
            "remaining_length": 0,
            "packet": bytearray(b""),
            "to_process": 0,
            "pos": 0,
        }
        with self._msgtime_mutex:
            self._last_bytes_received = mqtt.time_func()
        return rc

    def _read_fixed_header(self, inp: Any) -> MQTTErrorCode | None:
        """The command byte and the remaining length, as paho reads them; then one buffer of that size."""
        if inp["command"] == 0:
            try:
                command = self._sock_recv(1)
            except BlockingIOError:
                return MQTTErrorCode.MQTT_ERR_AGAIN
            except TimeoutError as err:
                self._easy_log(mqtt.MQTT_LOG_ERR, "timeout on socket: %s", err)
                return MQTTErrorCode.MQTT_ERR_CONN_LOST
            except OSError as err:
                self._easy_log(mqtt.MQTT_LOG_ERR, "failed to receive on socket: %s", err)
                return MQTTErrorCode.MQTT_ERR_CONN_LOST
            if len(command) == 0:
                return MQTTErrorCode.MQTT_ERR_CONN_LOST
            inp["command"] = command[0]
        if inp["have_remaining"] == 0:
            while True:
                try:
                    byte = self._sock_recv(1)
                except BlockingIOError:
                    return MQTTErrorCode.MQTT_ERR_AGAIN
                except OSError as err:
                    self._easy_log(mqtt.MQTT_LOG_ERR, "failed to receive on socket: %s", err)
                    return MQTTErrorCode.MQTT_ERR_CONN_LOST
                if len(byte) == 0:
                    return MQTTErrorCode.MQTT_ERR_CONN_LOST
                value = byte[0]
                inp["remaining_count"].append(value)
                if len(inp["remaining_count"]) > 4:  # at most 4 bytes of remaining length (MQTT)
                    return MQTTErrorCode.MQTT_ERR_PROTOCOL
                inp["remaining_length"] += (value & 127) * inp["remaining_mult"]
                inp["remaining_mult"] *= 128
                if (value & 128) == 0:
                    break
            inp["have_remaining"] = 1
            inp["to_process"] = inp["remaining_length"]
            inp["packet"] = bytearray(inp["remaining_length"])
        return None


def speed_up(client: Any) -> bool:
    """Give one aiomqtt client's paho client the copy-free paths; False (and paho's own) on other paho versions."""
    global _warned
    paho_client = getattr(client, "_client", None)
    if not isinstance(paho_client, mqtt.Client) or not supported():
        if not _warned:
            _warned = True
            logger.info("paho-mqtt %s: using its own receive path (fedmq's faster one is for 2.1 and 2.2)",
                        paho.mqtt.__version__)  # fmt: skip
        return False
    if type(paho_client) is mqtt.Client:
        paho_client.__class__ = FastClient
    return True


def install() -> bool:
    """Put `decode_publish` in paho's place, process-wide and idempotent; True if it is in place.

    An entry point's call (`broker.tuning.tune_process`), not an import's side effect: without it a
    FastClient still reads with ``recv_into`` and sends without copies, but each PUBLISH's payload is
    copied once more by paho's own decoder."""
    if not supported():
        return False
    _packet.decode_publish = decode_publish  # type: ignore[assignment]  # paho looks it up at each call
    return True


def installed() -> bool:
    return _packet.decode_publish is decode_publish  # type: ignore[comparison-overlap]
