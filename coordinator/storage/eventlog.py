"""The run's event log, `events.jsonl`: everything the engine was told and what it decided.

The engine is pure, so its input events with their times (plus the task ids it drew) determine
every decision it makes; updates are logged as their metadata and a hash of their tensors, which a
replay recomputes. Commands are logged so that a replay can say where it first went another way,
and so that a reader sees selections, tasks, refusals and aggregations in order. The format is
documented in docs/replay.md. Lines are JSON; bytes are written as ``{"$b": HEX}``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

from fedmq.coordinator.config import CoordinatorConfig
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.fedcore.tensors import arrays_sha256

logger = logging.getLogger(__name__)

FORMAT = 2
"""2: a synchronous attempt's tasks carry each node's own id (`engine.base.node_task_id`), derived from
the id drawn; format 1 logs, whose nodes shared one id, no longer replay (issue 31)."""
FILENAME = "events.jsonl"


def tagged(value: Any) -> Any:
    """`value` as JSON can hold it, reversibly (`untagged`): bytes and non-string keys are tagged."""
    if isinstance(value, bytes | bytearray | memoryview):
        return {"$b": bytes(value).hex()}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value):
            return {k: tagged(v) for k, v in value.items()}
        return {"$map": [[tagged(k), tagged(v)] for k, v in value.items()]}
    if isinstance(value, list | tuple):
        return [tagged(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def untagged(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$b"}:
            return bytes.fromhex(value["$b"])
        if set(value) == {"$map"}:
            return {_hashable(untagged(k)): untagged(v) for k, v in value["$map"]}
        return {k: untagged(v) for k, v in value.items()}
    if isinstance(value, list):
        return [untagged(v) for v in value]
    return value


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _hex(task: bytes | None) -> str | None:
    return task.hex() if isinstance(task, bytes) else None


def encode_event(event: e.Event) -> dict[str, Any]:
    """The event's fields as its log line holds them (without the sequence number and time)."""
    name = type(event).__name__
    if isinstance(event, e.NodeSeen):
        return {"ev": name, "node": event.node, "online": event.online, "num_samples": event.num_samples}
    if isinstance(event, e.Acked):
        return {"ev": name, "node": event.node, "round": event.round, "task": _hex(event.task)}
    if isinstance(event, e.UpdateArrived):
        m, ingested = event.message, event.ingested  # its digest taken in the ingest step when there was one
        return {
            "ev": name,
            "node": m.sender,
            "round": m.round,
            "received_at": event.received_at,
            "meta": tagged(m.meta),
            "tensors": len(m.tensors),
            "bytes": ingested.nbytes if ingested else int(sum(np.asarray(a).nbytes for a in m.tensors.values())),
            "sha256": ingested.sha256 if ingested else arrays_sha256(m.tensors),
        }
    if isinstance(event, e.SecAggArrived):
        m = event.message
        return {
            "ev": name,
            "node": m.sender,
            "kind": str(m.kind),
            "round": m.round,
            "received_at": event.received_at,
            "meta": tagged(m.meta),
        }
    if isinstance(event, e.TaskUnsent):
        return {"ev": name, "node": event.node, "task": event.task.hex()}
    if isinstance(event, e.Configured):
        return {"ev": name, "step": event.step, "inline": event.inline}
    if isinstance(event, e.Aggregated):
        fields = {"ev": name, "step": event.step, "metrics": tagged(event.metrics), "model_sha256": event.model_sha256}
        return fields | ({"rejected": event.rejected} if event.rejected else {})
    if isinstance(event, e.Evaluated):
        return {"ev": name, "step": event.step, "metrics": tagged(event.metrics)}
    if isinstance(event, e.Stop):
        return {"ev": name, "reason": event.reason}
    return {"ev": name}  # Start, Tick


LOGGED_COMMANDS = (
    c.Configure, c.SendTask, c.Broadcast, c.Resend, c.Refused, c.Aggregate, c.SendSecAgg, c.Evaluate, c.Rollback,
    c.Finish,
)  # fmt: skip
"""Decisions worth reading and checking; receipts, records, statuses and checkpoints follow from them."""


def encode_command(command: c.Command) -> dict[str, Any] | None:
    """The command as its log line holds it; None for the kinds not logged."""
    name = type(command).__name__
    if isinstance(command, c.Configure):
        return {
            "cmd": name,
            "step": command.step,
            "round": command.ctx.round,
            "version": command.ctx.version,
            "tasks": [[t.node, t.task.hex(), t.round, t.attempt, t.version] for t in command.tasks],
            "inline_only": command.inline_only,
        }
    if isinstance(command, c.SendTask | c.Resend):
        return {"cmd": name, "step": command.step, "node": command.node}
    if isinstance(command, c.Broadcast):
        return {"cmd": name, "step": command.step, "round": command.round}
    if isinstance(command, c.Refused):
        return {"cmd": name, "node": command.node, "reason": command.reason, "detail": command.detail}
    if isinstance(command, c.Aggregate):
        return {
            "cmd": name,
            "step": command.step,
            "round": command.ctx.round,
            "updates": [[u.node_id, u.round, u.base_version, u.staleness, u.num_samples] for u in command.updates],
            "failures": [[f.node_id, f.round, f.reason] for f in command.failures],
            "bases": list(command.bases),
        }
    if isinstance(command, c.SendSecAgg):  # its content follows from the logged events: a digest of it
        meta = json.dumps(tagged(command.message.to_meta()), sort_keys=True).encode()
        return {"cmd": name, "node": command.node, "sha256": hashlib.sha256(meta).hexdigest()}
    if isinstance(command, c.Evaluate):
        return {"cmd": name, "step": command.step}
    if isinstance(command, c.Rollback):
        return {"cmd": name, "step": command.step, "reason": command.reason}
    if isinstance(command, c.Finish):
        return {"cmd": name, "state": command.state, "error": command.error}
    return None


def log_header(config: CoordinatorConfig, **extra: Any) -> dict[str, Any]:
    """What the first line says of the run (besides the format)."""
    return {
        "federation": config.federation,
        "engine": config.engine,
        "method": config.method,
        "seed": config.seed,
        "started_unix": time.time(),
        **extra,
    }


def _drop_partial_line(path: Path) -> None:
    """Cut a line the killed run left half-written (its buffer was flushed mid-line), so that the
    resumed run's lines start on a line of their own and the log stays one JSON object a line."""
    with path.open("rb+") as fh:
        size = fh.seek(0, 2)
        fh.seek(max(0, size - (1 << 20)))
        tail = fh.read()
        if tail.endswith(b"\n"):
            return
        cut = tail.rfind(b"\n")
        if cut < 0 and size > len(tail):
            return  # a line longer than the tail read: leave it to the reader to report
        fh.truncate(size - len(tail) + cut + 1)
        logger.warning("event log %s: dropped a half-written last line of the run that was cut off", path)


class EventLog:
    """Written from `start` until `close`. Lines are flushed at every aggregation and at the end, so
    a crash loses at most the lines since the last model version."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None
        self._seq = 0

    def start(self, header: Mapping[str, Any], *, resumed: Mapping[str, Any] | None = None) -> None:
        """A fresh log with `header`; or, for a run resumed from its checkpoint, the old log
        continued after a line that says so."""
        try:
            if resumed is not None and self.path.exists() and self.path.stat().st_size:
                _drop_partial_line(self.path)
                self._file = self.path.open("a", buffering=1 << 16)
                self._write({"resume": tagged(dict(resumed))})
            else:
                self._file = self.path.open("w", buffering=1 << 16)
                self._write({"log": "fedmq-events", "format": FORMAT, **tagged(dict(header))})
        except OSError as exc:
            logger.error("cannot write the event log %s (%s); the run goes on without it", self.path, exc)
            self._file = None

    def _write(self, line: Mapping[str, Any]) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        except (OSError, TypeError, ValueError) as exc:  # the log must never stop the run
            logger.error("event log %s: cannot write a line (%r); the log stops here", self.path, exc)
            self.close()

    def event(self, now: float, event: e.Event) -> None:
        self._seq += 1
        self._write({"n": self._seq, "t": now, **encode_event(event)})
        if isinstance(event, e.Aggregated) and self._file is not None:
            self._file.flush()

    def commands(self, commands: list[c.Command]) -> None:
        for command in commands:
            line = encode_command(command)
            if line is not None:
                self._write(line)

    def recording(self, new_id: Callable[[], bytes]) -> Callable[[], bytes]:
        """`new_id` whose every id is logged, in the order drawn (a replay draws them back)."""

        def drawn() -> bytes:
            value = new_id()
            self._write({"id": value.hex()})
            return value

        return drawn

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                logger.error("event log %s: %r", self.path, exc)
            self._file = None
