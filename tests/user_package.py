"""A user's own folder, as the plug-in tests write it: a package `mylab` outside fedmq with a method
(a FedAvg variant), a model class and a dataset loader, and an experiment file that names them.

`forget_user_modules` undoes what importing them did to this process (the module cache and the
plug-in caches: `fedcore.plugins.forget`), so that each test sees its own folder's version of `mylab`."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fedmq.fedcore import plugins

PACKAGE = "mylab"
METHOD = "mylab.sqrtavg"
MODEL = "mylab.nets:TinyNet"
DATASET = "mylab.data:load"

SQRTAVG = '''\
"""SqrtAvg: FedAvg weighting each update by a power of its sample count (a user's method)."""

from collections.abc import Sequence
from dataclasses import dataclass

from fedmq.fedcore.algorithms import base, fedavg


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    power: float = 0.5
    """The exponent of a node's sample count in its weight: 1 is FedAvg, 0 the plain mean."""

    def __post_init__(self) -> None:
        base.require_non_negative(self, "power")


class CoordinatorHalf(fedavg.CoordinatorHalf):
    hp: Hyperparams

    def weights(self, updates: Sequence[base.NodeUpdate]) -> list[float]:
        return [float(u.num_samples) ** self.hp.power for u in updates]


class NodeHalf(fedavg.NodeHalf):
    hp: Hyperparams


SPEC = base.AlgorithmSpec(name="sqrtavg", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
'''

NETS = '''\
"""A user's model: any nn.Module taking (input_shape, num_classes, **options)."""

import math

from torch import nn


class TinyNet(nn.Module):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU())
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.head(self.body(x))
'''

DATA = '''\
"""A user's dataset: scikit-learn's digits (8 x 8 images, 10 classes), as float features in [0, 1]."""

import torch
from sklearn.datasets import load_digits

from fedmq.fedcore.data import Split, TensorDataset


def load(*, seed: int, test_every: int = 4) -> Split:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y, dtype=torch.int64)
    test = torch.arange(len(y)) % test_every == 0
    return Split(train=TensorDataset(x[~test], y[~test], 10), test=TensorDataset(x[test], y[test], 10))
'''

EXPERIMENT = """\
name: mylab
seed: 0
nodes: 4
policy:
  fraction: 1.0
  deadline_s: 30
rounds: {rounds}
data:
  dataset: {dataset}
partition:
  kind: iid
model:
  name: {model}
  options: {options}
method:
  name: {method}
  hyperparams: {{power: 0.5}}
train:
  local_epochs: 1
  batch_size: 32
  lr: 0.1
"""


def write_package(folder: Path, *, method_note: str = "") -> Path:
    """`folder`/mylab with the method, model and dataset modules; `method_note` changes the method's
    source (another version of it). Returns `folder`."""
    package = folder / PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text('"""A user\'s lab package."""\n')
    (package / "sqrtavg.py").write_text(SQRTAVG + (f"# {method_note}\n" if method_note else ""))
    (package / "nets.py").write_text(NETS)
    (package / "data.py").write_text(DATA)
    return folder


def write_experiment(
    folder: Path,
    *,
    rounds: int = 2,
    method: str = METHOD,
    model: str = MODEL,
    dataset: str = DATASET,
    model_options: str = "{hidden: 16}",
) -> Path:
    """`folder`/experiment.yaml: 4 nodes, iid, `rounds` rounds of `method` on `model` and `dataset`."""
    path = folder / "experiment.yaml"
    text = EXPERIMENT.format(rounds=rounds, method=method, model=model, dataset=dataset, options=model_options)
    path.write_text(text)
    return path


def write_module(folder: Path, name: str, source: str) -> None:
    """One more module of `mylab` (a broken plug-in, for instance)."""
    (folder / PACKAGE / f"{name}.py").write_text(textwrap.dedent(source))


def forget_user_modules() -> None:
    """Drop `mylab` from the module cache and every user method this process loaded."""
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]
    plugins.forget()


@contextmanager
def user_folder(folder: Path) -> Iterator[Path]:
    """`folder` importable (first on sys.path), and `mylab` forgotten before and after."""
    forget_user_modules()
    sys.path.insert(0, str(folder))
    try:
        yield folder
    finally:
        sys.path.remove(str(folder))
        forget_user_modules()
