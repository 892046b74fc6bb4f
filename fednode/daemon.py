"""The node daemon: one MQTT identity that announces itself, acknowledges tasks, trains and reports.

Per round: a task arrives on the node's own topic; the node subscribes to the round's model topic,
acknowledges, receives the one broadcast model, trains in a worker thread (one node of the process
at a time), and publishes its update. A small model comes inside the task itself: no subscription
and no acknowledgement then. Malformed or out-of-round messages are counted and logged.
With ``hosting.vectorize`` the nodes of a process that received the same task are trained together
(`fednode.groups`); each still publishes its own update. The node's scenario script (`NodeConfig.script`)
is played in wall time (`fednode.scripted`): it goes offline and online, drops tasks, and sleeps for
its modelled link and compute time around training.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from fedmq.broker import BusClient, BusConfig, Envelope, Kind, Message, Topics, Will, encode
from fedmq.broker.errors import BusError
from fedmq.fedcore import protocol
from fedmq.fedcore.algorithms.base import GroupMember, NodeHalf, Payload, TaskInput
from fedmq.fedcore.algorithms.fingerprint import MethodFingerprint, fingerprint_of
from fedmq.fedcore.compression import compress_update
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.masked import weighted_change
from fedmq.fedcore.protocol import (
    Announcement,
    CoordinatorStatus,
    ProtocolError,
    Receipt,
    SecAggUp,
    Update,
    UpdateFailed,
)
from fedmq.fedcore.secagg import SecAggSettings
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.tensors import flatten_groups, schema_mismatch, split_groups
from fedmq.fedcore.training import TrainSettings
from fedmq.fednode.config import NodeConfig
from fedmq.fednode.masking import KINDS as SECAGG_KINDS
from fedmq.fednode.masking import Draft, SecureAggregationPart
from fedmq.fednode.scenario import Transition
from fedmq.fednode.scripted import ScriptPlayer
from fedmq.fednode.workspace import Workspace

logger = logging.getLogger(__name__)

CONNECTS_AT_ONCE = 64
"""Nodes of one process that connect to the broker at the same time (the rest wait their turn, and
their connect timeout starts with it): 10,000 nodes in two processes all at once starved some."""


class _NodeLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Prefixes records with the node id: one process hosts many nodes and shares one log."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        kwargs.setdefault("extra", {}).update(self.extra or {})
        return f"[{(self.extra or {}).get('node_id')}] {msg}", kwargs


class NoUpdate(Exception):
    """The node has no update for a task, for a reason it reports to the coordinator (a site
    aggregator whose nodes sent nothing): a failure of the round, not of the daemon."""


FROM_COORDINATOR = frozenset({"node-task", "node-model", "node-receipt", "node-secagg", "model", "coordinator-state"})
"""Channels only the coordinator publishes on."""

TaskError = ProtocolError
"""What the node rejects a message with (the protocol's error: its reason is the counter)."""


@dataclass(frozen=True, slots=True)
class Task:
    round: int
    attempt: int
    task_id: bytes
    model_topic: str
    settings: TrainSettings
    received_at: float
    inline: bool = False
    """The task carries the model itself (small models): no subscription, no acknowledgement."""
    version: int | None = None
    """The model version the task was built from, echoed as the update's `base_version` (None from
    a coordinator that sends none)."""
    frame_bytes: int = 0
    """The size of the task's frame as received (the scenario's link time counts it)."""
    deadline_s: float | None = None
    """How long after its `sent_at` the task may still be acted on (None: always)."""
    method: str | None = None
    """The coordinator's method digest (None: it named none)."""
    model_id: bytes | None = None
    """The id the task's model broadcast carries (None from older coordinators, whose broadcast
    quoted the task id)."""
    secure: SecAggSettings | None = None
    """With secure aggregation, its settings: the update is masked (`fedcore.secure_task`)."""

    @property
    def model_key(self) -> bytes:
        """What the task's model quotes: its `model_id`, or (older coordinators) the task id."""
        return self.task_id if self.model_id is None else self.model_id


class NodeDaemon:
    def __init__(
        self, config: NodeConfig, bus_config: BusConfig, half: NodeHalf, data: TensorDataset, workspace: Workspace
    ) -> None:
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
        self.fingerprint = fingerprint_of(half, workspace.schema)
        """The method, hyperparameters and model schema this node trains: announced, and checked in every task."""
        self._method_warned: str | None = None
        self.rounds_trained = 0
        self.trainings = 0
        self.train_seconds = 0.0
        """Local trainings finished and their wall seconds (an update abandoned afterwards included), for metrics."""
        self.crashed = False
        self._bus: BusClient | None = None
        self._task: Task | None = None
        self._job: asyncio.Task[None] | None = None
        self._run_id: str | None = None
        self._stop = asyncio.Event()
        self._background: set[asyncio.Task[Any]] = set()
        self.player = ScriptPlayer(config.script, self.node_id, log=self.log)
        self._status_lock = asyncio.Lock()
        self.connected = asyncio.Event()
        """Set once the node is connected and subscribed, cleared when `serve` ends (readiness for supervisors)."""
        self._drain_asked = asyncio.Event()
        self._draining: str | None = None
        self.connect_gate: asyncio.Semaphore | None = None
        """Shared by the nodes of a process (`serve_nodes`): how many connect at once."""
        self._subscribed = asyncio.Event()
        """Set once the first connection's subscriptions are granted (later ones restore them first)."""
        self.secure = SecureAggregationPart(
            federation=config.federation, node_id=self.node_id, num_samples=len(data), publish=self._send_secagg,
            log=self.log,
        )  # fmt: skip
        """The secure aggregation of the node's tasks that ask for it (`fednode.masking`)."""

    async def serve(self) -> None:
        """Run until the run finishes (with `exit_when_done`), a crash fault, or cancellation.

        The scenario's time 0 is now, before connecting."""
        started = time.monotonic()
        will = Will(self.topics.node_status(self.node_id), self._status("offline"))
        client = BusClient(
            self.bus_config,
            client_id=self.client_id,
            federation=self.config.federation,
            will=will,
            on_connect=self._announce_when_subscribed,
            logger=logger.getChild("bus"),
        )
        self._bus = client  # before connecting: the on-connect hook announces through it
        async with contextlib.AsyncExitStack() as stack:
            bus = await self._connect(stack, client)
            self.connected.set()
            if self.config.script.transitions:
                self._spawn(self.player.play(started, self._on_transition), f"scenario-{self.node_id}")
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
                self._subscribed.clear()
                if self._task is not None:
                    self._leave_group(self._task)
                for task in (receiver, stopper, drainer, self._job, *self._background):
                    if task is not None:
                        task.cancel()
                await asyncio.gather(
                    receiver, stopper, drainer, *([self._job] if self._job else []), return_exceptions=True
                )
                self.log.info("stopping after %d rounds trained; bus %s", self.rounds_trained, bus.stats.as_dict())
                if self.config.script.scripted:
                    self.log.info("scenario: %s", self.player.counts())
                # a clean DISCONNECT does not fire the will, so say goodbye explicitly; without a
                # connection there is nobody to tell (the broker is gone, or it fired the will already)
                if not self.crashed and bus.connected:
                    try:
                        await asyncio.wait_for(
                            bus.publish(self.topics.node_status(self.node_id), self._status("offline"), retain=True), 2
                        )
                    except (BusError, TimeoutError) as exc:
                        self.log.warning("could not publish the offline status: %s", exc)

    async def _connect(self, stack: contextlib.AsyncExitStack, client: BusClient) -> BusClient:
        """Connect and subscribe, holding the process's connection gate (`serve_nodes`): thousands of
        nodes of one process connecting at once kept its event loop too busy to start some of them
        within their connect timeout."""
        async with self.connect_gate or contextlib.nullcontext():
            bus = await stack.enter_async_context(client)
            await bus.subscribe(*self._subscriptions())
        self._subscribed.set()
        return bus

    def _subscriptions(self) -> list[str]:
        """The node's inbox (task, model, receipt) and the coordinator's state."""
        return [*self.topics.node_inbox(self.node_id), self.topics.coordinator_state]

    def drain(self, reason: str) -> None:
        """Stop taking tasks and end `serve` once the task in hand is dealt with: a training job in
        progress finishes and sends its update; a task whose model has not come is abandoned, and a
        task that arrives meanwhile refused, each reported to the coordinator as a failure with
        `reason` (it then stops waiting for this node); then the node says goodbye (offline)."""
        if self._draining is None:
            self._draining = reason
            self._drain_asked.set()

    @property
    def draining(self) -> str | None:
        """Why the node is draining, or None."""
        return self._draining

    async def _drain_when_asked(self) -> None:
        await self._drain_asked.wait()
        reason = self._draining or "draining"
        task, self._task = self._task, None
        if task is not None:  # acknowledged, the model not here yet
            self._leave_group(task)
            self.log.info("draining (%s): abandoning round %d's task, whose model has not come", reason, task.round)
            await self._report_failure(task, f"abandoned: the node is stopping ({reason})")
        job = self._job
        if job is not None and not job.done():
            self.log.info("draining (%s): finishing the update in hand", reason)
            await asyncio.wait({job})
        self.log.info("drained (%s) after %d rounds trained", reason, self.rounds_trained)

    async def _announce(self) -> None:
        """The retained status, on every connect and scripted transition: online, or offline while the
        scenario says so (one at a time, each saying the state when it goes out, so the last one wins)."""
        if self._bus is None:
            return
        async with self._status_lock:
            state = "online" if self.player.online else "offline"
            await self._bus.publish(self.topics.node_status(self.node_id), self._status(state), retain=True)

    async def _announce_when_subscribed(self) -> None:
        """The on-connect announcement, once the node's inbox is subscribed: the coordinator sends a
        task as soon as it reads `online`, and on the first connection the hook ran before the
        subscription, so a loaded machine lost the first round's tasks of every node of a process
        (the round waited out its deadline with all of them late). Reconnections restore the
        subscriptions before the hook runs, so this waits only once."""
        await self._subscribed.wait()
        await self._announce()

    async def _reannounce(self) -> None:
        """The status again, for a coordinator (re)started since the last one: the retained status it
        reads first may not be this node's any more (64 random bytes left there by another client made
        a restarted coordinator never see the node, issue 31). One message per node and coordinator run."""
        try:
            await asyncio.wait_for(self._announce(), 10)
        except (BusError, TimeoutError) as exc:  # the next connect announces it then
            self.log.warning("could not announce the status to the new coordinator run: %r", exc)

    async def _on_transition(self, transition: Transition) -> None:
        """The scenario took the node offline (dropping the task in hand) or brought it back."""
        if transition.online:
            self.log.info("scenario: online at %g s", transition.at)
        else:
            how = "crashes" if transition.crash else "goes offline"
            self.log.info("scenario: %s at %g s, dropping the work in hand", how, transition.at)
            self._abandon()
        try:
            await asyncio.wait_for(self._announce(), 10)
        except (BusError, TimeoutError) as exc:  # the next connect announces the state then
            self.log.warning(
                "scenario: could not publish the %s status: %r", "online" if self.player.online else "offline", exc
            )

    def _abandon(self) -> None:
        """Forget the pending task; a job in hand sees its spell ended and sends nothing."""
        task, self._task = self._task, None
        if task is not None:
            self._leave_group(task)
            if not task.inline:
                self._spawn(self._unsubscribe_model(task), f"unsubscribe-{self.node_id}-{task.round}")

    def _status(self, state: str) -> Message:
        return self._status_message(self._announcement(state == "online"))

    def _announcement(self, online: bool) -> Announcement:
        """What the node announces: offline, or online with what it holds and which connection this is
        (after a reconnection the coordinator sends the task in hand again)."""
        if not online:
            return Announcement(online=False)
        histogram = self.data.label_histogram() if self.config.announce_label_histogram else None
        return Announcement(
            online=True,
            device=str(self.workspace.device),
            num_samples=len(self.data),
            method=self.fingerprint.to_meta(),
            connection=self._bus.connections if self._bus is not None else 0,
            label_histogram=None if histogram is None else tuple(histogram),
        )

    def _status_message(self, announcement: Announcement) -> Message:
        return Message(
            kind=Kind.NODE_STATUS,
            federation=self.config.federation,
            round=-1,
            sender=self.node_id,
            meta=announcement.to_meta(),
        )

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
            return  # our own retained status echoes back through the inbox wildcard-free topics; ignore
        if route.channel in FROM_COORDINATOR and message.sender != "coordinator":
            raise TaskError("wrong-sender", f"{route.channel} from {message.sender!r}, expected the coordinator")
        if route.channel == "coordinator-state" and message.kind == Kind.COORDINATOR_STATUS:
            self._on_coordinator_status(message)
        elif route.channel == "node-task" and message.kind == Kind.TASK:
            await self._on_task(message, envelope.size)
        elif route.channel in ("model", "node-model") and message.kind == Kind.MODEL:
            await self._on_model(message, envelope.size)
        elif route.channel == "node-receipt" and message.kind == Kind.RECEIPT:
            self._on_receipt(message)
        elif route.channel == "node-secagg" and message.kind in SECAGG_KINDS:
            await self.secure.on_message(message)
        else:
            raise TaskError("unexpected-kind", f"{message.kind} on {envelope.topic}")

    def _on_coordinator_status(self, message: Message) -> None:
        status = CoordinatorStatus.from_meta(message.meta)
        if status.state.active:
            if status.run_id != self._run_id and self._bus is not None:
                self._spawn(self._reannounce(), f"reannounce-{self.node_id}")
            self._run_id = status.run_id
            self._check_method(status.method)
        elif status.state.final and status.run_id is not None and status.run_id == self._run_id:
            self.log.info("coordinator reports the run %s", status.state)
            if self.config.exit_when_done:
                self._stop.set()

    def _check_method(self, announced: Any) -> None:
        """Say once, loudly, that the coordinator runs another method (its tasks will be refused)."""
        if announced is None:
            return
        try:
            theirs = MethodFingerprint.from_meta(announced)
        except ValueError as exc:
            raise TaskError("bad-status", str(exc)) from None
        if theirs.digest != self.fingerprint.digest and self._method_warned != theirs.digest:
            self._method_warned = theirs.digest
            self.log.error(
                "the coordinator runs %s; this node runs %s (differences: %s): its tasks will be refused;"
                " start the node with the coordinator's experiment file",
                theirs.describe(),
                self.fingerprint.describe(),
                self.fingerprint.differences(theirs, "here", "at the coordinator"),
            )

    def _method_mismatch(self, task: Task) -> str | None:
        """Why a task is for another method than this node's (None: it is ours, or names none)."""
        digest = task.method
        if digest is None or digest == self.fingerprint.digest:
            return None
        return (
            f"method-mismatch: the task is for method fingerprint {str(digest)[:32]!r}; this node runs"
            f" {self.fingerprint.describe()} (fingerprint {self.fingerprint.digest})"
        )

    async def _on_task(self, message: Message, size: int = 0) -> None:
        task = self._parse_task(message, size)
        self._check_deadline(task, message.sent_at)
        mismatch = self._method_mismatch(task)
        if mismatch is not None:  # the coordinator stops waiting for this node, and logs why
            self._bus_or_fail().stats.rejected["method-mismatch"] += 1
            self.log.error("round %d's task refused: %s", task.round, mismatch)
            await self._report_failure(task, mismatch)
            return
        if self._draining is not None:
            self.log.info("round %d's task refused: the node is stopping (%s)", task.round, self._draining)
            await self._report_failure(task, f"refused: the node is stopping ({self._draining})")
            return
        if not self.player.admit(task.round):
            return  # scripted: offline, or a dropped task (no ack, no group, no update)
        if task.inline:
            # the model it carries is checked before it replaces the pending task: a refused task
            # (wrong shapes, from anyone who can publish on this topic) must not cost the node the
            # genuine task it holds (issue 31)
            self._parse_model(message)
        if self._task is not None:
            self._leave_group(self._task)
            if not self._task.inline and self._task.model_topic != task.model_topic:
                await self._unsubscribe_model(self._task)
        self._task = task
        if task.secure is not None:
            await self.secure.start(
                round=task.round, attempt=task.attempt, task_id=task.task_id, model_id=task.model_id,
                settings=task.secure,
            )  # fmt: skip
        groups = self.workspace.groups if self._grouped(task) else None
        if groups is not None:
            groups.expect(_group_key(task), self.node_id)
        if task.inline:
            if groups is not None and not groups.warned_inline:
                groups.warned_inline = True
                self.log.warning(
                    "the model comes inside the task, so a group forms from the tasks that arrived before it:"
                    " with hosting.vectorize set the coordinator's policy.inline_model_bytes to 0"
                )
            await self._on_model(message, 0)  # the task's frame is the model's
            return
        bus = self._bus_or_fail()
        await bus.subscribe(task.model_topic)
        ack = Message(
            kind=Kind.ACK,
            federation=self.config.federation,
            round=task.round,
            sender=self.node_id,
            meta={"task": task.task_id},
        )
        await bus.publish(self.topics.ack(self.node_id), ack)
        self.log.debug("task for round %d acknowledged", task.round)

    def _parse_task(self, message: Message, size: int = 0) -> Task:
        """The task the message carries (`protocol.Task`), checked against its header: the model topic
        must be its round's, the round not negative, and tensors only in a task that carries the model."""
        spec = protocol.Task.from_meta(message.meta)
        if spec.model_topic != self.topics.model(message.round):
            raise TaskError("bad-task", f"model topic {spec.model_topic!r} does not belong to round {message.round}")
        if message.round < 0:
            raise TaskError("wrong-round", f"round {message.round}")
        if message.tensors and not spec.inline:
            raise TaskError("bad-task", "tensors in a task that does not say it carries the model")
        return Task(
            message.round, spec.attempt, spec.task_id, spec.model_topic, spec.settings, time.monotonic(),
            spec.inline, spec.version, size, spec.deadline_s, spec.method, spec.model_id, spec.secure_aggregation,
        )  # fmt: skip

    def _check_deadline(self, task: Task, sent_at: float) -> None:
        """Refuse (as ``expired-task``: logged and counted, not acted on) a task that arrives after the
        coordinator gave up on it: more than its ``deadline_s`` after its ``sent_at``, plus
        `NodeConfig.clock_skew_s` for the two machines' clocks. Such a task was queued in the node's
        session while it was away (on an MQTT v5 broker the message expiry normally drops it first);
        a task without ``deadline_s`` never expires."""
        deadline = task.deadline_s
        if deadline is None:
            return
        age = time.time() - sent_at
        if age > deadline + self.config.clock_skew_s:
            raise TaskError(
                "expired-task",
                f"round {task.round}'s task arrived {age:.1f} s after it was sent, past its deadline of"
                f" {deadline:g} s (+ {self.config.clock_skew_s:g} s allowed for clock skew): not trained on"
                " (if fresh tasks expire, this machine's clock is ahead: synchronise it)",
            )

    async def _on_model(self, message: Message, size: int = 0) -> None:
        task = self._task
        quoted = message.meta.get("model_id", message.meta.get("task"))
        if task is None or message.round != task.round or quoted != task.model_key:
            self.log.debug("model for round %d matches no pending task; ignored", message.round)
            return
        self._task = None
        if not task.inline:
            # clean-up only: the model arrived, so training need not wait for the broker's UNSUBACK
            self._spawn(self._unsubscribe_model(task), f"unsubscribe-{self.node_id}-{task.round}")
        if self.config.faults.fail_at_round == task.round:
            self.log.warning("fault injection: crashing mid-round %d", task.round)
            self.crashed = True
            self._bus_or_fail().abort()
            self._stop.set()
            return
        payload = self._parse_model(message)
        if self._job is not None and not self._job.done():
            self.log.warning("round %d starts while the previous update is still being produced", task.round)
        received = task.frame_bytes + size
        job = self._train_and_send(task, payload, self.player.spell, received)
        self._job = asyncio.create_task(job, name=f"train-{self.node_id}-{task.round}")
        self._job.add_done_callback(self._harvest)

    def _parse_model(self, message: Message) -> Payload:
        try:
            groups = split_groups(message.tensors)
        except AlgorithmError as exc:
            raise TaskError("bad-model", str(exc)) from exc
        if "model" in groups:
            mismatch = schema_mismatch(groups["model"], self.workspace.schema)
            if mismatch is not None:
                raise TaskError(mismatch[0], f"broadcast model: {mismatch[1]}")
        meta = message.meta.get("payload", {})
        if not isinstance(meta, dict):
            raise TaskError("bad-model", "payload meta must be a map")
        return Payload(tensors=groups, meta=meta)

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

    async def _send_secagg(self, round: int, kind: Kind, step: SecAggUp) -> None:
        message = Message(
            kind=kind, federation=self.config.federation, round=round, sender=self.node_id, meta=step.to_meta()
        )
        await self._bus_or_fail().publish(self.topics.secagg(self.node_id), message)

    async def _unsubscribe_model(self, task: Task) -> None:
        try:
            await self._bus_or_fail().unsubscribe(task.model_topic)
        except BusError as exc:
            self.log.warning("could not unsubscribe from %s: %s", task.model_topic, exc)

    # -- training --------------------------------------------------------------------------

    def _grouped(self, task: Task) -> bool:
        """Whether this task's training goes through the process's group (``hosting.vectorize``); never
        in a round where a fault makes this node fail on its own."""
        groups, faults = self.workspace.groups, self.config.faults
        if groups is None or task.round in (faults.error_at_round, faults.fail_at_round):
            return False
        return groups.admits(self.half)

    def _leave_group(self, task: Task) -> None:
        if self.workspace.groups is not None:
            self.workspace.groups.withdraw(_group_key(task), self.node_id)

    async def _produce(self, task: Task, payload: Payload) -> tuple[bytearray | Draft, float]:
        """The encoded update: trained with this task's group when it forms, else alone under the lock."""
        groups = self.workspace.groups
        if groups is not None and self._grouped(task):
            member = GroupMember(
                half=self.half, task=self._task_input(task, payload), data=self.data, generator=self._generator(task)
            )
            grouped = await groups.train(_group_key(task), member)
            if grouped is not None:
                result, train_s = grouped
                return await asyncio.to_thread(self._frame, task, result, train_s, payload), train_s
        async with self.workspace.lock:
            return await asyncio.to_thread(self._train_and_encode, task, payload)

    async def _train_and_send(self, task: Task, payload: Payload, spell: asyncio.Event, received: int) -> None:
        """Train and publish the update; with a scenario, first the modelled download (`received`
        bytes), then the modelled compute time beyond the real one, and the upload, all outside the
        workspace lock. Nothing is sent once the node went offline (`spell` ended)."""
        script, hold = self.config.script, self.player.hold
        if not await hold(script.transfer_s(received), spell):
            return self._abandoned(task)
        try:
            frame, train_s = await self._produce(task, payload)
        except NoUpdate as exc:
            self.log.warning("round %d: no update to send: %s", task.round, exc)
            if not spell.is_set():
                await self._report_failure(task, str(exc))
            return
        except Exception as exc:  # the round must not wait for an update that will never come
            if self._bus is not None:
                self._bus.stats.rejected["training-error"] += 1
            self.log.error("training for round %d failed: %r", task.round, exc, exc_info=exc)
            if spell.is_set():
                return self._abandoned(task)
            await self._report_failure(task, f"{type(exc).__name__}: {exc}")
            return
        self.trainings += 1
        self.train_seconds += train_s
        if not await hold(max(0.0, script.compute_s(len(self.data)) - train_s), spell):
            return self._abandoned(task)
        delay = self.config.faults.delay_for(task.round)
        if delay:
            self.log.info("fault injection: delaying round %d's update by %g s", task.round, delay)
            if not await hold(delay, spell):
                return self._abandoned(task)
        if isinstance(frame, Draft):
            masked = await self.secure.masked(
                round=task.round, task_id=task.task_id, draft=frame, wait_s=task.deadline_s, gone=spell
            )
            if masked is None:
                return self._abandoned(task) if spell.is_set() else None
            frame = encode(masked)
        if not await hold(script.transfer_s(len(frame)), spell):
            return self._abandoned(task)
        await self._bus_or_fail().publish_frame(self.topics.update(self.node_id), frame, round=task.round)
        self.rounds_trained += 1
        self.log.info("round %d: trained %.3f s, update of %d bytes sent", task.round, train_s, len(frame))

    def _abandoned(self, task: Task) -> None:
        self.player.abandoned += 1
        self.log.info("scenario: round %d's update is not sent (the node went offline)", task.round)

    async def _report_failure(self, task: Task, reason: str) -> None:
        """An update without tensors that says why: the coordinator stops waiting for this node."""
        failure = Message(
            kind=Kind.UPDATE,
            federation=self.config.federation,
            round=task.round,
            sender=self.node_id,
            meta=UpdateFailed(task_id=task.task_id, reason=reason).to_meta(),
        )
        try:
            await self._bus_or_fail().publish(self.topics.update(self.node_id), failure)
        except BusError as exc:
            self.log.warning("could not report the failure of round %d: %s", task.round, exc)

    def _train_and_encode(self, task: Task, payload: Payload) -> tuple[bytearray | Draft, float]:
        """Runs in a worker thread; encodes before releasing the workspace, whose tensors the update aliases."""
        if self.config.faults.error_at_round == task.round:
            raise RuntimeError(f"fault injection: training error at round {task.round}")
        started = time.perf_counter()
        result = self.half.train(
            self._task_input(task, payload), self.workspace.model, self.data, self._generator(task)
        )
        train_s = time.perf_counter() - started
        return self._frame(task, result, train_s, payload), train_s

    def _frame(self, task: Task, result: Payload, train_s: float, received: Payload) -> bytearray | Draft:
        """The update's frame; with secure aggregation, the draft the shared step lets it mask (`masking`):
        the change from the model the task carried, copied out of the workspace."""
        if task.secure is None:
            return self._encode(task, result, train_s, received=received)
        meta = Update(
            task_id=task.task_id, num_samples=len(self.data), train_seconds=train_s, payload=result.meta,
            base_version=task.version,
        )  # fmt: skip
        return Draft(meta, weighted_change(result.tensors["model"], received.tensors["model"], 1.0))

    def _generator(self, task: Task) -> torch.Generator:
        return torch_generator(
            self.config.seed, "node-train", self.node_id, task.round, task.attempt, device=self.workspace.device
        )

    def _task_input(self, task: Task, payload: Payload) -> TaskInput:
        return TaskInput(
            node_id=self.node_id,
            round=task.round,
            payload=payload,
            settings=task.settings,
            scratch=self.workspace.scratch,
        )

    def _encode(
        self,
        task: Task,
        result: Payload,
        train_s: float,
        *,
        received: Payload | None = None,
        num_samples: int | None = None,
        site_nodes: int | None = None,
    ) -> bytearray:
        """The update's frame, compressed as configured (`received`, the task's payload, is the base of a
        delta); it claims `num_samples` (by default the node's data) and, from a site aggregator, the
        number of its nodes' updates it holds (`site_nodes`)."""
        compression = self.config.compression
        meta = Update(
            task_id=task.task_id,
            num_samples=len(self.data) if num_samples is None else num_samples,
            train_seconds=train_s,
            payload=result.meta,
            site_nodes=site_nodes,
            base_version=task.version,
            compression=compression.meta(),
        )
        update = Message(
            kind=Kind.UPDATE,
            federation=self.config.federation,
            round=task.round,
            sender=self.node_id,
            meta=meta.to_meta(),
            tensors=compress_update(flatten_groups(result.tensors), compression, received.tensors if received else {}),
        )
        return encode(update)

    def _spawn(self, coro: Any, name: str) -> None:
        """A background step that nothing waits for, kept until it ends (never fire-and-forget)."""
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.warning("%s failed: %r", task.get_name(), task.exception())

    def _harvest(self, job: asyncio.Task[None]) -> None:
        if job.cancelled():
            return
        exc = job.exception()
        if exc is not None:  # a failed publish of the update; training errors are reported in the job
            self.log.error("round job failed: %r", exc, exc_info=exc)

    @property
    def bus(self) -> BusClient | None:
        """The node's bus client once `serve` began (its stats and connection state, for metrics)."""
        return self._bus

    def _bus_or_fail(self) -> BusClient:
        if self._bus is None:
            raise RuntimeError("the node is not connected")
        return self._bus


def _group_key(task: Task) -> tuple[int, int, bytes, TrainSettings]:
    """Nodes train together only for one task: one round attempt, one broadcast, one set of settings."""
    return (task.round, task.attempt, task.model_key, task.settings)


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
