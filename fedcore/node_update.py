"""The update a node sends for a task, made from its training's result, and the random stream it trains
with: the one place each is made, for every node there is (the node daemon, a site aggregator, the
in-process driver and so replay and simulation alike).

Pure and synchronous; the transport wraps it (a frame on the bus, a message in process). The tensors
it returns are the compressed flat arrays the wire carries; without compression they may alias the
training's result (the workspace model), so a caller that trains the next node in the same workspace
copies them, or encodes them, first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fedmq.fedcore.algorithms.base import Payload
from fedmq.fedcore.compression import Compression, compress_update
from fedmq.fedcore.protocol import Update
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.tensors import flatten_groups


def node_generator(
    seed: int, node_id: str, round: int, attempt: int, device: torch.device | str = "cpu"
) -> torch.Generator:
    """The random stream a node trains a task with (batch order, augmentation, dropout): one per node,
    round and attempt of the run's seed, wherever the node runs, so that a daemon's training, the
    in-process driver's and replay's are the same."""
    return torch_generator(seed, "node-train", node_id, round, attempt, device=device)


def update_header(
    task_id: bytes,
    base_version: int | None,
    payload_meta: Mapping[str, Any],
    *,
    num_samples: int,
    train_seconds: float,
    site_nodes: int | None = None,
    compression: Compression | None = None,
) -> Update:
    """The update's header: the task it answers and its base version, what the node's data claims, and
    how its tensors are compressed (None: they are not, as a masked update's)."""
    return Update(
        task_id=task_id,
        num_samples=num_samples,
        train_seconds=train_seconds,
        payload=payload_meta,
        site_nodes=site_nodes,
        base_version=base_version,
        compression=compression.meta() if compression is not None else None,
    )


def node_update(
    task_id: bytes,
    base_version: int | None,
    result: Payload,
    *,
    num_samples: int,
    train_seconds: float,
    compression: Compression,
    received: Payload | None = None,
    site_nodes: int | None = None,
) -> tuple[Update, dict[str, np.ndarray]]:
    """The update for a task from the training's `result`: its header and its tensors, compressed as
    configured (`received`, the task's payload, is the base of a delta)."""
    header = update_header(
        task_id, base_version, result.meta, num_samples=num_samples, train_seconds=train_seconds,
        site_nodes=site_nodes, compression=compression,
    )  # fmt: skip
    tensors = compress_update(flatten_groups(result.tensors), compression, received.tensors if received else {})
    return header, tensors
