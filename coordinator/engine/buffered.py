"""Buffered asynchronous aggregation: FedAsync (K = 1) and FedBuff (K > 1) as a state machine.

`concurrency` nodes train at once, each on its own task carrying the model version it was built
from. When a task ends (an update, a reported failure, its node going offline, or its deadline)
its slot is refilled at once by a seeded draw among the idle live nodes (the node that
just delivered among them), unless K accepted updates already wait to be folded (backpressure:
the buffer never outgrows what folding keeps up with). Accepted updates wait in a buffer; every K
of them are folded into a new model version by the half's `aggregate` with the staleness rule of
`AsyncPolicy` (staleness = the version folded from - the version the update trained from). An
update whose place in the buffer would fold it staler than max_staleness is refused on arrival and
recorded, never folded. The last version folds everything accepted (more than K if folding lagged);
updates arriving after it started are answered late and counted, not accepted.

A refused message (malformed, forged, claiming more samples than its node announced) does not end
the node's task: until the broker authenticates senders anyone can publish on a node's topic, so
the node's valid update is still taken until the task's deadline. A task that ends without one
after a refusal (expired, or its node went offline) is recorded as rejected.

Heavy calls run one at a time in the daemon's lane, in the order asked: a task configured while an
aggregation runs is labelled with the version that aggregation produces, which is the model it will
read. Folding pauses while an evaluation runs (so that the evaluated and checkpointed model is the
version named); training never pauses.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.engine.base import Engine
from fedmq.coordinator.errors import ProtocolError
from fedmq.coordinator.updates import check_base_version, parse_update
from fedmq.fedcore.algorithms.base import Failure, Folding, NodeUpdate
from fedmq.fedcore.protocol import RunState, UpdateFailed
from fedmq.fedcore.seeding import stream

logger = logging.getLogger(__name__)

CLOSED_TASKS_KEPT = 65_536
"""Ended tasks remembered, so that a second or a too-late update gets its true reason."""


@dataclass(slots=True)
class _Task:
    spec: c.TaskSpec
    sent_at: float
    deadline: float
    refused: str = ""
    """Why the latest message refused for this task was refused ("" if none was)."""


class BufferedAsync(Engine):
    """The asynchronous policy (`AsyncPolicy`), driven by events."""

    def __init__(self, *args: Any, evaluates: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.evaluates = evaluates
        self.ap = self.config.asynchronous
        self.tasks: dict[bytes, _Task] = {}
        """Tasks in flight by id, in the order they were sent (so the first has the earliest deadline)."""
        self.by_node: dict[str, bytes] = {}
        self.buffer: list[NodeUpdate] = []
        self.dispatches = 0
        self.updates_folded = 0
        self.totals: Counter[str] = Counter()
        self._reserved: dict[int, tuple[c.TaskSpec, ...]] = {}
        self._reserved_nodes: set[str] = set()
        self._closed: OrderedDict[bytes, tuple[str, str]] = OrderedDict()
        self._task_counts: dict[str, tuple[int, int]] = {}
        self._since: Counter[str] = Counter()
        self._failures: list[Failure] = []
        self._folding: int | None = None
        self._deferred: list[Callable[[], None]] = []
        self._evaluating: int | None = None
        self._final_fold = False
        self._stopping = False
        self.folds_without_model = 0
        """Folds in a row whose model was rejected (``policy.max_rounds_without_model``)."""
        self._record: dict[str, Any] = {}
        self._last_version_at = 0.0

    # -- dispatching tasks --------------------------------------------------------------------------

    def _begin(self, out: list[c.Command], now: float) -> None:
        self._last_version_at = now
        if self.version >= self.ap.aggregations:
            self._finish(out)
            return
        self._dispatch(out, now)

    def _resume_waiting(self, out: list[c.Command], now: float) -> None:
        self._dispatch(out, now)

    def _target_version(self) -> int:
        """The model a task configured now will carry: one more while an aggregation is queued first."""
        return self.version + (1 if self._folding is not None else 0)

    def _dispatch(self, out: list[c.Command], now: float) -> None:
        """Fill free slots with a seeded draw among the idle live nodes. One Configure at a time: the
        slots freed while it is prepared are filled together when it is done (under load, tasks are
        configured in batches, one worker-thread call for many)."""
        if self.state != RunState.RUNNING or self._final_fold or self._stopping or self._reserved:
            return
        if len(self.buffer) >= self.ap.buffer:
            return  # backpressure: a full batch waits to be folded, so no new work until it is
        if not self.live and not self.tasks and not self._reserved and self._wait_until is None:
            logger.warning("no live node; waiting up to %g s for one", self.policy.wait_for_nodes_s)
            self._wait(out, 1, now)
            return
        free = self.ap.concurrency - len(self.tasks) - len(self._reserved_nodes)
        idle = sorted(self.live - self.by_node.keys() - self._reserved_nodes)
        n = min(free, len(idle))
        if n <= 0:
            return
        rng = stream(self.config.seed, "async-sampler", self.dispatches)
        self.dispatches += 1
        chosen = sorted(idle[i] for i in rng.choice(len(idle), size=n, replace=False))
        version = self._target_version()
        tasks = tuple(
            c.TaskSpec(node, self.new_id(), version, self._attempt(node, version), version) for node in chosen
        )
        ctx = self._context(version, tuple(chosen), "configure", version=version)
        step = self._next_step()
        self._reserved[step] = tasks
        self._reserved_nodes.update(chosen)
        keep = self.keeps_models()
        out.append(
            c.Configure(step, ctx, tasks, ctx.settings.to_meta(), self.ap.deadline_s, inline_only=True, keep_model=keep)
        )

    def keeps_models(self) -> bool:
        """FedBuff folds each update as a delta from the model its node received: keep those models too."""
        return super().keeps_models() or self.ap.rule == "fedbuff"

    def _attempt(self, node: str, version: int) -> int:
        """How many tasks `node` had before at `version`: with the version it seeds the node's
        training stream, so two tasks from one model never train alike."""
        last_version, count = self._task_counts.get(node, (-1, -1))
        attempt = count + 1 if last_version == version else 0
        self._task_counts[node] = (version, attempt)
        return attempt

    def _configured(self, out: list[c.Command], event: e.Configured, now: float) -> None:
        tasks = self._reserved.pop(event.step, None)
        if tasks is None:
            return
        sent = []
        for spec in tasks:
            self._reserved_nodes.discard(spec.node)
            if spec.node not in self.live or self._final_fold or self._stopping:
                continue  # went offline while its task was prepared, or the run is ending: the slot is free again
            self.tasks[spec.task] = _Task(spec, now, now + self.ap.deadline_s)
            self.by_node[spec.node] = spec.task
            sent.append(spec.node)
            out.append(c.SendTask(event.step, spec.node))
        if sent:
            self._note(self.participation.selected, sent, tasks[0].version)
        self._dispatch(out, now)

    # -- updates --------------------------------------------------------------------------------------

    def _on(self, out: list[c.Command], event: e.Event, now: float) -> None:
        if isinstance(event, e.Configured):
            self._configured(out, event, now)
        elif isinstance(event, e.TaskUnsent):
            task = self.tasks.get(event.task)
            if task is not None:
                self._end_task(task, "lost")
                self._dispatch(out, now)
        elif isinstance(event, e.Aggregated):
            self._aggregated(out, event, now)
        elif isinstance(event, e.Evaluated):
            self._evaluated(out, event, now)
        # acknowledgements are not used: every asynchronous task carries its model

    def _on_update(self, out: list[c.Command], event: e.UpdateArrived, now: float) -> None:
        message = event.message
        node = message.sender
        task_id = message.meta.get("task")
        task = self.tasks.get(task_id) if isinstance(task_id, bytes) else None
        if task is None:
            self._unknown_task(out, event, task_id)
            return
        spec = task.spec
        if spec.node != node:
            raise ProtocolError("foreign-task", f"the task {task_id.hex()} was sent to another node, not {node}")  # type: ignore[union-attr]
        try:
            update = self._parse(event, task)
        except ProtocolError as exc:  # the task stays open for the node's valid update
            task.refused = f"{exc.reason}: {exc.detail}"
            raise
        self._end_task(task, "answered")
        try:
            self._take(out, event, task, update)
        finally:
            self._maybe_fold(out, now)
            self._dispatch(out, now)

    def _parse(self, event: e.UpdateArrived, task: _Task) -> NodeUpdate | None:
        """The update, checked against its task (ProtocolError says why not); None for a node's
        report that its training failed, and while the run is ending (nothing more is folded)."""
        message, spec = event.message, task.spec
        if message.round != spec.version:
            raise ProtocolError(
                "wrong-base-version", f"update for version {message.round}, the task carried {spec.version}"
            )
        if UpdateFailed.is_failure(message.meta) or self._final_fold or self._stopping:
            return None
        check_base_version(message, spec.version, required=True)
        update = parse_update(
            message,
            self.schema,
            version=spec.version,
            sent_at=task.sent_at,
            received_at=event.received_at,
            compression=self.config.compression,
            ingested=event.ingested,
        )
        self._check_samples(update)
        return update

    def _take(self, out: list[c.Command], event: e.UpdateArrived, task: _Task, update: NodeUpdate | None) -> None:
        message, spec = event.message, task.spec
        node = spec.node
        if UpdateFailed.is_failure(message.meta):
            detail = UpdateFailed.from_meta(message.meta).reason
            logger.warning("node %s reports its training for version %d failed: %s", node, spec.version, detail)
            self._failed(node, spec.version, "failed", detail)
            return
        if update is None:
            self.totals["finished"] += 1
            self._decline(out, message, "finished", "the last model version is being made", "late")
            return
        # the buffer is folded in order, K at a time: the version this update will be folded from
        staleness = self._target_version() + len(self.buffer) // self.ap.buffer - spec.version
        if staleness > self.ap.max_staleness:
            detail = f"trained from version {spec.version}, {staleness} behind (max {self.ap.max_staleness})"
            self._failed(node, spec.version, "stale", detail)
            self._decline(out, message, "stale", detail, "stale")
            return
        self.buffer.append(update)
        self._receipt(out, message, "received")

    def _unknown_task(self, out: list[c.Command], event: e.UpdateArrived, task_id: object) -> None:
        message = event.message
        closed = self._closed.get(task_id) if isinstance(task_id, bytes) else None
        if closed is None:
            raise ProtocolError("wrong-round", f"update matches no task sent to {message.sender}")
        node, why = closed
        if node != message.sender:
            raise ProtocolError("foreign-task", f"that task was sent to another node, not {message.sender}")
        if why == "answered":
            raise ProtocolError("duplicate-update", f"{node} already answered that task")
        self.late_arrivals += 1
        self._decline(out, message, "expired", f"the task was {why} before the update came", "late")

    def _note(self, change: Callable[..., None], *args: Any) -> None:
        """Change the participation record now, or, while an aggregation runs (it reads the record in
        the worker thread), right after it: the record is never copied and never changes under it."""
        if self._folding is None:
            change(*args)
        else:
            self._deferred.append(functools.partial(change, *args))

    def _end_task(self, task: _Task, why: str) -> None:
        spec = task.spec
        self.tasks.pop(spec.task, None)
        if self.by_node.get(spec.node) == spec.task:
            del self.by_node[spec.node]
        self._closed[spec.task] = (spec.node, why)
        while len(self._closed) > CLOSED_TASKS_KEPT:
            self._closed.popitem(last=False)
        if why in ("expired", "lost"):
            if task.refused:  # only refused messages came for it
                self._failed(spec.node, spec.version, "rejected", task.refused)
            else:
                self._failed(spec.node, spec.version, why, "")

    def _failed(self, node: str, version: int, reason: str, detail: str) -> None:
        """A task that ends without an update to fold: recorded in the participation record and the metrics."""
        record = {
            "failed": self.participation.failed,
            "rejected": self.participation.rejected,
            "lost": self.participation.lost,
            "expired": self.participation.late,
            "stale": self.participation.late,
        }[reason]
        self._note(record, node)
        self._since[reason] += 1
        self.totals[reason] += 1
        self._failures.append(Failure(node, version, reason, detail))  # type: ignore[arg-type]

    # -- liveness and time ----------------------------------------------------------------------------

    def _on_liveness(self, out: list[c.Command], node: str, online: bool, now: float) -> None:
        if not online:
            task_id = self.by_node.get(node)
            if task_id is not None:
                logger.info("node %s went offline holding a task of version %d", node, self.tasks[task_id].spec.version)
                self._end_task(self.tasks[task_id], "lost")
        self._dispatch(out, now)

    def _deadlines(self) -> Sequence[float | None]:
        first = next(iter(self.tasks.values()), None)
        return (first.deadline,) if first is not None else ()

    def _on_tick(self, out: list[c.Command], now: float) -> None:
        # tasks are kept in the order they were sent, all with the same deadline_s: the expired come first
        expired = list(itertools.takewhile(lambda t: t.deadline <= now, self.tasks.values()))
        for task in expired:
            logger.info(
                "task of %s (version %d) expired after %g s", task.spec.node, task.spec.version, self.ap.deadline_s
            )
            self._end_task(task, "expired")
        if expired:
            self._dispatch(out, now)

    # -- folding ---------------------------------------------------------------------------------------

    def _maybe_fold(self, out: list[c.Command], now: float, *, flush: bool = False) -> None:
        """Fold the oldest K buffered updates (all of them when flushing) into the next version."""
        if self._folding is not None or self._evaluating is not None or not self.buffer:
            return
        if len(self.buffer) < self.ap.buffer and not flush:
            return
        last = self.version + 1 >= self.ap.aggregations
        k = len(self.buffer) if flush or last else self.ap.buffer  # the last version folds all that was accepted
        batch, self.buffer = self.buffer[:k], self.buffer[k:]
        v = self.version
        updates = [dataclasses.replace(u, staleness=v - u.base_version) for u in batch]
        for u in updates:  # arrival order: a node folded twice in one version counts twice
            self.participation.accepted(
                u.node_id,
                v,
                num_samples=u.num_samples,
                rtt_s=round(u.rtt_seconds, 6),
                train_s=round(u.train_seconds, 6),
            )
        ordered = sorted(updates, key=lambda u: u.node_id)  # stable: a node's updates stay in arrival order
        rule = self.ap.rule
        folding = Folding(rule=rule, staleness=self.ap.staleness, server_lr=self.ap.server_lr)
        nodes = tuple(sorted({u.node_id for u in updates}))
        ctx = self._context(v, nodes, "aggregate", folding=folding, version=v)
        needed = [t.spec.version for t in self.tasks.values()]
        needed += [s.version for specs in self._reserved.values() for s in specs]
        needed += [u.base_version for u in self.buffer]
        bases = tuple(sorted({u.base_version for u in updates})) if rule == "fedbuff" else ()
        staleness = np.array([u.staleness for u in updates], dtype=np.float64)
        self._record = {
            "round": v,
            "version": v + 1,
            "folded": [u.node_id for u in ordered],
            "staleness_mean": float(staleness.mean()),
            "staleness_max": int(staleness.max()),
            "flush": flush,
        }
        self.updates_folded += len(updates)
        self._folding = self._next_step()
        if last:
            self._final_fold = True
        out.append(
            c.Aggregate(self._folding, ctx, ordered, list(self._failures), bases, keep_from=min([v + 1, *needed]))
        )
        self._failures = []

    def _aggregated(self, out: list[c.Command], event: e.Aggregated, now: float) -> None:
        if event.step != self._folding:
            return
        self._folding = None
        for change in self._deferred:
            change()
        self._deferred = []
        if event.rejected:  # the half fell back to the last good model already
            self._fold_rejected(out, now, f"the folded model holds {event.rejected}")
            return
        self.folds_without_model = 0
        self.version += 1
        self._record |= {"aggregated": True, **{k: float(v) for k, v in event.metrics.items()}}
        last = self.version >= self.ap.aggregations
        if self.evaluates and (self._eval_due(self.version - 1, self.ap.aggregations - 1) or last or self._stopping):
            self._evaluating = event.step
            out.append(c.Evaluate(event.step))
            self._dispatch(out, now)
            return
        self._end_version(out, now, checkpoint=last or self._stopping)

    def _fold_rejected(self, out: list[c.Command], now: float, why: str) -> None:
        """A fold made a model that is never published (issue 31, item 2): the last good model stays,
        the version does not advance, the folded updates are named as suspects in the version's line,
        and the engine goes on taking updates; after ``policy.max_rounds_without_model`` such folds in
        a row the run fails, saying why, instead of folding poison for ever."""
        suspects = list(self._record.get("folded", []))
        logger.warning(
            "version %d: model rejected, %s; the last good model stays (updates from %s)",
            self.version + 1,
            why,
            ", ".join(suspects),
        )
        self._record |= {"version": self.version, "aggregated": False, "model_rejected": why, "suspects": suspects}
        self._final_fold = False  # the last version is still to make: take updates again
        self.folds_without_model += 1
        bound = self.config.policy.max_rounds_without_model
        if bound is not None and self.folds_without_model >= bound:
            self._end_version(out, now, checkpoint=False, advance=False)
            self._fail(
                out,
                f"{self.folds_without_model} folds in a row made no new model (the last: {why});"
                " policy.max_rounds_without_model stops a federation that cannot progress",
            )
            return
        self._end_version(out, now, checkpoint=False)

    def _evaluated(self, out: list[c.Command], event: e.Evaluated, now: float) -> None:
        if event.step != self._evaluating:
            return
        self._evaluating = None
        if "accuracy" in event.metrics:
            self.accuracies.append((self.version - 1, float(event.metrics["accuracy"])))
        self._record |= dict(event.metrics)
        self._end_version(out, now, checkpoint=True)

    def _end_version(self, out: list[c.Command], now: float, *, checkpoint: bool, advance: bool = True) -> None:
        """The version's line, its checkpoint and status, then the next fold and tasks (`advance`),
        or the run's end."""
        record = self._record | {
            **{k: self._since[k] for k in ("stale", "expired", "lost", "rejected", "failed")},
            "live": len(self.live),
            "in_flight": len(self.tasks),
            "buffered": len(self.buffer),
            "round_seconds": round(now - self._last_version_at, 4),
            "ended_s": round(self._since_start(now), 4),
            "model_version": self.version,
        }
        self._since.clear()
        self._last_version_at = now
        self._record = {}
        out.append(c.Record(record))
        done = self.version >= self.ap.aggregations
        if "accuracy" in record:
            logger.info("version %d: accuracy %.4f", self.version, record["accuracy"])
        if checkpoint or done:
            out.append(c.Checkpoint(self.version - 1, self.checkpoint_meta()))
        progress_every = max(1, self.ap.aggregations // 100)
        if checkpoint or done or self.version % progress_every == 0:
            out.append(self.status(round_done=self.version - 1))
        if not advance:
            return
        if done:
            self._finish_run(out)
        elif self._stopping:
            self._stop_now(out)
        else:
            self._maybe_fold(out, now)
            self._dispatch(out, now)

    def _finish_run(self, out: list[c.Command]) -> None:
        if self.tasks:
            logger.info("%d tasks still in flight at the end: their updates will be refused as late", len(self.tasks))
        self._finish(out)

    # -- stopping --------------------------------------------------------------------------------------

    def _stop(self, out: list[c.Command], event: e.Stop, now: float) -> None:
        """Fold what was accepted (a partial buffer included), then stop: no accepted update is lost."""
        self._stopping = True
        if self._folding is None and self._evaluating is None:
            if self.buffer:
                self._maybe_fold(out, now, flush=True)
            else:
                self._stop_now(out)

    def _stop_now(self, out: list[c.Command]) -> None:
        if self.buffer:
            self._maybe_fold(out, 0.0, flush=True)
            return
        self.state = RunState.STOPPED
        out.append(c.Finish(RunState.STOPPED))

    def _fail(self, out: list[c.Command], error: str) -> None:
        if self.buffer:
            logger.error(
                "%d accepted updates were not folded: %s", len(self.buffer), ", ".join(u.node_id for u in self.buffer)
            )
        super()._fail(out, error)

    # -- state ----------------------------------------------------------------------------------------

    def status_fields(self) -> dict[str, Any]:
        return {
            "round": self.version,
            "rounds": self.ap.aggregations,
            "model_version": self.version,
            "engine": "async",
            "in_flight": len(self.tasks),
        }

    def checkpoint_meta(self) -> dict[str, Any]:
        return (
            {
                "engine": "async",
                "round": self.version - 1,
                "aggregations_completed": self.version,
                "dispatches": self.dispatches,
                "updates_folded": self.updates_folded,
            }
            | ({"folds_without_model": self.folds_without_model} if self.folds_without_model else {})
            | self._common_meta()
        )

    def restore(self, meta: Mapping[str, Any]) -> None:
        self._restore_common(meta)
        self.dispatches = int(meta["dispatches"])
        self.updates_folded = int(meta["updates_folded"])
        self.folds_without_model = int(meta.get("folds_without_model", 0))

    def summary_fields(self) -> dict[str, Any]:
        return super().summary_fields() | {
            "rounds": self.ap.aggregations,
            "rounds_completed": self.version,
            "aggregations": self.ap.aggregations,
            "aggregations_completed": self.version,
            "updates_folded": self.updates_folded,
            "updates_not_folded": dict(sorted(self.totals.items())),
            "in_flight_at_end": len(self.tasks),
            "buffered_at_end": len(self.buffer),
            "buffer": self.ap.buffer,
            "concurrency": self.ap.concurrency,
            "rule": self.ap.rule,
        }
