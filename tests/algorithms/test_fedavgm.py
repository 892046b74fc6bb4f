"""FedAvgM's two halves in-process: the server momentum rule by hand, FedAvg at beta = 0 and eta = 1,
determinism; hyperparameters and checkpoints: test_contract.py."""

from __future__ import annotations

import math

import pytest

from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm
from tests.algorithms import common
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
    a = common.assert_deterministic("fedavgm")
    assert all(math.isfinite(m["train_loss"]) and m["velocity_norm"] > 0 for m in a.metrics)
