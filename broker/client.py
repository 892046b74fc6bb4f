"""An asyncio MQTT client for fedmq frames: chunking, deduplication, validation and reconnection.

One `BusClient` is one MQTT connection with one identity. It keeps its subscriptions across
reconnects, publishes frames too large for one message as concurrent chunks, reassembles incoming
chunks, drops redelivered messages by id, and turns every malformed input into a counted, logged
rejection instead of an exception in the caller's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import ssl
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import aiomqtt
import paho.mqtt.client as mqtt
from aiomqtt.exceptions import MqttConnectError
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from fedmq.broker import paho_fast
from fedmq.broker.chunking import Reassembler, process_budget, split
from fedmq.broker.codec import decode, encode
from fedmq.broker.config import MQTT_MAX_PACKET, PUBLISH_OVERHEAD, BusConfig
from fedmq.broker.errors import BusError, CodecError, CredentialsError, MessageTooLarge
from fedmq.broker.message import Kind, Message, new_message_id
from fedmq.broker.throttle import LogThrottle

Frame = bytes | bytearray
"""An encoded frame, as the publish calls take it."""

logger = logging.getLogger(__name__)

_SESSION_EXPIRY_S = 3600
# paho's MQTT_ERR_NO_CONN and MQTT_ERR_CONN_LOST: the call may succeed on the next connection
_CONNECTION_LOST_CODES = (4, 7)


_TLS_FAILURES = ("CERTIFICATE_VERIFY_FAILED", "WRONG_VERSION_NUMBER", "Hostname mismatch", "TLSV1_ALERT")
"""Marks of a TLS handshake that failed: retrying cannot help, so the first connection fails fast."""
_AUTH_REFUSED = {4, 5, 134, 135}
"""CONNACK codes for a bad user name or password and not authorised (MQTT 3.1.1, then v5)."""


def _reason_code(rc: Any) -> int:
    """A CONNACK's return code as a number, whether paho gives an int or a ReasonCode."""
    return int(getattr(rc, "value", rc) or 0)


def tls_context(config: BusConfig) -> ssl.SSLContext | None:
    """The TLS context of an ``mqtts://`` connection: the broker's certificate must chain to
    `config.ca_file` (or the system's CAs) and name the host connected to; TLS 1.2 at least."""
    if not config.tls:
        return None
    try:
        context = ssl.create_default_context(cafile=config.ca_file)
        if config.cert_file is not None:
            context.load_cert_chain(config.cert_file, config.key_file)
    except FileNotFoundError as exc:
        raise CredentialsError(f"TLS file not found: {exc.filename}") from None
    except (ssl.SSLError, OSError) as exc:
        files = ", ".join(f for f in (config.ca_file, config.cert_file, config.key_file) if f)
        raise CredentialsError(f"cannot load the TLS files ({files}): {exc}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _refused_subscriptions(topics: list[str], granted: object) -> list[str]:
    """The topics a SUBACK refused (code 0x80 or above: not authorised, bad filter...)."""
    codes = list(granted) if isinstance(granted, list | tuple) else []
    return [t for t, code in zip(topics, codes, strict=False) if int(getattr(code, "value", code)) >= 0x80]


def quiet_pending_publishes(record: logging.LogRecord) -> bool:
    """aiomqtt warns above 10 pending publishes; concurrent chunk publishing does that by design."""
    return not record.getMessage().startswith("There are ") or "pending publish" not in record.getMessage()


@dataclass(frozen=True, slots=True)
class Envelope:
    """A validated incoming message and where it came from."""

    topic: str
    message: Message
    size: int
    retained: bool = False
    received_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, slots=True)
class Will:
    """The message the broker publishes for this client if it vanishes without a DISCONNECT."""

    topic: str
    message: Message
    retain: bool = True


@dataclass
class BusStats:
    received: int = 0
    published: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    duplicates: int = 0
    reconnects: int = 0
    rejected: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, object]:
        return {
            "received": self.received,
            "published": self.published,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "duplicates": self.duplicates,
            "reconnects": self.reconnects,
            "rejected": dict(sorted(self.rejected.items())),
        }


class _Batch:
    """The acknowledgements `publish_many` waits for: `done` resolves when every message id came back."""

    __slots__ = ("done", "pending")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.done: asyncio.Future[None] = loop.create_future()
        self.pending: set[int] = set()

    def expect(self, mids: Mapping[int, str]) -> None:
        self.pending.update(mids)
        if not self.pending and not self.done.done():
            self.done.set_result(None)

    def acked(self, mid: int) -> None:
        self.pending.discard(mid)
        if not self.pending and not self.done.done():
            self.done.set_result(None)


class BusClient:
    """Reusable, not re-entrant: ``async with BusClient(...) as bus:`` connects, and exit disconnects."""

    def __init__(
        self,
        config: BusConfig,
        *,
        client_id: str,
        federation: str,
        will: Will | None = None,
        on_connect: Callable[[], Awaitable[None]] | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        """`on_connect` runs after every (re)connection, once subscriptions are restored: a daemon
        re-publishes its retained status there, since the broker published its will meanwhile."""
        self.config = config
        self._on_connect = on_connect
        self._hook: asyncio.Task[None] | None = None
        self.client_id = client_id
        self.federation = federation
        self.stats = BusStats()
        self._will = will
        self._log = logger or globals()["logger"]
        self._throttle = LogThrottle(self._log)
        """Refusals are logged a few per kind a minute, then counted (`stats.rejected` counts them all)."""
        self._mqtt_log = self._log.getChild("mqtt")
        self._mqtt_log.addFilter(quiet_pending_publishes)
        self._subscriptions: dict[str, int] = {}
        self._as_published: set[str] = set()
        """Subscriptions whose messages keep their publisher's retain flag (MQTT v5; `subscribe`)."""
        self._protocol = aiomqtt.ProtocolVersion.V311 if config.protocol == "3.1.1" else aiomqtt.ProtocolVersion.V5
        self._client: aiomqtt.Client | None = None
        self._generation = 0
        self._lost = asyncio.Event()
        self._lost_future: asyncio.Future[None] | None = None
        """Resolved when the current connection is lost: calls in flight race it (one per connection,
        not a waiter task per call)."""
        self._state = asyncio.Condition()
        self._queue: asyncio.Queue[Envelope] | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._closing = False
        self._entered = False
        self._fatal: BaseException | None = None
        self._last_error = "no attempt yet"
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._publish_slots = asyncio.Semaphore(config.max_concurrent_publishes)
        self._expiry_props: dict[int, Properties] = {}
        self._expiry_timer: asyncio.TimerHandle | None = None
        self._tls = tls_context(config)
        self.max_message_bytes = config.max_message_bytes
        """The largest message this client publishes: the config's, or less where the broker announces a
        smaller Maximum Packet Size (MQTT v5 CONNACK)."""
        self.chunk_bytes = config.chunk_bytes
        """Frames above this go out as chunks: the config's, or less to fit the broker's maximum."""
        self._connack: dict[str, Any] = {}
        self._reassembler = Reassembler(
            max_bytes=config.max_reassembly_bytes,
            max_transfer_bytes=config.max_transfer_bytes,
            timeout_s=config.transfer_timeout_s,
            on_abandon=lambda sender, reason: self._count_reject("transfer-timeout"),
            budget=process_budget(config.max_reassembly_bytes),
        )

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def protocol(self) -> str:
        return "5" if self._protocol == aiomqtt.ProtocolVersion.V5 else "3.1.1"

    @property
    def connected(self) -> bool:
        return self._client is not None

    @property
    def connections(self) -> int:
        """Connections made so far (1 after the first): a daemon's status carries it, so that the
        coordinator can tell a reconnection from a repeated announcement."""
        return self._generation

    @property
    def failed(self) -> bool:
        """The client ended with an error (`messages` and every call raise it): it will not reconnect."""
        return self._fatal is not None

    async def __aenter__(self) -> Self:
        if self._entered:
            raise RuntimeError("BusClient is reusable but not re-entrant")
        self._entered = True
        self._closing = False
        self._fatal = None
        self._queue = asyncio.Queue(self.config.incoming_queue)
        self._supervisor = asyncio.create_task(self._supervise(), name=f"bus-{self.client_id}")
        try:
            await asyncio.wait_for(self._wait_generation(0), self.config.connect_timeout_s)
        except (TimeoutError, BusError) as exc:
            await self._stop()
            self._entered = False
            if isinstance(exc, BusError):
                raise
            raise BusError(
                f"could not connect to {self.config.url} within {self.config.connect_timeout_s:g} s"
                f" ({self._last_error}); is a broker running there? `fedmq broker` starts one"
            ) from None
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stop()
        self._entered = False

    async def _stop(self) -> None:
        self._closing = True
        if self._expiry_timer is not None:
            self._expiry_timer.cancel()
        if self._hook is not None:
            self._hook.cancel()
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiomqtt.MqttError):
                await self._supervisor
            self._supervisor = None
        self._client = None
        self._reassembler.clear()  # what it held of the process's reassembly budget

    def abort(self) -> None:
        """Drop the TCP connection without a DISCONNECT, as a crash would, so the broker fires the will.

        For fault injection in experiments and tests; the client does not reconnect afterwards.
        """
        self._closing = True
        self._drop_socket(self._client)

    @staticmethod
    def _drop_socket(client: aiomqtt.Client | None) -> None:
        """Shut the connection's socket: the broker sees a lost client and publishes its will."""
        paho = getattr(client, "_client", None)
        sock = paho.socket() if paho is not None else None
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    async def _probe_protocol(self) -> None:
        """In 'auto' mode, learn once whether the broker speaks MQTT v5.

        The probe is a bare v5 CONNECT (no properties, no will) under a throwaway id: some v3-only
        brokers (amqtt) misparse a v5 CONNECT that carries properties or credentials and hang instead
        of refusing it. A v5 broker that wants credentials answers "not authorised" in v5: that is v5 too.
        """
        if self.config.protocol != "auto":
            return
        probe = aiomqtt.Client(
            self.config.host,
            self.config.port,
            identifier=f"{self.client_id}-probe",
            protocol=aiomqtt.ProtocolVersion.V5,
            timeout=min(2.0, self.config.connect_timeout_s),
            tls_context=self._tls,
            logger=self._log.getChild("probe"),
        )
        try:
            async with probe:
                self._protocol = aiomqtt.ProtocolVersion.V5
        except MqttConnectError as exc:
            # refused for the credentials, it spoke v5: the real connection then fails with the reason
            v5 = _reason_code(exc.rc) in (134, 135)
            self._protocol = aiomqtt.ProtocolVersion.V5 if v5 else aiomqtt.ProtocolVersion.V311
        except aiomqtt.MqttError as exc:
            if "timed out" not in str(exc).lower():
                raise
            self._protocol = aiomqtt.ProtocolVersion.V311
        self._log.debug("broker %s speaks MQTT %s", self.config.url, self.protocol)

    async def _supervise(self) -> None:
        try:
            await self._connection_loop()
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except BaseException as exc:  # surfaced to every waiter instead of dying silently in a task
            self._fatal = BusError(f"bus client {self.client_id} failed: {exc!r}")
            self._log.exception("bus client %s failed", self.client_id)
            async with self._state:
                self._state.notify_all()

    async def _connection_loop(self) -> None:
        delay = self.config.reconnect_initial_s
        ever_connected = False
        probed = self.config.protocol != "auto"
        while not self._closing:
            if not probed:
                try:
                    await self._probe_protocol()
                    probed = True
                except aiomqtt.MqttError as exc:
                    self._last_error = str(exc)
                    hopeless = self._tls_failure(exc)
                    if hopeless is not None:
                        await self._fail(hopeless)
                        return
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.config.reconnect_max_s)
                    continue
            client = self._make_client()
            try:
                async with client:
                    await self._on_connected(client)
                    ever_connected = True
                    delay = self.config.reconnect_initial_s
                    try:
                        async for raw in client.messages:
                            await self._on_message(raw)
                    except aiomqtt.MqttError:
                        raise
                    except Exception:
                        # the client dies of this: drop the connection as a crash would, so that the
                        # broker publishes the will (the daemon's status goes offline with it) instead
                        # of aiomqtt's clean DISCONNECT, which would leave an `online` status behind
                        self._drop_socket(client)
                        raise
            except MqttConnectError as exc:
                self._last_error = f"connection refused: {exc}"
                if not ever_connected:
                    hint = ""
                    if _reason_code(exc.rc) in _AUTH_REFUSED:
                        who = f"user {self.config.username!r}" if self.config.username else "no user name"
                        hint = f" ({who}): check the credentials (--credentials, or the password file)"
                    await self._fail(BusError(f"broker {self.config.url} refused the connection: {exc}{hint}"))
                    return
            except aiomqtt.MqttError as exc:
                self._last_error = str(exc)
                hopeless = None if ever_connected else self._tls_failure(exc)
                if hopeless is not None:
                    await self._fail(hopeless)
                    return
            finally:
                await self._on_disconnected()
            if self._closing:
                return
            if ever_connected:
                self.stats.reconnects += 1
                self._log.warning(
                    "connection to %s lost (%s); reconnecting in %.2f s", self.config.url, self._last_error, delay
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.config.reconnect_max_s)

    def _tls_failure(self, exc: aiomqtt.MqttError) -> BusError | None:
        """A TLS handshake that no retry can mend (an untrusted certificate, another host name, a
        plain-MQTT port), as an error saying what to check; None for anything else."""
        text = str(exc)
        if self._tls is None:
            if "reset by peer" in text:
                self._last_error = f"{text}; if the broker expects TLS, use mqtts://"
            return None
        if not any(mark in text for mark in _TLS_FAILURES):
            return None
        ca = self.config.ca_file or "the system's CAs"
        return BusError(
            f"TLS with {self.config.url} failed: {text}. The broker's certificate must be signed by {ca} and"
            f" name {self.config.host!r}; is the broker listening with TLS on that port?"
        )

    async def _fail(self, error: BusError) -> None:
        """End the client with `error`, surfaced to every waiter (a first connection that cannot succeed)."""
        self._fatal = error
        async with self._state:
            self._state.notify_all()

    def _make_client(self) -> aiomqtt.Client:
        v5 = self._protocol == aiomqtt.ProtocolVersion.V5
        will = None
        if self._will is not None:
            # a fresh id per connection: receivers would drop a second will with the same id as a duplicate
            message = dataclasses.replace(self._will.message, message_id=new_message_id(), sent_at=time.time())
            will = aiomqtt.Will(self._will.topic, bytes(encode(message)), qos=1, retain=self._will.retain)
        connect_props = None
        if v5 and self.config.persistent_session:
            connect_props = Properties(PacketTypes.CONNECT)
            connect_props.SessionExpiryInterval = _SESSION_EXPIRY_S
        options = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)] if self.config.tcp_nodelay else []
        client = aiomqtt.Client(
            self.config.host,
            self.config.port,
            username=self.config.username,
            password=self.config.password,
            identifier=self.client_id,
            protocol=self._protocol,
            will=will,
            clean_session=None if v5 else not self.config.persistent_session,
            clean_start=(not self.config.persistent_session) if v5 else mqtt.MQTT_CLEAN_START_FIRST_ONLY,
            keepalive=self.config.keepalive_s,
            timeout=self.config.connect_timeout_s,
            max_inflight_messages=self.config.max_inflight_messages,
            properties=connect_props,
            socket_options=options,
            tls_context=self._tls,
            logger=self._mqtt_log,
        )
        paho_fast.speed_up(client)
        self._record_connack(client)
        self._hook_acks(client)
        return client

    def _hook_acks(self, client: aiomqtt.Client) -> None:
        """`publish_many`'s acknowledgements: paho's on_publish resolves its batches' waits, and hands
        every other message id to aiomqtt's own callback."""
        paho = client._client
        forward = paho.on_publish
        batches: dict[int, _Batch] = {}
        paho._fedmq_batches = batches  # type: ignore[attr-defined]  # this connection's message ids

        def on_publish(c: mqtt.Client, userdata: Any, mid: int, *rest: Any) -> None:
            batch = batches.pop(mid, None)
            if batch is not None:
                batch.acked(mid)
            elif forward is not None:
                forward(c, userdata, mid, *rest)  # type: ignore[call-arg]

        paho.on_publish = on_publish

    def _record_connack(self, client: aiomqtt.Client) -> None:
        """Keep the CONNACK's properties, which aiomqtt drops: the broker's Maximum Packet Size."""
        paho = client._client
        forward = paho.on_connect
        self._connack = {}

        def on_connect(c: mqtt.Client, userdata: Any, flags: Any, reason: Any, properties: Any = None) -> None:
            limit = getattr(properties, "MaximumPacketSize", None)
            if isinstance(limit, int) and limit > 0:
                self._connack["max_packet"] = limit
            if forward is not None:
                forward(c, userdata, flags, reason, properties)  # type: ignore[call-arg]  # paho v2 callback

        paho.on_connect = on_connect

    def _fit_to_broker(self) -> None:
        """Chunk below the broker's announced maximum packet, which it would otherwise answer by
        dropping the connection (mosquitto's `max_packet_size`)."""
        limit = min(self.config.max_message_bytes, self._connack.get("max_packet", MQTT_MAX_PACKET))
        chunk = min(self.config.chunk_bytes, limit - PUBLISH_OVERHEAD - 4096)
        if chunk < 4096:
            raise BusError(f"the broker's maximum packet of {limit} bytes is too small for fedmq (>= 10 KiB)")
        if (limit, chunk) != (self.max_message_bytes, self.chunk_bytes):
            self._log.info("the broker's maximum packet is %d bytes: chunks of at most %d bytes", limit, chunk)
        self.max_message_bytes, self.chunk_bytes = limit, chunk

    async def _on_connected(self, client: aiomqtt.Client) -> None:
        self._fit_to_broker()
        for topic, qos in self._subscriptions.items():
            wanted = self._subscription([topic], qos)
            granted = await client.subscribe(wanted, timeout=self.config.operation_timeout_s)
            if _refused_subscriptions([topic], granted):
                self._log.error("the broker refused %s's subscription to %s on reconnecting", self.client_id, topic)
        async with self._state:
            self._client = client
            self._lost = asyncio.Event()
            self._lost_future = asyncio.get_running_loop().create_future()
            self._generation += 1
            self._state.notify_all()
        if self._on_connect is not None:
            # a task, not an inline await: the supervisor must go on reading, or a connection lost
            # during the hook would never be noticed and the hook's publish would wait forever
            if self._hook is not None:
                self._hook.cancel()
            self._hook = asyncio.create_task(self._run_hook(self._on_connect))
        self._log.debug("connected to %s as %s (MQTT %s)", self.config.url, self.client_id, self.protocol)

    async def _run_hook(self, hook: Callable[[], Awaitable[None]]) -> None:
        try:
            await hook()
        except BusError as exc:
            self._log.warning("on-connect hook of %s failed: %s", self.client_id, exc)

    async def _on_disconnected(self) -> None:
        self._lost.set()
        if self._lost_future is not None and not self._lost_future.done():
            self._lost_future.set_result(None)
        async with self._state:
            self._client = None
            self._state.notify_all()

    async def _wait_generation(self, newer_than: int) -> tuple[aiomqtt.Client, int]:
        """Wait for a live connection newer than `newer_than`."""
        async with self._state:
            while True:
                if self._fatal is not None:
                    raise self._fatal
                if self._closing:
                    raise BusError("the bus client is closed")
                if self._client is not None and self._generation > newer_than:
                    return self._client, self._generation
                await self._state.wait()

    # -- outgoing --------------------------------------------------------------------------

    async def subscribe(self, *topics: str, qos: int = 1, retain_as_published: bool = False) -> None:
        """Subscribe (restored on every reconnection); BusError names the topics the broker refused
        (an ACL that does not let this identity read them), which would otherwise never deliver.

        `retain_as_published`: a message published retained keeps the flag when it is delivered at
        once (`Envelope.retained`), where MQTT otherwise clears it, so a receiver can refuse what
        should never be retained however it arrives. MQTT v5 only: over 3.1.1 (amqtt) only a stored
        message replayed on subscribing says it was retained."""
        granted: list[object] = []

        async def call(client: aiomqtt.Client, limit_s: float) -> None:
            granted[:] = [await client.subscribe(self._subscription(topics, qos), timeout=limit_s)]

        for topic in topics:
            self._subscriptions[topic] = qos
            if retain_as_published:
                self._as_published.add(topic)
        await self._with_connection("subscribe", call)
        refused = _refused_subscriptions(list(topics), granted[0] if granted else None)
        if refused:
            for topic in refused:
                self._subscriptions.pop(topic, None)
            who = f"user {self.config.username!r}" if self.config.username else "an anonymous client"
            raise BusError(
                f"the broker refused {who} the subscription to {', '.join(refused)}: not authorised by its ACL"
                " (is this identity's node id its user name?)"
            )

    def _subscription(
        self, topics: Sequence[str], qos: int
    ) -> list[tuple[str, SubscribeOptions]] | list[tuple[str, int]]:
        """What SUBSCRIBE asks for `topics`: their QoS (3.1.1), or v5 options, which keep the retain
        flag for the topics subscribed `retain_as_published`."""
        if self._protocol != aiomqtt.ProtocolVersion.V5:
            return [(t, qos) for t in topics]
        return [(t, SubscribeOptions(qos=qos, retainAsPublished=t in self._as_published)) for t in topics]

    async def unsubscribe(self, *topics: str) -> None:
        for topic in topics:
            self._subscriptions.pop(topic, None)
            self._as_published.discard(topic)
        await self._with_connection("unsubscribe", lambda c, t: c.unsubscribe(list(topics), timeout=t))

    async def publish(
        self, topic: str, message: Message, *, qos: int = 1, retain: bool = False, expiry_s: float | None = None
    ) -> int:
        """Encode and publish; returns the frame size. Large frames go out as concurrent chunks."""
        return await self.publish_frame(
            topic, encode(message), round=message.round, qos=qos, retain=retain, expiry_s=expiry_s
        )

    def publish_advisory(self, topic: str, message: Message) -> bool:
        """Hand a QoS 0 message to the connection now and wait for nothing: for advisory messages that
        QoS 0 may lose anyway (receipts). No task, no retry: without a live connection, or for a
        message that would need chunks, nothing is sent and False says so."""
        client = self._client
        if client is None or self._closing or self._lost.is_set():
            return False
        frame = encode(message)
        if len(frame) > self.chunk_bytes:
            return False
        info = client._client.publish(topic, frame, 0, False, None)  # paho's own: queued, written when writable
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            return False
        self.stats.published += 1
        self.stats.bytes_out += len(frame)
        return True

    async def publish_frame(
        self,
        topic: str,
        frame: bytes | bytearray,
        *,
        round: int,
        qos: int = 1,
        retain: bool = False,
        expiry_s: float | None = None,
    ) -> int:
        """Publish an encoded frame (so one encoding can be sent several times)."""
        if len(frame) <= self.chunk_bytes:
            await self._publish_raw(topic, frame, qos=qos, retain=retain, expiry_s=expiry_s)
            return len(frame)
        if retain:
            raise ValueError(f"a retained message must fit in one chunk ({self.chunk_bytes} bytes)")
        chunks = split(
            frame,
            chunk_bytes=self.chunk_bytes,
            federation=self.federation,
            sender=self.client_id,
            round=round,
        )
        async with asyncio.TaskGroup() as group:
            for chunk in chunks:
                group.create_task(self._publish_raw(topic, encode(chunk), qos=qos, retain=False, expiry_s=expiry_s))
        return len(frame)

    async def _publish_raw(
        self, topic: str, payload: bytes | bytearray, *, qos: int, retain: bool, expiry_s: float | None
    ) -> None:
        if len(payload) + len(topic) + PUBLISH_OVERHEAD > self.max_message_bytes:
            raise MessageTooLarge(
                f"{len(payload)} bytes exceed the broker limit of {self.max_message_bytes}", topic=topic
            )
        async with self._publish_slots:
            if qos == 1:  # paho's queue and one wait for the acknowledgement, not a task and two waits
                if await self._publish_acked([topic], {topic: payload}, retain=retain, expiry_s=expiry_s):
                    raise BusError(f"publish failed: {self._last_error}", topic=topic)
                return
            await self._with_connection(
                "publish",
                lambda c, t: c.publish(
                    topic, payload, qos=qos, retain=retain, properties=self._props(expiry_s), timeout=t
                ),
                topic=topic,
            )
        self.stats.published += 1
        self.stats.bytes_out += len(payload)

    def _props(self, expiry_s: float | None) -> Properties | None:
        """A PUBLISH's message expiry (MQTT v5), one object per value: paho packs it on every send."""
        if expiry_s is None or self._protocol != aiomqtt.ProtocolVersion.V5:
            return None
        seconds = max(1, int(expiry_s))
        props = self._expiry_props.get(seconds)
        if props is None:
            props = self._expiry_props[seconds] = Properties(PacketTypes.PUBLISH)
            props.MessageExpiryInterval = seconds
        return props

    async def publish_many(
        self,
        topics: Sequence[str],
        frame: Frame | Mapping[str, Frame],
        *,
        round: int,
        qos: int = 1,
        expiry_s: float | None = None,
    ) -> list[str]:
        """One frame to many topics, or each topic its own (a map by topic: a round's tasks, which
        differ in their task ids only): every PUBLISH handed to the connection at once and their
        acknowledgements awaited together, where `publish_frame` would take a task and two waits each.
        Unacknowledged ones are sent again after a reconnection, until `operation_timeout_s`. Returns
        the topics that could not be published."""
        if not topics:
            return []
        frames: Mapping[str, Frame] = frame if isinstance(frame, Mapping) else dict.fromkeys(topics, frame)
        largest = max(len(frames[t]) for t in topics)
        if qos != 1 or largest > self.chunk_bytes:  # chunks and QoS 0 take the general path
            results = await asyncio.gather(
                *(self.publish_frame(t, frames[t], round=round, qos=qos, expiry_s=expiry_s) for t in topics),
                return_exceptions=True,
            )
            for result in results:
                if isinstance(result, BaseException) and not isinstance(result, BusError):
                    raise result
            return [t for t, r in zip(topics, results, strict=True) if isinstance(r, BaseException)]
        longest = max(len(t) for t in topics)
        if largest + longest + PUBLISH_OVERHEAD > self.max_message_bytes:
            raise MessageTooLarge(f"{largest} bytes exceed the broker limit of {self.max_message_bytes}")
        return await self._publish_acked(topics, frames, retain=False, expiry_s=expiry_s)

    async def _publish_acked(
        self, topics: Sequence[str], frames: Mapping[str, Frame], *, retain: bool, expiry_s: float | None
    ) -> list[str]:
        """QoS 1 PUBLISHes of `frame` to `topics`, handed to paho at once and acknowledged together
        (`_hook_acks`); what a lost connection left unacknowledged goes again on the next one, until
        `operation_timeout_s`. The topics not published (BusError: refused by the broker)."""
        deadline = time.monotonic() + self.config.operation_timeout_s
        todo, generation = list(topics), 0
        while todo:
            try:
                client, generation = await self._connection(generation, deadline)
            except TimeoutError:
                self._log.warning("%d publishes failed: no connection (%s)", len(todo), self._last_error)
                return todo
            lost = self._lost_future
            assert lost is not None
            batch = _Batch(asyncio.get_running_loop())
            paho, props = client._client, self._props(expiry_s)
            acks: dict[int, _Batch] = paho._fedmq_batches  # type: ignore[attr-defined]
            sent: dict[int, str] = {}
            for topic in todo:
                info = paho.publish(topic, frames[topic], 1, retain, props)
                if info.rc in _CONNECTION_LOST_CODES:
                    break  # the connection is going: the rest go after the reconnection
                if info.rc != mqtt.MQTT_ERR_SUCCESS:
                    raise BusError(f"publish refused by the client: {mqtt.error_string(info.rc)}", topic=topic)
                sent[info.mid] = topic
                acks[info.mid] = batch
            batch.expect(sent)
            if sent:
                await asyncio.wait({batch.done, lost}, timeout=max(deadline - time.monotonic(), 0),
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            else:
                await asyncio.wait({lost}, timeout=max(deadline - time.monotonic(), 0))
            for mid in batch.pending:
                acks.pop(mid, None)
            self.stats.published += len(sent) - len(batch.pending)
            self.stats.bytes_out += sum(len(frames[t]) for m, t in sent.items() if m not in batch.pending)
            todo = [sent[m] for m in batch.pending] + todo[len(sent) :]
            if todo and time.monotonic() >= deadline:
                self._last_error = f"unacknowledged after {self.config.operation_timeout_s:g} s"
                self._log.warning("%d publishes unacknowledged after %g s", len(todo), self.config.operation_timeout_s)
                return todo
        return []

    async def _connection(self, newer_than: int, deadline: float) -> tuple[aiomqtt.Client, int]:
        """A live connection newer than `newer_than`, and its generation; TimeoutError past `deadline`."""
        live = self._client
        if live is not None and self._generation > newer_than and self._fatal is None and not self._closing:
            return live, self._generation  # connected: no wait, no lock
        return await asyncio.wait_for(self._wait_generation(newer_than), max(deadline - time.monotonic(), 0))

    async def _with_connection(
        self, what: str, call: Callable[[aiomqtt.Client, float], Awaitable[object]], *, topic: str | None = None
    ) -> None:
        """Run `call(client, timeout)` on a live connection; after a connection loss, retry on the next one.

        A retried QoS 1 publish may arrive twice; receivers drop the second by message id.
        """
        deadline = time.monotonic() + self.config.operation_timeout_s
        generation = 0
        while True:
            try:
                client, generation = await self._connection(generation, deadline)
            except TimeoutError:
                raise BusError(f"{what} timed out waiting for the broker ({self._last_error})", topic=topic) from None
            lost = self._lost_future
            assert lost is not None
            attempt = asyncio.ensure_future(call(client, max(deadline - time.monotonic(), 0.001)))
            try:
                # a call in flight when the connection drops would wait for an ack that can never come
                await asyncio.wait({attempt, lost}, return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
            finally:
                if not attempt.done():
                    attempt.cancel()
                    with contextlib.suppress(asyncio.CancelledError, aiomqtt.MqttError):
                        await attempt
            try:
                if attempt.cancelled():
                    raise aiomqtt.MqttError("connection lost while the call was in flight")
                attempt.result()
                return
            except aiomqtt.MqttCodeError as exc:
                if exc.rc not in _CONNECTION_LOST_CODES:
                    raise BusError(f"{what} refused by the broker: {exc}", topic=topic) from exc
                self._last_error = str(exc)
            except aiomqtt.MqttError as exc:
                self._last_error = str(exc)
            if time.monotonic() >= deadline:
                raise BusError(f"{what} failed: {self._last_error}", topic=topic)

    # -- incoming --------------------------------------------------------------------------

    async def messages(self) -> AsyncIterator[Envelope]:
        """Validated messages in arrival order; one consumer per client."""
        if self._queue is None:
            raise RuntimeError("use the client inside `async with`")
        queue = self._queue
        while True:
            if self._supervisor is None or self._supervisor.done():
                raise BusError(f"bus client stopped: {self._fatal or self._last_error}")
            if not queue.empty():  # what has come already needs no waiting (and no task per message)
                yield queue.get_nowait()
                continue
            getter = asyncio.ensure_future(queue.get())
            try:
                done, _ = await asyncio.wait({getter, self._supervisor}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not getter.done():
                    getter.cancel()  # the consumer was cancelled or the client stopped: no orphaned get()
            if getter not in done:
                raise BusError(f"bus client stopped: {self._fatal or self._last_error}")
            yield getter.result()

    async def _on_message(self, raw: aiomqtt.Message) -> None:
        """`_on_raw`, fenced: one message that trips an unforeseen error is counted (``internal-error``)
        and logged with its traceback; the connection, and the daemon reading it, go on."""
        try:
            await self._on_raw(raw)
        except Exception:
            self._count_reject("internal-error")
            self._log.exception("error while receiving a message on %s; it is dropped", raw.topic.value)

    async def _on_raw(self, raw: aiomqtt.Message) -> None:
        payload = raw.payload
        if not isinstance(payload, bytes | bytearray | memoryview):
            self._reject("bad-payload", raw.topic.value, "payload is not bytes")
            return
        topic = raw.topic.value
        size = len(payload)
        if size == 0:  # MQTT's deletion of a retained message, delivered to subscribers: nothing to read
            self._log.debug("empty message on %s (a retained message cleared) ignored", topic[:200])
            return
        self.stats.received += 1
        self.stats.bytes_in += size
        if size > self.config.max_message_bytes:
            self._reject("oversized", topic, f"{size} bytes > limit {self.config.max_message_bytes}")
            return
        message = self._validate(topic, payload, retained=bool(raw.retain))
        if message is None:
            return
        if message.kind == Kind.CHUNK:
            try:
                frame = self._reassembler.add(message)
            except CodecError as exc:
                self._reject(exc.reason, topic, f"{exc.detail} (from {message.sender!r})")
                return
            finally:
                self._arm_expiry()
            if frame is None:
                return
            message = self._validate(topic, frame, verified=True)
            if message is None or message.kind == Kind.CHUNK:
                if message is not None:
                    self._reject("bad-chunk", topic, "a chunked frame may not itself be a chunk")
                return
            size = len(frame)
        await self._queue.put(Envelope(topic, message, size, retained=bool(raw.retain)))  # type: ignore[union-attr]

    def _validate(
        self, topic: str, frame: bytes | bytearray | memoryview, *, verified: bool = False, retained: bool = False
    ) -> Message | None:
        """Decode, check the federation, drop a repeated id. `verified`: every byte was checked already
        (a frame reassembled from chunks whose checksums matched and which cover it exactly).
        `retained`: the broker kept it (a status), which the warning says: it stays until replaced."""
        try:
            message = decode(frame, verify=not verified)
        except CodecError as exc:
            note = " (a retained message: ignored, and kept by the broker until its publisher replaces it)"
            self._reject(exc.reason, topic, exc.detail + (note if retained else ""))
            return None
        if message.federation != self.federation:
            self._reject("wrong-federation", topic, f"federation {message.federation!r} from {message.sender!r}")
            return None
        if message.message_id in self._seen:
            self.stats.duplicates += 1
            self._log.debug("duplicate message %s on %s dropped", message.message_id.hex()[:8], topic)
            return None
        self._seen[message.message_id] = None
        if len(self._seen) > self.config.dedup_window:
            self._seen.popitem(last=False)
        return message

    def _reject(self, reason: str, topic: str, detail: str) -> None:
        self._count_reject(reason)
        # a topic can be 65,535 bytes of someone else's choosing: the log gets its start
        self._throttle.warning(
            (reason, topic[:200]), "rejected message on %s: %s: %s", topic[:200], reason, detail[:1000]
        )

    def _count_reject(self, reason: str) -> None:
        self.stats.rejected[reason] += 1

    def reject(self, reason: str, envelope: Envelope, detail: str) -> None:
        """Let the daemon count and log a message it found invalid (wrong round, wrong shape, ...)."""
        self._reject(reason, envelope.topic, f"{detail} (from {envelope.message.sender!r})")

    def _arm_expiry(self) -> None:
        """A timer, not a polling loop, abandons the oldest incomplete transfer when it times out."""
        if self._expiry_timer is not None:
            self._expiry_timer.cancel()
            self._expiry_timer = None
        deadline = self._reassembler.next_deadline()
        if deadline is not None and not self._closing:
            loop = asyncio.get_running_loop()
            delay = max(deadline - time.monotonic(), 0) + 0.01
            self._expiry_timer = loop.call_later(delay, self._on_expiry)

    def _on_expiry(self) -> None:
        self._expiry_timer = None
        self._reassembler.expire()
        self._arm_expiry()
