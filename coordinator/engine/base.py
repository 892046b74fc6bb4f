"""What every round policy shares: liveness, the participation record, waiting for nodes, the
half's context, status, checkpoint meta, and refusing or declining updates.

An engine is synchronous and pure: `handle(event, now)` returns commands and changes only the
engine's own state; `next_deadline()` says when it wants a `Tick`. It reads no clock, does no I/O and
calls no algorithm half (the commands ask for that), so its tests run in milliseconds on a FakeClock.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fedmq.broker import Message
from fedmq.coordinator.config import CoordinatorConfig
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.errors import ProtocolError
from fedmq.coordinator.updates import check_samples
from fedmq.fedcore.algorithms.base import Folding, NodeUpdate, RoundContext
from fedmq.fedcore.participation import ParticipationRecord
from fedmq.fedcore.protocol import ReceiptStatus, RunState
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.tensors import TensorSpec

logger = logging.getLogger(__name__)

Schema = Mapping[str, Mapping[str, TensorSpec]]
NO_RECEIPT = frozenset({"duplicate-update", "wrong-round", "not-selected", "wrong-sender", "foreign-task"})
"""Refusals not answered with a receipt: the sender has no task to hear about, or is not who it says."""


def new_task_id() -> bytes:
    return os.urandom(16)


def node_task_id(secret: bytes, node: str) -> bytes:
    """The task id `node` gets for the round attempt whose secret is `secret` (a drawn `new_id`):
    HMAC-SHA256(secret, "node/" + node), its first 16 bytes.

    A synchronous attempt used to give every selected node the same id, and the model broadcast,
    which every node may read, carried it: a node able to publish on another's topic quoted a valid
    id (issue 31, item 4). Now each node's id reaches that node alone (on its task topic), and neither
    another node's id nor the broadcast's `model_id` tells anything of it. Derived rather than drawn
    per node, so that the engine still draws (and the event log records, and a replay draws back)
    one id an attempt, and checks an id by recomputing it: nothing to store per node. Pure: the
    engine stays free of I/O."""
    return hmac.new(secret, b"node/" + node.encode(), hashlib.sha256).digest()[:16]


def public_model_id(secret: bytes) -> bytes:
    """What the attempt's model broadcast (and every task of it, as `model_id`) carries so that a
    node matches the model to its task and nodes sharing a host train together: derived from the
    secret like the nodes' task ids ("model" cannot collide with "node/..."), and no use in an update."""
    return hmac.new(secret, b"model", hashlib.sha256).digest()[:16]


class Engine(ABC):
    """The shared part of `SyncRounds` and `BufferedAsync`."""

    def __init__(self, config: CoordinatorConfig, schema: Schema, *, new_id: Callable[[], bytes] = new_task_id) -> None:
        self.config = config
        self.policy = config.policy
        self.schema = schema
        self.new_id = new_id
        self.participation = ParticipationRecord()
        self.live: set[str] = set()
        self.announced: dict[str, int | None] = {}
        """Each node's sample count from its latest online announcement (None: it announced none)."""
        self.state = RunState.STARTING
        self.error = ""
        self.version = 0
        """The global model's version: the number of aggregations so far."""
        self.accuracies: list[tuple[int, float]] = []
        self.refused: Counter[str] = Counter()
        """Updates not taken, by reason: protocol refusals (also counted with the bus's rejections of
        bad messages) and valid updates that policy declined (late, stale, expired, finished)."""
        self.late_arrivals = 0
        self.started_at: float | None = None
        self.startup_s: float | None = None
        """Seconds from start until enough nodes were live and the first round or task began."""
        self._wait_until: float | None = None
        self._wait_for = 0
        self._step = 0

    # -- the interface ---------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.state.final

    def handle(self, event: e.Event, now: float) -> list[c.Command]:
        """React to one event at time `now`; the commands come in the order they must run."""
        out: list[c.Command] = []
        if self.finished:
            if isinstance(event, e.UpdateArrived):
                self._decline(out, event.message, "finished", "the run is over", "late")
            return out
        if isinstance(event, e.Start):
            self._start(out, now)
        elif isinstance(event, e.NodeSeen):
            self._node_seen(out, event, now)
        elif isinstance(event, e.Tick):
            self._tick(out, now)
        elif isinstance(event, e.UpdateArrived):
            self._update(out, event, now)
        elif isinstance(event, e.Stop):
            self._stop(out, event, now)
        else:
            self._on(out, event, now)
        return out

    def next_deadline(self) -> float | None:
        """When the engine next needs a `Tick` (None: only events move it on)."""
        times = [t for t in (self._wait_until, *self._deadlines()) if t is not None]
        return min(times) if times else None

    # -- what a policy provides ------------------------------------------------------------------

    @abstractmethod
    def _begin(self, out: list[c.Command], now: float) -> None:
        """Enough nodes are live for the first time: start working."""

    @abstractmethod
    def _on(self, out: list[c.Command], event: e.Event, now: float) -> None:
        """Every event but Start, NodeSeen, Tick, UpdateArrived and Stop."""

    @abstractmethod
    def _on_update(self, out: list[c.Command], event: e.UpdateArrived, now: float) -> None: ...

    @abstractmethod
    def _on_liveness(self, out: list[c.Command], node: str, online: bool, now: float) -> None:
        """A node came or went while the run was going."""

    @abstractmethod
    def _on_tick(self, out: list[c.Command], now: float) -> None: ...

    @abstractmethod
    def _deadlines(self) -> Sequence[float | None]: ...

    @abstractmethod
    def _stop(self, out: list[c.Command], event: e.Stop, now: float) -> None: ...

    @abstractmethod
    def status_fields(self) -> dict[str, Any]:
        """What the status message says besides the state (round, rounds, version, ...)."""

    @abstractmethod
    def checkpoint_meta(self) -> dict[str, Any]: ...

    @abstractmethod
    def restore(self, meta: Mapping[str, Any]) -> None:
        """Continue from a checkpoint's meta (the daemon restored the half's tensors)."""

    # -- shared steps ----------------------------------------------------------------------------

    def _start(self, out: list[c.Command], now: float) -> None:
        self.started_at = now
        self.state = RunState.WAITING
        out.append(self.status())
        self._wait(out, self.policy.min_nodes, now)

    def _wait(self, out: list[c.Command], count: int, now: float) -> None:
        """Wait (up to wait_for_nodes_s) until `count` nodes are live, then `_resume_waiting`."""
        self._wait_for = count
        self._wait_until = now + self.policy.wait_for_nodes_s
        self._check_wait(out, now)

    def _check_wait(self, out: list[c.Command], now: float) -> None:
        if self._wait_until is None or len(self.live) < self._wait_for:
            return
        self._wait_until = None
        if self.state == RunState.WAITING:
            self.state = RunState.RUNNING
            self.startup_s = self._since_start(now)
            logger.info("%d nodes live; starting at version %d", len(self.live), self.version)
            self._begin(out, now)
        else:
            self._resume_waiting(out, now)

    @abstractmethod
    def _resume_waiting(self, out: list[c.Command], now: float) -> None:
        """A wait for nodes in the middle of the run is over (sync: the attempt goes ahead)."""

    def _node_seen(self, out: list[c.Command], event: e.NodeSeen, now: float) -> None:
        was = event.node in self.live
        if event.online:
            limit = self.config.sample_limit(event.node)
            if event.num_samples is not None and limit is not None and event.num_samples > limit:
                # refused as if never sent: the node does not come online with a weight above the limit
                detail = f"announces {event.num_samples} samples, above its limit of {limit} ({self._limit_source})"
                logger.warning("node %s %s; its announcement is ignored", event.node, detail)
                self.refused["samples-over-limit"] += 1
                out.append(c.Refused(event.node, "samples-over-limit", detail))
                return
            self.announced[event.node] = event.num_samples
            self.live.add(event.node)
        else:
            self.live.discard(event.node)
        if was != event.online and self.state != RunState.WAITING:
            self._on_liveness(out, event.node, event.online, now)
        self._check_wait(out, now)

    def _tick(self, out: list[c.Command], now: float) -> None:
        if self._wait_until is not None and now >= self._wait_until:
            self._wait_until = None
            if self.state == RunState.WAITING:
                self._fail(
                    out,
                    f"only {len(self.live)} of the {self._wait_for} nodes needed came online within"
                    f" {self.policy.wait_for_nodes_s:g} s; start the nodes, or lower min_nodes",
                )
            else:
                self._fail(out, f"no node came back online within {self.policy.wait_for_nodes_s:g} s")
            return
        self._on_tick(out, now)

    def _update(self, out: list[c.Command], event: e.UpdateArrived, now: float) -> None:
        try:
            self._on_update(out, event, now)
        except ProtocolError as exc:
            self._refuse(out, event.message, exc.reason, exc.detail)

    def _check_samples(self, update: NodeUpdate) -> None:
        """The update's sample count against the node's announcement and the limit (ProtocolError)."""
        check_samples(
            update.node_id,
            update.num_samples,
            self.announced.get(update.node_id),
            limit=self.config.sample_limit(update.node_id),
            required=self.policy.require_announced_samples,
        )

    @property
    def _limit_source(self) -> str:
        """Where a node's sample limit comes from, for the refusal's reader."""
        if self.config.node_samples is None:
            return "policy.max_node_samples"
        return "its shard of the experiment's partition, or policy.max_node_samples"

    def _refuse(
        self, out: list[c.Command], message: Message, reason: str, detail: str, *, receipt: ReceiptStatus = "rejected"
    ) -> None:
        """A message that breaks the protocol (malformed, forged, duplicated, out of round): counted
        with the bus's rejections, answered with a receipt unless the sender has no task to hear of."""
        self.refused[reason] += 1
        out.append(c.Refused(message.sender, reason, detail))
        if reason not in NO_RECEIPT:
            self._receipt(out, message, receipt, reason if receipt == "rejected" else detail)

    def _decline(self, out: list[c.Command], message: Message, reason: str, detail: str, status: ReceiptStatus) -> None:
        """A valid update that policy does not fold (too late, too stale, the run is over): counted
        with the engine's outcomes, not the bus's rejections, and the node is told why."""
        self.refused[reason] += 1
        out.append(c.Refused(message.sender, reason, detail, protocol=False))
        self._receipt(out, message, status, detail)

    def _receipt(self, out: list[c.Command], message: Message, status: ReceiptStatus, reason: str = "") -> None:
        """Tell the sender what became of its update, unless its task id is not even a byte string
        (or the update was taken and `policy.receipts` asks for refusals only)."""
        task = message.meta.get("task")
        if status == "received" and self.policy.receipts == "refusals":
            return
        if isinstance(task, bytes | None):
            out.append(c.Receipt(message.sender, message.round, task, message.message_id, status, reason))

    def _fail(self, out: list[c.Command], error: str) -> None:
        logger.error("%s", error)
        self.state, self.error = RunState.FAILED, error
        out.append(c.Finish(RunState.FAILED, error))

    def _finish(self, out: list[c.Command]) -> None:
        self.state = RunState.FINISHED
        out.append(c.Finish(RunState.FINISHED))

    def _since_start(self, now: float) -> float:
        """Seconds since `Start` (a clock may well start at 0)."""
        return 0.0 if self.started_at is None else now - self.started_at

    def _next_step(self) -> int:
        self._step += 1
        return self._step

    def _context(
        self,
        rnd: int,
        selected: tuple[str, ...],
        step: str,
        *,
        folding: Folding | None = None,
        version: int | None = None,
    ) -> RoundContext:
        """What the half sees; `step` names its random stream (configure or aggregate). The record is
        the engine's own: an engine does not change it while an aggregation (which reads it) runs."""
        return RoundContext(
            round=rnd,
            selected=selected,
            participation=self.participation,
            settings=self.config.train.for_round(rnd),
            generator=torch_generator(self.config.seed, "coordinator", step, rnd),
            version=self.version if version is None else version,
            folding=folding or Folding(),
        )

    def keeps_models(self) -> bool:
        """Whether the model each task carries must be kept until no update can come from it
        (`Configure.keep_model`, let go by `Aggregate.keep_from`): delta-compressed updates are
        differences from their task's model, which the coordinator adds back before aggregating."""
        return self.config.compression.enabled and self.config.compression.delta

    def _eval_due(self, index: int, last: int) -> bool:
        """Evaluate after step `index` (0-based) of `last + 1`: every eval_every, each of the last
        eval_last, and the last."""
        return index == last or (index + 1) % self.config.eval_every == 0 or index > last - self.config.eval_last

    def status(self, **extra: Any) -> c.PublishStatus:
        fields = self.status_fields() | {"live_nodes": len(self.live), **extra}
        if self.accuracies:
            fields["accuracy"] = self.accuracies[-1][1]
            fields["best_accuracy"] = max(a for _, a in self.accuracies)
        return c.PublishStatus(self.state, fields)

    def _common_meta(self) -> dict[str, Any]:
        return {
            "model_version": self.version,
            "accuracies": list(self.accuracies),
            "participation": self.participation.to_json(),
            "federation": self.config.federation,
            "seed": self.config.seed,
        }

    def _restore_common(self, meta: Mapping[str, Any]) -> None:
        self.version = int(meta["model_version"])
        self.accuracies = [(int(r), float(a)) for r, a in meta["accuracies"]]
        self.participation = ParticipationRecord.from_json(meta["participation"])

    def summary_fields(self) -> dict[str, Any]:
        """What the engine adds to summary.json."""
        return {
            "model_version": self.version,
            "late_arrivals": self.late_arrivals,
            "startup_seconds": None if self.startup_s is None else round(self.startup_s, 3),
            "refused_updates": dict(sorted(self.refused.items())),
            **({"error": self.error} if self.error else {}),  # why a failed run failed
        }
