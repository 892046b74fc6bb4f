"""The messages of the fedmq protocol as typed values: one place that says what each kind's meta holds.

The bus (`fedmq.broker`) moves frames and knows nothing about learning; the daemons (`coordinator/`,
`fednode/`, `aggregator/`) used to build and read each kind's `meta` map by hand, in several places
each. Here every kind that carries learning is a frozen dataclass with one `to_meta()` (what goes on
the wire) and one `from_meta(meta)` (what comes off it, checked: `ProtocolError` with the reason the
receiver counts). The header (kind, round, sender, tensors) stays with the daemons, which hold the
topics and schemas that checks against it need.

The wire format is the one fedmq always spoke: keys, types, values and key order are those the
hand-written builders made (`tests/protocol/frames.json` holds frames recorded from them, and
`tests/protocol/test_wire_frames.py` parses and rebuilds them byte for byte). A field that is None
is left out of the meta, as the builders left it out, unless its doc says otherwise. The table in
`docs/protocol.md` is checked against these classes (`tests/protocol/test_protocol_doc.py`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, Literal, TypeGuard

from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.secagg import SecAggSettings
from fedmq.fedcore.training import TrainSettings

TASK_ID_BYTES = 16
FAILURE_CHARS = 500
"""A failure report's reason is cut to this many characters."""
MAX_SAMPLES = 10**12
"""An update claiming this many samples or more is malformed (the real bound is the node's limit)."""
MAX_HISTOGRAM = 100_000
MAX_DEVICE_CHARS = 64


class ProtocolError(ValueError):
    """A message broke the protocol (malformed meta, wrong round, not selected...). `reason` is the
    counter it is rejected under (`bus.rejected` in summary.json), `detail` says what was wrong."""

    def __init__(self, reason: str, detail: str, *, node_id: str | None = None, round: int | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.node_id = node_id
        self.round = round


class RunState(StrEnum):
    """A coordinator's run, as its status says it (and its engine and daemon hold it). Members are
    strings, so they compare equal to, and serialise as, the spellings the wire always carried."""

    STARTING = "starting"
    """The daemon is up; the engine has not started (never published)."""
    WAITING = "waiting"
    """Waiting for enough nodes to come online."""
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"
    """Stopped from outside (SIGTERM, cancellation) before the run's end."""
    OFFLINE = "offline"
    """The coordinator's last will: its connection died."""

    @property
    def final(self) -> bool:
        """The run is over: nothing more comes from it."""
        return self in FINAL_STATES

    @property
    def active(self) -> bool:
        """The coordinator is running a run whose tasks nodes take (waiting for nodes, or running)."""
        return self in (RunState.WAITING, RunState.RUNNING)


FINAL_STATES = frozenset({RunState.FINISHED, RunState.FAILED, RunState.STOPPED})

ReceiptStatus = Literal["received", "late", "stale", "rejected"]
RECEIPT_STATUSES: tuple[ReceiptStatus, ...] = ("received", "late", "stale", "rejected")


# -- checks shared by the parsers --------------------------------------------------------------------


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _optional_map(meta: Mapping[str, Any], key: str, reason: str) -> Mapping[str, Any] | None:
    value = meta.get(key)
    if value is not None and not isinstance(value, Mapping):
        raise ProtocolError(reason, f"{key} must be a map")
    return value


def _meta(meta: object, reason: str) -> Mapping[str, Any]:
    if not isinstance(meta, Mapping):
        raise ProtocolError(reason, "meta must be a map")
    return meta


def _put(meta: dict[str, Any], key: str, value: object) -> None:
    """Optional fields go on the wire only when they hold something."""
    if value is not None:
        meta[key] = value


# -- the kinds ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Announcement:
    """A node's retained status (`node-status`): online with what it holds, or offline (also its will)."""

    online: bool = field(metadata={"wire": "state"})
    """`state` on the wire: "online" or "offline"."""
    device: str | None = None
    num_samples: int | None = None
    """What the node holds: an update may claim no more (None: it announced no count)."""
    method: Mapping[str, Any] | None = None
    """The node's method fingerprint (`MethodFingerprint.to_meta`), checked by the coordinator."""
    connection: int | None = None
    """The node's connections so far: when it grows, the coordinator sends the task the node holds
    unanswered again (None from workers sharing a site's node id, and from older nodes). A value that
    is not a count is ignored, as it always was."""
    site_live: int | None = None
    """A site aggregator's live nodes (informative: read by watchers, not by the coordinator)."""
    label_histogram: tuple[int, ...] | None = None

    REASON = "bad-status"

    @property
    def state(self) -> Literal["online", "offline"]:
        return "online" if self.online else "offline"

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"state": self.state}
        _put(meta, "device", self.device)
        _put(meta, "num_samples", self.num_samples)
        _put(meta, "method", None if self.method is None else dict(self.method))
        _put(meta, "connection", self.connection)
        _put(meta, "site_live", self.site_live)
        _put(meta, "label_histogram", None if self.label_histogram is None else list(self.label_histogram))
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Announcement:
        meta = _meta(meta, cls.REASON)
        state = meta.get("state")
        if state not in ("online", "offline"):
            raise ProtocolError(cls.REASON, f"state {state!r} is not 'online' or 'offline'")
        n = meta.get("num_samples")
        if n is not None and (not _is_int(n) or n < 0):
            raise ProtocolError(cls.REASON, f"num_samples {n!r} is not a non-negative integer")
        device = meta.get("device")
        if device is not None and (not isinstance(device, str) or len(device) > MAX_DEVICE_CHARS):
            raise ProtocolError(cls.REASON, "device must be a short string")
        hist = meta.get("label_histogram")
        if hist is not None and (
            not isinstance(hist, list) or len(hist) > MAX_HISTOGRAM or not all(_is_int(c) and c >= 0 for c in hist)
        ):
            raise ProtocolError(cls.REASON, "label_histogram must be a list of non-negative integers")
        connection, site_live = meta.get("connection"), meta.get("site_live")
        return cls(
            online=state == "online",
            device=device,
            num_samples=n,
            method=_optional_map(meta, "method", cls.REASON),
            connection=connection if _is_int(connection) else None,
            site_live=site_live if _is_int(site_live) else None,
            label_histogram=None if hist is None else tuple(hist),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorStatus:
    """The coordinator's retained status (`coordinator-status`), on its status topic after every round
    and on its state topic when the state changes; with state offline, its will."""

    state: RunState
    run_id: str | None = None
    method: Mapping[str, Any] | None = None
    """The coordinator's method fingerprint (`MethodFingerprint.to_meta`)."""
    round: int | None = None
    """Sync: the round; async: the model version (the engine's `status_fields`)."""
    rounds: int | None = None
    """The run's rounds (sync) or aggregations (async); nil on the wire from a site's relay, which
    does not know them: sent whenever `round` is."""
    model_version: int | None = None
    engine: str | None = None
    """"async" from the asynchronous engine (none from the others)."""
    in_flight: int | None = None
    """Async: the tasks out."""
    live_nodes: int | None = None
    round_done: int | None = None
    """The round (version) this status reports the end of."""
    accuracy: float | None = None
    best_accuracy: float | None = None

    REASON = "bad-status"
    FIELDS = ("round", "rounds", "model_version", "engine", "in_flight", "live_nodes", "round_done",
              "accuracy", "best_accuracy")  # fmt: skip
    """What an engine's status says besides the state (`Engine.status`), in wire order."""

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"state": self.state.value}
        _put(meta, "run_id", self.run_id)
        _put(meta, "method", None if self.method is None else dict(self.method))
        for name in self.FIELDS:
            value = getattr(self, name)
            if value is not None or (name == "rounds" and self.round is not None):
                meta[name] = value
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> CoordinatorStatus:
        meta = _meta(meta, cls.REASON)
        state = meta.get("state")
        if state not in RunState.__members__.values():
            raise ProtocolError(cls.REASON, f"state {state!r} is not one of {', '.join(RunState)}")
        run_id = meta.get("run_id")
        if run_id is not None and not isinstance(run_id, str):
            raise ProtocolError(cls.REASON, f"run_id {run_id!r} is not a string")
        fields: dict[str, Any] = {}
        for name in cls.FIELDS:
            value = meta.get(name)
            ok = (
                value is None
                or (name == "engine" and isinstance(value, str))
                or (name in ("accuracy", "best_accuracy") and _is_number(value))
                or (name not in ("engine", "accuracy", "best_accuracy") and _is_int(value))
            )
            if not ok:
                raise ProtocolError(cls.REASON, f"{name} {value!r} is not a {_KIND_OF.get(name, 'integer')}")
            fields[name] = value
        method = _optional_map(meta, "method", cls.REASON)
        return cls(state=RunState(str(state)), run_id=run_id, method=method, **fields)


_KIND_OF = {"engine": "string", "accuracy": "number", "best_accuracy": "number"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    """One selected node's task (`task`). With `inline`, the frame also carries the model's tensors,
    and `payload` is the model's meta. The header's round, the model topic's agreement with it, and
    tensors without `inline` are the receiving node's checks."""

    task_id: bytes = field(metadata={"wire": "task"})
    """`task` on the wire: 16 bytes that the node's ack and update quote, the node's own (a
    synchronous round gives each node another, `engine.base.node_task_id`)."""
    attempt: int = 0
    version: int | None = None
    """The model version the task carries, echoed as the update's `base_version` (None from
    coordinators that send none)."""
    model_topic: str
    model_id: bytes | None = None
    """The id the model broadcast of the task's round attempt carries (16 bytes), by which the node
    matches the model to its task and nodes of one host train together. Not the task id: since
    issue 31 each node's `task` is its own, and the broadcast, which every node may read, reveals
    none. None from coordinators older than per-node ids (their broadcast quoted the shared `task`)."""
    deadline_s: float | None = None
    """How long the coordinator waits for the update; a node that receives the task later (by its
    `ts`, allowing for clock skew) does not act on it. None: never expires."""
    settings: TrainSettings
    method: str | None = None
    """The coordinator's method digest; a node whose own differs refuses the task."""
    secure_aggregation: SecAggSettings | None = None
    """With secure aggregation, its settings (`neighbours`, `threshold`, `clip` on the wire): the node
    masks its update and answers the `secagg-*` messages (docs/privacy.md)."""
    inline: bool = False
    payload: Mapping[str, Any] | None = None
    """With `inline`, the algorithm's scalars that go with the model."""

    REASON = "bad-task"

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"task": self.task_id, "attempt": self.attempt}
        _put(meta, "version", self.version)
        meta["model_topic"] = self.model_topic
        _put(meta, "model_id", self.model_id)
        _put(meta, "deadline_s", self.deadline_s)
        meta["settings"] = self.settings.to_meta()
        _put(meta, "method", self.method)
        secure = self.secure_aggregation
        if secure is not None:
            meta["secure_aggregation"] = {
                "neighbours": secure.neighbours, "threshold": secure.threshold, "clip": secure.clip
            }  # fmt: skip
            _put(meta["secure_aggregation"], "l2_clip", secure.l2_clip)
        if self.inline:
            meta |= {"inline": True, "payload": dict(self.payload or {})}
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Task:
        meta = _meta(meta, cls.REASON)
        task_id, topic = meta.get("task"), meta.get("model_topic")
        if not isinstance(task_id, bytes) or len(task_id) != TASK_ID_BYTES:
            raise ProtocolError(cls.REASON, "task id must be 16 bytes")
        if not isinstance(topic, str):
            raise ProtocolError(cls.REASON, f"model topic {topic!r} is not a topic")
        model_id = meta.get("model_id")
        if model_id is not None and (not isinstance(model_id, bytes) or len(model_id) != TASK_ID_BYTES):
            raise ProtocolError(cls.REASON, "model id must be 16 bytes")
        attempt = meta.get("attempt", 0)
        if not _is_int(attempt) or attempt < 0:
            raise ProtocolError(cls.REASON, f"attempt {attempt!r}")
        inline = meta.get("inline", False)
        if not isinstance(inline, bool):
            raise ProtocolError(cls.REASON, f"inline {inline!r} is not true or false")
        version = meta.get("version")
        if version is not None and (not _is_int(version) or version < 0):
            raise ProtocolError(cls.REASON, f"version {version!r} is not a non-negative integer")
        try:
            settings = TrainSettings.from_meta(meta.get("settings", {}))
        except ConfigError as exc:
            raise ProtocolError(cls.REASON, str(exc)) from exc
        deadline = meta.get("deadline_s")
        if deadline is not None and (not _is_number(deadline) or not deadline > 0):
            raise ProtocolError(cls.REASON, f"deadline_s {deadline!r} is not a positive number of seconds")
        payload = meta.get("payload", {}) if inline else None
        if inline and not isinstance(payload, dict):
            raise ProtocolError("bad-model", "payload meta must be a map")
        method = meta.get("method")
        return cls(
            task_id=task_id,
            attempt=attempt,
            version=version,
            model_topic=topic,
            model_id=model_id,
            deadline_s=deadline,
            settings=settings,
            # a digest that is not a string matches no node's: refused as method-mismatch, as always
            method=None if method is None else method if isinstance(method, str) else str(method),
            secure_aggregation=_secure_settings(_optional_map(meta, "secure_aggregation", cls.REASON)),
            inline=inline,
            payload=payload,
        )


def _secure_settings(meta: Mapping[str, Any] | None) -> SecAggSettings | None:
    """A task's `secure_aggregation` map as settings (ProtocolError bad-task: it is not one)."""
    if meta is None:
        return None
    neighbours, threshold, clip = meta.get("neighbours"), meta.get("threshold"), meta.get("clip")
    if not _is_int(neighbours) or not _is_number(threshold) or not _is_number(clip):
        raise ProtocolError("bad-task", "secure_aggregation needs neighbours (an integer), threshold and clip")
    l2_clip = meta.get("l2_clip")
    if l2_clip is not None and not _is_number(l2_clip):
        raise ProtocolError("bad-task", f"secure_aggregation's l2_clip {l2_clip!r} is not a number")
    try:  # a node needs the clip only: the fixed total reaches it as the directory's weight_total
        return SecAggSettings(
            neighbours=neighbours,
            threshold=float(threshold),
            clip=float(clip),
            l2_clip=None if l2_clip is None else float(l2_clip),
        )
    except ValueError as exc:
        raise ProtocolError("bad-task", f"secure_aggregation: {exc}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Update:
    """A node's update for a task (`update`); the tensors ride in the frame. The task it quotes, its
    base version against the task's, the tensors against the schema, the compression against the
    experiment's and the sample count against the node's announcement are the coordinator's checks."""

    task_id: bytes | None = field(metadata={"wire": "task"})
    """`task` on the wire: the task the update answers. The coordinator matches it to a task it sent
    before it reads the rest (`wrong-round` otherwise), so anything but bytes reads as None here."""
    num_samples: int
    train_seconds: float = 0.0
    payload: Mapping[str, Any]
    """The algorithm's scalars (e.g. `loss`)."""
    site_nodes: int | None = field(default=None, metadata={"wire": "site"})
    """`site: {nodes: N}` on the wire: a site aggregator's partial holds N of its nodes' updates."""
    base_version: int | None = None
    """The task's `version` (None from nodes older than versions)."""
    compression: Mapping[str, Any] | None = None
    """How the tensors are compressed (`Compression.meta`); None: they are not."""

    REASON = "bad-update"

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "task": self.task_id,
            "num_samples": self.num_samples,
            "train_seconds": self.train_seconds,
            "payload": dict(self.payload),
        }
        if self.site_nodes is not None:
            meta["site"] = {"nodes": self.site_nodes}
        _put(meta, "base_version", self.base_version)
        _put(meta, "compression", None if self.compression is None else dict(self.compression))
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Update:
        meta = _meta(meta, cls.REASON)
        task_id = meta.get("task")
        num_samples = meta.get("num_samples")
        if not _is_int(num_samples) or not 0 < num_samples < MAX_SAMPLES:
            raise ProtocolError(cls.REASON, f"num_samples {num_samples!r} is not a positive integer")
        train_seconds = meta.get("train_seconds", 0.0)
        if not isinstance(train_seconds, int | float) or not math.isfinite(train_seconds) or train_seconds < 0:
            raise ProtocolError(cls.REASON, f"train_seconds {train_seconds!r} is invalid")
        site = meta.get("site")
        site_nodes = site.get("nodes") if isinstance(site, dict) else None
        if site is not None and (not _is_int(site_nodes) or not 0 <= site_nodes <= num_samples):
            raise ProtocolError(cls.REASON, f"site {site!r} must say how many nodes' updates it holds")
        payload = meta.get("payload", {})
        if not isinstance(payload, dict):
            raise ProtocolError(cls.REASON, "payload meta must be a map")
        base = meta.get("base_version")
        if base is not None and not _is_int(base):
            raise ProtocolError("wrong-base-version", f"base_version {base!r} is not an integer")
        return cls(
            task_id=task_id if isinstance(task_id, bytes) else None,
            num_samples=num_samples,
            train_seconds=train_seconds,
            payload=payload,
            site_nodes=site_nodes,
            base_version=base,
            compression=meta.get("compression"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateFailed:
    """A node's report that it has no update for a task (`update` with `failed`, no tensors): its
    training failed, it refused the task, or it is stopping. The coordinator stops waiting for it."""

    task_id: bytes | None = field(metadata={"wire": "task"})
    """As an update's (`Update.task_id`)."""
    reason: str = field(metadata={"wire": "failed"})
    """`failed` on the wire, at most 500 characters."""

    REASON = "bad-update"

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", self.reason[:FAILURE_CHARS])

    def to_meta(self) -> dict[str, Any]:
        return {"task": self.task_id, "failed": self.reason}

    @staticmethod
    def is_failure(meta: Mapping[str, Any]) -> bool:
        """Whether an update's meta is a failure report (it says `failed`)."""
        return "failed" in meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> UpdateFailed:
        meta = _meta(meta, cls.REASON)
        if "failed" not in meta:
            raise ProtocolError(cls.REASON, "a failure report says why (failed)")
        task_id, failed = meta.get("task"), meta["failed"]
        return cls(
            task_id=task_id if isinstance(task_id, bytes) else None,
            reason=failed if isinstance(failed, str) else str(failed),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Receipt:
    """What became of an update (`receipt`), sent to its node at most once (advisory: the
    coordinator's metrics are the truth, so a node only logs it)."""

    status: ReceiptStatus
    reason: str = ""
    task_id: bytes | None = field(metadata={"wire": "task"})
    """The task the update quoted (nil on the wire when it quoted none)."""
    update_id: bytes
    """The update's message id."""

    REASON = "bad-receipt"

    def to_meta(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason, "task": self.task_id, "update_id": self.update_id}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Receipt:
        meta = _meta(meta, cls.REASON)
        status, reason = meta.get("status"), meta.get("reason", "")
        if status not in RECEIPT_STATUSES:
            raise ProtocolError(cls.REASON, f"status {status!r} is not one of {', '.join(RECEIPT_STATUSES)}")
        if not isinstance(reason, str):
            raise ProtocolError(cls.REASON, f"reason {reason!r} is not a string")
        task_id, update_id = meta.get("task"), meta.get("update_id")
        if not isinstance(task_id, bytes | None) or not isinstance(update_id, bytes):
            raise ProtocolError(cls.REASON, "task and update_id must be bytes")
        return cls(status=status, reason=reason, task_id=task_id, update_id=update_id)


# -- secure aggregation (fedcore/secagg.py; docs/privacy.md) ---------------------------------------

SECAGG_KEY_BYTES = 32
"""An X25519 public key, a self-mask commitment (sha256)."""
SECAGG_SHARE_BYTES = 34
"""A revealed Shamir share: its 2-byte index and the two 16-byte halves of a 32-byte secret."""
MAX_SECAGG_CIPHERTEXT = 256
"""An encrypted pair of shares is 12 + 68 + 16 = 96 bytes; anything much longer is not one."""
MAX_SECAGG_NODES = 100_000
"""The most nodes a secure-aggregation map may name (the experiment's nodes, at most)."""
_SECAGG_ID_CHARS = 64


def _node_bytes(meta: Mapping[str, Any], key: str, reason: str, *, size: int | None, limit: int) -> dict[str, bytes]:
    """`meta[key]`: a map from node ids to bytes of `size` (or at most `limit` bytes)."""
    value = meta.get(key)
    if not isinstance(value, Mapping) or len(value) > MAX_SECAGG_NODES:
        raise ProtocolError(reason, f"{key} must be a map from node ids to bytes")
    for node, data in value.items():
        if not isinstance(node, str) or not 0 < len(node) <= _SECAGG_ID_CHARS:
            raise ProtocolError(reason, f"{key} names {node!r}, which is not a node id")
        if not isinstance(data, bytes) or (len(data) != size if size is not None else not 0 < len(data) <= limit):
            raise ProtocolError(reason, f"{key}[{node}] must be {size or f'at most {limit}'} bytes")
    return dict(value)


def _node_list(meta: Mapping[str, Any], key: str, reason: str) -> tuple[str, ...]:
    value = meta.get(key)
    if not isinstance(value, list) or len(value) > MAX_SECAGG_NODES:
        raise ProtocolError(reason, f"{key} must be a list of node ids")
    if not all(isinstance(n, str) and 0 < len(n) <= _SECAGG_ID_CHARS for n in value) or len(set(value)) < len(value):
        raise ProtocolError(reason, f"{key} must hold distinct node ids")
    return tuple(value)


def _task_bytes(meta: Mapping[str, Any], reason: str) -> bytes:
    task = meta.get("task")
    if not isinstance(task, bytes) or len(task) != TASK_ID_BYTES:
        raise ProtocolError(reason, "task id must be 16 bytes")
    return task


def _key_bytes(value: object, what: str, reason: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != SECAGG_KEY_BYTES:
        raise ProtocolError(reason, f"{what} must be {SECAGG_KEY_BYTES} bytes")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class SecAggKeys:
    """Secure aggregation, step 1 (`secagg-keys`, node -> coordinator): the node's two ephemeral X25519
    public keys for this task, one to encrypt shares to it, one to agree pairwise masks with it."""

    task_id: bytes = field(metadata={"wire": "task"})
    encryption_key: bytes
    mask_key: bytes

    REASON = "bad-secagg"

    def to_meta(self) -> dict[str, Any]:
        return {"task": self.task_id, "encryption_key": self.encryption_key, "mask_key": self.mask_key}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> SecAggKeys:
        meta = _meta(meta, cls.REASON)
        return cls(
            task_id=_task_bytes(meta, cls.REASON),
            encryption_key=_key_bytes(meta.get("encryption_key"), "encryption_key", cls.REASON),
            mask_key=_key_bytes(meta.get("mask_key"), "mask_key", cls.REASON),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SecAggDirectory:
    """Step 2 (`secagg-directory`, coordinator -> node): the public keys of the node's neighbours in
    the round's masking graph, and the sample total its vector is weighted by (n / weight_total)."""

    task_id: bytes = field(metadata={"wire": "task"})
    neighbours: Mapping[str, tuple[bytes, bytes]]
    """Each neighbour's (encryption_key, mask_key); on the wire a map to two-element lists."""
    weight_total: int
    """The samples the participants announced, together: each node weights its update by its own
    count over this, so that the unmasked sum is the sample-weighted sum and stays within the clip."""

    REASON = "bad-secagg"

    def to_meta(self) -> dict[str, Any]:
        neighbours = {node: [c, s] for node, (c, s) in self.neighbours.items()}
        return {"task": self.task_id, "neighbours": neighbours, "weight_total": self.weight_total}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> SecAggDirectory:
        meta = _meta(meta, cls.REASON)
        value = meta.get("neighbours")
        if not isinstance(value, Mapping) or len(value) > MAX_SECAGG_NODES:
            raise ProtocolError(cls.REASON, "neighbours must be a map from node ids to their two keys")
        neighbours: dict[str, tuple[bytes, bytes]] = {}
        for node, keys in value.items():
            if not isinstance(node, str) or not 0 < len(node) <= _SECAGG_ID_CHARS:
                raise ProtocolError(cls.REASON, f"neighbours names {node!r}, which is not a node id")
            if not isinstance(keys, list) or len(keys) != 2:
                raise ProtocolError(cls.REASON, f"neighbours[{node}] must be its two keys")
            neighbours[node] = (
                _key_bytes(keys[0], "an encryption key", cls.REASON),
                _key_bytes(keys[1], "a mask key", cls.REASON),
            )
        total = meta.get("weight_total")
        if not _is_int(total) or not 0 < total < MAX_SAMPLES * MAX_SECAGG_NODES:
            raise ProtocolError(cls.REASON, f"weight_total {total!r} is not a positive integer")
        return cls(task_id=_task_bytes(meta, cls.REASON), neighbours=neighbours, weight_total=total)


@dataclass(frozen=True, slots=True, kw_only=True)
class SecAggShares:
    """Step 3 (`secagg-shares`, node -> coordinator): its self-mask seed and mask key, Shamir-shared
    among its neighbours, each neighbour's pair encrypted to it (the coordinator cannot read them), and
    the commitment (sha256) by which the coordinator checks the seed it later reconstructs."""

    task_id: bytes = field(metadata={"wire": "task"})
    commitment: bytes
    shares: Mapping[str, bytes]
    """Per neighbour, its encrypted pair of shares."""

    REASON = "bad-secagg"

    def to_meta(self) -> dict[str, Any]:
        return {"task": self.task_id, "commitment": self.commitment, "shares": dict(self.shares)}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> SecAggShares:
        meta = _meta(meta, cls.REASON)
        return cls(
            task_id=_task_bytes(meta, cls.REASON),
            commitment=_key_bytes(meta.get("commitment"), "commitment", cls.REASON),
            shares=_node_bytes(meta, "shares", cls.REASON, size=None, limit=MAX_SECAGG_CIPHERTEXT),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SecAggShared:
    """Step 4 (`secagg-shared`, coordinator -> node): the encrypted shares its neighbours addressed to
    it, from those whose shares reached the coordinator in time: the node masks its update against
    exactly these neighbours, and keeps the shares for the unmasking."""

    task_id: bytes = field(metadata={"wire": "task"})
    shares: Mapping[str, bytes]
    """Per neighbour, the pair of shares it encrypted to this node."""

    REASON = "bad-secagg"

    def to_meta(self) -> dict[str, Any]:
        return {"task": self.task_id, "shares": dict(self.shares)}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> SecAggShared:
        meta = _meta(meta, cls.REASON)
        shares = _node_bytes(meta, "shares", cls.REASON, size=None, limit=MAX_SECAGG_CIPHERTEXT)
        return cls(task_id=_task_bytes(meta, cls.REASON), shares=shares)


@dataclass(frozen=True, slots=True, kw_only=True)
class SecAggUnmask:
    """Step 6 (`secagg-unmask`, coordinator -> a node whose masked update was accepted): which of its
    neighbours' updates are in the sum (reveal their self-mask shares) and which dropped after sharing
    (reveal their mask-key shares). A node never reveals both for one neighbour."""

    task_id: bytes = field(metadata={"wire": "task"})
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]

    REASON = "bad-secagg"

    def to_meta(self) -> dict[str, Any]:
        return {"task": self.task_id, "survivors": list(self.survivors), "dropped": list(self.dropped)}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> SecAggUnmask:
        meta = _meta(meta, cls.REASON)
        return cls(
            task_id=_task_bytes(meta, cls.REASON),
            survivors=_node_list(meta, "survivors", cls.REASON),
            dropped=_node_list(meta, "dropped", cls.REASON),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SecAggReveal:
    """Step 7 (`secagg-reveal`, node -> coordinator): the shares `secagg-unmask` asked for, decrypted."""

    task_id: bytes = field(metadata={"wire": "task"})
    seed_shares: Mapping[str, bytes]
    """Per surviving neighbour, this node's share of its self-mask seed."""
    key_shares: Mapping[str, bytes]
    """Per dropped neighbour, this node's share of its mask key."""

    REASON = "bad-secagg"

    def to_meta(self) -> dict[str, Any]:
        return {"task": self.task_id, "seed_shares": dict(self.seed_shares), "key_shares": dict(self.key_shares)}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> SecAggReveal:
        meta = _meta(meta, cls.REASON)
        size = SECAGG_SHARE_BYTES
        return cls(
            task_id=_task_bytes(meta, cls.REASON),
            seed_shares=_node_bytes(meta, "seed_shares", cls.REASON, size=size, limit=size),
            key_shares=_node_bytes(meta, "key_shares", cls.REASON, size=size, limit=size),
        )


SecAggUp = SecAggKeys | SecAggShares | SecAggReveal
"""What a node sends the coordinator in secure aggregation (on `fedmq/{fed}/secagg/{node}`)."""
SecAggDown = SecAggDirectory | SecAggShared | SecAggUnmask
"""What the coordinator sends one node (on `fedmq/{fed}/nodes/{node}/secagg`)."""

ProtocolMessage = Announcement | CoordinatorStatus | Task | Update | UpdateFailed | Receipt | SecAggUp | SecAggDown


def wire_keys(cls: type[ProtocolMessage]) -> tuple[str, ...]:
    """The meta keys a message class writes, in order (a field's key is its name unless it says otherwise)."""
    return tuple(f.metadata.get("wire", f.name) for f in fields(cls))


MESSAGES: dict[str, type[ProtocolMessage]] = {
    "node-status": Announcement,
    "coordinator-status": CoordinatorStatus,
    "task": Task,
    "update": Update,
    "receipt": Receipt,
    "secagg-keys": SecAggKeys,
    "secagg-directory": SecAggDirectory,
    "secagg-shares": SecAggShares,
    "secagg-shared": SecAggShared,
    "secagg-unmask": SecAggUnmask,
    "secagg-reveal": SecAggReveal,
}
"""The class of each kind's meta (an `update` that says `failed` is an `UpdateFailed`)."""


def parse(kind: str, meta: Mapping[str, Any]) -> ProtocolMessage:
    """`meta` of a message of `kind` as its typed value (ProtocolError: it is malformed)."""
    if kind == "update" and UpdateFailed.is_failure(meta):
        return UpdateFailed.from_meta(meta)
    if kind not in MESSAGES:
        raise ProtocolError("unexpected-kind", f"{kind!r} carries no protocol message")
    return MESSAGES[kind].from_meta(meta)
