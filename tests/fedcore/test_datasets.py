"""Dataset loaders: the real MNIST, Fashion-MNIST and CIFAR files, generated CIFAR-pickle, CINIC-10 and
Tiny-ImageNet fixtures, the decoded-array cache, and the errors for missing or malformed files."""

from __future__ import annotations

import gzip
import hashlib
import io
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedmq.fedcore.data import DATASETS, Split, load_dataset
from fedmq.fedcore.datasets import cifar, folders, mnist
from fedmq.fedcore.datasets.mnist import read_idx
from fedmq.fedcore.errors import ConfigError, DataError
from tests.fedcore.py2pickle import dumps_py2

# sha256 of the decoded uint8 arrays N x 3 x 32 x 32, C order (shared/data/README.md)
CIFAR_SHA256 = {
    "cifar10": (
        "67211b3581fa992aba0cca56a1467be430d148ebddfddaf26c867b572915d4b2",
        "ed893735ff82c0178f2cd31343a1d5ab993eeae4f3b919d9c1436789336729f1",
    ),
    "cifar100": (
        "de64658905c6b161606e3649ddafce7cf86c7634a0cf9116d518e64ef46a33c5",
        "83c56492b2c11211ad1bb2dbd4f2eef4170a0441e41a41f3039c3144b1f5a511",
    ),
}
# per-class counts of the official files
IDX_COUNTS = {
    "mnist": (
        [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949],
        [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009],
    ),
    "fashion-mnist": ([6000] * 10, [1000] * 10),
}


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache folder for the session: each real dataset is decoded once (CIFAR takes seconds)."""
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="session")
def real(data_root: Path, data_cache: Path) -> dict[str, Split]:
    """The real datasets, loaded lazily by name and kept for the session."""

    class Lazy(dict[str, Split]):
        def __missing__(self, name: str) -> Split:
            self[name] = load_dataset(name, seed=0, root=data_root, cache_dir=data_cache)
            return self[name]

    return Lazy()


def sha256(x: torch.Tensor) -> str:
    return hashlib.sha256(x.contiguous().numpy().tobytes()).hexdigest()


# -- the real files --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(IDX_COUNTS))
def test_idx_loader_real_files_give_documented_shapes_and_class_counts(name: str, real: dict[str, Split]) -> None:
    """MNIST and Fashion-MNIST: 60,000 / 10,000 uint8 images 1 x 28 x 28, int64 labels, exact class counts."""
    split = real[name]
    assert split.train.x.shape == (60000, 1, 28, 28) and split.test.x.shape == (10000, 1, 28, 28)
    assert split.train.x.dtype == torch.uint8 and split.train.y.dtype == torch.int64
    assert split.train.num_classes == 10
    assert (split.train.label_histogram(), split.test.label_histogram()) == IDX_COUNTS[name]


@pytest.mark.parametrize("name", sorted(CIFAR_SHA256))
def test_cifar_loader_real_pack_matches_published_checksums(name: str, real: dict[str, Split]) -> None:
    """CIFAR-10/100 WebP packs decode to the README's sha256 of the uint8 N x 3 x 32 x 32 arrays, balanced labels."""
    split = real[name]
    classes = split.train.num_classes
    assert classes == {"cifar10": 10, "cifar100": 100}[name]
    assert split.train.x.shape == (50000, 3, 32, 32) and split.test.x.shape == (10000, 3, 32, 32)
    assert split.train.x.dtype == torch.uint8 and split.train.y.dtype == torch.int64
    assert (sha256(split.train.x), sha256(split.test.x)) == CIFAR_SHA256[name]
    assert split.train.label_histogram() == [50000 // classes] * classes
    assert split.test.label_histogram() == [10000 // classes] * classes


def test_cifar100_coarse_labels_option_gives_twenty_superclasses(data_root: Path, data_cache: Path) -> None:
    """labels=coarse gives CIFAR-100's 20 superclasses (2,500 training images each) from the same cache entry."""
    split = load_dataset("cifar100", seed=0, root=data_root, cache_dir=data_cache, labels="coarse")
    assert split.train.num_classes == 20 and split.train.label_histogram() == [2500] * 20


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist", "cifar10", "cifar100"])
def test_normalize_dataset_constants_give_zero_mean_unit_std(name: str, real: dict[str, Split]) -> None:
    """The per-dataset constants normalise the training set to mean about 0 and std about 1 per channel.

    Exact and fast: the eval transform maps each of the 256 pixel values per channel, weighted by
    the training set's per-channel histogram of raw pixels.
    """
    data = real[name].train
    channels = data.x.shape[1]
    hist = torch.zeros(channels, 256, dtype=torch.float64)
    for start in range(0, len(data), 10000):
        chunk = data.x[start : start + 10000]
        for c in range(channels):
            hist[c] += torch.bincount(chunk[:, c].reshape(-1).long(), minlength=256).double()
    side = data.x.shape[-1]  # an image of the dataset's size whose pixels run through 0..255 (then repeat)
    levels = (torch.arange(side * side) % 256).to(torch.uint8).view(1, 1, side, side).repeat(1, channels, 1, 1)
    values = data.eval_transform(levels, None).double().view(channels, -1)[:, :256]  # type: ignore[misc]
    count = hist.sum(1)
    mean = (hist * values).sum(1) / count
    std = ((hist * values**2).sum(1) / count - mean**2).sqrt()
    assert torch.allclose(mean, torch.zeros_like(mean), atol=2e-3), mean
    assert torch.allclose(std, torch.ones_like(std), atol=2e-3), std


def test_cifar_default_transforms_crop_flip_and_normalise_batches(real: dict[str, Split]) -> None:
    """CIFAR training batches are float, normalised, augmented (differ from eval) and reproducible per seed."""
    data = real["cifar10"].train
    idx = torch.arange(64)
    a, y = data.train_batch(idx, torch.Generator().manual_seed(1))
    b, _ = data.train_batch(idx, torch.Generator().manual_seed(1))
    plain, _ = data.eval_batch(0, 64)
    assert a.dtype == torch.float32 and a.shape == (64, 3, 32, 32) and torch.equal(y, data.y[:64])
    assert torch.equal(a, b) and not torch.equal(a, plain)


def test_cache_second_load_reads_cache_without_decoding(
    real: dict[str, Split], data_root: Path, data_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second CIFAR-10 load comes from the cache: the WebP decoder is not called and the arrays are equal."""
    first = real["cifar10"]

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("decoded again")

    monkeypatch.setattr(cifar, "decode_blobs", refuse)
    again = load_dataset("cifar10", seed=0, root=data_root, cache_dir=data_cache)
    assert torch.equal(again.train.x, first.train.x) and torch.equal(again.test.y, first.test.y)
    assert sha256(again.train.x) == CIFAR_SHA256["cifar10"][0]


# -- CIFAR python-version pickles (fabricated, same layout) -----------------------------------


def _cifar_images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 3072), dtype=np.uint8)


@pytest.fixture
def cifar10_pickles(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """ROOT/cifar10/cifar-10-batches-py with five training batches of 4 images and a test batch of 3."""
    folder = tmp_path / "cifar10" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    xs, ys = [], []
    for i, name in enumerate([*(f"data_batch_{b}" for b in range(1, 6)), "test_batch"]):
        n = 3 if name == "test_batch" else 4
        x, y = _cifar_images(n, i), [(i + j) % 10 for j in range(n)]
        entry = {"batch_label": f"batch {i}", "labels": y, "data": x, "filenames": [f"f{j}.png" for j in range(n)]}
        (folder / name).write_bytes(dumps_py2(entry))
        xs.append(x)
        ys.append(y)
    (folder / "batches.meta").write_bytes(dumps_py2({"label_names": [f"c{i}" for i in range(10)]}))
    return tmp_path, np.concatenate(xs).reshape(-1, 3, 32, 32), np.concatenate(ys)


def test_cifar10_pickles_load_in_standard_order(cifar10_pickles: tuple[Path, np.ndarray, np.ndarray]) -> None:
    """The python-version batches give images N x 3 x 32 x 32 and labels in batch order (1..5, then test)."""
    root, x, y = cifar10_pickles
    split = load_dataset("cifar10", seed=0, root=root)
    assert split.train.x.shape == (20, 3, 32, 32) and split.test.x.shape == (3, 3, 32, 32)
    assert np.array_equal(split.train.x.numpy(), x[:20]) and np.array_equal(split.test.x.numpy(), x[20:])
    assert split.train.y.tolist() == y[:20].tolist() and split.train.y.dtype == torch.int64


def test_cifar100_pickles_give_fine_and_coarse_labels(tmp_path: Path) -> None:
    """cifar-100-python/train and test: fine labels by default, coarse ones with labels=coarse."""
    folder = tmp_path / "cifar-100-python"  # also accepted directly under the root
    folder.mkdir()
    for i, name in enumerate(["train", "test"]):
        entry = {"data": _cifar_images(5, i), "fine_labels": [99, 0, 5, 6, 7], "coarse_labels": [19, 0, 1, 2, 3]}
        (folder / name).write_bytes(dumps_py2(entry))
    fine = load_dataset("cifar100", seed=0, root=tmp_path)
    coarse = load_dataset("cifar100", seed=0, root=tmp_path, labels="coarse")
    assert fine.train.num_classes == 100 and fine.train.y.tolist() == [99, 0, 5, 6, 7]
    assert coarse.train.num_classes == 20 and coarse.test.y.tolist() == [19, 0, 1, 2, 3]


def test_cifar_malicious_batch_file_is_a_data_error_and_runs_nothing(
    cifar10_pickles: tuple[Path, np.ndarray, np.ndarray],
) -> None:
    """A data_batch file that would call os.system is refused with a DataError naming the file."""
    root, _, _ = cifar10_pickles
    marker = root / "pwned"
    (root / "cifar10" / "cifar-10-batches-py" / "data_batch_3").write_bytes(
        b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    )
    with pytest.raises(DataError, match=r"data_batch_3 is not a CIFAR batch file.*refused"):
        load_dataset("cifar10", seed=0, root=root)
    assert not marker.exists()


def test_cache_is_keyed_by_source_and_skips_decoding_when_unchanged(
    cifar10_pickles: tuple[Path, np.ndarray, np.ndarray], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Second load: equal arrays and no batch file read; a rewritten source file is decoded again."""
    root, x, _ = cifar10_pickles
    cache = tmp_path / "cache"
    reads: list[Path] = []
    original = cifar.read_pickle_batch

    def counting(path: Path, source: cifar.CifarSource) -> tuple[np.ndarray, list[np.ndarray]]:
        reads.append(path)
        return original(path, source)

    monkeypatch.setattr(cifar, "read_pickle_batch", counting)
    first = load_dataset("cifar10", seed=0, root=root, cache_dir=cache)
    assert len(reads) == 6
    second = load_dataset("cifar10", seed=0, root=root, cache_dir=cache)
    assert len(reads) == 6, "the second load decoded again"
    assert torch.equal(first.train.x, second.train.x) and torch.equal(first.test.y, second.test.y)
    assert np.array_equal(second.train.x.numpy(), x[:20])
    entries = sorted(p.name for p in cache.iterdir() if not p.name.startswith("."))  # not the lock files
    assert len(entries) == 1 and entries[0].startswith("cifar10-python-")
    assert sorted(p.name for p in (cache / entries[0]).iterdir()) == [
        "source.json",
        "test_x.npy",
        "test_y.npy",
        "train_x.npy",
        "train_y.npy",
    ]

    test_batch = root / "cifar10" / "cifar-10-batches-py" / "test_batch"
    new_x = _cifar_images(2, 99)
    test_batch.write_bytes(dumps_py2({"data": new_x, "labels": [1, 2]}))
    third = load_dataset("cifar10", seed=0, root=root, cache_dir=cache)
    assert len(reads) == 12 and len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 2
    assert np.array_equal(third.test.x.numpy(), new_x.reshape(2, 3, 32, 32))


# -- image folders (generated fixtures) -------------------------------------------------------


def _png(path: Path, value: int, size: int, mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fill = value if mode == "L" else (value, (value + 1) % 256, (value + 2) % 256)
    Image.new(mode, (size, size), fill).save(path)


CINIC_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@pytest.fixture
def cinic_root(tmp_path: Path) -> Path:
    """ROOT/cinic10/{train,valid,test}/<class>/ with two 32 x 32 PNGs per class (one greyscale in train)."""
    for s, split in enumerate(["train", "valid", "test"]):
        for c, name in enumerate(CINIC_CLASSES):
            for i in range(2):
                mode = "L" if (split, c, i) == ("train", 3, 1) else "RGB"
                _png(tmp_path / "cinic10" / split / name / f"img_{i}.png", 100 * s + 10 * c + i, 32, mode)
    return tmp_path


def test_cinic10_loader_reads_folders_in_imagefolder_order(cinic_root: Path) -> None:
    """CINIC-10: classes sorted, files sorted within a class, RGB uint8 3 x 32 x 32, greyscale converted."""
    split = load_dataset("cinic10", seed=0, root=cinic_root)
    assert split.train.x.shape == (20, 3, 32, 32) and split.test.x.shape == (20, 3, 32, 32)
    assert split.train.x.dtype == torch.uint8 and split.train.num_classes == 10
    assert split.train.y.tolist() == [c for c in range(10) for _ in range(2)]
    assert split.train.x[:, 0, 0, 0].tolist() == [10 * c + i for c in range(10) for i in range(2)]
    assert split.train.x[7, :, 5, 5].tolist() == [31, 31, 31]  # the greyscale one, as RGB
    assert split.test.x[0, :, 0, 0].tolist() == [200, 201, 202]


def test_cinic10_include_valid_appends_the_validation_split(cinic_root: Path, tmp_path: Path) -> None:
    """include_valid gives train then valid as the training set; the test set is unchanged."""
    split = load_dataset("cinic10", seed=0, root=cinic_root, cache_dir=tmp_path / "cache", include_valid=True)
    assert len(split.train) == 40 and len(split.test) == 20
    assert split.train.x[20:, 0, 0, 0].tolist() == [100 + 10 * c + i for c in range(10) for i in range(2)]


@pytest.fixture
def tiny_root(tmp_path: Path) -> Path:
    """ROOT/tiny-imagenet-200 with 200 wnids (listed unsorted), one 64 x 64 JPEG each, and 3 validation images."""
    base = tmp_path / "tiny-imagenet-200"
    wnids = [f"n{9999 - i:08d}" for i in range(200)]  # reverse order on purpose: classes are the sorted wnids
    base.mkdir()
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    for wnid in wnids:
        _png(base / "train" / wnid / "images" / f"{wnid}_0.JPEG", 200, 64)
        (base / "train" / wnid / f"{wnid}_boxes.txt").write_text(f"{wnid}_0.JPEG\t0\t0\t63\t63\n")
    lines = []
    for i, wnid in enumerate([wnids[0], wnids[199], wnids[5]]):
        _png(base / "val" / "images" / f"val_{i}.JPEG", 40 * i, 64, mode="L" if i == 2 else "RGB")
        lines.append(f"val_{i}.JPEG\t{wnid}\t0\t0\t63\t63")
    (base / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_tiny_imagenet_loader_sorts_classes_and_keeps_annotation_order(tiny_root: Path) -> None:
    """Tiny-ImageNet: 3 x 64 x 64 uint8, 200 classes = sorted wnids, val (as test) in val_annotations order."""
    split = load_dataset("tiny-imagenet", seed=0, root=tiny_root)
    assert split.train.x.shape == (200, 3, 64, 64) and split.test.x.shape == (3, 3, 64, 64)
    assert split.train.num_classes == 200 and split.train.y.tolist() == list(range(200))
    # wnids[0] = n00009999 sorts last (199), wnids[199] = n00009800 first (0), wnids[5] = n00009994 is 194
    assert split.test.y.tolist() == [199, 0, 194]
    assert abs(int(split.test.x[1, 0, 30, 30]) - 40) <= 2 and split.test.x.dtype == torch.uint8
    x, _ = split.train.train_batch(torch.arange(4), torch.Generator().manual_seed(0))
    assert x.shape == (4, 3, 64, 64) and x.dtype == torch.float32


def test_folder_loaders_second_load_skips_image_reads(cinic_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a cache, CINIC-10's images are read once; the second load reads no image file."""
    cache = cinic_root / "cache"
    first = load_dataset("cinic10", seed=0, root=cinic_root, cache_dir=cache)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("read the images again")

    monkeypatch.setattr(folders, "read_images", refuse)
    second = load_dataset("cinic10", seed=0, root=cinic_root, cache_dir=cache)
    assert torch.equal(first.train.x, second.train.x) and torch.equal(first.test.y, second.test.y)


# -- missing and malformed files ---------------------------------------------------------------

EXPECTED_NAMES = {
    "mnist": "mnist/MNIST/raw/{train-images-idx3-ubyte,",
    "fashion-mnist": "fashion-mnist/FashionMNIST/raw/",
    "cifar10": "cifar10/cifar10_webp.npz",
    "cifar100": "cifar100/cifar-100-python/{train,test}",
    "cinic10": "cinic10/{train,valid,test}/<class>/*.png",
    "tiny-imagenet": "tiny-imagenet-200/wnids.txt",
}


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_loader_missing_files_raise_data_error_naming_files_and_env_var(name: str, tmp_path: Path) -> None:
    """An empty data root: DataError naming the expected files under it, data.root and FEDMQ_DATA_ROOT."""
    with pytest.raises(DataError) as info:
        load_dataset(name, seed=0, root=tmp_path)
    message = str(info.value)
    assert f"{tmp_path}/{EXPECTED_NAMES[name]}" in message
    assert "FEDMQ_DATA_ROOT" in message and "data.root" in message


def test_loader_without_root_says_to_set_one() -> None:
    """No data root at all: the DataError says that none is set and how to set it."""
    with pytest.raises(DataError, match=r"no data root is set(.|\n)*\$FEDMQ_DATA_ROOT/cifar10/cifar10_webp.npz"):
        load_dataset("cifar10", seed=0)


def _idx(path: Path, magic: int, dims: tuple[int, ...], payload: bytes) -> Path:
    path.write_bytes(gzip.compress(struct.pack(">I", magic) + struct.pack(f">{len(dims)}I", *dims) + payload))
    return path


def test_read_idx_valid_file_gives_its_array(tmp_path: Path) -> None:
    """A well-formed idx3 file gives the array its header describes."""
    path = _idx(tmp_path / "x.gz", 0x803, (2, 2, 3), bytes(range(12)))
    assert read_idx(path, ndim=3).tolist() == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10, 11]]]


@pytest.mark.parametrize(
    ("magic", "dims", "payload", "match"),
    [
        (0x801, (2, 2, 3), bytes(12), "magic"),  # a labels file where images were expected
        (0x0D03, (2, 2, 3), bytes(48), "magic"),  # float data
        (0x803, (2, 2, 3), bytes(11), "header says"),  # truncated
        (0x803, (2, 2, 3), bytes(13), "header says"),  # trailing bytes
    ],
)
def test_read_idx_bad_header_or_length_raises_data_error(
    tmp_path: Path, magic: int, dims: tuple[int, ...], payload: bytes, match: str
) -> None:
    """Wrong magic numbers and lengths that disagree with the header are DataErrors naming the file."""
    path = _idx(tmp_path / "x.gz", magic, dims, payload)
    with pytest.raises(DataError, match=match):
        read_idx(path, ndim=3)


def test_idx_loader_wrong_image_count_raises_data_error(tmp_path: Path) -> None:
    """Well-formed idx files of the wrong size (not 60,000 / 10,000) are rejected."""
    raw = tmp_path / "mnist" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split in ("train", "t10k"):
        _idx(raw / f"{split}-images-idx3-ubyte.gz", 0x803, (2, 28, 28), bytes(2 * 784))
        _idx(raw / f"{split}-labels-idx1-ubyte.gz", 0x801, (2,), bytes(2))
    with pytest.raises(DataError, match=r"expected \(60000, 28, 28\)"):
        load_dataset("mnist", seed=0, root=tmp_path)
    assert mnist.SIZES["train"] == 60000


def test_cifar_pack_with_bad_offsets_raises_data_error(tmp_path: Path) -> None:
    """A WebP pack whose offsets do not cut its bytes into images is rejected before decoding."""
    (tmp_path / "cifar10").mkdir()
    buf = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buf, format="WEBP", lossless=True)
    blob = np.frombuffer(buf.getvalue() * 2, dtype=np.uint8)
    np.savez(
        tmp_path / "cifar10" / "cifar10_webp.npz",
        images_webp=blob,
        offsets=np.array([0, 5, len(blob) + 1]),
        n_train=np.array(1),
        labels=np.array([0, 1], dtype=np.uint8),
    )
    with pytest.raises(DataError, match="offsets"):
        load_dataset("cifar10", seed=0, root=tmp_path)


def _one_image_pack(root: Path, image_format: str) -> None:
    """A CIFAR-10 pack of two 32 x 32 images (one train, one test) encoded as `image_format`."""
    (root / "cifar10").mkdir()
    blobs = []
    for shade in (10, 200):
        buf = io.BytesIO()
        Image.new("RGB", (32, 32), (shade, shade, shade)).save(buf, format=image_format, lossless=True)
        blobs.append(buf.getvalue())
    np.savez(
        root / "cifar10" / "cifar10_webp.npz",
        images_webp=np.frombuffer(b"".join(blobs), dtype=np.uint8),
        offsets=np.cumsum([0, *map(len, blobs)]),
        n_train=np.array(1),
        labels=np.array([0, 1], dtype=np.uint8),
    )


def test_cifar_pack_decodes_its_webp_images(tmp_path: Path) -> None:
    """A small WebP pack decodes to its pixels (the decoder told the images' format, not probing)."""
    _one_image_pack(tmp_path, "WEBP")
    split = load_dataset("cifar10", seed=0, root=tmp_path, cache_dir=None)
    train, test = split.train, split.test
    assert train.x.shape == (1, 3, 32, 32) and test.x.shape == (1, 3, 32, 32)
    assert train.x.unique().tolist() == [10] and test.x.unique().tolist() == [200]


def test_cifar_pack_of_other_images_raises_data_error(tmp_path: Path) -> None:
    """A pack whose images are PNG, not WebP, is refused with the image named, not read as something else."""
    _one_image_pack(tmp_path, "PNG")
    with pytest.raises(DataError, match=r"image 0 cannot be decoded"):
        load_dataset("cifar10", seed=0, root=tmp_path, cache_dir=None)


# -- registry and options ---------------------------------------------------------------------


def test_registry_lists_every_dataset() -> None:
    """The names the experiment files use."""
    assert sorted(DATASETS) == [
        "cifar10",
        "cifar100",
        "cinic10",
        "digits",
        "fashion-mnist",
        "mnist",
        "synthetic",
        "tiny-imagenet",
    ]


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("mnist", {"colour": True}, "allowed: none"),
        ("cifar100", {"labels": "medium"}, "fine or coarse"),
        ("digits", {"download": True}, "cannot be downloaded"),
        ("cifar10", {"augment": {"crop": 40}}, "40-pixel crop"),
        ("cifar10", {"augment": {"zoom": 2}}, "unknown fields"),
        ("cifar10", {"normalize": {"mean": [0.5], "std": [0.5]}}, "1 normalisation means"),
        ("cifar10", {"normalize": "sometimes"}, "expected dataset"),
    ],
)
def test_load_dataset_bad_settings_raise_config_error(
    name: str, options: dict[str, object], match: str, cifar10_pickles: tuple[Path, np.ndarray, np.ndarray]
) -> None:
    """Unknown options, impossible augmentations and mismatched normalisations are ConfigErrors."""
    root, _, _ = cifar10_pickles
    with pytest.raises(ConfigError, match=match):
        load_dataset(name, seed=0, root=root, **options)  # type: ignore[arg-type]


def test_digits_default_has_no_transforms_and_stays_float() -> None:
    """digits keeps its float [0, 1] inputs without transforms (the quickstart is unchanged)."""
    split = load_dataset("digits", seed=0)
    assert split.train.train_transform is None and split.test.eval_transform is None
    assert split.train.x.dtype == torch.float32
