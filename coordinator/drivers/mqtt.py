"""The coordinator daemon: the adapter between MQTT and the round engine, assembled from its parts.

Messages become events (`coordinator.engine.events`), the engine decides, and its commands become
publishes and the algorithm half's heavy calls. The daemon drives the engine, one event at a time,
and executes what it asks through its parts:

- `Inbox` (`drivers.inbox`): every incoming message checked (budget, topic, sender, kind, method)
  and made the engine's event; a refused one is counted and logged, never the daemon's end;
- `Outbox` (`drivers.outbox`): tasks, model broadcasts and resends, secure aggregation's steps and
  receipts, with each node's open task held to send again after a reconnection;
- `HeavyCalls` (`drivers.heavy`): configure, aggregate, evaluate, rollback and the checkpoint's
  snapshot, one after another on one worker thread, back as events;
- `Statuses` (`drivers.statuses`): the retained status and state, in the engine's order, the last
  one published even when the bus client died.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fedmq.broker import BusClient, BusConfig, Topics, Will
from fedmq.broker.background import Background
from fedmq.broker.errors import BusError
from fedmq.coordinator.config import CoordinatorConfig
from fedmq.coordinator.drivers.heavy import Failed, HeavyCalls
from fedmq.coordinator.drivers.inbox import Inbox
from fedmq.coordinator.drivers.outbox import Outbox
from fedmq.coordinator.drivers.statuses import Statuses
from fedmq.coordinator.engine import Engine, make_engine
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.engine.base import new_task_id
from fedmq.coordinator.engine.clock import Clock, MonotonicClock
from fedmq.coordinator.errors import CoordinatorError
from fedmq.coordinator.halfcalls import HalfCalls, update_schema
from fedmq.coordinator.observers.reporting import MEASURED_FIELDS, Evaluator, outcome_fields, write_run_files
from fedmq.coordinator.registry import NodeRegistry
from fedmq.coordinator.storage.eventlog import FILENAME as EVENT_LOG
from fedmq.coordinator.storage.eventlog import EventLog, log_header
from fedmq.coordinator.storage.persistence import Persistence
from fedmq.coordinator.storage.run_dir import RunDir
from fedmq.coordinator.updates import ingest
from fedmq.fedcore.algorithms.base import CoordinatorHalf
from fedmq.fedcore.algorithms.fingerprint import fingerprint_of
from fedmq.fedcore.participation import ParticipationRecord
from fedmq.fedcore.protocol import RunState
from fedmq.fedcore.tensors import schema_of

logger = logging.getLogger(__name__)


EngineFactory = Callable[[Callable[[], bytes]], Engine]
"""Makes a coordinator's engine from its task-id maker (which records each id in the event log, so that
a replay draws the same ones): the part a site aggregator swaps for its relay engine."""


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


class Coordinator:
    def __init__(
        self,
        config: CoordinatorConfig,
        bus_config: BusConfig,
        half: CoordinatorHalf,
        *,
        evaluator: Evaluator | None = None,
        persistence: Persistence | None = None,
        extra_summary: Mapping[str, Any] | None = None,
        clock: Clock | None = None,
        new_engine: EngineFactory | None = None,
        calls: HalfCalls | None = None,
        run_id: str | None = None,
    ) -> None:
        """The parts the composition root hands in (`experiments.build`; a site aggregator's relay,
        `aggregator.site`): `evaluator` (by default none: the run does not evaluate), `persistence` (the
        run directory and checkpoints; by default the config's `out_dir`), `new_engine` (by default the
        round policy the config names), `calls` (how the half's heavy calls are made), `clock` and
        `run_id` (by default a fresh random one)."""
        self.config = config
        self.bus_config = bus_config
        self.half = half
        self.clock = clock or MonotonicClock()
        self.topics = Topics(config.federation)
        self.registry = NodeRegistry()
        self.fingerprint = fingerprint_of(half, schema_of(half.model.state_dict()))
        """The method, hyperparameters and model schema nodes must share: in every task and status."""
        self.persistence = persistence or Persistence(RunDir(config.out_dir), half)
        self.run_dir = self.persistence.run_dir
        self.run_id = run_id or os.urandom(8).hex()
        self.client_id = f"{config.federation}-coordinator"
        """The MQTT client id (a broker lets one connection hold it at a time)."""
        self.evaluator = evaluator or Evaluator(half, None, None, config.eval_device)
        self.event_log = EventLog(self.run_dir.root / EVENT_LOG)
        new_id = self.event_log.recording(new_task_id)
        self.engine = new_engine(new_id) if new_engine is not None else self._default_engine(new_id)
        self._events: asyncio.Queue[e.Event | Failed] = asyncio.Queue()
        self.background = Background(logger)
        """The publishes nothing waits for, kept until they end."""
        self.outbox = Outbox(config, bus_config, self.fingerprint.digest, self.post, self.background)
        self.heavy = HeavyCalls(
            calls or HalfCalls(half, config), self.outbox, self.evaluator, self.persistence, self.run_dir,
            self._events.put_nowait,
        )  # fmt: skip
        self.inbox = Inbox(
            config, bus_config, self.registry, self.fingerprint, self.outbox, self.post, self.background,
            lambda message: ingest(message, self.engine.schema, config.compression),
        )  # fmt: skip
        self.statuses = Statuses(
            bus_config, config.federation, self.client_id, self.run_id, self.fingerprint,
            lambda: self.engine.status().fields,
        )  # fmt: skip
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
        return make_engine(self.config, schema, evaluates=self.evaluator.test is not None, new_id=new_id)

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
        will = Will(self.topics.coordinator_status, self.statuses.message(RunState.OFFLINE, {}))
        client = BusClient(
            self.bus_config,
            client_id=self.client_id,
            federation=self.config.federation,
            will=will,
            logger=logger.getChild("bus"),
        )
        async with client as bus:
            self._attach(bus)
            await bus.subscribe(self.topics.all_node_status)
            # acks and updates keep a retained publish's flag even live (MQTT v5), to be refused (`Inbox.dispatch`)
            subscriptions = [self.topics.all_acks, self.topics.all_updates]
            if self.config.secure_aggregation is not None:
                subscriptions.append(self.topics.all_secagg)
            await bus.subscribe(*subscriptions, retain_as_published=True)
            self.connected.set()
            receiver = asyncio.create_task(self.inbox.receive(bus), name="coordinator-receive")
            driver = asyncio.create_task(self._drive(), name="coordinator-drive")
            statuses = asyncio.create_task(self.statuses.publish_in_order(), name="coordinator-status")
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
                for task in (receiver, driver, *self.background, *self.inbox.ingests):
                    task.cancel()
                await asyncio.gather(receiver, driver, return_exceptions=True)
                await self.heavy.close()
                await self.persistence.flush()  # the last checkpoint is on disk before exit
                self.event_log.close()
                summary = self._write_summary()
                await asyncio.shield(self.statuses.publish_final(self._state, statuses))
        return summary

    def _attach(self, bus: BusClient) -> None:
        """The connected bus, to the daemon and the parts that publish."""
        self._bus = self.outbox.bus = self.inbox.bus = self.statuses.bus = bus

    async def _stop_engine(self) -> None:
        """Let the engine fold what it has accepted (async buffer) before the run stops."""
        try:
            async with asyncio.timeout(30):
                await self.inbox.ingests.settle()  # the updates being read reach the engine
                self._feed(e.Stop())
                while not self.engine.finished:
                    self._feed(await self._next_event())
        except (TimeoutError, CoordinatorError) as exc:
            logger.warning("stopping without folding the buffered updates: %r", exc)

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
            if isinstance(item, Failed):
                raise CoordinatorError(str(item))
            return item
        try:
            async with asyncio.timeout(None if deadline is None else max(deadline - self.clock.now(), 0)):
                item = await self._events.get()
        except TimeoutError:
            return e.Tick()
        if isinstance(item, Failed):
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
            if self.outbox.pending and not isinstance(command, c.SendTask):
                self.outbox.flush()  # the tasks before whatever the engine asked for after them
            self._execute(command)
        if self.outbox.pending:
            self.outbox.flush()
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
            self.heavy.configure(command)
        elif isinstance(command, c.SendTask):
            self.outbox.send_task(command)
        elif isinstance(command, c.Broadcast):
            self.outbox.broadcast(command)
        elif isinstance(command, c.Resend):
            self.outbox.resend(command)
        elif isinstance(command, c.Receipt):
            self.outbox.receipt(command)
        elif isinstance(command, c.Refused):
            self.inbox.refused(command)
        elif isinstance(command, c.SendSecAgg):
            self.outbox.send_secagg(command)
        elif isinstance(command, c.Aggregate):
            self.heavy.aggregate(command)
        elif isinstance(command, c.Evaluate):
            self.heavy.evaluate(command)
        elif isinstance(command, c.Rollback):
            self.heavy.rollback()
        elif isinstance(command, c.Record):
            self.run_dir.append_metrics(command.record)
        elif isinstance(command, c.Checkpoint):
            self.heavy.checkpoint(command)
        elif isinstance(command, c.PublishStatus):
            self.statuses.put(command.state, command.fields)
        elif isinstance(command, c.Finish):
            self._state = RunState(command.state)

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
            **outcome_fields(self.engine, self.evaluator, self.half, self.heavy.calls.node_privacy),
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
