"""Datasets as whole tensors in memory, and the registry that loads them by name.

A `TensorDataset` is features plus integer labels; nodes batch it with their own generator, with no
DataLoader workers (they cost more than they save for data this size). Image datasets keep uint8
N x C x H x W images (CIFAR-10's training set is 150 MB) and turn each batch into model input with
their transforms, on the batch's device.

`load_dataset(name, ...)` knows: digits and synthetic (made in memory), mnist, fashion-mnist,
cifar10, cifar100, cinic10 and tiny-imagenet (read from a data root by `fedcore.datasets`, decoded
once into a cache folder), each with its standard augmentation and normalisation constants.
`dataset_schema(name, ...)` says what its examples look like without loading it, and
`load_local(path, name, ...)` reads one node's own data in its place (`fedcore.datasets.local`).

A dataset of one's own (`user_dataset`): ``data.dataset: my_package.data:load`` or a ``fedmq.datasets``
entry point, a function ``load(*, seed, **data.options)`` (taking ``root`` and ``cache_dir`` too when
it names them) that returns a `Split` of `TensorDataset` s, as the built-in loaders do. What it
returns is checked (`check_split`) before anything uses it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from fedmq.fedcore import plugins
from fedmq.fedcore.datasets.cache import Arrays
from fedmq.fedcore.datasets.cifar import load_cifar
from fedmq.fedcore.datasets.digits import digits_arrays
from fedmq.fedcore.datasets.download import TORCHVISION, fetch
from fedmq.fedcore.datasets.folders import load_cinic10, load_tiny_imagenet
from fedmq.fedcore.datasets.local import Schema, read_local
from fedmq.fedcore.datasets.mnist import load_idx_dataset
from fedmq.fedcore.errors import ConfigError, DataError
from fedmq.fedcore.seeding import stream
from fedmq.fedcore.transforms import Augment, BatchTransform, pipelines


@dataclass(frozen=True, slots=True)
class TensorDataset:
    """Inputs (float features, or uint8 images N x C x H x W kept compact) and integer labels.

    Model input comes from `train_batch` and `eval_batch`, which run the transforms on the batch's
    device: `train_transform` (augmentation then normalisation, drawing from the node's generator)
    and `eval_transform` (normalisation only). Without transforms a batch is `x` as stored.
    """

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    train_transform: BatchTransform | None = None
    eval_transform: BatchTransform | None = None

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"{len(self.x)} inputs but {len(self.y)} labels")

    def train_batch(self, idx: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[idx]
        return (self.train_transform(x, generator) if self.train_transform else x), self.y[idx]

    def eval_batch(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[start:stop]
        return (self.eval_transform(x, None) if self.eval_transform else x), self.y[start:stop]

    def __len__(self) -> int:
        return len(self.y)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def subset(self, indices: np.ndarray) -> TensorDataset:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return replace(self, x=self.x[idx], y=self.y[idx])

    def label_histogram(self) -> list[int]:
        return torch.bincount(self.y, minlength=self.num_classes).tolist()

    def to(self, device: torch.device | str) -> TensorDataset:
        return replace(self, x=self.x.to(device), y=self.y.to(device))


@dataclass(frozen=True, slots=True)
class Split:
    train: TensorDataset
    test: TensorDataset
    val: TensorDataset | None = None
    """Held out of the training set (never partitioned), for choices that must not see the test set."""
    node_parts: tuple[np.ndarray, ...] | None = None
    """Each node's indices into `train`, in node order, where the split made the nodes' parts itself
    (`held_out_by_node`: the test set is cut from them); None: the experiment's partition makes them."""


def hold_out_validation(split: Split, fraction: float, *, seed: int) -> Split:
    """Move a stratified `fraction` of the training set into `split.val`, keeping the rest in order."""
    if not 0 < fraction < 1:
        raise ConfigError(f"{fraction} is not in (0, 1)", field="data.validation_fraction")
    labels = split.train.y.numpy()
    rng = stream(seed, "validation-split")
    held: list[np.ndarray] = []
    for label in np.unique(labels):
        idx = np.flatnonzero(labels == label)
        held.append(rng.permutation(idx)[: round(len(idx) * fraction)])
    val = np.sort(np.concatenate(held))
    keep = np.setdiff1d(np.arange(len(labels)), val)
    if len(val) == 0 or len(keep) == 0:
        raise ConfigError(f"{fraction} of {len(labels)} samples leaves an empty part", field="data.validation_fraction")
    return replace(split, train=split.train.subset(keep), val=split.train.subset(val))


POOLED_EVALUATE_ON = ("train_part", "held_out_part")


def pooled_indices(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training part, held-out part) of `n` pooled samples, as the FedVLS authors cut them:
    ``np.random.seed(seed)`` then sklearn's ``train_test_split(train_size=1 - test_fraction,
    shuffle=True)``, whose `ShuffleSplit` draws one permutation from NumPy's global RandomState and
    takes its first ``n - floor((1 - test_fraction) n)`` entries as the held-out part and the rest,
    in permuted order, as the training part. A fresh ``RandomState(seed)`` gives the same stream."""
    if not 0 < test_fraction < 1:
        raise ConfigError(f"{test_fraction} is not in (0, 1)", field="data.split.test_fraction")
    n_train = math.floor((1 - test_fraction) * n)
    n_test = n - n_train
    if n_train == 0 or n_test == 0:
        raise ConfigError(f"{test_fraction} of {n} samples leaves an empty part", field="data.split.test_fraction")
    permutation = np.random.RandomState(seed).permutation(n)
    return permutation[n_test : n_test + n_train], permutation[:n_test]


def pooled_resplit(split: Split, *, test_fraction: float, seed: int, evaluate_on: str) -> Split:
    """The FedVLS authors' pipeline (``system/data/generate_mnist.py``): the training set and then the
    test set pooled, re-split by `pooled_indices`; the nodes are partitioned from the training part.

    `evaluate_on` says which part is evaluated: "train_part" is what the authors' code does (their
    ``main.py`` unpacks ``generate_mnist``'s returned loaders in swapped order, so the loader they
    evaluate is the training part, the union of the nodes' data), "held_out_part" what their paper
    describes. The parts keep the split's transforms. Apply it before holding out a validation set."""
    if evaluate_on not in POOLED_EVALUATE_ON:
        raise ConfigError(
            f"{evaluate_on!r} is not one of {', '.join(POOLED_EVALUATE_ON)}", field="data.split.evaluate_on"
        )
    pooled = pooled_sets(split)
    train_idx, held_idx = pooled_indices(len(pooled), test_fraction, seed)
    train = pooled.subset(train_idx)
    return Split(train, train if evaluate_on == "train_part" else pooled.subset(held_idx))


def pooled_sets(split: Split) -> TensorDataset:
    """The training set and then the test set as one, with the training set's transforms (the papers'
    re-splits start from it). Made before a validation set is held out."""
    if split.val is not None:
        raise ConfigError("a pooled re-split is made before a validation set is held out", field="data.split")
    a, b = split.train, split.test
    if a.input_shape != b.input_shape or a.num_classes != b.num_classes or a.x.dtype != b.x.dtype:
        raise ConfigError("the training and test sets differ in shape, classes or type: they cannot be pooled")
    return replace(a, x=torch.cat([a.x, b.x]), y=torch.cat([a.y, b.y]))


def held_out_by_node(data: TensorDataset, parts: Sequence[np.ndarray], *, test_fraction: float, seed: int) -> Split:
    """PFLlib's evaluation convention (FedSA's Table 1): each node's part of `data` cut in two as PFLlib
    cuts a client's data, sklearn's ``train_test_split(train_size=1 - test_fraction, shuffle=True)``:
    the part shuffled, its first ``n - floor((1 - test_fraction) n)`` samples held out and the rest, in
    shuffled order, trained on. The test set is the held-out parts together, in node order, so that its
    accuracy is PFLlib's: each node's held-out accuracy pooled by its number of samples, on test data of
    each node's own label distribution. Each node's shuffle is drawn from a stream of its own
    (`fedcore.seeding.stream(seed, "held-out", i)`): the proportions are PFLlib's, the draws fedmq's
    (PFLlib's are NumPy's unseeded global ones). Returns the split, its `node_parts` the nodes' training
    parts as indices into its `train`."""
    if not 0 < test_fraction < 1:
        raise ConfigError(f"{test_fraction} is not in (0, 1)", field="data.split.test_fraction")
    kept: list[np.ndarray] = []
    held: list[np.ndarray] = []
    for i, part in enumerate(parts):
        n_train = math.floor((1 - test_fraction) * len(part))
        if n_train == 0:
            least = next(n for n in range(2, 10**6) if math.floor((1 - test_fraction) * n) > 0)
            raise ConfigError(
                f"node {i}'s part of {len(part)} sample(s) leaves it nothing to train on once"
                f" {test_fraction} is held out; raise partition.min_samples to {least} or more",
                field="data.split.test_fraction",
            )
        shuffled = stream(seed, "held-out", i).permutation(np.asarray(part))
        held.append(shuffled[: len(part) - n_train])
        kept.append(shuffled[len(part) - n_train :])
    ends = np.cumsum([len(k) for k in kept])
    node_parts = tuple(np.arange(end - len(k), end) for k, end in zip(kept, ends, strict=True))
    return Split(data.subset(np.concatenate(kept)), data.subset(np.concatenate(held)), node_parts=node_parts)


def _stratified_split(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = stream(seed, "test-split")
    test_idx: list[np.ndarray] = []
    for label in np.unique(y):
        idx = np.flatnonzero(y == label)
        rng.shuffle(idx)
        test_idx.append(idx[: round(len(idx) * test_fraction)])
    test = np.sort(np.concatenate(test_idx))
    train = np.setdiff1d(np.arange(len(y)), test)
    return train, test


def load_digits(*, seed: int, test_fraction: float = 0.25) -> Split:
    """scikit-learn's 8x8 digits (1,797 images, ships with the package, works offline), as 1x8x8 in [0, 1]."""
    images, target = digits_arrays()  # scikit-learn's file, read without importing scikit-learn
    x = (images.astype(np.float32) / 16.0)[:, None, :, :]
    y = target.astype(np.int64)
    train, test = _stratified_split(x, y, test_fraction, seed)
    return Split(
        TensorDataset(torch.from_numpy(x[train]), torch.from_numpy(y[train]), 10),
        TensorDataset(torch.from_numpy(x[test]), torch.from_numpy(y[test]), 10),
    )


def load_synthetic(
    *,
    seed: int,
    num_classes: int = 10,
    features: int = 32,
    train_size: int = 2000,
    test_size: int = 500,
    noise: float = 1.0,
) -> Split:
    """Clearly synthetic data for tests: one Gaussian cluster per class around random centres."""
    rng = stream(seed, "synthetic-data")
    centres = rng.normal(0.0, 2.0, size=(num_classes, features)).astype(np.float32)

    def draw(n: int) -> TensorDataset:
        y = rng.integers(0, num_classes, size=n)
        x = centres[y] + rng.normal(0.0, noise, size=(n, features)).astype(np.float32)
        return TensorDataset(torch.from_numpy(x), torch.from_numpy(y.astype(np.int64)), num_classes)

    return Split(draw(train_size), draw(test_size))


def _split(arrays: Arrays, num_classes: int, *, y: str = "y", train: Sequence[str] = ("train",)) -> Split:
    def part(x: np.ndarray, labels: np.ndarray) -> TensorDataset:
        # views of read-only buffers are copied (torch tensors are writable); cached arrays are
        # copy-on-write memory maps and are not
        x, labels = (a if a.flags.writeable else a.copy() for a in (x, labels))
        return TensorDataset(torch.from_numpy(x), torch.from_numpy(labels), num_classes)

    if len(train) == 1:
        train_set = part(arrays[f"{train[0]}_x"], arrays[f"{train[0]}_{y}"])
    else:
        train_set = part(
            np.concatenate([arrays[f"{s}_x"] for s in train]), np.concatenate([arrays[f"{s}_{y}"] for s in train])
        )
    return Split(train_set, part(arrays["test_x"], arrays[f"test_{y}"]))


def load_mnist(*, root: Path | None, cache_dir: Path | None) -> Split:
    """MNIST: 60,000 / 10,000 images 1 x 28 x 28 uint8, 10 classes, from the idx files."""
    return _split(load_idx_dataset("mnist", root, cache_dir), 10)


def load_fashion_mnist(*, root: Path | None, cache_dir: Path | None) -> Split:
    """Fashion-MNIST: 60,000 / 10,000 images 1 x 28 x 28 uint8, 10 classes, from the idx files."""
    return _split(load_idx_dataset("fashion-mnist", root, cache_dir), 10)


def load_cifar10(*, root: Path | None, cache_dir: Path | None) -> Split:
    """CIFAR-10: 50,000 / 10,000 images 3 x 32 x 32 uint8, 10 classes (WebP pack or python pickles)."""
    return _split(load_cifar("cifar10", root, cache_dir), 10)


def _cifar100_classes(labels: str) -> int:
    if labels not in ("fine", "coarse"):
        raise ConfigError(f"labels must be fine or coarse, got {labels!r}", field="data.options.labels")
    return 100 if labels == "fine" else 20


def load_cifar100(*, root: Path | None, cache_dir: Path | None, labels: str = "fine") -> Split:
    """CIFAR-100: 50,000 / 10,000 images 3 x 32 x 32 uint8; `labels` fine (100 classes) or coarse (20)."""
    _cifar100_classes(labels)
    arrays = load_cifar("cifar100", root, cache_dir)
    return _split(arrays, 100, y="y") if labels == "fine" else _split(arrays, 20, y="coarse_y")


def load_cinic(*, root: Path | None, cache_dir: Path | None, include_valid: bool = False) -> Split:
    """CINIC-10: 90,000 training (180,000 with `include_valid`) / 90,000 test images 3 x 32 x 32, 10 classes."""
    arrays = load_cinic10(root, cache_dir)
    return _split(arrays, 10, train=("train", "valid") if include_valid else ("train",))


def load_tiny(*, root: Path | None, cache_dir: Path | None) -> Split:
    """Tiny-ImageNet: 100,000 training / 10,000 validation (as test) images 3 x 64 x 64, 200 classes."""
    return _split(load_tiny_imagenet(root, cache_dir), 200)


@dataclass(frozen=True, slots=True, kw_only=True)
class DatasetSpec:
    """A dataset by name: its loader and its standard preprocessing."""

    load: Callable[..., Split]
    schema: Callable[..., Schema]
    """What `load` would return, from its arguments (defaults applied) without loading anything."""
    files: bool = True
    """read from the data root (the loader takes root and cache_dir), or made in memory (it takes seed)"""
    mean: tuple[float, ...] | None = None
    """per-channel training-set mean of pixels in [0, 1] (`normalize: dataset`); None: not normalised"""
    std: tuple[float, ...] | None = None
    augment: Augment | None = None
    """the standard training augmentation (`augment: default`)"""


_CIFAR_AUGMENT = Augment(crop=32, padding=4, flip=True)


def _images(channels: int, side: int, classes: int) -> Callable[..., Schema]:
    return lambda **_: Schema((channels, side, side), classes, pixels=True)


def _synthetic_schema(*, num_classes: int, features: int, **_: object) -> Schema:
    return Schema((features,), num_classes, pixels=False)


def _cifar100_schema(*, labels: str, **_: object) -> Schema:
    return Schema((3, 32, 32), _cifar100_classes(labels), pixels=True)


DATASETS: dict[str, DatasetSpec] = {
    "digits": DatasetSpec(load=load_digits, schema=lambda **_: Schema((1, 8, 8), 10, pixels=False), files=False),
    "synthetic": DatasetSpec(load=load_synthetic, schema=_synthetic_schema, files=False),
    "mnist": DatasetSpec(load=load_mnist, schema=_images(1, 28, 10), mean=(0.1307,), std=(0.3081,)),
    "fashion-mnist": DatasetSpec(load=load_fashion_mnist, schema=_images(1, 28, 10), mean=(0.2860,), std=(0.3530,)),
    "cifar10": DatasetSpec(
        load=load_cifar10,
        schema=_images(3, 32, 10),
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616),
        augment=_CIFAR_AUGMENT,
    ),
    "cifar100": DatasetSpec(
        load=load_cifar100,
        schema=_cifar100_schema,
        mean=(0.5071, 0.4865, 0.4409),
        std=(0.2673, 0.2564, 0.2762),
        augment=_CIFAR_AUGMENT,
    ),
    "cinic10": DatasetSpec(
        load=load_cinic,
        schema=_images(3, 32, 10),
        mean=(0.4789, 0.4723, 0.4305),
        std=(0.2421, 0.2383, 0.2587),
        augment=_CIFAR_AUGMENT,
    ),
    "tiny-imagenet": DatasetSpec(
        load=load_tiny,
        schema=_images(3, 64, 200),
        mean=(0.4802, 0.4481, 0.3975),
        std=(0.2770, 0.2691, 0.2821),
        augment=Augment(crop=64, padding=4, flip=True),
    ),
}

NORMALIZATIONS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}

AugmentChoice = Augment | Mapping[str, object] | str | None
NormalizeChoice = Mapping[str, Sequence[float]] | tuple[Sequence[float], Sequence[float]] | str | None


def resolve_augment(choice: AugmentChoice, spec: DatasetSpec) -> Augment | None:
    """``default`` (the dataset's standard one), ``none``, an `Augment`, or a mapping of its fields."""
    if isinstance(choice, Augment) or choice is None:
        return choice
    if choice == "default":
        return spec.augment
    if choice == "none":
        return None
    if isinstance(choice, Mapping):
        known = {f.name for f in Augment.__dataclass_fields__.values()}
        unknown = sorted(set(choice) - known)
        if unknown:
            raise ConfigError(f"unknown fields {unknown}; allowed: {sorted(known)}", field="data.augment")
        values = dict(choice)
        if "order" in values:
            values["order"] = tuple(values["order"])  # type: ignore[arg-type]
        return Augment(**values)  # type: ignore[arg-type]
    raise ConfigError(f"expected default, none or a mapping, got {choice!r}", field="data.augment")


def resolve_normalize(
    choice: NormalizeChoice, spec: DatasetSpec, channels: int
) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """``dataset`` (its own constants, none for digits and synthetic), ``half``, ``imagenet``, ``none``, or mean/std."""
    if choice is None or choice == "none":
        return None
    if choice == "dataset":
        return (spec.mean, spec.std) if spec.mean is not None and spec.std is not None else None
    if choice == "half":
        return (0.5,) * channels, (0.5,) * channels
    if isinstance(choice, str) and choice in NORMALIZATIONS:
        return NORMALIZATIONS[choice]
    if isinstance(choice, Mapping) and set(choice) == {"mean", "std"}:
        mean, std = tuple(map(float, choice["mean"])), tuple(map(float, choice["std"]))
    elif isinstance(choice, tuple) and len(choice) == 2:
        mean, std = tuple(map(float, choice[0])), tuple(map(float, choice[1]))
    else:
        raise ConfigError(
            f"expected dataset, half, imagenet, none or {{mean: [...], std: [...]}}, got {choice!r}",
            field="data.normalize",
        )
    if len(mean) != len(std) or not mean or min(std) <= 0:
        raise ConfigError("needs one mean and one positive std per channel", field="data.normalize")
    return mean, std


def _pipelines(
    data: TensorDataset, augment: Augment | None, normalize: tuple[Sequence[float], ...] | None
) -> tuple[BatchTransform, BatchTransform] | None:
    """(train, eval) transforms for data like `data`; None for float features with neither."""
    if augment is None and normalize is None and data.x.is_floating_point():
        return None
    return pipelines(augment, normalize, data.input_shape)  # type: ignore[arg-type]


def _channels(data: TensorDataset) -> int:
    return data.input_shape[0] if data.x.dim() == 4 else 1


def with_transforms(split: Split, augment: Augment | None, normalize: tuple[Sequence[float], ...] | None) -> Split:
    """The split with its train and eval transforms; float features with neither are left as they are."""
    made = _pipelines(split.train, augment, normalize)
    if made is None:
        return split
    train_t, eval_t = made
    return Split(
        replace(split.train, train_transform=train_t, eval_transform=eval_t),
        replace(split.test, train_transform=train_t, eval_transform=eval_t),
    )


def _bind(
    name: str, loader: Callable[..., Split], fixed: Mapping[str, object], options: dict[str, object]
) -> inspect.BoundArguments:
    try:
        return inspect.signature(loader).bind(**fixed, **options)
    except TypeError as exc:
        allowed = [p for p in inspect.signature(loader).parameters if p not in fixed]
        raise ConfigError(
            f"bad options for dataset {name!r} ({exc}); allowed: {', '.join(allowed) or 'none'}", field="data.options"
        ) from None


def _call(name: str, loader: Callable[..., Split], fixed: Mapping[str, object], options: dict[str, object]) -> Split:
    _bind(name, loader, fixed, options)
    return loader(**fixed, **options)


def _spec(name: str) -> DatasetSpec:
    return DATASETS[name] if name in DATASETS else user_dataset(name)


_USER: dict[str, DatasetSpec] = plugins.cache()
"""The user's datasets this process has resolved, by name."""


def user_dataset(name: str) -> DatasetSpec:
    """A user's dataset `name` (a ``fedmq.datasets`` entry point or ``module:function``) as a DatasetSpec:
    its loader, checked on every call; its schema read from a load (seed 0); no normalisation constants
    and no standard augmentation (data.normalize and data.augment may give them)."""
    if name in _USER:
        return _USER[name]
    found = plugins.resolve(name, "dataset", field="data.dataset", default_attr=None, builtins=list(DATASETS))
    loader = found.value
    if not callable(loader):
        raise ConfigError(
            f"{found.origin} is a {type(loader).__name__}, not a function returning fedmq.fedcore.data.Split",
            field="data.dataset",
        )
    params = inspect.signature(loader).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "seed" not in params and not takes_any:
        raise ConfigError(f"{found.origin}: the loader must take a keyword argument seed", field="data.dataset")
    files = "root" in params and "cache_dir" in params

    def load(**kwargs: object) -> Split:
        try:
            split = loader(**kwargs)
        except (ConfigError, DataError):
            raise
        except Exception as exc:  # the user's code: say where, without a traceback
            message = f"{found.origin}: the loader raised {type(exc).__name__}: {exc}"
            raise ConfigError(message[:800], field="data.dataset") from None
        return check_split(split, found.origin)

    spec = DatasetSpec(load=load, schema=lambda **kwargs: schema_of_split(load(**kwargs)), files=False)
    _USER[name] = spec
    _USER_FILES[name] = files
    return spec


_USER_FILES: dict[str, bool] = plugins.cache()
"""Whether a user's loader takes root and cache_dir (besides seed)."""


def schema_of_split(split: Split) -> Schema:
    """The Schema of a checked split: its input shape, classes, and whether its inputs are uint8 images."""
    return Schema(split.train.input_shape, split.train.num_classes, pixels=split.train.x.dtype == torch.uint8)


def check_split(split: object, origin: str) -> Split:
    """`split` if it is what a loader must return (as the built-in ones do), else a ConfigError saying
    what is wrong: a Split of two TensorDatasets, non-empty, float32 features or uint8 images N x C x H x W,
    int64 labels in [0, num_classes), train and test alike."""

    def fail(problem: str) -> ConfigError:
        return ConfigError(
            f"{origin} returned {problem}; return fedmq.fedcore.data.Split(train=TensorDataset(x, y, num_classes),"
            " test=TensorDataset(...)) with x float32 (N x ...) or uint8 images (N x C x H x W) and y int64 labels"
            " 0..num_classes-1 (docs/plugins.md)",
            field="data.dataset",
        )

    if not isinstance(split, Split):
        raise fail(f"a {type(split).__name__}, not a Split")
    for part in ("train", "test"):
        data = getattr(split, part)
        if not isinstance(data, TensorDataset):
            raise fail(f"a Split whose {part} is a {type(data).__name__}, not a TensorDataset")
        x, y = data.x, data.y
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            raise fail(f"{part} inputs or labels that are not tensors")
        if len(y) == 0:
            raise fail(f"an empty {part} set")
        if x.dtype not in (torch.float32, torch.uint8) or (x.dtype == torch.uint8 and x.dim() != 4):
            raise fail(f"{part} inputs of dtype {x.dtype} and shape {tuple(x.shape)}")
        if y.dtype != torch.int64 or y.dim() != 1:
            raise fail(f"{part} labels of dtype {y.dtype} and shape {tuple(y.shape)}")
        if not isinstance(data.num_classes, int) or data.num_classes < 2:
            raise fail(f"{part} num_classes {data.num_classes!r} (at least 2)")
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= data.num_classes:
            raise fail(f"{part} labels {low}..{high} outside 0..{data.num_classes - 1}")
    if split.train.input_shape != split.test.input_shape or split.train.x.dtype != split.test.x.dtype:
        raise fail(
            f"train inputs {tuple(split.train.input_shape)} {split.train.x.dtype} but test inputs"
            f" {tuple(split.test.input_shape)} {split.test.x.dtype}"
        )
    if split.train.num_classes != split.test.num_classes:
        raise fail(f"{split.train.num_classes} classes in train but {split.test.num_classes} in test")
    return split


def dataset_schema(name: str, **options: object) -> Schema:
    """The input shape, classes and kind of dataset `name`'s examples under loader `options`, without
    reading any file (what a node on its own data builds its model from)."""
    spec = _spec(name)
    fixed: dict[str, object] = {"root": None, "cache_dir": None} if spec.files else {"seed": 0}
    if name in _USER_FILES:  # a user's loader: load it and see
        return spec.schema(**_user_fixed(name, 0, None, None), **options)
    bound = _bind(name, spec.load, fixed, dict(options))
    bound.apply_defaults()
    return spec.schema(**bound.arguments)


def _user_fixed(name: str, seed: int, root: str | Path | None, cache_dir: str | Path | None) -> dict[str, object]:
    """What fedmq passes a user's loader besides data.options: seed, and root and cache_dir if it takes them."""
    fixed: dict[str, object] = {"seed": seed}
    if _USER_FILES[name]:
        fixed["root"] = Path(root).expanduser() if root is not None else None
        fixed["cache_dir"] = Path(cache_dir).expanduser() if cache_dir is not None else None
    return fixed


def load_local(
    path: str | Path,
    name: str,
    *,
    augment: AugmentChoice = "default",
    normalize: NormalizeChoice = "dataset",
    **options: object,
) -> TensorDataset:
    """One node's own examples (an .npz of x and y, or a folder of class folders: `fedcore.datasets.local`)
    in place of its shard of dataset `name`, checked against `name`'s schema, with the transforms
    `load_dataset` would give it. Reads only `path`. A malformed file raises `DataError`."""
    spec = _spec(name)
    schema = dataset_schema(name, **options)
    aug = resolve_augment(augment, spec)
    x, y = read_local(Path(path).expanduser(), schema, name)
    data = TensorDataset(torch.from_numpy(x), torch.from_numpy(y), schema.num_classes)
    made = _pipelines(data, aug, resolve_normalize(normalize, spec, _channels(data)))
    if made is None:
        return data
    return replace(data, train_transform=made[0], eval_transform=made[1])


def load_dataset(
    name: str,
    *,
    seed: int,
    root: str | Path | None = None,
    cache_dir: str | Path | None = None,
    download: bool = False,
    augment: AugmentChoice = "default",
    normalize: NormalizeChoice = "dataset",
    **options: object,
) -> Split:
    """The dataset `name` with its transforms.

    `root` is the folder holding the datasets' files (``ROOT/mnist/...``, ``ROOT/cifar10/...``);
    `cache_dir` keeps decoded arrays (None: decode every time); `download` fetches missing files
    with torchvision where it imports. `augment` and `normalize` choose the preprocessing
    (see `resolve_augment` and `resolve_normalize`); `options` go to the loader. A missing or
    malformed dataset raises `DataError`; a bad setting `ConfigError`.
    """
    spec = _spec(name)
    aug = resolve_augment(augment, spec)
    if download and name not in TORCHVISION:
        raise ConfigError(f"{name!r} cannot be downloaded; only {', '.join(TORCHVISION)}", field="data.download")
    if name in _USER_FILES:
        split = spec.load(**_user_fixed(name, seed, root, cache_dir), **options)
    elif not spec.files:
        split = _call(name, spec.load, {"seed": seed}, dict(options))
    else:
        paths = {
            "root": Path(root).expanduser() if root is not None else None,
            "cache_dir": Path(cache_dir).expanduser() if cache_dir is not None else None,
        }
        try:
            split = _call(name, spec.load, paths, dict(options))
        except DataError:
            if not download:
                raise
            fetch(name, paths["root"])
            split = _call(name, spec.load, paths, dict(options))
    return with_transforms(split, aug, resolve_normalize(normalize, spec, _channels(split.train)))
