"""Validating an update message against the task it answers and the schema the algorithm expects."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedmq.broker import Message
from fedmq.coordinator.compressed import decoded, payload_of
from fedmq.fedcore.algorithms.base import NodeUpdate
from fedmq.fedcore.compression import Compression
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.protocol import ProtocolError, Update
from fedmq.fedcore.tensors import StateDict, TensorSpec, arrays_sha256, non_finite, schema_mismatch, split_groups


def first_non_finite(arrays: Mapping[str, np.ndarray], groups: Mapping[str, StateDict]) -> str | None:
    """The name of the first floating tensor holding NaN or inf (it would poison the average), or
    None. numpy checks the received arrays directly (a few microseconds each, torch costs more per
    small tensor); bfloat16, which numpy lacks, is checked by torch."""
    for name, array in arrays.items():
        if array.dtype.kind == "f":
            if not np.isfinite(array).all():
                return name
        elif array.dtype.metadata and array.dtype.metadata.get("fedmq_dtype") == "bfloat16":
            group, _, key = name.partition("/")
            if non_finite({key: groups[group][key]}) is not None:
                return name
    return None


def check_base_version(message: Message, version: int, *, required: bool = False) -> None:
    """The update's `base_version` must be the version of the task it answers: a node that says
    otherwise is confused or forging (ProtocolError "wrong-base-version"). Older nodes send none."""
    base = message.meta.get("base_version")
    if base is None and not required:
        return
    if not isinstance(base, int) or isinstance(base, bool):
        raise ProtocolError("wrong-base-version", f"base_version {base!r} is not an integer", node_id=message.sender)
    if base != version:
        raise ProtocolError(
            "wrong-base-version", f"base_version {base} but the task carried version {version}", node_id=message.sender
        )


@dataclass(frozen=True, slots=True)
class Read:
    """An update's content as the schema expects it: its header, its tensor groups (decompressed) and
    the compression it came in."""

    meta: Update
    groups: dict[str, StateDict]
    used: Compression


@dataclass(frozen=True, slots=True)
class Ingested:
    """An update read before the engine sees it (`ingest`): what it holds, or the refusal the engine
    gives when it reaches the update (so the engine's order of checks, and its reasons, stay its own),
    and the digest the event log records."""

    read: Read | ProtocolError
    sha256: str
    nbytes: int


def read_update(
    message: Message, schema: Mapping[str, Mapping[str, TensorSpec]], compression: Compression | None = None
) -> Read:
    """The update's header and tensors, checked against the schema with no engine state: decompressed
    (only `compression`, default none, is accepted), the groups and shapes the algorithm expects, every
    value finite. ProtocolError says why not."""
    node = message.sender
    try:
        meta = Update.from_meta(message.meta)
    except ProtocolError as exc:
        raise ProtocolError(exc.reason, exc.detail, node_id=node) from None
    arrays, used = decoded(message, schema, compression or Compression())
    try:
        groups = split_groups(arrays)
    except AlgorithmError as exc:
        raise ProtocolError("bad-update", str(exc), node_id=node) from exc
    if groups.keys() != schema.keys():
        raise ProtocolError("wrong-shape", f"tensor groups {sorted(groups)} != expected {sorted(schema)}", node_id=node)
    for group, expected in schema.items():
        mismatch = schema_mismatch(groups[group], expected)
        if mismatch is not None:
            raise ProtocolError(mismatch[0], f"{group}: {mismatch[1]}", node_id=node)
    bad = first_non_finite(arrays, groups)
    if bad is not None:
        raise ProtocolError("non-finite", f"{bad} holds NaN or inf", node_id=node)
    return Read(meta, groups, used)


def ingest(
    message: Message, schema: Mapping[str, Mapping[str, TensorSpec]], compression: Compression | None = None
) -> Ingested:
    """The ingest step a daemon runs before its engine (off the event loop for a large update): the
    decoding, decompression and checks of `read_update`, and the event log's digest, all of which cost
    in proportion to the model. A node's report of a failed training holds nothing to read."""
    try:
        read: Read | ProtocolError = read_update(message, schema, compression)
    except ProtocolError as exc:
        read = exc
    nbytes = int(sum(np.asarray(a).nbytes for a in message.tensors.values()))
    return Ingested(read, arrays_sha256(message.tensors), nbytes)


def parse_update(
    message: Message,
    schema: Mapping[str, Mapping[str, TensorSpec]],
    *,
    version: int,
    sent_at: float,
    received_at: float,
    compression: Compression | None = None,
    ingested: Ingested | None = None,
) -> NodeUpdate:
    """A NodeUpdate trained from model `version`, or ProtocolError with the reason to count; read now,
    or before the engine (`ingested`)."""
    read = ingested.read if ingested is not None else read_update(message, schema, compression)
    if isinstance(read, ProtocolError):
        raise ProtocolError(read.reason, read.detail, node_id=read.node_id, round=read.round)
    return NodeUpdate(
        node_id=message.sender,
        round=message.round,
        num_samples=read.meta.num_samples,
        payload=payload_of(read.groups, read.meta.payload, read.used),
        train_seconds=float(read.meta.train_seconds),
        rtt_seconds=max(received_at - sent_at, 0.0),
        base_version=version,
        site_nodes=read.meta.site_nodes or 0,  # a site aggregator's partial says how many nodes it holds
    )


def check_samples(node: str, claimed: int, announced: int | None, *, limit: int | None, required: bool) -> None:
    """An update's sample count weights it in the average, so one message claiming 10^11 samples
    would replace the global model: the count must be believable, or ProtocolError says why not.

    - above `limit` (the node's shard size or the coordinator's max_node_samples): "samples-over-limit";
    - more than the node announced in its status: "samples-mismatch". A node trains on the data it
      holds (fedmq's nodes claim exactly what they announced); it may train on part of it, never
      on more;
    - the node announced no count: "samples-unannounced" when `required`, since nothing backs the
      claim; otherwise only the limit bounds it.
    """
    if limit is not None and claimed > limit:
        raise ProtocolError(
            "samples-over-limit", f"num_samples {claimed} is above the node's limit of {limit}", node_id=node
        )
    if announced is None:
        if required:
            raise ProtocolError(
                "samples-unannounced", f"{node} announced no sample count to check {claimed} against", node_id=node
            )
        return
    if claimed > announced:
        raise ProtocolError("samples-mismatch", f"num_samples {claimed} but {node} announced {announced}", node_id=node)
