"""FedRS's two halves in-process: the restriction scales (hard and proportional) and the restricted
cross-entropy by hand, the restriction of the missing classes' classifier rows, FedAvg at alpha = 1,
determinism, what the update carries; hyperparameters and checkpoints: test_contract.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedmq.fedcore.algorithms import build_hyperparams, fedrs
from fedmq.fedcore.algorithms.base import Payload, TaskInput
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.training import TrainSettings
from tests.algorithms import common
from tests.algorithms.common import Federation, same_state, shards, tiny_model

SPEC = fedrs.SPEC


@pytest.mark.parametrize(
    ("scaling", "expected"),
    [("hard", [1.0, 0.7, 1.0]), ("proportional", [1.0, 0.7, 0.7 + 0.3 * 0.4])],
)
def test_restriction_scales_match_hand_values(scaling: str, expected: list[float]) -> None:
    """Counts (5, 0, 2), alpha 0.7: hard (1, 0.7, 1); FedRS's code alpha + (1 - alpha) n_c / max n = (1, 0.7, 0.82)."""
    scales = fedrs.restriction_scales(torch.tensor([5.0, 0.0, 2.0]), 0.7, scaling)
    assert scales.tolist() == pytest.approx(expected)


def test_restriction_scales_with_unknown_scaling_raise_value_error() -> None:
    with pytest.raises(ValueError, match="scaling"):
        fedrs.restriction_scales(torch.ones(3), 0.5, "soft")


def test_restricted_cross_entropy_matches_hand_value() -> None:
    """Logits (2, 2, 1) on label 0, scales (1, 0.5, 1): -log(e^2 / (e^2 + e^1 + e^1))."""
    loss = fedrs.restricted_cross_entropy(
        torch.tensor([[2.0, 2.0, 1.0]]), torch.tensor([0]), torch.tensor([1.0, 0.5, 1.0])
    )
    assert float(loss) == pytest.approx(-math.log(math.exp(2) / (math.exp(2) + 2 * math.exp(1))), rel=1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        fedrs.restricted_cross_entropy(torch.zeros(1, 3), torch.tensor([0]), torch.ones(2))


def test_restriction_scales_the_missing_class_row_gradient_by_alpha() -> None:
    """With a bias-free linear head, d loss / d w_c for a missing class is alpha times d/d(alpha w_c^T h):
    alpha = 0 freezes the row; alpha = 0.5 gives a gradient of that row, present rows keep theirs."""
    g = torch.Generator().manual_seed(0)
    h, y = torch.randn(5, 4, generator=g), torch.tensor([0, 2, 0, 2, 2])
    counts = torch.tensor([2.0, 0.0, 3.0])

    def grad(alpha: float) -> torch.Tensor:
        head = nn.Linear(4, 3, bias=False)
        with torch.no_grad():
            head.weight.copy_(torch.randn(3, 4, generator=torch.Generator().manual_seed(1)))
        fedrs.restricted_cross_entropy(head(h), y, fedrs.restriction_scales(counts, alpha, "hard")).backward()
        return head.weight.grad

    frozen, restricted = grad(0.0), grad(0.5)
    assert torch.equal(frozen[1], torch.zeros(4))
    assert (frozen[[0, 2]] != 0).all()
    assert (restricted[1] != 0).any()


def test_fedrs_neutral_setting_equals_fedavg_exactly() -> None:
    """alpha = 1 gives FedAvg's global model bit for bit; the default alpha does not."""
    fedavg = Federation("fedavg").run(2)
    assert same_state(fedavg, Federation(SPEC, {"alpha": 1.0}).run(2))
    assert not same_state(fedavg, Federation(SPEC).run(2))


def test_fedrs_node_training_follows_the_restricted_gradient() -> None:
    """One full-batch SGD step on shard 0 (only class 0) equals a manual step on CE(alpha_c f(x), y)."""
    data = shards()[0]
    settings = TrainSettings(local_epochs=1, batch_size=len(data), lr=0.1)
    start = tiny_model(1).state_dict()
    half = SPEC.node(build_hyperparams(SPEC, {"alpha": 0.3}), node_id="n0")
    task = TaskInput(node_id="n0", round=0, payload=Payload(tensors={"model": start}), settings=settings)
    out = half.train(task, tiny_model(99), data, torch_generator(0, "t"))
    manual = tiny_model(1)
    nn.functional.cross_entropy(manual(data.x) * torch.tensor([1.0, 0.3, 0.3]), data.y).backward()
    with torch.no_grad():
        for p in manual.parameters():
            p -= 0.1 * p.grad
    for name, p in manual.state_dict().items():
        assert torch.allclose(out.tensors["model"][name], p, atol=1e-6), name


@pytest.mark.parametrize("scaling", ["hard", "proportional"])
def test_fedrs_training_is_deterministic_and_sends_only_the_model(scaling: str) -> None:
    """Same seed, same model; another seed differs; the update holds the model, loss and steps only."""
    a = common.assert_deterministic(SPEC, {"scaling": scaling})
    out = a.train("node-001", Payload(tensors={"model": tiny_model().state_dict()}))
    assert set(out.payload.tensors) == {"model"} and set(out.payload.meta) == {"loss", "steps"}
    assert math.isfinite(out.payload.meta["loss"])
