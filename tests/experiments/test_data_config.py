"""The `data:` section: augmentation and normalisation choices, the data root and cache folder it resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fedmq.experiments.build import cache_dir, data_root, load_split
from fedmq.experiments.config import AugmentConfig, NormalizeConfig, parse_config
from fedmq.fedcore.errors import ConfigError, DataError
from fedmq.fedcore.transforms import Compose, Normalize, RandomCrop, RandomRotation, ToFloat


def config(**data: object) -> object:
    return parse_config({"name": "t", "nodes": 2, "rounds": 1, "data": data})


def test_data_config_accepts_paper_style_augment_and_normalize() -> None:
    """A KDIA-style CIFAR-100 augmentation and explicit constants parse into their models."""
    cfg = config(
        dataset="cifar100",
        augment={"crop": 32, "padding": 4, "padding_mode": "reflect", "flip": True, "rotation_deg": 15},
        normalize={"mean": [0.5071, 0.4865, 0.4409], "std": [0.2673, 0.2564, 0.2762]},
    )
    assert cfg.data.augment == AugmentConfig(crop=32, padding=4, padding_mode="reflect", flip=True, rotation_deg=15)  # type: ignore[attr-defined]
    assert isinstance(cfg.data.normalize, NormalizeConfig)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"augment": {"zoom": 2}}, "data.augment: zoom: unknown field (allowed fields: crop, padding"),
        ({"augment": "sometimes"}, "data.augment: expected default, none or a mapping with crop"),
        ({"augment": {"padding_mode": "wrap"}}, "data.augment: padding_mode: Input should be 'zero', 'reflect'"),
        ({"normalize": "unit"}, "data.normalize: expected dataset, half, imagenet, none or a mapping with mean, std"),
        ({"normalize": {"mean": [0.5], "std": [0.0]}}, "one mean and one positive std per channel"),
        ({"cache_dirr": "/tmp"}, "data.cache_dirr: unknown field; allowed here: augment, cache, cache_dir"),
    ],
)
def test_data_config_bad_choice_gives_one_readable_error(data: dict[str, object], message: str) -> None:
    """Each mistake is one line naming the field and what is allowed."""
    with pytest.raises(ConfigError) as info:
        config(**data)
    assert message in str(info.value)
    assert str(info.value).count("\n") == 1


def test_data_root_and_cache_dir_resolve_config_then_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """data.root wins over FEDMQ_DATA_ROOT; cache_dir over FEDMQ_CACHE_DIR over ~/.cache/fedmq; cache: false is none."""
    monkeypatch.setenv("FEDMQ_DATA_ROOT", str(tmp_path / "env-data"))
    monkeypatch.setenv("FEDMQ_CACHE_DIR", str(tmp_path / "env-cache"))
    assert data_root(config()) == tmp_path / "env-data"  # type: ignore[arg-type]
    assert data_root(config(root=str(tmp_path / "cfg"))) == tmp_path / "cfg"  # type: ignore[arg-type]
    assert cache_dir(config()) == tmp_path / "env-cache"  # type: ignore[arg-type]
    assert cache_dir(config(cache_dir=str(tmp_path / "c"))) == tmp_path / "c"  # type: ignore[arg-type]
    assert cache_dir(config(cache=False)) is None  # type: ignore[arg-type]
    monkeypatch.delenv("FEDMQ_DATA_ROOT")
    monkeypatch.delenv("FEDMQ_CACHE_DIR")
    assert data_root(config()) is None  # type: ignore[arg-type]
    assert cache_dir(config()) == Path("~/.cache/fedmq").expanduser()  # type: ignore[arg-type]


def test_load_split_missing_dataset_names_files_and_env_var(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An image dataset under an empty root is a DataError that says what to put where and what to set."""
    monkeypatch.delenv("FEDMQ_DATA_ROOT", raising=False)
    with pytest.raises(DataError, match=r"no data root is set(.|\n)*FEDMQ_DATA_ROOT"):
        load_split(config(dataset="mnist", cache=False))  # type: ignore[arg-type]
    with pytest.raises(DataError, match=re.escape(f"{tmp_path}/mnist/MNIST/raw")):
        load_split(config(dataset="mnist", root=str(tmp_path), cache=False))  # type: ignore[arg-type]


def test_load_split_passes_augment_and_normalize_to_the_transforms(data_root: Path, tmp_path: Path) -> None:
    """The config's augmentation and normalisation end up in the training and evaluation transforms."""
    cfg = config(
        dataset="mnist",
        root=str(data_root),
        cache_dir=str(tmp_path),
        augment={"crop": 28, "padding": 2, "rotation_deg": 10},
        normalize="half",
    )
    split = load_split(cfg)  # type: ignore[arg-type]
    train = split.train.train_transform
    assert isinstance(train, Compose)
    # the crop selects uint8 pixels, then they become floats for the rotation and the normalisation
    assert [type(s) for s in train.steps] == [RandomCrop, ToFloat, RandomRotation, Normalize]
    assert train.steps[-1] == Normalize((0.5,), (0.5,))
    x, _ = split.test.eval_batch(0, 4)
    assert torch.allclose(x, split.test.x[:4].float() / 127.5 - 1)


def test_load_split_loader_options_cannot_shadow_data_fields() -> None:
    """data.options may not smuggle in root, seed or the other fields of data."""
    with pytest.raises(ConfigError, match="are fields of data"):
        load_split(config(options={"root": "/x"}))  # type: ignore[arg-type]
