"""Datasets kept as folders of image files: CINIC-10 and Tiny-ImageNet.

Order follows torchvision's ImageFolder, so that partitions are the same as in code that uses it:
classes sorted by folder name, and within a class the files sorted by name.

- CINIC-10 (https://datashare.ed.ac.uk/handle/10283/3192): ``ROOT/cinic10/{train,valid,test}/<class>/*.png``,
  32 x 32 RGB, 90,000 images per split. The test split is the test set; `include_valid` adds the
  validation split after the training one (the 180,000-image training set some papers use).
- Tiny-ImageNet (http://cs231n.stanford.edu/tiny-imagenet-200.zip): ``ROOT/tiny-imagenet-200/``
  with ``wnids.txt``, ``train/<wnid>/images/*.JPEG`` and ``val/images/*.JPEG`` labelled by
  ``val/val_annotations.txt``; 64 x 64 RGB (greyscale files are converted), 200 classes. The
  validation set, in the annotation file's order, is the test set (the official test set has no labels).

The folder and class folders (their modification times) key the cache: a file replaced in place
without adding or removing one is not noticed, so delete the cache entry after editing a dataset.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedmq.fedcore.datasets.cache import Arrays, cached
from fedmq.fedcore.datasets.images import read_images
from fedmq.fedcore.datasets.layout import first_existing, missing
from fedmq.fedcore.errors import DataError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".webp"}
_DECODER_VERSION = 1

CINIC_FOLDERS = ("cinic10", "CINIC-10", "cinic-10")
CINIC_SPLITS = ("train", "valid", "test")
CINIC_CLASSES = 10
TINY_FOLDERS = ("tiny-imagenet-200", "tiny-imagenet/tiny-imagenet-200")
TINY_CLASSES = 200


def image_files(folder: Path) -> list[Path]:
    """The image files directly in `folder` (by suffix, any case), sorted by name."""
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def _class_folders(split: Path) -> list[Path]:
    return sorted(p for p in split.iterdir() if p.is_dir())


def _image_folder(split: Path, classes: list[str]) -> tuple[list[Path], np.ndarray]:
    paths: list[Path] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        files = image_files(split / name)
        paths += files
        labels += [label] * len(files)
    if not paths:
        raise DataError(f"{split}: no image files in its class folders")
    return paths, np.asarray(labels, dtype=np.int64)


def _cinic_decode(base: Path, classes: list[str]) -> Arrays:
    arrays: Arrays = {}
    for split in CINIC_SPLITS:
        found = [p.name for p in _class_folders(base / split)]
        if found != classes:
            raise DataError(f"{base / split}: class folders {found} differ from train's {classes}")
        paths, labels = _image_folder(base / split, classes)
        arrays[f"{split}_x"] = read_images(paths, (3, 32, 32))
        arrays[f"{split}_y"] = labels
    return arrays


def load_cinic10(root: Path | None, cache_dir: Path | None) -> Arrays:
    """``train_x``, ``train_y``, ``valid_x``, ``valid_y``, ``test_x``, ``test_y``."""
    base = first_existing(root, CINIC_FOLDERS, wanted=CINIC_SPLITS)
    if base is None:
        expected = [f"{folder}/{{train,valid,test}}/<class>/*.png" for folder in CINIC_FOLDERS[:2]]
        raise missing("cinic10", root, expected, "CINIC-10 is at https://datashare.ed.ac.uk/handle/10283/3192.")
    classes = [p.name for p in _class_folders(base / "train")]
    if len(classes) != CINIC_CLASSES:
        raise DataError(f"{base / 'train'}: {len(classes)} class folders, expected {CINIC_CLASSES}")
    sources = [base / s for s in CINIC_SPLITS] + [base / s / c for s in CINIC_SPLITS for c in classes]
    return cached(cache_dir, "cinic10", sources, lambda: _cinic_decode(base, classes), version=_DECODER_VERSION)


def _tiny_decode(base: Path, wnids: list[str]) -> Arrays:
    index = {w: i for i, w in enumerate(wnids)}
    paths, train_y = _image_folder_nested(base / "train", wnids)
    annotations = base / "val" / "val_annotations.txt"
    val_paths: list[Path] = []
    val_y: list[int] = []
    for number, line in enumerate(annotations.read_text().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in index:
            raise DataError(f"{annotations}:{number}: expected 'FILE<TAB>WNID...' with a wnid from wnids.txt")
        val_paths.append(base / "val" / "images" / fields[0])
        val_y.append(index[fields[1]])
    missing_files = [p for p in val_paths if not p.is_file()]
    if missing_files:
        raise DataError(f"{annotations} names {len(missing_files)} missing files, e.g. {missing_files[0]}")
    return {
        "train_x": read_images(paths, (3, 64, 64)),
        "train_y": train_y,
        "test_x": read_images(val_paths, (3, 64, 64)),
        "test_y": np.asarray(val_y, dtype=np.int64),
    }


def _image_folder_nested(split: Path, classes: list[str]) -> tuple[list[Path], np.ndarray]:
    """Tiny-ImageNet's ``train/<wnid>/images/*.JPEG`` (the boxes files beside ``images/`` are ignored)."""
    paths: list[Path] = []
    labels: list[int] = []
    for label, wnid in enumerate(classes):
        folder = split / wnid / "images"
        if not folder.is_dir():
            raise DataError(f"{folder} is missing (one folder per wnid in wnids.txt)")
        files = image_files(folder)
        paths += files
        labels += [label] * len(files)
    return paths, np.asarray(labels, dtype=np.int64)


def load_tiny_imagenet(root: Path | None, cache_dir: Path | None) -> Arrays:
    """``train_x``, ``train_y``, ``test_x`` (the validation images), ``test_y``; classes are the sorted wnids."""
    wanted = ("wnids.txt", "train", "val/images", "val/val_annotations.txt")
    base = first_existing(root, TINY_FOLDERS, wanted=wanted)
    if base is None:
        expected = [
            f"{TINY_FOLDERS[0]}/wnids.txt",
            f"{TINY_FOLDERS[0]}/train/<wnid>/images/*.JPEG",
            f"{TINY_FOLDERS[0]}/val/images/*.JPEG and {TINY_FOLDERS[0]}/val/val_annotations.txt",
        ]
        raise missing(
            "tiny-imagenet",
            root,
            expected,
            "Tiny-ImageNet is at http://cs231n.stanford.edu/tiny-imagenet-200.zip (unzip it in the data root).",
        )
    wnids = sorted({w.strip() for w in (base / "wnids.txt").read_text().splitlines() if w.strip()})
    if len(wnids) != TINY_CLASSES:
        raise DataError(f"{base / 'wnids.txt'} lists {len(wnids)} classes, expected {TINY_CLASSES}")
    sources = [base / "wnids.txt", base / "val" / "val_annotations.txt", base / "val" / "images"]
    sources += [base / "train" / w / "images" for w in wnids if (base / "train" / w / "images").exists()]
    return cached(cache_dir, "tiny-imagenet", sources, lambda: _tiny_decode(base, wnids), version=_DECODER_VERSION)
