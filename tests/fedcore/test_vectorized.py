"""Vectorised training of many nodes against `local_sgd` node by node.

Tolerance: vectorised and one-by-one training run the same operations, but batched matrix products,
grouped convolutions and padded batches sum in another order, so results agree to float rounding,
amplified a little by the steps that follow. Measured on this CPU (mlp and cnn on digits with
augmentation, 7 unequal shards, 2 epochs, 3 seeds): with SGD (momentum, weight decay, clipping) at
most 3e-8 on any weight, so every weight must be within 1e-5 (plus 1e-4 relative): far above
rounding, far below what a wrong step gives (a wrong momentum, a missed weight decay or one extra
step moves weights by 1e-3 to 1e-2). Adam is another matter: it divides each gradient by the root
of its running square, so a weight whose gradient is rounding noise (about 1e-9, near eps) takes a
step of a sizeable fraction of lr in either direction. The mlp stays within 2e-7, but the cnn has a
few such weights, off by up to 9.3e-5 = 0.0093 lr (1 weight in 30,000). For Adam the test allows
at most 0.1% of the weights beyond 1e-5 and none beyond 0.1 lr: a real error moves most weights.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Hashable, Sequence

import pytest
import torch
from torch import nn

from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm
from fedmq.fedcore.algorithms.base import GroupMember, Payload, TaskInput
from fedmq.fedcore.data import TensorDataset, load_dataset
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.models import build_model
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.training import LossFn, TrainSettings, TrainStats, cross_entropy, local_sgd
from fedmq.fedcore.transforms import Augment, Normalize, PaddingMode, ToFloat, pipelines
from fedmq.fedcore.vectorized import (
    NodeBatch,
    VectorizeError,
    augment_nodes,
    cross_entropy_objective,
    known_steps,
    nll,
    step_kind,
    steps_per_epoch,
    train_vectorized,
    unsupported,
)
from tests.fedcore.captured_steps import every_step_whole

ATOL, RTOL = 1e-5, 1e-4
SIZES = (40, 17, 1, 33, 2, 64, 9)
"""Unequal shards: a single sample, a trailing batch of one (17 = 16 + 1), short and long ones."""

SGD = TrainSettings(local_epochs=2, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-3, max_grad_norm=1.0)
ADAM = TrainSettings(local_epochs=2, batch_size=16, optimizer="adam", lr=0.01, weight_decay=1e-3, max_grad_norm=0.5)


@pytest.fixture(scope="module")
def digits() -> TensorDataset:
    """Digits with a random crop (1 pixel of padding) and flips: both draw from each node's generator."""
    return load_dataset("digits", seed=0, augment={"crop": 8, "padding": 1, "flip": True}).train


def shards(data: TensorDataset, sizes: Sequence[int]) -> list[TensorDataset]:
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(7))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [data.subset(perm[s : s + n].numpy()) for s, n in zip(starts, sizes, strict=True)]


def generators(k: int) -> list[torch.Generator]:
    return [torch_generator(3, "node-train", f"node-{i}", 0) for i in range(k)]


def one_by_one(
    model: torch.nn.Module, datasets: Sequence[TensorDataset], settings: TrainSettings, loss_fn: LossFn = cross_entropy
) -> list[tuple[dict[str, torch.Tensor], TrainStats]]:
    out = []
    for data, gen in zip(datasets, generators(len(datasets)), strict=True):
        copy_ = copy.deepcopy(model)
        stats = local_sgd(copy_, data, settings, gen, loss_fn=loss_fn)
        out.append((copy_.state_dict(), stats))
    return out


def assert_as_local_sgd(state: dict[str, torch.Tensor], want: dict[str, torch.Tensor], settings: TrainSettings) -> None:
    """Every weight within ATOL/RTOL (SGD); for Adam, see the module docstring."""
    if settings.optimizer == "sgd":
        for key in want:
            torch.testing.assert_close(state[key], want[key], atol=ATOL, rtol=RTOL)
        return
    diff = torch.cat([(state[k] - want[k]).abs().flatten() for k in want])
    beyond = diff > ATOL + RTOL * torch.cat([want[k].abs().flatten() for k in want])
    assert float(beyond.float().mean()) <= 1e-3 and float(diff.max()) <= 0.1 * settings.lr, (beyond.sum(), diff.max())


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("settings", [SGD, ADAM], ids=["sgd-momentum", "adam"])
def test_vectorized_unequal_shards_equal_one_by_one_within_tolerance(
    digits: TensorDataset, name: str, settings: TrainSettings
) -> None:
    """Seven nodes of unequal shards (with augmentation, momentum or Adam, weight decay, clipping): each
    node's weights and stats are what local_sgd gives it alone, within the stated tolerance."""
    model = build_model(name, digits.input_shape, 10, seed=0)
    start = copy.deepcopy(model.state_dict())
    datasets = shards(digits, SIZES)
    expected = one_by_one(model, datasets, settings)
    got = train_vectorized(model, datasets, settings, generators(len(datasets)))
    assert all(torch.equal(start[k], v) for k, v in model.state_dict().items()), "the template model moved"
    for (want_state, want), (state, stats) in zip(expected, got, strict=True):
        assert (stats.steps, stats.samples_seen) == (want.steps, want.samples_seen)
        assert stats.loss == pytest.approx(want.loss, rel=RTOL, abs=ATOL)
        assert_as_local_sgd(state, want_state, settings)
        assert max_difference(state, start) > 1e-3, "a node did not train"
    assert [s.steps for _, s in got] == [2 * steps_per_epoch(n, 16) for n in SIZES] == [6, 2, 2, 4, 2, 8, 2]


@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("settings", [SGD, ADAM], ids=["sgd-momentum", "adam"])
def test_vectorized_in_float64_equals_one_by_one_to_rounding(
    digits: TensorDataset, name: str, settings: TrainSettings
) -> None:
    """In float64 the two agree to 1e-12 on every weight, Adam and the cnn included: what float32 shows
    beyond its rounding is rounding amplified (a near tie in a max-pool or a ReLU, a near-zero gradient
    under Adam), not a difference in the computation."""
    data64 = dataclasses.replace(digits, x=digits.x.double())
    model = build_model(name, digits.input_shape, 10, seed=0).double()
    datasets = shards(data64, SIZES)
    expected = one_by_one(model, datasets, settings)
    got = train_vectorized(model, datasets, settings, generators(len(datasets)))
    for (want_state, want), (state, stats) in zip(expected, got, strict=True):
        assert max_difference(state, want_state) < 1e-12
        assert stats.loss == pytest.approx(want.loss, rel=1e-12)


def proximal(model: torch.nn.Module, mu: float) -> LossFn:
    """The cross-entropy plus mu times the squared distance from `model`'s weights (FedProx's kind)."""
    start = {n: p.detach().clone() for n, p in model.named_parameters()}

    def loss_fn(trained: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        drift = sum(((p - start[n]) ** 2).sum() for n, p in trained.named_parameters())
        return cross_entropy(trained, x, y) + mu * drift

    return loss_fn


@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("settings", [SGD, ADAM], ids=["sgd-momentum", "adam"])
def test_the_captured_steps_computation_equals_one_by_one_in_float64(
    digits: TensorDataset, name: str, settings: TrainSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A captured step trains its kind's first b nodes (`step_kind`): unmasked while each of them has a
    batch, masked where some have none (they keep weights and optimizer state, restored after the update);
    SIZES gives the kinds (7 nodes), (4, masked: 3 train), (2) and (1). Run that way on the CPU, in
    float64, every node is its own local_sgd to 1e-12, its summed gradients and a carried state what the
    eager steps give."""
    from fedmq.fedcore import vectorized

    data64 = dataclasses.replace(digits, x=digits.x.double())
    model = build_model(name, digits.input_shape, 10, seed=0).double()
    datasets = shards(data64, SIZES)
    expected = one_by_one(model, datasets, settings, loss_fn=proximal(model, 0.01))
    carry = {"steps": torch.zeros(len(SIZES), dtype=torch.float64)}

    def objective(batch: NodeBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        # a term of the parameters (a proximal term's kind): its value and gradient are not zero on a
        # node with no batch left, so only the masking keeps them out of that node's sums
        drift = sum(((p - batch.start[n]) ** 2).sum() for n, p in batch.params.items())
        loss = batch.mean(nll(batch.logits(), batch.y))
        return loss + 0.01 * drift, {"drift": drift}, {"steps": batch.carry["steps"] + 1}

    def train() -> list[tuple[dict[str, torch.Tensor], TrainStats]]:
        gens = generators(len(SIZES))
        return train_vectorized(model, datasets, settings, gens, objective=objective, carry=carry, sum_gradients=True)

    eager = train()
    monkeypatch.setattr(vectorized, "run_steps", every_step_whole)
    whole = train()
    for (want_state, want), (state, stats), (_, eager_stats) in zip(expected, whole, eager, strict=True):
        assert max_difference(state, want_state) < 1e-12
        assert stats.loss == pytest.approx(want.loss, rel=1e-12)
        assert stats.terms["drift"] == pytest.approx(eager_stats.terms["drift"], rel=1e-12)
        assert float(stats.carry["steps"]) == stats.steps == want.steps
        for key, total in stats.gradient_sums.items():
            torch.testing.assert_close(total, eager_stats.gradient_sums[key], rtol=0, atol=1e-12)


def test_a_captured_step_takes_the_power_of_two_of_nodes_at_or_above_those_training() -> None:
    """`step_kind`: the first b nodes, b the power of two at or above the active count (K at most),
    masked exactly where b is more than that count; a count of none or more than K is refused."""
    assert [step_kind(a, 10) for a in range(1, 11)] == [
        (1, False), (2, False), (4, True), (4, False), (8, True), (8, True), (8, True), (8, False),
        (10, True), (10, False),
    ]  # fmt: skip
    assert step_kind(100, 100) == (100, False) and step_kind(65, 100) == (100, True)
    assert len({step_kind(a, 100) for a in range(1, 101)}) == 14  # 2 (log2 K + 1) at most: few graphs
    for wrong in (0, 11):
        with pytest.raises(ValueError, match="1 to 10 nodes"):
            step_kind(wrong, 10)


def test_a_round_of_unequal_shards_runs_each_step_as_its_active_counts_kind(
    digits: TensorDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `run_steps` is handed for SIZES in batches of 16 over 2 epochs (steps 6, 2, 2, 4, 2, 8, 2 a
    node): 2 steps of 7 nodes, 2 of 3 (the 4-node step masked), 2 of 2 and 2 of 1; nodes with no batch
    left are no longer carried in the step (before, every captured step took all 7)."""
    from fedmq.fedcore import vectorized

    kinds: list[object] = []
    stepped: list[tuple[int, bool]] = []
    step = vectorized._Round.step

    def record(total: int, load: Callable[[int], None], eager: Callable[[int], None],
               whole: Callable[[Hashable], None], graphs: bool, kind: Callable[[int], Hashable] = lambda s: None,
               captured: object = None) -> None:  # fmt: skip
        for s in range(total):  # every step as its captured kind, as every_step_whole
            load(s)
            kinds.append(kind(s))
            whole(kinds[-1])

    def counted(self: vectorized._Round, a: int, masked: bool = False) -> None:
        stepped.append((a, masked))
        step(self, a, masked)

    monkeypatch.setattr(vectorized, "run_steps", record)
    monkeypatch.setattr(vectorized._Round, "step", counted)
    train_vectorized(build_model("mlp", digits.input_shape, 10, seed=0), shards(digits, SIZES), SGD, generators(7))
    assert kinds == [(7, False)] * 2 + [(4, True)] * 2 + [(2, False)] * 2 + [(1, False)] * 2
    assert stepped == kinds  # the step a kind runs: the first b nodes, masked as the kind says


@pytest.mark.parametrize("augment", [{"crop": 8, "padding": 1, "flip": True}, {"padding": 2, "rotation_deg": 30}])
def test_augmentation_of_all_nodes_at_once_is_each_nodes_own_bitwise(augment: dict[str, object]) -> None:
    """augment_nodes on the concatenated batches gives each node exactly what its own train_batch gives,
    and leaves each generator where train_batch leaves it."""
    data = load_dataset("digits", seed=0, augment=augment, normalize={"mean": [0.3], "std": [0.4]}).train
    parts = shards(data, (5, 16, 1))
    steps = known_steps(data.train_transform)  # type: ignore[arg-type]
    assert steps is not None and len(steps) >= 3
    idx = [torch.arange(len(p)) for p in parts]
    alone = torch.cat([p.train_batch(i, g)[0] for p, i, g in zip(parts, idx, generators(3), strict=True)])
    gens = generators(3)
    together = augment_nodes(torch.cat([p.x for p in parts]), [len(p) for p in parts], steps, gens)
    assert torch.equal(alone, together)
    after = generators(3)
    for p, i, g in zip(parts, idx, after, strict=True):
        p.train_batch(i, g)
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(after, gens, strict=True))


def synthetic_uint8_images(n: int, augment: Augment) -> TensorDataset:
    """Clearly synthetic CIFAR-like data: n random uint8 images 3 x 8 x 8 in 10 classes, with the training
    transform a CIFAR experiment builds (`pipelines`: the augmentation, ToFloat, Normalize)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 256, (n, 3, 8, 8), generator=g, dtype=torch.uint8)
    train, evaluation = pipelines(augment, ((0.49, 0.48, 0.45), (0.25, 0.24, 0.26)), (3, 8, 8))
    return TensorDataset(x, torch.randint(0, 10, (n,), generator=g), 10, train, evaluation)


@pytest.mark.parametrize("padding_mode", ["zero", "reflect"])
def test_uint8_images_are_converted_and_normalised_by_one_lookup_bitwise(padding_mode: PaddingMode) -> None:
    """On uint8 images, ToFloat and the Normalize after it are one lookup in a vectorised step
    (`_pixel_table`): every pixel of every node's batch is, bit for bit, what its own train_batch gives."""
    data = synthetic_uint8_images(40, Augment(crop=8, padding=2, padding_mode=padding_mode, flip=True))
    parts = shards(data, (5, 16, 1))
    steps = known_steps(data.train_transform)  # type: ignore[arg-type]
    assert steps is not None and [type(s) for s in steps[-2:]] == [ToFloat, Normalize]
    idx = [torch.arange(len(p)) for p in parts]
    alone = torch.cat([p.train_batch(i, g)[0] for p, i, g in zip(parts, idx, generators(3), strict=True)])
    together = augment_nodes(torch.cat([p.x for p in parts]), [len(p) for p in parts], steps, generators(3))
    assert alone.dtype == together.dtype == torch.float32 and torch.equal(alone, together)
    every_value = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).expand(1, 3, 16, 16)
    assert torch.equal(augment_nodes(every_value, [1], steps[-2:], generators(1)), Normalize(
        (0.49, 0.48, 0.45), (0.25, 0.24, 0.26))(ToFloat()(every_value, None), None))  # fmt: skip


def test_vectorized_training_on_uint8_images_is_one_by_one() -> None:
    """The lookup inside a whole vectorised round: each node's model as local_sgd trains it alone."""
    data = synthetic_uint8_images(60, Augment(crop=8, padding=2, padding_mode="reflect", flip=True))
    model = build_model("mlp", data.input_shape, 10, seed=0)
    datasets = shards(data, (20, 7, 33))
    for (want, _), (state, _) in zip(
        one_by_one(model, datasets, SGD), train_vectorized(model, datasets, SGD, generators(3)), strict=True
    ):
        assert_as_local_sgd(state, want, SGD)


@pytest.mark.parametrize("images", ["uint8 rgb", "digits"])
@pytest.mark.parametrize(("pipeline", "rows_a_call"), [("off", 0), ("on", 0), ("off", 150)])
def test_batches_made_before_the_steps_train_bitwise_as_made_in_each_step(
    digits: TensorDataset, images: str, pipeline: str, rows_a_call: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step's augmented batch made for a chunk of the plan before its steps run (`round_plan.BATCH_ROOM`,
    under `outputs_ahead`: on a GPU), a step's or several steps' batches a call (150 rows: 2 steps of 3 nodes
    of 16), pipelined or not, trains every node of a convolutional model bitwise as the batch made in each
    step (a CPU's way); in kept rounds too. On uint8 RGB images (crop with reflection, flip, the pixel
    lookup) and on the 1-channel digits (crop, flip), whose batch a CPU convolution would treat by its
    strides."""
    from fedmq.fedcore import round_plan, vectorized

    monkeypatch.setattr(vectorized, "CPU_OUTPUT_ROWS", rows_a_call)
    if images == "digits":
        data = load_dataset("digits", seed=0, augment={"crop": 8, "padding": 1, "flip": True}).train
    else:
        data = synthetic_uint8_images(60, Augment(crop=8, padding=2, padding_mode="reflect", flip=True))
    datasets = shards(data, (20, 7, 33))
    model = build_model("cnn", data.input_shape, 10, seed=0)
    settings = dataclasses.replace(SGD, batch_size=16, local_epochs=2)
    with round_plan.outputs_ahead("off"):
        want = train_vectorized(model, datasets, settings, generators(3))
    with round_plan.outputs_ahead("on"), round_plan.plan_pipeline(pipeline):
        got = [train_vectorized(model, datasets, settings, generators(3))]
        with vectorized.keep_rounds():
            got += [train_vectorized(model, datasets, settings, generators(3)) for _ in range(2)]
    for results in got:
        for (state, stats), (state_want, stats_want) in zip(results, want, strict=True):
            assert stats == stats_want
            assert all(torch.equal(state[k], state_want[k]) for k in state_want)


def test_batches_of_a_round_too_large_for_the_device_are_made_in_each_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round whose augmented batches would take more than `BATCH_AHEAD_BYTES` makes each step's batch in
    the step, though `outputs_ahead` asks for them ahead (they would stay on the device until the round
    ends); below it, the round fills them ahead. The same training either way."""
    from fedmq.fedcore import round_plan, vectorized

    data = synthetic_uint8_images(60, Augment(crop=8, padding=2, padding_mode="reflect", flip=True))
    datasets = shards(data, (20, 7, 33))
    model = build_model("cnn", data.input_shape, 10, seed=0)
    fills: list[int] = []
    fill = vectorized._Round._fill_outputs
    monkeypatch.setattr(vectorized._Round, "_fill_outputs", lambda self, *a: fills.append(1) or fill(self, *a))
    results = []
    with round_plan.outputs_ahead("on"):
        # 3 nodes x 4 steps (2 epochs of 33 rows: 16, 16, and a last row of 1 left out) x 16 rows of 3 x 8 x 8
        # float32: 147,456 bytes
        for limit in (147_456, 147_455):
            monkeypatch.setattr(vectorized, "BATCH_AHEAD_BYTES", limit)
            fills.clear()
            results.append((train_vectorized(model, datasets, SGD, generators(3)), len(fills)))
    (ahead, ahead_fills), (in_step, in_step_fills) = results
    assert ahead_fills > 0 and in_step_fills == 0
    for (state, _), (state_in_step, _) in zip(ahead, in_step, strict=True):
        assert all(torch.equal(state[k], state_in_step[k]) for k in state)


def doubled_corner(x: torch.Tensor) -> torch.Tensor:
    """A frozen function of a batch, elementwise (so bitwise the same on any batch it is part of)."""
    return x.flatten(1)[:, :3] * 2.0


def corner_objective(corner: Callable[[NodeBatch], torch.Tensor]) -> Callable[[NodeBatch], torch.Tensor]:
    """The cross-entropy plus a term that reads `corner(batch)`, a frozen function of the step's batch."""

    def objective(batch: NodeBatch) -> torch.Tensor:
        logits = batch.logits()
        term = (corner(batch) * logits[:, :3]).sum(-1)
        return batch.mean(nll(logits, batch.y).add(term, alpha=0.1))

    return objective


@pytest.mark.parametrize("transform", ["known", "its own"])
@pytest.mark.parametrize(
    ("ahead", "pipeline", "rows_a_call"), [("on", "off", 0), ("on", "on", 0), ("on", "off", 500), ("off", "off", 0)]
)
def test_batch_outputs_are_made_before_the_steps_on_the_steps_own_batches(
    digits: TensorDataset, transform: str, ahead: str, pipeline: str, rows_a_call: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `BatchOutput` made for each chunk of the plan before its steps run (`OUTPUTS_AHEAD`: on a GPU), from
    the batches as the steps augment them (a transform the step knows: crop and flip; or one of the node's
    own, applied in the plan; a step's batch or several steps' a call), or inside each step (on a CPU),
    trains every node bitwise as the objective computing it itself at every step; inside `keep_rounds` too."""
    from fedmq.fedcore import round_plan, vectorized

    monkeypatch.setattr(vectorized, "CPU_OUTPUT_ROWS", rows_a_call)  # 500: 7 steps a call, as on a GPU
    data = load_dataset("digits", seed=0, augment={"crop": 8, "padding": 1, "flip": True}).train
    data = data if transform == "known" else dataclasses.replace(data, train_transform=GaussianNoise())
    datasets = shards(data, (40, 17, 1, 33))
    model = build_model("mlp", data.input_shape, 10, seed=0)
    made = round_plan.BatchOutput(doubled_corner, (3,))
    inline = corner_objective(lambda batch: doubled_corner(batch.x))
    reading = corner_objective(lambda batch: batch.step["corner"])

    def made_ahead() -> list[tuple[dict[str, torch.Tensor], TrainStats]]:
        outputs = {"corner": made}
        return train_vectorized(model, datasets, SGD, generators(4), objective=reading, keep_as="a", outputs=outputs)

    with round_plan.plan_pipeline(pipeline), round_plan.outputs_ahead(ahead):
        want = train_vectorized(model, datasets, SGD, generators(4), objective=inline, keep_as="inline")
        got = made_ahead()
        with vectorized.keep_rounds():
            kept = [made_ahead(), made_ahead()]
    for results in (got, *kept):
        for (state, stats), (state_want, stats_want) in zip(results, want, strict=True):
            assert stats == stats_want
            assert all(torch.equal(state[k], state_want[k]) for k in state_want)
    far = train_vectorized(model, datasets, SGD, generators(4))  # the term moves the nodes
    assert max_difference(far[0][0], want[0][0]) > 100 * ATOL


@dataclasses.dataclass(frozen=True)
class GaussianNoise:
    """A transform augment_nodes does not know: each node then transforms its own batch."""

    std: float = 0.1

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        if generator is None:
            return x
        return x + self.std * torch.randn(x.shape, generator=generator, device=generator.device).to(x.device)


def test_vectorized_with_an_unknown_transform_transforms_node_by_node(digits: TensorDataset) -> None:
    noisy = dataclasses.replace(digits, train_transform=GaussianNoise())
    assert known_steps(GaussianNoise()) is None
    model = build_model("mlp", digits.input_shape, 10, seed=0)
    datasets = shards(noisy, (20, 7, 33))
    for (want, _), (state, _) in zip(
        one_by_one(model, datasets, SGD), train_vectorized(model, datasets, SGD, generators(3)), strict=True
    ):
        assert_as_local_sgd(state, want, SGD)


def test_vectorized_node_out_of_batches_stops_moving_with_its_momentum(digits: TensorDataset) -> None:
    """With momentum 0.9 and weight decay, a node whose one batch is used up keeps its weights from
    then on (a further step would move it by lr x momentum x buffer), and an empty shard never moves."""
    settings = TrainSettings(batch_size=8, lr=0.1, momentum=0.9, weight_decay=0.1)
    model = build_model("mlp", digits.input_shape, 10, seed=1)
    start = copy.deepcopy(model.state_dict())
    datasets = [*shards(digits, (5, 64)), digits.subset(torch.arange(0).numpy())]
    got = train_vectorized(model, datasets, settings, generators(3))
    assert [s.steps for _, s in got] == [1, 8, 0]
    one_step = one_by_one(model, datasets[:1], settings)[0][0]
    assert max_difference(got[0][0], one_step) < ATOL
    two_steps = copy.deepcopy(model)
    local_sgd(two_steps, datasets[0], TrainSettings(**{**settings.to_meta(), "local_epochs": 2}), generators(1)[0])
    assert max_difference(got[0][0], two_steps.state_dict()) > 100 * ATOL, "the test cannot tell a moving node"
    assert all(torch.equal(got[2][0][k], start[k]) for k in start)
    assert got[2][1] == TrainStats(loss=0.0, steps=0, samples_seen=0)


def test_carried_state_follows_each_nodes_own_steps_and_stops_with_them(digits: TensorDataset) -> None:
    """A carried state (a step counter, the labels seen per class) is each node's own: it advances with
    the node's steps, holds still once the node has no batch left, and never sees the padding; an
    objective that returns other names than it was given is refused."""
    settings = TrainSettings(batch_size=8, lr=0.1, local_epochs=2)
    model = build_model("mlp", digits.input_shape, 10, seed=1)
    datasets = [*shards(digits, (5, 64, 13)), digits.subset(torch.arange(0).numpy())]
    start = {"steps": torch.tensor([0.0, 10.0, 20.0, 30.0]), "seen": torch.zeros(4, 10)}

    def objective(batch: NodeBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        labels = (batch.y.unsqueeze(1) == torch.arange(10)).to(batch.weight.dtype) * batch.weight.unsqueeze(1)
        carried = {"steps": batch.carry["steps"] + 1, "seen": batch.carry["seen"] + labels.sum(0)}
        return batch.mean(nll(batch.logits(), batch.y)), {}, carried

    got = train_vectorized(model, datasets, settings, generators(4), objective=objective, carry=start)
    for k, (data, (_, stats)) in enumerate(zip(datasets, got, strict=True)):
        assert float(stats.carry["steps"]) == start["steps"][k] + stats.steps
        assert torch.equal(stats.carry["seen"], torch.bincount(data.y, minlength=10).float() * 2)
    assert [s.steps for _, s in got] == [2, 16, 4, 0]

    def renamed(batch: NodeBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return batch.mean(nll(batch.logits(), batch.y)), {}, {"other": batch.carry["steps"]}

    with pytest.raises(VectorizeError, match="carried"):
        train_vectorized(model, datasets, settings, generators(4), objective=renamed, carry=start)
    with pytest.raises(ValueError, match="carry 'steps' holds 3 rows for 4 nodes"):
        train_vectorized(
            model, datasets, settings, generators(4), objective=objective, carry={**start, "steps": start["steps"][:3]}
        )


def test_summed_gradients_are_each_nodes_steps_and_zero_without_any(digits: TensorDataset) -> None:
    """With plain SGD a node's weights move by -lr times its summed gradients, so the sums equal
    (start - end) / lr per node; with no step anywhere (every shard empty) they are zeros, and a
    carried state comes back as it was given."""
    settings = TrainSettings(batch_size=8, lr=0.1, momentum=0.0, local_epochs=2)
    model = build_model("mlp", digits.input_shape, 10, seed=1).double()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    data = dataclasses.replace(digits, x=digits.x.double())
    got = train_vectorized(model, shards(data, (5, 21)), settings, generators(2), sum_gradients=True)
    for state, stats in got:
        assert stats.steps > 0
        for name, total in stats.gradient_sums.items():
            torch.testing.assert_close(total, (start[name] - state[name]) / settings.lr, rtol=0, atol=1e-10)
    empty = [digits.subset(torch.arange(0).numpy())] * 2
    carry = {"n": torch.tensor([3.0, 4.0])}
    none = train_vectorized(model, empty, settings, generators(2), sum_gradients=True, carry=carry)
    assert all(float(t.abs().sum()) == 0.0 for _, stats in none for t in stats.gradient_sums.values())
    assert [float(stats.carry["n"]) for _, stats in none] == [3.0, 4.0]


def test_vectorized_results_do_not_alias_the_model_or_each_other(digits: TensorDataset) -> None:
    """The returned weights are fresh tensors: loading another model into the template leaves them."""
    model = build_model("mlp", digits.input_shape, 10, seed=0)
    got = train_vectorized(model, shards(digits, (20, 20)), SGD, generators(2))
    before = copy.deepcopy(got[0][0])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    got[1][0]["net.1.weight"].add_(1.0)
    assert all(torch.equal(before[k], got[0][0][k]) for k in before)


@pytest.mark.parametrize(("name", "options"), [("resnet18", {"norm": "bn"}), ("mobilenetv2", {})])
def test_vectorized_refuses_batchnorm_outside_fedavgs_objective(name: str, options: dict[str, object]) -> None:
    """BatchNorm is trained vectorised on FedAvg's objective only (tests/fedcore/test_vectorized_batch_norm.py):
    otherwise refused with the reason, never trained wrong."""
    model = build_model(name, (3, 32, 32), 10, seed=0, **options)
    assert "BatchNorm" in (unsupported(model) or "") and unsupported(model, batch_norm=True) is None
    data = TensorDataset(torch.zeros(4, 3, 32, 32), torch.zeros(4, dtype=torch.long), 10)
    with pytest.raises(VectorizeError, match="BatchNorm"):
        train_vectorized(model, [data], SGD, generators(1), objective=lambda batch: cross_entropy_objective(batch))


def test_vectorized_refuses_dropout_and_accepts_groupnorm() -> None:
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    assert "dropout" in (unsupported(net) or "")
    assert unsupported(build_model("resnet18", (3, 32, 32), 10, seed=0, norm="gn")) is None


def _members(method: str, datasets: Sequence[TensorDataset], state: dict[str, torch.Tensor]) -> list[GroupMember]:
    spec = get_algorithm(method)
    hp = build_hyperparams(spec, {})
    payload = Payload(tensors={"model": state})
    return [
        GroupMember(
            half=spec.node(hp, node_id=f"node-{i}"),
            task=TaskInput(node_id=f"node-{i}", round=0, payload=payload, settings=SGD),
            data=data,
            generator=gen,
        )
        for i, (data, gen) in enumerate(zip(datasets, generators(len(datasets)), strict=True))
    ]


@pytest.mark.parametrize("method", ["fedavg", "fedavgm", "noop"])
def test_group_training_of_a_method_equals_its_train_per_node(digits: TensorDataset, method: str) -> None:
    """train_group gives each member what train gives it (FedAvg's node half, which FedAvgM reuses;
    noop's), starting from the broadcast model whatever the workspace held before."""
    state = build_model("cnn", digits.input_shape, 10, seed=5).state_dict()
    datasets = shards(digits, (30, 12, 3))
    members = _members(method, datasets, state)
    workspace = build_model("cnn", digits.input_shape, 10, seed=6)
    assert members[0].half.group_refusal(workspace) is None
    grouped = members[0].half.train_group(members, workspace)
    for member, payload in zip(_members(method, datasets, state), grouped, strict=True):
        alone = member.half.train(member.task, copy.deepcopy(workspace), member.data, member.generator)
        assert set(payload.meta) == set(alone.meta) and payload.meta["steps"] == alone.meta["steps"]
        assert payload.meta["loss"] == pytest.approx(alone.meta["loss"], rel=RTOL, abs=ATOL)
        assert max_difference(payload.tensors["model"], alone.tensors["model"]) < ATOL
        assert payload.tensors["model"]["classifier.3.bias"].data_ptr() != workspace.classifier[3].bias.data_ptr()


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_every_built_in_method_trains_in_groups(model: str) -> None:
    """Every method fedmq ships has a group form at its defaults (FedACD's clean P too), on both
    models of these tests: `fedmq simulate` trains none of them one by one."""
    from fedmq.fedcore.algorithms import ALGORITHMS

    net = build_model(model, (1, 8, 8), 10, seed=0)
    settings = [(name, {}) for name in ALGORITHMS] + [("fedacd", {"p_estimate": "clean"})]
    refused = {}
    for name, hp in settings:
        spec = get_algorithm(name)
        reason = spec.node(build_hyperparams(spec, hp), node_id="node-0").group_refusal(net)
        if reason is not None:
            refused[name] = reason
    assert refused == {} and len(settings) == 21


def test_a_loss_term_method_without_a_group_term_trains_one_by_one() -> None:
    """Every shipped loss-term method writes its objective as a GroupTerm; one of a user's that writes
    only `objective` is refused group training, saying so."""
    from fedmq.fedcore.algorithms import shared

    class OwnTerm(shared.LossTermNode):
        def objective(self, task, model, data):  # type: ignore[no-untyped-def]
            return None

    half = OwnTerm(build_hyperparams(get_algorithm("fedavg"), {}), node_id="node-0")
    assert "no vectorised form" in (half.group_refusal(build_model("mlp", (1, 8, 8), 10, seed=0)) or "")


def test_a_subclass_that_changes_train_does_not_inherit_group_training() -> None:
    """A node half that subclasses FedAvg's and changes `train` (as FedDisco does, which therefore
    writes its `train_group` beside it) trains one by one until it has a group form of its own."""
    from fedmq.fedcore.algorithms import fedavg

    class Changed(fedavg.NodeHalf):
        def train(self, task, model, data, generator):  # type: ignore[no-untyped-def]
            return super().train(task, model, data, generator)

    half = Changed(build_hyperparams(get_algorithm("fedavg"), {}), node_id="node-0")
    assert "no group form" in (half.group_refusal(build_model("mlp", (1, 8, 8), 10, seed=0)) or "")
    with pytest.raises(AlgorithmError, match="group"):
        half.train_group([], build_model("mlp", (1, 8, 8), 10, seed=0))


def test_a_loss_term_method_that_trains_otherwise_refuses_group_training() -> None:
    """A subclass that changes `fit` without a `fit_group` beside it (FedRCL has both) trains one by one."""
    from fedmq.fedcore.algorithms import fedprox

    class Refitted(fedprox.NodeHalf):
        fit = fedprox.NodeHalf.fit  # defined here, not on LossTermNode

    half = Refitted(fedprox.Hyperparams(mu=0.1), node_id="node-0")
    assert "overrides fit" in (half.group_refusal(build_model("mlp", (1, 8, 8), 10, seed=0)) or "")


def test_fedavg_trains_a_batchnorm_model_in_groups_and_moon_refuses() -> None:
    model = build_model("resnet32", (3, 32, 32), 10, seed=0)
    for method, refused in (("fedavg", False), ("moon", True)):
        spec = get_algorithm(method)
        half = spec.node(build_hyperparams(spec, {}), node_id="node-0")
        assert ("BatchNorm" in (half.group_refusal(model) or "")) is refused, method


def test_group_of_different_tasks_is_an_error(digits: TensorDataset) -> None:
    state = build_model("mlp", digits.input_shape, 10, seed=0).state_dict()
    members = _members("fedavg", shards(digits, (8, 8)), state)
    other = GroupMember(
        half=members[1].half,
        task=TaskInput(node_id="node-1", round=0, payload=members[1].task.payload, settings=ADAM),
        data=members[1].data,
        generator=members[1].generator,
    )
    with pytest.raises(ValueError, match="another task"):
        members[0].half.train_group([members[0], other], build_model("mlp", digits.input_shape, 10, seed=0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_vectorized_on_gpu_with_resident_data_equals_one_by_one(digits: TensorDataset) -> None:
    """Data, augmentation and generators on the GPU, in float64 (float32 convolutions may use TF32 there):
    every weight within 1e-10 of one-by-one training on the GPU."""
    cuda = torch.device("cuda")
    model = build_model("cnn", digits.input_shape, 10, seed=0).to(cuda, torch.float64)
    datasets = [d.to(cuda) for d in shards(dataclasses.replace(digits, x=digits.x.double()), SIZES)]
    assert_each_node_as_local_sgd_on(cuda, model, datasets, SGD)


def assert_each_node_as_local_sgd_on(
    device: torch.device,
    model: torch.nn.Module,
    datasets: Sequence[TensorDataset],
    settings: TrainSettings,
    graphs: str | None = None,
) -> None:
    """Every node of a vectorised round on `device` (generators there too) within 1e-10 of its own
    local_sgd there, and trained (float64)."""
    expected = []
    for i, data in enumerate(datasets):
        copy_ = copy.deepcopy(model)
        local_sgd(copy_, data, settings, torch_generator(3, "node-train", f"node-{i}", 0, device=device))
        expected.append(copy_.state_dict())
    gens = [torch_generator(3, "node-train", f"node-{i}", 0, device=device) for i in range(len(datasets))]
    got = train_vectorized(model, datasets, settings, gens, graphs=graphs)
    for want, (state, stats) in zip(expected, got, strict=True):
        assert stats.steps > 0 and max_difference(state, want) < 1e-10


@pytest.mark.parametrize(
    ("augment", "settings"),
    [
        ({"crop": 8, "padding": 1, "flip": True}, SGD),
        ({"crop": 6, "rotation_deg": 15.0, "flip": True}, dataclasses.replace(SGD, drop_last=True)),
        ("none", dataclasses.replace(SGD, local_epochs=3, batch_size=5)),
    ],
)
def test_the_plan_drawn_an_epoch_at_a_time_is_the_plan_drawn_a_step_at_a_time(
    augment: object, settings: TrainSettings
) -> None:
    """Every row, weight, count and random value of the batched plan is bitwise the per-step one, for
    shards of one sample, a trailing batch of one, an empty shard and long ones."""
    from fedmq.fedcore.round_plan import _plan

    data = load_dataset("digits", seed=0, augment=augment).train
    datasets = [*shards(data, SIZES), data.subset(torch.arange(0).numpy())]
    steps = known_steps(data.train_transform) if data.train_transform is not None else []
    count = [settings.local_epochs * steps_per_epoch(len(d), settings.batch_size, settings.drop_last) for d in datasets]
    offsets = [0, *torch.tensor([len(d) for d in datasets]).cumsum(0).tolist()[:-1]]
    plans = [
        _plan(datasets, settings, generators(len(datasets)), steps, offsets, max(count), torch.float32, torch.device("cpu"),
              batched=batched, pipelined=pipelined)
        for batched, pipelined in ((True, False), (True, True), (False, False))
    ]  # fmt: skip
    fast, chunked, slow = plans
    assert len(chunked.bounds) > 3 and chunked.bounds[-1] == max(count)  # several chunks, drawn as needed
    for plan in (fast, chunked):
        assert plan.layout == slow.layout
        for name in slow.layout:
            assert torch.equal(plan.field(name), slow.field(name)), name
        assert torch.equal(plan.seen, slow.seen) and float(slow.seen.sum()) > 0
    draws = [slow.field(name) for name in slow.layout if name.startswith("draw")]
    assert not steps or (draws and any(bool(d.any()) for d in draws))


@pytest.mark.parametrize("settings", [SGD, dataclasses.replace(SGD, local_epochs=3, batch_size=5, drop_last=True)])
def test_an_objectives_draws_between_the_batches_are_the_plan_drawn_a_step_at_a_time(settings: TrainSettings) -> None:
    """KDIA's noise, drawn from the node's stream after each batch's augmentation: the plan drawn an epoch at
    a time (the uniform values a batch at a time between them) is bitwise the per-step plan, rows, draws and
    the objective's own values alike, and leaves each node's generator where the per-step drawing does."""
    from fedmq.fedcore.algorithms.kdia import _GeneratedDraws
    from fedmq.fedcore.algorithms.kdia.generator import build_generator
    from fedmq.fedcore.round_plan import _plan

    data = load_dataset("digits", seed=0, augment={"crop": 8, "padding": 1, "flip": True}).train
    datasets = [*shards(data, SIZES), data.subset(torch.arange(0).numpy())]
    steps = known_steps(data.train_transform)  # type: ignore[arg-type]
    count = [settings.local_epochs * steps_per_epoch(len(d), settings.batch_size, settings.drop_last) for d in datasets]
    offsets = [0, *torch.tensor([len(d) for d in datasets]).cumsum(0).tolist()[:-1]]
    model = build_model("cnn", data.input_shape, 10, seed=0)

    class Drawn(_GeneratedDraws):  # the draws as drawn, not the generator's features of them
        def prepare(self, drawn: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return drawn

    plans, after = [], []
    for batched, pipelined in ((True, False), (True, True), (False, False)):
        gens = generators(len(datasets))
        plans.append(
            _plan(datasets, settings, gens, steps, offsets, max(count), torch.float32, torch.device("cpu"),
                  Drawn(build_generator(4, model), 4), batched=batched, pipelined=pipelined)
        )  # fmt: skip
        plans[-1].field("rows")  # every chunk drawn, as a round's last step has them
        after.append([g.get_state() for g in gens])
    slow = plans[-1]
    assert len(plans[1].chunks) > 2  # several chunks, drawn as needed
    for plan, states in zip(plans[:2], after[:2], strict=True):
        assert plan.layout == slow.layout and {"step.y_gen", "step.z"} <= set(slow.layout)
        for name in slow.layout:
            assert torch.equal(plan.field(name), slow.field(name)), name
        assert all(torch.equal(a, b) for a, b in zip(states, after[-1], strict=True))
    assert float(slow.field("step.z").abs().sum()) > 0


def test_epoch_start_renews_each_nodes_state_before_each_of_its_epochs_but_the_first(digits: TensorDataset) -> None:
    """`epoch_start(k, params)` runs before the first step of each of node k's epochs but the first, with
    k in the caller's order and the node's parameters as they are then; a state under other names is refused."""
    settings = TrainSettings(batch_size=8, lr=0.1, local_epochs=3)
    model = build_model("mlp", digits.input_shape, 10, seed=1)
    datasets = [*shards(digits, (5, 64, 13)), digits.subset(torch.arange(0).numpy())]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls: list[tuple[int, float]] = []

    def renew(k: int, params: dict[str, torch.Tensor], carried: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        moved = max(float((params[n] - start[n]).abs().max()) for n in start)
        calls.append((k, moved))
        assert float(carried["epochs"]) == sum(1 for j, _ in calls[:-1] if j == k)  # the node's own, as it is now
        return {"epochs": carried["epochs"] + 1.0}

    def objective(batch: NodeBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return batch.mean(nll(batch.logits(), batch.y)), {}, {"epochs": batch.carry["epochs"]}

    carry = {"epochs": torch.zeros(4)}
    got = train_vectorized(
        model, datasets, settings, generators(4), objective=objective, carry=carry, epoch_start=renew
    )
    assert sorted(k for k, _ in calls) == [0, 0, 1, 1, 2, 2]  # 3 epochs: 2 renewals each; none for the empty shard
    assert all(moved > 0 for _, moved in calls)  # the node's trained parameters, not the start
    assert [float(stats.carry["epochs"]) for _, stats in got] == [2.0, 2.0, 2.0, 0.0]
    with pytest.raises(VectorizeError, match="epoch_start gave"):
        train_vectorized(
            model, datasets, settings, generators(4), objective=objective, carry=carry,
            epoch_start=lambda k, params, carried: {"other": torch.zeros(())},
        )  # fmt: skip


def _kept_tensors(round_: object) -> list[torch.Tensor]:
    """Every tensor a captured step of the round reads or writes: what must keep its address."""
    from fedmq.fedcore.transforms import CropTables
    from fedmq.fedcore.vectorized import _Round

    assert isinstance(round_, _Round)
    cur = round_.cur
    found = [*round_.stack.params.values(), *(t for v in round_.stack.state.values() for t in v), round_.stack.step]
    found += [*round_.start.values(), *round_.frozen.values(), round_.y, round_.totals]
    found += [round_.lr.fused, round_.lr.negative, round_.lr.exact]
    found += [
        t
        for made in round_.constants.values()
        for t in ((made.rows, made.columns) if isinstance(made, CropTables) else made)
    ]
    found += [cur.bytes] + ([round_.x] if round_.x is not None else [])  # every per-step tensor views `bytes`
    return found


@pytest.mark.parametrize("settings", [SGD, ADAM], ids=["sgd-momentum", "adam"])
def test_a_kept_round_trains_later_calls_bitwise_as_fresh_rounds_in_the_same_buffers(
    digits: TensorDataset, settings: TrainSettings
) -> None:
    """Inside `keep_rounds`, calls of one shape train in the first call's round, its buffers refilled in
    place (what lets a GPU replay the graphs captured by the first call): each call's weights and stats
    are bitwise a fresh round's, for other nodes, another starting model, another lr (a decaying one),
    fewer rows and more rows than the round holds (a new round then); no returned weight is overwritten
    by a later call; a call of another objective is not kept."""
    from fedmq.fedcore import vectorized

    perm = torch.randperm(len(digits), generator=torch.Generator().manual_seed(3))
    sizes = [(40, 17, 1, 33), (20, 35, 9, 2), (64, 64, 64, 64), (5, 5, 5, 5)]
    calls, at = [], 0
    for i, group in enumerate(sizes):
        parts = [digits.subset(perm[at + sum(group[:j]) : at + sum(group[: j + 1])].numpy()) for j in range(4)]
        at += sum(group)
        calls.append((parts, build_model("cnn", digits.input_shape, 10, seed=i % 2), settings.lr * 0.5**i))
    model = build_model("cnn", digits.input_shape, 10, seed=0)

    def train(
        parts: list[TensorDataset], start: torch.nn.Module, lr: float
    ) -> list[tuple[dict[str, torch.Tensor], TrainStats]]:
        model.load_state_dict(start.state_dict())
        return train_vectorized(model, parts, dataclasses.replace(settings, lr=lr), generators(4))

    fresh = [train(*call) for call in calls]
    with vectorized.keep_rounds():
        kept = vectorized.KEPT.get()
        assert kept is not None
        got = [train(*calls[0])]
        (first,) = kept.values()
        addresses = [t.data_ptr() for t in _kept_tensors(first.round)]
        got.append(train(*calls[1]))
        assert list(kept.values()) == [first]  # the same round, its tensors where they were
        assert [t.data_ptr() for t in _kept_tensors(first.round)] == addresses
        got += [train(*calls[2]), train(*calls[3])]  # more rows than the round holds: a new round, kept
        (second,) = kept.values()
        assert second is not first and second.capacity >= sum(sizes[2])
        train_vectorized(model, calls[0][0], settings, generators(4), objective=lambda b: cross_entropy_objective(b))
        assert list(kept.values()) == [second]
    for want, have in zip(fresh, got, strict=True):
        for (w_state, w_stats), (h_state, h_stats) in zip(want, have, strict=True):
            assert all(torch.equal(w_state[k], h_state[k]) for k in w_state)
            assert w_stats == h_stats


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kept_rounds_replay_the_first_calls_cuda_graphs_bitwise_as_fresh_rounds(digits: TensorDataset) -> None:
    """On a GPU with graphs, later calls in a kept round replay the graphs the first call captured (no
    warm-up, no capture): each call (each at its own lr) gets weights bitwise a fresh round's, and within 1e-10 of one-by-one
    training in float64; unequal shards, so both kinds of step (unmasked and masked) are replayed."""
    from fedmq.fedcore import vectorized

    cuda = torch.device("cuda")
    data64 = dataclasses.replace(digits, x=digits.x.double()).to(cuda)
    perm = torch.randperm(len(digits), generator=torch.Generator().manual_seed(3))
    groups = [shards(data64.subset(perm[i * 200 : (i + 1) * 200].numpy()), SIZES) for i in range(3)]
    model = build_model("cnn", digits.input_shape, 10, seed=0).to(cuda, torch.float64)

    settings = dataclasses.replace(SGD, local_epochs=6)  # 6 steps of each kind: (7), (4, masked), (2), (1)

    def train(parts: list[TensorDataset], i: int) -> list[tuple[dict[str, torch.Tensor], TrainStats]]:
        decayed = dataclasses.replace(settings, lr=settings.lr * 0.5**i)  # each call its own lr, one graph
        return train_vectorized(model, parts, decayed, generators(len(parts)), graphs="on")

    fresh = [train(parts, i) for i, parts in enumerate(groups)]
    with vectorized.keep_rounds():
        kept = [train(parts, i) for i, parts in enumerate(groups)]
        (round_,) = vectorized.KEPT.get().values()  # type: ignore[union-attr]
        # each kind of step (step_kind: the first b nodes, masked where fewer train), captured once
        assert set(round_.graphs) == {(7, False), (4, True), (2, False), (1, False)}
    for i, (parts, want, have) in enumerate(zip(groups, fresh, kept, strict=True)):
        alone = one_by_one(model, parts, dataclasses.replace(settings, lr=settings.lr * 0.5**i))
        for (w_state, _), (h_state, _), (a_state, _) in zip(want, have, alone, strict=True):
            assert all(torch.equal(w_state[k], h_state[k]) for k in w_state)
            assert max_difference(h_state, a_state) < 1e-10


def test_rounds_are_not_kept_for_another_model_object_or_a_model_holding_loose_tensors(digits: TensorDataset) -> None:
    """A kept round reads its model object's tensors: a call on another model object (of the same class
    and shapes) builds its own round, a model holding a tensor outside its parameters and buffers (FedNH's
    wrapper holds its round's prototypes so) keeps none, and at most KEPT_ROUNDS rounds are kept."""
    from fedmq.fedcore import vectorized

    parts = shards(digits, (20, 30))

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_model("mlp", digits.input_shape, 10, seed=0)
            self.scale = torch.tensor(2.0)  # neither a parameter nor a buffer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x) * self.scale

    with vectorized.keep_rounds():
        kept = vectorized.KEPT.get()
        assert kept is not None
        train_vectorized(Scaled(), parts, SGD, generators(2))
        assert kept == {}
        models = [build_model("mlp", digits.input_shape, 10, seed=0) for _ in range(vectorized.KEPT_ROUNDS + 1)]
        for model in models:
            train_vectorized(model, parts, SGD, generators(2))
        assert [k.model for k in kept.values()] == models[1:]  # one per object, the oldest dropped


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_captured_by_threads_on_streams_of_their_own_are_each_threads_alone(digits: TensorDataset) -> None:
    """Cells simulated as threads of one process (`fedmq simulate --cells-per-process`) capture and replay
    their graphs at the same time, each thread on a CUDA stream of its own: each thread's weights are
    bitwise what the same call gives alone."""
    import threading

    from fedmq.experiments.simulate_grid import cell_stream

    cuda = torch.device("cuda")
    data = digits.to(cuda)
    perm = torch.randperm(len(digits), generator=torch.Generator().manual_seed(5))
    groups = [shards(data.subset(perm[i * 200 : (i + 1) * 200].numpy()), SIZES) for i in range(4)]
    models = [build_model("cnn", digits.input_shape, 10, seed=i).to(cuda) for i in range(4)]
    settings = dataclasses.replace(SGD, local_epochs=6)  # enough steps of each kind to capture both

    def train(i: int) -> list[tuple[dict[str, torch.Tensor], TrainStats]]:
        return train_vectorized(models[i], groups[i], settings, generators(len(SIZES)), graphs="on")

    alone = [train(i) for i in range(4)]
    together: list[list[tuple[dict[str, torch.Tensor], TrainStats]]] = [[] for _ in range(4)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with cell_stream("cuda"):
                together[i] = train(i)
                torch.cuda.current_stream().synchronize()
        except BaseException as exc:  # raised in the test's thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for want, have in zip(alone, together, strict=True):
        for (w_state, w_stats), (h_state, h_stats) in zip(want, have, strict=True):
            assert all(torch.equal(w_state[k], h_state[k]) for k in w_state)
            assert w_stats.loss == h_stats.loss


def test_a_keyed_call_laid_out_otherwise_gets_a_kept_round_of_its_own(digits: TensorDataset) -> None:
    """Under one key, calls whose buffers would lie otherwise (an epoch renewal or not, other inputs) each
    get a kept round of their own, and a call like the first trains in the first's: a kept round only ever
    copies in what fits its buffers."""
    from fedmq.fedcore import vectorized

    parts = shards(digits, (20, 30))
    model = build_model("mlp", digits.input_shape, 10, seed=0)
    carry = {"steps": torch.zeros(2)}

    def objective(batch: NodeBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return cross_entropy_objective(batch), {}, {"steps": batch.carry["steps"] + 1}

    def train(**extra: object) -> None:
        train_vectorized(model, parts, SGD, generators(2), objective=objective, carry=carry, keep_as="one key",
                         **extra)  # type: ignore[arg-type]  # fmt: skip

    with vectorized.keep_rounds():
        train()
        train(epoch_start=lambda k, params, carried: {"steps": torch.zeros(())})
        train(inputs={"w": torch.ones(2, 3)})
        train()
        held = vectorized.KEPT.get()
        assert held is not None and len(held) == 3


def test_a_plan_is_drawn_in_chunks_as_the_steps_need_them_where_that_overlaps_the_device() -> None:
    """Pipelined (auto on a CUDA device, where the host draws a chunk while the device trains the steps
    before it): a first chunk of two steps, each later one twice the one before, drawn when a step first
    needs it; on a CPU (nothing to overlap) one chunk, drawn before the first step."""
    from fedmq.fedcore.round_plan import _chunk_bounds, _pipelined, _plan, plan_pipeline

    assert _chunk_bounds(80, True) == [0, 2, 6, 14, 30, 62, 80]
    assert _chunk_bounds(8, False) == [0, 8] and _chunk_bounds(0, True) == [0, 0]
    cpu = torch.device("cpu")
    assert not _pipelined(cpu) and _pipelined(torch.device("cuda"))
    with plan_pipeline("on"):
        assert _pipelined(cpu)
    with plan_pipeline("off"):
        assert not _pipelined(torch.device("cuda"))
    with plan_pipeline("sometimes"), pytest.raises(ValueError, match="auto, on or off"):
        _pipelined(cpu)
    data = load_dataset("digits", seed=0, augment={"crop": 8, "padding": 1, "flip": True}).train
    datasets = shards(data, (64, 40))
    settings = dataclasses.replace(SGD, local_epochs=3)  # 4 + 3 steps an epoch: 12 steps
    plan = _plan(datasets, settings, generators(2), known_steps(data.train_transform), [0, 64], 12,  # type: ignore[arg-type]
                 torch.float32, cpu, pipelined=True)  # fmt: skip
    assert plan.bounds == [0, 2, 6, 12] and len(plan.chunks) == 1  # the first chunk only, before any step
    plan.row(5)
    assert len(plan.chunks) == 2
    plan.row(11)
    assert len(plan.chunks) == 3 and float(plan.seen.sum()) == 3 * (64 + 40)


@pytest.mark.parametrize("layout", ["contiguous", "a transposed gradient", "a transposed parameter"])
@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.0, 0.0), (0.9, 0.0), (0.9, 1e-3), (0.0, 1e-3)])
def test_the_stacks_sgd_update_is_torchs_sgd_step_for_every_node(
    momentum: float, weight_decay: float, layout: str
) -> None:
    """`_sgd_all` against torch.optim.SGD stepping the same tensors, two steps at two lrs (read from the
    device): torch's fused kernel, bitwise its fused form and its plain form to the last bits (a fused
    multiply-add rounds once), momentum buffers that start at zero as torch's first step's copy of the
    gradient. Large tensors (the vectorised kernels' paths) and small alike. The kernel reads every
    tensor as contiguous memory (a transposed gradient gave other weights): a transposed gradient is made
    contiguous, a transposed parameter takes the multi-tensor form."""
    from fedmq.fedcore.vectorized import _LearningRate, _sgd_all

    torch.manual_seed(0)
    shapes = [(4, 300_001), (4, 7), (4, 64, 3, 3)]
    params = [torch.randn(s) for s in shapes]
    if layout == "a transposed parameter":
        params[1] = torch.randn(7, 4).t()
    grads = [[torch.randn(s) * 1e-2 for s in shapes] for _ in range(2)]
    if layout == "a transposed gradient":
        grads[0][1] = grads[1][1] = torch.randn(7, 4).t() * 1e-2
    bufs = [torch.zeros(s) for s in shapes] if momentum else []
    settings = dataclasses.replace(SGD, momentum=momentum, weight_decay=weight_decay)
    lr = _LearningRate.of(0.0137, torch.float32, torch.device("cpu"))
    theirs = {fused: [nn.Parameter(p.clone()) for p in params] for fused in (True, False)}
    optimisers = {
        fused: torch.optim.SGD(ps, lr=0.0137, momentum=momentum, weight_decay=weight_decay, fused=fused)
        for fused, ps in theirs.items()
    }
    for step, rate in enumerate((0.0137, 0.02)):
        lr.set(rate)
        _sgd_all(params, [g.clone() for g in grads[step]], bufs, settings, lr)
        for fused, optimiser in optimisers.items():
            optimiser.param_groups[0]["lr"] = rate
            for p, g in zip(theirs[fused], grads[step], strict=True):
                p.grad = g.contiguous()
            optimiser.step()
    for p, t in zip(params, theirs[False], strict=True):
        torch.testing.assert_close(p, t.detach(), rtol=1e-6, atol=1e-8)
    if layout != "a transposed parameter":
        assert all(torch.equal(p, t) for p, t in zip(params, theirs[True], strict=True))
        want = [optimisers[True].state[t]["momentum_buffer"] for t in theirs[True]] if momentum else []
        assert all(torch.equal(b, w) for b, w in zip(bufs, want, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32-fused", "float64-multi-tensor"])
def test_the_stacks_sgd_update_captured_on_a_gpu_is_torchs_sgd_at_every_lr(dtype: torch.dtype) -> None:
    """On a CUDA device, `_sgd_all` captured once as a CUDA graph and replayed at two lrs (set on the device
    between replays, as a kept round sets them): torch.optim.SGD's weights, bitwise its fused form's in
    float32 (the fused kernel), and in float64 (the multi-tensor form, the fused kernel reading a device lr
    as float32) within float64 rounding of its plain form's."""
    from fedmq.fedcore.vectorized import _LearningRate, _sgd_all

    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 300_001), (4, 7), (4, 64, 3, 3)]
    params = [torch.randn(s, generator=gen, dtype=dtype).to(cuda) for s in shapes]
    grads = [[(torch.randn(s, generator=gen, dtype=dtype) * 1e-2).to(cuda) for s in shapes] for _ in range(2)]
    bufs = [torch.zeros_like(p) for p in params]
    settings = dataclasses.replace(SGD, momentum=0.9, weight_decay=1e-3)
    lr = _LearningRate.of(0.0137, dtype, cuda)
    fused = dtype == torch.float32
    theirs = [nn.Parameter(p.clone()) for p in params]
    optimiser = torch.optim.SGD(theirs, lr=0.0137, momentum=0.9, weight_decay=1e-3, fused=fused)
    step_grads = [torch.empty_like(p) for p in params]
    _sgd_all([p.clone() for p in params], [g.clone() for g in grads[0]], [b.clone() for b in bufs], settings, lr)
    torch.cuda.synchronize()  # warmed up outside the graph, on copies
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _sgd_all(params, step_grads, bufs, settings, lr)
    for step, rate in enumerate((0.0137, 0.02)):
        lr.set(rate)
        torch._foreach_copy_(step_grads, grads[step])
        graph.replay()
        optimiser.param_groups[0]["lr"] = rate
        for p, g in zip(theirs, grads[step], strict=True):
            p.grad = g.clone()
        optimiser.step()
    for p, t in zip(params, theirs, strict=True):
        if fused:
            assert torch.equal(p, t.detach())
        else:
            torch.testing.assert_close(p, t.detach(), rtol=1e-13, atol=1e-15)


def test_a_groupnorm_resnet_trains_vectorised_as_one_by_one_in_float64(digits: TensorDataset) -> None:
    """FedRCL's model, ResNet-18 with GroupNorm, whose GroupNorms a round runs as one over its nodes
    (`fedcore.layers_over_nodes`): every node its own local_sgd to 1e-12, clipping and momentum included."""
    data64 = dataclasses.replace(digits, x=digits.x.double())
    model = build_model("resnet18", digits.input_shape, 10, seed=0, norm="gn", stem="cifar").double()
    datasets = shards(data64, (9, 4, 12))
    settings = dataclasses.replace(SGD, local_epochs=1, batch_size=8)
    expected = one_by_one(model, datasets, settings)
    got = train_vectorized(model, datasets, settings, generators(len(datasets)))
    for (want_state, want), (state, stats) in zip(expected, got, strict=True):
        assert stats.steps == want.steps > 0
        assert max_difference(state, want_state) < 1e-12
        assert stats.loss == pytest.approx(want.loss, rel=1e-12)


@pytest.mark.parametrize("name", ["moon-cnn", "fedavg-cnn", "conv2cifar"])
def test_pools_over_the_nodes_train_bitwise_as_vmaps_own_rule(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CNNs' max-pooling, run on the nodes' channels as one batch's (`fedcore.layers_over_nodes`, no copy into
    node order), changes no bit of a vectorised round: a run recorded before replays."""
    from torch import nn

    from fedmq.fedcore import layers_over_nodes

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(60, 3, 32, 32, generator=gen), torch.randint(0, 10, (60,), generator=gen), 10)
    model = build_model(name, (3, 32, 32), 10, seed=0)
    datasets = shards(data, (20, 13, 27))
    settings = dataclasses.replace(SGD, batch_size=8)
    pooled = []
    forward = layers_over_nodes.MaxPool2dOverNodes.forward
    monkeypatch.setattr(
        layers_over_nodes.MaxPool2dOverNodes, "forward", lambda self, x: pooled.append(1) or forward(self, x)
    )
    ours = train_vectorized(model, datasets, settings, generators(3))
    assert pooled  # the pools ran over the nodes
    monkeypatch.setattr(layers_over_nodes, "_replaced", lambda m: type(m) in (nn.GroupNorm, nn.Linear))
    theirs = train_vectorized(model, datasets, settings, generators(3))
    for (state, stats), (want_state, want) in zip(ours, theirs, strict=True):
        assert stats.steps == want.steps > 0 and stats.loss == want.loss
        assert all(torch.equal(state[k], want_state[k]) for k in want_state)


def test_the_cross_entropy_over_the_nodes_trains_bitwise_as_the_gathered_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """`nll` as torch's `nll_loss` over every node's samples (`layers_over_nodes.negative_log_likelihood`)
    changes no bit of a vectorised round: a run recorded with the gathered form replays."""
    from fedmq.fedcore import layers_over_nodes, vectorized

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(60, 3, 32, 32, generator=gen), torch.randint(0, 10, (60,), generator=gen), 10)
    model = build_model("moon-cnn", (3, 32, 32), 10, seed=0)
    datasets = shards(data, (20, 13, 27))
    settings = dataclasses.replace(SGD, batch_size=8)
    ours = train_vectorized(model, datasets, settings, generators(3))
    monkeypatch.setattr(vectorized, "negative_log_likelihood", layers_over_nodes._gathered)
    theirs = train_vectorized(model, datasets, settings, generators(3))
    for (state, stats), (want_state, want) in zip(ours, theirs, strict=True):
        assert stats.steps == want.steps > 0 and stats.loss == want.loss
        assert all(torch.equal(state[k], want_state[k]) for k in want_state)


def _layers_over_nodes_as_one_by_one(device: torch.device, name: str, options: dict[str, object], graphs: str) -> None:
    """In float64 on `device`, every node of a vectorised round of `name` (its pooling, GroupNorm or
    BatchNorm run over the nodes, `fedcore.layers_over_nodes`) within 1e-10 of its own local_sgd."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(49, 3, 32, 32, generator=gen, dtype=torch.float64)
    data = TensorDataset(x, torch.randint(0, 10, (49,), generator=gen), 10)
    datasets = [d.to(device) for d in shards(data, (16, 9, 24))]
    model = build_model(name, (3, 32, 32), 10, seed=0, **options).to(device, torch.float64)
    assert_each_node_as_local_sgd_on(
        device, model, datasets, dataclasses.replace(SGD, local_epochs=1, batch_size=8), graphs
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("name", "options"),
    [("moon-cnn", {}), ("resnet18", {"norm": "gn", "stem": "cifar"}), ("resnet18", {"norm": "bn", "stem": "imagenet"})],
    ids=["pool", "groupnorm", "batchnorm-and-pool"],
)
def test_layers_over_nodes_in_captured_cuda_graphs_equal_one_by_one_on_gpu(
    name: str, options: dict[str, object]
) -> None:
    """The batching rules of `fedcore.layers_over_nodes` (2026-11-29, written without a GPU) inside the
    round's captured CUDA graphs: each node's own local_sgd on the GPU, in float64."""
    _layers_over_nodes_as_one_by_one(torch.device("cuda"), name, options, graphs="on")
