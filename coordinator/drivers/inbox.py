"""What the coordinator accepts from the nodes: each incoming message checked, then made the engine's event.

A part of the MQTT driver (`coordinator.drivers.mqtt`). The checks that need no engine happen here,
before the event log and the engine: the node's message and byte budget, the topic's scheme, a
retained ack or update (refused, and the broker's copy cleared), the sender against its topic, the
experiment's node ids, the kinds each channel may carry, and a node announcing another method. A
refused message is counted and logged (a few per node and reason a minute), never the daemon's end.

An update is read before the engine (`coordinator.updates.ingest`: decoded, decompressed, checked
against the schema, its digest taken), a large one in a worker thread, so that the event loop goes on
receiving while a big model is read; the engine still decides, in its own order, whether it is taken.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fedmq.broker import BusClient, BusConfig, Envelope, Kind, Message, Topics
from fedmq.broker.background import Background
from fedmq.broker.throttle import LogThrottle
from fedmq.broker.topics import Route
from fedmq.coordinator.budgets import node_budgets
from fedmq.coordinator.config import CoordinatorConfig
from fedmq.coordinator.drivers.outbox import Outbox
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.errors import ProtocolError
from fedmq.coordinator.registry import NodeRegistry
from fedmq.coordinator.updates import Ingested
from fedmq.fedcore.algorithms.fingerprint import MethodFingerprint
from fedmq.fedcore.protocol import Announcement, UpdateFailed

logger = logging.getLogger("fedmq.coordinator.drivers.mqtt")

CHANNEL_KINDS: dict[str, frozenset[Kind]] = {
    "node-status": frozenset({Kind.NODE_STATUS}),
    "acks": frozenset({Kind.ACK}),
    "updates": frozenset({Kind.UPDATE}),
    "secagg": frozenset({Kind.SECAGG_KEYS, Kind.SECAGG_SHARES, Kind.SECAGG_REVEAL}),
}
"""What may come on each channel the coordinator subscribes to."""
OFF_LOOP_BYTES = 1 << 20
"""An update frame this large or larger is read in a worker thread (a smaller one costs less than the
hand-over)."""


class Inbox:
    def __init__(
        self,
        config: CoordinatorConfig,
        bus_config: BusConfig,
        registry: NodeRegistry,
        fingerprint: MethodFingerprint,
        outbox: Outbox,
        post: Callable[[e.Event], None],
        background: Background,
        ingest: Callable[[Message], Ingested],
    ) -> None:
        """`post` hands the engine each accepted message's event; `outbox` learns which open tasks were
        answered, and sends a reconnected node's again; `ingest` reads an update before the engine."""
        self.config = config
        self.topics = Topics(config.federation)
        self.registry = registry
        self.fingerprint = fingerprint
        self.bus: BusClient | None = None
        """The connected bus (set by the daemon while it serves)."""
        self._outbox = outbox
        self._post = post
        self._background = background
        self._refusals = LogThrottle(logger)
        """Protocol refusals, a few per node and reason a minute in the log (all counted)."""
        self._ingest = ingest
        self.ingests = Background(logger)
        """The large updates being read in a worker thread, their events posted when read."""
        self._budgets = node_budgets(config.policy, bus_config.max_transfer_bytes)
        self._connections: dict[str, int] = {}
        """Each node's connection count, from its statuses: a higher one means it reconnected."""

    async def receive(self, bus: BusClient) -> None:
        """Every message the bus delivers, until the bus gives up."""
        async for envelope in bus.messages():
            route = self.topics.route(envelope.topic)  # once per message: the budget and the dispatch read it
            if self.over_budget(bus, envelope, route):
                continue
            try:
                self.dispatch(envelope, route)
            except ProtocolError as exc:
                bus.reject(exc.reason, envelope, exc.detail)
                if envelope.retained and exc.reason != "retained":
                    logger.warning(
                        "the retained message on %s is ignored (%s); its node is seen when it announces again",
                        envelope.topic[:200],
                        exc.reason,
                    )
            except Exception:  # a daemon never dies of one message; the traceback says why
                bus.stats.rejected["internal-error"] += 1
                logger.exception("error while handling a message on %s", envelope.topic[:200])

    def over_budget(self, bus: BusClient, envelope: Envelope, route: Route | None) -> bool:
        """Whether the node whose topic `envelope` came on (its `route`) is over its message or byte budget:
        then it is dropped here, before the engine and the event log, and counted (`coordinator.budgets`)."""
        if route is None or route.node is None:
            return False
        exceeded = self._budgets.admit(route.node, envelope.size)
        if exceeded is None:
            return False
        bus.stats.rejected["over-budget"] += 1
        self._refusals.warning(
            ("over-budget", route.node),
            "%s is over its %s budget (policy.node_%s_per_s): its messages are dropped, and counted as"
            " over-budget, until it slows down",
            route.node,
            "message" if exceeded == "messages" else "byte",
            exceeded,
        )
        return True

    def dispatch(self, envelope: Envelope, route: Route | None) -> None:
        """The message's event for the engine, or the ProtocolError that says why it is refused."""
        message = envelope.message
        if route is None:
            raise ProtocolError(
                "unknown-topic",
                f"topic {envelope.topic[:200]!r} is outside the scheme (node ids are 1 to 64 letters, digits,"
                " '_', '.' or '-')",
            )
        if envelope.retained and route.channel in ("acks", "updates", "secagg"):
            self._clear_retained(envelope.topic)
            raise ProtocolError(
                "retained",
                f"a retained {route.channel[:-1]} on the topic of {route.node!r} (acks and updates are never"
                " retained: the broker replayed a stored message); refused, and the broker's copy cleared",
            )
        if route.node is not None and message.sender != route.node:
            raise ProtocolError("wrong-sender", f"sender {message.sender[:80]!r} on the topic of {route.node!r}")
        if route.node is not None and self.config.nodes is not None and route.node not in self.config.nodes:
            raise ProtocolError("unknown-node", f"{route.node!r} is not a node of this experiment")
        expected = CHANNEL_KINDS.get(route.channel)
        if expected is None:
            return  # our own topics echo nothing we subscribed to; ignore anything else
        if message.kind not in expected:
            raise ProtocolError("unexpected-kind", f"{message.kind} on a {route.channel} topic")
        if route.channel == "node-status":
            self._status(message.sender, Announcement.from_meta(message.meta))
        elif route.channel == "secagg":
            self._post(e.SecAggArrived(message, envelope.received_at))
        elif route.channel == "acks":
            task = message.meta.get("task")
            self._outbox.answered(message.sender, task)
            self._post(e.Acked(message.sender, message.round, task if isinstance(task, bytes) else None))
        else:
            self._outbox.answered(message.sender, message.meta.get("task"))
            self._update(message, envelope)

    def _update(self, message: Message, envelope: Envelope) -> None:
        """The update's event, once read (a node's report of a failed training holds nothing to read)."""
        if UpdateFailed.is_failure(message.meta):
            self._post(e.UpdateArrived(message, envelope.received_at))
        elif envelope.size < OFF_LOOP_BYTES:
            self._post(e.UpdateArrived(message, envelope.received_at, self._ingest(message)))
        else:

            async def off_loop() -> None:
                ingested = await asyncio.to_thread(self._ingest, message)
                self._post(e.UpdateArrived(message, envelope.received_at, ingested))

            self.ingests.spawn(off_loop(), f"ingest-{message.sender}")

    def _status(self, sender: str, announcement: Announcement) -> None:
        """A node's announcement: into the registry (a node running another method never live: it would
        train another objective), the engine told when it changed what the engine knows."""
        refusal = self._method_refusal(announcement)
        known = self.registry.get(sender)
        count = known.num_samples if known is not None else None
        was_online = known is not None and known.online
        changed = self.registry.apply_status(sender, Announcement(online=False) if refusal else announcement)
        node = self.registry.get(sender)
        assert node is not None
        reconnected = self._reconnected(sender, announcement.connection)
        if changed is not None or (node.online and node.num_samples != count):
            self._post(e.NodeSeen(sender, node.online, node.num_samples))
        elif was_online and node.online and reconnected:
            self._outbox.resend_open_task(sender)
        if refusal:
            raise ProtocolError("method-mismatch", refusal)

    def _clear_retained(self, topic: str) -> None:
        """Publish an empty retained message on `topic`, which deletes the broker's stored one (issue
        31, item 9): a node may publish with the retain flag on its own ack and update topics (the
        ACL cannot forbid the flag on mosquitto), and the broker would replay that message to every
        coordinator that subscribes, this one after each reconnection included."""
        if self.bus is None:
            return
        logger.warning("clearing the retained message a client left on %s", topic[:200])
        self._background.spawn(self.bus.publish_frame(topic, b"", round=-1, retain=True), "clear-retained")

    def _reconnected(self, node: str, connection: int | None) -> bool:
        """Whether this status is the node's first on a newer connection than its last status said
        (a repeated announcement on the same connection is not: the node holds what it held)."""
        if connection is None:
            return False
        previous = self._connections.get(node)
        self._connections[node] = connection
        return previous is not None and connection > previous

    def _method_refusal(self, announcement: Announcement) -> str | None:
        """Why an online announcement is refused for its method (None: it matches, or says none)."""
        if not announcement.online or announcement.method is None:
            return None
        try:
            theirs = MethodFingerprint.from_meta(announcement.method)
        except ValueError as exc:
            raise ProtocolError("bad-status", str(exc)) from None
        if theirs.digest == self.fingerprint.digest:
            return None
        differences = self.fingerprint.differences(theirs, "here", "on the node")
        return (
            f"the node runs {theirs.describe()}; the coordinator runs {self.fingerprint.describe()}"
            f" (differences: {differences}): it is not given tasks until it announces the coordinator's method"
        )

    def refused(self, command: c.Refused) -> None:
        """The engine refused a message: a protocol refusal is counted and logged like the inbox's own."""
        if command.protocol:
            if self.bus is not None:
                self.bus.stats.rejected[command.reason] += 1
            self._refusals.warning(
                (command.reason, command.node),
                "refused a message from %s: %s: %s",
                command.node,
                command.reason,
                command.detail,
            )
        else:
            logger.info("update from %s not folded: %s: %s", command.node, command.reason, command.detail)
