"""A node's own data (`fedmq node --data`): the .npz and folder forms, checked against the dataset's
schema, with the dataset's own transforms, and every malformed input refused with a DataError that
names the file and says what to fix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedmq.fedcore.data import DATASETS, dataset_schema, load_dataset, load_local
from fedmq.fedcore.datasets.local import Schema
from fedmq.fedcore.errors import ConfigError, DataError


def _images(n: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, *shape), dtype=np.uint8)


def _save(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


def test_dataset_schema_is_known_for_every_dataset_without_loading_it() -> None:
    """Every registered dataset says its schema; loader options that change it are followed."""
    assert {name: dataset_schema(name).input_shape for name in DATASETS} == {
        "digits": (1, 8, 8), "synthetic": (32,), "mnist": (1, 28, 28), "fashion-mnist": (1, 28, 28),
        "cifar10": (3, 32, 32), "cifar100": (3, 32, 32), "cinic10": (3, 32, 32), "tiny-imagenet": (3, 64, 64),
    }  # fmt: skip
    assert dataset_schema("cifar100", labels="coarse") == Schema((3, 32, 32), 20, pixels=True)
    assert dataset_schema("synthetic", features=5, num_classes=3) == Schema((5,), 3, pixels=False)


@pytest.mark.parametrize(("name", "options"), [("digits", {}), ("synthetic", {"features": 6, "num_classes": 4})])
def test_dataset_schema_equals_what_the_loader_makes(name: str, options: dict[str, object]) -> None:
    """The schema matches the loaded dataset (the ones made in memory; files: see the next test)."""
    train = load_dataset(name, seed=0, **options).train  # type: ignore[arg-type]
    schema = dataset_schema(name, **options)
    assert (train.input_shape, train.num_classes, train.x.dtype == torch.uint8) == (
        schema.input_shape, schema.num_classes, schema.pixels,
    )  # fmt: skip


def test_dataset_schema_equals_mnists_loaded_shape(data_root: Path) -> None:
    train = load_dataset("mnist", seed=0, root=data_root).train
    assert (train.input_shape, train.num_classes, train.x.dtype) == ((1, 28, 28), 10, torch.uint8)
    assert dataset_schema("mnist") == Schema(train.input_shape, train.num_classes, pixels=True)


def test_dataset_schema_refuses_unknown_datasets_and_options() -> None:
    with pytest.raises(ConfigError, match="unknown dataset"):
        dataset_schema("imagenet")
    with pytest.raises(ConfigError, match="allowed: labels"):
        dataset_schema("cifar100", labelz="fine")
    with pytest.raises(ConfigError, match="fine or coarse"):
        dataset_schema("cifar100", labels="medium")


def test_npz_of_cifar_images_gets_the_datasets_transforms(tmp_path: Path) -> None:
    """uint8 N x C x H x W as the loader keeps them; eval batches are normalised with CIFAR-10's
    constants and training batches augmented (crop with padding, flip), as `load_dataset` does."""
    x, y = _images(6, (3, 32, 32)), np.array([0, 1, 2, 9, 9, 3])
    data = load_local(_save(tmp_path / "node.npz", x=x, y=y), "cifar10")
    assert data.x.dtype == torch.uint8 and torch.equal(data.x, torch.from_numpy(x)) and data.y.tolist() == y.tolist()
    assert data.num_classes == 10 and data.label_histogram()[9] == 2
    batch, labels = data.eval_batch(0, 6)
    mean = torch.tensor(DATASETS["cifar10"].mean).view(1, 3, 1, 1)
    std = torch.tensor(DATASETS["cifar10"].std).view(1, 3, 1, 1)
    assert torch.allclose(batch, (torch.from_numpy(x).float() / 255 - mean) / std, atol=1e-6)
    assert labels.dtype == torch.int64
    augmented, _ = data.train_batch(torch.arange(6), torch.Generator().manual_seed(0))
    assert augmented.shape == (6, 3, 32, 32) and not torch.allclose(augmented, batch)


def test_npz_with_the_experiments_own_preprocessing(tmp_path: Path) -> None:
    """augment and normalize chosen in the experiment apply to the node's data too."""
    path = _save(tmp_path / "node.npz", x=_images(3, (1, 28, 28)), y=np.array([1, 2, 3]))
    data = load_local(path, "mnist", augment="none", normalize="half")
    batch, _ = data.eval_batch(0, 3)
    train, _ = data.train_batch(torch.arange(3), torch.Generator().manual_seed(0))
    assert torch.equal(batch, train) and torch.allclose(batch, data.x.float() / 255 * 2 - 1, atol=1e-6)


_TO_NCHW = {
    "nchw": lambda a: a,
    "nhwc": lambda a: a.transpose(0, 3, 1, 2),
    "nhw": lambda a: a[:, None],
}


@pytest.mark.parametrize(
    ("name", "stored", "layout"),
    [
        ("cifar10", (32, 32, 3), "nhwc"),
        ("mnist", (28, 28), "nhw"),
        ("mnist", (28, 28, 1), "nhwc"),
        ("mnist", (1, 28, 28), "nchw"),
    ],
)
def test_npz_channels_last_and_channelless_images_become_nchw(
    tmp_path: Path, name: str, stored: tuple[int, ...], layout: str
) -> None:
    """N x H x W x C (PIL's and most image code's layout), and N x H x W for one channel, are accepted."""
    x = _images(4, stored)
    data = load_local(_save(tmp_path / "node.npz", x=x, y=np.arange(4)), name)
    nchw = _TO_NCHW[layout](x)
    assert data.input_shape == dataset_schema(name).input_shape and torch.equal(data.x, torch.from_numpy(nchw))


def test_npz_of_digits_features_is_kept_as_float32(tmp_path: Path) -> None:
    """digits: float features N x 1 x 8 x 8 (pixel / 16) as its loader makes them, no transforms."""
    x = np.random.default_rng(0).random((5, 1, 8, 8))  # float64: cast
    data = load_local(_save(tmp_path / "d.npz", x=x, y=np.array([0, 1, 2, 3, 4], dtype=np.uint8)), "digits")
    assert data.x.dtype == torch.float32 and data.y.dtype == torch.int64 and data.train_transform is None
    assert torch.allclose(data.eval_batch(0, 5)[0], torch.from_numpy(x).float())


def _bad_npz(tmp_path: Path, case: str) -> Path:
    path = tmp_path / "node.npz"
    ok_x, ok_y = _images(4, (1, 28, 28)), np.arange(4)
    if case == "missing":
        return tmp_path / "nowhere.npz"
    if case == "not-an-archive":
        path.write_text("x,y\n1,2\n")
    elif case == "npy":
        np.save(path.with_suffix(".npy"), ok_x)
        return path.with_suffix(".npy")
    elif case == "no-y":
        _save(path, x=ok_x, labels=ok_y)
    elif case == "float-pixels":
        _save(path, x=ok_x.astype(np.float32) / 255, y=ok_y)
    elif case == "shape":
        _save(path, x=_images(4, (3, 32, 32)), y=ok_y)
    elif case == "label-range":
        _save(path, x=ok_x, y=np.array([0, 1, 2, 10]))
    elif case == "negative-label":
        _save(path, x=ok_x, y=np.array([0, -1, 2, 3]))
    elif case == "float-labels":
        _save(path, x=ok_x, y=ok_y.astype(np.float32))
    elif case == "lengths":
        _save(path, x=ok_x, y=np.arange(3))
    elif case == "empty":
        _save(path, x=ok_x[:0], y=ok_y[:0])
    elif case == "objects":
        np.savez(path, x=np.array([ok_x, None], dtype=object), y=ok_y)
    return path


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("missing", "does not exist"),
        ("not-an-archive", "cannot be read as an .npz"),
        ("npy", "single .npy array"),
        ("no-y", "holds the arrays ['x', 'labels']"),
        ("float-pixels", "astype(np.uint8)"),
        ("shape", "x has shape (4, 3, 32, 32); dataset 'mnist' takes uint8 images N x 1 x 28 x 28"),
        ("label-range", "labels 0..10; the experiment's dataset has 10 classes, 0..9"),
        ("negative-label", "labels -1..3"),
        ("float-labels", "1-D array of integer class indices"),
        ("lengths", "3 labels for 4 inputs"),
        ("empty", "holds no examples"),
        ("objects", "cannot be read"),
    ],
)
def test_malformed_npz_is_a_data_error_naming_the_file_and_the_fix(tmp_path: Path, case: str, says: str) -> None:
    path = _bad_npz(tmp_path, case)
    with pytest.raises(DataError) as info:
        load_local(path, "mnist")
    assert str(path) in str(info.value) and says in str(info.value)


def test_npz_of_digits_with_nan_or_integer_features_is_refused(tmp_path: Path) -> None:
    x = np.zeros((2, 1, 8, 8), dtype=np.float32)
    x[1, 0, 0, 0] = np.nan
    with pytest.raises(DataError, match="NaN"):
        load_local(_save(tmp_path / "a.npz", x=x, y=np.arange(2)), "digits")
    with pytest.raises(DataError, match="floating point"):
        load_local(_save(tmp_path / "b.npz", x=np.zeros((2, 1, 8, 8), np.uint8), y=np.arange(2)), "digits")


def _png(path: Path, size: tuple[int, int], mode: str = "RGB", value: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, (value,) * len(mode) if len(mode) > 1 else value).save(path)


def test_folder_of_class_index_folders_reads_each_image_with_its_label(tmp_path: Path) -> None:
    """PATH/<class index>/*.png, classes in index order and files by name; absent classes have no
    folder; other files and hidden folders are ignored; RGB files become one channel for MNIST."""
    root = tmp_path / "mine"
    _png(root / "7" / "b.png", (28, 28), value=70)
    _png(root / "7" / "a.png", (28, 28), value=71)
    _png(root / "2" / "x.jpg", (28, 28), mode="L", value=20)
    (root / "7" / "notes.txt").write_text("not an image")
    (root / ".cache").mkdir()
    data = load_local(root, "mnist")
    assert data.y.tolist() == [2, 7, 7] and data.x.shape == (3, 1, 28, 28) and data.x.dtype == torch.uint8
    assert [int(data.x[i, 0, 0, 0]) for i in range(3)] == [20, 71, 70]


@pytest.mark.parametrize(
    ("layout", "says"),
    [
        ({"cats/a.png": (32, 32)}, "sub-folders ['cats'] are not class indices"),
        ({"10/a.png": (32, 32)}, "sub-folders ['10'] are not class indices"),
        ({"3/a.png": (28, 28)}, "image of size (28, 28) where 32x32 was expected"),
        ({}, "no image files in class folders"),
    ],
)
def test_malformed_folder_is_a_data_error(tmp_path: Path, layout: dict[str, tuple[int, int]], says: str) -> None:
    root = tmp_path / "mine"
    root.mkdir()
    for name, size in layout.items():
        _png(root / name, size)
    with pytest.raises(DataError) as info:
        load_local(root, "cifar10")
    assert str(root) in str(info.value) and says in str(info.value)


def test_folder_is_refused_for_a_feature_dataset(tmp_path: Path) -> None:
    _png(tmp_path / "mine" / "1" / "a.png", (8, 8), mode="L")
    with pytest.raises(DataError, match=r"give an \.npz of x and y"):
        load_local(tmp_path / "mine", "digits")
