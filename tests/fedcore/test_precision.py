"""`train.precision: bf16`: each step's forward pass under bfloat16 autocast, one by one and vectorised.

bfloat16 keeps 8 bits of mantissa, so its rounding, not the computation, sets how far two runs that
sum in different orders drift apart: on digits (3 nodes of 60, 2 epochs) vectorised and one-by-one
bf16 training differ by up to 6e-3 on a weight, about what bf16 and float32 differ by, where float32's
two paths agree to 3e-8. The tests therefore check that bf16 is applied on both paths (each differs from
its float32 run far beyond float32 rounding), stays near float32, and is deterministic; what it costs
in accuracy is measured in docs/simulation.md.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from fedmq.experiments.config import load_config
from fedmq.fedcore.data import TensorDataset, load_dataset
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.models import build_model
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.training import TrainSettings, local_sgd
from fedmq.fedcore.vectorized import train_vectorized

FLOAT32 = TrainSettings(local_epochs=2, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-3)
BF16 = dataclasses.replace(FLOAT32, precision="bf16")


@pytest.fixture(scope="module")
def parts() -> list[TensorDataset]:
    data = load_dataset("digits", seed=0, augment={"crop": 8, "padding": 1, "flip": True}).train
    return [data.subset(torch.arange(i * 60, (i + 1) * 60).numpy()) for i in range(3)]


def generators() -> list[torch.Generator]:
    return [torch_generator(3, "node-train", f"node-{i}", 0) for i in range(3)]


def one_by_one(
    model: torch.nn.Module, parts: list[TensorDataset], settings: TrainSettings
) -> list[dict[str, torch.Tensor]]:
    out = []
    for data, gen in zip(parts, generators(), strict=True):
        trained = copy.deepcopy(model)
        local_sgd(trained, data, settings, gen)
        out.append(trained.state_dict())
    return out


def vectorised(
    model: torch.nn.Module, parts: list[TensorDataset], settings: TrainSettings
) -> list[dict[str, torch.Tensor]]:
    return [state for state, _ in train_vectorized(model, parts, settings, generators())]


def distance(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> float:
    return max(float((x[k] - y[k]).abs().max()) for x, y in zip(a, b, strict=True) for k in x)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_bf16_is_applied_one_by_one_and_vectorised_and_stays_near_float32(
    parts: list[TensorDataset], name: str
) -> None:
    model = build_model(name, parts[0].input_shape, 10, seed=0)
    alone32, together32 = one_by_one(model, parts, FLOAT32), vectorised(model, parts, FLOAT32)
    alone16, together16 = one_by_one(model, parts, BF16), vectorised(model, parts, BF16)
    assert distance(alone32, together32) < 1e-5  # float32's two paths: rounding
    assert distance(alone16, alone32) > 1e-4 and distance(together16, together32) > 1e-4  # bf16 took effect
    assert distance(alone16, alone32) < 0.05 and distance(together16, alone16) < 0.05  # and is bf16 rounding
    assert all(t.dtype == torch.float32 for state in together16 for t in state.values())  # weights stay float32
    assert distance(one_by_one(model, parts, BF16), alone16) == 0.0  # deterministic
    assert distance(vectorised(model, parts, BF16), together16) == 0.0


def test_precision_travels_only_when_bf16_and_is_validated() -> None:
    assert "precision" not in FLOAT32.to_meta()  # float32 tasks are byte for byte what they were
    assert BF16.to_meta()["precision"] == "bf16"
    assert TrainSettings.from_meta(BF16.to_meta()) == BF16
    with pytest.raises(ConfigError, match="must be one of 'float32', 'bf16'"):
        TrainSettings.from_meta({**FLOAT32.to_meta(), "precision": "fp16"})
    with pytest.raises(ConfigError, match="DP-SGD"):
        TrainSettings(precision="bf16", max_grad_norm=1.0, dp_noise_multiplier=1.0)


def test_an_experiment_file_asks_for_bf16_in_its_train_section() -> None:
    quickstart = Path(__file__).resolve().parents[2] / "experiments" / "quickstart.yaml"
    assert load_config(quickstart, ["train.precision=bf16"]).train.precision == "bf16"
    assert load_config(quickstart).train.precision == "float32"
    with pytest.raises(ConfigError, match="precision"):
        load_config(quickstart, ["train.precision=half"])
