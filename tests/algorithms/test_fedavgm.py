"""FedAvgM's two halves in-process: the server momentum rule by hand, FedAvg at beta = 0 and eta = 1,
the checkpointed velocity, determinism and bad hyperparameters."""

from __future__ import annotations

import math

import pytest
import torch

from fedcore.algorithms import build_hyperparams, get_algorithm
from fedcore.errors import ConfigError
from tests.algorithms.common import Federation, context, same_state, scalar_model, scalar_state, update

SPEC = get_algorithm("fedavgm")


def _coordinator(**hp: object):  # type: ignore[no-untyped-def]
    return SPEC.coordinator(build_hyperparams(SPEC, hp), model=scalar_model(0.0))


def _round(coordinator, round: int, values: tuple[float, float]) -> float:  # type: ignore[no-untyped-def]
    """Two equal-sized updates holding `values`; the new global weight."""
    updates = [update(f"n{i}", scalar_state(v), 10, round, loss=1.0) for i, v in enumerate(values)]
    coordinator.aggregate(context(round, ("n0", "n1")), updates, [])
    return float(coordinator.model.weight.detach())


@pytest.mark.parametrize(
    ("hp", "expected"),
    [
        # paper: v1 = -1, w1 = 1; Delta2 = 1 - 1.5 = -0.5, v2 = 0.9 (-1) - 0.5 = -1.4, w2 = 1 + 1.4
        ({"dampening": False}, (1.0, 2.4)),
        # code: v1 = 0.1 (-1), w1 = 0.1; Delta2 = 0.1 - 1.5 = -1.4, v2 = -0.09 - 0.14 = -0.23, w2 = 0.33
        ({"dampening": True}, (0.1, 0.33)),
        # eta = 0.5: v1 = -1, w1 = 0.5; Delta2 = -1, v2 = -1.9, w2 = 0.5 + 0.95
        ({"dampening": False, "server_lr": 0.5}, (0.5, 1.45)),
    ],
)
def test_aggregate_two_rounds_matches_hand_computed_momentum(
    hp: dict[str, object], expected: tuple[float, float]
) -> None:
    """w_0 = 0, averages 1.0 then 1.5, beta = 0.9: the global weight after each round, by hand."""
    coordinator = _coordinator(**hp)
    assert _round(coordinator, 0, (0.0, 2.0)) == pytest.approx(expected[0], abs=1e-6)
    assert _round(coordinator, 1, (1.0, 2.0)) == pytest.approx(expected[1], abs=1e-6)


@pytest.mark.parametrize("dampening", [True, False])
def test_fedavgm_neutral_setting_equals_fedavg_exactly(dampening: bool) -> None:
    """beta = 0 and eta = 1 give FedAvg's global model bit for bit, on the same seed."""
    fedavg = Federation("fedavg").run(3)
    neutral = Federation("fedavgm", {"momentum": 0.0, "server_lr": 1.0, "dampening": dampening}).run(3)
    assert same_state(fedavg, neutral)
    assert not same_state(fedavg, Federation("fedavgm").run(3))


def test_fedavgm_training_is_deterministic_under_a_fixed_seed() -> None:
    """Two federations with the same seed end with the same model and velocity; another seed differs."""
    a, b = Federation("fedavgm"), Federation("fedavgm")
    assert same_state(a.run(2), b.run(2))
    assert same_state(a.coordinator.state_dict(), b.coordinator.state_dict())
    assert not same_state(a.coordinator.model.state_dict(), Federation("fedavgm", seed=1).run(2))
    assert all(math.isfinite(m["train_loss"]) and m["velocity_norm"] > 0 for m in a.metrics)


def test_fedavgm_state_round_trip_resumes_identically() -> None:
    """A coordinator restored from the model and `state_dict` after round 0 aggregates round 1 as the original does."""
    original = _coordinator(dampening=False)
    _round(original, 0, (0.0, 2.0))
    restored = _coordinator(dampening=False)
    restored.model.load_state_dict(original.model.state_dict())
    restored.load_state_dict({k: v.clone() for k, v in original.state_dict().items()})
    assert _round(original, 1, (1.0, 2.0)) == _round(restored, 1, (1.0, 2.0)) == pytest.approx(2.4)
    fresh = _coordinator(dampening=False)  # without the velocity the second round differs
    fresh.model.load_state_dict(original.model.state_dict())
    assert _round(fresh, 1, (1.0, 2.0)) != pytest.approx(2.4)


def test_fedavgm_load_state_dict_with_wrong_entries_raises_value_error() -> None:
    """A velocity that does not match the model is refused with the entries named."""
    coordinator = _coordinator()
    with pytest.raises(ValueError, match="missing"):
        coordinator.load_state_dict({})
    with pytest.raises(ValueError, match="unexpected"):
        coordinator.load_state_dict({"velocity/weight": torch.zeros(1, 1), "velocity/bias": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        coordinator.load_state_dict({"velocity/weight": torch.zeros(2)})


def test_fedavgm_defaults_are_the_spec_values() -> None:
    """Momentum 0.9, server lr 1.0 and KDIA's dampened rule by default."""
    hp = build_hyperparams(SPEC, {})
    assert (hp.momentum, hp.server_lr, hp.dampening) == (0.9, 1.0, True)


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"momentum": float("nan")}, "momentum"),
        ({"server_lr": 0}, "server_lr"),
        ({"server_lr": float("inf")}, "server_lr"),
        ({"dampening": "yes"}, "not a bool"),
        ({"beta": 0.9}, "unknown hyperparameters"),
    ],
)
def test_fedavgm_bad_hyperparameters_raise_config_error(values: dict[str, object], match: str) -> None:
    """Out-of-range, mistyped and unknown hyperparameters are ConfigErrors naming the problem."""
    with pytest.raises(ConfigError, match=match):
        build_hyperparams(SPEC, values)
