"""FedNH's two halves in-process: the initial prototypes (orthonormal, spread, seeded without the global
RNG), the cosine logits and the smoothed prototype update by hand, the node's class means and its
training with fixed prototypes, the coordinator's averaging of bodies and scale, the schema of what
travels, the evaluation model, invalid wire values, the checkpointed state, determinism;
hyperparameters and checkpoints: test_contract.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from fedmq.fedcore.aggregation import weighted_average
from fedmq.fedcore.algorithms import build_hyperparams, fednh
from fedmq.fedcore.algorithms.base import Payload, TaskInput
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.tensors import non_finite, schema_mismatch
from fedmq.fedcore.training import TrainSettings
from tests.algorithms import common
from tests.algorithms.common import Federation, context, same_state, shards, tiny_model

SPEC = fednh.SPEC


def _coordinator(**hp: object) -> fednh.CoordinatorHalf:
    return SPEC.coordinator(build_hyperparams(SPEC, hp), model=tiny_model(0))


# -- initial prototypes ----------------------------------------------------------------------------


def test_orthogonal_prototypes_are_orthonormal_and_need_room() -> None:
    """C <= d gives W W^T = I; C > d cannot be orthonormal and is a ValueError."""
    w = fednh.orthogonal_prototypes(3, 8, torch_generator(0, "p"))
    assert w.shape == (3, 8) and w.dtype == torch.float32
    assert torch.allclose(w @ w.t(), torch.eye(3), atol=1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        fednh.orthogonal_prototypes(5, 4, torch_generator(0, "p"))


@pytest.mark.parametrize(
    ("classes", "dim", "max_cosine"),
    [(3, 2, -0.5), (6, 2, 0.5), (4, 3, -1.0 / 3.0), (12, 3, 1.0 / math.sqrt(5.0)), (2, 1, -1.0)],
    ids=["triangle", "hexagon", "tetrahedron", "icosahedron", "two-points-on-a-line"],
)
def test_spread_prototypes_reach_the_known_optimal_configurations(classes: int, dim: int, max_cosine: float) -> None:
    """Unit rows whose largest pairwise cosine is (within 0.01) that of the optimal spherical code."""
    w = fednh.spread_prototypes(classes, dim, torch_generator(0, "p"))
    assert torch.allclose(w.norm(dim=1), torch.ones(classes), atol=1e-6)
    cosine = (w @ w.t()).fill_diagonal_(-2.0)
    assert float(cosine.max()) == pytest.approx(max_cosine, abs=0.01)


def test_initial_prototypes_use_orthogonal_when_they_fit_and_spread_otherwise() -> None:
    """ "orthogonal" with C <= d is the QR construction; with C > d it falls back to the spread one."""
    gen = lambda: torch_generator(5, "p")  # noqa: E731
    assert torch.equal(fednh.initial_prototypes(3, 4, "orthogonal", gen()), fednh.orthogonal_prototypes(3, 4, gen()))
    assert torch.equal(fednh.initial_prototypes(6, 2, "orthogonal", gen()), fednh.spread_prototypes(6, 2, gen()))
    assert torch.equal(fednh.initial_prototypes(3, 4, "spread", gen()), fednh.spread_prototypes(3, 4, gen()))


def test_coordinator_prototypes_are_seeded_and_leave_the_global_rng_alone() -> None:
    """The same prototype_seed gives the same W whatever the global RNG; another seed another W; the
    global RNG state is untouched by building the coordinator."""
    torch.manual_seed(1)
    state = torch.get_rng_state()
    a = _coordinator().prototypes
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(2)
    assert torch.equal(a, _coordinator().prototypes)
    assert not torch.equal(a, _coordinator(prototype_seed=1).prototypes)
    assert torch.allclose(a @ a.t(), torch.eye(3), atol=1e-6)  # tiny mlp: 3 classes, 8 features


# -- logits and the prototype update ---------------------------------------------------------------


def test_fednh_logits_are_scaled_cosines() -> None:
    """Feature (3, 4) is (0.6, 0.8) normalised; prototypes (1, 0) and (0, 2) -> (0, 1); s = 2: (1.2, 1.6)."""
    logits = fednh.fednh_logits(torch.tensor([[3.0, 4.0]]), torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([2.0]))
    assert torch.allclose(logits, torch.tensor([[1.2, 1.6]]))


def test_update_prototypes_matches_the_smoothed_rule_by_hand() -> None:
    """W = ((1, 0), (0, 1), (-1, 0)), rho = 1/2. Client A holds 3 of class 0 with mean (5, 0) (renormalised to
    (1, 0)); client B 1 of class 0 and 2 of class 1, both means (0, 1). mu_0 = (3, 1) / sqrt(10), so
    w_0 = normalize((1, 0) / 2 + mu_0 / 2); w_1 = (0, 1); class 2, held by nobody, keeps its prototype exactly."""
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    means = [torch.tensor([[5.0, 0.0], [0.0, 0.0], [0.0, 0.0]]), torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.0, 0.0]])]
    counts = [torch.tensor([3, 0, 0]), torch.tensor([1, 2, 0])]
    new = fednh.update_prototypes(w, means, counts, 0.5)
    r = math.sqrt(10.0)
    expected0 = torch.tensor([(1 + 3 / r) / 2, (1 / r) / 2])
    assert torch.allclose(new[0], expected0 / expected0.norm(), atol=1e-6)
    assert torch.allclose(new[1], torch.tensor([0.0, 1.0]))
    assert torch.equal(new[2], w[2])
    assert torch.equal(w, torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]))  # the input is not modified


def test_update_prototypes_extremes_of_rho_and_the_degenerate_mix() -> None:
    """rho = 1 keeps W bit for bit; rho = 0 replaces a held class by mu_c; an exactly opposite mu_c at
    rho = 1/2 (a zero mix) keeps the prototype instead of producing a zero vector."""
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    means, counts = [torch.tensor([[0.0, 3.0], [-1.0, 0.0]])], [torch.tensor([2, 1])]
    assert torch.equal(fednh.update_prototypes(w, means, counts, 1.0), w)
    assert torch.allclose(fednh.update_prototypes(w, means, counts, 0.0), torch.tensor([[0.0, 1.0], [-1.0, 0.0]]))
    opposite = fednh.update_prototypes(w, [torch.tensor([[-1.0, 0.0], [0.0, 1.0]])], [torch.tensor([1, 1])], 0.5)
    assert torch.equal(opposite[0], w[0])


# -- the node half ---------------------------------------------------------------------------------


def test_class_means_match_a_hand_computation_and_the_histogram() -> None:
    """Per class: the normalised mean of the normalised features; counts are the label histogram; a
    class the shard lacks has a zero row."""
    data = shards()[0]
    model = tiny_model(4)
    means, counts = fednh.class_means(model, data, 3, torch.device("cpu"))
    assert counts.dtype == torch.int64 and counts.tolist() == data.label_histogram()
    with torch.no_grad():
        z = F.normalize(model.extract(data.x), dim=1)
    for c, n in enumerate(counts.tolist()):
        if n == 0:
            assert torch.equal(means[c], torch.zeros(8))
        else:
            assert torch.allclose(means[c], F.normalize(z[data.y == c].mean(0), dim=0), atol=1e-6)
    assert 0 in counts.tolist()  # the first shard is label-skewed


def test_node_trains_the_body_against_fixed_prototypes() -> None:
    """One full-batch SGD step equals a hand step on CE(s cos(phi(x), W)), with s learnt; the model's own head
    keeps its broadcast values and the prototypes are not changed."""
    data = shards()[2]
    lr = 0.5
    start = tiny_model(1).state_dict()
    prototypes = fednh.orthogonal_prototypes(3, 8, torch_generator(0, "p"))
    scale = torch.tensor([3.0])
    payload = Payload(tensors={"model": start, "prototypes": {"weight": prototypes.clone()}, "scale": {"value": scale}})
    settings = TrainSettings(local_epochs=1, batch_size=len(data), lr=lr)
    task = TaskInput(node_id="n0", round=0, payload=payload, settings=settings)
    half = SPEC.node(build_hyperparams(SPEC, {}), node_id="n0")
    out = half.train(task, tiny_model(99), data, torch_generator(0, "t"))

    manual = tiny_model(1)
    s = torch.tensor([3.0], requires_grad=True)
    loss = F.cross_entropy(fednh.fednh_logits(manual.extract(data.x), prototypes, s), data.y)
    loss.backward()
    with torch.no_grad():
        for p in manual.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    model = out.tensors["model"]
    for name, p in manual.state_dict().items():
        assert torch.allclose(model[name], p, atol=1e-6), name
    assert float(out.tensors["scale"]["value"]) == pytest.approx(3.0 - lr * float(s.grad), abs=1e-6)
    head = tiny_model(1).head_keys()
    assert head and all(torch.equal(model[k], start[k]) for k in head)
    assert torch.equal(payload.tensors["prototypes"]["weight"], prototypes)


def test_node_update_matches_the_coordinator_schema() -> None:
    """What a node sends passes the daemon's checks (schema, finite); with a fixed scale no scale group."""
    for learn_scale in (True, False):
        fed = Federation(SPEC, {"learn_scale": learn_scale})
        payload = fed.coordinator.configure_round(context(0, fed.node_ids))
        update = fed.train("node-001", payload)
        schema = fed.coordinator.update_schema()
        assert set(update.payload.tensors) == set(schema)
        assert ("scale" in schema) is learn_scale
        for group, expected in schema.items():
            assert schema_mismatch(update.payload.tensors[group], expected) is None, group
            assert non_finite(update.payload.tensors[group]) is None
        counts = update.payload.tensors["class_means"]["counts"]
        assert counts.tolist() == fed.data[1].label_histogram()


def test_node_without_prototypes_or_with_a_plain_model_raises_algorithm_error() -> None:
    """A task missing W, or a model without extract/num_classes, is an AlgorithmError naming node and round."""
    fed = Federation(SPEC)
    payload = fed.coordinator.configure_round(context(0, fed.node_ids))
    with pytest.raises(AlgorithmError, match=r"prototypes/weight.*node node-000, round 0"):
        fed.train("node-000", Payload(tensors={"model": payload.tensors["model"], "scale": payload.tensors["scale"]}))
    with pytest.raises(AlgorithmError, match=r"FedModel.*node n0, round 2"):
        common.train_alone(SPEC, common.plain_module())
    with pytest.raises(ValueError, match="FedModel"):
        SPEC.coordinator(build_hyperparams(SPEC, {}), model=common.plain_module())


# -- the coordinator half --------------------------------------------------------------------------


def _updates(fed: Federation) -> list:  # type: ignore[type-arg]
    payload = fed.coordinator.configure_round(context(0, fed.node_ids))
    return [fed.train(node, payload) for node in fed.node_ids]


@pytest.mark.parametrize("weighted", [True, False])
def test_aggregate_averages_bodies_and_scale_and_moves_the_prototypes(weighted: bool) -> None:
    """Body and s: the (sample-weighted or plain) mean of the updates; W: update_prototypes of their class means."""
    fed = Federation(SPEC, {"weighted": weighted})
    updates = _updates(fed)
    old = fed.coordinator.prototypes.clone()
    metrics = fed.coordinator.aggregate(context(0, fed.node_ids), updates, [])
    weights = [float(u.num_samples) if weighted else 1.0 for u in updates]
    expected = weighted_average([u.payload.tensors["model"] for u in updates], weights)
    assert same_state(fed.coordinator.model.state_dict(), expected)
    scales = [float(u.payload.tensors["scale"]["value"]) for u in updates]
    assert float(fed.coordinator.scale) == pytest.approx(
        sum(w * s for w, s in zip(weights, scales, strict=True)) / sum(weights)
    )
    stats = [u.payload.tensors["class_means"] for u in updates]
    assert torch.equal(
        fed.coordinator.prototypes,
        fednh.update_prototypes(old, [s["means"] for s in stats], [s["counts"] for s in stats], 0.9),
    )
    assert metrics["fednh_invalid"] == 0.0 and metrics["fednh_classes_seen"] == 3.0
    assert metrics["fednh_prototype_shift"] > 0.0 and math.isfinite(metrics["train_loss"])


def test_fixed_scale_stays_put_and_smoothing_one_keeps_the_prototypes() -> None:
    """learn_scale false: s stays at its value; smoothing 1: W stays the initial one, bit for bit."""
    fed = Federation(SPEC, {"learn_scale": False, "scale": 7.0, "smoothing": 1.0})
    initial = fed.coordinator.prototypes.clone()
    fed.run(2)
    assert float(fed.coordinator.scale) == 7.0
    assert torch.equal(fed.coordinator.prototypes, initial)


def test_evaluation_model_gives_fednh_logits_of_the_global_model() -> None:
    """The evaluated network's forward is s cos(phi(x), W) of the coordinator's model, W and s."""
    fed = Federation(SPEC)
    fed.run(1)
    models = fed.coordinator.evaluation_models()
    assert list(models) == ["global"]
    x = fed.data[0].x
    with torch.no_grad():
        expected = fednh.fednh_logits(
            fed.coordinator.model.extract(x), fed.coordinator.prototypes, fed.coordinator.scale
        )
        assert torch.allclose(models["global"](x), expected)
    assert next(models["global"].parameters()) is next(fed.coordinator.model.parameters())


def test_fednh_learns_and_is_deterministic_under_a_fixed_seed() -> None:
    """Same seed, same model, W and s; another seed another model; the training loss falls over rounds."""
    a = common.assert_deterministic(SPEC, {"scale": 10.0}, rounds=3)
    assert a.metrics[-1]["train_loss"] < a.metrics[0]["train_loss"]


BAD_STATS = {
    **common.BAD_CLASS_MEANS,
    "zero-mean-for-held-class": lambda m, c: (torch.zeros_like(m), c),
}
"""What every method's check of class means refuses, and FedNH's own: a zero mean for a class the node holds."""


@pytest.mark.parametrize("bad", sorted(BAD_STATS))
def test_invalid_class_means_leave_the_update_out(bad: str) -> None:
    """An update with unusable counts or means is left out of the body average and of the prototype update."""
    fed = Federation(SPEC)
    good, other, _ = _updates(fed)
    stats = other.payload.tensors["class_means"]
    broken = common.with_class_means(other, *BAD_STATS[bad](stats["means"], stats["counts"]))
    metrics = fed.coordinator.aggregate(context(0, fed.node_ids), [good, broken], [])
    assert metrics["fednh_invalid"] == 1.0
    assert same_state(fed.coordinator.model.state_dict(), good.payload.tensors["model"])


def test_missing_groups_leave_the_update_out_and_none_left_is_an_error() -> None:
    """No class means, or no scale while s is learnt: left out; when no update remains, AlgorithmError."""
    fed = Federation(SPEC)
    good, a, b = _updates(fed)
    no_means = type(a)(
        node_id="x",
        round=0,
        num_samples=a.num_samples,
        payload=Payload(tensors={"model": a.payload.tensors["model"], "scale": a.payload.tensors["scale"]}),
    )
    no_scale = type(b)(
        node_id="y",
        round=0,
        num_samples=b.num_samples,
        payload=Payload(tensors={k: v for k, v in b.payload.tensors.items() if k != "scale"}),
    )
    metrics = fed.coordinator.aggregate(context(0, fed.node_ids), [good, no_means, no_scale], [])
    assert metrics["fednh_invalid"] == 2.0
    with pytest.raises(AlgorithmError, match="valid FedNH class means"):
        fed.coordinator.aggregate(context(1, fed.node_ids), [no_means, no_scale], [])


def test_fednh_state_round_trips_and_bad_state_is_refused() -> None:
    """W and s survive state_dict/load_state_dict; missing, misshapen or non-finite entries are ValueErrors."""
    fed = Federation(SPEC)
    fed.run(2)
    fresh = _coordinator()
    assert not torch.equal(fresh.prototypes, fed.coordinator.prototypes)
    fresh.load_state_dict(fed.coordinator.state_dict())
    assert same_state(fresh.state_dict(), fed.coordinator.state_dict())
    state = fed.coordinator.state_dict()
    for bad in (
        {"prototypes": state["prototypes"]},
        {**state, "extra": torch.zeros(1)},
        {**state, "prototypes": torch.zeros(2, 8)},
        {**state, "scale": torch.tensor([float("nan")])},
    ):
        with pytest.raises(ValueError, match="FedNH state"):
            fresh.load_state_dict(bad)
