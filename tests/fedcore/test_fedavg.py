"""FedAvg's two halves in-process, with no bus: determinism, the weighted mean, bad hyperparameters."""

from __future__ import annotations

import pytest
import torch

from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm
from fedmq.fedcore.algorithms.base import NodeUpdate, Payload, RoundContext, TaskInput
from fedmq.fedcore.data import load_dataset
from fedmq.fedcore.errors import AlgorithmError, ConfigError
from fedmq.fedcore.models import build_model
from fedmq.fedcore.participation import ParticipationRecord
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.training import TrainSettings, evaluate

SPEC = get_algorithm("fedavg")
SETTINGS = TrainSettings(local_epochs=1, batch_size=16, lr=0.05)


def _train(node: str, global_state: dict[str, torch.Tensor], data, round: int = 0) -> Payload:  # type: ignore[no-untyped-def]
    half = SPEC.node(build_hyperparams(SPEC, {}), node_id=node)
    model = build_model("mlp", (1, 8, 8), 10, seed=99)  # a workspace with other weights: the task overwrites them
    task = TaskInput(node_id=node, round=round, payload=Payload(tensors={"model": global_state}), settings=SETTINGS)
    return half.train(task, model, data, torch_generator(0, "node-train", node, round))


def test_fedavg_node_training_is_deterministic_and_learns() -> None:
    split = load_dataset("synthetic", seed=0, features=64, train_size=400)
    data = type(split.train)(split.train.x.view(-1, 1, 8, 8), split.train.y, 10)
    start = build_model("mlp", (1, 8, 8), 10, seed=1).state_dict()
    a, b = _train("n1", start, data), _train("n1", start, data)
    assert all(torch.equal(a.tensors["model"][k], b.tensors["model"][k]) for k in start)
    other = _train("n2", start, data)
    assert not torch.equal(a.tensors["model"]["net.1.weight"], other.tensors["model"]["net.1.weight"])
    assert a.meta["loss"] < 2.3


def test_fedavg_aggregate_is_the_sample_weighted_mean() -> None:
    hp = build_hyperparams(SPEC, {})
    coordinator = SPEC.coordinator(hp, model=torch.nn.Linear(2, 1))
    states = [{"weight": torch.full((1, 2), v), "bias": torch.full((1,), v)} for v in (1.0, 4.0)]
    updates = [
        NodeUpdate(node_id=f"n{i}", round=0, num_samples=n, payload=Payload(tensors={"model": s}, meta={"loss": 1.0}))
        for i, (s, n) in enumerate(zip(states, (30, 10), strict=True))
    ]
    ctx = RoundContext(round=0, selected=("n0", "n1"), participation=ParticipationRecord(), settings=SETTINGS)
    metrics = coordinator.aggregate(ctx, updates, [])
    assert torch.allclose(coordinator.model.weight, torch.full((1, 2), 1.75)) and metrics["train_loss"] == 1.0
    plain = SPEC.coordinator(build_hyperparams(SPEC, {"weighted": False}), model=torch.nn.Linear(2, 1))
    plain.aggregate(ctx, updates, [])
    assert torch.allclose(plain.model.weight, torch.full((1, 2), 2.5))


def test_fedavg_one_node_one_round_equals_local_training() -> None:
    """With a single update the global model becomes exactly that update."""
    split = load_dataset("digits", seed=0)
    coordinator = SPEC.coordinator(build_hyperparams(SPEC, {}), model=build_model("mlp", (1, 8, 8), 10, seed=1))
    ctx = RoundContext(round=0, selected=("n0",), participation=ParticipationRecord(), settings=SETTINGS)
    payload = coordinator.configure_round(ctx)
    out = _train("n0", {k: v.clone() for k, v in payload.tensors["model"].items()}, split.train)
    coordinator.aggregate(ctx, [NodeUpdate(node_id="n0", round=0, num_samples=len(split.train), payload=out)], [])
    assert all(torch.equal(coordinator.model.state_dict()[k], v) for k, v in out.tensors["model"].items())
    assert evaluate(coordinator.model, split.test)[0] > 0.5


def test_fedavg_rejects_unknown_or_mistyped_hyperparameters() -> None:
    with pytest.raises(ConfigError, match="allowed: \\['weighted'\\]"):
        build_hyperparams(SPEC, {"mu": 0.1})
    with pytest.raises(ConfigError, match="not a bool"):
        build_hyperparams(SPEC, {"weighted": "yes"})
    with pytest.raises(ConfigError, match="unknown method 'fedsgd'"):
        get_algorithm("fedsgd")


def test_fedavg_node_without_model_in_task_raises_algorithm_error() -> None:
    split = load_dataset("digits", seed=0)
    with pytest.raises(AlgorithmError, match="no usable model"):
        _train("n0", {"bogus": torch.zeros(1)}, split.train)
