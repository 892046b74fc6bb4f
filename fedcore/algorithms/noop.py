"""No training at all: each node returns the model it received, and the server averages them (FedAvg's).

Not a learning method: it measures what the framework itself costs per round (``fedmq bench
rounds``: task, acknowledgement, broadcast, update, receipt, aggregation, checkpoint) and checks a
deployment's plumbing end to end without spending any compute on training. The global model never
changes, so accuracy stays where the initialisation puts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fedmq.fedcore.algorithms import base, fedavg, shared
from fedmq.fedcore.data import TensorDataset


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    weighted: bool = True
    """Weight the (identical) returned models by sample counts, as FedAvg does, so that the server's
    work per round is FedAvg's exactly."""


class NodeHalf(base.NodeHalf[Hyperparams]):
    def train(
        self, task: base.TaskInput, model: nn.Module, data: TensorDataset, generator: torch.Generator
    ) -> base.Payload:
        shared.load_group(task, "model", model, node_id=self.node_id)  # checks the model as FedAvg would
        return base.Payload(tensors={"model": model.state_dict()}, meta={"loss": 0.0, "steps": 0})

    def train_group(self, members: Sequence[base.GroupMember], model: nn.Module) -> list[base.Payload]:
        """Every member returns the broadcast model: one copy (not aliasing the workspace) for the group."""
        first = base.same_task(members)
        shared.load_group(first.task, "model", model, node_id=first.half.node_id)
        state = {name: t.detach().clone() for name, t in model.state_dict().items()}
        return [base.Payload(tensors={"model": state}, meta={"loss": 0.0, "steps": 0}) for _ in members]


SPEC = base.AlgorithmSpec(name="noop", hyperparams=Hyperparams, coordinator=fedavg.CoordinatorHalf, node=NodeHalf)
