"""What the nodes hosted by one process share: the device, one model to train in, and a lock.

Nodes of one process train one at a time (the lock), so one model instance is enough for all of
them: memory per hosted node is its data shard and its algorithm state, not a model copy.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch
from torch import nn

from fedcore.tensors import TensorSpec, schema_of


@dataclass(eq=False)
class Workspace:
    model: nn.Module
    device: torch.device
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.model.to(self.device)
        self.schema: dict[str, TensorSpec] = schema_of(self.model.state_dict())
