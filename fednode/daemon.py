"""The node daemon: one MQTT identity that announces itself, acknowledges tasks, trains and reports.

Per round: a task arrives on the node's own topic; the node subscribes to the round's model topic,
acknowledges, receives the one broadcast model, trains in a worker thread (one node of the process
at a time), and publishes its update. A small model comes inside the task itself: no subscription
and no acknowledgement then. Malformed or out-of-round messages are counted and logged.
With ``hosting.vectorize`` the nodes of a process that received the same task are trained together
(`fednode.groups`); each still publishes its own update. The node's scenario script (`NodeConfig.script`)
is played in wall time (`fednode.scripted`): it goes offline and online, drops tasks, and sleeps for
its modelled link and compute time around training.

The daemon is the session (connection, subscriptions, what comes in, the coordinator's state); its
parts are handed to it or made from its config: the task's course from arrival to update
(`fednode.task_course`, with the task as the node holds it in `fednode.task`), the round's job
(`fednode.update_job`), the trainer that makes the update (`fednode.trainer`; a site aggregator
hands in its own), what it tells the coordinator (`fednode.reports`), the retained status
(`fednode.presence`), the method check (`fednode.method_check`) and secure aggregation
(`fednode.masking`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from fedmq.broker import BusClient, BusConfig, Envelope, Kind, Message, Topics, Will
from fedmq.broker.background import Background
from fedmq.broker.errors import BusError
from fedmq.fedcore.algorithms.base import NodeHalf
from fedmq.fedcore.algorithms.fingerprint import fingerprint_of
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.protocol import CoordinatorStatus, ProtocolError, Receipt, RunState
from fedmq.fednode.config import NodeConfig
from fedmq.fednode.masking import KINDS as SECAGG_KINDS
from fedmq.fednode.masking import SecureAggregationPart
from fedmq.fednode.method_check import MethodCheck
from fedmq.fednode.presence import Presence
from fedmq.fednode.reports import Reports
from fedmq.fednode.scenario import Transition
from fedmq.fednode.scripted import ScriptPlayer
from fedmq.fednode.task import Task, TaskError
from fedmq.fednode.task_course import TaskCourse
from fedmq.fednode.trainer import LocalTrainer, NoUpdate, Trainer
from fedmq.fednode.update_job import UpdateJobs
from fedmq.fednode.workspace import Workspace

__all__ = ["NoUpdate", "NodeDaemon", "Task", "TaskError", "serve_nodes"]

logger = logging.getLogger(__name__)

CONNECTS_AT_ONCE = 64
"""Nodes of one process that connect to the broker at the same time (the rest wait their turn, and
their connect timeout starts with it): 10,000 nodes in two processes all at once starved some."""


class _NodeLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Prefixes records with the node id: one process hosts many nodes and shares one log."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        kwargs.setdefault("extra", {}).update(self.extra or {})
        return f"[{(self.extra or {}).get('node_id')}] {msg}", kwargs


FROM_COORDINATOR = frozenset({"node-task", "node-model", "node-receipt", "node-secagg", "model", "coordinator-state"})
"""Channels only the coordinator publishes on."""


class NodeDaemon:
    def __init__(
        self,
        config: NodeConfig,
        bus_config: BusConfig,
        half: NodeHalf,
        data: TensorDataset,
        workspace: Workspace,
        *,
        trainer: Trainer | None = None,
        share_group: str | None = None,
    ) -> None:
        """`trainer` makes the updates (by default `LocalTrainer`: the method's node half on `data`; a site
        aggregator hands in its own). With `share_group`, several daemons are one node: each subscribes
        to the node's tasks through the MQTT v5 shared subscription ``$share/GROUP/...`` (the broker
        hands each task to one live daemon), and one that sees the node announced offline while it is
        alive (another's will) announces it online again."""
        self.config = config
        self.bus_config = bus_config
        self.half = half
        self.data = data
        self.workspace = workspace
        self.topics = Topics(config.federation)
        self.node_id = config.node_id
        self.client_id = f"{config.federation}-{config.node_id}"
        """The MQTT client id (a broker lets one connection hold it at a time)."""
        self.log = _NodeLog(logger, {"node_id": self.node_id})
        self.trainer: Trainer = trainer or LocalTrainer(config, half, data, workspace, self.log)
        self.share_group = share_group
        self.fingerprint = fingerprint_of(half, workspace.schema)
        """The method, hyperparameters and model schema this node trains: announced, and checked in every task."""
        self.method_check = MethodCheck(self.fingerprint, self.log)
        self.crashed = False
        self.run_outcome = RunState.STOPPED
        """How the coordinator's run ended, as its last status said (stopped until it says)."""
        self._bus: BusClient | None = None
        self._run_id: str | None = None
        self._stop = asyncio.Event()
        self.background = Background(self.log)
        """The steps nothing waits for (announcements, unsubscriptions, the scenario), kept until they end."""
        self.reports = Reports(config.federation, self.node_id, self.log)
        """The node's acknowledgements, updates, failures and secure aggregation steps (`fednode.reports`)."""
        self.player = ScriptPlayer(config.script, self.node_id, log=self.log)
        self.connected = asyncio.Event()
        """Set once the node is connected and subscribed, cleared when `serve` ends (readiness for supervisors)."""
        self._drain_asked = asyncio.Event()
        self.connect_gate: asyncio.Semaphore | None = None
        """Shared by the nodes of a process (`serve_nodes`): how many connect at once."""
        self.presence = Presence(
            config, data=data, device=str(workspace.device), method=self.fingerprint.to_meta(), trainer=self.trainer,
            online=lambda: self.player.online, shared=share_group is not None, spawn=self.background.spawn,
            log=self.log,
        )  # fmt: skip
        """The node's retained status (`fednode.presence`)."""
        self.secure = SecureAggregationPart(
            federation=config.federation, node_id=self.node_id, num_samples=len(data), publish=self.reports.secagg,
            log=self.log,
        )  # fmt: skip
        """The secure aggregation of the node's tasks that ask for it (`fednode.masking`)."""
        self.updates = UpdateJobs(config, len(data), self.trainer, self.player, self.secure, self.reports, self.log)
        """Each round's training and update, once its model came (`fednode.update_job`)."""
        self.tasks = TaskCourse(
            config, workspace, trainer=self.trainer, method_check=self.method_check, player=self.player,
            secure=self.secure, reports=self.reports, updates=self.updates, background=self.background,
            bus=self._bus_or_fail, crash=self._crash, log=self.log,
        )  # fmt: skip
        """The node's task from its arrival to its update (`fednode.task_course`)."""

    async def serve(self) -> None:
        """Run until the run finishes (with `exit_when_done`), a crash fault, or cancellation.

        The scenario's time 0 is now, before connecting."""
        started = time.monotonic()
        will = Will(self.topics.node_status(self.node_id), self.presence.status("offline"))
        client = BusClient(
            self.bus_config,
            client_id=self.client_id,
            federation=self.config.federation,
            will=will,
            on_connect=self.presence.announce_when_subscribed,
            logger=logger.getChild("bus"),
        )
        self._attach(client)  # before connecting: the on-connect hook announces through it
        async with contextlib.AsyncExitStack() as stack:
            bus = await self._connect(stack, client)
            self.connected.set()
            if self.config.script.transitions:
                self.background.spawn(self.player.play(started, self._on_transition), f"scenario-{self.node_id}")
            receiver = asyncio.create_task(self._receive(bus))
            stopper = asyncio.create_task(self._stop.wait())
            drainer = asyncio.create_task(self._drain_when_asked(), name=f"drain-{self.node_id}")
            try:
                await asyncio.wait({receiver, stopper, drainer}, return_when=asyncio.FIRST_COMPLETED)
                if receiver.done():
                    receiver.result()
                if drainer.done():
                    drainer.result()
            finally:
                self.connected.clear()
                self.presence.subscribed.clear()
                self.tasks.withdraw()
                job = self.tasks.job
                for task in (receiver, stopper, drainer, job, *self.background):
                    if task is not None:
                        task.cancel()
                await asyncio.gather(receiver, stopper, drainer, *([job] if job else []), return_exceptions=True)
                self.log.info("stopping after %d rounds trained; bus %s", self.updates.sent, bus.stats.as_dict())
                if self.config.script.scripted:
                    self.log.info("scenario: %s", self.player.counts())
                # a clean DISCONNECT does not fire the will, so say goodbye explicitly; without a
                # connection there is nobody to tell (the broker is gone, or it fired the will already)
                if not self.crashed and bus.connected:
                    goodbye = self.presence.status("offline")
                    try:
                        await asyncio.wait_for(bus.publish(self.presence.topic, goodbye, retain=True), 2)
                    except (BusError, TimeoutError) as exc:
                        self.log.warning("could not publish the offline status: %s", exc)

    def _attach(self, bus: BusClient) -> None:
        """The node's bus client, to the daemon and the parts that publish."""
        self._bus = self.presence.bus = self.reports.bus = bus

    async def _connect(self, stack: contextlib.AsyncExitStack, client: BusClient) -> BusClient:
        """Connect and subscribe, holding the process's connection gate (`serve_nodes`): thousands of
        nodes of one process connecting at once kept its event loop too busy to start some of them
        within their connect timeout."""
        async with self.connect_gate or contextlib.nullcontext():
            bus = await stack.enter_async_context(client)
            await bus.subscribe(*self._subscriptions())
        self.presence.subscribed.set()
        return bus

    def _subscriptions(self) -> list[str]:
        """The node's inbox (task, model, receipt) and the coordinator's state; with a share group, the
        task topic shared and the node's own status (another daemon's will, to answer)."""
        topics = [*self.topics.node_inbox(self.node_id), self.topics.coordinator_state]
        if self.share_group is None:
            return topics
        task = self.topics.task(self.node_id)
        topics = [f"$share/{self.share_group}/{task}" if t == task else t for t in topics]
        return [*topics, self.topics.node_status(self.node_id)]

    def drain(self, reason: str) -> None:
        """Stop taking tasks and end `serve` once the task in hand is dealt with: a training job in
        progress finishes and sends its update; a task whose model has not come is abandoned, and a
        task that arrives meanwhile refused, each reported to the coordinator as a failure with
        `reason` (it then stops waiting for this node); then the node says goodbye (offline)."""
        if self.tasks.draining is None:
            self.tasks.draining = reason
            self._drain_asked.set()

    @property
    def draining(self) -> str | None:
        """Why the node is draining, or None."""
        return self.tasks.draining

    async def _drain_when_asked(self) -> None:
        await self._drain_asked.wait()
        await self.tasks.drain()

    async def _on_transition(self, transition: Transition) -> None:
        """The scenario took the node offline (dropping the task in hand) or brought it back."""
        if transition.online:
            self.log.info("scenario: online at %g s", transition.at)
        else:
            how = "crashes" if transition.crash else "goes offline"
            self.log.info("scenario: %s at %g s, dropping the work in hand", how, transition.at)
            self.tasks.abandon()
        await self.presence.announce_or_warn(f"({'online' if self.player.online else 'offline'}) of the scenario")

    # -- receiving -------------------------------------------------------------------------

    async def _receive(self, bus: BusClient) -> None:
        async for envelope in bus.messages():
            try:
                await self._dispatch(envelope)
            except ProtocolError as exc:
                bus.reject(exc.reason, envelope, exc.detail)
            except Exception:  # one message never takes the daemon down
                bus.stats.rejected["internal-error"] += 1
                self.log.exception("error while handling a message on %s", envelope.topic)

    async def _dispatch(self, envelope: Envelope) -> None:
        route = self.topics.route(envelope.topic)
        message = envelope.message
        if route is None:
            raise TaskError("unknown-topic", f"topic {envelope.topic} is outside the scheme")
        if route.channel == "node-status":
            self._on_own_status(message)
            return
        if route.channel in FROM_COORDINATOR and message.sender != "coordinator":
            raise TaskError("wrong-sender", f"{route.channel} from {message.sender!r}, expected the coordinator")
        if route.channel == "coordinator-state" and message.kind == Kind.COORDINATOR_STATUS:
            self._on_coordinator_status(message)
        elif route.channel == "node-task" and message.kind == Kind.TASK:
            await self.tasks.on_task(message, envelope.size)
        elif route.channel in ("model", "node-model") and message.kind == Kind.MODEL:
            await self.tasks.on_model(message, envelope.size)
        elif route.channel == "node-receipt" and message.kind == Kind.RECEIPT:
            self._on_receipt(message)
        elif route.channel == "node-secagg" and message.kind in SECAGG_KINDS:
            await self.secure.on_message(message)
        else:
            raise TaskError("unexpected-kind", f"{message.kind} on {envelope.topic}")

    def _on_own_status(self, message: Message) -> None:
        """The node's own status, subscribed with a share group only: another daemon of the node went
        offline (its will) while this one is alive and could answer, so the node is announced again."""
        offline = message.meta.get("state") == "offline"
        alive = self.tasks.draining is None and not self.crashed
        if self.share_group is not None and offline and alive and self.presence.announcement(True).online:
            self.log.info("another daemon of this node went offline; announcing the node again")
            self.background.spawn(self.presence.announce(), f"announce-{self.node_id}")

    def _on_coordinator_status(self, message: Message) -> None:
        status = CoordinatorStatus.from_meta(message.meta)
        if status.state.active:
            if status.run_id != self._run_id and self._bus is not None:
                # the retained status a (re)started coordinator reads first may not be this node's any
                # more (64 random bytes left there by another client, issue 31): one status a run
                self.background.spawn(
                    self.presence.announce_or_warn("to the new coordinator run"), f"reannounce-{self.node_id}"
                )
            self._run_id = status.run_id
            self.method_check.coordinator_runs(status.method)
        elif status.state.final and status.run_id is not None and status.run_id == self._run_id:
            self.run_outcome = status.state
            self.log.info("coordinator reports the run %s", status.state)
            if self.config.exit_when_done:
                self._stop.set()

    def _on_receipt(self, message: Message) -> None:
        """Receipts are advisory (the coordinator's metrics are the truth): logged, never counted."""
        try:
            receipt = Receipt.from_meta(message.meta)
        except ProtocolError as exc:
            self.log.warning("update for round %d: unreadable receipt: %s", message.round, exc)
            return
        if receipt.status == "received":
            self.log.debug("update for round %d received by the coordinator", message.round)
        else:
            self.log.warning("update for round %d was %s: %s", message.round, receipt.status, receipt.reason)

    def _crash(self) -> None:
        """The crash fault: the connection dropped without a goodbye (the broker fires the will)."""
        self.crashed = True
        self._bus_or_fail().abort()
        self._stop.set()

    @property
    def rounds_trained(self) -> int:
        """Updates sent."""
        return self.updates.sent

    @property
    def bus(self) -> BusClient | None:
        """The node's bus client once `serve` began (its stats and connection state, for metrics)."""
        return self._bus

    def _bus_or_fail(self) -> BusClient:
        if self._bus is None:
            raise RuntimeError("the node is not connected")
        return self._bus


async def serve_nodes(daemons: list[NodeDaemon]) -> list[str]:
    """Host several node daemons in one event loop; one failing does not stop the others. Returns the
    ids of those that stopped on a broker error (unreachable, refused), for the exit code."""
    failed: list[str] = []
    gate = asyncio.Semaphore(CONNECTS_AT_ONCE)
    for daemon in daemons:
        daemon.connect_gate = gate

    async def guarded(daemon: NodeDaemon) -> None:
        try:
            await daemon.serve()
        except BusError as exc:
            daemon.log.error("stopped: %s", exc)
            failed.append(daemon.node_id)

    async with asyncio.TaskGroup() as group:
        for daemon in daemons:
            group.create_task(guarded(daemon), name=f"node-{daemon.node_id}")
    return sorted(failed)
