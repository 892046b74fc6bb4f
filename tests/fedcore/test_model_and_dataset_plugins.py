"""A user's own model (`model.name: module:Class`) and dataset (`data.dataset: module:function`), from
their own folder or a `fedmq.models` / `fedmq.datasets` entry point, and each broken one a
ConfigError naming the option and what to write."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from fedmq.fedcore.data import dataset_schema, load_dataset
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.models import build_model, model_options
from tests.user_package import DATASET, MODEL, user_folder, write_module, write_package


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Path]:
    with user_folder(write_package(tmp_path / "lab")) as folder:
        yield folder


def test_a_model_class_from_the_user_s_folder_is_built_with_its_options_and_seed(lab: Path) -> None:
    assert model_options(MODEL) == {"hidden": 16}
    a = build_model(MODEL, (1, 8, 8), 10, seed=3, hidden=8)
    b = build_model(MODEL, (1, 8, 8), 10, seed=3, hidden=8)
    assert isinstance(a, nn.Module) and a(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    with pytest.raises(ConfigError, match=r"model 'mylab.nets:TinyNet' has no option 'depth'; allowed: hidden"):
        build_model(MODEL, (1, 8, 8), 10, seed=0, depth=2)


def test_a_user_dataset_loads_with_its_options_and_gives_its_schema(lab: Path) -> None:
    split = load_dataset(DATASET, seed=0, test_every=3)
    assert split.train.input_shape == (1, 8, 8) and len(split.test) == 599
    schema = dataset_schema(DATASET)
    assert (schema.input_shape, schema.num_classes, schema.pixels) == ((1, 8, 8), 10, False)


def test_entry_points_name_a_model_and_a_dataset(lab: Path) -> None:
    info = lab / "mylab-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mylab\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[fedmq.models]\ntiny = mylab.nets:TinyNet\n\n[fedmq.datasets]\nlab-digits = mylab.data:load\n"
    )
    assert build_model("tiny", (1, 8, 8), 10, seed=0)(torch.zeros(1, 1, 8, 8)).shape == (1, 10)
    assert load_dataset("lab-digits", seed=0).train.num_classes == 10


BROKEN_MODELS = {
    "mylab.nets": "unknown model 'mylab.nets'.*'mylab.nets' names no model in a module \\(module:NAME\\)",
    "mylab.nets:Missing": "nets.py defines no 'Missing'",
    "mylab.notnet:NotNet": "model 'mylab.notnet:NotNet' gave a NotNet, not a torch.nn.Module",
    "mylab.notnet:VALUE": "is a int, not an nn.Module class",
    "mylab.notnet:Raises": "model 'mylab.notnet:Raises' raised RuntimeError: no weights here",
    "nolab.nets:Net": "unknown model 'nolab.nets:Net'; available: .*no module 'nolab' is on the path",
}
NOT_NET = """\
VALUE = 3
class NotNet:
    def __init__(self, input_shape, num_classes):
        pass
def Raises(input_shape, num_classes):
    raise RuntimeError("no weights here")
"""


@pytest.mark.parametrize("name", sorted(BROKEN_MODELS))
def test_a_broken_model_is_a_config_error_saying_what_to_fix(lab: Path, name: str) -> None:
    write_module(lab, "notnet", NOT_NET)
    with pytest.raises(ConfigError, match=BROKEN_MODELS[name]) as caught:
        build_model(name, (1, 8, 8), 10, seed=0)
    assert caught.value.field == "model.name"


BAD_DATA = """\
import torch
from fedmq.fedcore.data import Split, TensorDataset

def _part(n, shape=(4,), dtype=torch.float32, labels=None, classes=3):
    y = labels if labels is not None else torch.arange(n) % classes
    return TensorDataset(torch.zeros(n, *shape, dtype=dtype), y, classes)

def pair(*, seed):
    return _part(8), _part(4)

def labels(*, seed):
    return Split(_part(8), _part(4, labels=torch.tensor([0, 1, 2, 3])))

def shapes(*, seed):
    return Split(_part(8), _part(4, shape=(5,)))

def doubles(*, seed):
    return Split(_part(8, dtype=torch.float64), _part(4, dtype=torch.float64))

def flat_images(*, seed):
    return Split(_part(8, shape=(64,), dtype=torch.uint8), _part(4, shape=(64,), dtype=torch.uint8))

def no_seed():
    return Split(_part(8), _part(4))

def raises(*, seed):
    raise OSError("lab share not mounted")
"""
BROKEN_DATASETS = {
    "pair": "returned a tuple, not a Split; return fedmq.fedcore.data.Split",
    "labels": "returned test labels 0..3 outside 0..2",
    "shapes": r"returned train inputs \(4,\) torch.float32 but test inputs \(5,\)",
    "doubles": "returned train inputs of dtype torch.float64",
    "flat_images": r"returned train inputs of dtype torch.uint8 and shape \(8, 64\)",
    "no_seed": "the loader must take a keyword argument seed",
    "raises": "the loader raised OSError: lab share not mounted",
}


@pytest.mark.parametrize("function", sorted(BROKEN_DATASETS))
def test_a_broken_dataset_is_a_config_error_saying_what_to_fix(lab: Path, function: str) -> None:
    write_module(lab, "baddata", BAD_DATA)
    with pytest.raises(ConfigError, match=BROKEN_DATASETS[function]) as caught:
        load_dataset(f"mylab.baddata:{function}", seed=0)
    assert caught.value.field == "data.dataset"
