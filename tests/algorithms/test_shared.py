"""The helpers several methods share (`fedcore.algorithms.shared`): local_sgd's batch count, a node's
label counts, the checks on uploaded class means, the template of FedAvg plus a loss term, a node's
state per parameter and a sync-only half's average."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedmq.fedcore.algorithms import fedavg, fedprox, shared
from fedmq.fedcore.algorithms.base import NodeUpdate, Payload
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.training import TrainSettings, local_sgd
from fedmq.fedcore.vectorized import steps_per_epoch
from tests.algorithms import common
from tests.algorithms.common import Federation, same_state, shards, tiny_model, update


@pytest.mark.parametrize(
    ("n", "batch", "drop_last", "expected"),
    [(20, 8, False, 3), (17, 8, False, 2), (16, 8, False, 2), (9, 8, False, 1), (1, 8, False, 1), (5, 1, False, 0),
     (40, 8, False, 5), (33, 8, False, 4), (9, 40, False, 1), (20, 8, True, 2), (9, 40, True, 0), (5, 1, True, 0)],
)  # fmt: skip
def test_steps_per_epoch_counts_the_batches_local_sgd_trains_on(
    n: int, batch: int, drop_last: bool, expected: int
) -> None:
    """local_sgd stops at a batch of one sample (so a trailing one is skipped, and with batch_size 1
    every one) and, with drop_last, at a short trailing batch; FedACD's running estimate, FedProto's
    last epoch and the vectorised plan count on the same number."""
    assert steps_per_epoch(n, batch, drop_last) == expected
    data = shards()[2].subset(np.arange(n))
    settings = TrainSettings(local_epochs=1, batch_size=batch, lr=0.01, drop_last=drop_last)
    assert local_sgd(tiny_model(0), data, settings, torch_generator(0, "t")).steps == expected


def test_local_label_counts_is_the_shard_histogram() -> None:
    """n_c of the whole shard as float32 (shard 1: 19, 11, 0)."""
    counts = shared.local_label_counts(shards()[1], tiny_model(), node_id="n", round=0)
    assert counts.dtype == torch.float32 and counts.tolist() == [19.0, 11.0, 0.0]


def test_local_label_counts_of_empty_or_mismatched_shard_raise_algorithm_error() -> None:
    """No labels, or labels that do not fit the model's logits, fail the round naming the node."""
    with pytest.raises(AlgorithmError, match="empty"):
        shared.local_label_counts(common.empty_shard(), tiny_model(), node_id="n", round=0)
    wide = tiny_model()
    wide.num_classes = 5  # the data has 3 classes
    with pytest.raises(AlgorithmError, match="5 logits"):
        shared.local_label_counts(shards()[0], wide, node_id="n", round=0)


def _with_class_means(means: torch.Tensor, counts: torch.Tensor) -> NodeUpdate:
    """An update of 10 samples carrying `means` and `counts`."""
    tensors = {"model": {}, "class_means": {"means": means, "counts": counts}}
    return NodeUpdate(node_id="n", round=0, num_samples=10, payload=Payload(tensors=tensors))


@pytest.mark.parametrize(
    ("means", "counts", "problem"),
    [
        (torch.zeros(3, 2), torch.tensor([4, 6, 0]), None),
        (torch.zeros(2, 2), torch.tensor([4, 6, 0]), "wrong shape"),
        (torch.zeros(3, 2), torch.tensor([4.0, 6.0, 0.0]), "not integers"),
        (torch.zeros(3, 2), torch.tensor([-1, 6, 0]), "negative"),
        (torch.zeros(3, 2), torch.tensor([5, 6, 0]), "sum to 11"),
        (torch.zeros(3, 2), torch.tensor([0, 0, 0]), "sum to 0"),
        (torch.full((3, 2), float("nan")), torch.tensor([4, 6, 0]), "not finite"),
    ],
)
def test_class_means_problem_names_what_is_wrong(
    means: torch.Tensor, counts: torch.Tensor, problem: str | None
) -> None:
    """Class means from the wire: shape (C, d) and (C,), integer non-negative counts summing to 1..n, finite means."""
    found = shared.class_means_problem(_with_class_means(means, counts), classes=3, dim=2)
    assert found is None if problem is None else problem in (found or "")


def test_class_means_problem_without_the_group() -> None:
    """An update without class means is named as such."""
    assert shared.class_means_problem(update("n", {}, 10), classes=3, dim=2) == "no class means"


def test_loss_term_node_at_its_neutral_setting_trains_as_fedavg() -> None:
    """The template with no objective (FedProx at mu = 0) is FedAvg's local training, bit for bit."""
    start = Federation("fedavg").coordinator.model.state_dict()
    a = Federation("fedavg").train("node-001", Payload(tensors={"model": start}))
    b = Federation("fedprox", {"mu": 0.0}).train("node-001", Payload(tensors={"model": start}))
    assert isinstance(Federation("fedprox").nodes["node-000"], shared.LossTermNode)
    assert same_state(a.payload.tensors["model"], b.payload.tensors["model"])
    assert a.payload.meta == b.payload.meta


def test_averaging_coordinator_weights_by_samples_and_fedavg_may_not() -> None:
    """The shared server weighs by n_k; FedAvg's `weighted: false` gives the plain mean."""
    updates = [update("a", {}, 10), update("b", {}, 30)]
    assert fedprox.CoordinatorHalf(fedprox.Hyperparams(), model=tiny_model()).weights(updates) == [10.0, 30.0]
    plain = fedavg.CoordinatorHalf(fedavg.Hyperparams(weighted=False), model=tiny_model())
    assert plain.weights(updates) == [1.0, 1.0]


def test_node_state_starts_at_zero_on_the_cpu_and_refuses_changed_parameters() -> None:
    """A node's state per parameter (SCAFFOLD's c_i, FedDyn's grad_k): zero on the CPU in the
    accumulator dtype before its first round, then kept as it is; an AlgorithmError naming node and
    round once the model's parameters are not the ones it was made for."""
    params = shared.trainable(tiny_model(0))
    state = shared.node_state(None, params, node_id="n0", round=0)
    assert list(state) == [name for name, _ in params]
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 and not t.any() for t in state.values())
    assert shared.node_state(state, params, node_id="n0", round=1) is state
    with pytest.raises(AlgorithmError, match=r"parameters changed.*node n0, round 2"):
        shared.node_state(state, params[1:], node_id="n0", round=2)


def test_sync_average_is_the_halfs_rule_over_the_models_and_refuses_no_update() -> None:
    """The models' mean weighted by the given weights, through the half's averaging rule (swapped
    here as FedSA swaps it); no update is an AlgorithmError; state_norm is the Euclidean norm."""
    half = fedavg.CoordinatorHalf(fedavg.Hyperparams(), model=common.scalar_model(0.0))
    updates = [update("a", common.scalar_state(1.0), 10), update("b", common.scalar_state(3.0), 30)]
    ctx = common.context(0, ("a", "b"))
    assert float(shared.sync_average(half, ctx, updates, [10.0, 30.0])["weight"]) == 2.5
    half.average = lambda states, weights: {k: v.clone() for k, v in states[-1].items()}
    assert float(shared.sync_average(half, ctx, updates, [10.0, 30.0])["weight"]) == 3.0
    with pytest.raises(AlgorithmError, match="no update to aggregate"):
        shared.sync_average(half, common.context(0, ()), [], [])
    assert shared.state_norm([torch.tensor([3.0]), torch.tensor([[4.0]])]) == 5.0


@pytest.mark.parametrize("shape", [(), (3,)])
def test_add_rows_by_product_is_index_add(shape: tuple[int, ...]) -> None:
    """The atomics-free form `add_rows` takes on a GPU adds what `index_add_` adds (float64, to
    rounding), rows with repeated and absent indices alike, for sums of vectors and of counts."""
    gen = torch.Generator().manual_seed(0)
    index = torch.tensor([2, 0, 2, 2, 4, 0])
    values = torch.rand(len(index), *shape, generator=gen, dtype=torch.float64)
    start = torch.rand(5, *shape, generator=gen, dtype=torch.float64)
    by_index, by_product = start.clone(), start.clone()
    by_index.index_add_(0, index, values)
    shared.add_rows_by_product(by_product, index, values)
    torch.testing.assert_close(by_product, by_index, rtol=0, atol=1e-15)
    assert torch.equal(by_product[[1, 3]], start[[1, 3]])
    on_cpu = start.clone()
    shared.add_rows(on_cpu, index, values.float())  # another dtype, cast to the target's
    assert on_cpu.dtype == torch.float64 and torch.allclose(on_cpu, by_index, atol=1e-7)
