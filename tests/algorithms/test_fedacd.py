"""FedACD's two halves in-process: L1 (value and both gradients), L2 and Eq. 9 against hand-computed
cases, log Delta with missing classes, Mixup (lam = 1 is no Mixup, seeded Beta draws), the class-
probability matrix and its running estimate, KL(P || Q) and the score by hand (with the spec's CIFAR-100
check), the aggregation weights of Eq. 11 and its variants, invalid scores from the wire, FedAvg at the
neutral setting, determinism, the node's reported score, a CUDA run; hyperparameters and checkpoints: test_contract.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from fedmq.fedcore.algorithms import build_hyperparams, fedacd
from fedmq.fedcore.algorithms.base import Payload, TaskInput
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.training import TrainSettings
from tests.algorithms import common
from tests.algorithms.common import SETTINGS, Federation, context, same_state, shards, tiny_model

SPEC = fedacd.SPEC
NEUTRAL = {"l1_weight": 0.0, "logit_adjust": False, "mixup_alpha": 0.0, "weighting": "samples"}
"""The setting that makes FedACD train and aggregate as FedAvg does."""


def _logits(*probs: float) -> torch.Tensor:
    """One sample's logits whose softmax is `probs` (which sum to 1)."""
    return torch.log(torch.tensor([probs], dtype=torch.float64))


# -- L1 (Eq. 7) ----------------------------------------------------------------------------------


def test_flatten_loss_matches_hand_values() -> None:
    """p = (0.5, 0.3, 0.2): y = 0 gives q = (0.5, 0.25, 0.25) and 0.3 ln 1.2 + 0.2 ln 0.8 = 0.0100678;
    y = 2 gives q = (0.4, 0.4, 0.2) and 0.5 ln 1.25 + 0.3 ln 0.75 = 0.0252672."""
    logits = _logits(0.5, 0.3, 0.2).repeat(2, 1)
    l1 = fedacd.flatten_loss(logits, torch.tensor([0, 2]))
    assert l1.shape == (2,)
    assert float(l1[0]) == pytest.approx(0.3 * math.log(1.2) + 0.2 * math.log(0.8), abs=1e-12)
    assert float(l1[0]) == pytest.approx(0.0100678, abs=1e-7)
    assert float(l1[1]) == pytest.approx(0.5 * math.log(1.25) + 0.3 * math.log(0.75), abs=1e-12)
    assert float(l1[1]) == pytest.approx(0.0252672, abs=1e-7)


def test_flatten_loss_is_zero_for_flat_wrong_classes_and_for_two_classes() -> None:
    """Flat off-diagonal probabilities are the target itself; with C = 2 the one wrong class is always flat."""
    flat = fedacd.flatten_loss(_logits(0.4, 0.2, 0.2, 0.2), torch.tensor([0]))
    assert float(flat) == pytest.approx(0.0, abs=1e-15)
    two = fedacd.flatten_loss(torch.tensor([[2.0, -1.0], [0.3, 0.1]]), torch.tensor([0, 1]))
    assert torch.allclose(two, torch.zeros(2), atol=1e-7)


def test_flatten_loss_gradients_match_hand_derivatives_for_both_target_variants() -> None:
    """p = (0.5, 0.3, 0.2), y = 0. Undetached, L1 = (1 - p_y) KL(p~ || U) so dL1/df_y = -p_y (1 - p_y) KL(p~ || U);
    detached, dL1/df_y = -p_y [sum_{k != y} p_k log p_k + (1 - p_y)] + log(q_k) p_y (1 - p_y). Same value both ways."""
    p_y, rest = 0.5, (0.3, 0.2)
    kl_tilde = sum(r / (1 - p_y) * math.log((r / (1 - p_y)) * len(rest)) for r in rest)
    log_q = math.log((1 - p_y) / 2)
    expected = {
        False: -p_y * (1 - p_y) * kl_tilde,
        True: -p_y * (sum(r * math.log(r) for r in rest) + (1 - p_y)) + log_q * p_y * (1 - p_y),
    }
    for detach, grad_y in expected.items():
        logits = _logits(0.5, 0.3, 0.2).requires_grad_(True)
        value = fedacd.flatten_loss(logits, torch.tensor([0]), detach_target=detach)
        assert float(value.detach()) == pytest.approx((1 - p_y) * kl_tilde, abs=1e-12)
        value.sum().backward()
        assert float(logits.grad[0, 0]) == pytest.approx(grad_y, abs=1e-10), detach
    assert expected[True] != pytest.approx(expected[False])


def test_flatten_loss_stays_finite_for_extreme_logits() -> None:
    """A confident sample (p_y ~ 1) and an underflowing wrong class give finite values and gradients."""
    logits = torch.tensor([[60.0, -40.0, 0.0], [-80.0, 80.0, 79.0]], requires_grad=True)
    for detach in (True, False):
        value = fedacd.flatten_loss(logits, torch.tensor([0, 0]), detach_target=detach).sum()
        (grad,) = torch.autograd.grad(value, logits)
        assert torch.isfinite(value) and torch.isfinite(grad).all()


# -- L2 (Eq. 8), log Delta and Eq. 9 -------------------------------------------------------------


def test_adjusted_cross_entropy_matches_hand_value_and_eq_8() -> None:
    """f = 0, log Delta_0. = (0, ln 2, ln 0.5), y = 0: log(1 + 2 + 0.5) = ln 3.5; random logits match
    Eq. 8's log[1 + sum_{i != y} exp(f_i - f_y + log Delta_yi)]; log Delta = 0 is plain CE."""
    log_delta = torch.tensor([[0.0, math.log(2), math.log(0.5)], [0.3, 0.0, -1.2], [2.0, -0.7, 0.0]])
    value = fedacd.adjusted_cross_entropy(torch.zeros(1, 3), torch.tensor([0]), log_delta)
    assert float(value) == pytest.approx(math.log(3.5), abs=1e-6)
    logits = torch.tensor([[0.4, -1.0, 2.2], [1.5, 0.1, -0.3]])
    y = torch.tensor([2, 1])
    got = fedacd.adjusted_cross_entropy(logits, y, log_delta)
    for b in range(2):
        yb = int(y[b])
        eq8 = math.log(1 + sum(math.exp(logits[b, i] - logits[b, yb] + log_delta[yb, i]) for i in range(3) if i != yb))
        assert float(got[b]) == pytest.approx(eq8, abs=1e-6)
    plain = fedacd.adjusted_cross_entropy(logits, y, torch.zeros(3, 3))
    assert torch.allclose(plain, F.cross_entropy(logits, y, reduction="none"))


def test_log_delta_matrix_hand_values_with_a_missing_class() -> None:
    """Class 2 missing, delta = 0.01: log(P_yi / P_iy) between present classes, ln 0.01 towards class 2,
    zero diagonal, zero row for the missing class."""
    p = torch.tensor([[0.7, 0.2, 0.1], [0.4, 0.5, 0.1], [0.3, 0.3, 0.4]])
    present = torch.tensor([True, True, False])
    got = fedacd.log_delta_matrix(p, present, delta_missing=0.01, eps=1e-8)
    expected = torch.tensor(
        [
            [0.0, math.log(0.2 / 0.4), math.log(0.01)],
            [math.log(0.4 / 0.2), 0.0, math.log(0.01)],
            [0.0, 0.0, 0.0],
        ]
    )
    assert torch.allclose(got, expected, atol=1e-6)


def test_log_delta_matrix_clamps_zero_entries_to_eps_and_clips_when_asked() -> None:
    """P_01 = 0: log(1e-8) - log(0.5) = -17.73; with clip 10 it becomes -10 and its mirror +10."""
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    present = torch.tensor([True, True])
    got = fedacd.log_delta_matrix(p, present, delta_missing=0.01, eps=1e-8)
    assert float(got[0, 1]) == pytest.approx(math.log(1e-8) - math.log(0.5), abs=1e-5)
    assert float(got[1, 0]) == pytest.approx(-float(got[0, 1]), abs=1e-5)
    clipped = fedacd.log_delta_matrix(p, present, delta_missing=0.01, eps=1e-8, clip=10.0)
    assert clipped.tolist() == [[0.0, -10.0], [10.0, 0.0]]


def test_local_loss_is_l1_plus_lambda_l2_by_hand() -> None:
    """p = (0.5, 0.3, 0.2), y = 0, log Delta_0. = (0, ln 2, ln 0.5): the adjusted softmax is (0.5, 0.6, 0.1) / 1.2,
    so L2 = ln 2.4; L = w1 0.0100678 + lambda ln 2.4; without log Delta L2 is CE = ln 2."""
    logits = _logits(0.5, 0.3, 0.2)
    y = torch.tensor([0])
    log_delta = torch.tensor([[0.0, math.log(2), math.log(0.5)], [0.0] * 3, [0.0] * 3], dtype=torch.float64)
    l1 = 0.3 * math.log(1.2) + 0.2 * math.log(0.8)
    both = fedacd.local_loss(logits, y, log_delta, l1_weight=1.0, l2_weight=1.0)
    assert float(both) == pytest.approx(l1 + math.log(2.4), abs=1e-12)
    assert float(both) == pytest.approx(0.8855365, abs=1e-7)
    scaled = fedacd.local_loss(logits, y, log_delta, l1_weight=0.5, l2_weight=2.0)
    assert float(scaled) == pytest.approx(0.5 * l1 + 2.0 * math.log(2.4), abs=1e-12)
    assert float(fedacd.local_loss(logits, y, None, l1_weight=0.0, l2_weight=1.0)) == pytest.approx(math.log(2))
    only_l1 = fedacd.local_loss(logits, y, log_delta, l1_weight=1.0, l2_weight=0.0)
    assert float(only_l1) == pytest.approx(l1, abs=1e-12)


# -- Mixup ---------------------------------------------------------------------------------------


def test_mixup_with_lambda_one_returns_the_batch_and_draws_nothing() -> None:
    """lam = 1 is no Mixup: the same inputs and labels, and the generator is left untouched."""
    x, y = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), torch.arange(6)
    generator = torch.Generator().manual_seed(5)
    before = generator.get_state()
    x2, y2 = fedacd.mixup_batch(x, y, 1.0, generator)
    assert x2 is x and y2 is y and torch.equal(generator.get_state(), before)
    assert fedacd.mixup_lambda(0.0, np.random.default_rng(0)) == 1.0
    assert fedacd.mixup_lambda(1.0, None) == 1.0


def test_mixup_mixes_each_sample_with_a_permuted_partner() -> None:
    """lam = 0.3: x~ = 0.3 x + 0.7 x[perm] and y_b = y[perm], perm from the generator (reproduced here)."""
    x, y = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), torch.arange(6)
    x2, y_b = fedacd.mixup_batch(x, y, 0.3, torch.Generator().manual_seed(5))
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(5))
    assert torch.equal(y_b, y[perm]) and sorted(y_b.tolist()) == list(range(6))
    assert torch.allclose(x2, 0.3 * x + 0.7 * x[perm])


def test_mixup_lambdas_are_seeded_beta_draws() -> None:
    """The numpy stream comes from the torch generator: same seed, same draws; Beta(1, 1) is uniform
    (mean 1/2, variance 1/12) and Beta(0.2, 0.2) has variance 1 / (4 (2 alpha + 1)) = 0.179."""
    a = fedacd.numpy_stream(torch.Generator().manual_seed(3))
    b = fedacd.numpy_stream(torch.Generator().manual_seed(3))
    c = fedacd.numpy_stream(torch.Generator().manual_seed(4))
    draws_a = [fedacd.mixup_lambda(1.0, a) for _ in range(4000)]
    assert draws_a[:50] == [fedacd.mixup_lambda(1.0, b) for _ in range(50)]
    assert draws_a[:50] != [fedacd.mixup_lambda(1.0, c) for _ in range(50)]
    assert all(0.0 <= v <= 1.0 for v in draws_a)
    assert np.mean(draws_a) == pytest.approx(0.5, abs=0.02) and np.var(draws_a) == pytest.approx(1 / 12, abs=0.01)
    u_shaped = [fedacd.mixup_lambda(0.2, a) for _ in range(4000)]
    assert np.var(u_shaped) == pytest.approx(1 / (4 * 1.4), abs=0.015)


def test_node_training_with_lambda_always_one_equals_training_without_mixup(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every lam = 1 (and the seed draw taken away), Mixup changes nothing: bit for bit the model of
    mixup_alpha = 0. With real draws the model differs."""
    start = tiny_model(0).state_dict()

    def trained(alpha: float) -> dict[str, torch.Tensor]:
        fed = Federation(SPEC, {"mixup_alpha": alpha})
        payload = Payload(tensors={"model": {k: v.clone() for k, v in start.items()}})
        return fed.train("node-002", payload).payload.tensors["model"]

    off = trained(0.0)
    mixed = trained(1.0)
    assert not same_state(off, mixed)
    monkeypatch.setattr(fedacd, "numpy_stream", lambda generator: np.random.default_rng(0))
    monkeypatch.setattr(fedacd, "mixup_lambda", lambda alpha, rng: 1.0)
    assert same_state(off, trained(1.0))


# -- the class-probability matrix ----------------------------------------------------------------


def test_accumulated_rows_are_weighted_class_means_and_empty_rows_keep_their_value() -> None:
    """Rows 0 and 1 are the (lam-weighted) means of their samples' probabilities; row 2, never seen, keeps P_prev."""
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1], [0.4, 0.4, 0.2]])
    sums, counts = torch.zeros(3, 3), torch.zeros(3)
    fedacd.accumulate_rows(sums, counts, probs, torch.tensor([0, 1, 0]))
    previous = torch.full((3, 3), 7.0)
    p = fedacd.rows_from(sums, counts, previous)
    assert torch.allclose(p[0], torch.tensor([0.5, 0.35, 0.15])) and torch.allclose(p[1], probs[1])
    assert p[2].tolist() == [7.0, 7.0, 7.0]
    # a mixed pair: sample 0 (y_a = 0, y_b = 1) with lam = 0.25, sample 1 (y_a = 1, y_b = 0)
    sums, counts = torch.zeros(3, 3), torch.zeros(3)
    fedacd.accumulate_rows(sums, counts, probs[:2], torch.tensor([0, 1]), 0.25)
    fedacd.accumulate_rows(sums, counts, probs[:2], torch.tensor([1, 0]), 0.75)
    p = fedacd.rows_from(sums, counts, previous)
    assert torch.allclose(p[0], 0.25 * probs[0] + 0.75 * probs[1])
    assert torch.allclose(p[1], 0.75 * probs[0] + 0.25 * probs[1])
    assert counts.tolist() == [1.0, 1.0, 0.0]


def test_probability_matrix_is_the_clean_class_mean_softmax_in_eval_mode() -> None:
    """Over node 1's shard (classes 0 and 1): each row is the mean softmax of that class; row 2 is 0;
    the model's training mode is restored."""
    data = shards()[1]
    model = tiny_model(3)
    model.train()
    p = fedacd.probability_matrix(model, data, batch_size=7)
    assert model.training
    with torch.no_grad():
        probs = F.softmax(model(data.x), dim=1)
    for c in (0, 1):
        assert torch.allclose(p[c], probs[data.y == c].mean(0), atol=1e-6)
    assert p[2].tolist() == [0.0, 0.0, 0.0]
    assert torch.allclose(p[:2].sum(1), torch.ones(2))


def test_running_estimate_renews_p_at_each_epoch_from_the_previous_epoch() -> None:
    """Epoch 1 uses the clean P of the received model; at the first batch of epoch 2, P becomes the mean of
    epoch 1's recorded outputs (lam-weighted), log Delta follows, and the accumulators restart."""
    data = shards()[1]  # 30 samples, batch 8: 4 steps per epoch
    model = tiny_model(2)
    hp = build_hyperparams(SPEC, {})
    present = torch.tensor([True, True, False])
    est = fedacd._Estimate(model, data, present, hp, TrainSettings(batch_size=8))
    assert est.per_epoch == 4
    assert fedacd._Estimate(model, data, present, hp, TrainSettings(batch_size=8, drop_last=True)).per_epoch == 3
    clean = fedacd.probability_matrix(model, data)
    assert torch.equal(est.p, clean)
    log_delta = fedacd.log_delta_matrix(clean, present, delta_missing=0.01, eps=1e-8)
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1]])
    for _ in range(4):
        assert torch.equal(est.before_batch(), log_delta)
        est.after_batch(torch.log(probs), torch.tensor([0, 1]), torch.tensor([1, 0]), 0.75)
    renewed = est.before_batch()
    expected = torch.stack([0.75 * probs[0] + 0.25 * probs[1], 0.75 * probs[1] + 0.25 * probs[0]])
    assert torch.allclose(est.p[:2], expected, atol=1e-6)
    assert torch.equal(est.p[2], clean[2])  # absent class: no weight, keeps its value
    assert torch.allclose(renewed, fedacd.log_delta_matrix(est.p, present, delta_missing=0.01, eps=1e-8))
    assert float(est.counts.sum()) == 0.0


def test_accumulated_rows_are_accumulate_rows_with_a_weight_per_sample() -> None:
    """The vectorised step's pure form: a weight per sample (0 for padding) gives the rows that
    `accumulate_rows` adds in place, sample by sample."""
    gen = torch.Generator().manual_seed(0)
    probs = F.softmax(torch.randn(6, 4, generator=gen, dtype=torch.float64), dim=1)
    labels = torch.tensor([0, 2, 2, 3, 0, 1])
    weight = torch.tensor([0.3, 0.3, 0.3, 0.3, 0.0, 0.0], dtype=torch.float64)  # the last two: padding
    start_sums, start_counts = torch.rand(4, 4, generator=gen, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    sums, counts = start_sums.clone(), start_counts.clone()
    fedacd.accumulate_rows(sums, counts, probs[:4], labels[:4], 0.3)
    got_sums, got_counts = fedacd.accumulated(start_sums, start_counts, probs, labels, weight)
    assert torch.allclose(got_sums, sums, rtol=0, atol=1e-15) and torch.allclose(got_counts, counts, rtol=0, atol=1e-15)


# -- KL(P || Q) and the score (Eq. 10) -----------------------------------------------------------


def test_template_kl_matches_hand_values_for_mean_and_sum() -> None:
    """C = 2, tau = 0.9, P = [[0.6, 0.4], [0.2, 0.8]]: rows 0.6 ln(0.6/0.9) + 0.4 ln 4 and 0.2 ln 2 + 0.8 ln(0.8/0.9)."""
    p = torch.tensor([[0.6, 0.4], [0.2, 0.8]])
    both = torch.tensor([True, True])
    row0 = 0.6 * math.log(0.6 / 0.9) + 0.4 * math.log(0.4 / 0.1)
    row1 = 0.2 * math.log(0.2 / 0.1) + 0.8 * math.log(0.8 / 0.9)
    assert fedacd.template_kl(p, both, tau=0.9) == pytest.approx((row0 + row1) / 2, abs=1e-7)
    assert fedacd.template_kl(p, both, tau=0.9, reduction="sum") == pytest.approx(row0 + row1, abs=1e-7)
    # an absent class's row is left out; P = Q gives 0; a zero entry counts 0 log 0 = 0
    assert fedacd.template_kl(p, torch.tensor([True, False]), tau=0.9) == pytest.approx(row0, abs=1e-7)
    assert fedacd.template_kl(torch.tensor([[0.9, 0.1], [0.1, 0.9]]), both, tau=0.9) == pytest.approx(0.0, abs=1e-7)
    assert fedacd.template_kl(torch.tensor([[1.0, 0.0]]), torch.tensor([True]), tau=0.9) == pytest.approx(
        -math.log(0.9), abs=1e-7
    )
    with pytest.raises(ValueError, match="no present class"):
        fedacd.template_kl(p, torch.tensor([False, False]), tau=0.9)


def test_template_kl_row_mean_has_the_magnitude_of_the_papers_table_9() -> None:
    """The spec's check: C = 100, tau = 1 - 1e-5, P_ii = 0.6 and flat off-diagonals: about 3.93 per row,
    0.6 ln(0.6 / tau) + 0.4 ln(0.4 / 1e-5); the mean over rows stays there, the sum is 100 times it."""
    c, tau = 100, 1 - 1e-5
    p = torch.full((c, c), 0.4 / (c - 1), dtype=torch.float64)
    p.fill_diagonal_(0.6)
    present = torch.ones(c, dtype=torch.bool)
    row = 0.6 * math.log(0.6 / tau) + 0.4 * math.log(0.4 / 1e-5)
    assert fedacd.template_kl(p, present, tau=tau) == pytest.approx(row, rel=1e-9)
    assert row == pytest.approx(3.93, abs=0.01)
    assert fedacd.template_kl(p, present, tau=tau, reduction="sum") == pytest.approx(100 * row, rel=1e-9)


def test_adaptability_score_and_its_inverse_by_hand() -> None:
    """V = Sigmoid(1 / KL): KL = 1 -> 0.7310586, KL = 0.5 -> Sigmoid(2) = 0.8807971, KL = 0 -> 1 (1 / eps);
    1 / logit(V) gives KL back."""
    assert fedacd.adaptability_score(1.0, 1e-8) == pytest.approx(0.7310585786, abs=1e-10)
    assert fedacd.adaptability_score(0.5, 1e-8) == pytest.approx(0.8807970780, abs=1e-10)
    assert fedacd.adaptability_score(0.0, 1e-8) == 1.0
    assert fedacd.adaptability_score(-1e-12, 1e-8) == 1.0
    assert 0.5 < fedacd.adaptability_score(5.6, 1e-8) < 0.55
    for kl in (0.6, 2.0, 5.6, 300.0):
        assert fedacd.kl_from_score(fedacd.adaptability_score(kl, 1e-8)) == pytest.approx(kl, rel=1e-9)
    assert fedacd.kl_from_score(1.0) == 0.0


# -- aggregation (Eq. 11) ------------------------------------------------------------------------


def _coordinator(**hp: object):  # type: ignore[no-untyped-def]
    return SPEC.coordinator(build_hyperparams(SPEC, hp), model=common.scalar_model(0.0))


def _aggregate(coordinator, rows: list[tuple[float, int, object]]) -> tuple[float, dict[str, float]]:  # type: ignore[no-untyped-def]
    """One round of hand-made updates (value, num_samples, score or `...` for none), update i
    reporting loss i + 1; the new weight and the metrics."""
    scored = [
        (value, n, {"loss": float(i + 1)} if v is ... else {"loss": float(i + 1), fedacd.SCORE: v})
        for i, (value, n, v) in enumerate(rows)
    ]
    return common.aggregate_scalars(coordinator, scored)


def test_aggregation_weights_by_hand() -> None:
    """V = (0.6, 0.9), n = (10, 30): score (0.6, 0.9), score_samples (6, 27), uniform (1, 1), samples (10, 30)."""
    assert fedacd.aggregation_weights([0.6, 0.9], [10, 30], "score") == [0.6, 0.9]
    assert fedacd.aggregation_weights([0.6, 0.9], [10, 30], "score_samples") == pytest.approx([6.0, 27.0])
    assert fedacd.aggregation_weights([0.6, 0.9], [10, 30], "uniform") == [1.0, 1.0]
    assert fedacd.aggregation_weights([0.6, 0.9], [10, 30], "samples") == [10.0, 30.0]
    with pytest.raises(ValueError, match="weighting"):
        fedacd.aggregation_weights([0.6], [10], "median")


@pytest.mark.parametrize(
    ("weighting", "expected"),
    [
        ("score", (0.6 * 1 + 0.9 * 2) / 1.5),  # Eq. 11: 1.6
        ("score_samples", (6 * 1 + 27 * 2) / 33),
        ("uniform", 1.5),
        ("samples", (10 * 1 + 30 * 2) / 40),
    ],
)
def test_aggregate_weights_models_by_the_chosen_rule(weighting: str, expected: float) -> None:
    """Models 1 and 2 with V = (0.6, 0.9), n = (10, 30); the metrics: mean score, mean KL = 1 / logit(V)."""
    value, metrics = _aggregate(_coordinator(weighting=weighting), [(1.0, 10, 0.6), (2.0, 30, 0.9)])
    assert value == pytest.approx(expected, abs=1e-6)
    assert metrics["acd_invalid"] == 0.0
    assert metrics["acd_score"] == pytest.approx(0.75)
    assert metrics["acd_kl"] == pytest.approx((1 / math.log(1.5) + 1 / math.log(9)) / 2)
    weights = fedacd.aggregation_weights([0.6, 0.9], [10, 30], weighting)
    assert metrics["train_loss"] == pytest.approx((weights[0] * 1 + weights[1] * 2) / sum(weights))


@pytest.mark.parametrize(
    "bad",
    [..., float("nan"), float("inf"), 0.5, 0.4, 1.0 + 1e-9, 7.0, -0.8, True, "0.7", None, [0.7]],
    ids=[
        "missing",
        "nan",
        "inf",
        "half",
        "below-half",
        "above-one",
        "far-above",
        "negative",
        "bool",
        "str",
        "none",
        "list",
    ],
)
def test_invalid_score_leaves_update_out(bad: object) -> None:
    """A score that is missing, not a finite number, or outside (0.5, 1] leaves its update out, counted."""
    value, metrics = _aggregate(_coordinator(), [(1.0, 10, 0.7), (9.0, 90, bad)])
    assert value == pytest.approx(1.0, abs=1e-6)
    assert metrics["acd_invalid"] == 1.0
    assert metrics["acd_score"] == pytest.approx(0.7)


def test_score_of_one_is_valid() -> None:
    """V = 1 (KL below eps) is a valid, saturated score; its KL reads as 0."""
    value, metrics = _aggregate(_coordinator(), [(1.0, 10, 1.0), (3.0, 10, 1.0)])
    assert value == pytest.approx(2.0, abs=1e-6)
    assert metrics["acd_invalid"] == 0.0 and metrics["acd_kl"] == 0.0


def test_all_scores_invalid_raises_algorithm_error() -> None:
    """No valid score left for a score-weighted average: the round fails."""
    with pytest.raises(AlgorithmError, match="valid FedACD score"):
        _aggregate(_coordinator(), [(1.0, 10, ...), (2.0, 10, float("nan")), (3.0, 10, 2.0)])


def test_unused_invalid_score_keeps_its_update_for_sample_weights() -> None:
    """weighting = "samples" does not use the score: an update without one is kept, but still counted."""
    value, metrics = _aggregate(_coordinator(weighting="samples"), [(1.0, 10, 0.7), (3.0, 30, ...)])
    assert value == pytest.approx(2.5, abs=1e-6)
    assert metrics["acd_invalid"] == 1.0


def test_coordinator_keeps_no_extra_state() -> None:
    """FedACD's server needs nothing beyond the global model; extra state is refused."""
    coordinator = _coordinator()
    assert coordinator.state_dict() == {}
    coordinator.load_state_dict({})
    with pytest.raises(ValueError, match="no extra state"):
        coordinator.load_state_dict({"x": torch.zeros(1)})


# -- the whole method ----------------------------------------------------------------------------


def test_neutral_setting_equals_fedavg_exactly() -> None:
    """No L1, plain CE, no Mixup and sample weights: FedAvg's global model bit for bit; the defaults differ."""
    fedavg = Federation("fedavg").run(2)
    assert same_state(fedavg, Federation(SPEC, NEUTRAL).run(2))
    assert not same_state(fedavg, Federation(SPEC).run(2))


def test_training_is_deterministic_under_a_fixed_seed() -> None:
    """Same seed, same global model (Mixup draws included); another seed differs; the loss is finite."""
    a = common.assert_deterministic(SPEC)
    assert all(math.isfinite(m["train_loss"]) and m["acd_invalid"] == 0.0 for m in a.metrics)


@pytest.mark.parametrize(
    "option",
    [
        {"p_estimate": "clean"},
        {"detach_target": False},
        {"delta_missing": 1e-4},
        {"l2_weight": 2.0},
        {"log_delta_clip": 1.0},
    ],
    ids=lambda o: next(iter(o)),
)
def test_each_option_changes_training(option: dict[str, object]) -> None:
    """Every loss option reaches the training: one round differs from the defaults' (and stays finite)."""
    default = Federation(SPEC).run(1)
    fed = Federation(SPEC, option)
    assert not same_state(default, fed.run(1))
    assert math.isfinite(fed.metrics[0]["train_loss"])


def test_node_reports_the_score_of_its_final_model() -> None:
    """Each node's meta score is Sigmoid(1 / KL(P || Q)) of the model it returns, over its own present classes."""
    fed = Federation(SPEC)
    payload = fed.coordinator.configure_round(context(0, fed.node_ids))
    model = tiny_model()
    for node, data in zip(fed.node_ids, fed.data, strict=True):
        out = fed.train(node, payload)
        model.load_state_dict(out.payload.tensors["model"])
        present = torch.tensor(data.label_histogram()) > 0
        kl = fedacd.template_kl(fedacd.probability_matrix(model, data), present, tau=1 - 1e-5)
        score = out.payload.meta[fedacd.SCORE]
        assert isinstance(score, float) and 0.5 < score <= 1.0
        assert score == pytest.approx(fedacd.adaptability_score(kl, 1e-8), abs=1e-12)
        assert math.isfinite(out.payload.meta["loss"]) and out.payload.meta["steps"] > 0


def test_node_with_empty_shard_raises_algorithm_error() -> None:
    """No sample, no class-probability matrix: the node fails the round with an AlgorithmError naming itself."""
    with pytest.raises(AlgorithmError, match=r"at least 2 classes and 1 sample.*node n0, round 2"):
        common.train_alone(SPEC, tiny_model(), data=common.empty_shard())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_node_trains_on_cuda_deterministically() -> None:
    """On CUDA, with the data, model and generator there: a finite update, reproducible per seed."""
    data = shards()[2]
    data = TensorDataset(data.x.cuda(), data.y.cuda(), data.num_classes)
    node = SPEC.node(build_hyperparams(SPEC, {}), node_id="n0")
    start = tiny_model(0).state_dict()

    def run() -> Payload:
        model = tiny_model(99).cuda()
        task = TaskInput(node_id="n0", round=0, payload=Payload(tensors={"model": start}), settings=SETTINGS)
        return node.train(task, model, data, torch_generator(0, "t", device="cuda"))

    a, b = run(), run()
    assert all(t.is_cuda for t in a.tensors["model"].values())
    assert same_state(a.tensors["model"], b.tensors["model"]) and a.meta == b.meta
    assert 0.5 < a.meta[fedacd.SCORE] <= 1.0
