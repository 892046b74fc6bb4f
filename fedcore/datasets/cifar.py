"""CIFAR-10 and CIFAR-100 from the original python-version files or from the lossless WebP packs.

Looked for under the data root, first match wins:
- ``cifar10/cifar10_webp.npz`` / ``cifar100/cifar100_webp.npz``: the WebP packs (``images_webp``,
  ``offsets``, ``n_train``, labels), decoded with Pillow;
- ``cifar10/cifar-10-batches-py/`` (``data_batch_1..5``, ``test_batch``) and
  ``cifar100/cifar-100-python/`` (``train``, ``test``): the pickles from the CIFAR page, which is
  where torchvision puts them; ``ROOT/cifar-10-batches-py/`` and ``ROOT/cifar-100-python/`` too.
  They are read by `fedcore.datasets.safe_unpickle`, never by the pickle module.

Both give the same arrays: uint8 N x 3 x 32 x 32 in the standard order (training batches 1 to 5,
then the test batch; 50,000 and 10,000 images), int64 labels; CIFAR-100 keeps its fine and coarse
labels. Sizes are taken from the files (the tests use small fabricated ones); shapes, dtypes, label
ranges and the pack's offsets are checked.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedmq.fedcore.datasets.cache import Arrays, cached
from fedmq.fedcore.datasets.images import decode_blobs
from fedmq.fedcore.datasets.layout import first_existing, missing
from fedmq.fedcore.datasets.safe_unpickle import UnpicklingError, loads
from fedmq.fedcore.errors import DataError

SHAPE = (3, 32, 32)
_DECODER_VERSION = 1


@dataclass(frozen=True, slots=True)
class CifarSource:
    name: str
    folder: str
    pack: str
    pickle_dir: str
    train_files: tuple[str, ...]
    test_files: tuple[str, ...]
    label_keys: tuple[str, ...]  # in the pickles; the first one is `y`
    pack_label_keys: tuple[str, ...]
    num_classes: tuple[int, ...]


SOURCES = {
    "cifar10": CifarSource(
        name="cifar10",
        folder="cifar10",
        pack="cifar10_webp.npz",
        pickle_dir="cifar-10-batches-py",
        train_files=tuple(f"data_batch_{i}" for i in range(1, 6)),
        test_files=("test_batch",),
        label_keys=("labels",),
        pack_label_keys=("labels",),
        num_classes=(10,),
    ),
    "cifar100": CifarSource(
        name="cifar100",
        folder="cifar100",
        pack="cifar100_webp.npz",
        pickle_dir="cifar-100-python",
        train_files=("train",),
        test_files=("test",),
        label_keys=("fine_labels", "coarse_labels"),
        pack_label_keys=("fine_labels", "coarse_labels"),
        num_classes=(100, 20),
    ),
}
# array names in the cache and in what the loader returns, one per label kind
LABEL_ARRAYS = ("y", "coarse_y")

GET = (
    "The python version is at https://www.cs.toronto.edu/~kriz/cifar.html (extract the tar.gz there),"
    " or set data.download: true where torchvision is installed."
)


def _text_keys(value: object, where: Path) -> dict[str, object]:
    if not isinstance(value, dict):
        raise DataError(f"{where}: expected a dict, found {type(value).__name__}")
    return {k.decode("latin-1") if isinstance(k, bytes) else str(k): v for k, v in value.items()}


def _labels(value: object, n: int, classes: int, where: str) -> np.ndarray:
    labels = np.asarray(value)
    if labels.shape != (n,) or labels.dtype.kind not in "iu":
        raise DataError(f"{where}: {n} integer labels expected, got shape {labels.shape} of {labels.dtype}")
    labels = labels.astype(np.int64)
    if n and (labels.min() < 0 or labels.max() >= classes):
        raise DataError(f"{where}: labels outside 0..{classes - 1}")
    return labels


def read_pickle_batch(path: Path, source: CifarSource) -> tuple[np.ndarray, list[np.ndarray]]:
    """One python-version batch file: images N x 3 x 32 x 32 and one label array per label kind."""
    try:
        content = loads(path.read_bytes())
    except OSError as exc:
        raise DataError(f"{path} cannot be read ({exc})") from exc
    except UnpicklingError as exc:
        raise DataError(f"{path} is not a CIFAR batch file: {exc}") from exc
    entry = _text_keys(content, path)
    data = entry.get("data")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise DataError(f"{path}: 'data' must be a uint8 array N x 3072")
    n = data.shape[0]
    labels = []
    for key, classes in zip(source.label_keys, source.num_classes, strict=True):
        if key not in entry:
            raise DataError(f"{path}: no {key!r} entry (has {sorted(entry)})")
        labels.append(_labels(entry[key], n, classes, f"{path} {key}"))
    return data.reshape(n, *SHAPE), labels


def _decode_pickles(folder: Path, source: CifarSource) -> Arrays:
    arrays: Arrays = {}
    for split, files in (("train", source.train_files), ("test", source.test_files)):
        parts = [read_pickle_batch(folder / f, source) for f in files]
        arrays[f"{split}_x"] = np.concatenate([p[0] for p in parts])
        for i, name in enumerate(LABEL_ARRAYS[: len(source.label_keys)]):
            arrays[f"{split}_{name}"] = np.concatenate([p[1][i] for p in parts])
    return arrays


def _decode_pack(path: Path, source: CifarSource) -> Arrays:
    needed = {"images_webp", "offsets", "n_train", *source.pack_label_keys}
    try:
        with np.load(path, allow_pickle=False) as pack:
            if not needed <= set(pack.files):
                raise DataError(f"{path}: a WebP pack holds {sorted(needed)}; this one has {sorted(pack.files)}")
            content = {k: pack[k] for k in needed}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path} cannot be read as a WebP pack ({exc})") from exc
    offsets, blobs = content["offsets"], content["images_webp"]
    total = len(content[source.pack_label_keys[0]])
    n_train = int(content["n_train"])
    if not 0 < n_train < total or offsets.shape != (total + 1,) or offsets.dtype.kind not in "iu":
        raise DataError(f"{path}: n_train {n_train} and {offsets.shape} offsets do not fit {total} labels")
    if offsets[0] != 0 or offsets[-1] != len(blobs) or np.any(np.diff(offsets) <= 0):
        raise DataError(f"{path}: offsets do not cut images_webp into {total} images")
    x = decode_blobs(blobs, offsets, SHAPE, source=str(path), formats=("WEBP",))
    arrays: Arrays = {"train_x": x[:n_train], "test_x": x[n_train:]}
    for key, classes, name in zip(source.pack_label_keys, source.num_classes, LABEL_ARRAYS, strict=False):
        labels = _labels(content[key], total, classes, f"{path} {key}")
        arrays[f"train_{name}"], arrays[f"test_{name}"] = labels[:n_train], labels[n_train:]
    return arrays


def load_cifar(name: str, root: Path | None, cache_dir: Path | None) -> Arrays:
    """``train_x``, ``train_y``, ``test_x``, ``test_y`` (and for CIFAR-100 ``train_coarse_y``, ``test_coarse_y``)."""
    source = SOURCES[name]
    pack = first_existing(root, [f"{source.folder}/{source.pack}"])
    if pack is not None:
        return cached(cache_dir, f"{name}-webp", [pack], lambda: _decode_pack(pack, source), version=_DECODER_VERSION)
    files = source.train_files + source.test_files
    folder = first_existing(root, [f"{source.folder}/{source.pickle_dir}", source.pickle_dir], wanted=files)
    if folder is not None:
        paths = [folder / f for f in files]
        return cached(
            cache_dir, f"{name}-python", paths, lambda: _decode_pickles(folder, source), version=_DECODER_VERSION
        )
    listed = "{" + ",".join(files) + "}"
    expected = [
        f"{source.folder}/{source.pack}",
        f"{source.folder}/{source.pickle_dir}/{listed}",
        f"{source.pickle_dir}/{listed}",
    ]
    raise missing(name, root, expected, GET)
