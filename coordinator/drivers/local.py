"""The engine in one process with no broker: a discrete-event driver on a fake clock.

The same engine the daemon drives (`SyncRounds`, `BufferedAsync`), with the same commands, executed
directly: `configure_round`, then each selected node's half trains at once on a snapshot of what
it was sent (as the wire would carry it) and its update "arrives" after the compute time the
caller gives (0 by default) in virtual time; aggregation and evaluation come back as events at the
same instant. Nothing sleeps, so a federation of hours runs in the time its training takes, and
the same inputs always give the same event order and the same models.

It replaces the hand-written round loops that tests and benchmarks used to keep beside the daemon,
and it is what scenarios and replays run on.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from fedmq.broker import Kind, Message
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.engine.base import Engine
from fedmq.coordinator.engine.clock import FakeClock
from fedmq.coordinator.halfcalls import HalfCalls
from fedmq.coordinator.storage.eventlog import EventLog
from fedmq.fedcore.algorithms.base import CoordinatorHalf, GroupMember, NodeHalf, Payload, TaskInput
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.masked import round_key
from fedmq.fedcore.node_update import node_generator, node_update, update_header
from fedmq.fedcore.protocol import (
    ProtocolError,
    SecAggDirectory,
    SecAggShared,
    SecAggUnmask,
    SecAggUp,
    Update,
    UpdateFailed,
)
from fedmq.fedcore.round_plan import outputs_ahead, plan_pipeline
from fedmq.fedcore.secure_task import SecureTask
from fedmq.fedcore.seeding import stream
from fedmq.fedcore.tensors import flatten_groups
from fedmq.fedcore.training import TrainSettings
from fedmq.fedcore.vectorized import graph_mode, keep_rounds

logger = logging.getLogger(__name__)

RECEIPTS_KEPT = 10_000

ComputeTime = Callable[[str, c.TaskSpec], float | None]
"""Virtual seconds from a task being sent to its update arriving (node id, task); None: the node
drops the task and never answers."""


def _clone(payload: Payload) -> Payload:
    """What a node receives: a copy, as encoding for the wire makes (the half's model changes later)."""
    tensors = {g: {k: v.detach().clone() for k, v in s.items()} for g, s in payload.tensors.items()}
    return Payload(tensors=tensors, meta=dict(payload.meta))


@dataclass(slots=True)
class LocalNode:
    """A node of the federation: its half and its shard."""

    half: NodeHalf
    data: TensorDataset


@dataclass(frozen=True, slots=True)
class _Arrival:
    """An update (or a secure-aggregation message) on its way: it arrives only if its node has not
    gone offline since it was sent."""

    event: e.UpdateArrived | e.SecAggArrived
    node: str
    epoch: int


@dataclass(slots=True)
class _SecureNode:
    """A node's task under secure aggregation: trained at once, its masked update sent when it may."""

    task: SecureTask
    spec: c.TaskSpec
    base: Payload
    """What the task carried: the node masks its change from this model."""
    trained: Payload
    compute: float | None
    sent_at: float


SECURE_STEPS = ("keys", "shares", "update", "reveal")
"""Where a node may go silent in secure aggregation (`LocalFederation.secure_faults`)."""


@dataclass(slots=True)
class _Step:
    tasks: dict[str, c.TaskSpec]
    payloads: dict[str, Payload]
    settings: TrainSettings


@dataclass
class LocalFederation:
    """Drive `engine` with `half` and `nodes` in this process; `run` until the engine finishes."""

    engine: Engine
    half: CoordinatorHalf
    nodes: Mapping[str, LocalNode]
    workspace: nn.Module
    """The model the nodes train in, one after another (as the nodes of one daemon process do)."""
    seed: int = 0
    evaluate: Callable[[], Mapping[str, float]] | None = None
    compute_s: ComputeTime | None = None
    scratch: Callable[..., nn.Module] | None = None
    clock: FakeClock = field(default_factory=FakeClock)
    records: list[dict[str, Any]] = field(default_factory=list)
    """The metrics lines, as metrics.jsonl would hold them."""
    round_records: dict[str, list[Mapping[str, Any]]] = field(default_factory=dict)
    checkpoint: Mapping[str, Any] | None = None
    """The last checkpoint's meta (the engine's state to resume from)."""
    refused: Counter[str] = field(default_factory=Counter)
    receipts: deque[c.Receipt] = field(default_factory=lambda: deque(maxlen=RECEIPTS_KEPT))
    """The latest receipts (what the nodes were told)."""
    event_log: EventLog | None = None
    lost_in_flight: int = 0
    """Updates that never arrived because their node went offline (or crashed) first."""
    dropped: int = 0
    """Tasks the nodes dropped (`compute_s` said None)."""
    vectorize: bool = False
    """Train the nodes a step sends one model to as one vectorised computation (`NodeHalf.train_group`)
    where their method allows; the others, and every node of a group whose training fails, one by one."""
    graphs: str = "auto"
    """CUDA graphs for vectorised steps and the methods' own captured steps (`fedcore.vectorized.graph_mode`)."""
    pipeline: str = "auto"
    """Draw each vectorised round's plan in chunks as its steps need them (`fedcore.round_plan.plan_pipeline`)."""
    outputs_ahead: str = "auto"
    """Make an objective's frozen outputs before a vectorised round's steps (`fedcore.round_plan.outputs_ahead`)."""
    reuse_rounds: bool = False
    """Keep each vectorised group's round (its buffers and captured graphs) for the next group of its
    shape (`fedcore.vectorized.keep_rounds`)."""
    groups_trained: int = 0
    """Groups of nodes trained as one computation."""
    rounds_kept: Counter[str] = field(default_factory=Counter)
    """With `reuse_rounds`, the vectorised calls by what became of their rounds: reused, built, not kept
    (`fedcore.vectorized.keep_rounds`)."""
    images_trained: int = 0
    """Node-training images: each trained task's local epochs times its shard."""
    train_seconds: float = 0.0
    """Wall seconds spent training the nodes (the share of a simulation's time its training takes)."""
    coordinator_seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Wall seconds of the coordinator's own work, by part: "aggregation" (the half's, KDIA's teacher
    and generator with it) and "evaluation"; `experiments.simulate` adds "checkpoints". With
    `train_seconds`, where a simulation's time went."""
    secure_faults: Mapping[str, str] = field(default_factory=dict)
    """With secure aggregation, per node, the step it goes silent at (one of `SECURE_STEPS`): it sends
    nothing from then on, in every round (a node that drops mid-protocol)."""

    def __post_init__(self) -> None:
        self._queue: list[tuple[float, int, e.Event | _Arrival]] = []
        self._order = itertools.count()
        self._steps: dict[int, _Step] = {}
        self._half_calls = HalfCalls(self.half, self.engine.config)
        self.node_privacy = self._half_calls.node_privacy
        self._started = False
        self._online: set[str] = set()
        self._epochs: Counter[str] = Counter()
        self._refusals: dict[type, str | None] = {}
        self._secure: dict[str, _SecureNode] = {}
        unknown = {n: s for n, s in self.secure_faults.items() if s not in SECURE_STEPS}
        if unknown:
            raise ValueError(f"secure_faults name steps other than {', '.join(SECURE_STEPS)}: {unknown}")

    # -- the outside world ---------------------------------------------------------------------------

    def at(self, when: float, event: e.Event | _Arrival) -> None:
        """Schedule `event` at virtual time `when` (availability changes, a Stop, ...)."""
        heapq.heappush(self._queue, (max(when, self.clock.now()), next(self._order), event))

    def online(self, *nodes: str, at: float | None = None) -> None:
        for node in nodes:
            self.at(self.clock.now() if at is None else at, e.NodeSeen(node, True))

    def offline(self, *nodes: str, at: float | None = None) -> None:
        for node in nodes:
            self.at(self.clock.now() if at is None else at, e.NodeSeen(node, False))

    def pending_availability(self) -> list[tuple[float, str, bool]] | None:
        """The availability changes still to come, in order, as (time, node, online); None while
        anything else is pending (an update in flight, a task not yet trained, an engine event): a
        checkpoint taken then could not be resumed exactly (`experiments.sim_checkpoint`)."""
        if self._steps:
            return None
        pending: list[tuple[float, str, bool]] = []
        for when, _, event in sorted(self._queue, key=lambda item: item[:2]):
            if not isinstance(event, e.NodeSeen) or event.num_samples is not None:
                return None
            pending.append((when, event.node, event.online))
        return pending

    def replace_schedule(self, events: Sequence[tuple[float, e.Event]]) -> None:
        """Drop every scheduled event and schedule `events` (in order) instead: a resumed simulation
        puts back the availability changes its checkpoint says were still to come."""
        if self._started:
            raise RuntimeError("the schedule can be replaced only before the federation runs")
        self._queue.clear()
        for when, event in events:
            self.at(when, event)

    # -- running -------------------------------------------------------------------------------------

    def run(self, until: Callable[[], bool] | None = None, *, max_events: int = 10_000_000) -> list[dict[str, Any]]:
        """Process events until the engine finishes (or `until()` holds); the metrics lines so far.
        A node whose liveness nothing scheduled for the start is online from the start (and may go
        offline later as scheduled)."""
        if not self._started:
            self._started = True
            now = self.clock.now()
            decided = {ev.node for when, _, ev in self._queue if isinstance(ev, e.NodeSeen) and when <= now}
            self.online(*(node for node in self.nodes if node not in decided))
            self._drain_now()
            self._feed(e.Start())
        with self.training_modes():
            for _ in range(max_events):
                if self.engine.finished or (until is not None and until()):
                    return self.records
                self._step()
        raise RuntimeError(f"the federation did not finish within {max_events} events")

    def training_modes(self) -> ExitStack:
        """The graph mode of the nodes' groups and of the coordinator's own captured steps (KDIA's
        generator), their plans' pipeline, where frozen outputs are made and the kept rounds, entered once around the
        run's loop (and its replay's)."""
        modes = ExitStack()
        modes.enter_context(graph_mode(self.graphs))
        modes.enter_context(plan_pipeline(self.pipeline))
        modes.enter_context(outputs_ahead(self.outputs_ahead))
        if self.reuse_rounds:
            self.rounds_kept = modes.enter_context(keep_rounds())
        return modes

    def _drain_now(self) -> None:
        """Events already due (the nodes' first statuses) go before the run starts, as retained messages do."""
        while self._queue and self._queue[0][0] <= self.clock.now():
            self._deliver(heapq.heappop(self._queue)[2])

    def _step(self) -> None:
        deadline = self.engine.next_deadline()
        if self._queue and (deadline is None or self._queue[0][0] <= deadline):
            when, _, event = heapq.heappop(self._queue)
        elif deadline is not None:
            when, event = deadline, e.Tick()
        else:
            raise RuntimeError(f"the engine ({self.engine.state}) waits for an event that nothing will send")
        self.clock.set(max(when, self.clock.now()))
        self._deliver(event)

    def _deliver(self, event: e.Event | _Arrival) -> None:
        if isinstance(event, _Arrival):
            if event.epoch != self._epochs[event.node]:
                self.lost_in_flight += 1  # its node went offline meanwhile: the update is lost with it
                return
            event = event.event
        self._feed(event)

    def _feed(self, event: e.Event) -> None:
        self.before_event(event)
        if isinstance(event, e.NodeSeen):
            if event.num_samples is None and event.node in self.nodes:
                # a node announces the size of its shard with its status, as the node daemon does
                event = replace(event, num_samples=len(self.nodes[event.node].data))
            (self._online.add if event.online else self._online.discard)(event.node)
            if not event.online:
                self._epochs[event.node] += 1
        now = self.clock.now()
        if self.event_log is not None:
            self.event_log.event(now, event)
        commands = self.engine.handle(event, now)
        if self.event_log is not None:
            self.event_log.commands(commands)
        tasks: list[c.SendTask] = []  # a step's tasks, trained together where they can be
        for command in commands:
            if isinstance(command, c.SendTask):
                tasks.append(command)
                continue
            if tasks:
                self._train_all(tasks)
                tasks = []
            self._execute(command)
            self.after_command(command)
        if tasks:
            self._train_all(tasks)
        self.after_event(event)

    # -- extension points (a simulation's checkpoints, `experiments.sim_checkpoint`) -------------------

    def before_event(self, event: e.Event) -> None:
        """Called before the engine handles `event`; nothing by default."""

    def after_command(self, command: c.Command) -> None:
        """Called after each of an event's commands but its tasks is executed; nothing by default."""

    def after_event(self, event: e.Event) -> None:
        """Called once `event`'s commands are executed and its tasks trained; nothing by default."""

    @property
    def _calls(self) -> HalfCalls:
        self._half_calls.half = self.half  # a caller may swap in another half between runs (a restored one)
        return self._half_calls

    def _now(self, event: e.Event) -> None:
        self.at(self.clock.now(), event)

    # -- commands ------------------------------------------------------------------------------------

    def _execute(self, command: c.Command) -> None:
        if isinstance(command, c.Configure):
            self._configure(command)
        elif isinstance(command, c.SendTask):
            self._train(command)
        elif isinstance(command, c.Aggregate):
            started = time.perf_counter()
            aggregated, records = self._calls.aggregate(command)
            self.coordinator_seconds["aggregation"] += time.perf_counter() - started
            for name, lines in records.items():
                self.round_records.setdefault(name, []).extend(lines)
            self._now(aggregated)
        elif isinstance(command, c.Evaluate):
            started = time.perf_counter()
            figures = dict(self.evaluate()) if self.evaluate else {}
            self.coordinator_seconds["evaluation"] += time.perf_counter() - started
            self._now(e.Evaluated(command.step, figures))
        elif isinstance(command, c.Rollback):
            self._calls.rollback()
        elif isinstance(command, c.Record):
            self.records.append(dict(command.record))
        elif isinstance(command, c.Checkpoint):
            self.checkpoint = command.meta
        elif isinstance(command, c.Refused):
            self.refused[command.reason] += 1
            logger.debug("refused from %s: %s: %s", command.node, command.reason, command.detail)
        elif isinstance(command, c.Receipt):
            self.receipts.append(command)
        elif isinstance(command, c.SendSecAgg):
            self._secure_step(command)
        # Broadcast and Resend never come (every task carries its model); statuses and Finish need nothing

    def _configure(self, command: c.Configure) -> None:
        payload = self._calls.configure(command)
        if isinstance(payload, Payload):
            shared = _clone(payload)
            payloads = {t.node: shared for t in command.tasks}
        else:
            payloads = {t.node: _clone(payload[t.node]) for t in command.tasks}
        settings = TrainSettings.from_meta(command.settings)
        self._steps[command.step] = _Step({t.node: t for t in command.tasks}, payloads, settings)
        self._now(e.Configured(command.step, inline=True))

    def _train(self, command: c.SendTask) -> None:
        """The node trains now on what it was sent; its update arrives after its compute time."""
        self._train_all([command])

    def _take(self, command: c.SendTask) -> tuple[c.TaskSpec, Payload, TrainSettings]:
        step = self._steps[command.step]
        spec = step.tasks.pop(command.node)
        payload = step.payloads.pop(command.node)
        if not step.tasks:
            del self._steps[command.step]
        return spec, payload, step.settings

    def _train_all(self, commands: list[c.SendTask]) -> None:
        """Each commanded node trains on what it was sent; each update arrives after its node's compute
        time, scheduled in the order of the commands. With `vectorize`, the tasks of one engine answer
        train as one group, those the nodes then drop included: the group (and so the rounding of its
        sums) is what the engine sent, which a replay of the event log can rebuild."""
        started = time.perf_counter()
        work = [self._take(command) for command in commands]
        grouped = self._train_group(work) if self.vectorize and len(work) > 1 else {}
        self.train_seconds += time.perf_counter() - started
        for spec, payload, settings in work:
            self.images_trained += settings.local_epochs * len(self.nodes[spec.node].data)
            compute = self.compute_s(spec.node, spec) if self.compute_s is not None else 0.0
            if compute is None:
                self.dropped += 1
                continue
            if self.engine.config.secure_aggregation is not None:
                self._secure_start(spec, payload, settings, compute, grouped.get(spec.node))
                continue
            started = time.perf_counter()
            message = self.produce(spec, payload, settings, compute, trained=grouped.get(spec.node))
            self.train_seconds += time.perf_counter() - started
            arrives = self.clock.now() + compute
            event = e.UpdateArrived(message, arrives)
            self.at(arrives, _Arrival(event, spec.node, self._epochs[spec.node]))

    def _task(self, spec: c.TaskSpec, payload: Payload, settings: TrainSettings) -> TaskInput:
        return TaskInput(
            node_id=spec.node,
            round=spec.round,
            payload=payload,
            settings=settings,
            **({"scratch": self.scratch} if self.scratch is not None else {}),
        )

    def _generator(self, spec: c.TaskSpec) -> torch.Generator:
        return node_generator(self.seed, spec.node, spec.round, spec.attempt)

    def _groupable(self, half: NodeHalf) -> bool:
        """Whether nodes of this half's class train in groups with the workspace model (why not: logged once)."""
        kind = type(half)
        if kind not in self._refusals:
            reason = self._refusals[kind] = half.group_refusal(self.workspace)
            if reason is not None:
                logger.warning("simulation.vectorize: nodes train one by one: %s", reason)
        return self._refusals[kind] is None

    def _train_group(self, work: list[tuple[c.TaskSpec, Payload, TrainSettings]]) -> dict[str, Payload]:
        """The outputs of the nodes that share one model, method and settings, trained as one group;
        {} when they cannot be (each then trains alone)."""
        spec, payload, settings = work[0]
        half = self.nodes[spec.node].half
        same = all(
            p is payload and s == settings and type(self.nodes[t.node].half) is type(half) for t, p, s in work
        )  # a step sends its nodes one shared payload unless the method personalises them
        if not same or not self._groupable(half):
            return {}
        members = [
            GroupMember(
                half=self.nodes[t.node].half,
                task=self._task(t, p, s),
                data=self.nodes[t.node].data,
                generator=self._generator(t),
            )
            for t, p, s in work
        ]
        try:
            updates = half.train_group(members, self.workspace)  # under `run`'s (or a replay's) graph_mode
        except Exception as exc:  # as the daemons' group trainer: every member then trains alone
            logger.error("training a group of %d failed, each trains alone: %r", len(members), exc, exc_info=exc)
            return {}
        self.groups_trained += 1
        return {t.node: u for (t, _, _), u in zip(work, updates, strict=True)}

    def produce(
        self,
        spec: c.TaskSpec,
        payload: Payload,
        settings: TrainSettings,
        compute: float,
        *,
        trained: Payload | None = None,
    ) -> Message:
        """The update `spec.node` sends for `spec` (or its report that training failed); `trained`: its
        training's output when its group trained it already."""
        node = self.nodes[spec.node]
        task = self._task(spec, payload, settings)
        compression = self.engine.config.compression  # the nodes compress as the coordinator expects
        try:
            out = (
                trained
                if trained is not None
                else node.half.train(task, self.workspace, node.data, self._generator(spec))
            )
            header, arrays = node_update(
                spec.task, spec.version, out, num_samples=len(node.data), train_seconds=float(compute),
                compression=compression, received=payload,
            )  # fmt: skip
        except Exception as exc:  # the node reports it, as the daemon's node does
            logger.warning("%s's training for round %d failed: %r", spec.node, spec.round, exc)
            meta: Update | UpdateFailed = UpdateFailed(task_id=spec.task, reason=f"{type(exc).__name__}: {exc}")
            tensors = {}
        else:
            meta = header
            # the update aliases the workspace, which the next node trains in: copy it, as encoding does
            tensors = {k: v.copy() for k, v in arrays.items()}
        return Message(
            kind=Kind.UPDATE, federation=self.engine.config.federation, round=spec.round, sender=spec.node,
            meta=meta.to_meta(), tensors=tensors,
        )  # fmt: skip

    # -- secure aggregation: the node's side, as `fedcore.secure_task` plays it ------------------------------

    def _secure_start(
        self, spec: c.TaskSpec, payload: Payload, settings: TrainSettings, compute: float, trained: Payload | None
    ) -> None:
        """Train now; send the keys; the masked update waits for the shared step (`_secure_step`)."""
        settings_ = self.engine.config.secure_aggregation
        assert settings_ is not None and spec.model is not None
        node = self.nodes[spec.node]
        started = time.perf_counter()
        try:
            out = trained or node.half.train(
                self._task(spec, payload, settings), self.workspace, node.data, self._generator(spec)
            )
            out = Payload(
                tensors={g: {k: v.detach().clone() for k, v in t.items()} for g, t in out.tensors.items()},
                meta=dict(out.meta),
            )
        except Exception:  # the node reports it as `produce` does
            self.train_seconds += time.perf_counter() - started
            message = self.produce(spec, payload, settings, compute)
            self.at(
                self.clock.now() + compute,
                _Arrival(e.UpdateArrived(message, self.clock.now() + compute), spec.node, self._epochs[spec.node]),
            )
            return
        self.train_seconds += time.perf_counter() - started
        draws = stream(self.seed, "secagg", spec.node, spec.round, spec.attempt)
        task = SecureTask(
            settings_,
            round_key(self.engine.config.federation, spec.round, spec.attempt, spec.model),
            node=spec.node,
            task_id=spec.task,
            num_samples=len(node.data),
            random=draws.bytes,
        )
        self._secure[spec.node] = _SecureNode(task, spec, payload, out, compute, self.clock.now())
        self._secure_send(spec.node, spec.round, "keys", task.keys())

    def _secure_send(self, node: str, round: int, step: str, message: SecAggUp) -> None:
        if self.secure_faults.get(node) in SECURE_STEPS[: SECURE_STEPS.index(step) + 1]:
            return  # silent from this step on
        kind = {"keys": Kind.SECAGG_KEYS, "shares": Kind.SECAGG_SHARES, "reveal": Kind.SECAGG_REVEAL}[step]
        wire = Message(
            kind=kind, federation=self.engine.config.federation, round=round, sender=node, meta=message.to_meta()
        )
        self.at(self.clock.now(), _Arrival(e.SecAggArrived(wire, self.clock.now()), node, self._epochs[node]))

    def _secure_step(self, command: c.SendSecAgg) -> None:
        mine = self._secure.get(command.node)
        if mine is None:
            return
        message, task = command.message, mine.task
        try:
            if isinstance(message, SecAggDirectory):
                self._secure_send(command.node, mine.spec.round, "shares", task.on_directory(message))
            elif isinstance(message, SecAggShared):
                task.on_shared(message)
                self._secure_update(mine)
            elif isinstance(message, SecAggUnmask):
                self._secure_send(command.node, mine.spec.round, "reveal", task.on_unmask(message))
        except ProtocolError as exc:
            logger.warning("%s refuses a secure-aggregation step: %s", command.node, exc)

    def _secure_update(self, mine: _SecureNode) -> None:
        node, spec = mine.spec.node, mine.spec
        if self.secure_faults.get(node) in ("keys", "shares", "update"):
            return
        masked = mine.task.mask(mine.trained.tensors["model"], mine.base.tensors["model"])
        meta = update_header(
            spec.task, spec.version, {**mine.trained.meta, "secagg_clipped": masked.clipped},
            num_samples=len(self.nodes[node].data), train_seconds=float(mine.compute or 0.0),
        )  # fmt: skip
        message = Message(
            kind=Kind.UPDATE, federation=self.engine.config.federation, round=spec.round, sender=node,
            meta=meta.to_meta(), tensors=flatten_groups(masked.tensors),
        )  # fmt: skip
        arrives = max(self.clock.now(), mine.sent_at + float(mine.compute or 0.0))
        self.at(arrives, _Arrival(e.UpdateArrived(message, arrives), node, self._epochs[node]))

    # -- what tests read -----------------------------------------------------------------------------

    def model(self) -> dict[str, torch.Tensor]:
        """A copy of the global model now."""
        return {k: v.detach().clone() for k, v in self.half.model.state_dict().items()}
