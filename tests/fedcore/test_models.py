"""The model registry: the extractor/head interface, taps, seeding, parameter counts against the specs, options."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.models import MODELS, FedModel, build_model, count_parameters, model_options

# (name, input shape, classes, options, expected taps {name: width}, feature_shape): every registered
# model on the input shapes its papers use
CASES: list[tuple[str, tuple[int, ...], int, dict[str, Any], dict[str, int], tuple[int, ...]]] = [
    ("mlp", (1, 8, 8), 10, {}, {"features": 128}, (128,)),
    ("mlp", (1, 28, 28), 10, {"hidden": [200, 200]}, {"fc1": 200, "features": 200}, (200,)),
    ("dnn", (1, 28, 28), 10, {}, {"fc1": 200, "features": 200}, (200,)),
    ("cnn", (1, 8, 8), 10, {}, {"conv1": 16, "conv2": 32, "features": 64}, (64,)),
    ("cnn", (1, 28, 28), 10, {"channels": [8, 8], "hidden": 16}, {"conv1": 8, "conv2": 8, "features": 16}, (16,)),
    (
        "moon-cnn",
        (3, 32, 32),
        10,
        {},
        {"conv1": 6, "features": 400, "fc1": 120, "fc2": 84, "projection": 256},
        (16, 5, 5),
    ),
    ("fedavg-cnn", (1, 28, 28), 10, {}, {"conv1": 32, "conv2": 64, "features": 512}, (512,)),
    ("fedavg-cnn", (3, 32, 32), 10, {}, {"conv1": 32, "conv2": 64, "features": 512}, (512,)),
    ("conv2cifar", (3, 32, 32), 10, {}, {"conv1": 64, "conv2": 64, "fc1": 384, "features": 192}, (192,)),
    (
        "conv2cifar",
        (3, 32, 32),
        100,
        {"head_bias": True},
        {"conv1": 64, "conv2": 64, "fc1": 384, "features": 192},
        (192,),
    ),
]
RESNET_TAPS = {"layer0": 64, "layer1": 64, "layer2": 128, "layer3": 256, "layer4": 512, "features": 512}
MOBILENET_TAPS = {"layer0": 32, "layer1": 24, "layer2": 32, "layer3": 96, "layer4": 320, "features": 1280}
CASES += [
    ("resnet18", (3, 32, 32), 10, {}, RESNET_TAPS, (512,)),
    ("resnet18", (3, 32, 32), 10, {"stem": "imagenet"}, RESNET_TAPS, (512,)),
    ("resnet18", (3, 64, 64), 200, {"norm": "gn", "head_bias": False}, RESNET_TAPS, (512,)),
    ("resnet34", (3, 32, 32), 100, {"stem": "imagenet"}, RESNET_TAPS, (512,)),
    ("resnet32", (3, 32, 32), 10, {}, {"layer0": 16, "layer1": 16, "layer2": 32, "layer3": 64, "features": 64}, (64,)),
    ("mobilenetv2", (3, 32, 32), 10, {}, MOBILENET_TAPS, (1280,)),
    ("mobilenetv2", (3, 64, 64), 200, {}, MOBILENET_TAPS, (1280,)),
    ("mobilenetv2", (3, 32, 32), 10, {"variant": "imagenet"}, MOBILENET_TAPS, (1280,)),
]
CASE_IDS = [
    f"{n}-{'x'.join(map(str, s))}-{k}-" + ",".join(f"{o}={v}" for o, v in opts.items()) for n, s, k, opts, *_ in CASES
]
FIRST_CASE: dict[str, tuple[str, tuple[int, ...], int, dict[str, Any], dict[str, int], tuple[int, ...]]] = {}
for _case in CASES:
    FIRST_CASE.setdefault(_case[0], _case)


@functools.cache
def _run(i: int) -> tuple[FedModel, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Builds case i in eval mode and runs it once on a seeded batch of 2: model, h, logits, split logits, taps."""
    name, shape, k, opts, *_ = CASES[i]
    model = build_model(name, shape, k, seed=0, **opts).eval()
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(i))
    with torch.no_grad():
        h = model.extract(x)
        return model, h, model(x), model.classify(h), *model.forward_taps(x)


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach() for p in model.parameters()]


def test_registry_every_model_has_a_forward_case() -> None:
    """Each registered model is exercised by the forward tests below."""
    assert set(MODELS) == {case[0] for case in CASES}


@pytest.mark.parametrize("i", range(len(CASES)), ids=CASE_IDS)
def test_forward_batch_of_two_gives_logits_and_features(i: int) -> None:
    """forward gives (2, K) logits and extract gives (2, *feature_shape)."""
    _, _, k, _, _, feature_shape = CASES[i]
    model, h, logits, _, _, _ = _run(i)
    assert logits.shape == (2, k) and model.num_classes == k
    assert h.shape == (2, *feature_shape) and model.feature_shape == feature_shape
    assert model.feature_dim == h[0].numel()
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("i", range(len(CASES)), ids=CASE_IDS)
def test_classify_of_extract_equals_forward(i: int) -> None:
    """classify(extract(x)) and the logits of forward_taps are bitwise forward(x)."""
    _, _, logits, split, tap_logits, _ = _run(i)
    assert torch.equal(split, logits)
    assert torch.equal(tap_logits, logits)


@pytest.mark.parametrize("i", range(len(CASES)), ids=CASE_IDS)
def test_forward_taps_names_and_shapes_are_the_documented_ones(i: int) -> None:
    """forward_taps gives the documented names in order, each (2, d), with features the flattened extract(x)."""
    expected = CASES[i][4]
    model, h, _, _, _, taps = _run(i)
    assert list(taps) == list(expected) == list(model.tap_names)
    assert {name: tuple(t.shape) for name, t in taps.items()} == {name: (2, d) for name, d in expected.items()}
    assert torch.equal(taps["features"], h.flatten(1))


@pytest.mark.parametrize(
    "i",
    [i for i, case in enumerate(CASES) if "layer0" in case[4]],
    ids=[c for c, case in zip(CASE_IDS, CASES, strict=True) if "layer0" in case[4]],
)
def test_forward_taps_stage_taps_are_taken_before_the_activation(i: int) -> None:
    """The layerN taps are pre-activation (FedRCL) and can be negative; the pooled ReLU features cannot."""
    _, _, _, _, _, taps = _run(i)
    assert all((taps[name] < 0).any() for name in taps if name.startswith("layer"))
    assert (taps["features"] >= 0).all()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_represent_returns_the_representation_tap_and_logits(name: str) -> None:
    """represent(x) is (taps[representation_tap], logits); MOON's projection for moon-cnn, features elsewhere."""
    i = CASES.index(FIRST_CASE[name])
    model, _, logits, _, _, taps = _run(i)
    x = torch.randn(2, *CASES[i][1], generator=torch.Generator().manual_seed(i))
    with torch.no_grad():
        z, rep_logits = model.represent(x)
    assert model.representation_tap == ("projection" if name == "moon-cnn" else "features")
    assert torch.equal(z, taps[model.representation_tap]) and torch.equal(rep_logits, logits)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_head_keys_are_exactly_the_parameters_classify_uses(name: str) -> None:
    """Backpropagating through classify alone reaches exactly the parameters head_keys names."""
    _, shape, k, opts, _, feature_shape = FIRST_CASE[name]
    model = build_model(name, shape, k, seed=0, **opts)
    model.classify(torch.rand(2, *feature_shape)).sum().backward()
    reached = {key for key, p in model.named_parameters() if p.grad is not None}
    assert reached == set(model.head_keys()) and reached


@pytest.mark.parametrize("name", sorted(MODELS))
def test_build_model_same_seed_same_parameters_other_seed_other_parameters(name: str) -> None:
    """Initialisation is a function of the seed alone."""
    _, shape, k, opts, *_ = FIRST_CASE[name]
    a, b, c = (build_model(name, shape, k, seed=s, **opts) for s in (3, 3, 4))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    drawn = [
        not torch.equal(x, y) for x, y in zip(_params(a), _params(c), strict=True) if x.numel() > 1 and x.std() > 0
    ]
    assert drawn and all(drawn)  # every randomly initialised tensor differs; constant ones (norm affine) do not


# (name, input shape, classes, options, exact count, where the figure comes from)
COUNTS = [
    ("moon-cnn", (3, 32, 32), 10, {}, 92_626, "kdia.md 1.1: CIFAR-10 total"),
    ("moon-cnn", (3, 32, 32), 100, {}, 115_756, "kdia.md 1.1: CIFAR-100 total"),
    ("fedavg-cnn", (1, 28, 28), 10, {}, 1_663_370, "McMahan et al. CNN on MNIST"),
    (
        "fedavg-cnn",
        (3, 32, 32),
        10,
        {},
        2_432 + 51_264 + 64 * 8 * 8 * 512 + 512 + 5_130,
        "computed: 3-channel conv1, 8x8 maps",
    ),
    (
        "conv2cifar",
        (3, 32, 32),
        10,
        {},
        4_864 + 102_464 + 614_784 + 73_920 + 1_920,
        "fedacd.md 2.2: about 0.80M, computed exactly",
    ),
    ("resnet18", (3, 32, 32), 10, {}, 11_173_962, "CIFAR ResNet-18, BatchNorm"),
    (
        "resnet18",
        (3, 32, 32),
        10,
        {"norm": "gn"},
        11_173_962,
        "fedrcl.md 2.2: GroupNorm has BatchNorm's affine parameters (~11M, 6)",
    ),
    (
        "resnet18",
        (3, 32, 32),
        10,
        {"stem": "imagenet"},
        11_181_642,
        "torchvision resnet18(num_classes=10): FedSA, FedVLS",
    ),
    (
        "resnet18",
        (3, 64, 64),
        200,
        {"norm": "gn", "head_bias": False},
        11_168_832 + 512 * 200,
        "fedacd.md 2.2: Tiny-ImageNet, bias-free head",
    ),
    (
        "resnet34",
        (3, 32, 32),
        100,
        {"stem": "imagenet"},
        21_797_672 - 1000 * 513 + 100 * 513,
        "torchvision resnet34 with 100 classes: FedSA CIFAR-100*",
    ),
    ("resnet34", (3, 32, 32), 10, {}, 21_282_122, "CIFAR ResNet-34"),
    ("resnet32", (3, 32, 32), 10, {}, 464_154, "fedvls.md 2.2; He et al. 0.46M"),
    ("mobilenetv2", (3, 32, 32), 10, {}, 2_296_922, "fedvls.md 2.2: the code's CIFAR MobileNetV2 (CCVR)"),
    (
        "mobilenetv2",
        (3, 224, 224),
        1000,
        {"variant": "imagenet"},
        3_504_872,
        "torchvision mobilenet_v2, the paper's table",
    ),
    ("dnn", (1, 28, 28), 10, {}, 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10, "fedvls.md 2.2: 784-200-200-K"),
    ("cnn", (1, 8, 8), 10, {}, 38_282, "the quickstart CNN"),
]


@pytest.mark.parametrize(("name", "shape", "k", "opts", "expected", "source"), COUNTS, ids=[c[5] for c in COUNTS])
def test_count_parameters_matches_the_specs(
    name: str, shape: tuple[int, ...], k: int, opts: dict[str, Any], expected: int, source: str
) -> None:
    """Parameter counts equal the specs' figures (exact where given, computed where approximate)."""
    assert count_parameters(build_model(name, shape, k, seed=0, **opts)) == expected


@pytest.mark.parametrize(("opts", "approx_m", "digits"), [({}, 0.80, 2), ({"norm": "gn"}, 11, 0)])
def test_count_parameters_approximate_figures_hold_at_their_rounding(
    opts: dict[str, Any], approx_m: float, digits: int
) -> None:
    """Conv2Cifar is "about 0.80M" (fedacd.md 2.2); FedRCL's GroupNorm ResNet-18 is "~11M" (fedrcl.md 6)."""
    name = "conv2cifar" if digits else "resnet18"
    assert round(count_parameters(build_model(name, (3, 32, 32), 10, seed=0, **opts)) / 1e6, digits) == approx_m


@pytest.mark.parametrize(("k", "head"), [(10, 89_754), (100, 112_884)])
def test_moon_cnn_split_is_kdias_conv_extractor_and_linear_classifier(k: int, head: int) -> None:
    """extract is the 16x5x5 generator target (2,872 parameters); classify holds every linear layer."""
    model = build_model("moon-cnn", (3, 32, 32), k, seed=0)
    head_params = sum(p.numel() for key, p in model.named_parameters() if key in model.head_keys())
    assert model.feature_shape == (16, 5, 5)
    assert (count_parameters(model) - head_params, head_params) == (2_872, head)
    assert model.classify(torch.rand(2, 16, 5, 5)).shape == (2, k)


BAD_OPTIONS = [
    ("resnet18", (3, 32, 32), {"norm": "ln"}, "norm"),
    ("resnet18", (3, 32, 32), {"stem": "tiny"}, "stem"),
    ("resnet18", (3, 32, 32), {"norm": "gn", "groups": 3}, "groups"),
    ("resnet34", (3, 32, 32), {"head_bias": "yes"}, "head_bias"),
    ("resnet32", (3, 32, 32), {"init": "xavier"}, "init"),
    ("mobilenetv2", (3, 32, 32), {"variant": "v3"}, "variant"),
    ("conv2cifar", (3, 32, 32), {"bias": False}, "bias"),
    ("fedavg-cnn", (3, 32, 32), {"hidden": 256}, "hidden"),
    ("moon-cnn", (3, 32, 32), {"projection_dim": 0}, "projection_dim"),
    ("moon-cnn", (3, 8, 8), {}, "too small"),
    ("mlp", (1, 8, 8), {"hidden": [0]}, "hidden"),
    ("dnn", (1, 28, 28), {"hidden": "200"}, "hidden"),
    ("cnn", (64,), {}, "C x H x W"),
]


@pytest.mark.parametrize(
    ("name", "shape", "opts", "mentions"), BAD_OPTIONS, ids=[f"{b[0]}-{b[3]}" for b in BAD_OPTIONS]
)
def test_build_model_bad_options_raise_config_error_naming_the_model(
    name: str, shape: tuple[int, ...], opts: dict[str, Any], mentions: str
) -> None:
    """An unknown option, a bad value or an unusable input shape is a ConfigError naming the model and the problem."""
    with pytest.raises(ConfigError, match=f"'{name}'") as info:
        build_model(name, shape, 10, seed=0, **opts)
    assert mentions in str(info.value) and info.value.field == "model.options"


def test_build_model_unknown_name_raises_config_error_listing_models() -> None:
    """An unknown model name is a ConfigError on model.name listing the registry."""
    with pytest.raises(ConfigError, match="resnet18") as info:
        build_model("vgg9", (3, 32, 32), 10, seed=0)
    assert info.value.field == "model.name"


def test_model_options_lists_each_option_with_its_default() -> None:
    """model_options gives the accepted options and defaults, without input_shape and num_classes."""
    assert model_options("resnet18") == {"norm": "bn", "groups": 2, "stem": "cifar", "head_bias": True, "init": "code"}
    assert model_options("fedavg-cnn") == {}


TRAINABLE = [
    ("mlp", (1, 8, 8)),
    ("dnn", (1, 28, 28)),
    ("cnn", (1, 8, 8)),
    ("moon-cnn", (3, 32, 32)),
    ("fedavg-cnn", (1, 28, 28)),
    ("conv2cifar", (3, 32, 32)),
]


@pytest.mark.parametrize(("name", "shape"), TRAINABLE)
def test_train_step_on_a_fixed_batch_reduces_the_loss(name: str, shape: tuple[int, ...]) -> None:
    """One SGD step on a fixed synthetic batch of 2 lowers the cross-entropy on that batch."""
    model = build_model(name, shape, 10, seed=0)
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([3, 7])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    with torch.no_grad():
        assert F.cross_entropy(model(x), y) < loss.detach()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_keeps_the_contract_a_user_s_model_is_checked_against(name: str) -> None:
    """`fedmq.testing.check_model`: logits of the right shape, a gradient for every parameter, seeded weights."""
    from fedmq.testing import check_model

    _, shape, k, opts, *_ = FIRST_CASE[name]
    check_model(name, shape, k, **opts)


def test_models_built_by_threads_at_once_have_their_seeds_weights() -> None:
    """Cells simulated as threads of one process build their models at the same time: each model's
    weights are its seed's, as built alone (`seeding.global_stream` holds torch's global stream for one
    build at a time; without it the threads' draws interleave and a restore rewinds another's stream)."""
    import threading

    seeds = list(range(8))
    alone = {s: build_model("moon-cnn", (3, 32, 32), 10, seed=s).state_dict() for s in seeds}
    built: dict[int, dict[str, torch.Tensor]] = {}
    start = threading.Barrier(len(seeds))

    def build(seed: int) -> None:
        start.wait()
        for _ in range(3):
            built[seed] = build_model("moon-cnn", (3, 32, 32), 10, seed=seed).state_dict()

    threads = [threading.Thread(target=build, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in seeds:
        assert all(torch.equal(alone[s][k], built[s][k]) for k in alone[s]), s
