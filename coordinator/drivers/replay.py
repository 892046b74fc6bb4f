"""Replay a recorded run (`events.jsonl`) on the engine in this process, and check it step by step.

The engine is fed the recorded events at their recorded times, in their recorded order, and draws
the recorded task ids; everything else is recomputed: the half's configure, aggregate and evaluate
(run as the daemon's worker thread ran them, in the order asked), and each node's update, trained
from the model its task carried with the task's seed when the log says the update arrived. At each
step the replay checks what it computed against the log: the engine's commands (selections, tasks,
refusals, what each aggregation folds), every update's tensor hash, every aggregated model's hash
and every evaluation. It stops at the first difference with a `ReplayMismatch` that names the log
line, the step, the node and what differed; a log that cannot be read is a `ReplayError`.

What cannot be recomputed: an update no node of this federation produced (forged, corrupted), and
the work of a stateful node whose earlier update never reached the coordinator (its state then
differs): both show as a mismatch at the step where they matter.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedmq.broker import Kind, Message
from fedmq.coordinator.drivers.local import LocalFederation, _clone
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.observers.reporting import reproducible
from fedmq.coordinator.storage.eventlog import FORMAT, encode_command, tagged, untagged
from fedmq.fedcore import masked as m
from fedmq.fedcore.algorithms.base import CoordinatorHalf, Payload
from fedmq.fedcore.protocol import SecAggDirectory, UpdateFailed
from fedmq.fedcore.secagg import quantise
from fedmq.fedcore.tensors import arrays_sha256, flatten_groups, model_sha256, split_groups
from fedmq.fedcore.training import TrainSettings

CACHED_UPDATES = 256
"""Recomputed updates kept for duplicates (a node's update delivered twice)."""


class ReplayError(Exception):
    """The log cannot be replayed: unreadable, truncated mid-line, of another format, or resumed."""


@dataclass
class ReplayMismatch(Exception):
    """The replay went another way than the recorded run."""

    line: int
    what: str
    step: int | None = None
    node: str | None = None

    def __str__(self) -> str:
        where = [f"line {self.line}"]
        if self.step is not None:
            where.append(f"step {self.step}")
        if self.node is not None:
            where.append(f"node {self.node}")
        return f"{', '.join(where)}: {self.what}"


@dataclass(frozen=True, slots=True)
class Entry:
    """One line of the log, with its line number (1-based)."""

    line: int
    data: Mapping[str, Any]


@dataclass(slots=True)
class _Sent:
    spec: c.TaskSpec
    payload: Payload
    settings: TrainSettings
    step: int


@dataclass
class ReplayReport:
    events: int = 0
    updates: int = 0
    """Updates recomputed and found equal to the recorded ones."""
    aggregations: int = 0
    """Aggregated models whose hash matched."""
    evaluations: int = 0
    commands: int = 0
    complete: bool = False
    """The log ran to the run's end (its Finish)."""
    final_model_sha256: str = ""


def read_log(path: Path) -> tuple[Mapping[str, Any], list[Entry]]:
    """The header and the entries; a `ReplayError` saying which line is wrong."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ReplayError(f"cannot read the event log {path}: {exc.strerror or exc}") from None
    entries: list[Entry] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            last = number == len(text.splitlines())
            hint = " (the log is truncated: the run did not finish writing it)" if last else " (edited?)"
            raise ReplayError(f"{path}, line {number}: not a JSON line{hint}: {exc.msg}") from None
        if not isinstance(data, dict):
            raise ReplayError(f"{path}, line {number}: expected a JSON object")
        entries.append(Entry(number, data))
    if not entries or entries[0].data.get("log") != "fedmq-events":
        raise ReplayError(f'{path} is not a fedmq event log (its first line has no "log": "fedmq-events")')
    header = entries[0].data
    if header.get("format") != FORMAT:
        raise ReplayError(f"{path}: event log format {header.get('format')!r}; this fedmq reads format {FORMAT}")
    for entry in entries:
        if "resume" in entry.data:
            raise ReplayError(
                f"{path}, line {entry.line}: the run was resumed from a checkpoint there; replay covers runs"
                " from a fresh start to their end"
            )
    return header, entries[1:]


def _groups(entries: Iterable[Entry]) -> Iterator[tuple[Entry, list[Entry]]]:
    """Each event with the command lines that followed it (the engine's answer to it)."""
    current: Entry | None = None
    answer: list[Entry] = []
    for entry in entries:
        if "ev" in entry.data:
            if current is not None:
                yield current, answer
            current, answer = entry, []
        elif "cmd" in entry.data:
            if current is None:
                raise ReplayError(f"line {entry.line}: a command before any event")
            answer.append(entry)
        elif "id" not in entry.data:
            raise ReplayError(f"line {entry.line}: neither an event, a command nor a task id: {dict(entry.data)}")
    if current is not None:
        yield current, answer


def _same(a: Any, b: Any) -> bool:
    """Equality in which NaN equals NaN (a metric may be NaN in both)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _first_difference(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> str:
    for key in sorted(set(ours) | set(theirs)):
        if not _same(ours.get(key), theirs.get(key)):
            return f"{key}: recorded {theirs.get(key)!r}, replayed {ours.get(key)!r}"
    return "no difference"


def _check_metrics(entry: Entry, ours: Mapping[str, Any], what: str, step: int, half: CoordinatorHalf) -> None:
    """The recorded metrics are the replay's, those the run measured of itself (wall times) aside."""
    recorded = reproducible(untagged(entry.data.get("metrics", {})), half)
    mine = reproducible(ours, half)
    if not _same(mine, recorded):
        raise ReplayMismatch(entry.line, f"{what} differ: " + _first_difference(mine, recorded), step)


@dataclass
class Replay(LocalFederation):
    """`LocalFederation` driven by a log instead of its own clock and nodes' timing."""

    entries: list[Entry] = field(default_factory=list)
    report: ReplayReport = field(default_factory=ReplayReport)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._ids = deque(bytes.fromhex(str(x.data["id"])) for x in self.entries if "id" in x.data)
        self.engine.new_id = self._draw_id
        self._sent: dict[tuple[bytes, str], _Sent] = {}
        self._configured: set[int] = set()
        self._results: dict[int, e.Aggregated | e.Evaluated] = {}
        self._cache: OrderedDict[tuple[bytes, str], tuple[str, dict[str, Any], Message]] = OrderedDict()
        self._group_of: dict[tuple[bytes, str], list[tuple[bytes, str]]] = {}
        """With `vectorize`: each sent task's group, the tasks of one engine answer (as the run trained them)."""
        self._trained_ahead: dict[tuple[bytes, str], Message] = {}
        self._sent_keys: dict[tuple[int, str], tuple[bytes, str]] = {}
        """(step, node) -> the key of the task sent (the last one: a step sends a node one task)."""
        """Updates trained with their group before the log says they arrived."""
        self._line = 0
        self._half_calls.masks = False  # the recomputed updates are unmasked: their sum is taken as it is
        self._bases: dict[tuple[bytes, str], Payload] = {}
        """With secure aggregation, the model each task carried (its update is the change from it)."""
        self._weight_totals: dict[tuple[bytes, str], int] = {}
        """With secure aggregation, each task's directory total (its update is weighted by n over it)."""
        if any(x.data.get("ev") == "NodeSeen" and "num_samples" not in x.data for x in self.entries):
            # recorded before announced counts were logged (and checked): replay it as it ran, unchecked
            policy = dataclasses.replace(self.engine.policy, require_announced_samples=False)
            self.engine.policy = policy
            self.engine.config = dataclasses.replace(self.engine.config, policy=policy)

    def _draw_id(self) -> bytes:
        if not self._ids:
            raise ReplayMismatch(self._line, "the engine drew a task id the recorded run did not draw")
        return self._ids.popleft()

    # -- the replay ------------------------------------------------------------------------------------

    def replay(self) -> ReplayReport:
        """Feed every recorded event; raise `ReplayMismatch` at the first difference."""
        groups = list(_groups(self.entries))
        with self.training_modes():  # as the run: its nodes' groups and its coordinator's captured steps
            self._feed_all(groups)
        self.report.complete = self.engine.finished
        self.report.final_model_sha256 = model_sha256(self.half.model)
        return self.report

    def _feed_all(self, groups: list[tuple[Entry, list[Entry]]]) -> None:
        """Each recorded event to the engine, its answer compared and executed."""
        for i, (entry, answer) in enumerate(groups):
            self._line = entry.line
            try:
                event = self._event(entry)
            except (KeyError, TypeError, ValueError) as exc:
                raise ReplayError(f"line {entry.line}: a malformed {entry.data.get('ev')} event: {exc!r}") from None
            self.clock.set(max(float(entry.data["t"]), self.clock.now()))
            commands = self.engine.handle(event, self.clock.now())
            if not self._compare(entry, commands, answer, last=i == len(groups) - 1):
                break  # the log was cut while the engine's last answer was being written: it ends here
            for command in commands:
                self._execute(command)
            self._note_group([command for command in commands if isinstance(command, c.SendTask)])
            self.report.events += 1

    def _compare(self, entry: Entry, commands: list[c.Command], answer: list[Entry], *, last: bool) -> bool:
        """Check the engine's answer against the log's; False when the log's last answer was cut short."""
        ours = [line for line in map(encode_command, commands) if line is not None]
        for i, recorded in enumerate(answer):
            if i >= len(ours):
                raise ReplayMismatch(recorded.line, f"the replayed engine did not issue {dict(recorded.data)}")
            if not _same(ours[i], dict(recorded.data)):
                step = recorded.data.get("step")
                node = recorded.data.get("node")
                what = f"{recorded.data.get('cmd')}: " + _first_difference(ours[i], recorded.data)
                raise ReplayMismatch(recorded.line, what, step if isinstance(step, int) else None, node)
        self.report.commands += len(answer)
        if len(ours) > len(answer):
            if last:
                return False
            raise ReplayMismatch(
                entry.line, f"after {entry.data.get('ev')} the replayed engine also issued {ours[len(answer)]}"
            )
        return True

    def _event(self, entry: Entry) -> e.Event:
        d = entry.data
        kind = d["ev"]
        if kind == "Start":
            return e.Start()
        if kind == "Tick":
            return e.Tick()
        if kind == "Stop":
            return e.Stop(str(d.get("reason", "stopped")))
        if kind == "NodeSeen":
            n = d.get("num_samples")
            return e.NodeSeen(str(d["node"]), bool(d["online"]), None if n is None else int(n))
        if kind == "Acked":
            task = d.get("task")
            return e.Acked(str(d["node"]), int(d["round"]), bytes.fromhex(task) if task is not None else None)
        if kind == "TaskUnsent":
            return e.TaskUnsent(str(d["node"]), bytes.fromhex(d["task"]))
        if kind == "Configured":
            step = int(d["step"])
            if step not in self._configured:
                raise ReplayMismatch(entry.line, "Configured for a step the replay did not configure", step)
            return e.Configured(step, bool(d["inline"]))
        if kind == "Aggregated":
            return self._aggregated(entry)
        if kind == "Evaluated":
            return self._evaluated(entry)
        if kind == "UpdateArrived":
            return self._arrived(entry)
        if kind == "SecAggArrived":
            meta = untagged(d["meta"])
            if not isinstance(meta, dict):
                raise TypeError("meta is not a map")
            message = Message(
                kind=Kind(str(d["kind"])), federation=self.engine.config.federation, round=int(d["round"]),
                sender=str(d["node"]), meta=meta,
            )  # fmt: skip
            return e.SecAggArrived(message, float(d["received_at"]))
        raise ReplayError(f"line {entry.line}: unknown event {kind!r}")

    def _aggregated(self, entry: Entry) -> e.Aggregated:
        step = int(entry.data["step"])
        ours = self._results.pop(step, None)
        if not isinstance(ours, e.Aggregated):
            raise ReplayMismatch(entry.line, "an aggregation the replay did not ask for", step)
        if ours.model_sha256 != entry.data.get("model_sha256"):
            raise ReplayMismatch(
                entry.line,
                f"the aggregated model differs: sha256 {entry.data.get('model_sha256')} recorded,"
                f" {ours.model_sha256} replayed",
                step,
            )
        if ours.rejected != entry.data.get("rejected", ""):
            raise ReplayMismatch(
                entry.line,
                f"the model was rejected {entry.data.get('rejected')!r} recorded, {ours.rejected!r} replayed",
            )
        _check_metrics(entry, ours.metrics, "the aggregation's metrics", step, self.half)
        self.report.aggregations += 1
        return ours

    def _evaluated(self, entry: Entry) -> e.Evaluated:
        step = int(entry.data["step"])
        ours = self._results.pop(step, None)
        if not isinstance(ours, e.Evaluated):
            raise ReplayMismatch(entry.line, "an evaluation the replay did not ask for", step)
        _check_metrics(entry, ours.metrics, "the evaluation's metrics", step, self.half)
        self.report.evaluations += 1
        return ours

    def _arrived(self, entry: Entry) -> e.UpdateArrived:
        d = entry.data
        node, meta = str(d["node"]), untagged(d["meta"])
        if not isinstance(meta, dict):
            raise TypeError("meta is not a map")
        task = meta.get("task")
        key = (task, node) if isinstance(task, bytes) else None
        tensors: Mapping[str, Any] = {}
        if key is not None and not UpdateFailed.is_failure(meta) and int(d.get("tensors", 0)):
            tensors = self._recompute(entry, key, meta)
        message = Message(
            kind=Kind.UPDATE, federation=self.engine.config.federation, round=int(d["round"]), sender=node,
            meta=meta, tensors=dict(tensors),
        )  # fmt: skip
        return e.UpdateArrived(message, float(d["received_at"]))

    def _recompute(self, entry: Entry, key: tuple[bytes, str], meta: Mapping[str, Any]) -> Mapping[str, Any]:
        """The node's update for the task, trained now (or, for a duplicate, as trained before)."""
        node = key[1]
        cached = self._cache.get(key)
        if cached is None:
            produced = self._trained_ahead.pop(key, None)  # trained with its group already
            if produced is None:
                sent = self._sent.pop(key, None)
                if sent is None:
                    raise ReplayMismatch(
                        entry.line,
                        f"an update for task {key[0].hex()} that the replay never sent to this node",
                        node=node,
                    )
                produced = self._produce_with_group(key, sent)
            if UpdateFailed.is_failure(produced.meta):
                failed = UpdateFailed.from_meta(produced.meta)
                raise ReplayMismatch(entry.line, f"training failed in the replay: {failed.reason}", node=node)
            if self.engine.config.secure_aggregation is not None:
                produced = self._unmasked(entry, key, produced)
            cached = (arrays_sha256(produced.tensors), dict(produced.meta.get("payload", {})), produced)
            self._cache[key] = cached
            while len(self._cache) > CACHED_UPDATES:
                self._cache.popitem(last=False)
        digest, payload_meta, produced = cached
        masked = self.engine.config.secure_aggregation is not None  # its own masks were random, never logged
        if not masked and digest != entry.data.get("sha256"):
            raise ReplayMismatch(
                entry.line,
                f"the recomputed update of round {entry.data.get('round')} differs from the recorded one:"
                f" sha256 {entry.data.get('sha256')} recorded, {digest} replayed",
                node=node,
            )
        recorded = meta.get("payload", {})
        if not _same(untagged(json.loads(json.dumps(tagged(payload_meta)))), recorded):
            raise ReplayMismatch(
                entry.line,
                "the update's payload meta differs: " + _first_difference(payload_meta, dict(recorded)),
                node=node,
            )
        self.report.updates += 1
        return produced.tensors

    def _unmasked(self, entry: Entry, key: tuple[bytes, str], produced: Message) -> Message:
        """A secure task's update as the node would have masked it, without the masks: its weighted
        change from the model the task carried, quantised. The masks cancel in the unmasking, which is
        exact, so the sum of these is the sum the recorded run unmasked, and the model the same."""
        settings = self.engine.config.secure_aggregation
        base, total = self._bases.pop(key, None), self._weight_totals.pop(key, None)
        if settings is None or base is None or total is None:
            raise ReplayMismatch(entry.line, "a masked update of a task the replay sent no directory for", node=key[1])
        trained = split_groups(dict(produced.tensors))["model"]
        weight = int(produced.meta["num_samples"]) / total
        values, clipped = quantise(m.weighted_change(trained, base.tensors["model"], weight), settings)
        meta = dict(produced.meta) | {"payload": {**produced.meta.get("payload", {}), "secagg_clipped": clipped}}
        tensors = flatten_groups({m.GROUP: {m.TENSOR: m.as_wire(values)}})
        return dataclasses.replace(produced, meta=meta, tensors=tensors)

    def _note_group(self, tasks: list[c.SendTask]) -> None:
        """The tasks of one engine answer train as one group when `vectorize` is on, as `_train_all` does."""
        if not self.vectorize or len(tasks) < 2:
            return
        keys = [key for t in tasks if (key := self._sent_keys.pop((t.step, t.node), None)) is not None]
        for key in keys:
            self._group_of[key] = keys

    def _produce_with_group(self, key: tuple[bytes, str], sent: _Sent) -> Message:
        """`key`'s update, trained with its group (whose other updates wait in `_trained_ahead`) or alone."""
        keys = self._group_of.pop(key, None)
        if keys is None:
            return self.produce(sent.spec, sent.payload, sent.settings, 0.0)
        members = {k: sent if k == key else self._sent.pop(k) for k in keys if k == key or k in self._sent}
        for k in keys:
            self._group_of.pop(k, None)
        work = [(s.spec, s.payload, s.settings) for s in members.values()]
        trained = self._train_group(work)
        for k, s in members.items():
            if k != key:
                self._trained_ahead[k] = self.produce(s.spec, s.payload, s.settings, 0.0, trained=trained.get(k[1]))
        return self.produce(sent.spec, sent.payload, sent.settings, 0.0, trained=trained.get(key[1]))

    # -- commands: the half's calls run now, their results wait for their recorded turn -------------------

    def _execute(self, command: c.Command) -> None:
        if isinstance(command, c.Configure):
            payload = self._calls.configure(command)
            settings = TrainSettings.from_meta(command.settings)
            shared = _clone(payload) if isinstance(payload, Payload) else None  # as the wire copies it
            for t in command.tasks:
                sent = shared if shared is not None else _clone(payload[t.node])  # type: ignore[index]
                self._sent[(t.task, t.node)] = _Sent(t, sent, settings, command.step)
                if self.engine.config.secure_aggregation is not None:
                    self._bases[(t.task, t.node)] = sent
                self._sent_keys[(command.step, t.node)] = (t.task, t.node)
            self._configured.add(command.step)
        elif isinstance(command, c.Aggregate):
            aggregated, records = self._calls.aggregate(command)
            for name, lines in records.items():
                self.round_records.setdefault(name, []).extend(lines)
            self._results[command.step] = aggregated
        elif isinstance(command, c.Evaluate):
            self._results[command.step] = e.Evaluated(command.step, dict(self.evaluate()) if self.evaluate else {})
        elif isinstance(command, c.Rollback):
            self._calls.rollback()
        elif isinstance(command, c.SendTask | c.Broadcast | c.Resend):
            pass  # the node's update is trained when the log says it arrived
        elif isinstance(command, c.SendSecAgg):  # the nodes' answers come from the log
            if isinstance(command.message, SecAggDirectory):
                self._weight_totals[(command.message.task_id, command.node)] = command.message.weight_total
        else:
            super()._execute(command)
