"""Batch transforms: preprocessing and augmentation applied to whole batches of tensors.

Datasets keep images as compact uint8 (N x C x H x W) and turn each batch into model input on the
device the batch lives on (the GPU when there is one), never image by image in Python. A
transform is a callable ``(batch, generator) -> batch``; random ones draw only from the generator
they are given (the node's training stream), and ``generator=None`` means "evaluation": no
randomness allowed.

`Augment` describes a training augmentation (random crop with zero, reflect or replicate padding,
horizontal flip, small rotations, in a chosen order) and `pipelines` turns it and a normalisation
into the (train, eval) transforms a `TensorDataset` carries: the augmentation (train only; eval
only centre-crops when the crop is smaller than the image) with ToFloat after its leading crops and
flips (they select pixels, so they run on uint8) and before anything that interpolates, then
Normalize. AutoAugment is not implemented.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from fedmq.fedcore.errors import ConfigError


class BatchTransform(Protocol):
    def __call__(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class Compose:
    steps: tuple[BatchTransform, ...]

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        for step in self.steps:
            x = step(x, generator)
        return x


@dataclass(frozen=True, slots=True)
class ToFloat:
    """uint8 pixels to float32 in [0, 1] (what torchvision's ToTensor does).

    The divisor is a tensor on the batch's device, not a Python number: CUDA divides by a number as a
    product with its reciprocal, one bit off the quotient for some pixels, so the same crop came out
    of a GPU and a CPU a bit apart; a tensor divisor is a true division on both (and the CPU's
    quotients are what they were). A vectorised step makes it once (`divisor`) and passes it to
    `apply`, as it does Normalize's mean and std."""

    scale: float = 255.0

    def divisor(self, device: torch.device) -> torch.Tensor:
        return torch.full((), self.scale, dtype=torch.float32, device=device)

    def apply(self, x: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
        return x if x.is_floating_point() else x.float().div_(divisor)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return self.apply(x, self.divisor(x.device))


@dataclass(frozen=True, slots=True)
class Normalize:
    """Per-channel (x - mean) / std, on N x C x ... batches."""

    mean: Sequence[float]
    std: Sequence[float]

    def __post_init__(self) -> None:
        if len(self.mean) != len(self.std) or not self.mean or any(s <= 0 for s in self.std):
            raise ValueError("Normalize needs one mean and one positive std per channel")

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        shape = (1, len(self.mean)) + (1,) * (x.dim() - 2)
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(shape)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(shape)
        return (x - mean) / std


# -- augmentation -------------------------------------------------------------------------------
# Random steps draw one value per image from the generator, on the generator's device, and move it
# to the batch's device; with generator=None they are the identity (or, for a crop smaller than the
# image, the centre crop), so evaluation is deterministic.

PaddingMode = Literal["zero", "reflect", "replicate"]
STEP_NAMES = ("crop", "flip", "rotation")
_TORCH_PAD = {"zero": "constant", "reflect": "reflect", "replicate": "replicate"}


def _draw(generator: torch.Generator, n: int, device: torch.device) -> torch.Tensor:
    """n uniform values in [0, 1) from `generator`, on `device`."""
    return torch.rand(n, generator=generator, device=generator.device).to(device)


def crop_at(
    x: torch.Tensor, top: torch.Tensor, left: torch.Tensor, size: int, flip: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-image windows: image i's ``size x size`` window at (top[i], left[i]) of an N x C x H x W batch,
    mirrored left-right where `flip[i]`. The flip is the order the window's columns are read in, so a
    crop and the flip after it are one gather (data moved, no arithmetic: bitwise the crop, then
    `x.flip(-1)` where flipped), where the flip alone was two passes over the batch."""
    n, c, _, w = x.shape
    ahead, columns = _columns(size, x.device, flip)
    rows = (top.view(n, 1) + ahead).view(n, 1, size, 1).expand(n, c, size, w)
    x = x.gather(2, rows)
    cols = (left.view(n, 1) + columns).view(n, 1, 1, size).expand(n, c, size, size)
    return x.gather(3, cols)


def _columns(size: int, device: torch.device, flip: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A window's positions 0 .. size - 1, and the order each image reads its columns in: those, or where
    `flip` says, size - 1 .. 0."""
    ahead = torch.arange(size, device=device)
    return ahead, ahead if flip is None else torch.where(flip.view(-1, 1), ahead.flip(0), ahead)


@dataclass(frozen=True)
class CropTables:
    """Where every window of one repeated crop reads, made once (a vectorised round's `_constants`), in the
    coordinates of the batch the crop gathers from (the image's, or with zero padding the padded batch's):
    ``rows[o]``, the rows the window at top o reads. With a reflection or a replication, ``columns[o]`` the
    columns the window at left o reads and ``columns[flipped + o]`` those mirrored (a flipped image's), so
    a step finds its windows with a lookup an axis where working them out took up to seven operators an
    axis (a reflection's arithmetic; on a GPU a kernel each). Otherwise (`shifted`) a window's columns are
    the positions 0 .. size - 1 or their mirror, ``columns[0]`` and ``columns[1]``, shifted by its left:
    an operator fewer than a lookup. The same integers either way, so bitwise the same crop."""

    rows: torch.Tensor
    columns: torch.Tensor
    shifted: bool

    @property
    def flipped(self) -> int:
        """Where the mirrored columns start: after every window position's own."""
        return len(self.columns) // 2


def crop_tables(
    height: int, width: int, size: int, padding: int, mode: PaddingMode, device: torch.device
) -> CropTables:
    """The `CropTables` of a `size` crop of ``height x width`` images padded by `padding` in `mode`."""
    shifted = padding == 0 or mode == "zero"

    def table(n: int) -> torch.Tensor:
        at = torch.arange(n + 2 * padding - size + 1).view(-1, 1) + torch.arange(size)  # padded coordinates
        return at if shifted else _source(at - padding, n, mode)

    columns = torch.arange(size).view(1, -1) if shifted else table(width)
    return CropTables(table(height).to(device), torch.cat([columns, columns.flip(1)]).to(device), shifted)


def _crop_by_tables(
    x: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor | None, tables: CropTables
) -> torch.Tensor:
    n, c, _, w = x.shape
    size = tables.rows.shape[1]
    rows = tables.rows[top].view(n, 1, size, 1).expand(n, c, size, w)
    if tables.shifted:
        ahead, behind = tables.columns
        at = left.view(n, 1) + (ahead if flip is None else torch.where(flip.view(-1, 1), behind, ahead))
    else:
        at = tables.columns[left if flip is None else torch.where(flip, left + tables.flipped, left)]
    cols = at.view(n, 1, 1, size).expand(n, c, size, size)
    return x.gather(2, rows).gather(3, cols)


def padded_crop_at(
    x: torch.Tensor,
    top: torch.Tensor,
    left: torch.Tensor,
    size: int,
    padding: int,
    mode: PaddingMode,
    flip: torch.Tensor | None = None,
    tables: CropTables | None = None,
) -> torch.Tensor:
    """``crop_at(pad(x, padding, mode), top, left, size, flip)``, bitwise, for any dtype: torch's reflection
    and replication padding take floats only, so for those each window's rows and columns are read where
    the padding would have copied them from, without making the padded batch (zeros are padded as
    before: torch pads any dtype with a constant, in fewer operations). So a batch can be cropped while
    it is still uint8 (`pipelines`), moving a quarter of float32's bytes; `top` and `left` are in padded
    coordinates, as `crop_at`'s are. `tables` (`crop_tables`, for this crop and image size): the windows
    looked up rather than worked out."""
    n, c, h, w = x.shape
    if mode == "reflect" and padding >= min(h, w):
        raise ValueError(f"a reflection padding of {padding} needs images larger than {h} x {w}")
    zeros = padding > 0 and mode == "zero"
    if tables is not None:
        return _crop_by_tables(pad(x, padding, mode) if zeros else x, top, left, flip, tables)
    if padding == 0 or zeros:
        return crop_at(pad(x, padding, mode), top, left, size, flip)
    ahead, columns = _columns(size, x.device, flip)
    rows = top.view(n, 1) + (ahead - padding)  # (n, size) in the image's coordinates
    cols = left.view(n, 1) + (columns - padding)
    out = x.gather(2, _source(rows, h, mode).view(n, 1, size, 1).expand(n, c, size, w))
    return out.gather(3, _source(cols, w, mode).view(n, 1, 1, size).expand(n, c, size, size))


def _source(at: torch.Tensor, n: int, mode: PaddingMode) -> torch.Tensor:
    """Where positions `at` of a padded axis (-padding to n + padding - 1, padding < n) read in the image's
    n: mirrored without repeating the edge (reflect: n - 1 - |n - 1 - |at||), or the nearest edge."""
    if mode == "reflect":
        return (n - 1) - ((n - 1) - at.abs()).abs()
    return at.clamp(0, n - 1)


def pad(x: torch.Tensor, padding: int, mode: PaddingMode) -> torch.Tensor:
    """`padding` pixels on each side: zeros, a reflection without repeating the edge, or the edge repeated."""
    if padding == 0:
        return x
    return F.pad(x, (padding,) * 4, mode=_TORCH_PAD[mode], **({"value": 0.0} if mode == "zero" else {}))


def center_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    h, w = x.shape[-2:]
    if (h, w) == (size, size):
        return x
    top, left = round((h - size) / 2), round((w - size) / 2)
    return x[..., top : top + size, left : left + size]


@dataclass(frozen=True, slots=True)
class RandomCrop:
    """torchvision's RandomCrop(size, padding, padding_mode) on a batch: pad, then one random window per image.

    Evaluation (no generator): the centre ``size x size`` crop of the unpadded image (the image
    itself when it is that size).
    """

    size: int
    padding: int = 0
    padding_mode: PaddingMode = "zero"

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        if generator is None:
            return center_crop(x, self.size)
        n, h, w = len(x), x.shape[-2] + 2 * self.padding, x.shape[-1] + 2 * self.padding
        if h < self.size or w < self.size:
            raise ValueError(f"a {self.size}-pixel crop of {h} x {w} padded images")
        top = (_draw(generator, n, x.device) * (h - self.size + 1)).long().clamp_(max=h - self.size)
        left = (_draw(generator, n, x.device) * (w - self.size + 1)).long().clamp_(max=w - self.size)
        return padded_crop_at(x, top, left, self.size, self.padding, self.padding_mode)


@dataclass(frozen=True, slots=True)
class RandomHorizontalFlip:
    """Each image mirrored left-right with probability `p`."""

    p: float = 0.5

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        if generator is None:
            return x
        flip = _draw(generator, len(x), x.device) < self.p
        return torch.where(flip.view(-1, *([1] * (x.dim() - 1))), x.flip(-1), x)


def rotate(x: torch.Tensor, degrees: torch.Tensor, *, mode: str = "nearest") -> torch.Tensor:
    """Each image turned counter-clockwise by degrees[i] about its centre, corners filled with zeros.

    torchvision's RandomRotation conventions (nearest neighbour, no expansion, fill 0), done with
    one affine_grid / grid_sample over the batch.
    """
    n, c, h, w = x.shape
    rad = torch.deg2rad(degrees.to(device=x.device, dtype=torch.float32))
    cos, sin = torch.cos(rad), torch.sin(rad)
    zero = torch.zeros_like(cos)
    # output (x, y) in [-1, 1] (y down) samples the input at R^-1 (x, y), corrected for the aspect ratio
    theta = torch.stack([torch.stack([cos, -sin * h / w, zero], 1), torch.stack([sin * w / h, cos, zero], 1)], 1)
    src = x if x.is_floating_point() else x.float()
    grid = F.affine_grid(theta.to(src.dtype), [n, c, h, w], align_corners=False)
    out = F.grid_sample(src, grid, mode=mode, padding_mode="zeros", align_corners=False)
    return out if x.is_floating_point() else out.round_().to(x.dtype)


@dataclass(frozen=True, slots=True)
class RandomRotation:
    """torchvision's RandomRotation(degrees): a uniform angle in [-degrees, degrees] per image."""

    degrees: float

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        if generator is None or self.degrees == 0:
            return x
        angles = (_draw(generator, len(x), x.device) * 2 - 1) * self.degrees
        return rotate(x, angles)


@dataclass(frozen=True, slots=True, kw_only=True)
class Augment:
    """A training augmentation: which random steps, with what settings, in what order.

    `crop` is the output side (None: the image's own side); `padding` pixels are added on each side
    first (`padding_mode` zero, reflect or replicate); `flip` mirrors half the images; `rotation_deg`
    turns each image by a uniform angle in [-rotation_deg, rotation_deg]. `order` lists the steps
    (crop, flip, rotation) in the order they run; steps that do nothing are skipped.
    """

    crop: int | None = None
    padding: int = 0
    padding_mode: PaddingMode = "zero"
    flip: bool = False
    rotation_deg: float = 0.0
    order: tuple[str, ...] = STEP_NAMES

    def __post_init__(self) -> None:
        def bad(message: str, name: str) -> ConfigError:
            return ConfigError(message, field=f"data.augment.{name}")

        if self.crop is not None and (isinstance(self.crop, bool) or self.crop < 1):
            raise bad(f"must be a positive number of pixels, got {self.crop!r}", "crop")
        if isinstance(self.padding, bool) or self.padding < 0:
            raise bad(f"must be 0 or more pixels, got {self.padding!r}", "padding")
        if self.padding_mode not in _TORCH_PAD:
            raise bad(f"{self.padding_mode!r} is not one of {', '.join(_TORCH_PAD)}", "padding_mode")
        if not 0 <= self.rotation_deg <= 180:
            raise bad(f"must be in [0, 180], got {self.rotation_deg!r}", "rotation_deg")
        if sorted(self.order) != sorted(set(self.order)) or not set(self.order) <= set(STEP_NAMES):
            raise bad(f"lists each of {', '.join(STEP_NAMES)} at most once, got {list(self.order)}", "order")

    def steps(self, height: int, width: int) -> tuple[tuple[BatchTransform, ...], tuple[BatchTransform, ...]]:
        """(training steps, evaluation steps) for images of this size."""
        size = self.crop if self.crop is not None else min(height, width)
        if size > min(height, width):
            raise ConfigError(f"a {size}-pixel crop of {height} x {width} images", field="data.augment.crop")
        if self.crop is None and height != width and self.padding:
            raise ConfigError("non-square images need an explicit crop size", field="data.augment.crop")
        made: dict[str, BatchTransform] = {}
        if self.padding or size != height or size != width:
            made["crop"] = RandomCrop(size, self.padding, self.padding_mode)
        if self.flip:
            made["flip"] = RandomHorizontalFlip()
        if self.rotation_deg:
            made["rotation"] = RandomRotation(self.rotation_deg)
        train = tuple(made[name] for name in self.order if name in made)
        unlisted = sorted(set(made) - set(self.order))
        if unlisted:
            raise ConfigError(f"order leaves out the configured steps {unlisted}", field="data.augment.order")
        evaluation: tuple[BatchTransform, ...] = (RandomCrop(size),) if "crop" in made else ()
        return train, evaluation


def pipelines(
    augment: Augment | None,
    normalize: tuple[Sequence[float], Sequence[float]] | None,
    input_shape: tuple[int, ...],
) -> tuple[BatchTransform, BatchTransform]:
    """(train transform, eval transform): to float in [0, 1], the augmentation (train only), normalisation.

    Evaluation applies only the deterministic part: the centre crop when the crop is smaller than
    the image, and the normalisation. The crops and flips that come first select pixels only, so they
    run on the images' own dtype (uint8: a quarter of float32's bytes) and the conversion to float after
    them gives the same values bit for bit; a rotation interpolates, so the conversion comes before it.
    """
    train: tuple[BatchTransform, ...] = ()
    evaluation: tuple[BatchTransform, ...] = ()
    if augment is not None:
        if len(input_shape) != 3:
            raise ConfigError(f"augmentation needs C x H x W images, got {input_shape}", field="data.augment")
        train, evaluation = augment.steps(input_shape[1], input_shape[2])
    tail: tuple[BatchTransform, ...] = ()
    if normalize is not None:
        mean, std = normalize
        if len(input_shape) < 2 or len(mean) != input_shape[0]:
            raise ConfigError(
                f"{len(mean)} normalisation means for inputs of shape {input_shape}", field="data.normalize"
            )
        tail = (Normalize(tuple(mean), tuple(std)),)
    return Compose((*_selecting_first(train), *tail)), Compose((*_selecting_first(evaluation), *tail))


def _selecting_first(steps: tuple[BatchTransform, ...]) -> tuple[BatchTransform, ...]:
    """`steps` with ToFloat placed after the leading crops and flips (selections of pixels, which commute
    with the conversion) and before anything else (a rotation)."""
    lead = 0
    while lead < len(steps) and isinstance(steps[lead], RandomCrop | RandomHorizontalFlip):
        lead += 1
    return (*steps[:lead], ToFloat(), *steps[lead:])
