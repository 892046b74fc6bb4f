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
from typing import Any, Literal

import paho.mqtt
import paho.mqtt.client as mqtt
from paho.mqtt import _packet
from paho.mqtt.enums import MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties, VariableByteIntegers
from paho.mqtt.reasoncodes import ReasonCode

logger = logging.getLogger(__name__)

SUPPORTED = ("2.1.", "2.2.")
"""paho-mqtt releases whose `_packet_read`, `_packet_queue` and `decode_publish` this mirrors."""

_PUBLISH = 0x30
_PROPERTIES: dict[bytes, Properties] = {}
"""Received PUBLISH properties by their bytes: a round's tasks all carry the same expiry, and building a
Properties costs more than decoding the rest of the packet. Shared, so read only (nothing writes them)."""
_PROPERTIES_KEPT = 256


def _publish_properties(packed: bytes) -> Properties:
    """The properties of a PUBLISH from their bytes (the length prefix included), parsed once."""
    properties = _PROPERTIES.get(packed)
    if properties is None:
        properties = Properties(PacketTypes.PUBLISH)
        properties.unpack(packed)
        if len(_PROPERTIES) >= _PROPERTIES_KEPT:
            _PROPERTIES.clear()
        _PROPERTIES[packed] = properties
    return properties


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
            properties = _publish_properties(bytes(view[pos:end]))  # small: copied, so paho's parsers get bytes
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


WRITE_BATCH = 256
"""Buffers one sendmsg carries at most (Linux takes 1,024)."""
WRITE_BATCH_BYTES = 4 * 2**20
READ_AHEAD = 4096
"""A connection's first read-ahead buffer: small, since a process may hold 10,000 connections."""
READ_AHEAD_MAX = 256 * 1024
"""The most it grows to, doubling each time a read fills it (a coordinator's one connection, busy)."""
READS_PER_CALL = 16
"""Socket reads in one call before the event loop gets its turn (whole packets read are handled first)."""
_NO_PUBACK_PROPERTIES = Properties(PacketTypes.PUBACK)
"""The properties paho hands on_publish for a written QoS 0 PUBLISH: none (read only)."""


class _ReadAhead:
    """Bytes read from the socket and not yet handled: `data[start:end]`."""

    __slots__ = ("data", "end", "start", "view")

    def __init__(self) -> None:
        self.data = bytearray(READ_AHEAD)
        self.view = memoryview(self.data)
        self.start = self.end = 0

    def fill(self, sock: Any) -> int:
        """Read into the free space, moving what is left to the front first (into a buffer twice the
        size when the last read filled it); bytes read (0: closed)."""
        size = self.end - self.start
        if self.end == len(self.data) and len(self.data) < READ_AHEAD_MAX:
            grown = bytearray(len(self.data) * 2)
            grown[:size] = self.data[self.start : self.end]
            self.view.release()
            self.data, self.view = grown, memoryview(grown)
            self.start, self.end = 0, size
        elif self.start == self.end:
            self.start = self.end = 0
        elif self.start:
            self.data[:size] = self.data[self.start : self.end]
            self.start, self.end = 0, size
        n = int(sock.recv_into(self.view[self.end :]))
        self.end += n
        return n

    def header(self) -> tuple[int, int, int] | Literal[False] | None:
        """(command, remaining length, where the packet's body starts) of the next packet; None when its
        fixed header is not all here; False for a remaining length of more than 4 bytes."""
        data, pos, end = self.data, self.start, self.end
        if end - pos < 2:
            return None
        command = data[pos]
        length, mult, i = 0, 1, pos + 1
        while True:
            if i >= end:
                return None
            byte = data[i]
            length += (byte & 127) * mult
            mult *= 128
            i += 1
            if not byte & 128:
                return command, length, i
            if i - pos > 4:
                return False


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

    def _packet_write(self) -> MQTTErrorCode:
        """paho's loop over the queued packets, but up to `WRITE_BATCH` of them leave in one sendmsg: at a
        thousand tasks and receipts a round, one system call each was a fifth of the coordinator's time."""
        sock = self._sock
        if sock is None or isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "sendmsg"):
            return super()._packet_write()
        queue = self._out_packet
        while queue:
            if queue[0]["command"] & 0xF0 == mqtt.DISCONNECT:
                return super()._packet_write()  # paho closes the connection after it: its own path
            batch: list[Any] = []
            buffers: list[Any] = []
            size = 0
            for packet in queue:
                if packet["command"] & 0xF0 == mqtt.DISCONNECT or len(buffers) >= WRITE_BATCH:
                    break
                rest = packet["packet"][packet["pos"] :]
                parts = rest.buffers() if isinstance(rest, _Scatter) else [rest]
                if batch and size + len(rest) > WRITE_BATCH_BYTES:
                    break
                batch.append(packet)
                buffers.extend(parts)
                size += len(rest)
            try:
                sent = int(sock.sendmsg(buffers))
            except BlockingIOError:
                return MQTTErrorCode.MQTT_ERR_AGAIN
            except OSError as err:
                self._easy_log(mqtt.MQTT_LOG_ERR, "failed to receive on socket: %s", err)
                return MQTTErrorCode.MQTT_ERR_CONN_LOST
            partial = False
            for packet in batch:
                step = min(sent, packet["to_process"])
                packet["to_process"] -= step
                packet["pos"] += step
                sent -= step
                if packet["to_process"]:
                    partial = True  # the socket took part of it: the rest when it is writable again
                    break
                queue.popleft()
                if packet["command"] & 0xF0 == _PUBLISH and packet["qos"] == 0:
                    self._published_qos0(packet)
            if partial:
                break
        with self._msgtime_mutex:
            self._last_msg_out = mqtt.time_func()
        return MQTTErrorCode.MQTT_ERR_SUCCESS

    def _published_qos0(self, packet: Any) -> None:
        """What paho does once a QoS 0 PUBLISH is written: on_publish (callback API 2), then its info."""
        with self._callback_mutex:
            on_publish = self.on_publish
        if on_publish:
            with self._in_callback_mutex:
                try:
                    on_publish(
                        self, self._userdata, packet["mid"], ReasonCode(PacketTypes.PUBACK), _NO_PUBACK_PROPERTIES
                    )  # type: ignore[call-arg]
                except Exception as err:
                    self._easy_log(mqtt.MQTT_LOG_ERR, "Caught exception in on_publish: %s", err)
                    if not self.suppress_exceptions:
                        raise
        packet["info"]._set_as_published()

    def _packet_read(self) -> MQTTErrorCode:
        sock = self._sock
        if sock is None or not hasattr(sock, "recv_into"):  # websockets: paho's own path
            return super()._packet_read()
        if not isinstance(sock, ssl.SSLSocket):
            return self._buffered_read(sock)
        inp: Any = self._in_packet
        if inp["command"] == 0 or inp["have_remaining"] == 0:
            rc = self._read_fixed_header(inp)
            if rc is not None:
                return rc
        count = 100  # as paho: do not stay in this loop forever on a huge message
        while inp["to_process"] > 0:
            rc = self._recv_into_packet(sock, inp)
            if rc is not None:
                return rc
            count -= 1
            if count == 0:
                return MQTTErrorCode.MQTT_ERR_AGAIN
        return self._handle_read_packet()

    def _recv_into_packet(self, sock: Any, inp: Any) -> MQTTErrorCode | None:
        """Read the rest of a packet straight into its own buffer: None once some bytes came, else the
        code to return (nothing there yet, the connection lost)."""
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
        return None

    def _buffered_read(self, sock: Any) -> MQTTErrorCode:
        """Plain sockets: read what has come in `READ_AHEAD` pieces and handle every whole packet in it,
        where paho's path takes three system calls a packet (the command byte, each length byte, the
        rest). A packet larger than what is buffered gets a buffer of its own, read into directly."""
        inp: Any = self._in_packet
        reads = 0
        while True:
            if self._sock is None:
                return MQTTErrorCode.MQTT_ERR_NO_CONN
            if inp["command"] != 0 and inp["to_process"] > 0:  # a large packet: straight into its buffer
                if reads >= READS_PER_CALL:  # the event loop's turn; the socket is still readable
                    return MQTTErrorCode.MQTT_ERR_SUCCESS
                rc = self._recv_into_packet(sock, inp)
                if rc is not None:
                    return rc
                reads += 1
                if inp["to_process"]:
                    continue
                rc = self._handle_read_packet()
                if rc:
                    return rc
                inp = self._in_packet
                continue
            rc = self._handle_buffered()  # whole packets already read
            if rc:
                return rc
            inp = self._in_packet
            if inp["command"] != 0:
                continue  # a large packet started in the buffer: read the rest into its own
            if reads >= READS_PER_CALL:  # every whole packet read is handled; the rest is still in the socket
                return MQTTErrorCode.MQTT_ERR_SUCCESS
            buffer = self._read_ahead
            if buffer is None:
                buffer = self._read_ahead = _ReadAhead()
            try:
                n = buffer.fill(sock)
            except BlockingIOError:
                return MQTTErrorCode.MQTT_ERR_AGAIN
            except OSError as err:
                self._easy_log(mqtt.MQTT_LOG_ERR, "failed to receive on socket: %s", err)
                return MQTTErrorCode.MQTT_ERR_CONN_LOST
            if n == 0:
                return MQTTErrorCode.MQTT_ERR_CONN_LOST
            reads += 1
            with self._msgtime_mutex:
                self._last_bytes_received = mqtt.time_func()

    _read_ahead: _ReadAhead | None = None

    def _sock_close(self) -> None:
        self._read_ahead = None  # bytes of a connection that is gone
        super()._sock_close()

    def _handle_buffered(self) -> MQTTErrorCode:
        """Handle each whole packet in the read-ahead buffer; a packet that runs past it moves into a
        buffer of its own (`_in_packet`), to be read into directly."""
        buffer = self._read_ahead
        while buffer is not None and self._sock is not None:
            header = buffer.header()
            if header is None:
                return MQTTErrorCode.MQTT_ERR_SUCCESS  # a partial fixed header: more bytes first
            if header is False:
                return MQTTErrorCode.MQTT_ERR_PROTOCOL
            command, length, start = header
            inp: Any = self._in_packet
            inp["command"], inp["remaining_length"], inp["have_remaining"] = command, length, 1
            available = buffer.end - start
            if available >= length:
                inp["packet"] = bytearray(buffer.data[start : start + length])
                inp["to_process"] = 0
                buffer.start = start + length
                rc = self._handle_read_packet()
                if rc:
                    return rc
                continue
            packet = bytearray(length)
            packet[:available] = buffer.data[start : buffer.end]
            inp["packet"], inp["to_process"] = packet, length - available
            buffer.start = buffer.end = 0
            return MQTTErrorCode.MQTT_ERR_SUCCESS
        return MQTTErrorCode.MQTT_ERR_SUCCESS

    def _handle_read_packet(self) -> MQTTErrorCode:
        """A whole packet is in `_in_packet`: paho handles it (PUBLISH payloads as views on it), then a fresh one."""
        inp: Any = self._in_packet
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
