"""FedDisco's two halves in-process: the discrepancy and Eq. 8 by hand, FedAvg at a = b = 0, the
normalisation switch, invalid discrepancies, the all-clipped fallback, the node's reported d_k;
hyperparameters and checkpoints: test_contract.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm
from fedmq.fedcore.algorithms.feddisco import DISCREPANCY, disco_weights, label_discrepancy
from fedmq.fedcore.errors import AlgorithmError
from tests.algorithms import common
from tests.algorithms.common import Federation, context, same_state, tiny_model

SPEC = get_algorithm("feddisco")


def _coordinator(num_classes: int | None = None, **hp: object):  # type: ignore[no-untyped-def]
    model = common.scalar_model(0.0)
    if num_classes is not None:
        model.num_classes = num_classes  # what the framework's models expose; bounds d_k by log C
    return SPEC.coordinator(build_hyperparams(SPEC, hp), model=model)


def _aggregate(coordinator, rows: list[tuple[float, int, object]]) -> tuple[float, dict[str, float]]:  # type: ignore[no-untyped-def]
    """One round of hand-made updates (value, num_samples, discrepancy or `...` for none), each
    reporting loss 1; the new weight and the metrics."""
    reported = [(value, n, {"loss": 1.0} if d is ... else {"loss": 1.0, DISCREPANCY: d}) for value, n, d in rows]
    return common.aggregate_scalars(coordinator, reported)


# -- the discrepancy and Eq. 8 by hand ----------------------------------------------------------


def test_label_discrepancy_hand_values() -> None:
    """KL from uniform: 0 when balanced, log C for a single class, and a two-class case by hand."""
    assert label_discrepancy([5, 5, 5]) == 0.0
    assert label_discrepancy([0, 7, 0]) == pytest.approx(math.log(3), rel=1e-15)
    assert label_discrepancy([0, 0, 0, 0, 0, 0, 0, 0, 0, 12]) == pytest.approx(math.log(10), rel=1e-15)
    # P = (3/4, 1/4), C = 2: 3/4 log(3/2) + 1/4 log(1/2)
    assert label_discrepancy([3, 1]) == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5), rel=1e-15)
    assert label_discrepancy([3, 1]) == pytest.approx(0.13081204, abs=1e-8)
    # C = 3, P = (1/2, 1/2, 0): log(3/2)
    assert label_discrepancy([4, 4, 0]) == pytest.approx(math.log(1.5), rel=1e-15)


def test_label_discrepancy_of_empty_histogram_raises_value_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        label_discrepancy([0, 0, 0])


def test_disco_weights_match_eq_8_by_hand_with_one_clipped() -> None:
    """n = (10, 20, 70), d = (0.1, 0.5, 2.0), a = 0.5, b = 0.1: p ~ ReLU(n_k/n - a d_k + b) = (0.15, 0.05, -0.2 -> 0)."""
    weights = disco_weights([10, 20, 70], [0.1, 0.5, 2.0], 0.5, 0.1)
    assert weights == pytest.approx([15.0, 5.0, 0.0], abs=1e-12)
    assert weights[2] == 0.0
    p = np.array(weights) / sum(weights)
    assert p == pytest.approx([0.75, 0.25, 0.0], abs=1e-12)


def test_disco_weights_with_zero_a_and_b_are_the_sample_counts_exactly() -> None:
    assert disco_weights([10, 25, 7], [0.3, 1.1, 0.0], 0.0, 0.0) == [10.0, 25.0, 7.0]


def test_aggregate_weights_models_by_eq_8_and_counts_clipped_updates() -> None:
    """Values (1, 2, 3) with the weights above, raw discrepancies: (15 x 1 + 5 x 2) / 20 = 1.25, one clipped."""
    coordinator = _coordinator(a=0.5, b=0.1, normalize=False)
    value, metrics = _aggregate(coordinator, [(1.0, 10, 0.1), (2.0, 20, 0.5), (3.0, 70, 2.0)])
    assert value == pytest.approx(1.25, abs=1e-6)
    assert metrics["disco_clipped"] == 1.0
    assert metrics["disco_invalid"] == 0.0 and metrics["disco_fallback"] == 0.0
    assert metrics["train_loss"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("normalize", "expected"),
    [
        # d / sum d = (0.1, 0.3, 0.6): p ~ (0.1 - 0.05 + 0.1, 0.3 - 0.15 + 0.1, 0.6 - 0.3 + 0.1) = (15, 25, 40) / 80
        (True, (15 * 1 + 25 * 2 + 40 * 3) / 80),
        # raw d = (0.2, 0.6, 1.2): p ~ (0.1 - 0.1 + 0.1, 0.3 - 0.3 + 0.1, 0.6 - 0.6 + 0.1), equal weights
        (False, 2.0),
    ],
)
def test_normalize_divides_discrepancies_by_their_round_sum(normalize: bool, expected: float) -> None:
    """n = (10, 30, 60), d = (0.2, 0.6, 1.2), a = 0.5, b = 0.1, values (1, 2, 3), with and without normalisation."""
    coordinator = _coordinator(a=0.5, b=0.1, normalize=normalize)
    value, metrics = _aggregate(coordinator, [(1.0, 10, 0.2), (2.0, 30, 0.6), (3.0, 60, 1.2)])
    assert value == pytest.approx(expected, abs=1e-6)
    assert metrics["disco_clipped"] == 0.0


def test_normalize_with_all_zero_discrepancies_keeps_them_zero() -> None:
    """Balanced nodes everywhere (sum d = 0): no division by zero, p ~ n_k/n + b."""
    coordinator = _coordinator(a=0.5, b=0.1, normalize=True)
    value, metrics = _aggregate(coordinator, [(1.0, 10, 0.0), (3.0, 30, 0.0)])
    # weights 10 + 40 x 0.1 = 14 and 30 + 4 = 34
    assert value == pytest.approx((14 * 1 + 34 * 3) / 48, abs=1e-6)
    assert metrics["disco_fallback"] == 0.0


def test_zero_a_and_b_give_fedavg_global_model_exactly() -> None:
    """a = b = 0: FedDisco's global model is FedAvg's bit for bit on the same seed; the defaults differ."""
    fedavg = Federation("fedavg").run(2)
    neutral = Federation("feddisco", {"a": 0.0, "b": 0.0})
    assert same_state(fedavg, neutral.run(2))
    assert all(m["disco_clipped"] == 0.0 and m["disco_fallback"] == 0.0 for m in neutral.metrics)
    assert not same_state(fedavg, Federation("feddisco").run(2))


# -- invalid discrepancies and the fallback -----------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [..., float("nan"), float("inf"), -0.1, True, False, "0.3", None, math.log(3) * 1.01, 5.0],
    ids=["missing", "nan", "inf", "negative", "true", "false", "string", "none", "above-log-C", "far-above-log-C"],
)
def test_invalid_discrepancy_leaves_update_out(bad: object) -> None:
    """An update with a missing, non-numeric, non-finite, negative, bool or > log C discrepancy is left out."""
    coordinator = _coordinator(num_classes=3, a=0.5, b=0.1)
    value, metrics = _aggregate(coordinator, [(1.0, 10, 0.5), (7.0, 90, bad)])
    assert value == pytest.approx(1.0, abs=1e-6)  # only the valid update remains
    assert metrics["disco_invalid"] == 1.0


def test_discrepancy_up_to_log_c_is_valid() -> None:
    """A single-class node's d_k = log C (computed in floating point) is accepted."""
    coordinator = _coordinator(num_classes=3, a=0.0, b=0.0)
    value, metrics = _aggregate(coordinator, [(1.0, 10, 0.5), (3.0, 10, label_discrepancy([0, 9, 0]))])
    assert value == pytest.approx(2.0, abs=1e-6)
    assert metrics["disco_invalid"] == 0.0


def test_all_discrepancies_invalid_raises_algorithm_error() -> None:
    coordinator = _coordinator(num_classes=3)
    with pytest.raises(AlgorithmError, match="valid discrepancy"):
        _aggregate(coordinator, [(1.0, 10, ...), (2.0, 10, float("nan")), (3.0, 10, -1.0)])


def test_all_weights_clipped_falls_back_to_fedavg() -> None:
    """a = 10 clips every ReLU: the round uses n_k / n, (10 x 1 + 30 x 3) / 40 = 2.5, and reports the fallback."""
    coordinator = _coordinator(a=10.0, b=0.0)
    value, metrics = _aggregate(coordinator, [(1.0, 10, 0.5), (3.0, 30, 0.5)])
    assert value == pytest.approx(2.5, abs=1e-6)
    assert metrics["disco_fallback"] == 1.0
    assert metrics["disco_clipped"] == 0.0  # the weights used are FedAvg's, none zero


# -- the node half ------------------------------------------------------------------------------


def test_node_reports_discrepancy_of_its_shard_histogram() -> None:
    """Each node's update carries meta discrepancy = label_discrepancy(its shard's label histogram), and its loss."""
    federation = Federation("feddisco")
    payload = federation.coordinator.configure_round(context(0, federation.node_ids))
    values = []
    for node, data in zip(federation.node_ids, federation.data, strict=True):
        out = federation.train(node, payload)
        expected = label_discrepancy(data.label_histogram())
        assert out.payload.meta[DISCREPANCY] == expected
        assert isinstance(out.payload.meta[DISCREPANCY], float) and 0.0 <= expected <= math.log(3) + 1e-12
        assert math.isfinite(out.payload.meta["loss"])
        values.append(expected)
    assert max(values) > 0.0  # the shards are label-skewed
    assert len(set(values)) > 1


def test_node_with_empty_shard_raises_algorithm_error() -> None:
    """No labels, no distribution: the node fails the round with an AlgorithmError naming itself."""
    with pytest.raises(AlgorithmError, match=r"empty.*node n0, round 2"):
        common.train_alone(SPEC, tiny_model(), data=common.empty_shard())
