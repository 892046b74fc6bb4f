"""BatchNorm in vectorised training (`fedcore.masked_norm`) against `local_sgd` node by node.

Shards of unequal sizes make padded batches (9 and 2 samples in batches of 16, and the last batch of
40), so a batch statistic that counted the padding, or a running statistic updated for a node with no
batch left, would move weights by far more than rounding. In float64, SGD agrees to about 1e-15;
Adam to about 3e-12, measured: a bias just before a BatchNorm has a gradient that is rounding noise
(the normalisation removes it), which Adam scales to a step. Tolerances: 1e-12 with SGD, 1e-10 with Adam.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm
from fedmq.fedcore.data import TensorDataset, load_dataset
from fedmq.fedcore.masked_norm import MaskedBatchNorm, NormStep, masked_norms
from fedmq.fedcore.models import build_model
from fedmq.fedcore.training import TrainSettings, TrainStats
from fedmq.fedcore.vectorized import NodeBatch, VectorizeError, keep_rounds, nll, train_vectorized, unsupported
from tests.fedcore.captured_steps import every_step_whole
from tests.fedcore.test_vectorized import (
    ADAM,
    ATOL,
    RTOL,
    SGD,
    _members,
    generators,
    max_difference,
    one_by_one,
    shards,
)

SIZES = (40, 17, 33, 2, 64, 9)
"""Unequal shards as tests/fedcore/test_vectorized.py's, but for the single sample: torch refuses a
BatchNorm1d batch of one value per channel, so `local_sgd` cannot train that node to compare with."""


@pytest.fixture(scope="module")
def digits64() -> TensorDataset:
    data = load_dataset("digits", seed=0, augment={"crop": 8, "padding": 1, "flip": True}).train
    return dataclasses.replace(data, x=data.x.double())


def norm_net(
    momentum: float | None = 0.1, affine: bool = True, tracked: bool = True, second_momentum: float | None = -1.0
) -> nn.Module:
    """A conv with BatchNorm2d and a linear layer with BatchNorm1d, each preceded by a bias (whose
    gradient the normalisation cancels), in float64; the second BatchNorm's momentum is the first's unless
    `second_momentum` is given."""
    torch.manual_seed(0)
    second = momentum if second_momentum == -1.0 else second_momentum
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4, momentum=momentum, affine=affine, track_running_stats=tracked),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(256, 16),
        nn.BatchNorm1d(16, momentum=second, affine=affine, track_running_stats=tracked),
        nn.ReLU(),
        nn.Linear(16, 10),
    ).double()


def assert_each_node_is_its_own(
    got: Sequence[tuple[dict[str, torch.Tensor], TrainStats]],
    want: Sequence[tuple[dict[str, torch.Tensor], TrainStats]],
    tolerance: float,
) -> None:
    for (state, stats), (want_state, want_stats) in zip(got, want, strict=True):
        assert list(state) == list(want_state)  # the running statistics and batch counts included, in order
        assert max_difference(state, want_state) < tolerance
        assert stats.loss == pytest.approx(want_stats.loss, rel=1e-12)
        assert stats.steps == want_stats.steps


@pytest.mark.parametrize("settings", [SGD, ADAM], ids=["sgd-momentum", "adam"])
@pytest.mark.parametrize(
    "net",
    [{}, {"momentum": None}, {"affine": False}, {"tracked": False}, {"second_momentum": 0.3}],
    ids=["momentum-0.1", "cumulative", "no-affine", "batch-statistics-only", "two-momenta"],
)
def test_batch_norm_trained_vectorised_equals_one_by_one_in_float64(
    digits64: TensorDataset, settings: TrainSettings, net: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each node's weights, running statistics and batch counts are what local_sgd gives it alone, eagerly
    and with every step as a CUDA device replays it (masked where some nodes have no batch left)."""
    from fedmq.fedcore import vectorized

    model = norm_net(**net)  # type: ignore[arg-type]
    datasets = shards(digits64, SIZES)
    want = one_by_one(model, datasets, settings)
    tolerance = 1e-12 if settings.optimizer == "sgd" else 1e-10
    assert_each_node_is_its_own(train_vectorized(model, datasets, settings, generators(len(SIZES))), want, tolerance)
    monkeypatch.setattr(vectorized, "run_steps", every_step_whole)
    assert_each_node_is_its_own(train_vectorized(model, datasets, settings, generators(len(SIZES))), want, tolerance)
    if net.get("tracked", True):
        counts = [int(state["1.num_batches_tracked"]) for state, _ in want]
        assert counts == [stats.steps for _, stats in want] == [6, 2, 4, 2, 8, 2]


def test_the_padding_would_change_the_statistics(digits64: TensorDataset, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: the statistics over the whole padded batch (every sample's weight 1 in the
    masked BatchNorm, the masking switched off) move a padded node's running mean far beyond rounding."""
    from fedmq.fedcore import masked_norm

    model = norm_net()
    datasets = shards(digits64, (9, 32))  # node 0: one batch of 9, padded to 16; node 1: two full batches
    want = one_by_one(model, datasets, SGD)
    got = train_vectorized(model, datasets, SGD, generators(2))
    assert max_difference(got[0][0], want[0][0]) < 1e-12
    batch = masked_norm.NormStep.batch
    monkeypatch.setattr(masked_norm.NormStep, "batch", lambda self, weight: batch(self, torch.ones_like(weight)))
    wrong = train_vectorized(model, datasets, SGD, generators(2))
    assert float((wrong[0][0]["1.running_mean"] - want[0][0]["1.running_mean"]).abs().max()) > 1e-4
    assert max_difference(wrong[1][0], want[1][0]) < 1e-12, "node 1's batches were full: the same either way"


@pytest.mark.parametrize("batch_size", [1, 2, 7, 16])
@pytest.mark.parametrize("drop_last", [False, True])
def test_whole_batch_steps_are_those_where_no_training_node_pads(batch_size: int, drop_last: bool) -> None:
    """`whole_batch_steps`, from the shard sizes alone, against the batches `local_sgd` draws (`node_indices`):
    a step is whole exactly when every node that has a batch at it has `batch_size` samples."""
    from fedmq.fedcore.round_plan import node_indices, whole_batch_steps

    sizes = (40, 17, 33, 2, 64, 9, 1, 0, 14, 21)
    settings = dataclasses.replace(SGD, batch_size=batch_size, drop_last=drop_last, local_epochs=3)
    batches = [
        [
            len(idx)
            for idx in node_indices(TensorDataset(torch.zeros(n, 1), torch.zeros(n), 2), settings, torch.Generator())
        ]
        for n in sizes
    ]
    total = max(len(b) for b in batches)
    want = [batch_size > 1 and all(len(b) <= s or b[s] == batch_size for b in batches) for s in range(total)]
    assert whole_batch_steps(sizes, settings, total) == want
    if batch_size == 7 and not drop_last:
        assert True in want and False in want  # both kinds of step occur: the comparison can tell them apart


def test_whole_batches_take_torchs_batch_norm_and_padded_ones_the_masked_sums(
    digits64: TensorDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose nodes all have whole batches normalises with torch's own BatchNorm (two kernels, not
    the masked sums' dozens); a step where one pads takes the masked statistics; both agree with local_sgd."""
    from fedmq.fedcore import layers_over_nodes, masked_norm, vectorized

    calls = {"torch": 0, "masked": 0}
    batch_norm, counts = layers_over_nodes.F.batch_norm, masked_norm.NormStep.counts

    def torch_norm(*args: object, **kwargs: object) -> torch.Tensor:
        calls["torch"] += 1
        return batch_norm(*args, **kwargs)  # type: ignore[arg-type]

    def masked(self: NormStep, values: int, dtype: torch.dtype) -> masked_norm.Counts:
        calls["masked"] += 1
        return counts(self, values, dtype)

    monkeypatch.setattr(layers_over_nodes.F, "batch_norm", torch_norm)  # the kernel over the nodes (layers_over_nodes)
    monkeypatch.setattr(masked_norm.NormStep, "counts", masked)
    model = norm_net()
    datasets = shards(digits64, (40, 32, 48))  # steps 0, 1: all whole; step 2: node 0's 8 samples pad its batch
    want = one_by_one(model, datasets, SGD)
    calls.update(torch=0, masked=0)
    assert_each_node_is_its_own(train_vectorized(model, datasets, SGD, generators(3)), want, 1e-12)
    # 2 epochs of 3 steps, steps 2 and 5 padded; each of the 2 BatchNorms of a forward pass calls torch's or
    # asks for its counts once a step
    assert calls == {"torch": 2 * 4, "masked": 2 * 2}
    monkeypatch.setattr(vectorized, "run_steps", every_step_whole)  # each step as its captured kind replays it
    calls.update(torch=0, masked=0)
    assert_each_node_is_its_own(train_vectorized(model, datasets, SGD, generators(3)), want, 1e-12)
    assert calls == {"torch": 2 * 4, "masked": 2 * 2}
    calls.update(torch=0, masked=0)
    with masked_norm.masked_at_every_step():  # the bench's comparison: every step the masked sums, as before
        assert_each_node_is_its_own(train_vectorized(model, datasets, SGD, generators(3)), want, 1e-12)
    assert calls == {"torch": 0, "masked": 2 * 6}
    assert masked_norm.TORCH_AT_WHOLE_BATCHES.get()  # and only within the block


def test_kept_rounds_start_each_call_from_the_models_running_statistics(digits64: TensorDataset) -> None:
    """A round kept for the next call (`keep_rounds`) starts that call's nodes from the model's buffers,
    not from where the last call's nodes left theirs: bitwise what a fresh round gives."""
    model = norm_net()
    first, second = shards(digits64, (40, 17, 9)), shards(digits64, (33, 20, 12))
    fresh = train_vectorized(model, second, SGD, generators(3))
    with keep_rounds() as counts:
        train_vectorized(model, first, SGD, generators(3))
        kept = train_vectorized(model, second, SGD, generators(3))
    assert counts == {"built": 1, "reused": 1}
    for (state, _), (want, _) in zip(kept, fresh, strict=True):
        assert all(torch.equal(state[k], want[k]) for k in want)


def test_resnet_with_batch_norm_trains_vectorised_as_one_by_one_in_float64(digits64: TensorDataset) -> None:
    """The CIFAR ResNet (BatchNorm after every convolution, as FedSA's ResNet-18), on digits with the
    quickstart's training (lr 0.05, momentum 0.9, 2 epochs): every node its own local_sgd to 1e-10."""
    model = build_model("resnet32", digits64.input_shape, 10, seed=0).double()
    datasets = shards(digits64, (67, 30, 45, 12))
    settings = TrainSettings(local_epochs=2, batch_size=16, lr=0.05, momentum=0.9)
    assert_each_node_is_its_own(
        train_vectorized(model, datasets, settings, generators(4)), one_by_one(model, datasets, settings), 1e-10
    )


def test_resnet_with_batch_norm_trains_vectorised_as_one_by_one_in_float32() -> None:
    """The CIFAR ResNet (BatchNorm after every convolution, as FedSA's ResNet-18) on CIFAR-shaped images:
    float32 within the vectorised tests' tolerance, buffers included."""
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(40, 3, 16, 16, generator=gen), torch.randint(0, 10, (40,), generator=gen), 10)
    datasets = [data.subset(list(range(0, 22))), data.subset(list(range(22, 31))), data.subset(list(range(31, 40)))]
    model = build_model("resnet32", (3, 16, 16), 10, seed=0)
    settings = dataclasses.replace(SGD, local_epochs=1, batch_size=8)
    want = one_by_one(model, datasets, settings)
    got = train_vectorized(model, datasets, settings, generators(3))
    for (state, stats), (want_state, want_stats) in zip(got, want, strict=True):
        assert list(state) == list(want_state)
        for key in want_state:
            torch.testing.assert_close(state[key], want_state[key], atol=ATOL, rtol=RTOL)
        assert stats.loss == pytest.approx(want_stats.loss, rel=RTOL, abs=ATOL)


@pytest.mark.parametrize("method", ["fedavg", "fedsa", "fedavgm"])
def test_methods_that_train_as_fedavg_train_batch_norm_models_in_groups(method: str, digits64: TensorDataset) -> None:
    """FedSA's ResNet-18 has BatchNorm: FedAvg's node half (FedSA's and FedAvgM's) trains it in groups,
    each member what its own `train` gives it."""
    model = norm_net().float()
    datasets = [dataclasses.replace(d, x=d.x.float()) for d in shards(digits64, (30, 12, 3))]
    members = _members(method, datasets, model.state_dict())
    assert members[0].half.group_refusal(model) is None
    grouped = members[0].half.train_group(members, copy.deepcopy(model))
    for member, payload in zip(_members(method, datasets, model.state_dict()), grouped, strict=True):
        alone = member.half.train(member.task, copy.deepcopy(model), member.data, member.generator)
        assert max_difference(payload.tensors["model"], alone.tensors["model"]) < ATOL
        assert torch.equal(
            payload.tensors["model"]["1.num_batches_tracked"], alone.tensors["model"]["1.num_batches_tracked"]
        )


@pytest.mark.parametrize("method", ["moon", "fedprox", "kdia", "fedacd"])
def test_other_objectives_refuse_batch_norm_and_say_why(method: str) -> None:
    """Another objective may run the model more than once a step, or the global model's statistics
    (MOON, distillation): a BatchNorm model trains one by one, with the reason."""
    spec = get_algorithm(method)
    half = spec.node(build_hyperparams(spec, {}), node_id="node-0")
    assert "FedAvg's node objective only" in (
        half.group_refusal(build_model("resnet32", (3, 32, 32), 10, seed=0)) or ""
    )


def test_train_vectorized_refuses_batch_norm_with_an_objective_of_its_own() -> None:
    data = TensorDataset(torch.zeros(4, 3, 32, 32), torch.zeros(4, dtype=torch.long), 10)

    def twice(batch: NodeBatch) -> torch.Tensor:
        return batch.mean(nll(batch.logits(), batch.y)) + batch.mean(nll(batch.logits(), batch.y))

    model = build_model("mobilenetv2", (3, 32, 32), 10, seed=0)
    assert unsupported(model, batch_norm=True) is None
    with pytest.raises(VectorizeError, match="BatchNorm"):
        train_vectorized(model, [data], SGD, generators(1), objective=twice)


def test_a_buffer_of_another_module_is_still_refused() -> None:
    """Only BatchNorm's buffers are known to be what `masked_norm` updates."""
    net = norm_net()
    net[7].register_buffer("scale", torch.ones(10))
    assert "buffers (7.scale)" in (unsupported(net, batch_norm=True) or "")


def test_masked_norms_leaves_the_model_as_it_was() -> None:
    """The masked structure shares the model's tensors and modules where no BatchNorm is below them; the
    model's own modules, tables and names are unchanged."""
    model = build_model("resnet32", (3, 32, 32), 10, seed=0)
    before = [(name, type(m)) for name, m in model.named_modules()]
    tensors = {name: t.data_ptr() for name, t in model.state_dict().items()}
    masked = masked_norms(model, NormStep())
    assert [(name, type(m)) for name, m in model.named_modules()] == before
    assert {name: t.data_ptr() for name, t in masked.state_dict().items()} == tensors
    kinds = {type(m) for m in masked.modules()}
    assert MaskedBatchNorm in kinds and nn.BatchNorm2d not in kinds
    assert masked.fc is model.fc  # type: ignore[union-attr]


def test_a_masked_batch_norm_outside_its_step_is_an_error() -> None:
    masked = masked_norms(nn.BatchNorm1d(3), NormStep())
    with pytest.raises(RuntimeError, match=r"NormStep\.batch"):
        masked(torch.zeros(4, 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batch_norm_in_captured_cuda_graphs_equals_one_by_one(digits64: TensorDataset) -> None:
    """On a GPU, in float64, with every kind of step captured as a CUDA graph and replayed (6 epochs, so
    each kind runs past its warm-up): every node's weights and running statistics within 1e-10 of its
    own local_sgd there, and a kept round's replays bitwise a fresh round."""
    from fedmq.fedcore.seeding import torch_generator
    from fedmq.fedcore.training import local_sgd

    cuda = torch.device("cuda")
    model = norm_net().to(cuda)
    datasets = [d.to(cuda) for d in shards(digits64, SIZES)]
    settings = dataclasses.replace(SGD, local_epochs=6)

    def gens() -> list[torch.Generator]:
        return [torch_generator(3, "node-train", f"node-{i}", 0, device=cuda) for i in range(len(SIZES))]

    expected = []
    for data, gen in zip(datasets, gens(), strict=True):
        copy_ = copy.deepcopy(model)
        local_sgd(copy_, data, settings, gen)
        expected.append(copy_.state_dict())
    fresh = train_vectorized(model, datasets, settings, gens(), graphs="on")
    for want, (state, _) in zip(expected, fresh, strict=True):
        assert max_difference(state, want) < 1e-10
    with keep_rounds():
        train_vectorized(model, datasets, settings, gens(), graphs="on")
        replayed = train_vectorized(model, datasets, settings, gens(), graphs="on")
    for (state, _), (want, _) in zip(replayed, fresh, strict=True):
        assert all(torch.equal(state[k], want[k]) for k in want)
