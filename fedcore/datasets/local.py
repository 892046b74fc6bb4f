"""One node's own data, for deployment (``fedmq node --data PATH``): read from one file or folder,
checked against the experiment dataset's schema, never the whole dataset.

Two forms (docs/local-data.md):

- an ``.npz`` archive with arrays ``x`` (inputs) and ``y`` (labels), e.g. ``np.savez(PATH, x=x, y=y)``;
  other arrays in it are ignored. For an image dataset ``x`` is uint8 pixels (0..255) laid out
  N x C x H x W, as the dataset's loader keeps them; N x H x W x C (channels last, as PIL and most
  image code make them) and, for one channel, N x H x W are accepted and turned into N x C x H x W.
  For a feature dataset (digits, synthetic) ``x`` is floating point in the loader's shape (digits:
  N x 1 x 8 x 8, pixel / 16 in [0, 1]) and is kept as float32. ``y`` holds N integer class indices.
- a folder of image files (PNG, JPEG, BMP, WebP) in one sub-folder per class, named by the class
  index: ``PATH/0/*.png``, ``PATH/1/*.png``, ... (absent classes simply have no folder). Images are
  read with Pillow and converted to the dataset's channels; each must have its size. Image
  datasets only.

Every check names the file and says what to fix: a `DataError`.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedmq.fedcore.datasets.folders import image_files
from fedmq.fedcore.datasets.images import read_images
from fedmq.fedcore.errors import DataError


@dataclass(frozen=True, slots=True)
class Schema:
    """What a dataset's examples look like, known without loading it: the model is built from it."""

    input_shape: tuple[int, ...]
    num_classes: int
    pixels: bool
    """uint8 images C x H x W (transformed batch by batch), else float32 features."""

    def describe(self) -> str:
        shape = " x ".join(map(str, self.input_shape))
        return f"{'uint8 images' if self.pixels else 'float features'} N x {shape}, labels 0..{self.num_classes - 1}"


def read_local(path: Path, schema: Schema, dataset: str) -> tuple[np.ndarray, np.ndarray]:
    """Inputs (N x `schema.input_shape`, uint8 or float32) and int64 labels from `path`, checked."""
    if path.is_dir():
        x, y = _read_folder(path, schema, dataset)
    elif path.is_file():
        x, y = _read_npz(path, schema, dataset)
    else:
        raise DataError(
            f"{path} does not exist; --data takes an .npz file (arrays x and y) or a folder of class folders"
        )
    return x, y


def _read_npz(path: Path, schema: Schema, dataset: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise DataError(f"{path} is a single .npy array; save x and y together: np.savez({path.name!r}, x=x, y=y)")
        with loaded as archive:
            names = list(archive.files)
            if "x" not in names or "y" not in names:
                raise DataError(
                    f"{path} holds the arrays {names}; a node's data file holds x (inputs) and y (labels):"
                    f" np.savez({path.name!r}, x=x, y=y)"
                )
            x, y = archive["x"], archive["y"]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path} cannot be read as an .npz archive of x and y ({exc})") from exc
    x = _inputs(x, schema, dataset, path)
    return x, _labels(y, len(x), schema, f"{path}: y")


def _inputs(x: np.ndarray, schema: Schema, dataset: str, path: Path) -> np.ndarray:
    shape = schema.input_shape
    want = f"dataset {dataset!r} takes {schema.describe()}"
    if x.ndim == 0 or len(x) == 0:
        raise DataError(f"{path}: x holds no examples; {want}")
    if schema.pixels and x.dtype != np.uint8:
        raise DataError(
            f"{path}: x is {x.dtype}; {want} (pixels 0..255; from floats in [0, 1]: (x * 255).round().astype(np.uint8))"
        )
    if not schema.pixels and x.dtype.kind != "f":
        raise DataError(f"{path}: x is {x.dtype}; {want} (floating point, as the dataset's loader makes them)")
    got = tuple(x.shape[1:])
    if got == shape:
        pass
    elif len(shape) == 3 and got == (shape[1], shape[2], shape[0]):
        x = x.transpose(0, 3, 1, 2)  # channels last -> N x C x H x W
    elif len(shape) >= 2 and shape[0] == 1 and got == shape[1:]:
        x = x[:, None]
    else:
        extra = f" (or N x {shape[1]} x {shape[2]} x {shape[0]}, channels last)" if len(shape) == 3 else ""
        raise DataError(f"{path}: x has shape {tuple(x.shape)}; {want}{extra}")
    if not schema.pixels:
        x = x.astype(np.float32, copy=False)
        if not np.isfinite(x).all():
            raise DataError(f"{path}: x holds NaN or infinite values")
    return np.ascontiguousarray(x)


def _labels(y: np.ndarray, n: int, schema: Schema, where: str) -> np.ndarray:
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise DataError(f"{where} must be a 1-D array of integer class indices, got {y.dtype} of shape {y.shape}")
    if len(y) != n:
        raise DataError(f"{where} has {len(y)} labels for {n} inputs; one label per example")
    low, high = int(y.min()), int(y.max())
    if low < 0 or high >= schema.num_classes:
        raise DataError(
            f"{where} holds labels {low}..{high}; the experiment's dataset has {schema.num_classes} classes,"
            f" 0..{schema.num_classes - 1}"
        )
    return y.astype(np.int64)


def _read_folder(path: Path, schema: Schema, dataset: str) -> tuple[np.ndarray, np.ndarray]:
    if not schema.pixels:
        raise DataError(f"{path} is a folder; dataset {dataset!r} takes {schema.describe()}: give an .npz of x and y")
    folders = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    bad = [p.name for p in folders if not p.name.isdigit() or int(p.name) >= schema.num_classes]
    if bad:
        raise DataError(
            f"{path}: sub-folders {bad} are not class indices; name each class folder by its index,"
            f" 0..{schema.num_classes - 1} (e.g. {path / '3'}/*.png)"
        )
    paths: list[Path] = []
    labels: list[int] = []
    for folder in sorted(folders, key=lambda p: int(p.name)):
        files = image_files(folder)
        paths += files
        labels += [int(folder.name)] * len(files)
    if not paths:
        raise DataError(f"{path}: no image files in class folders; expected {path}/<class index>/*.png")
    x = read_images(paths, schema.input_shape)  # type: ignore[arg-type]
    return x, np.asarray(labels, dtype=np.int64)
