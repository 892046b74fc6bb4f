"""Compressed updates at the coordinator (`fedcore.compression`, docs/compression.md).

An update is decompressed before its schema is checked (`decoded`), so that the engines see the
dtypes and shapes the algorithm expects; a malformed one is refused as ``bad-compression`` like any
other bad update. A delta-compressed update's ``model`` group is still a difference from its task's
model when it is accepted (`DeltaPayload`); `restore` adds that model back, from the versions the
coordinator kept (`coordinator.storage.versions`), right before the half aggregates it.

The coordinator accepts the experiment's compression only: both ends are configured from one file,
so an update compressed otherwise comes from a misconfigured (or forged) node, and says so in its
refusal; and only a configured delta compression makes the coordinator keep the models it needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from fedmq.broker import Message
from fedmq.coordinator.errors import ProtocolError
from fedmq.fedcore.algorithms.base import NodeUpdate, Payload
from fedmq.fedcore.compression import DELTA_GROUP, SCALES, Compression, CompressionError, add_base, decompress
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.tensors import StateDict, TensorSpec


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DeltaPayload(Payload):
    """An accepted update's payload whose ``model`` group holds the differences from the model of
    its base version that `compression` sent; `restore` turns it into the model itself."""

    compression: Compression


def decoded(
    message: Message, schema: Mapping[str, Mapping[str, TensorSpec]], configured: Compression
) -> tuple[dict[str, np.ndarray], Compression]:
    """The update's tensors as the schema expects them, and the compression it came in; a
    ProtocolError ``bad-compression`` for another compression than `configured` or a malformed one."""
    node = message.sender
    if not configured.enabled and "compression" not in message.meta and SCALES not in message.tensors:
        return dict(message.tensors), configured  # the common case, on every update: no schema walk
    try:
        used = Compression.from_meta(message.meta.get("compression"))
        if used.meta() != configured.meta():
            raise CompressionError(f"the update is {used.describe()}; this federation's are {configured.describe()}")
        flat = {f"{group}/{name}": spec for group, specs in schema.items() for name, spec in specs.items()}
        return decompress(message.tensors, used, flat), used
    except CompressionError as exc:
        raise ProtocolError(exc.reason, str(exc), node_id=node) from None


def payload_of(tensors: Mapping[str, StateDict], meta: Mapping[str, object], used: Compression) -> Payload:
    """The accepted update's payload: a `DeltaPayload` while its model is still a difference."""
    if used.enabled and used.delta and DELTA_GROUP in tensors:
        return DeltaPayload(tensors=tensors, meta=meta, compression=used)
    return Payload(tensors=tensors, meta=meta)


def restore(updates: Sequence[NodeUpdate], model_of: Callable[[int], StateDict]) -> list[NodeUpdate]:
    """The updates with every delta turned back into a model: its base version's model (`model_of`) added."""
    out = []
    for update in updates:
        payload = update.payload
        if isinstance(payload, DeltaPayload):
            tensors = dict(payload.tensors)
            base = model_of(update.base_version)
            tensors[DELTA_GROUP] = add_base(tensors[DELTA_GROUP], base, payload.compression)
            update = dataclasses.replace(update, payload=Payload(tensors=tensors, meta=payload.meta))
        out.append(update)
    return out


def check_one_model(payloads: Mapping[str, Payload]) -> None:
    """Delta compression keeps one model per version: per-node tasks must all carry the same one."""
    models = [p.tensors.get(DELTA_GROUP) for p in payloads.values()]
    first = models[0] if models else None
    for model in models[1:]:
        if (
            model is None
            or first is None
            or model.keys() != first.keys()
            or not all(torch.equal(model[k], first[k]) for k in first)
        ):
            raise AlgorithmError(
                "this method sends each node its own model, which delta compression cannot read back:"
                " set compression.delta false"
            )
