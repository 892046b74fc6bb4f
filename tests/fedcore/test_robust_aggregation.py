"""Robust `method.aggregator` rules (`fedcore.aggregation.robust`): norm clipping, coordinate-wise median and
trimmed mean. On synthetic rounds (nine honest updates near the global model, one attacker far off)
each bounds what the poisoned update does where the mean follows it; small cases are checked against
values worked out by hand; and in an in-process federation on sklearn digits one poisoned node wrecks
FedAvg's mean but not the robust rules."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from torch import nn

from fedmq.experiments.config import parse_config
from fedmq.fedcore.aggregation import AGGREGATORS, build_aggregator
from fedmq.fedcore.aggregation.robust import NormClip, clipped_mean, coordinate_median, trimmed_mean, update_norm
from fedmq.fedcore.algorithms import async_refusal, build_hyperparams, fedavg, get_algorithm
from fedmq.fedcore.algorithms.base import Payload
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.tensors import StateDict
from tests.algorithms.common import context, update

HONEST = 9
ATTACK = 1e6


def global_model() -> nn.Module:
    """A linear layer and a BatchNorm: weights, floating buffers and the integer num_batches_tracked."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


def direction(state: StateDict) -> StateDict:
    """A synthetic unit vector over the floating entries (L2 norm 1 over all of them together)."""
    g = torch.Generator().manual_seed(7)
    raw = {k: torch.randn(v.shape, generator=g) for k, v in state.items() if v.is_floating_point()}
    norm = math.sqrt(sum(float(t.square().sum()) for t in raw.values()))
    return {k: t / norm for k, t in raw.items()}


def poisoned_round(model: nn.Module, attackers: int = 1) -> tuple[list[StateDict], StateDict]:
    """Synthetic updates: `HONEST` models at w + N(0, 0.01^2) each coordinate, then `attackers` at
    w + 1e6 u (u a unit direction); and u."""
    w = model.state_dict()
    u = direction(w)
    g = torch.Generator().manual_seed(1)
    honest = [
        {k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v + k_node for k, v in w.items()}
        for k_node in range(HONEST)
    ]
    bad = [{k: v + ATTACK * u[k] if v.is_floating_point() else v for k, v in w.items()} for _ in range(attackers)]
    return honest + bad, u


def distance(a: StateDict, b: StateDict) -> float:
    return update_norm(b, a)


def within_honest_range(out: StateDict, honest: list[StateDict]) -> bool:
    """Every floating coordinate of `out` lies between the honest updates' smallest and largest value there."""
    for name, value in out.items():
        if value.is_floating_point():
            stacked = torch.stack([s[name] for s in honest])
            if not bool(((value >= stacked.amin(0) - 1e-6) & (value <= stacked.amax(0) + 1e-6)).all()):
                return False
    return True


def scalars(*values: float) -> list[StateDict]:
    return [{"w": torch.tensor([v])} for v in values]


# -- one poisoned update among ten -------------------------------------------------------------------


def test_the_mean_follows_one_poisoned_update_a_tenth_of_the_way() -> None:
    """The baseline: FedAvg's mean moves by about 1e6 / 10 = 1e5 towards the attacker."""
    model = global_model()
    states, _ = poisoned_round(model)
    out = build_aggregator("mean")(states, [1.0] * len(states))
    assert distance(out, model.state_dict()) == pytest.approx(ATTACK / len(states), rel=1e-3)


def test_clip_moves_the_model_by_at_most_max_norm_and_the_attacker_by_max_norm_over_k() -> None:
    """Honest deltas (norm ~0.05) are under M = 1 and kept; the attacker's is cut to M, so with
    `weighted: false` the model is w + (1/10) sum honest deltas + (M/10) u, at most M from w."""
    model = global_model()
    w = model.state_dict()
    states, u = poisoned_round(model)
    rule = build_aggregator("clip", {"max_norm": 1.0, "weighted": False}, model=model)
    out = rule(states, [1.0] * len(states))
    assert distance(out, w) <= 1.0
    for name, now in w.items():
        if now.is_floating_point():
            honest = sum(s[name] - now for s in states[:HONEST])
            expected = now + honest / 10 + 1.0 / 10 * u[name]
            torch.testing.assert_close(out[name], expected, rtol=0, atol=1e-6)
    assert rule.metrics["clip_share"] == pytest.approx(0.1)
    assert rule.metrics["clip_norm_max"] == pytest.approx(ATTACK, rel=1e-6)
    assert rule.metrics["clip_norm_median"] < 0.1


def test_clip_auto_bounds_the_attacker_by_three_typical_updates_and_keeps_an_honest_round() -> None:
    """max_norm auto (`fedmq run --secure`'s rule): M = 3 x the round's median delta norm. The
    attacker's delta (norm 1e6) is cut to M, the honest ones (all near the median) are kept, so the
    model is the honest mean plus at most M / 10 of the attacker's direction; with no attacker the
    rule is the plain weighted mean."""
    model = global_model()
    w = model.state_dict()
    states, u = poisoned_round(model)
    rule = build_aggregator("clip", {"max_norm": "auto", "weighted": False}, model=model)
    out = rule(states, [1.0] * len(states))
    bound = 3 * rule.metrics["clip_norm_median"]
    assert rule.metrics["clip_max_norm"] == pytest.approx(bound) and bound < 0.5
    for name, now in w.items():
        if now.is_floating_point():
            honest = sum(s[name] - now for s in states[:HONEST])
            torch.testing.assert_close(out[name], now + honest / 10 + bound / 10 * u[name], rtol=0, atol=1e-6)
    assert rule.metrics["clip_share"] == pytest.approx(0.1)
    honest_only, rule = states[:HONEST], build_aggregator("clip", {"max_norm": "auto"}, model=model)
    kept = rule(honest_only, [float(k + 1) for k in range(HONEST)])
    mean = build_aggregator("mean")(honest_only, [float(k + 1) for k in range(HONEST)])
    for name in w:
        torch.testing.assert_close(kept[name], mean[name])
    assert rule.metrics["clip_share"] == 0.0


def test_clip_weighted_bounds_even_an_attacker_claiming_most_samples() -> None:
    """With the method's weights a node claiming 100 times the samples pulls harder, but never past M."""
    model = global_model()
    states, _ = poisoned_round(model)
    weights = [10.0] * HONEST + [1000.0]
    out = build_aggregator("clip", {"max_norm": 0.5}, model=model)(states, weights)
    assert distance(out, model.state_dict()) <= 0.5


@pytest.mark.parametrize(
    ("name", "options", "attackers"),
    [("median", None, 1), ("median", None, 4), ("trimmed_mean", None, 1), ("trimmed_mean", {"trim": 0.25}, 3)],
)
def test_median_and_trimmed_mean_stay_within_the_honest_range(name: str, options: dict | None, attackers: int) -> None:
    """With f attackers the median (f < K / 2) and the trimmed mean (floor(trim K) >= f) keep every
    coordinate between the honest updates' extremes: 1e6 away becomes at most ~0.03 away."""
    model = global_model()
    states, _ = poisoned_round(model, attackers)
    out = build_aggregator(name, options, model=model)(states, [1.0] * len(states))
    assert within_honest_range(out, states[:HONEST])
    assert distance(out, model.state_dict()) < 0.2


def test_a_trim_too_small_for_the_attackers_lets_them_through() -> None:
    """The bound needs floor(trim K) >= attackers: trim 0.1 of 11 drops one per end, and a second
    attacker on the same side moves the mean by ~1e6 / 9."""
    model = global_model()
    states, _ = poisoned_round(model, attackers=2)
    out = trimmed_mean(states, [1.0] * len(states), trim=0.1)
    assert distance(out, model.state_dict()) > 1e4


# -- exact values on small cases -----------------------------------------------------------------------


def test_median_by_hand() -> None:
    """Odd count: the middle value; even: the mean of the two middle ones; per coordinate."""
    assert coordinate_median(scalars(1.0, 10.0, 2.0), [1.0] * 3)["w"].item() == 2.0
    assert coordinate_median(scalars(1.0, 10.0, 2.0, 3.0), [1.0] * 4)["w"].item() == 2.5
    states = [{"w": torch.tensor([1.0, 9.0])}, {"w": torch.tensor([5.0, -1.0])}, {"w": torch.tensor([3.0, 4.0])}]
    assert coordinate_median(states, [1.0, 1.0, 1.0])["w"].tolist() == [3.0, 4.0]


def test_trimmed_mean_by_hand() -> None:
    """floor(trim K) values dropped at each end: 0.2 of 5 drops one (mean of 2, 3, 4); 0.1 of 5 drops none."""
    states = scalars(4.0, 100.0, 2.0, 1.0, 3.0)
    assert trimmed_mean(states, [1.0] * 5, trim=0.2)["w"].item() == 3.0
    assert trimmed_mean(states, [1.0] * 5, trim=0.1)["w"].item() == 22.0
    assert trimmed_mean(states, [1.0] * 5, trim=0.0)["w"].item() == 22.0
    # 0.29 * 100 is 28.999... in floats, and still 29 per end: 29 zeros and 29 of the 71 ones go, 42 ones stay
    assert trimmed_mean(scalars(*[0.0] * 29, *[1.0] * 71), [1.0] * 100, trim=0.29)["w"].item() == 1.0


def test_clip_by_hand() -> None:
    """From w = 0: deltas (3, 4) (norm 5) and (0.3, 0.4) (norm 0.5), M = 1, weights 1 and 3: the first
    is cut to (0.6, 0.8); weighted 0.25 (0.6, 0.8) + 0.75 (0.3, 0.4) = (0.375, 0.5), unweighted (0.45, 0.6)."""
    current = {"w": torch.zeros(2)}
    states = [{"w": torch.tensor([3.0, 4.0])}, {"w": torch.tensor([0.3, 0.4])}]
    norms: list[float] = []
    out = clipped_mean(current, states, [1.0, 3.0], max_norm=1.0, norms=norms)
    torch.testing.assert_close(out["w"], torch.tensor([0.375, 0.5]))
    assert norms == pytest.approx([5.0, 0.5])
    unweighted = clipped_mean(current, states, [1.0, 3.0], max_norm=1.0, weighted=False)
    torch.testing.assert_close(unweighted["w"], torch.tensor([0.45, 0.6]))
    # no delta above M: the weighted mean, up to rounding
    loose = clipped_mean(current, states, [1.0, 3.0], max_norm=10.0)
    torch.testing.assert_close(loose["w"], build_aggregator("mean")(states, [1.0, 3.0])["w"])


def test_zero_weights_leave_an_update_out_and_others_count_once() -> None:
    """A method gives weight 0 to leave an update out; the order statistics ignore sample counts."""
    states = scalars(1.0, 2.0, 100.0)
    assert coordinate_median(states, [1.0, 1.0, 0.0])["w"].item() == 1.5
    assert coordinate_median(states, [1.0, 1.0, 50.0])["w"].item() == 2.0
    with pytest.raises(ValueError, match="positive"):
        coordinate_median(states, [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="non-negative"):
        trimmed_mean(states, [1.0, -1.0, 1.0])


def test_integer_buffers_take_the_maximum_and_dtypes_are_kept() -> None:
    """num_batches_tracked: the largest counted value, as in the weighted mean; float64 stays float64."""
    model = global_model()
    states, _ = poisoned_round(model)  # honest node k has num_batches_tracked k
    weights = [1.0] * (len(states) - 1) + [0.0]
    for name, options in (("clip", {"max_norm": 1.0}), ("median", None), ("trimmed_mean", None)):
        out = build_aggregator(name, options, model=model)(states, weights)
        assert out["1.num_batches_tracked"].dtype == torch.int64
        assert out["1.num_batches_tracked"].item() == HONEST - 1
        assert all(out[k].dtype == v.dtype for k, v in states[0].items())
    doubles = [{"w": torch.tensor([v], dtype=torch.float64)} for v in (0.1, 0.2, 0.3)]
    assert coordinate_median(doubles, [1.0] * 3)["w"].dtype == torch.float64
    assert trimmed_mean(doubles, [1.0] * 3, trim=0.0)["w"].item() == (0.1 + 0.2 + 0.3) / 3


def test_median_and_trimmed_mean_do_not_depend_on_the_order_bit_for_bit() -> None:
    """Every permutation of the updates gives the same tensors, bits included (-0.0 and 0.0 too)."""
    g = torch.Generator().manual_seed(3)
    states = [{"w": torch.randn(50, generator=g), "z": torch.tensor([-0.0 if k % 2 else 0.0])} for k in range(5)]
    for rule in (coordinate_median, lambda s, w: trimmed_mean(s, w, trim=0.2), lambda s, w: trimmed_mean(s, w, trim=0)):
        first = rule(states, [1.0] * 5)
        for order in itertools.permutations(range(5)):
            out = rule([states[k] for k in order], [1.0] * 5)
            assert all(torch.equal(out[k], first[k]) for k in first)
            assert math.copysign(1.0, out["z"].item()) == 1.0


# -- the global model clip reads ---------------------------------------------------------------------


def test_clip_reads_the_global_model_each_round_not_a_copy() -> None:
    """On FedAvg's server, three rounds: each round's deltas are taken from the model the previous
    round made (FedAvg loads it in place), so each new model is that one plus the clipped mean."""
    spec = get_algorithm("fedavg")
    half = spec.coordinator(build_hyperparams(spec, {}), model=global_model())
    half.average = build_aggregator("clip", {"max_norm": 0.5}, model=half.model)
    for round in range(3):
        before = {k: v.clone() for k, v in half.model.state_dict().items()}
        states, u = poisoned_round(half.model)
        updates = [update(f"node-{k}", s, 10, round) for k, s in enumerate(states)]
        half.aggregate(context(round, tuple(u.node_id for u in updates)), updates, [])
        for name, now in before.items():
            if now.is_floating_point():
                honest = sum(s[name] - now for s in states[:HONEST])
                expected = now + honest / 10 + 0.5 / 10 * u[name]  # the attacker's 1e6 u cut to 0.5 u, weight 1/10
                torch.testing.assert_close(half.model.state_dict()[name], expected, rtol=0, atol=1e-6)
        assert distance(half.model.state_dict(), before) <= 0.5
        assert half.averaging_metrics()["clip_share"] == pytest.approx(0.1)


def test_clip_without_a_model_or_against_other_entries_refuses() -> None:
    rule = build_aggregator("clip", {"max_norm": 1.0})  # as preflight builds it: options checked only
    with pytest.raises(ValueError, match="needs the global model"):
        rule(scalars(1.0), [1.0])
    rule = NormClip(rule.hp, model=nn.Linear(1, 1, bias=False))
    with pytest.raises(ValueError, match=re.escape("unexpected ['w']")):
        rule(scalars(1.0), [1.0])


# -- options and async mode ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("clip", {}, "max_norm"),
        ("clip", {"max_norm": 0}, "max_norm must be a positive number"),
        ("clip", {"max_norm": -1.0}, "max_norm must be a positive number"),
        ("clip", {"max_norm": float("inf")}, "max_norm must be a positive number"),
        ("clip", {"max_norm": "big"}, "max_norm must be a positive number or 'auto', got 'big'"),
        ("clip", {"max_norm": True}, "max_norm must be a positive number or 'auto', got True"),
        ("clip", {"max_norm": "auto", "auto_multiple": 0.5}, "auto_multiple must be a number of at least 1"),
        ("clip", {"max_norm": 1.0, "weighted": "yes"}, "'yes' is not a bool"),
        ("clip", {"max_norm": 1.0, "norm": 2}, "unknown options ['norm']"),
        ("trimmed_mean", {"trim": 0.5}, "trim must be in [0, 0.5)"),
        ("trimmed_mean", {"trim": -0.1}, "trim must be in [0, 0.5)"),
        ("median", {"trim": 0.1}, "aggregator 'median' takes no options"),
    ],
)
def test_bad_options_are_config_errors_naming_the_field(name: str, options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        build_aggregator(name, options)
    assert err.value.field is not None and err.value.field.startswith("method.aggregator.options")


def test_options_have_their_defaults_and_ints_are_floats() -> None:
    assert build_aggregator("clip", {"max_norm": 2}).hp.max_norm == 2.0
    assert build_aggregator("clip", {"max_norm": 2}).hp.weighted is True
    assert build_aggregator("trimmed_mean").keywords == {"trim": 0.1}
    assert {"clip", "median", "trimmed_mean"} <= set(AGGREGATORS)


def _sync(nodes: int, fraction: float, aggregator: dict, **extra: object) -> dict:
    return {"name": "x", "nodes": nodes, "policy": {"fraction": fraction}, "rounds": 2, "method": {"name": "fedavg",
            "aggregator": aggregator}, **extra}  # fmt: skip


def test_a_robust_rule_that_would_be_the_plain_mean_for_the_cohort_is_refused_with_the_arithmetic() -> None:
    """Issue 31, item 2: trimmed_mean's default trim 0.1 over 5 updates a round trims nothing, so it
    was the plain mean and one poisoned update wrecked the run; nothing said so at start."""
    five = _sync(20, 0.25, {"name": "trimmed_mean"})
    with pytest.raises(ConfigError, match=re.escape("drops floor(0.1 x 5) = 0 values at each end")) as refused:
        parse_config(five)
    assert "set trim to at least 0.2 (1/5)" in str(refused.value) and "fraction x nodes = 5" in str(refused.value)
    parse_config(_sync(20, 0.25, {"name": "trimmed_mean", "options": {"trim": 0.2}}))  # trims one each end
    parse_config(_sync(20, 0.5, {"name": "trimmed_mean"}))  # 10 a round: one each end
    with pytest.raises(ConfigError, match="can trim nothing"):
        parse_config(_sync(4, 0.5, {"name": "trimmed_mean", "options": {"trim": 0.45}}))
    with pytest.raises(ConfigError, match=re.escape("median over 2 update(s) a round is their mean")):
        parse_config(_sync(4, 0.5, {"name": "median"}))
    parse_config(_sync(6, 0.5, {"name": "median"}))
    with pytest.raises(ConfigError, match=re.escape("clip with max_norm auto over 2 update(s) a round")):
        parse_config(_sync(4, 0.5, {"name": "clip", "options": {"max_norm": "auto"}}))
    parse_config(_sync(6, 0.5, {"name": "clip", "options": {"max_norm": "auto"}}))
    # with sites the coordinator aggregates one partial per site
    with pytest.raises(ConfigError, match="over 2 update"):
        parse_config(_sync(40, 1.0, {"name": "median"}, hierarchy={"sites": 2}))


@pytest.mark.parametrize("name", ["clip", "median", "trimmed_mean"])
def test_async_mode_refuses_the_robust_rules_with_a_reason(name: str) -> None:
    """The asynchronous folding steps do not call the averaging rule: async runs refuse these rules
    when the file is loaded, rather than silently averaging."""
    reason = async_refusal("fedavg", name) or ""
    assert f"aggregator {name!r} cannot aggregate asynchronously" in reason and "'mean' aggregator only" in reason
    aggregator = {"name": name, "options": {"max_norm": 1.0} if name == "clip" else {}}
    with pytest.raises(ConfigError, match=re.escape(f"aggregator {name!r} cannot aggregate asynchronously")):
        parse_config(
            {
                "name": "x",
                "nodes": 2,
                "engine": {"kind": "async"},
                "method": {"name": "fedavg", "aggregator": aggregator},
            }
        )


# -- an in-process federation with a poisoned node -----------------------------------------------------


class NoisyNode(fedavg.NodeHalf):
    """A poisoned node: trains as FedAvg does, then adds N(0, 10^2) to every floating entry (finite,
    of the right shapes, so the coordinator accepts it)."""

    def train(self, task, model, data, generator) -> Payload:
        out = super().train(task, model, data, generator)
        noisy = {
            k: v + 10.0 * torch.randn(v.shape, generator=generator) if v.is_floating_point() else v
            for k, v in out.tensors["model"].items()
        }
        return Payload(tensors={"model": noisy}, meta=out.meta)


def poisoned_digits_accuracy(aggregator: dict) -> float:
    """FedAvg on sklearn digits, 10 IID nodes all training each round, an MLP, 4 rounds, node-003
    poisoned: the last round's test accuracy."""
    from fedmq.experiments.local import build_local

    cfg = parse_config(
        {
            "name": "robust",
            "nodes": 10,
            "policy": {"fraction": 1.0},
            "rounds": 4,
            "eval_every": 4,
            "data": {"dataset": "digits"},
            "partition": {"kind": "iid"},
            "model": {"name": "mlp"},
            "method": {"name": "fedavg", "aggregator": aggregator},
            "train": {"local_epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.9},
        }
    )
    fed = build_local(cfg, device=torch.device("cpu"))
    fed.nodes["node-003"].half = NoisyNode(fed.nodes["node-003"].half.hp, node_id="node-003")
    records = fed.run()
    assert fed.engine.state == "finished" and all(len(r["accepted"]) == 10 for r in records)
    return records[-1]["accuracy"]


@pytest.mark.slow
def test_one_poisoned_node_wrecks_the_mean_but_not_the_robust_rules() -> None:
    """One node of ten sends its model plus noise of std 10: FedAvg's mean ends near chance, median,
    trimmed mean and clip (M = 1; honest deltas are ~0.8 here) near the clean run's ~0.85."""
    assert poisoned_digits_accuracy({"name": "mean"}) < 0.5
    for aggregator in ({"name": "median"}, {"name": "trimmed_mean"}, {"name": "clip", "options": {"max_norm": 1.0}}):
        assert poisoned_digits_accuracy(aggregator) > 0.75, aggregator
