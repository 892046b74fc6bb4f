"""The coordinator daemon: the adapter between MQTT and the round engine.

Messages become events (`coordinator.engine.events`), the engine decides, and its commands become
publishes and the algorithm half's heavy calls. Two loops run in one TaskGroup: the receiver, which
validates and routes every incoming message (and never dies of one), and the driver, which feeds
events to the engine one at a time and executes what it asks. The half's calls (configure,
aggregate, evaluate, checkpoint snapshots) run one after another on one worker thread (`Lane`)
and come back as events, so the engine never waits and never sees a half-updated model.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fedmq.broker import BusClient, BusConfig, Envelope, Kind, Message, Topics, Will
from fedmq.broker.errors import BusError
from fedmq.broker.throttle import LogThrottle
from fedmq.broker.topics import Route
from fedmq.coordinator.budgets import node_budgets
from fedmq.coordinator.config import CoordinatorConfig
from fedmq.coordinator.drivers.task_frames import SENDER, Prepared, TaskFrame, TaskFrames
from fedmq.coordinator.engine import Engine, make_engine
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.engine.base import new_task_id
from fedmq.coordinator.engine.clock import Clock, MonotonicClock
from fedmq.coordinator.errors import CoordinatorError, ProtocolError
from fedmq.coordinator.halfcalls import HalfCalls, update_schema
from fedmq.coordinator.lane import Lane
from fedmq.coordinator.observers.reporting import MEASURED_FIELDS, Evaluator, outcome_fields, write_run_files
from fedmq.coordinator.registry import NodeRegistry
from fedmq.coordinator.storage.eventlog import FILENAME as EVENT_LOG
from fedmq.coordinator.storage.eventlog import EventLog, log_header
from fedmq.coordinator.storage.persistence import Persistence
from fedmq.coordinator.storage.run_dir import RunDir
from fedmq.fedcore.algorithms.base import CoordinatorHalf
from fedmq.fedcore.algorithms.fingerprint import MethodFingerprint, fingerprint_of
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.participation import ParticipationRecord
from fedmq.fedcore.protocol import (
    Announcement,
    CoordinatorStatus,
    Receipt,
    RunState,
    SecAggDirectory,
    SecAggShared,
    SecAggUnmask,
)
from fedmq.fedcore.tensors import schema_of

logger = logging.getLogger(__name__)


EngineFactory = Callable[[Callable[[], bytes]], Engine]
"""Makes a coordinator's engine from its task-id maker (which records each id in the event log, so that
a replay draws the same ones): the part a site aggregator swaps for its relay engine."""


CHANNEL_KINDS: dict[str, frozenset[Kind]] = {
    "node-status": frozenset({Kind.NODE_STATUS}),
    "acks": frozenset({Kind.ACK}),
    "updates": frozenset({Kind.UPDATE}),
    "secagg": frozenset({Kind.SECAGG_KEYS, Kind.SECAGG_SHARES, Kind.SECAGG_REVEAL}),
}
"""What may come on each channel the coordinator subscribes to."""
SECAGG_KINDS = {
    SecAggDirectory: Kind.SECAGG_DIRECTORY,
    SecAggShared: Kind.SECAGG_SHARED,
    SecAggUnmask: Kind.SECAGG_UNMASK,
}


@dataclass(frozen=True, slots=True)
class Summary:
    rounds_completed: int
    final_accuracy: float | None
    best_accuracy: float | None
    wall_seconds: float
    state: str


Watcher = Callable[[float, e.Event, "list[c.Command]"], None]
"""Sees each event the engine handled, when (the clock's time), and the commands it gave."""


_FROM_MESSAGES = (e.NodeSeen, e.Acked, e.UpdateArrived)
"""The events one incoming message makes (`Coordinator._feed_fenced`)."""


class _Failed(Exception):
    """A heavy call raised: the run fails with this as the reason."""


class Coordinator:
    def __init__(
        self,
        config: CoordinatorConfig,
        bus_config: BusConfig,
        half: CoordinatorHalf,
        test_data: TensorDataset | None = None,
        *,
        val_data: TensorDataset | None = None,
        extra_summary: Mapping[str, Any] | None = None,
        clock: Clock | None = None,
        new_engine: EngineFactory | None = None,
        calls: HalfCalls | None = None,
        run_id: str | None = None,
    ) -> None:
        """The parts a composition swaps (a site aggregator's relay, `aggregator.site`): `new_engine` (by
        default the round policy the config names), `calls` (how the half's heavy calls are made) and
        `run_id` (by default a fresh random one)."""
        self.config = config
        self.bus_config = bus_config
        self.half = half
        self.test_data = test_data
        self.val_data = val_data
        self.clock = clock or MonotonicClock()
        self.topics = Topics(config.federation)
        self.registry = NodeRegistry()
        self.fingerprint = fingerprint_of(half, schema_of(half.model.state_dict()))
        """The method, hyperparameters and model schema nodes must share: in every task and status."""
        self.run_dir = RunDir(config.out_dir)
        self.run_id = run_id or os.urandom(8).hex()
        self.client_id = f"{config.federation}-coordinator"
        """The MQTT client id (a broker lets one connection hold it at a time)."""
        self.event_log = EventLog(self.run_dir.root / EVENT_LOG)
        new_id = self.event_log.recording(new_task_id)
        self.engine = new_engine(new_id) if new_engine is not None else self._default_engine(new_id)
        self.evaluator = Evaluator(half, test_data, val_data, config.eval_device)
        self.persistence = Persistence(self.run_dir, half)
        self._lane = Lane()
        self._events: asyncio.Queue[e.Event | _Failed] = asyncio.Queue()
        self._calls = calls or HalfCalls(half, config)
        self._refusals = LogThrottle(logger)
        """Protocol refusals, a few per node and reason a minute in the log (all counted)."""
        self._budgets = node_budgets(config.policy, bus_config.max_transfer_bytes)
        self._frames = TaskFrames(config, bus_config, self.fingerprint.digest)
        self._prepared: dict[int, Prepared] = {}
        """Encoded tasks not yet sent, by Configure step (a step goes once its tasks are out, except the
        latest broadcast step, whose model a late acknowledgement may still need)."""
        self._statuses: asyncio.Queue[Message] = asyncio.Queue()
        self._outbox: list[tuple[str, bytes, int, TaskFrame]] = []
        """Tasks to publish once the engine's commands for the current event are executed: (node, task id,
        round, frame)."""
        self._published_state: RunState | None = None
        self._connections: dict[str, int] = {}
        """Each node's connection count, from its statuses: a higher one means it reconnected."""
        self._open_tasks: dict[str, tuple[bytes, int, TaskFrame]] = {}
        """Each node's last task frame (task id, round, frame) until the node acknowledges or answers it:
        sent again when the node announces itself again while it holds it (`_resend_open_task`)."""
        self._background: set[asyncio.Task[Any]] = set()
        self._bus: BusClient | None = None
        self._extra_summary = dict(extra_summary or {})
        self._started = time.monotonic()
        self._cpu_started = time.process_time()
        self._state = RunState.STARTING
        self.connected = asyncio.Event()
        """Set while the coordinator is connected and subscribed (readiness for supervisors and `/readyz`)."""
        self.watchers: list[Watcher] = []
        """Called after each event with its commands (metrics, the HTTP API); one that raises is logged
        and removed, never the daemon's end."""

    def _default_engine(self, new_id: Callable[[], bytes]) -> Engine:
        """The round policy the config names (evaluating when there is test data)."""
        schema = update_schema(self.half, self.config)
        return make_engine(self.config, schema, evaluates=self.test_data is not None, new_id=new_id)

    def post(self, event: e.Event) -> None:
        """Feed the engine an event that comes from outside the bus (a site's requests from upstream):
        it is handled in turn with the messages' events, on the event loop."""
        self._events.put_nowait(event)

    @property
    def participation(self) -> ParticipationRecord:
        return self.engine.participation

    # -- lifecycle -------------------------------------------------------------------------

    async def serve(self) -> Summary:
        """Run to the end, then publish 'finished'. Cancelling it stops after writing the summary."""
        self._started = time.monotonic()
        resumed = self._resume() if self.config.resume else None
        self.event_log.start(log_header(self.config, run_id=self.run_id), resumed=resumed)
        will = Will(self.topics.coordinator_status, self._status_message(RunState.OFFLINE, {}))
        client = BusClient(
            self.bus_config,
            client_id=self.client_id,
            federation=self.config.federation,
            will=will,
            logger=logger.getChild("bus"),
        )
        async with client as bus:
            self._bus = bus
            await bus.subscribe(self.topics.all_node_status)
            # acks and updates keep a retained publish's flag even live (MQTT v5), to be refused (`_dispatch`)
            subscriptions = [self.topics.all_acks, self.topics.all_updates]
            if self.config.secure_aggregation is not None:
                subscriptions.append(self.topics.all_secagg)
            await bus.subscribe(*subscriptions, retain_as_published=True)
            self.connected.set()
            receiver = asyncio.create_task(self._receive(bus), name="coordinator-receive")
            driver = asyncio.create_task(self._drive(), name="coordinator-drive")
            statuses = asyncio.create_task(self._publish_statuses(), name="coordinator-status")
            try:
                await asyncio.wait({receiver, driver}, return_when=asyncio.FIRST_COMPLETED)
                if driver.done():
                    driver.result()
                    self._state = RunState(self.engine.state)
                else:
                    receiver.result()  # the receiver only ends when the bus gives up
                    raise CoordinatorError("the message receiver stopped")
            except asyncio.CancelledError:
                self._state = RunState.STOPPED
                driver.cancel()
                await asyncio.gather(driver, return_exceptions=True)
                await self._stop_engine()
                raise
            except (CoordinatorError, BusError) as exc:
                self._state = RunState.FAILED
                logger.error("%s", exc)
            finally:
                self.connected.clear()
                for task in (receiver, driver, *self._background):
                    task.cancel()
                await asyncio.gather(receiver, driver, return_exceptions=True)
                await self._lane.drain()
                self._lane.close()
                await self.persistence.flush()  # the last checkpoint is on disk before exit
                self.event_log.close()
                summary = self._write_summary()
                await asyncio.shield(self._final_status(statuses))
        return summary

    async def _stop_engine(self) -> None:
        """Let the engine fold what it has accepted (async buffer) before the run stops."""
        try:
            async with asyncio.timeout(30):
                self._feed(e.Stop())
                while not self.engine.finished:
                    self._feed(await self._next_event())
        except (TimeoutError, CoordinatorError) as exc:
            logger.warning("stopping without folding the buffered updates: %r", exc)

    # -- receiving -------------------------------------------------------------------------

    async def _receive(self, bus: BusClient) -> None:
        async for envelope in bus.messages():
            route = self.topics.route(envelope.topic)  # once per message: the budget and the dispatch read it
            if self._over_budget(bus, envelope, route):
                continue
            try:
                self._dispatch(envelope, route)
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

    def _over_budget(self, bus: BusClient, envelope: Envelope, route: Route | None) -> bool:
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

    def _dispatch(self, envelope: Envelope, route: Route | None) -> None:
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
            announcement = Announcement.from_meta(message.meta)
            refusal = self._method_refusal(announcement)
            known = self.registry.get(message.sender)
            count = known.num_samples if known is not None else None
            was_online = known is not None and known.online
            # a node running another method is never live: it would train another objective
            changed = self.registry.apply_status(
                message.sender, Announcement(online=False) if refusal else announcement
            )
            node = self.registry.get(message.sender)
            assert node is not None
            reconnected = self._reconnected(message.sender, announcement.connection)
            if changed is not None or (node.online and node.num_samples != count):
                self._events.put_nowait(e.NodeSeen(message.sender, node.online, node.num_samples))
            elif was_online and node.online and reconnected:
                self._resend_open_task(message.sender)
            if refusal:
                raise ProtocolError("method-mismatch", refusal)
        elif route.channel == "secagg":
            self._events.put_nowait(e.SecAggArrived(message, envelope.received_at))
        elif route.channel == "acks":
            task = message.meta.get("task")
            self._answered(message.sender, task)
            self._events.put_nowait(e.Acked(message.sender, message.round, task if isinstance(task, bytes) else None))
        else:
            self._answered(message.sender, message.meta.get("task"))
            self._events.put_nowait(e.UpdateArrived(message, envelope.received_at))

    def _clear_retained(self, topic: str) -> None:
        """Publish an empty retained message on `topic`, which deletes the broker's stored one (issue
        31, item 9): a node may publish with the retain flag on its own ack and update topics (the
        ACL cannot forbid the flag on mosquitto), and the broker would replay that message to every
        coordinator that subscribes, this one after each reconnection included."""
        if self._bus is None:
            return
        logger.warning("clearing the retained message a client left on %s", topic[:200])
        self._spawn(self._bus.publish_frame(topic, b"", round=-1, retain=True))

    def _reconnected(self, node: str, connection: int | None) -> bool:
        """Whether this status is the node's first on a newer connection than its last status said
        (a repeated announcement on the same connection is not: the node holds what it held)."""
        if connection is None:
            return False
        previous = self._connections.get(node)
        self._connections[node] = connection
        return previous is not None and connection > previous

    def _answered(self, node: str, task: object) -> None:
        """The node acknowledged or answered its open task: it has it, nothing to send again."""
        held = self._open_tasks.get(node)
        if held is not None and held[0] == task:
            del self._open_tasks[node]

    def _resend_open_task(self, node: str) -> None:
        """A live node announced itself on a new connection: after a broker restart its subscriptions
        may be new, so the task published before it re-subscribed was lost (issue 31).
        The same frame goes again; a node that had it drops the copy by its message id, and one that
        arrives past its deadline is refused there as expired."""
        held = self._open_tasks.get(node)
        if held is None or self._bus is None:
            return
        task_id, round, frame = held
        logger.info("round %d: %s announced itself again with its task unanswered: the task is sent again", round, node)
        self._spawn(
            self._bus.publish_frame(
                self.topics.task(node), frame.for_task(task_id), round=round, expiry_s=frame.expiry_s
            )
        )

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

    # -- driving the engine ----------------------------------------------------------------

    async def _drive(self) -> None:
        self._feed(e.Start())
        while not self.engine.finished:
            event = await self._next_event()
            if isinstance(event, _FROM_MESSAGES):
                self._feed_fenced(event)
            else:
                self._feed(event)

    def _feed_fenced(self, event: e.Event) -> None:
        """An event made from one incoming message: whatever it trips (in the event log, the engine,
        a publish) is counted and logged as that message's refusal, never the run's end. The run's
        own events (deadlines, the half's results) still fail it: those are the coordinator's bugs."""
        try:
            self._feed(event)
        except Exception:
            if self._bus is not None:
                self._bus.stats.rejected["internal-error"] += 1
            node = getattr(event, "node", None) or getattr(getattr(event, "message", None), "sender", "?")
            logger.exception("error while handling %s from %s; the message is dropped", type(event).__name__, node)

    async def _next_event(self) -> e.Event:
        """The next event, or a Tick when the engine's next deadline comes first."""
        deadline = self.engine.next_deadline()
        if not self._events.empty() and (deadline is None or deadline > self.clock.now()):
            item = self._events.get_nowait()  # no timer to arm for what is here already
            if isinstance(item, _Failed):
                raise CoordinatorError(str(item))
            return item
        try:
            async with asyncio.timeout(None if deadline is None else max(deadline - self.clock.now(), 0)):
                item = await self._events.get()
        except TimeoutError:
            return e.Tick()
        if isinstance(item, _Failed):
            raise CoordinatorError(str(item))
        return item

    def _feed(self, event: e.Event) -> None:
        """The engine's commands for `event`, executed in order: none waits (publishes and the half's
        calls run in the background and report back as events)."""
        now = self.clock.now()
        self.event_log.event(now, event)
        commands = self.engine.handle(event, now)
        self.event_log.commands(commands)
        if any(isinstance(x, c.Record) for x in commands):
            # the process's CPU seconds so far (every thread), in the line the file, the API and the watchers get
            cpu = round(time.process_time() - self._cpu_started, 4)
            commands = [
                c.Record({**x.record, MEASURED_FIELDS[0]: cpu}) if isinstance(x, c.Record) else x for x in commands
            ]
        for command in commands:
            if self._outbox and not isinstance(command, c.SendTask):
                self._send_tasks()  # the tasks before whatever the engine asked for after them
            self._execute(command)
        if self._outbox:
            self._send_tasks()
        for watcher in list(self.watchers) if self.watchers else ():  # no copy per event when none watch
            try:
                watcher(now, event, commands)
            except Exception:
                logger.exception("a watcher failed and is removed: %r", watcher)
                self.watchers.remove(watcher)

    @property
    def bus(self) -> BusClient | None:
        """The bus client while serving (its stats: bytes, messages, rejections), for metrics; None before."""
        return self._bus

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self._started

    @property
    def state(self) -> RunState:
        """The daemon's state: starting, the engine's (waiting, running, ...), then finished, failed or stopped."""
        return self._state if self._state.final else RunState(self.engine.state)

    def _execute(self, command: c.Command) -> None:
        if isinstance(command, c.Configure):
            self._heavy(lambda: self._configure(command), "configure", self._prepare)
        elif isinstance(command, c.SendTask):
            self._send_task(command)
        elif isinstance(command, c.Broadcast):
            self._broadcast(command)
        elif isinstance(command, c.Resend):
            self._resend(command)
        elif isinstance(command, c.Receipt):
            self._receipt(command)
        elif isinstance(command, c.Refused):
            self._refused(command)
        elif isinstance(command, c.SendSecAgg):
            self._send_secagg(command)
        elif isinstance(command, c.Aggregate):
            self._heavy(lambda: self._aggregate(command), "aggregate")
        elif isinstance(command, c.Evaluate):
            self._heavy(lambda: e.Evaluated(command.step, self.evaluator()), "evaluate")
        elif isinstance(command, c.Rollback):
            # in the lane, so the next round's Configure (queued after it) reads the model it restores
            self._lane.submit(self._calls.rollback, self._rolled_back)
        elif isinstance(command, c.Record):
            self.run_dir.append_metrics(command.record)
        elif isinstance(command, c.Checkpoint):
            self._checkpoint(command)
        elif isinstance(command, c.PublishStatus):
            self._statuses.put_nowait(self._status_message(command.state, command.fields))
        elif isinstance(command, c.Finish):
            self._state = RunState(command.state)

    def _rolled_back(self, _: Any, exc: BaseException | None) -> None:
        if exc is not None:
            logger.error("rollback failed: %r", exc, exc_info=exc)
            self._events.put_nowait(_Failed(f"the algorithm's rollback failed: {exc!r}"))

    def _heavy(self, call: Callable[[], Any], what: str, then: Callable[[Any], e.Event] | None = None) -> None:
        """Run `call` in the lane; its event (`then` makes it from the result, on the event loop), or
        the failure, comes back through the queue."""

        def done(result: Any, exc: BaseException | None) -> None:
            if exc is None:
                self._events.put_nowait(then(result) if then is not None else result)
            else:
                logger.error("%s failed: %r", what, exc, exc_info=exc)
                self._events.put_nowait(_Failed(f"the algorithm's {what} failed: {exc!r}"))

        self._lane.submit(call, done)

    # -- the half's calls (in the lane's thread) -------------------------------------------

    def _configure(self, command: c.Configure) -> tuple[int, Prepared]:
        """The half's payload for the step's tasks, encoded (in the lane: the model is read whole)."""
        return command.step, self._frames.prepare(command, self._calls.configure(command))

    def _prepare(self, made: tuple[int, Prepared]) -> e.Configured:
        """On the event loop: keep the step's frames for its SendTasks, and only the newest broadcast."""
        step, prepared = made
        if prepared.model is not None:
            for old in [k for k, p in self._prepared.items() if p.model is not None]:
                self._prepared[old].model = None
                self._forget_if_sent(old)
        if prepared.frames or prepared.model is not None:
            self._prepared[step] = prepared
        return e.Configured(step, inline=prepared.inline)

    def _forget_if_sent(self, step: int) -> None:
        prepared = self._prepared.get(step)
        if prepared is not None and not prepared.frames and prepared.model is None:
            del self._prepared[step]

    def _aggregate(self, command: c.Aggregate) -> e.Aggregated:
        aggregated, records = self._calls.aggregate(command)
        for name, lines in records.items():
            self.run_dir.append_records(name, lines)
        return aggregated

    def _checkpoint(self, command: c.Checkpoint) -> None:
        """The snapshot is taken in the lane (between the half's calls); the writer puts it on disk."""

        def done(tensors: Any, exc: BaseException | None) -> None:
            if exc is None:
                self.persistence.submit(command.key, tensors, command.meta)
            else:
                logger.error("checkpoint snapshot failed: %r", exc)

        self._lane.submit(self.persistence.snapshot, done)

    # -- publishing ------------------------------------------------------------------------

    def _send_task(self, command: c.SendTask) -> None:
        """Queued: the tasks an event asks for go out together (`_send_tasks`), one publish call per frame."""
        prepared = self._prepared.get(command.step)
        frame = prepared.frames.pop(command.node, None) if prepared else None
        if prepared is None or frame is None:
            logger.error("no prepared task for %s in step %d", command.node, command.step)
            return
        self._outbox.append((command.node, prepared.tasks.get(command.node, b""), prepared.round, frame))
        self._forget_if_sent(command.step)

    def _send_tasks(self) -> None:
        """Publish the queued tasks: the nodes that share a frame (a round's, the same but for each
        node's task id) in one `publish_many`; a node whose task could not be published is reported
        (TaskUnsent)."""
        outbox, self._outbox = self._outbox, []
        groups: dict[int, list[tuple[str, bytes, int, TaskFrame]]] = {}
        for item in outbox:
            groups.setdefault(id(item[3]), []).append(item)
        for items in groups.values():
            self._spawn(self._publish_tasks(items))

    async def _publish_tasks(self, items: list[tuple[str, bytes, int, TaskFrame]]) -> None:
        round, shared = items[0][2], items[0][3]
        topics = {self.topics.task(node): (node, task_id) for node, task_id, _, _ in items}
        if self._held_for_resend(shared.frame):
            for node, task_id, _, _ in items:
                self._open_tasks[node] = (task_id, round, shared)
        frames = {topic: shared.for_task(task_id) for topic, (_, task_id) in topics.items()}
        try:
            failed = await self._bus_or_fail().publish_many(list(topics), frames, round=round, expiry_s=shared.expiry_s)
        except BusError as exc:
            logger.warning("round %d: %d tasks failed: %s", round, len(topics), exc)
            failed = list(topics)
        for topic in failed:
            node, task_id = topics[topic]
            self._answered(node, task_id)  # reported unsent: the engine no longer waits for it
            logger.warning("round %d: the task to %s could not be published", round, node)
            self._events.put_nowait(e.TaskUnsent(node, task_id))

    def _held_for_resend(self, frame: bytearray) -> bool:
        """Whether a task frame is kept until its node answers (`_resend_open_task`): up to what a model
        may weigh inside a task, plus its header, which every round's shared task frame is. A larger
        per-node payload is not kept: held through training for every node, it would multiply memory."""
        limit = min(max(self.config.policy.inline_model_bytes, 0), self.bus_config.chunk_bytes // 2) + 4096
        return len(frame) <= limit

    def _broadcast(self, command: c.Broadcast) -> None:
        prepared = self._prepared.get(command.step)
        if prepared is None or prepared.model is None:
            logger.error("no model prepared for the broadcast of step %d", command.step)
            return
        frame, expiry_s = prepared.model, prepared.expiry_s

        async def send() -> None:
            try:
                await self._bus_or_fail().publish_frame(
                    self.topics.model(command.round), frame, round=command.round, expiry_s=expiry_s
                )
            except BusError as exc:
                logger.error("round %d: model broadcast failed: %s", command.round, exc)

        self._spawn(send())

    def _resend(self, command: c.Resend) -> None:
        prepared = self._prepared.get(command.step)
        if prepared is None or prepared.model is None:
            return
        self._spawn(
            self._bus_or_fail().publish_frame(
                self.topics.direct_model(command.node), prepared.model, round=prepared.round, expiry_s=prepared.expiry_s
            )
        )

    def _send_secagg(self, command: c.SendSecAgg) -> None:
        """A step of secure aggregation to one node; it expires with the step (`secure_timeout_s`)."""
        message = Message(
            kind=Kind(SECAGG_KINDS[type(command.message)]),
            federation=self.config.federation,
            round=command.round,
            sender=SENDER,
            meta=command.message.to_meta(),
        )
        topic = self.topics.node_secagg(command.node)
        self._spawn(self._bus_or_fail().publish(topic, message, expiry_s=self.config.secure_timeout_s))

    def _receipt(self, command: c.Receipt) -> None:
        receipt = Message(
            kind=Kind.RECEIPT,
            federation=self.config.federation,
            round=command.round,
            sender=SENDER,
            meta=Receipt(
                status=command.status, reason=command.reason, task_id=command.task, update_id=command.update_id
            ).to_meta(),
        )
        self._bus_or_fail().publish_advisory(self.topics.receipt(command.node), receipt)

    def _refused(self, command: c.Refused) -> None:
        if command.protocol:
            self._bus_or_fail().stats.rejected[command.reason] += 1
            self._refusals.warning(
                (command.reason, command.node),
                "refused a message from %s: %s: %s",
                command.node,
                command.reason,
                command.detail,
            )
        else:
            logger.info("update from %s not folded: %s: %s", command.node, command.reason, command.detail)

    def _status_message(self, state: str, fields: Mapping[str, Any]) -> Message:
        """The status the engine asked for (`fields`: what it says besides the state; none: the engine's now)."""
        status = CoordinatorStatus(
            state=RunState(state), run_id=self.run_id, method=self.fingerprint.to_meta(),
            **(fields or self._status_fields()),
        )  # fmt: skip
        return Message(
            kind=Kind.COORDINATOR_STATUS,
            federation=self.config.federation,
            round=-1 if status.round is None else status.round,
            sender=SENDER,
            meta=status.to_meta(),
        )

    def _status_fields(self) -> dict[str, Any]:
        return dict(self.engine.status().fields)

    async def _publish_statuses(self) -> None:
        """Statuses in the order the engine made them: every round on the status topic (watchers),
        on the state topic (nodes) only when the state changed."""
        while True:
            message = await self._statuses.get()
            try:
                await self._publish_status(message)
            except BusError as exc:
                logger.warning("could not publish the status: %s", exc)
            finally:
                self._statuses.task_done()

    async def _publish_status(self, message: Message) -> None:
        bus = self._bus_or_fail()
        await bus.publish(self.topics.coordinator_status, message, retain=True)
        state = RunState(message.meta["state"])
        if state != self._published_state:
            await bus.publish(self.topics.coordinator_state, message, retain=True)
            self._published_state = state

    async def _final_status(self, publisher: asyncio.Task[None]) -> None:
        final: Message | None = None
        try:
            async with asyncio.timeout(5):
                await self._statuses.join()
                final = self._status_message(self._state, {})
                await self._publish_status(final)
        except (BusError, TimeoutError) as exc:
            logger.warning("could not publish the final status: %s", exc)
            if final is not None and self._bus is not None and self._bus.failed:
                await self._final_status_anew(final)
        finally:
            publisher.cancel()

    async def _final_status_anew(self, message: Message) -> None:
        """The bus client died (its will said `offline` on the status topic, which nodes do not
        follow): one fresh connection publishes the final state, so that the nodes learn the run
        ended instead of waiting for tasks that never come (issue 31)."""
        client = BusClient(
            self.bus_config,
            client_id=f"{self.client_id}-final",
            federation=self.config.federation,
            logger=logger.getChild("bus"),
        )
        try:
            async with asyncio.timeout(10), client as bus:
                await bus.publish(self.topics.coordinator_status, message, retain=True)
                await bus.publish(self.topics.coordinator_state, message, retain=True)
            logger.info("the final state (%s) published through a new connection", message.meta["state"])
        except (BusError, TimeoutError) as exc:
            logger.warning("the nodes could not be told that the run ended: %s", exc)

    def _spawn(self, coro: Any) -> None:
        """Background publishes are kept and harvested, never fire-and-forget."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._harvest)

    def _harvest(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("background publish failed: %s", task.exception())

    def _bus_or_fail(self) -> BusClient:
        if self._bus is None:
            raise RuntimeError("the coordinator is not connected")
        return self._bus

    # -- persistence and the summary -------------------------------------------------------

    def _resume(self) -> dict[str, Any] | None:
        """The engine restored from the checkpoint; what the event log says of it (None: nothing to resume)."""
        meta = self.persistence.resume(
            federation=self.config.federation, seed=self.config.seed, engine=self.config.engine
        )
        if meta is None:
            return None
        try:
            self.engine.restore(meta)
        except (ValueError, KeyError, TypeError) as exc:
            raise CoordinatorError(f"checkpoint does not match this experiment: {exc}") from exc
        self.run_dir.truncate_metrics_after(int(meta["round"]))
        logger.info("resumed from the checkpoint of round %d (model version %d)", meta["round"], self.engine.version)
        return {"round": int(meta["round"]), "version": self.engine.version, "run_id": self.run_id}

    def _write_summary(self) -> Summary:
        wall = time.monotonic() - self._started
        checkpoints = self.persistence.writer
        summary = {
            **self._extra_summary,
            "method": self.config.method,
            "federation": self.config.federation,
            "engine": self.config.engine,
            "state": self._state,
            "nodes": len(self.registry),
            **outcome_fields(self.engine, self.evaluator, self.half, self._calls.node_privacy),
            "wall_seconds": round(wall, 3),
            "checkpoints": {
                "written_round": checkpoints.written_round,
                "replaced": checkpoints.replaced,
                "failures": checkpoints.failures,
            },
            "bus": self._bus.stats.as_dict() if self._bus else {},
        }
        write_run_files(self.run_dir, summary, self.engine.participation, self.registry)
        completed = int(summary.get("rounds_completed", summary.get("aggregations_completed", 0)))
        return Summary(completed, summary["final_accuracy"], summary["best_accuracy"], wall, self._state)
