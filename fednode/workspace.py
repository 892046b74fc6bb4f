"""What the nodes hosted by one process share: the device, one model to train in, and a lock.

Nodes of one process train one at a time (the lock), so one model instance is enough for all of
them: memory per hosted node is its data shard and its algorithm state, not a model copy. The
same holds for the spare models an algorithm needs (a teacher, a previous model): `scratch`.
With `group_wait_s` set (``hosting.vectorize``), `groups` trains the nodes that received the same
task together, as one vectorised computation (`fednode.groups`).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fedmq.fedcore.seeding import deterministic_kernels
from fedmq.fedcore.tensors import TensorSpec, schema_of
from fedmq.fednode.groups import GroupTrainer


@dataclass(eq=False)
class Workspace:
    model: nn.Module
    device: torch.device
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    group_wait_s: float | None = None
    """Train nodes of the same task together, waiting at most this long for their models; None: one by one."""

    def __post_init__(self) -> None:
        deterministic_kernels(self.device)  # the same seed, the same bits, on a GPU too
        self.model.to(self.device)
        self.schema: dict[str, TensorSpec] = schema_of(self.model.state_dict())
        self._scratch: dict[str, nn.Module] = {}
        self.groups = GroupTrainer(self.model, self.lock, self.group_wait_s) if self.group_wait_s is not None else None

    def scratch(self, key: str, build: Callable[[], nn.Module] | None = None) -> nn.Module:
        """A spare model kept under `key` for the nodes of this process: a copy of the training model's
        architecture, or what `build` makes; on the workspace's device. Use it only under `lock`."""
        module = self._scratch.get(key)
        if module is None:
            module = build() if build is not None else copy.deepcopy(self.model)
            module = self._scratch[key] = module.to(self.device)
        return module
