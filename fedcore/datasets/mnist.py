"""MNIST and Fashion-MNIST from the four official idx files (gzipped or not), read with numpy.

The files sit where torchvision puts them: ``ROOT/mnist/MNIST/raw/`` and
``ROOT/fashion-mnist/FashionMNIST/raw/`` (``ROOT/MNIST/raw/`` and ``ROOT/FashionMNIST/raw/`` are
accepted too). Magic numbers, dimensions and file lengths are checked; images come back as
N x 1 x 28 x 28 uint8, labels as int64, in the files' order.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedmq.fedcore.datasets.cache import Arrays, cached
from fedmq.fedcore.datasets.layout import first_existing, missing
from fedmq.fedcore.errors import DataError

FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
SIZES = {"train": 60_000, "test": 10_000}
_UBYTE = 0x08
_DECODER_VERSION = 1


@dataclass(frozen=True, slots=True)
class IdxSource:
    name: str
    folders: tuple[str, ...]
    get: str


SOURCES = {
    "mnist": IdxSource(
        "mnist",
        ("mnist/MNIST/raw", "MNIST/raw"),
        "The four files are at https://ossci-datasets.s3.amazonaws.com/mnist/ (torchvision's mirror of"
        " http://yann.lecun.com/exdb/mnist/), or set data.download: true where torchvision is installed.",
    ),
    "fashion-mnist": IdxSource(
        "fashion-mnist",
        ("fashion-mnist/FashionMNIST/raw", "FashionMNIST/raw"),
        "The four files are at http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
        " (see https://github.com/zalandoresearch/fashion-mnist),"
        " or set data.download: true where torchvision is installed.",
    ),
}


def read_idx(path: Path, *, ndim: int) -> np.ndarray:
    """An idx file of unsigned bytes with `ndim` dimensions; DataError if its header or length is wrong."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path} cannot be read ({exc})") from exc
    if len(raw) < 4 + 4 * ndim:
        raise DataError(f"{path} is too short for an idx header ({len(raw)} bytes)")
    zero, dtype, dims = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype != _UBYTE or dims != ndim:
        raise DataError(
            f"{path}: bad idx magic number 0x{int.from_bytes(raw[:4], 'big'):08x}"
            f" (expected 0x{(_UBYTE << 8) | ndim:08x}: unsigned bytes, {ndim} dimensions)"
        )
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    header = 4 + 4 * ndim
    if len(raw) - header != int(np.prod(shape)):
        raise DataError(f"{path}: the header says {shape} but the file has {len(raw) - header} data bytes")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def _file(folder: Path, name: str) -> Path:
    plain, gz = folder / name, folder / f"{name}.gz"
    return plain if plain.is_file() else gz


def _find(source: IdxSource, root: Path | None) -> Path:
    needed = [n for pair in FILES.values() for n in pair]
    for candidate in source.folders:
        folder = first_existing(root, [candidate])
        if folder is not None and all(_file(folder, n).is_file() for n in needed):
            return folder
    expected = [f"{folder}/{{{','.join(needed)}}}[.gz]" for folder in source.folders]
    raise missing(source.name, root, expected, source.get)


def _decode(folder: Path) -> Arrays:
    arrays: Arrays = {}
    for split, (images_name, labels_name) in FILES.items():
        images = read_idx(_file(folder, images_name), ndim=3)
        labels = read_idx(_file(folder, labels_name), ndim=1)
        if images.shape != (SIZES[split], 28, 28) or labels.shape != (SIZES[split],):
            raise DataError(
                f"{folder}: {split} images {images.shape} and labels {labels.shape};"
                f" expected ({SIZES[split]}, 28, 28) and ({SIZES[split]},)"
            )
        if int(labels.max()) > 9:
            raise DataError(f"{folder}: {split} labels outside 0..9")
        arrays[f"{split}_x"] = images[:, None, :, :]
        arrays[f"{split}_y"] = labels.astype(np.int64)
    return arrays


def load_idx_dataset(name: str, root: Path | None, cache_dir: Path | None) -> Arrays:
    """``train_x``, ``train_y``, ``test_x``, ``test_y`` of MNIST or Fashion-MNIST."""
    source = SOURCES[name]
    folder = _find(source, root)
    files = [_file(folder, n) for pair in FILES.values() for n in pair]
    return cached(cache_dir, name, files, lambda: _decode(folder), version=_DECODER_VERSION)
