"""`fedmq.testing`: the contract checks fedmq's built-in methods, models and datasets pass, run on a
user's own ones (which pass) and on ones that break a promise (a ContractError naming it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fedmq.testing import ContractError, check_dataset, check_method, check_model
from tests.user_package import DATASET, METHOD, MODEL, user_folder, write_module, write_package


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Path]:
    with user_folder(write_package(tmp_path / "lab")) as folder:
        yield folder


def test_the_user_s_method_model_and_dataset_keep_the_contract(lab: Path) -> None:
    check_method(METHOD, {"power": 0.5}, bad=[({"power": -1.0}, "power must be")])
    check_model(MODEL, (1, 8, 8), 10, hidden=8)
    split = check_dataset(DATASET, test_every=5)
    assert split.train.num_classes == 10


@pytest.mark.parametrize("name", ["digits", "synthetic"])
def test_the_built_in_datasets_made_in_memory_keep_the_contract(name: str) -> None:
    check_dataset(name)


BREAKS = """\
\"\"\"Methods, models and datasets that break the contract, each in one way.\"\"\"

import numpy as np
import torch
from torch import nn

from fedmq.fedcore.algorithms import base, fedavg
from fedmq.fedcore.data import Split, TensorDataset


class Forgetful(fedavg.CoordinatorHalf):
    def state_dict(self):
        return {"step": torch.zeros(1)}

    def load_state_dict(self, state):
        pass


SPEC = base.AlgorithmSpec(
    name="forgetful", hyperparams=fedavg.Hyperparams, coordinator=Forgetful, node=fedavg.NodeHalf
)


class Unused(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.head = nn.Linear(64, num_classes)
        self.spare = nn.Linear(3, 3)

    def forward(self, x):
        return self.head(x.flatten(1))


def unseeded(*, seed):
    x = torch.tensor(np.random.default_rng().random((20, 4)), dtype=torch.float32)
    y = torch.arange(20) % 2
    return Split(TensorDataset(x[:15], y[:15], 2), TensorDataset(x[15:], y[15:], 2))
"""


@pytest.mark.parametrize(
    ("check", "match"),
    [
        (lambda: check_method("mylab.breaks"), "load_state_dict accepted a checkpoint with an unexpected entry"),
        (lambda: check_model("mylab.breaks:Unused", (1, 8, 8), 10), r"no gradient reaches \['spare.weight'"),
        (lambda: check_dataset("mylab.breaks:unseeded"), "two loads with one seed differ"),
    ],
    ids=["method", "model", "dataset"],
)
def test_a_broken_promise_is_a_contract_error_naming_it(lab: Path, check: object, match: str) -> None:
    write_module(lab, "breaks", BREAKS)
    assert callable(check)
    with pytest.raises(ContractError, match=match):
        check()
