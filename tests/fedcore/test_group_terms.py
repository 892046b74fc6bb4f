"""The loss-term methods trained as one group (`LossTermNode.train_group` on their `group_term`) give
each node what its own `train` gives it: in float64, where rounding cannot hide another objective,
every weight within 1e-10, and the term visibly changes the result (so a group that ignored it fails)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm
from fedmq.fedcore.algorithms.base import GroupMember, Payload, TaskInput
from fedmq.fedcore.data import TensorDataset, load_dataset
from fedmq.fedcore.models import build_model
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.training import TrainSettings

SETTINGS = TrainSettings(local_epochs=2, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-3)
SIZES = (30, 17, 1, 45)
"""Unequal shards: a trailing batch of one (17), a single sample, and one longer than the rest."""
EXACT = 1e-10

CASES: dict[str, dict[str, Any]] = {
    "fedprox": {"mu": 0.5},
    "fedlc": {"tau": 1.0},
    "fedrs": {"alpha": 0.5},
    "fedntd": {"beta": 1.0, "temperature": 2.0},
    "fedgkd": {"gamma": 0.5},
    "kdia": {"lambda_kd": 0.5, "lambda_gen": 0.5, "kd_direction": "reverse", "noise_dim": 8},
    "moon": {"mu": 1.0, "temperature": 0.5, "previous_models": 2},
}
NEUTRAL: dict[str, dict[str, Any]] = {
    "fedprox": {"mu": 0.0},
    "fedlc": {"tau": 0.0},
    "fedrs": {"alpha": 1.0},
    "fedntd": {"beta": 0.0},
    "fedgkd": {"gamma": 0.0},
    "kdia": {"lambda_kd": 0.0, "lambda_gen": 0.0},
    "moon": {"mu": 0.0},
}


@pytest.fixture(scope="module")
def digits() -> TensorDataset:
    data = load_dataset("digits", seed=0, augment={"crop": 8, "padding": 1, "flip": True}).train
    return dataclasses.replace(data, x=data.x.double())


def shards(data: TensorDataset) -> list[TensorDataset]:
    gen = torch.Generator().manual_seed(3)
    # skewed labels, so that label-dependent terms (FedLC, FedRS) differ per node
    order = torch.argsort(data.y.double() + torch.rand(len(data), generator=gen, dtype=torch.float64) * 4)
    out, start = [], 0
    for n in SIZES:
        out.append(data.subset(order[start : start + n].numpy()))
        start += n * 7
    return out


def members(method: str, hp: Mapping[str, Any], datasets: Sequence[TensorDataset]) -> list[GroupMember]:
    spec = get_algorithm(method)
    params = build_hyperparams(spec, dict(hp))
    model = build_model("cnn", datasets[0].input_shape, 10, seed=5).double()
    tensors = {"model": model.state_dict()}
    meta: dict[str, Any] = {}
    if method in ("fedgkd", "kdia"):  # a teacher other than the model, as the buffer's mean would be
        tensors["teacher"] = build_model("cnn", datasets[0].input_shape, 10, seed=9).double().state_dict()
        meta["distill"] = True
    if method == "kdia":  # and a trained generator's weights, with running statistics of its own
        from fedmq.fedcore.algorithms.kdia.generator import build_generator

        generator = build_generator(params.noise_dim, model).double()
        with torch.no_grad():
            for name, t in generator.named_buffers():
                if name.endswith("running_mean"):
                    t.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
        tensors["generator"] = generator.state_dict()
        meta["generate"] = True
    scratch: dict[str, torch.nn.Module] = {}

    def spare(key: str, build: Any = None) -> torch.nn.Module:
        if key not in scratch:
            module = build() if build is not None else build_model("cnn", datasets[0].input_shape, 10, seed=0)
            scratch[key] = module.double()
        return scratch[key]

    group = [
        GroupMember(
            half=spec.node(params, node_id=f"node-{i}"),
            task=TaskInput(
                node_id=f"node-{i}",
                round=1,
                payload=Payload(tensors=tensors, meta=meta),
                settings=SETTINGS,
                scratch=spare,
            ),
            data=data,
            generator=torch_generator(4, "node-train", f"node-{i}", 1),
        )
        for i, data in enumerate(datasets)
    ]
    if method == "moon":  # node i has min(i, 2) previous models of its own: none, one, a full FIFO
        for i, member in enumerate(group):
            member.half.previous = [  # type: ignore[attr-defined]
                build_model("cnn", datasets[0].input_shape, 10, seed=20 + 2 * i + j).double().state_dict()
                for j in range(min(i, 2))
            ]
    return group


def difference(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("method", sorted(CASES))
def test_group_term_trains_each_node_as_its_own_objective(digits: TensorDataset, method: str) -> None:
    datasets = shards(digits)
    group = members(method, CASES[method], datasets)
    workspace = build_model("cnn", digits.input_shape, 10, seed=6).double()
    assert group[0].half.group_refusal(workspace) is None
    grouped = group[0].half.train_group(group, workspace)
    plain = members("fedavg", {}, datasets)
    fedavg = plain[0].half.train_group(plain, copy.deepcopy(workspace))
    moved = []
    for member, payload, baseline in zip(members(method, CASES[method], datasets), grouped, fedavg, strict=True):
        alone = member.half.train(member.task, copy.deepcopy(workspace), member.data, member.generator)
        assert payload.meta["steps"] == alone.meta["steps"] and set(payload.meta) == set(alone.meta)
        for term in ("kd_loss", "gen_loss"):
            if term in alone.meta:
                assert payload.meta[term] == pytest.approx(alone.meta[term], rel=1e-9)
        assert payload.meta["loss"] == pytest.approx(alone.meta["loss"], rel=1e-9)
        assert difference(payload.tensors["model"], alone.tensors["model"]) < EXACT
        moved.append(difference(payload.tensors["model"], baseline.tensors["model"]))
    assert max(moved) > 1e-4, "the term changed nothing"


@pytest.mark.parametrize("method", sorted(CASES))
def test_group_term_at_the_neutral_setting_is_fedavg(digits: TensorDataset, method: str) -> None:
    datasets = shards(digits)
    group = members(method, NEUTRAL[method], datasets)
    workspace = build_model("cnn", digits.input_shape, 10, seed=6).double()
    plain = members("fedavg", {}, datasets)
    for got, want in zip(
        group[0].half.train_group(group, copy.deepcopy(workspace)),
        plain[0].half.train_group(plain, copy.deepcopy(workspace)),
        strict=True,
    ):
        assert difference(got.tensors["model"], want.tensors["model"]) == 0.0


def test_moon_group_keeps_each_members_trained_model_and_reads_its_own_previous_ones(digits: TensorDataset) -> None:
    """Each member's half keeps its own trained model as `train` keeps it (FIFO of previous_models), and
    the negatives are each member's own previous models: swapping two members' histories changes the
    result (so a group that read one member's history for all would fail the agreement above)."""
    datasets = shards(digits)
    workspace = build_model("cnn", digits.input_shape, 10, seed=6).double()
    group = members("moon", CASES["moon"], datasets)
    grouped = group[0].half.train_group(group, copy.deepcopy(workspace))
    for i, (member, payload) in enumerate(zip(group, grouped, strict=True)):
        previous = member.half.previous  # type: ignore[attr-defined]
        assert len(previous) == min(i + 1, 2)
        assert difference(previous[-1], payload.tensors["model"]) == 0.0
        assert previous[-1]["classifier.3.bias"].data_ptr() != payload.tensors["model"]["classifier.3.bias"].data_ptr()
    swapped = members("moon", CASES["moon"], datasets)
    history = [m.half.previous for m in swapped]  # type: ignore[attr-defined]
    swapped[2].half.previous, swapped[3].half.previous = history[3], history[2]  # type: ignore[attr-defined]
    other = swapped[0].half.train_group(swapped, copy.deepcopy(workspace))
    assert difference(other[2].tensors["model"], grouped[2].tensors["model"]) > 1e-6
