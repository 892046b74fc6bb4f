"""FedProto's two halves in-process: the prototype regulariser and the global prototypes (count-weighted and the code's
plain mean) by hand, the batches of the last epoch, both prototype passes, the nodes' own models kept
between rounds, FedAvg at lambda = 0 with shared models, the nearest-prototype classifier, invalid wire
values, the checkpointed prototypes, determinism; hyperparameters and checkpoints: test_contract.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from fedmq.fedcore.aggregation import weighted_average
from fedmq.fedcore.algorithms import build_hyperparams, fedproto
from fedmq.fedcore.algorithms.base import Payload, TaskInput
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.tensors import non_finite, schema_mismatch
from fedmq.fedcore.training import TrainSettings
from tests.algorithms import common
from tests.algorithms.common import Federation, context, same_state, shards, tiny_model

SPEC = fedproto.SPEC


def _task(data_model: dict, prototypes: torch.Tensor, present: torch.Tensor, settings: TrainSettings) -> TaskInput:  # type: ignore[type-arg]
    payload = Payload(tensors={"model": data_model, "prototypes": {"weight": prototypes, "present": present}})
    return TaskInput(node_id="n0", round=0, payload=payload, settings=settings)


NO_PROTOTYPES = (torch.zeros(3, 8), torch.zeros(3, dtype=torch.bool))


# -- the loss and the aggregation by hand ----------------------------------------------------------


def test_prototype_loss_matches_hand_computation_and_skips_classes_without_a_prototype() -> None:
    """f = ((1, 2), (3, 4)), labels (0, 1), C_bar^(0) = (0, 0), class 1 without prototype:
    MSE = (1 + 4 + 0 + 0) / 4 = 1.25, and the second sample gets no gradient."""
    features = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    loss = fedproto.prototype_loss(
        features, torch.tensor([0, 1]), torch.tensor([[0.0, 0.0], [1.0, 1.0]]), torch.tensor([True, False])
    )
    loss.backward()
    assert float(loss.detach()) == pytest.approx(1.25)
    assert torch.allclose(features.grad, torch.tensor([[0.5, 1.0], [0.0, 0.0]]))  # 2 (f - C) / (B d)


@pytest.mark.parametrize(
    ("weighting", "class0"), [("counts", (0.75, 0.25)), ("uniform", (0.5, 0.5))], ids=["eq6", "code"]
)
def test_aggregate_prototypes_matches_hand_computation(weighting: str, class0: tuple[float, float]) -> None:
    """A holds 3 of class 0 at (1, 0); B holds 1 of class 0 at (0, 1) and 2 of class 1 at (2, 2); nobody class 2.
    Class 0: (3 (1, 0) + (0, 1)) / 4 by counts, ((1, 0) + (0, 1)) / 2 plainly; class 1: (2, 2); class 2 not held."""
    means = [torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]), torch.tensor([[0.0, 1.0], [2.0, 2.0], [0.0, 0.0]])]
    counts = [torch.tensor([3, 0, 0]), torch.tensor([1, 2, 0])]
    protos, held = fedproto.aggregate_prototypes(means, counts, weighting)
    assert held.tolist() == [True, True, False]
    assert torch.allclose(protos, torch.tensor([list(class0), [2.0, 2.0], [0.0, 0.0]]))


# -- the node half ---------------------------------------------------------------------------------


def test_train_pass_records_the_last_epoch_only() -> None:
    """17 samples in batches of 8 over 3 epochs: the last epoch sees 16 (the trailing one is skipped), so the
    counts sum to 16; with a negligible learning rate the recorded means equal the eval pass's."""
    data = shards()[2].subset(np.arange(17))
    start = tiny_model(3).state_dict()
    settings = TrainSettings(local_epochs=3, batch_size=8, lr=1e-12)
    half = SPEC.node(build_hyperparams(SPEC, {}), node_id="n0")
    out = half.train(_task(start, *NO_PROTOTYPES, settings), tiny_model(99), data, torch_generator(0, "t"))
    counts = out.tensors["class_means"]["counts"]
    assert int(counts.sum()) == 16 and counts.dtype == torch.int64
    full = shards()[2].subset(np.arange(16))
    half16 = SPEC.node(build_hyperparams(SPEC, {}), node_id="n0")
    out16 = half16.train(_task(start, *NO_PROTOTYPES, settings), tiny_model(99), full, torch_generator(0, "t"))
    evald = SPEC.node(build_hyperparams(SPEC, {"prototype_pass": "eval"}), node_id="n0")
    ref = evald.train(_task(start, *NO_PROTOTYPES, settings), tiny_model(99), full, torch_generator(0, "t"))
    assert torch.equal(out16.tensors["class_means"]["counts"], ref.tensors["class_means"]["counts"])
    assert torch.allclose(out16.tensors["class_means"]["means"], ref.tensors["class_means"]["means"], atol=1e-5)


def test_eval_pass_means_are_the_class_means_of_the_trained_model() -> None:
    """ "eval": counts are the label histogram, means the per-class mean representation of the returned model."""
    data = shards()[0]
    half = SPEC.node(build_hyperparams(SPEC, {"prototype_pass": "eval"}), node_id="n0")
    settings = TrainSettings(local_epochs=1, batch_size=8, lr=0.1)
    out = half.train(
        _task(tiny_model(1).state_dict(), *NO_PROTOTYPES, settings), tiny_model(99), data, torch_generator(0, "t")
    )
    counts, means = out.tensors["class_means"]["counts"], out.tensors["class_means"]["means"]
    assert counts.tolist() == data.label_histogram()
    model = tiny_model(0)
    model.load_state_dict(out.tensors["model"])
    with torch.no_grad():
        f = model.extract(data.x)
    for c, n in enumerate(counts.tolist()):
        expected = f[data.y == c].mean(0) if n else torch.zeros(8)
        assert torch.allclose(means[c], expected, atol=1e-6)


def test_regulariser_pulls_representations_towards_the_global_prototypes() -> None:
    """With prototypes for every class, a large lambda leaves the shard's representations nearer them than lambda 0."""
    data = shards()[1]
    start = tiny_model(2).state_dict()
    prototypes = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)).abs()
    present = torch.ones(3, dtype=torch.bool)
    settings = TrainSettings(local_epochs=5, batch_size=10, lr=0.1)

    def distance(lam: float) -> float:
        half = SPEC.node(build_hyperparams(SPEC, {"proto_weight": lam}), node_id="n0")
        model = tiny_model(99)
        half.train(_task(start, prototypes, present, settings), model, data, torch_generator(0, "t"))
        with torch.no_grad():
            return float(fedproto.prototype_loss(model.extract(data.x), data.y, prototypes, present))

    assert distance(10.0) < 0.5 * distance(0.0)


def test_nodes_keep_their_own_models_between_rounds() -> None:
    """With local_models, a node's second round starts from its own model whatever is broadcast; without, from
    the broadcast. The kept model is a CPU copy of what the node returned."""
    data = shards()[0]
    settings = TrainSettings(local_epochs=1, batch_size=8, lr=0.1)

    def second_round(half, broadcast_seed: int) -> dict:  # type: ignore[no-untyped-def, type-arg]
        task = _task(tiny_model(broadcast_seed).state_dict(), *NO_PROTOTYPES, settings)
        out = half.train(task, tiny_model(99), data, torch_generator(0, "b")).tensors["model"]
        return {k: v.clone() for k, v in out.items()}

    for local in (True, False):
        half = SPEC.node(build_hyperparams(SPEC, {"local_models": local}), node_id="n0")
        task = _task(tiny_model(1).state_dict(), *NO_PROTOTYPES, settings)
        first = {
            k: v.clone()
            for k, v in half.train(task, tiny_model(99), data, torch_generator(0, "a")).tensors["model"].items()
        }
        if not local:
            assert half.local is None
            assert not same_state(second_round(half, 5), second_round(half, 6))
            continue
        assert same_state(half.local, first) and all(t.device.type == "cpu" for t in half.local.values())
        kept = dict(half.local)
        a = second_round(half, 5)
        assert same_state(half.local, a)  # the newest local model replaces the old one
        half.local = kept
        assert same_state(a, second_round(half, 6))


def test_node_update_matches_the_coordinator_schema() -> None:
    """What a node sends passes the daemon's checks (schema, finite values)."""
    fed = Federation(SPEC)
    update = fed.train("node-002", fed.coordinator.configure_round(context(0, fed.node_ids)))
    schema = fed.coordinator.update_schema()
    assert set(update.payload.tensors) == set(schema)
    for group, expected in schema.items():
        assert schema_mismatch(update.payload.tensors[group], expected) is None, group
        assert non_finite(update.payload.tensors[group]) is None


def test_node_without_prototypes_raises_algorithm_error() -> None:
    """A task without the global prototypes (or without their mask) is an AlgorithmError naming node and round."""
    fed = Federation(SPEC)
    model = fed.coordinator.model.state_dict()
    with pytest.raises(AlgorithmError, match=r"global prototypes.*node node-000, round 0"):
        fed.train("node-000", Payload(tensors={"model": model}))
    with pytest.raises(AlgorithmError, match="global prototypes"):
        fed.train("node-000", Payload(tensors={"model": model, "prototypes": {"weight": torch.zeros(3, 8)}}))


# -- neutral setting, coordinator, evaluation ------------------------------------------------------


def test_fedproto_neutral_setting_equals_fedavg_exactly() -> None:
    """Shared models and lambda = 0 give FedAvg's global model bit for bit; with lambda > 0 the first round (no
    prototypes yet) still does, later rounds differ."""
    fedavg = Federation("fedavg").run(3)
    assert same_state(fedavg, Federation(SPEC, {"local_models": False, "proto_weight": 0.0}).run(3))
    assert same_state(Federation("fedavg").run(1), Federation(SPEC, {"local_models": False}).run(1))
    assert not same_state(fedavg, Federation(SPEC, {"local_models": False}).run(3))
    assert not same_state(fedavg, Federation(SPEC, {"proto_weight": 0.0}).run(3))  # local models: not FedAvg


def test_aggregate_averages_models_and_keeps_prototypes_of_classes_not_held() -> None:
    """The model is the sample-weighted average; C_bar is the count-weighted mean for held classes; a class held only in an
    earlier round keeps that round's prototype and stays present."""
    fed = Federation(SPEC)
    payload = fed.coordinator.configure_round(context(0, fed.node_ids))
    updates = [fed.train(n, payload) for n in fed.node_ids]
    metrics = fed.coordinator.aggregate(context(0, fed.node_ids), updates, [])
    expected = weighted_average([u.payload.tensors["model"] for u in updates], [float(u.num_samples) for u in updates])
    assert same_state(fed.coordinator.model.state_dict(), expected)
    stats = [u.payload.tensors["class_means"] for u in updates]
    protos, held = fedproto.aggregate_prototypes([s["means"] for s in stats], [s["counts"] for s in stats], "counts")
    assert held.all() and torch.equal(fed.coordinator.prototypes, protos)
    assert metrics["fedproto_classes"] == 3.0 and metrics["fedproto_invalid"] == 0.0
    # round 1: only node-000 reports, holding classes {0, 1}? whatever it lacks keeps the round-0 prototype
    fed.round = 1
    lone = fed.train("node-000", fed.coordinator.configure_round(context(1, ("node-000",))))
    before = fed.coordinator.prototypes.clone()
    fed.coordinator.aggregate(context(1, ("node-000",)), [lone], [])
    lacking = lone.payload.tensors["class_means"]["counts"] == 0
    assert lacking.any()
    assert torch.equal(fed.coordinator.prototypes[lacking], before[lacking])
    assert fed.coordinator.present.all()


def test_nearest_prototype_classifier_by_hand() -> None:
    """f(x) = x: from (0, 0) the prototypes (1, 0), (0, 2) are at squared distances 1 and 4; the third class has
    none and sits 1e4 below the lowest logit; with no prototype at all every logit is 0."""

    class Identity(nn.Module):
        def extract(self, x: torch.Tensor) -> torch.Tensor:
            return x

    protos = torch.tensor([[1.0, 0.0], [0.0, 2.0], [5.0, 5.0]])
    logits = fedproto.NearestPrototype(Identity(), protos, torch.tensor([True, True, False]))(torch.zeros(1, 2))
    assert torch.allclose(logits, torch.tensor([[-1.0, -4.0, -4.0 - fedproto.ABSENT_MARGIN]]))
    none = fedproto.NearestPrototype(Identity(), protos, torch.zeros(3, dtype=torch.bool))(torch.zeros(2, 2))
    assert torch.equal(none, torch.zeros(2, 3))


def test_evaluation_models_put_the_prototype_rule_first_only_when_asked() -> None:
    """By default the averaged model alone; with evaluate_prototypes the nearest-prototype rule first."""
    assert list(Federation(SPEC).coordinator.evaluation_models()) == ["global"]
    fed = Federation(SPEC, {"evaluate_prototypes": True})
    fed.run(1)
    models = fed.coordinator.evaluation_models()
    assert list(models) == ["prototype", "global"] and models["global"] is fed.coordinator.model
    x = fed.data[0].x
    with torch.no_grad():
        dist = torch.cdist(fed.coordinator.model.extract(x), fed.coordinator.prototypes)
        assert torch.equal(models["prototype"](x).argmax(1), dist.argmin(1))


def test_fedproto_is_deterministic_under_a_fixed_seed() -> None:
    """Same seed, same averaged model and prototypes; another seed differs."""
    a = common.assert_deterministic(SPEC, rounds=3)
    assert all(math.isfinite(m["train_loss"]) for m in a.metrics)


@pytest.mark.parametrize("bad", sorted(common.BAD_CLASS_MEANS))
def test_invalid_class_means_leave_the_update_out(bad: str) -> None:
    """An update with unusable counts or prototypes is left out of the model average and of the global prototypes."""
    fed = Federation(SPEC)
    payload = fed.coordinator.configure_round(context(0, fed.node_ids))
    good, other = fed.train("node-000", payload), fed.train("node-001", payload)
    stats = other.payload.tensors["class_means"]
    broken = common.with_class_means(other, *common.BAD_CLASS_MEANS[bad](stats["means"], stats["counts"]))
    metrics = fed.coordinator.aggregate(context(0, fed.node_ids), [good, broken], [])
    assert metrics["fedproto_invalid"] == 1.0
    assert same_state(fed.coordinator.model.state_dict(), good.payload.tensors["model"])
    with pytest.raises(AlgorithmError, match="valid FedProto prototypes"):
        fed.coordinator.aggregate(context(1, fed.node_ids), [broken], [])


def test_fedproto_state_round_trips_and_bad_state_is_refused() -> None:
    """The global prototypes and their mask survive state_dict/load_state_dict; malformed state is a ValueError."""
    fed = Federation(SPEC)
    fed.run(2)
    fresh = SPEC.coordinator(build_hyperparams(SPEC, {}), model=tiny_model(0))
    assert not fresh.present.any()
    fresh.load_state_dict(fed.coordinator.state_dict())
    assert same_state(fresh.state_dict(), fed.coordinator.state_dict())
    state = fed.coordinator.state_dict()
    for bad in (
        {"prototypes": state["prototypes"]},
        {**state, "prototypes": torch.zeros(3, 4)},
        {**state, "present": state["present"].float()},
        {**state, "prototypes": torch.full((3, 8), float("nan"))},
    ):
        with pytest.raises(ValueError, match="FedProto state"):
            fresh.load_state_dict(bad)
