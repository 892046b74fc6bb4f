"""The node host's shared workspace: one training model and spare models per process."""

from __future__ import annotations

import torch
from torch import nn

from fedmq.fedcore.models import build_model
from fedmq.fednode.workspace import Workspace


def test_workspace_scratch_is_one_module_per_key_of_the_models_architecture() -> None:
    """scratch(key) copies the training model's architecture once per key; scratch(key, build) uses build."""
    ws = Workspace(build_model("mlp", (4,), 3, seed=0), torch.device("cpu"))
    teacher = ws.scratch("teacher")
    assert teacher is ws.scratch("teacher") and teacher is not ws.model
    assert [p.shape for p in teacher.parameters()] == [p.shape for p in ws.model.parameters()]
    built = ws.scratch("generator", lambda: nn.Linear(2, 5))
    assert isinstance(built, nn.Linear) and ws.scratch("generator") is built
    with torch.no_grad():
        next(teacher.parameters()).add_(1.0)
    assert not torch.equal(next(teacher.parameters()), next(ws.model.parameters()))
