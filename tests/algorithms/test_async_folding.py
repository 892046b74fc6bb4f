"""Asynchronous folding: `CoordinatorHalf.next_model`'s three rules by hand on scalar models, the
async forms of FedAvgM and KDIA driven as the engine drives them, the participation record's
repeated versions, and the contract every registered method keeps (sync_only, or one async step)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import pytest
import torch
from torch import nn

from fedmq.fedcore.aggregation import fedasync_step, fedbuff_step, weighted_average
from fedmq.fedcore.algorithms import ALGORITHMS, async_refusal, build_hyperparams, get_algorithm
from fedmq.fedcore.algorithms.base import Failure, Folding, NodeUpdate, Payload, RoundContext
from fedmq.fedcore.algorithms.kdia.teacher import uploads_from_record
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.participation import ParticipationRecord
from fedmq.fedcore.staleness import CONSTANT, Staleness
from fedmq.fedcore.tensors import StateDict
from tests.algorithms.common import Federation, clone, context, same_state, scalar_model, scalar_state, update

POLY1 = Staleness(fn="polynomial", a=1.0)
"""s(t) = 1 / (1 + t): s(0) = 1, s(1) = 1/2, s(2) = 1/3."""
SMALL_GEN = {"gen_epochs": 1, "gen_batches_per_epoch": 4, "gen_batch_size": 8, "noise_dim": 4}
"""KDIA's generator, small enough for a unit test (as test_kdia.py)."""


def _ctx(
    round: int,
    folding: Folding,
    version: int | None = None,
    participation: ParticipationRecord | None = None,
    selected: tuple[str, ...] = (),
) -> RoundContext:
    ctx = context(round, selected, participation=participation)
    return dataclasses.replace(ctx, version=round if version is None else version, folding=folding)


def _stale(u: NodeUpdate, base_version: int, staleness: int) -> NodeUpdate:
    return dataclasses.replace(u, base_version=base_version, staleness=staleness)


def _value(state: Mapping[str, torch.Tensor]) -> float:
    return float(state["weight"].reshape(()))


def _three_updates() -> list[NodeUpdate]:
    """Folded into version 3 from w = 1: 3.0 (n 10, from version 2), 0.0 (n 30, fresh), 5.0 (n 10, from version 1)."""
    return [
        _stale(update("a", scalar_state(3.0), 10), 2, 1),
        _stale(update("b", scalar_state(0.0), 30), 3, 0),
        _stale(update("c", scalar_state(5.0), 10), 1, 2),
    ]


def _coordinator(name: str = "fedavg", value: float = 1.0, **hp: object):  # type: ignore[no-untyped-def]
    spec = get_algorithm(name)
    return spec.coordinator(build_hyperparams(spec, hp), model=scalar_model(value))


BASES = {1: scalar_state(4.0), 2: scalar_state(2.0)}


# -- next_model by hand ------------------------------------------------------------------------------


def test_next_model_mean_with_fresh_updates_equals_the_average_bit_for_bit() -> None:
    """Rule "mean", staleness 0 everywhere, any staleness function: exactly `self.average(states, weights)`."""
    fed = Federation("fedavg")
    payload = fed.coordinator.configure_round(context(0, fed.node_ids))
    assert isinstance(payload, Payload)
    updates = [fed.train(n, payload) for n in fed.node_ids]
    weights = [float(u.num_samples) for u in updates]
    expected = weighted_average([u.payload.tensors["model"] for u in updates], weights)
    for staleness in (CONSTANT, Staleness(), Staleness(fn="hinge", a=10.0, b=0.0), Staleness(fn="sqrt")):
        out = fed.coordinator.next_model(_ctx(0, Folding(staleness=staleness)), updates, weights)
        assert same_state(out, expected)
    one_stale = [_stale(updates[0], 0, 2), *updates[1:]]
    assert not same_state(fed.coordinator.next_model(_ctx(2, Folding(staleness=POLY1)), one_stale, weights), expected)


def test_next_model_mean_with_stale_updates_weights_by_staleness() -> None:
    """Rule "mean": weights n_k s(tau_k) = 5, 30, 10/3 over 3, 0, 5: (15 + 50/3) / (115/3) = 19/23."""
    coordinator = _coordinator()
    out = coordinator.next_model(_ctx(3, Folding(staleness=POLY1)), _three_updates(), [10.0, 30.0, 10.0])
    assert _value(out) == pytest.approx(19 / 23, rel=1e-6)
    unweighted = coordinator.next_model(_ctx(3, Folding()), _three_updates(), [10.0, 30.0, 10.0])
    assert _value(unweighted) == pytest.approx((30 + 0 + 50) / 50, rel=1e-6)  # constant: the plain average


def test_next_model_fedasync_matches_hand_computed_mixing() -> None:
    """w = 1 + 0.5 (0.2 x 1/2 x 2 + 0.6 x 1 x (-1) + 0.2 x 1/3 x 4) = 14/15; the model itself is not touched."""
    coordinator = _coordinator()
    folding = Folding(rule="fedasync", staleness=POLY1, server_lr=0.5)
    out = coordinator.next_model(_ctx(3, folding), _three_updates(), [10.0, 30.0, 10.0])
    assert _value(out) == pytest.approx(14 / 15, rel=1e-6)
    assert float(coordinator.model.weight.detach()) == 1.0


def test_next_model_fedasync_one_update_is_xie_mixing() -> None:
    """K = 1: w <- (1 - alpha_t) w + alpha_t w_new with alpha_t = 0.6 x (1 + 3)^-1/2 = 0.3: 0.7 x 1 + 0.3 x 11 = 4."""
    coordinator = _coordinator()
    folding = Folding(rule="fedasync", staleness=Staleness(fn="polynomial", a=0.5), server_lr=0.6)
    u = _stale(update("a", scalar_state(11.0), 7), 2, 3)
    assert _value(coordinator.next_model(_ctx(5, folding), [u], [7.0])) == pytest.approx(4.0, rel=1e-6)


def test_next_model_fedbuff_matches_hand_computed_buffer_step() -> None:
    """Deltas from each update's base (the current version's is the model itself), by hand; p_k = 1/K too."""
    # deltas 3 - 2, 0 - 1, 5 - 4: w = 1 + 0.5 (0.2 x 1/2 x 1 - 0.6 x 1 + 0.2 x 1/3 x 1) = 47/60
    coordinator = _coordinator()
    folding = Folding(rule="fedbuff", staleness=POLY1, server_lr=0.5, bases=BASES)
    out = coordinator.next_model(_ctx(3, folding), _three_updates(), [10.0, 30.0, 10.0])
    assert _value(out) == pytest.approx(47 / 60, rel=1e-6)
    # unweighted p_k = 1/3 is FedBuff's Algorithm 1: (1/2 x 1 - 1 + 1/3 x 1) / 3 = -1/18, eta 0.5
    out = coordinator.next_model(_ctx(3, folding), _three_updates(), [1.0, 1.0, 1.0])
    assert _value(out) == pytest.approx(1 - 0.5 / 18, rel=1e-6)


def test_next_model_fedbuff_prefers_the_given_base_of_the_current_version() -> None:
    """A base given for the current version is used (here 2.0 instead of the model's 1): 1 + 0.6 x (0 - 2) = -0.2."""
    coordinator = _coordinator()
    folding = Folding(rule="fedbuff", server_lr=1.0, bases={3: scalar_state(2.0)})
    u = _stale(update("b", scalar_state(0.0), 30), 3, 0)
    assert _value(coordinator.next_model(_ctx(3, folding), [u], [1.0])) == pytest.approx(-1.0, rel=1e-6)


def test_next_model_fedbuff_missing_base_version_raises_value_error_naming_it() -> None:
    """An update from version 1 with only version 2 known: ValueError naming version 1."""
    coordinator = _coordinator()
    folding = Folding(rule="fedbuff", bases={2: scalar_state(2.0)})
    with pytest.raises(ValueError, match="model of version 1 "):
        coordinator.next_model(_ctx(3, folding), _three_updates(), [10.0, 30.0, 10.0])


@pytest.mark.parametrize("rule", ["fedasync", "fedbuff"])
def test_next_model_async_rule_on_another_group_raises_value_error(rule: str) -> None:
    """The async rules fold the "model" group only; the mean folds any group."""
    coordinator = _coordinator()
    u = dataclasses.replace(
        update("a", scalar_state(1.0), 1), payload=Payload(tensors={"model": scalar_state(1.0), "x": scalar_state(3.0)})
    )
    with pytest.raises(ValueError, match="model group only"):
        coordinator.next_model(_ctx(0, Folding(rule=rule)), [u], [1.0], group="x")  # type: ignore[arg-type]
    assert _value(coordinator.next_model(_ctx(0, Folding()), [u], [1.0], group="x")) == 3.0


class _Counted(nn.Module):
    """A scalar weight and an integer buffer (as BatchNorm's num_batches_tracked)."""

    def __init__(self, value: float, steps: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((1, 1), value))
        self.register_buffer("steps", torch.tensor(steps))


@pytest.mark.parametrize("rule", ["mean", "fedasync", "fedbuff"])
def test_next_model_integer_buffers_take_the_maximum_over_the_updates(rule: str) -> None:
    """num_batches_tracked-like entries: the largest of the updates' (not the model's, not a mix)."""
    spec = get_algorithm("fedavg")
    coordinator = spec.coordinator(build_hyperparams(spec, {}), model=_Counted(1.0, 50))
    states = [{"weight": torch.full((1, 1), v), "steps": torch.tensor(s)} for v, s in ((2.0, 7), (3.0, 12), (4.0, 9))]
    updates = [_stale(update(f"n{i}", s, 1), 0, 1) for i, s in enumerate(states)]
    folding = Folding(rule=rule, staleness=POLY1, bases={0: {"weight": torch.zeros(1, 1), "steps": torch.tensor(3)}})  # type: ignore[arg-type]
    out = coordinator.next_model(_ctx(1, folding), updates, [1.0, 1.0, 1.0])
    assert out["steps"].dtype == torch.int64 and int(out["steps"]) == 12
    assert torch.isfinite(out["weight"]).all()


def test_fedbuff_step_float16_accumulates_in_float32_and_keeps_the_dtype() -> None:
    """Half-precision entries: the result is float16, the exact value rounded once (no float16 accumulation)."""
    current = {"w": torch.tensor([1.0, 2.0], dtype=torch.float16)}
    states = [{"w": torch.tensor([1.001, 2.5], dtype=torch.float16)} for _ in range(3)]
    out = fedbuff_step(current, states, [current] * 3, [1.0, 1.0, 1.0], [1.0, 0.5, 0.25], server_lr=2.0)
    expected = current["w"].double() + 2.0 * (states[0]["w"].double() - current["w"].double()) * (1.75 / 3)
    assert out["w"].dtype == torch.float16
    torch.testing.assert_close(out["w"], expected.half(), rtol=0, atol=0)


def test_fedasync_step_bad_weights_raise_value_error() -> None:
    """No states, mismatched lengths, negative or all-zero weights, a bad server_lr: ValueError."""
    w = scalar_state(1.0)
    with pytest.raises(ValueError, match="at least one"):
        fedasync_step(w, [], [], [])
    with pytest.raises(ValueError, match="one base, weight and discount"):
        fedasync_step(w, [w], [1.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="non-negative"):
        fedasync_step(w, [w, w], [1.0, -1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="positive"):
        fedasync_step(w, [w], [0.0], [1.0])
    with pytest.raises(ValueError, match="server_lr"):
        fedasync_step(w, [w], [1.0], [1.0], server_lr=0.0)
    with pytest.raises(ValueError, match="does not match"):
        fedasync_step(w, [{"other": torch.zeros(1)}], [1.0], [1.0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"rule": "fedavg"}, "one of"), ({"server_lr": 0.0}, "server_lr"), ({"staleness": "sqrt"}, "Staleness")],
)
def test_folding_bad_fields_raise_value_error(kwargs: dict[str, object], match: str) -> None:
    """An unknown rule, a non-positive server_lr, a staleness that is not a Staleness: ValueError."""
    with pytest.raises(ValueError, match=match):
        Folding(**kwargs)  # type: ignore[arg-type]


def test_interface_defaults_are_those_of_a_sync_round() -> None:
    """A NodeUpdate is fresh from version 0 unless told; a context folds by the plain mean; new failure reasons exist."""
    u = update("a", scalar_state(1.0), 1)
    assert (u.base_version, u.staleness) == (0, 0)
    ctx = context(0, ())
    assert ctx.version == 0 and ctx.folding == Folding() and ctx.folding.staleness(7) == 1.0
    assert Failure("a", 0, "stale").reason == "stale" and Failure("a", 0, "expired").reason == "expired"


# -- FedAvgM ------------------------------------------------------------------------------------------


def test_fedavgm_async_momentum_follows_next_model_target() -> None:
    """Momentum on Delta = w - next_model's target, over a fedasync then a fedbuff version, by hand."""
    # beta 0.9, no dampening, eta 1, from w = 0. Version 1 (fedasync, server_lr 0.5): target
    # 0.5 (0.5 x 2 + 0.5 x 1/2 x 4) = 1, v = -1, w = 1. Version 2 (fedbuff, bases {1: 0}): target
    # 1 + 0.5 (0.5 x 1/2 x 3 + 0.5 x 1) = 1.625, v = 0.9 (-1) - 0.625 = -1.525, w = 2.525
    coordinator = _coordinator("fedavgm", 0.0, momentum=0.9, dampening=False, server_lr=1.0)
    first = [_stale(update("a", scalar_state(2.0), 10), 1, 0), _stale(update("b", scalar_state(4.0), 10), 0, 1)]
    coordinator.aggregate(_ctx(1, Folding(rule="fedasync", staleness=POLY1, server_lr=0.5)), first, [])
    assert float(coordinator.model.weight.detach()) == pytest.approx(1.0, rel=1e-6)
    second = [_stale(update("a", scalar_state(3.0), 10), 1, 1), _stale(update("b", scalar_state(2.0), 10), 2, 0)]
    folding = Folding(rule="fedbuff", staleness=POLY1, server_lr=0.5, bases={1: scalar_state(0.0)})
    metrics = coordinator.aggregate(_ctx(2, folding), second, [])
    assert float(coordinator.model.weight.detach()) == pytest.approx(2.525, rel=1e-6)
    assert metrics["velocity_norm"] == pytest.approx(1.525, rel=1e-6)


# -- participation ------------------------------------------------------------------------------------


def test_participation_repeated_version_counts_again_without_an_interval() -> None:
    """Two updates of one node folded into version 3: count 3, intervals unchanged ([3]), last round 3."""
    rec = ParticipationRecord()
    rec.accepted("a", 0, num_samples=5)
    rec.accepted("a", 3, num_samples=5)
    rec.accepted("a", 3, num_samples=6)
    node = rec.get("a")
    assert node is not None
    assert (node.last_round, node.count, node.intervals, node.interval_count, node.mean_interval) == (3, 3, [3], 1, 3.0)
    assert node.num_samples == 6
    rec.accepted("a", 5, num_samples=6)
    assert node.intervals == [3, 2] and node.count == 4


def test_participation_first_acceptance_repeated_adds_no_interval() -> None:
    """A node's first version twice: count 2, no interval, mean interval None."""
    rec = ParticipationRecord()
    rec.accepted("a", 4, num_samples=5)
    rec.accepted("a", 4, num_samples=5)
    node = rec.get("a")
    assert node is not None and (node.count, node.intervals, node.mean_interval) == (2, [], None)


def test_participation_lower_version_than_the_last_raises_value_error() -> None:
    """An acceptance for an earlier version than the node's last is refused and changes nothing."""
    rec = ParticipationRecord()
    rec.accepted("a", 2, num_samples=5)
    with pytest.raises(ValueError, match="round 1 accepted after round 2"):
        rec.accepted("a", 1, num_samples=5)
    node = rec.get("a")
    assert node is not None and (node.count, node.last_round) == (1, 2)


def test_uploads_from_record_repeated_node_gives_one_upload_with_the_previous_participation() -> None:
    """Node a at versions 0 and 2, then twice at 5: one upload (its last state), previous (2, 2); b: new, (-1, 0)."""
    rec = ParticipationRecord()
    for version in (0, 2):
        rec.accepted("a", version, num_samples=5)
    states = [("a", scalar_state(1.0)), ("b", scalar_state(7.0)), ("a", scalar_state(2.0))]
    for node, _ in states:
        rec.accepted(node, 5, num_samples=5)
    uploads = uploads_from_record(rec, 5, states)
    assert [(u.node_id, u.previous_round, u.previous_count) for u in uploads] == [("a", 2, 2), ("b", -1, 0)]
    assert _value(uploads[0].state) == 2.0
    with pytest.raises(ValueError, match="no accepted participation"):
        uploads_from_record(rec, 5, [*states, ("b", scalar_state(3.0))])  # b: two uploads, one acceptance


# -- KDIA ---------------------------------------------------------------------------------------------


class _Async:
    """A federation whose aggregations are driven as the async engine drives them: each version's
    model and teacher are sent, updates trained from a version fold later with their staleness,
    participation is recorded at the version index in arrival order before `aggregate`."""

    def __init__(self, name: str, hyperparams: dict[str, object], rule: str = "fedbuff") -> None:
        self.fed = Federation(name, hyperparams)
        self.rule = rule
        self.version = 0
        self.bases: dict[int, StateDict] = {}
        self.payloads: dict[int, Payload] = {}
        self.metrics: list[Mapping[str, float]] = []

    def ctx(self, selected: Sequence[str] = ()) -> RoundContext:
        folding = Folding(rule=self.rule, staleness=Staleness(), server_lr=0.8, bases=dict(self.bases))  # type: ignore[arg-type]
        return _ctx(self.version, folding, participation=self.fed.participation, selected=tuple(selected))

    def send(self, node: str) -> Payload:
        """The task of the current version (configured once per version)."""
        if self.version not in self.payloads:
            out = self.fed.coordinator.configure_round(self.ctx(self.fed.node_ids))
            payload = out[node] if isinstance(out, Mapping) else out
            self.payloads[self.version] = Payload(
                tensors={g: clone(s) for g, s in payload.tensors.items()}, meta=dict(payload.meta)
            )
            self.bases[self.version] = clone(self.payloads[self.version].tensors["model"])
        return self.payloads[self.version]

    def train(self, node: str, seed_round: int | None = None) -> NodeUpdate:
        """`node` trains from the current version (its generator seeded by `seed_round`, default the version)."""
        payload = self.send(node)
        self.fed.round = self.version if seed_round is None else seed_round
        return dataclasses.replace(self.fed.train(node, payload), round=self.version, base_version=self.version)

    def fold(self, arrived: Sequence[NodeUpdate]) -> Mapping[str, float]:
        """Fold the buffer (in arrival order) into the next version."""
        updates = [dataclasses.replace(u, staleness=self.version - u.base_version) for u in arrived]
        for u in updates:
            self.fed.participation.accepted(u.node_id, self.version, num_samples=u.num_samples)
        ordered = sorted(updates, key=lambda u: u.node_id)  # stable: one node's updates stay in arrival order
        metrics = self.fed.coordinator.aggregate(self.ctx(sorted({u.node_id for u in updates})), ordered, [])
        self.metrics.append(metrics)
        self.version += 1
        return metrics


def _drive_kdia(teacher_mode: str) -> _Async:
    """Three versions: v0 folds node-000 twice and node-001; v1 a fresh node-002 and node-001's
    second update from v0 (staleness 1); v2 node-000's third update from v0 (staleness 2), a fresh
    node-002 and node-001 twice from v1 (a repeat of a node with history)."""
    run = _Async("kdia", {**SMALL_GEN, "teacher_mode": teacher_mode})
    a0, b0 = run.train("node-000"), run.train("node-001")
    a0_again = run.train("node-000", seed_round=50)  # delivered again at version 0, another draw
    b_late, a_late = run.train("node-001", seed_round=60), run.train("node-000", seed_round=70)
    run.fold([a0, b0, a0_again])
    run.fold([run.train("node-002"), b_late])
    b1, b1_again = run.train("node-001", seed_round=80), run.train("node-001", seed_round=90)
    run.fold([b1, a_late, run.train("node-002"), b1_again])
    return run


@pytest.mark.parametrize("teacher_mode", ["exact", "windowed", "incremental", "streaming"])
def test_kdia_async_aggregations_give_finite_models_and_normalised_teacher_weights(teacher_mode: str) -> None:
    """Repeated nodes and stale updates: finite metrics and models, teacher weights summing to 1, record in versions."""
    run = _drive_kdia(teacher_mode)
    coordinator = run.fed.coordinator
    for metrics in run.metrics:
        assert all(math.isfinite(v) for v in metrics.values()), metrics
    for model in coordinator.evaluation_models().values():
        assert all(torch.isfinite(t).all() for t in model.state_dict().values() if t.is_floating_point())
    records = coordinator.round_records()["teacher_weights"]
    weights = [r["weight"] for r in records]
    assert all(math.isfinite(w) and w > 0 for w in weights) and sum(weights) == pytest.approx(1.0, abs=1e-12)
    entry = {r["node_id"]: r for r in records}
    assert (entry["node-000"]["last_round"], entry["node-000"]["count"]) == (2, 3)
    assert (entry["node-001"]["last_round"], entry["node-001"]["count"]) == (2, 4)
    assert (entry["node-002"]["last_round"], entry["node-002"]["count"]) == (2, 2)
    assert run.metrics[0]["teacher_participant_share"] == pytest.approx(1.0)  # two nodes known, both took part


def test_kdia_async_store_keeps_a_repeated_node_last_update() -> None:
    """After version 0 the store holds node-000's second update of that version, not its first."""
    run = _Async("kdia", dict(SMALL_GEN))
    first, other, second = run.train("node-000"), run.train("node-001"), run.train("node-000", seed_round=50)
    assert not same_state(first.payload.tensors["model"], second.payload.tensors["model"])
    run.fold([first, other, second])
    store = run.fed.coordinator.store
    assert store is not None and store.rounds() == {"node-000": 0, "node-001": 0}
    assert same_state(store.get("node-000"), second.payload.tensors["model"])  # type: ignore[arg-type]


def test_kdia_async_incremental_teacher_matches_the_exact_one() -> None:
    """With repeated nodes, the incremental teacher (old mass from the previous (t_k, n_k)) equals the exact one."""
    exact, incremental = _drive_kdia("exact"), _drive_kdia("incremental")
    assert same_state(exact.fed.coordinator.model.state_dict(), incremental.fed.coordinator.model.state_dict())
    a, b = exact.fed.coordinator.teacher_model.state_dict(), incremental.fed.coordinator.teacher_model.state_dict()
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=1e-5, atol=1e-6)
    streaming = _drive_kdia("streaming")  # the approximate one differs: node-000's v0 model stays in its sums
    s = streaming.fed.coordinator.teacher_model.state_dict()
    assert any(not torch.allclose(s[k], v, rtol=1e-5, atol=1e-6) for k, v in a.items() if v.is_floating_point())


def test_kdia_async_student_is_next_model_fedbuff_step() -> None:
    """The student after version 0 is the fedbuff step over all three updates (node-000's both) with sample weights."""
    run = _Async("kdia", dict(SMALL_GEN))
    updates = [run.train("node-000"), run.train("node-001"), run.train("node-000", seed_round=50)]
    base = clone(run.bases[0])
    run.fold(updates)
    ordered = [updates[0], updates[2], updates[1]]
    expected = fedbuff_step(
        base,
        [u.payload.tensors["model"] for u in ordered],
        [base] * 3,
        [float(u.num_samples) for u in ordered],
        [1.0] * 3,
        server_lr=0.8,
    )
    assert same_state(run.fed.coordinator.model.state_dict(), expected)


# -- every registered method ----------------------------------------------------------------------------

CONTRACT_HYPERPARAMS: dict[str, dict[str, object]] = {"kdia": dict(SMALL_GEN)}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_method_is_sync_only_with_a_reason_or_folds_stale_updates(name: str) -> None:
    """sync_only is a sentence, or two fedbuff versions with a stale update give finite metrics and model."""
    reason = ALGORITHMS[name].coordinator.sync_only
    if reason is not None:
        assert isinstance(reason, str) and len(reason.split()) >= 8 and not reason.endswith(".")
        assert reason in (async_refusal(name) or "")
        return
    assert async_refusal(name) is None
    run = _Async(name, CONTRACT_HYPERPARAMS.get(name, {}))
    start = clone(run.fed.coordinator.model.state_dict())
    fresh = [run.train(n) for n in run.fed.node_ids]
    run.fold(fresh[:2])
    run.fold([run.train("node-000"), fresh[2]])  # node-002's update is one version stale
    for metrics in run.metrics:
        assert metrics and all(math.isfinite(v) for v in metrics.values()), metrics
    final = run.fed.coordinator.model.state_dict()
    assert all(torch.isfinite(t).all() for t in final.values() if t.is_floating_point())
    assert same_state(final, start) == (name == "noop")  # noop's nodes return the model they received


def test_fedvls_total_aggregation_async_keeps_the_previous_model_share() -> None:
    """FedVLS "total" under fedbuff: w + 0.8 sum_i (n_i / |D|) s(tau_i) (w_i - b_i), the previous model a zero delta."""
    run = _Async("fedvls", {"aggregation": "total"})
    fresh = [run.train(n) for n in run.fed.node_ids]
    run.fold(fresh)  # every node known: |D| = 90
    base0 = clone(run.bases[0])
    current = clone(run.fed.coordinator.model.state_dict())
    late = dataclasses.replace(fresh[0], node_id="node-001", num_samples=30)  # a v0 model folded into v1
    run.fold([late])
    s = Staleness()(1)
    expected = fedbuff_step(
        current, [late.payload.tensors["model"], current], [base0, current], [30.0, 60.0], [s, 1.0], server_lr=0.8
    )
    assert same_state(run.fed.coordinator.model.state_dict(), expected)


def test_async_refusal_names_the_method_or_the_aggregator() -> None:
    """SCAFFOLD and FedSA refuse with their reason; FedAvg with FedSA's aggregator refuses for the aggregator; unknown names are ConfigErrors."""
    assert "SCAFFOLD" in (async_refusal("scaffold") or "")
    assert "'mean' aggregator" in (async_refusal("fedsa") or "")
    assert async_refusal("fedavg", "mean") is None
    assert "aggregator 'fedsa'" in (async_refusal("fedprox", "fedsa") or "")
    with pytest.raises(ConfigError):
        async_refusal("fedasync")
    with pytest.raises(ConfigError):
        async_refusal("fedavg", "krum")
