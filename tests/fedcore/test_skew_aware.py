"""Skew-aware aggregation (SA, `fedcore.aggregation.skew_aware`), FedSA's rule, on its own.

Covers: every step of SA on hand-computed cases (the CV, the high-dispersion mask, the Micro-Class
bins in both binnings and the signed variant, the agreement counts, the greedy clustering alone on
hand matrices with its tie rules, the Macro-Class modes, the three weightings of Eq. 14 and the
output), an outlier client kept out by the S_mac cap and sim_t, the reductions to the plain mean (no
dispersed parameter, K = 1, a one-element tensor, cv_t = 1), determinism and independence from the
order of the updates, integer and non-trainable buffers, bad inputs, the accelerator against the
CPU. The FedSA method and SA as other methods' average: tests/algorithms/test_fedsa.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from fedmq.fedcore.aggregation import skew_aware, weighted_average
from fedmq.fedcore.aggregation.skew_aware import (
    SkewAwareOptions,
    agreement_counts,
    cluster_weights,
    coefficient_of_variation,
    greedy_cluster,
    high_dispersion,
    macro_classes,
    micro_classes,
    skew_aware_average,
)
from tests.algorithms.common import same_state

# The hand case: K = 4 clients, one tensor of 6 parameters (columns), one value per client (rows).
# p0..p3 have mean 10 and deviations d chosen so that s = d^2 is easy; p4 is constant; p5 has mean
# 100 and deviations +-1 (dispersed, but little relative to its mean).
HAND = torch.tensor(
    [
        [10.5, 10.0, 9.0, 12.5, 3.0, 101.0],  # d = 0.5,  0,  -1,   2.5, 0,  1
        [10.5, 10.0, 12.5, 7.5, 3.0, 99.0],  # d = 0.5,  0,   2.5, -2.5, 0, -1
        [13.0, 14.0, 9.0, 10.0, 3.0, 101.0],  # d = 3,    4,  -1,   0,   0,  1
        [6.0, 6.0, 9.5, 10.0, 3.0, 99.0],  # d = -4,  -4,  -0.5,  0,   0, -1
    ]
)


def _states(rows: torch.Tensor, **extra: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    return [{"w": row.clone(), **{k: v[i].clone() for k, v in extra.items()}} for i, row in enumerate(rows)]


# -- the steps of SA by hand --------------------------------------------------------------------


def test_sa_steps_on_the_hand_case_match_hand_computation() -> None:
    """Each step of SA on HAND (C_mic = 4), against values worked out by hand."""
    mu = HAND.mean(0)
    assert mu.tolist() == [10.0, 10.0, 10.0, 10.0, 3.0, 100.0]
    s = (HAND - mu).square()
    # Eq. 4: var = sum d^2 / 4 = (25.5, 32, 8.5, 12.5, 0, 4) / 4; cv = std / |mu|
    var = skew_aware.client_variance(HAND, mu, [0.25] * 4)
    assert var.tolist() == [25.5 / 4, 8.0, 8.5 / 4, 12.5 / 4, 0.0, 1.0]
    cv = coefficient_of_variation(var, mu, 1e-12)
    expected_cv = [math.sqrt(6.375) / 10, math.sqrt(8) / 10, math.sqrt(2.125) / 10, math.sqrt(3.125) / 10, 0, 0.01]
    assert cv.tolist() == pytest.approx(expected_cv, rel=1e-6)
    # Eqs. 5-6: min 0 (p4), max sqrt(8)/10 = 0.2828 (p1): normalised 0.893, 1, 0.515, 0.625, 0, 0.035
    assert high_dispersion(cv, 0.2).tolist() == [True, True, True, True, False, False]
    # Eq. 8: s at the high positions, divided by their maximum 16, times 4, ceiling, at least 1
    s_h = s[:, :4]
    mic = micro_classes(s_h, 4)
    assert mic.tolist() == [[1, 1, 1, 2], [1, 1, 2, 2], [3, 4, 1, 1], [4, 4, 1, 1]]
    # Eq. 10 numerators: clients 0, 1 agree at p0, p1, p3; 2, 3 at p1, p2, p3; 0 with 2 and 3 at p2
    counts = agreement_counts(mic, 4)
    assert counts.tolist() == [[4, 3, 1, 1], [3, 4, 0, 0], [1, 0, 4, 3], [1, 0, 3, 4]]
    # pairs (0, 1) and (2, 3) tie at 3: (0, 1) first; then (2, 3) = 3 beats joining {0, 1} at (1 + 0) / 2
    clusters, unclustered = greedy_cluster(counts, 4, 0.2 * 4)
    assert clusters == [[0, 1], [2, 3]] and unclustered == []
    # Eq. 11: modes per position; ties (1 vs 2 at p2 in cluster 0, 3 vs 4 at p0 in cluster 1) -> smaller
    mac = macro_classes(mic, clusters, 4)
    assert mac.tolist() == [[1, 1, 1, 2], [3, 4, 1, 1]]
    # Eq. 14 (count): cluster 0 has bin 1 three times, bin 2 once -> a_0 = (3, 3, 3, 1);
    # cluster 1 has bins 3, 4 once and 1 twice -> a_1 = (1, 1, 2, 2); normalised per position
    alpha = cluster_weights(mac, torch.tensor([2.0, 2.0]), "count", 4)
    assert torch.allclose(alpha, torch.tensor([[3 / 4, 3 / 4, 3 / 5, 1 / 3], [1 / 4, 1 / 4, 2 / 5, 2 / 3]]))
    # Eq. 12 cluster means (10.5, 10, 10.75, 10) and (9.5, 10, 9.25, 10); Eq. 15; Eq. 13 keeps mu at p4, p5
    out = skew_aware_average(_states(HAND), [1.0] * 4, SkewAwareOptions())["w"]
    assert out.tolist() == pytest.approx([10.25, 10.0, 10.15, 10.0, 3.0, 100.0], rel=1e-6)


@pytest.mark.parametrize(
    ("weighting", "expected"),
    [
        ("count", [10.25, 10.0, 10.15, 10.0]),
        ("size", [10.0, 10.0, 10.0, 10.0]),  # two clusters of two: 1/2 each, the plain mean
        # 1 / MAC: p0 (1, 1/3) -> (3/4, 1/4); p2 (1, 1) -> 1/2 each
        ("inverse_bin", [10.25, 10.0, 10.0, 10.0]),
    ],
)
def test_sa_weightings_of_eq14_on_the_hand_case(weighting: str, expected: list[float]) -> None:
    """The three readings of Eq. 14 give their hand-computed outputs at the high positions."""
    out = skew_aware_average(_states(HAND), [1.0] * 4, SkewAwareOptions(weighting=weighting))["w"]
    assert out.tolist() == pytest.approx([*expected, 3.0, 100.0], rel=1e-6)


def test_cluster_weights_sum_to_one_and_follow_each_mode() -> None:
    """Hand MAC rows: count (n of each bin), size (masses), inverse bin; every column sums to 1."""
    mac = torch.tensor([[1, 1, 2], [2, 3, 2]])
    count = cluster_weights(mac, torch.tensor([1.0, 3.0]), "count", 3)
    # row 0: bin 1 twice, bin 2 once -> (2, 2, 1); row 1: bin 2 twice, bin 3 once -> (2, 1, 2)
    assert torch.allclose(count, torch.tensor([[1 / 2, 2 / 3, 1 / 3], [1 / 2, 1 / 3, 2 / 3]]))
    assert cluster_weights(mac, torch.tensor([1.0, 3.0]), "size", 3).tolist() == [[0.25] * 3, [0.75] * 3]
    inverse = cluster_weights(mac, torch.tensor([1.0, 3.0]), "inverse_bin", 3)
    assert torch.allclose(inverse, torch.tensor([[2 / 3, 3 / 4, 1 / 2], [1 / 3, 1 / 4, 1 / 2]]))
    # signed codes 4..6 are the bins 1..3 above the mean: magnitude (c - 1) mod 3 + 1
    signed = cluster_weights(torch.tensor([[4], [2]]), torch.ones(2), "inverse_bin", 3)
    assert torch.allclose(signed, torch.tensor([[2 / 3], [1 / 3]]))
    with pytest.raises(ValueError, match="weighting"):
        cluster_weights(mac, torch.ones(2), "median", 3)


def test_micro_classes_quantile_and_signed_variants_by_hand() -> None:
    """Quantile bins split the K M_h values into equal counts; signed bins add C above the mean."""
    s = torch.tensor([[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]])
    # 8 values, C = 4: edges at the 2nd, 4th, 6th smallest (1, 3, 5): (<=1) 1, (1, 3] 2, (3, 5] 3, else 4
    assert micro_classes(s, 4, "quantile").tolist() == [[1, 1, 2, 2], [3, 3, 4, 4]]
    # uniform: ceil(4 s / 7), at least 1
    assert micro_classes(s, 4).tolist() == [[1, 1, 2, 2], [3, 3, 4, 4]]
    above = torch.tensor([[True, False, True, False], [False, False, True, True]])
    assert micro_classes(s, 4, above=above).tolist() == [[5, 1, 6, 2], [3, 3, 8, 8]]
    # C = 1: everything in bin 1, in both binnings
    assert micro_classes(s, 1).unique().tolist() == [1] == micro_classes(s, 1, "quantile").unique().tolist()
    with pytest.raises(ValueError, match="bins"):
        micro_classes(s, 4, "log")


def test_macro_classes_take_the_mode_and_the_smaller_bin_on_ties() -> None:
    """Per position the most frequent bin among the members; a tie goes to the smaller bin."""
    mic = torch.tensor([[1, 2, 3], [2, 2, 4], [2, 1, 4], [4, 4, 1]], dtype=torch.uint8)
    mac = macro_classes(mic, [[0, 1, 2], [0, 3]], 4)
    assert mac.tolist() == [[2, 2, 4], [1, 2, 1]]


def test_high_dispersion_degenerate_and_clipped_cases() -> None:
    """max = min gives no high parameter; cv_t = 1 none; the quantile clip raises the share."""
    assert not high_dispersion(torch.full((5,), 0.3), 0.2).any()
    cv = torch.tensor([0.0, 0.1, 0.2, 0.3, 10.0])
    assert high_dispersion(cv, 1.0).tolist() == [False] * 5
    # plain min-max: only 10 is above 0.2 of the range; clipped at the 80% quantile (4th smallest, 0.3):
    # normalised 0, 1/3, 2/3, 1, 1 -> above 0.2: the last three
    assert high_dispersion(cv, 0.2).tolist() == [False, False, False, False, True]
    assert high_dispersion(cv, 0.2, clip_quantile=0.8).tolist() == [False, True, True, True, True]


# -- the greedy clustering alone ----------------------------------------------------------------


def test_greedy_cluster_on_a_hand_matrix_with_ties_to_the_lowest_index() -> None:
    """Pairs tie -> lowest (a, b); joining ties with pairing -> join; cap -> frozen clusters and sim_t."""
    sim = np.array(
        [
            [1.0, 0.875, 0.875, 0.125, 0.125, 0.0],
            [0.875, 1.0, 0.625, 0.125, 0.125, 0.25],
            [0.875, 0.625, 1.0, 0.25, 0.125, 0.25],
            [0.125, 0.125, 0.25, 1.0, 0.75, 0.5],
            [0.125, 0.125, 0.125, 0.75, 1.0, 0.125],
            [0.0, 0.25, 0.25, 0.5, 0.125, 1.0],
        ]
    )
    # (0, 1) and (0, 2) tie at 0.875 -> {0, 1}. Then joining 2 at (0.875 + 0.625) / 2 = 0.75 ties the
    # pair (3, 4) at 0.75: joining wins -> {0, 1, 2}. Then (3, 4) = 0.75 beats any join (best 1/6)
    # -> {3, 4}. Client 5 alone: {3, 4} at (0.5 + 0.125) / 2 = 0.3125 beats {0, 1, 2} at 1/6.
    assert greedy_cluster(sim, 4, 0.2) == ([[0, 1, 2], [3, 4, 5]], [])
    # Cap 1: {0, 1} only; then, against {0, 1} frozen: 2 (0.75) joins, 3 and 4 (0.125), 5 (0.125) do not
    assert greedy_cluster(sim, 1, 0.2) == ([[0, 1, 2]], [3, 4, 5])
    # Cap 2: {0, 1, 2}, {3, 4}; then 5 at 0.3125 > 0.2 joins {3, 4}; with sim_t 0.3125 it does not (strict)
    assert greedy_cluster(sim, 2, 0.2) == ([[0, 1, 2], [3, 4, 5]], [])
    assert greedy_cluster(sim, 2, 0.3125) == ([[0, 1, 2], [3, 4]], [5])


def test_greedy_cluster_frozen_memberships_and_lone_clients() -> None:
    """After the cap, later joiners do not change the clusters others are compared with; K = 1 opens a
    cluster of one; a client equally similar to two clusters after the cap joins the lower one."""
    sim = np.array([[1.0, 0.75, 0.25, 0.875], [0.75, 1.0, 0.25, 0.0], [0.25, 0.25, 1.0, 0.0], [0.875, 0.0, 0.0, 1.0]])
    # cap 1: {0, 3} (0.875). Frozen: 1 at 0.375 joins; 2 at 0.125 does not, although against
    # {0, 1, 3} it would reach (0.25 + 0.25 + 0) / 3 = 1/6 > 0.15
    assert greedy_cluster(sim, 1, 0.15) == ([[0, 1, 3]], [2])
    assert greedy_cluster(np.ones((1, 1)), 3, 0.2) == ([[0]], [])
    tie = np.array(
        [
            [1.0, 1.0, 0.5, 0.0, 0.0],
            [1.0, 1.0, 0.5, 0.0, 0.0],
            [0.5, 0.5, 1.0, 0.5, 0.5],
            [0.0, 0.0, 0.5, 1.0, 1.0],
            [0.0, 0.0, 0.5, 1.0, 1.0],
        ]
    )
    # {0, 1}, then (3, 4) = 1 beats joining 2 at 0.5 -> {3, 4}: cap 2; client 2 at 0.5 to both -> the first
    assert greedy_cluster(tie, 2, 0.2) == ([[0, 1, 2], [3, 4]], [])
    with pytest.raises(ValueError, match="square"):
        greedy_cluster(np.ones((2, 3)), 2, 0.2)
    with pytest.raises(ValueError, match="max_clusters"):
        greedy_cluster(np.ones((2, 2)), 0, 0.2)


# -- the outlier, the reductions to the mean ----------------------------------------------------

OUTLIER = torch.tensor([[1.0, 1.0, 3.0, 2.0], [1.0, 1.0, 3.0, 2.0], [1.0, 1.0, 3.0, 4.0], [1.0, 5.0, 7.0, 4.0]])
"""Client 3 is the outlier at p1 and p2: mu = (1, 2, 4, 3), s = (0 | 1, 1, 1, 9 | 1, 1, 1, 9 | 1),
cv = (0, sqrt(3)/2, sqrt(3)/4, 1/3): normalised (0, 1, 0.5, 0.385) -> p1, p2, p3 high; s / 9 * 4
-> MIC rows (1, 1, 1) for clients 0-2 and (4, 4, 1) for client 3: agreement 3 among 0-2, 1 with 3."""


@pytest.mark.parametrize(
    ("options", "expected", "unclustered"),
    [
        # no cap reached: {0, 1}, 2 joins (3 >= 1), 3 joins (no pair left): one cluster, the plain mean
        ({}, [1.0, 2.0, 4.0, 3.0], ()),
        # cap 1: {0, 1}; 2 joins at 3/3 = 1 > 0.5; 3 at 1/3 <= 0.5 is left out: high part = mean of 0-2
        ({"s_mac": 1, "sim_t": 0.5}, [1.0, 1.0, 3.0, 8 / 3], (3,)),
        # cap 1 with sim_t 0.2: 1/3 > 0.2, so the outlier joins again
        ({"s_mac": 1}, [1.0, 2.0, 4.0, 3.0], ()),
    ],
)
def test_sa_outlier_client_is_kept_out_only_after_the_cap(
    options: dict[str, object], expected: list[float], unclustered: tuple[int, ...]
) -> None:
    """The outlier moves the mean; SA drops it from the high positions when the cap and sim_t say so."""
    aggregate = skew_aware.aggregator(SkewAwareOptions(**options))  # type: ignore[arg-type]
    out = aggregate(_states(OUTLIER), [1.0] * 4)["w"]
    assert out.tolist() == pytest.approx(expected, rel=1e-6)
    (layer,) = aggregate.layers
    assert layer.high == 3 and layer.unclustered == unclustered


def test_sa_reduces_to_the_mean_when_nothing_is_dispersed() -> None:
    """cv_t = 1, identical clients, K = 1 and one-element tensors give weighted_average's mean bit for bit."""
    gen = torch.Generator().manual_seed(0)
    states = [{"a": torch.randn(3, 5, generator=gen), "b": torch.randn(1, generator=gen)} for _ in range(5)]
    weights = [3.0, 1.0, 2.0, 5.0, 4.0]
    mean = weighted_average(states, [1.0] * 5)
    assert same_state(skew_aware_average(states, weights, SkewAwareOptions(cv_t=1.0)), mean)
    assert same_state(
        skew_aware_average(states, weights, SkewAwareOptions(cv_t=1.0, weighted=True)),
        weighted_average(states, weights),
    )
    # the default does move the 15-element tensor, but never the one-element one
    default = skew_aware_average(states, weights, SkewAwareOptions())
    assert not torch.equal(default["a"], mean["a"]) and torch.equal(default["b"], mean["b"])
    same = [{"a": states[0]["a"].clone(), "b": states[0]["b"].clone()} for _ in range(4)]
    assert same_state(skew_aware_average(same, [1.0] * 4, SkewAwareOptions()), weighted_average(same, [1.0] * 4))
    assert same_state(skew_aware_average(states[:1], [2.0], SkewAwareOptions()), weighted_average(states[:1], [2.0]))


def test_sa_is_deterministic_and_independent_of_the_order_of_the_updates() -> None:
    """The same input gives the same bits; a permutation of the clients gives the same clusters and
    model (no exact tie here: on ties the lower index, that is the lower node id, wins by design)."""
    gen = torch.Generator().manual_seed(1)
    m = 400
    center = torch.rand(m, generator=gen) + 2
    spread = torch.full((7, m), 0.05)
    spread[:3, : m // 2] = 1.0  # clients 0-2 vary on the first half, 3-5 on the second, 6 everywhere
    spread[3:6, m // 2 :] = 1.0
    spread[6] = 0.8
    rows = center + spread * torch.rand(7, m, generator=gen) * torch.randn(7, m, generator=gen).sign()
    states = _states(rows)
    aggregate = skew_aware.aggregator(SkewAwareOptions())
    first = aggregate(states, [1.0] * 7)
    assert aggregate.layers[0].clusters == ((0, 1, 2), (3, 4, 5, 6))
    assert same_state(first, skew_aware_average(states, [1.0] * 7, SkewAwareOptions()))
    assert (first["w"] - weighted_average(states, [1.0] * 7)["w"]).abs().max() > 0.1
    for seed in range(3):
        order = torch.randperm(7, generator=torch.Generator().manual_seed(seed)).tolist()
        permuted = skew_aware.aggregator(SkewAwareOptions())
        out = permuted([states[i] for i in order], [1.0] * 7)
        assert sorted(sorted(order[i] for i in c) for c in permuted.layers[0].clusters) == [[0, 1, 2], [3, 4, 5, 6]]
        assert torch.allclose(out["w"], first["w"], atol=1e-6)


def test_sa_weighted_option_uses_the_sample_weights() -> None:
    """weighted: the low part is the sample-weighted mean and the cluster means are weighted."""
    rows = OUTLIER.clone()
    out = skew_aware_average(_states(rows), [1.0, 1.0, 2.0, 0.0], SkewAwareOptions(weighted=True))["w"]
    # p = (1/4, 1/4, 1/2, 0): mu = (1, 1, 3, 3); weighted variances (0, 0, 0, 1): only p3 is high
    # (cv 1/3); s there is 1 for all, one bin, one cluster of all; its weighted mean is mu = 3
    assert out.tolist() == pytest.approx([1.0, 1.0, 3.0, 3.0], rel=1e-6)
    assert not torch.allclose(skew_aware_average(_states(rows), [1.0, 1.0, 2.0, 0.0], SkewAwareOptions())["w"], out)


# -- buffers ------------------------------------------------------------------------------------


def test_integer_buffers_take_the_maximum_or_the_first_copy() -> None:
    """num_batches_tracked: the maximum (weighted_average's rule), or the first update's with buffers first."""
    states = _states(HAND, n=torch.tensor([4, 9, 2, 7]))
    assert skew_aware_average(states, [1.0] * 4, SkewAwareOptions())["n"].item() == 9
    assert skew_aware_average(states, [1.0] * 4, SkewAwareOptions(buffers="first"))["n"].item() == 4
    assert skew_aware_average(states, [1.0] * 4, SkewAwareOptions())["n"].dtype == torch.int64


def test_non_trainable_entries_take_the_mean_or_the_first_copy_never_sa() -> None:
    """A bound model's BatchNorm statistics are averaged (or copied), not clustered; unbound, SA applies."""
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6))
    model[0].bias.requires_grad_(False)
    assert skew_aware.non_trainable(model) == {
        "0.bias",
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    }
    template = model.state_dict()
    states = [
        {k: (HAND[i].clone() if v.shape == (6,) and v.is_floating_point() else v.clone()) for k, v in template.items()}
        for i in range(4)
    ]
    for state in states:
        state["0.weight"] = torch.zeros(6, 6)
    bound = skew_aware.aggregator(SkewAwareOptions(), model=model)
    out = bound(states, [1.0] * 4)
    mean = HAND.mean(0)
    for name in ("0.bias", "1.running_mean", "1.running_var"):
        assert torch.equal(out[name], mean), name
    assert out["1.weight"].tolist() == pytest.approx([10.25, 10.0, 10.15, 10.0, 3.0, 100.0], rel=1e-6)
    assert {layer.name for layer in bound.layers} == {"0.weight", "1.weight", "1.bias"}
    first = skew_aware.aggregator(SkewAwareOptions(buffers="first"), model=model)(states, [1.0] * 4)
    assert torch.equal(first["1.running_mean"], HAND[0]) and torch.equal(first["1.weight"], out["1.weight"])
    unbound = skew_aware.aggregator(SkewAwareOptions())(states, [1.0] * 4)
    assert torch.equal(unbound["1.running_mean"], out["1.weight"])


def test_sa_refuses_inconsistent_inputs() -> None:
    """Missing states, a weight count that does not match, unequal shapes and bad weights are ValueErrors."""
    states = _states(HAND)
    with pytest.raises(ValueError, match="as many weights"):
        skew_aware_average(states, [1.0] * 3, SkewAwareOptions())
    with pytest.raises(ValueError, match="as many weights"):
        skew_aware_average([], [], SkewAwareOptions())
    with pytest.raises(ValueError, match="different shapes"):
        skew_aware_average([*states[:3], {"w": torch.zeros(5)}], [1.0] * 4, SkewAwareOptions())
    with pytest.raises(ValueError, match="non-negative"):
        skew_aware_average(states, [1.0, -1.0, 1.0, 1.0], SkewAwareOptions(weighted=True))
    with pytest.raises(ValueError, match="positive"):
        skew_aware_average(states, [0.0] * 4, SkewAwareOptions(weighted=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sa_on_cuda_matches_the_cpu() -> None:
    """Computing on the accelerator gives the same clusters and (to float tolerance) the same model on the CPU."""
    gen = torch.Generator().manual_seed(2)
    states = [{"w": torch.randn(30, 20, generator=gen).exp()} for _ in range(6)]
    cpu = skew_aware.aggregator(SkewAwareOptions())
    gpu = skew_aware.aggregator(SkewAwareOptions(), device=torch.device("cuda"))
    a, b = cpu(states, [1.0] * 6), gpu(states, [1.0] * 6)
    assert b["w"].device.type == "cpu" and torch.allclose(a["w"], b["w"], atol=1e-5)
    assert cpu.layers == gpu.layers
