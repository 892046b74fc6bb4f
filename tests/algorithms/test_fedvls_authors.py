"""fedmq's FedVLS objective pinned against the authors' code on a fixed batch (issue 19).

`authors_loss` below is written out from ``system/flcore/clients/clientvls.py`` of
github.com/krumpguo/FedVLS at commit 7d8163f4410ecef565a1d4e27703cd4bcab403d5, independently of
`fedcore.algorithms.fedvls` (no function of it is called):

- ``PriorCELoss`` (lines 105-108): CrossEntropyLoss(output + log(prior + 1e-9), y);
- ``new_LADEloss`` (lines 96-103): with pred_spread = (output - log(prior + 1e-9) + log(1/K + 1e-9)).T
  times the mask (y != c), loss = -sum_c(-(logsumexp_b pred_spread[c] - log N) * prior[c]), times 0.005;
- ``VLSloss`` (lines 110-115): KLDivLoss(batchmean)(log_softmax(output[:, O]), softmax(teacher[:, O]))
  with O = where(prior == 0), the softmaxes taken with ``dim=None`` (on a 2-D tensor torch picks dim 1);
- ``train`` (lines 41, 74-83): loss = PriorCE + LADE + lamda * VLS, SGD with momentum 0.9 and weight
  decay 0 (line 23 overrides args.weight_decay), the teacher a copy of the received global model
  (``set_parameters``, lines 91-94), run on each batch and detached.

The objective fedmq builds (`fedvls.NodeHalf.objective`, with the node's prior and vacant set
and the teacher loaded from the task) is captured by replacing `local_sgd` for one call, then
evaluated on a student whose weights differ from the teacher's (at the start of local training they
coincide and L_dis and its gradient are 0): loss and every parameter's gradient equal the authors'
within 1e-6. A second test trains for real (8 steps of SGD with momentum) and compares the weights
with the authors' loop run on the same batches.

One difference that this test leaves out on purpose: the authors count the prior by iterating their
node loader once (lines 45-58), which is built with ``shuffle=True, drop_last=True``
(``system/data/generate_mnist.py`` line 127), so up to 63 random samples of a node are missing from
their counts; fedmq counts the whole shard (fedvls.md A3). Both sides here get the whole shard's counts.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from fedmq.fedcore.algorithms import build_hyperparams, fedvls, shared
from fedmq.fedcore.algorithms.base import Payload, TaskInput
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.training import TrainSettings, TrainStats
from tests.algorithms.common import Scratch

CLASSES = 7
FEATURES = 6
COUNTS = (9, 6, 4, 1, 0, 0, 0)
"""The node's label counts: three common classes, one rare class (one sample), three vacant ones."""
TOL = 1e-6


def _shard(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.cat([torch.full((n,), c, dtype=torch.long) for c, n in enumerate(COUNTS)])
    y = y[torch.randperm(len(y), generator=g)]
    x = torch.randn(len(y), FEATURES, generator=g) + y[:, None].float() * 0.3
    return TensorDataset(x, y, CLASSES)


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, CLASSES))


def authors_loss(
    output: torch.Tensor, teach_output: torch.Tensor, y: torch.Tensor, num_per_class: torch.Tensor, lamda: float
) -> torch.Tensor:
    """clientVLS's per-batch loss, transcribed (see the module docstring for the lines)."""
    num_classes = output.shape[1]
    prior = num_per_class / num_per_class.sum()
    no_exist_label = torch.where(prior == 0)[0]
    # new_LADEloss
    cls_weight = num_per_class.float() / torch.sum(num_per_class.float())
    balanced_prior = torch.tensor(1.0 / num_classes).float()
    pred_spread = (output - torch.log(prior + 1e-9) + torch.log(balanced_prior + 1e-9)).T * (
        y != torch.arange(0, num_classes).view(-1, 1).type_as(y)
    )  # C x N
    n = pred_spread.size(-1)
    second_term = torch.logsumexp(pred_spread, -1) - np.log(n)
    lade_loss = -torch.sum((-second_term) * cls_weight) * 0.005
    # PriorCELoss
    prior_ce_loss = nn.CrossEntropyLoss()(output + torch.log(prior + 1e-9), y)
    # VLSloss: softmax over dim=None, which torch resolves to dim 1 for a 2-D input
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Implicit dimension choice for log_softmax has been deprecated"
        log_soft = torch.nn.functional.log_softmax(output[:, no_exist_label], dim=None, _stacklevel=3)
        teacher_soft = torch.nn.functional.softmax(teach_output[:, no_exist_label], dim=None, _stacklevel=3)
    vls_loss = nn.KLDivLoss(reduction="batchmean")(log_soft, teacher_soft)
    return prior_ce_loss + lade_loss + vls_loss * lamda


def _captured_objective(
    monkeypatch: pytest.MonkeyPatch, global_model: nn.Module, data: TensorDataset, hyperparams: dict[str, Any]
) -> Any:
    """fedmq's FedVLS objective for `data`, as `NodeHalf.train` hands it to `local_sgd`."""
    captured: dict[str, Any] = {}

    def fake_local_sgd(model: nn.Module, data: TensorDataset, settings: TrainSettings, generator: Any, **kw: Any):
        captured.update(kw)
        return TrainStats(loss=0.0, steps=0, samples_seen=0)

    monkeypatch.setattr(shared, "local_sgd", fake_local_sgd)  # the training of FedAvg plus a loss term
    half = fedvls.SPEC.node(build_hyperparams(fedvls.SPEC, hyperparams), node_id="node-000")
    workspace = _mlp(99)
    task = TaskInput(
        node_id="node-000",
        round=0,
        payload=Payload(tensors={"model": copy.deepcopy(global_model.state_dict())}),
        settings=TrainSettings(),
        scratch=Scratch(workspace),
    )
    half.train(task, workspace, data, torch_generator(0, "test"))
    return captured["loss_fn"]


def test_softmax_with_dim_none_is_over_classes_on_a_batch() -> None:
    """The authors' ``dim=None`` on an (N, |O|) tensor is the softmax over the classes (dim 1)."""
    t = torch.randn(5, 3, generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(torch.nn.functional.log_softmax(t, dim=None, _stacklevel=3), t.log_softmax(1))


@pytest.mark.parametrize("lam", [0.1, 1.0])
@pytest.mark.parametrize("batch", ["whole shard", "rare class absent", "one sample"])
def test_fedvls_objective_equals_the_authors_loss_and_gradients(
    monkeypatch: pytest.MonkeyPatch, lam: float, batch: str
) -> None:
    data = _shard()
    if batch == "whole shard":
        idx = torch.arange(len(data))
    elif batch == "rare class absent":
        idx = torch.nonzero(data.y != 3).flatten()[:12]
    else:
        idx = torch.nonzero(data.y == 0).flatten()[:1]
    x, y = data.x[idx], data.y[idx]
    global_model = _mlp(0)
    objective = _captured_objective(monkeypatch, global_model, data, {"lam": lam})

    student = _mlp(1)  # weights unlike the teacher's, so that L_dis and its gradient are not zero
    ours = objective(student, x, y)
    our_grads = torch.autograd.grad(ours, list(student.parameters()))

    reference = copy.deepcopy(student)
    teacher = copy.deepcopy(global_model)
    theirs = authors_loss(reference(x), teacher(x).detach(), y, torch.tensor(COUNTS).float(), lam)
    their_grads = torch.autograd.grad(theirs, list(reference.parameters()))

    ours, theirs = float(ours.detach()), float(theirs.detach())
    assert abs(ours - theirs) < TOL, (ours, theirs)
    for mine, other in zip(our_grads, their_grads, strict=True):
        assert torch.allclose(mine, other, atol=TOL, rtol=0), float((mine - other).abs().max())
    # every term is there: the distillation term moves the loss, and the suppression term too
    without_kd = authors_loss(reference(x), reference(x).detach(), y, torch.tensor(COUNTS).float(), lam)
    assert abs(theirs - float(without_kd.detach())) > 1e-3


def test_fedvls_local_training_equals_the_authors_loop() -> None:
    """Two epochs of batch 5 (8 steps), SGD lr 0.05 momentum 0.9 no weight decay, as clientVLS.train:
    fedmq's node (the real local_sgd) and the authors' loop on the same batches end at the same weights."""
    data = _shard()
    global_model = _mlp(0)
    settings = TrainSettings(local_epochs=2, batch_size=5, lr=0.05, momentum=0.9, weight_decay=0.0)
    generator = torch_generator(0, "node-train", "node-000", 0, 0)
    replay = torch.Generator().set_state(generator.get_state())

    half = fedvls.SPEC.node(build_hyperparams(fedvls.SPEC, {"lam": 0.1}), node_id="node-000")
    workspace = _mlp(99)
    task = TaskInput(
        node_id="node-000",
        round=0,
        payload=Payload(tensors={"model": copy.deepcopy(global_model.state_dict())}),
        settings=settings,
        scratch=Scratch(workspace),
    )
    out = half.train(task, workspace, data, generator)
    assert out.meta["steps"] == 8

    model = copy.deepcopy(global_model)
    teacher = copy.deepcopy(global_model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.0)
    counts = torch.tensor(COUNTS).float()
    for _ in range(settings.local_epochs):
        order = torch.randperm(len(data), generator=replay)
        for start in range(0, len(data), settings.batch_size):
            idx = order[start : start + settings.batch_size]
            x, y = data.x[idx], data.y[idx]
            optimizer.zero_grad()
            loss = authors_loss(model(x), teacher(x).detach(), y, counts, 0.1)
            loss.backward()
            optimizer.step()
    for name, theirs in model.state_dict().items():
        ours = out.tensors["model"][name]
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (name, float((ours - theirs).abs().max()))
