"""The coordinator's evaluation: `fedcore.training.evaluate` and `Evaluator`, on scikit-learn's digits."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from fedmq.coordinator.observers.reporting import Evaluator
from fedmq.fedcore.algorithms import get_algorithm
from fedmq.fedcore.algorithms.base import CoordinatorHalf
from fedmq.fedcore.data import TensorDataset, load_dataset
from fedmq.fedcore.models import build_model
from fedmq.fedcore.training import evaluate


def digits_test() -> TensorDataset:
    return load_dataset("digits", seed=0).test


def coordinator(seed: int = 1) -> CoordinatorHalf:
    spec = get_algorithm("fedavg")
    model = build_model("mlp", digits_test().input_shape, 10, seed=seed)
    return spec.coordinator(spec.hyperparams(), model=model, device=torch.device("cpu"))


def test_evaluate_sums_on_the_device_as_a_read_per_batch_summed() -> None:
    """Accuracy and mean loss read once at the end equal, bit for bit, the per-batch reads summed in
    Python floats (what evaluate did before), over batches that do not divide the data."""
    data = digits_test()
    model = build_model("mlp", data.input_shape, 10, seed=3)
    correct, loss_sum = 0, 0.0
    with torch.no_grad():
        for start in range(0, len(data), 100):
            x, y = data.eval_batch(start, start + 100)
            logits = model(x)
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
    accuracy, loss = evaluate(model, data, batch_size=100)
    assert len(data) % 100 != 0
    assert accuracy == correct / len(data) and loss == loss_sum / len(data)
    assert 0 < accuracy < 1  # an untrained model: not every answer right, not every one wrong


def test_the_evaluator_uses_data_already_on_its_device_as_it_is() -> None:
    test = digits_test()
    evaluator = Evaluator(coordinator(), test, None, "cpu")
    first = evaluator()
    assert evaluator._there("test", test) is test and evaluator() == first
    assert set(first) == {"accuracy", "loss"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_evaluator_moves_its_splits_to_a_cuda_device_once_and_agrees_with_the_cpu() -> None:
    """On CUDA the test and validation splits go to the device at the first evaluation and stay there;
    the figures are the CPU's (accuracy exactly on these 450 images, the loss to float tolerance)."""
    split = load_dataset("digits", seed=0)
    half = coordinator()
    on_cpu = Evaluator(half, split.test, split.train, "cpu")()
    evaluator = Evaluator(half, split.test, split.train, "cuda")
    first = evaluator()
    moved = evaluator._there("test", split.test)
    assert moved.x.is_cuda and evaluator._there("test", split.test) is moved and split.test.x.device.type == "cpu"
    assert evaluator._there("val", split.train).x.is_cuda
    assert evaluator() == first
    assert first["accuracy"] == on_cpu["accuracy"] and first["val_accuracy"] == on_cpu["val_accuracy"]
    assert first["loss"] == pytest.approx(on_cpu["loss"], rel=1e-5)
