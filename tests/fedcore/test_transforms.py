"""Batch transforms: crops, flips and rotations on whole batches, drawn only from the given generator."""

from __future__ import annotations

import pytest
import torch

from fedmq.experiments.bench.step_cost import StepCounter
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.transforms import (
    Augment,
    Compose,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    RandomRotation,
    ToFloat,
    center_crop,
    crop_at,
    crop_tables,
    pad,
    padded_crop_at,
    pipelines,
    rotate,
)

CIFAR_LIKE = Augment(crop=32, padding=4, flip=True, rotation_deg=15)


def images(n: int = 16, size: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, size, size), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_crop_at_with_zero_padding_equals_hand_computed_shift() -> None:
    """A 4 x 4 crop at (0, 2) of a 1-pixel zero-padded 4 x 4 image: shifted up-left, zeros on top."""
    x = torch.arange(1, 17, dtype=torch.float32).view(1, 1, 4, 4)
    out = crop_at(pad(x, 1, "zero"), torch.tensor([0]), torch.tensor([2]), 4)
    expected = torch.tensor([[0, 0, 0, 0], [2, 3, 4, 0], [6, 7, 8, 0], [10, 11, 12, 0]], dtype=torch.float32)
    assert torch.equal(out[0, 0], expected)


def test_crop_at_with_reflect_padding_equals_hand_computed_shift() -> None:
    """Reflect padding mirrors without repeating the edge (torchvision's padding_mode='reflect')."""
    x = torch.arange(1, 17, dtype=torch.float32).view(1, 1, 4, 4)
    out = crop_at(pad(x, 1, "reflect"), torch.tensor([2]), torch.tensor([0]), 4)
    expected = torch.tensor([[6, 5, 6, 7], [10, 9, 10, 11], [14, 13, 14, 15], [10, 9, 10, 11]], dtype=torch.float32)
    assert torch.equal(out[0, 0], expected)


@pytest.mark.parametrize("mode", ["zero", "reflect", "replicate"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_padded_crop_at_is_bitwise_the_crop_of_the_padded_batch(mode: str, dtype: torch.dtype) -> None:
    """Every window position, the corners included, on non-square images with negative floats (the
    zeros written by the padding stay +0.0): what `crop_at(pad(...))` gives, without the padded batch.
    uint8 is checked against the float padding of the same pixels (torch pads uint8 with zeros only)."""
    h, w, p, size = 7, 9, 3, 6
    n = (h + 2 * p - size + 1) * (w + 2 * p - size + 1)
    top, left = torch.meshgrid(torch.arange(h + 2 * p - size + 1), torch.arange(w + 2 * p - size + 1), indexing="ij")
    top, left = top.reshape(-1), left.reshape(-1)
    x = torch.randint(0, 256, (n, 2, h, w), generator=gen(1)).to(dtype)
    if dtype.is_floating_point:
        x = x - 128  # negative values: a product with a zero mask would give -0.0 where the padding gives +0.0
    got = padded_crop_at(x, top, left, size, p, mode)  # type: ignore[arg-type]
    expected = crop_at(pad(x.float(), p, mode), top, left, size)  # type: ignore[arg-type]
    assert got.dtype == dtype
    assert torch.equal(got.float(), expected)
    if dtype.is_floating_point:
        assert torch.equal(torch.signbit(got), torch.signbit(expected))  # bitwise: the zeros' signs too


@pytest.mark.parametrize("mode", ["zero", "reflect", "replicate"])
@pytest.mark.parametrize("padding", [0, 3])
@pytest.mark.parametrize("tables", [False, True], ids=["worked-out", "looked-up"])
def test_a_crop_given_flips_is_bitwise_the_crop_then_the_flip(mode: str, padding: int, tables: bool) -> None:
    """A vectorised step crops and flips in one gather (`flip`; `tables`: every window's rows and columns
    made once, `crop_tables`, then looked up): each image the crop's window, mirrored exactly where its
    flip says, at every window position; uint8 and float alike."""
    h, w, p, size = 7, 9, padding, 6
    n = (h + 2 * p - size + 1) * (w + 2 * p - size + 1)
    top, left = torch.meshgrid(torch.arange(h + 2 * p - size + 1), torch.arange(w + 2 * p - size + 1), indexing="ij")
    top, left = top.reshape(-1), left.reshape(-1)
    flip = torch.rand(n, generator=gen(2)) < 0.5
    assert 0 < int(flip.sum()) < n
    made = crop_tables(h, w, size, p, mode, torch.device("cpu")) if tables else None  # type: ignore[arg-type]
    for x in (torch.randint(0, 256, (n, 2, h, w), generator=gen(1), dtype=torch.uint8), torch.randn(n, 2, h, w)):
        cropped = crop_at(pad(x.double(), p, mode), top, left, size).to(x.dtype)  # type: ignore[arg-type]
        expected = torch.where(flip.view(-1, 1, 1, 1), cropped.flip(-1), cropped)
        assert torch.equal(padded_crop_at(x, top, left, size, p, mode, flip, made), expected)  # type: ignore[arg-type]
        if made is not None:  # unflipped too
            assert torch.equal(padded_crop_at(x, top, left, size, p, mode, None, made), cropped)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["zero", "reflect", "replicate"])
def test_a_crop_looked_up_in_its_tables_takes_a_few_operators_whatever_the_padding(mode: str) -> None:
    """With `crop_tables`, a crop and its flip are a lookup an axis, the flip's offset and two gathers (zero
    padding: the pad, the rows' lookup, the columns shifted): 6 operators, where working out a reflection's
    windows took 15."""
    x = torch.randint(0, 256, (8, 3, 32, 32), generator=gen(1), dtype=torch.uint8)
    top, left = torch.randint(0, 9, (8,), generator=gen(2)), torch.randint(0, 9, (8,), generator=gen(3))
    flip = torch.rand(8, generator=gen(4)) < 0.5
    made = crop_tables(32, 32, 32, 4, mode, torch.device("cpu"))  # type: ignore[arg-type]
    with StepCounter() as looked_up:
        padded_crop_at(x, top, left, 32, 4, mode, flip, made)  # type: ignore[arg-type]
    with StepCounter() as worked_out:
        padded_crop_at(x, top, left, 32, 4, mode, flip)  # type: ignore[arg-type]
    assert looked_up.ops <= 6 < worked_out.ops


def test_padded_crop_at_refuses_a_reflection_wider_than_the_image() -> None:
    with pytest.raises(ValueError, match="reflection padding of 4"):
        padded_crop_at(images(2, 4), torch.tensor([0, 1]), torch.tensor([0, 1]), 4, 4, "reflect")


@pytest.mark.parametrize("mode", ["zero", "reflect", "replicate"])
def test_pipeline_crops_and_flips_the_pixels_before_they_become_floats_with_the_same_result(mode: str) -> None:
    """The train transform converts to float after its crop and flip (selections, which commute with the
    conversion), bit for bit what converting first gives, drawing the same values from the generator;
    a rotation, which interpolates, still gets floats."""
    augment = Augment(crop=28, padding=4, padding_mode=mode, flip=True, rotation_deg=10)  # type: ignore[arg-type]
    normalize = ((0.4, 0.5, 0.6), (0.2, 0.25, 0.3))
    train, evaluation = pipelines(augment, normalize, (3, 32, 32))
    assert isinstance(train, Compose) and isinstance(evaluation, Compose)
    kinds = [type(step) for step in train.steps]
    assert kinds == [RandomCrop, RandomHorizontalFlip, ToFloat, RandomRotation, Normalize]
    assert [type(step) for step in evaluation.steps] == [RandomCrop, ToFloat, Normalize]  # the centre crop
    float_first = Compose((ToFloat(), *[s for s in train.steps if not isinstance(s, ToFloat)]))
    x = images(32)
    g1, g2 = gen(3), gen(3)
    assert torch.equal(train(x, g1), float_first(x, g2))
    assert torch.equal(g1.get_state(), g2.get_state())
    centre_first = Compose((ToFloat(), *[s for s in evaluation.steps if not isinstance(s, ToFloat)]))
    assert torch.equal(evaluation(x, None), centre_first(x, None))
    rotation_first, _ = pipelines(
        Augment(crop=32, padding=4, rotation_deg=10, order=("rotation", "crop")), None, (3, 32, 32)
    )
    assert isinstance(rotation_first, Compose) and isinstance(rotation_first.steps[0], ToFloat)


def test_crop_at_takes_a_different_window_per_image() -> None:
    """Each image of the batch gets its own (top, left)."""
    x = torch.arange(2 * 25, dtype=torch.float32).view(2, 1, 5, 5)
    out = crop_at(x, torch.tensor([0, 2]), torch.tensor([1, 0]), 3)
    assert torch.equal(out[0], x[0, :, 0:3, 1:4]) and torch.equal(out[1], x[1, :, 2:5, 0:3])


@pytest.mark.parametrize("mode", ["zero", "reflect", "replicate"])
def test_random_crop_outputs_are_shifts_of_the_padded_image(mode: str) -> None:
    """Every output is one of the (2p+1)^2 windows of the padded image, and several windows occur."""
    x = images(64).float()
    out = RandomCrop(32, 4, mode)(x, gen(0))  # type: ignore[arg-type]
    assert out.shape == x.shape
    padded = pad(x, 4, mode)  # type: ignore[arg-type]
    seen = set()
    for i in range(len(x)):
        hits = [
            (t, left)
            for t in range(9)
            for left in range(9)
            if torch.equal(out[i], padded[i, :, t : t + 32, left : left + 32])
        ]
        assert hits, f"image {i} is not a window of its padded image"
        seen.add(hits[0])
    assert len(seen) > 10


def test_random_crop_eval_is_identity_or_centre_crop() -> None:
    """Without a generator the crop is deterministic: the image itself, or its centre when smaller."""
    x = images(4, 64).float()
    assert torch.equal(RandomCrop(64, 4)(x, None), x)
    assert torch.equal(RandomCrop(56)(x, None), x[..., 4:60, 4:60])
    assert torch.equal(center_crop(x, 56), x[..., 4:60, 4:60])


def test_flip_flips_exactly_the_drawn_images() -> None:
    """Each output is the image or torch.flip of it along the width; both occur; p=1 flips all."""
    x = images(64).float()
    out = RandomHorizontalFlip()(x, gen(3))
    flipped = [torch.equal(out[i], torch.flip(x[i], dims=[-1])) for i in range(len(x))]
    kept = [torch.equal(out[i], x[i]) for i in range(len(x))]
    assert all(f or k for f, k in zip(flipped, kept, strict=True))
    assert 10 < sum(flipped) < 54
    assert torch.equal(RandomHorizontalFlip(p=1.0)(x, gen(0)), torch.flip(x, dims=[-1]))
    assert torch.equal(RandomHorizontalFlip()(x, None), x)


@pytest.mark.parametrize(("degrees", "k"), [(90.0, 1), (-90.0, -1), (180.0, 2)])
def test_rotate_by_right_angles_equals_rot90(degrees: float, k: int) -> None:
    """Positive angles turn counter-clockwise, as torchvision's rotate; right angles are exact."""
    x = images(3, 8).float()
    out = rotate(x, torch.full((3,), degrees))
    assert torch.equal(out, torch.rot90(x, k, dims=(-2, -1)))


def test_rotate_zero_is_identity_and_small_angles_keep_the_centre() -> None:
    """0 degrees changes nothing; 10 degrees keeps the centre pixel and zero-fills some corner."""
    x = images(2).float() + 1  # no zeros in the image, so fill is visible
    assert torch.equal(rotate(x, torch.zeros(2)), x)
    out = rotate(x, torch.tensor([10.0, -10.0]))
    assert torch.equal(out[..., 15:17, 15:17], x[..., 15:17, 15:17])
    assert (out[:, :, 0, 0] == 0).all()


def test_rotate_uint8_input_keeps_dtype() -> None:
    """uint8 batches come back as uint8 (rotation is computed in float)."""
    x = images(2)
    assert rotate(x, torch.tensor([90.0, 90.0])).dtype == torch.uint8


def test_random_rotation_draws_one_angle_per_image() -> None:
    """Two identical images in one batch are turned by different angles; eval leaves them alone."""
    x = images(1).float().repeat(2, 1, 1, 1)
    out = RandomRotation(15.0)(x, gen(0))
    assert not torch.equal(out[0], out[1])
    assert torch.equal(RandomRotation(15.0)(x, None), x)


def _pipeline() -> tuple[object, object]:
    return pipelines(CIFAR_LIKE, ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)), (3, 32, 32))


def test_pipeline_same_seed_same_batch_and_shape_preserved() -> None:
    """The same generator seed gives the same augmented batch, float32 of the input's shape."""
    train, _ = _pipeline()
    x = images()
    a, b = train(x, gen(7)), train(x, gen(7))  # type: ignore[operator]
    assert a.shape == x.shape and a.dtype == torch.float32 and torch.equal(a, b)


def test_pipeline_different_seeds_give_different_batches() -> None:
    """Different generator seeds give different augmentations of the same batch."""
    train, _ = _pipeline()
    x = images()
    assert not torch.equal(train(x, gen(1)), train(x, gen(2)))  # type: ignore[operator]


def test_pipeline_draws_only_from_the_given_generator() -> None:
    """The global RNG is neither used nor advanced by a training transform."""
    train, _ = _pipeline()
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    train(images(), gen(1))  # type: ignore[operator]
    assert torch.equal(torch.random.get_rng_state(), before)


def test_pipeline_eval_is_deterministic_normalisation_only() -> None:
    """The eval transform is (x / 255 - mean) / std, whatever the augmentation, and the same every call."""
    _, evaluation = _pipeline()
    x = images()
    expected = (x.float() / 255 - 0.5) / 0.25
    assert torch.allclose(evaluation(x, None), expected) and torch.equal(evaluation(x, None), evaluation(x, None))  # type: ignore[operator]


def test_pipeline_order_runs_rotation_first_when_listed_first() -> None:
    """order changes the result: rotate-then-crop differs from crop-then-rotate for the same draws."""
    a, _ = pipelines(
        Augment(crop=32, padding=4, rotation_deg=10, order=("rotation", "crop", "flip")), None, (3, 32, 32)
    )
    b, _ = pipelines(Augment(crop=32, padding=4, rotation_deg=10), None, (3, 32, 32))
    x = images()
    assert a(x, gen(0)).shape == b(x, gen(0)).shape == x.shape
    assert not torch.equal(a(x, gen(0)), b(x, gen(0)))


def test_pipeline_smaller_crop_centre_crops_at_eval() -> None:
    """A 56-pixel crop of 64-pixel images: random windows in training, the centre at evaluation."""
    train, evaluation = pipelines(Augment(crop=56), None, (3, 64, 64))
    x = images(4, 64)
    assert train(x, gen(0)).shape == (4, 3, 56, 56)
    assert torch.equal(evaluation(x, None), x[..., 4:60, 4:60].float() / 255)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"crop": 0}, "data.augment.crop"),
        ({"padding": -1}, "data.augment.padding"),
        ({"padding_mode": "wrap"}, "data.augment.padding_mode"),
        ({"rotation_deg": 200.0}, "data.augment.rotation_deg"),
        ({"order": ("crop", "crop")}, "data.augment.order"),
        ({"order": ("crop", "zoom")}, "data.augment.order"),
    ],
)
def test_augment_bad_settings_raise_config_error_naming_the_field(fields: dict[str, object], field: str) -> None:
    """Out-of-range or unknown augmentation settings name their config field."""
    with pytest.raises(ConfigError) as info:
        Augment(**fields)  # type: ignore[arg-type]
    assert info.value.field == field


def test_pipeline_order_leaving_out_a_configured_step_is_an_error() -> None:
    """A step that is configured but missing from order is an error, not silently skipped."""
    with pytest.raises(ConfigError, match="leaves out"):
        pipelines(Augment(flip=True, order=("crop",)), None, (3, 32, 32))


def test_tensor_dataset_train_batch_runs_transforms_on_indexed_images() -> None:
    """TensorDataset.train_batch indexes the uint8 images then augments and normalises them."""
    train, evaluation = _pipeline()
    data = TensorDataset(images(8), torch.arange(8), 10, train_transform=train, eval_transform=evaluation)  # type: ignore[arg-type]
    x, y = data.train_batch(torch.tensor([5, 2]), gen(0))
    assert x.shape == (2, 3, 32, 32) and y.tolist() == [5, 2] and x.dtype == torch.float32
    x_eval, _ = data.eval_batch(0, 8)
    assert torch.allclose(x_eval, Normalize((0.5,) * 3, (0.25,) * 3)(data.x.float() / 255, None))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pipeline_on_cuda_stays_on_device_and_is_deterministic() -> None:
    """On CUDA: output on the GPU, reproducible per seed, eval and CPU-generator draws equal to the CPU's."""
    train, evaluation = _pipeline()
    x = images(64).cuda()
    a = train(x, torch.Generator(device="cuda").manual_seed(3))  # type: ignore[operator]
    b = train(x, torch.Generator(device="cuda").manual_seed(3))  # type: ignore[operator]
    assert a.is_cuda and a.shape == x.shape and torch.equal(a, b)
    assert torch.allclose(evaluation(x, None).cpu(), evaluation(x.cpu(), None))  # type: ignore[operator]
    # crop and flip with a CPU generator: the same draws, so the same images as on the CPU
    crop_flip, _ = pipelines(Augment(crop=32, padding=4, flip=True), None, (3, 32, 32))
    c = crop_flip(x, torch.Generator().manual_seed(3))
    assert c.is_cuda and torch.equal(c.cpu(), crop_flip(x.cpu(), torch.Generator().manual_seed(3)))
