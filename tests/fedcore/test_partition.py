"""Partitions: reproducible from a seed, disjoint, complete where the method covers the set, and
faithful to the papers' splits (MOON/KDIA, FedRCL, FedSA/PFLlib, FedVLS, McMahan, NIID-Bench)."""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
import pytest

from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.partition import (
    PARTITIONERS,
    _weighted_class_counts,
    classes,
    dirichlet,
    dirichlet_balanced,
    iid,
    label_histograms,
    partition,
    quantity,
    shards,
)


def _balanced_labels(num_classes: int, per_class: int = 500, seed: int = 0) -> np.ndarray:
    """`num_classes` x `per_class` labels in a shuffled order, like CIFAR's training set."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


LABELS = {10: _balanced_labels(10), 100: _balanced_labels(100)}

# kind, options, classes, nodes, minimum node size the method guarantees
CASES: list[tuple[str, dict[str, Any], int, int, int]] = [
    ("iid", {}, 10, 20, 250),
    ("dirichlet", {"alpha": 0.3, "min_samples": 10}, 10, 20, 10),
    ("dirichlet", {"alpha": 0.5}, 100, 100, 10),
    ("dirichlet-balanced", {"alpha": 0.1}, 10, 20, 250),
    ("dirichlet-balanced", {"alpha": 0.3}, 100, 100, 500),
    ("classes", {"classes_per_node": 2}, 10, 20, 1),
    ("classes", {"classes_per_node": 2, "style": "fedvls"}, 10, 10, 1),
    ("classes", {"classes_per_node": 20, "style": "pflib", "min_samples": 50}, 100, 20, 50),
    ("classes", {"classes_per_node": 20, "style": "fedvls"}, 100, 10, 1),
    ("shards", {"shards_per_node": 2}, 10, 20, 250),
    ("shards", {"shards_per_node": 5}, 100, 100, 500),
    ("quantity", {"beta": 1.0}, 10, 10, 10),
    ("quantity", {"beta": 5.0, "min_samples": 20}, 100, 100, 20),
]
IDS = [f"{kind}-{'-'.join(f'{k}={v}' for k, v in opts.items())}-{c}c-{n}n" for kind, opts, c, n, _ in CASES]


def _entropy(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> float:
    """Mean label entropy of the nodes (lower: more skewed)."""
    hist = label_histograms(labels, parts, num_classes).astype(float)
    p = hist / hist.sum(1, keepdims=True)
    return float(np.mean(-(p * np.log(np.where(p > 0, p, 1))).sum(1)))


@pytest.mark.parametrize(("kind", "options", "num_classes", "nodes", "least"), CASES, ids=IDS)
def test_partition_any_kind_is_disjoint_complete_and_meets_min_size(
    kind: str, options: dict[str, Any], num_classes: int, nodes: int, least: int
) -> None:
    """Every kind: sorted int64 parts, no sample twice, every sample once (these sets divide evenly)."""
    labels = LABELS[num_classes]
    parts = partition(kind, labels, nodes, seed=3, **options)
    assert len(parts) == nodes
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)
    joined = np.concatenate(parts)
    assert len(joined) == len(labels) and len(np.unique(joined)) == len(labels)
    assert min(len(p) for p in parts) >= least


@pytest.mark.parametrize(("kind", "options", "num_classes", "nodes", "least"), CASES, ids=IDS)
def test_partition_any_kind_is_reproducible_and_seed_dependent(
    kind: str, options: dict[str, Any], num_classes: int, nodes: int, least: int
) -> None:
    """The same seed gives the same split; another seed a different one."""
    labels = LABELS[num_classes]
    a = partition(kind, labels, nodes, seed=1, **options)
    b = partition(kind, labels, nodes, seed=1, **options)
    c = partition(kind, labels, nodes, seed=2, **options)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_partition_registry_lists_every_kind() -> None:
    """The kinds the experiment config offers are the ones `partition` knows."""
    assert list(PARTITIONERS) == ["iid", "dirichlet", "dirichlet-balanced", "classes", "shards", "quantity"]


def test_iid_uneven_set_is_balanced_and_complete() -> None:
    """Sizes differ by at most one and every sample is used."""
    parts = iid(_balanced_labels(10, 101)[:1003], 10, seed=0)
    assert sorted({len(p) for p in parts}) == [100, 101]
    assert len(np.unique(np.concatenate(parts))) == 1003


def test_dirichlet_seed_seven_is_pinned() -> None:
    """The draws (and so the quickstart's published accuracy) stay those of the first implementation."""
    labels = np.random.default_rng(0).integers(0, 10, size=2000)
    parts = dirichlet(labels, 20, alpha=0.3, seed=7, min_samples=10)
    sizes = [151, 103, 84, 105, 133, 72, 80, 64, 70, 138, 107, 110, 80, 86, 163, 155, 113, 44, 104, 38]
    assert [len(p) for p in parts] == sizes
    assert [int(p[:3].sum()) for p in parts][:5] == [24, 78, 123, 127, 36]


def test_dirichlet_cap_stops_nodes_at_the_average_size() -> None:
    """A node that reaches len/N before a class is dealt gets none of it, so no node ends far above the mean."""
    labels = LABELS[100]
    sizes = np.array([len(p) for p in dirichlet(labels, 100, alpha=0.1, seed=0)])
    assert sizes.max() < 500 + 500  # at most the average plus (part of) one class


@pytest.mark.parametrize("fn", [dirichlet, dirichlet_balanced], ids=["dirichlet", "dirichlet-balanced"])
def test_label_skew_any_dirichlet_grows_as_alpha_shrinks(fn: Any) -> None:
    """Smaller alpha concentrates each node on fewer classes (mean per-node label entropy drops)."""
    labels = LABELS[10]
    entropy = [_entropy(labels, fn(labels, 20, alpha=a, seed=0), 10) for a in (0.1, 1.0, 100.0)]
    assert entropy[0] < entropy[1] < entropy[2]


def test_dirichlet_balanced_any_alpha_gives_equal_sizes() -> None:
    """FedRCL's split: every node holds exactly len/N samples, even at extreme skew."""
    for alpha in (0.01, 0.1, 10.0):
        parts = dirichlet_balanced(LABELS[100], 100, alpha=alpha, seed=0)
        assert {len(p) for p in parts} == {500}


def test_dirichlet_balanced_remainder_is_left_out() -> None:
    """When N does not divide the set, the remainder (fewer than N samples) belongs to no node."""
    labels = LABELS[10][:5003]
    parts = dirichlet_balanced(labels, 20, alpha=0.3, seed=0)
    joined = np.concatenate(parts)
    assert {len(p) for p in parts} == {250} and len(np.unique(joined)) == 5000


def test_weighted_class_counts_any_draw_follows_successive_sampling() -> None:
    """The per-class draw has the law of torch.multinomial without replacement (exact means by recursion)."""
    remaining, weights, size = (5, 3, 10), (0.5, 0.3, 0.2), 6

    @cache
    def law(taken: tuple[int, ...]) -> dict[tuple[int, ...], float]:
        if sum(taken) == size:
            return {taken: 1.0}
        left = [r - t for r, t in zip(remaining, taken, strict=True)]
        total = sum(n * w for n, w in zip(left, weights, strict=True))
        out: dict[tuple[int, ...], float] = {}
        for c in range(3):
            if left[c]:
                nxt = tuple(t + (i == c) for i, t in enumerate(taken))
                for key, prob in law(nxt).items():
                    out[key] = out.get(key, 0.0) + left[c] * weights[c] / total * prob
        return out

    exact = sum(np.array(k) * p for k, p in law((0, 0, 0)).items())
    rng = np.random.default_rng(0)
    draws = np.array([_weighted_class_counts(rng, np.array(weights), np.array(remaining), size) for _ in range(20000)])
    assert (draws.sum(1) == size).all() and (draws <= np.array(remaining)).all()
    np.testing.assert_allclose(draws.mean(0), exact, atol=0.02)


def test_weighted_class_counts_zero_weights_fill_uniformly() -> None:
    """Classes with zero weight are drawn only once the weighted ones are used up."""
    rng = np.random.default_rng(0)
    counts = _weighted_class_counts(rng, np.array([0.0, 1.0, 0.0]), np.array([5, 3, 10]), 6)
    assert counts[1] == 3 and counts.sum() == 6


@pytest.mark.parametrize(
    ("style", "num_classes", "nodes", "k"),
    [
        ("pflib", 10, 20, 2),
        ("pflib", 100, 20, 10),
        ("fedvls", 10, 10, 2),
        ("fedvls", 100, 10, 20),
        ("pflib", 100, 50, 20),
    ],
)
def test_classes_any_style_gives_exactly_k_classes_per_node(style: str, num_classes: int, nodes: int, k: int) -> None:
    """Every node holds samples of exactly k distinct classes, and each class is split among N k / C nodes."""
    labels = LABELS[num_classes]
    parts = classes(labels, nodes, classes_per_node=k, style=style, seed=0)
    hist = label_histograms(labels, parts, num_classes)
    assert ((hist > 0).sum(1) == k).all()
    assert ((hist > 0).sum(0) == nodes * k // num_classes).all()


@pytest.mark.parametrize(("num_classes", "s"), [(10, 2), (100, 20)])
def test_classes_fedvls_assignment_matches_the_spec_example(num_classes: int, s: int) -> None:
    """FedVLS, N = 10: nodes 0 and 1 share classes 0..s-1, nodes 2 and 3 the next s, and so on."""
    labels = LABELS[num_classes]
    hist = label_histograms(labels, classes(labels, 10, classes_per_node=s, style="fedvls", seed=0), num_classes)
    for node in range(10):
        pair = node // 2
        assert np.flatnonzero(hist[node]).tolist() == list(range(pair * s, (pair + 1) * s))


def test_classes_fedvls_sizes_follow_the_code_per_dataset() -> None:
    """CIFAR-10 branch: first holder gets randint(n_per/10, n_c); otherwise randint(n_per/10, n_per)."""

    def first_holder_sizes(num_classes: int, s: int, seed: int) -> np.ndarray:
        labels = LABELS[num_classes]
        parts = classes(labels, 10, classes_per_node=s, style="fedvls", seed=seed)
        firsts = label_histograms(labels, parts, num_classes)[0::2]  # nodes 0, 2, ... hold each class first
        return firsts[firsts > 0]

    first10 = np.concatenate([first_holder_sizes(10, 2, seed) for seed in range(5)])
    first100 = first_holder_sizes(100, 20, 0)
    assert first10.min() >= 25 and first10.max() > 250  # up to the whole class (500)
    assert first100.min() >= 25 and first100.max() < 250  # below n_per = 250


def test_classes_pflib_assignment_is_consecutive_groups() -> None:
    """PFLlib "pat", N = 20, C = 10, k = 2: each class goes to 4 nodes, nodes 0..3 share classes 0 and 1."""
    hist = label_histograms(LABELS[10], classes(LABELS[10], 20, classes_per_node=2, seed=0), 10)
    for node in range(20):
        group = node // 4
        assert np.flatnonzero(hist[node]).tolist() == [2 * group, 2 * group + 1]


def test_shards_any_split_gives_equal_sizes_and_at_most_s_classes() -> None:
    """McMahan shards: equal sizes, at most shards_per_node classes per node."""
    labels = LABELS[10]
    parts = shards(labels, 20, shards_per_node=2, seed=0)
    hist = label_histograms(labels, parts, 10)
    assert {len(p) for p in parts} == {250}
    assert (hist > 0).sum(1).max() <= 2 and (hist > 0).sum(1).mean() > 1.5


def test_shards_remainder_is_left_out() -> None:
    """Fewer than N x shards samples that do not fill a shard belong to no node."""
    labels = LABELS[10][:5013]
    parts = shards(labels, 20, shards_per_node=2, seed=0)
    assert {len(p) for p in parts} == {250} and len(np.unique(np.concatenate(parts))) == 5000


def test_quantity_any_beta_keeps_labels_iid_and_size_skew_grows_as_beta_shrinks() -> None:
    """NIID-Bench quantity skew: unequal sizes (more so at small beta), label mix close to the global one."""
    labels = LABELS[100]

    def spread(beta: float) -> float:
        sizes = np.array([len(p) for p in quantity(labels, 20, beta=beta, seed=0)])
        return float(sizes.std() / sizes.mean())

    assert spread(0.5) > spread(5.0) > spread(500.0)
    parts = quantity(LABELS[10], 10, beta=1.0, seed=0)
    big = max(parts, key=len)
    share = np.bincount(LABELS[10][big], minlength=10) / len(big)
    assert np.abs(share - 0.1).max() < 0.05


@pytest.mark.parametrize(
    ("kind", "options", "labels", "nodes", "field"),
    [
        ("dirichlet", {"alpha": 0.5, "min_samples": 10}, LABELS[10][:500], 100, "partition.min_samples"),
        ("dirichlet", {"alpha": 0.0}, LABELS[10], 10, "partition.alpha"),
        ("dirichlet", {"alpha": 0.01, "min_samples": 240, "max_attempts": 5}, LABELS[10], 20, "partition"),
        ("dirichlet-balanced", {"alpha": -1.0}, LABELS[10], 10, "partition.alpha"),
        ("classes", {"classes_per_node": 11}, LABELS[10], 10, "partition.classes_per_node"),
        ("classes", {"classes_per_node": 3}, LABELS[10], 10, "partition.classes_per_node"),
        ("classes", {"classes_per_node": 2, "style": "flower"}, LABELS[10], 10, "partition.style"),
        ("classes", {"classes_per_node": 2, "min_samples": 400}, LABELS[10], 20, "partition.min_samples"),
        ("shards", {"shards_per_node": 300}, LABELS[10], 20, "partition.shards_per_node"),
        ("shards", {"shards_per_node": 0}, LABELS[10], 20, "partition.shards_per_node"),
        ("quantity", {"beta": 0.1}, LABELS[10], 100, "partition.beta"),
        ("quantity", {"beta": 1.0, "min_samples": 600}, LABELS[10], 10, "partition.min_samples"),
        ("iid", {}, LABELS[10][:5], 10, "nodes"),
        ("pathological", {}, LABELS[10], 10, "partition.kind"),
    ],
)
def test_partition_impossible_request_raises_config_error_naming_the_field(
    kind: str, options: dict[str, Any], labels: np.ndarray, nodes: int, field: str
) -> None:
    """A request that cannot be met is a ConfigError naming the setting to change, never a hang or a crash."""
    with pytest.raises(ConfigError) as info:
        partition(kind, labels, nodes, seed=0, **options)
    assert info.value.field == field and str(info.value).startswith(f"{field}: ")


def test_partition_error_messages_say_what_to_change() -> None:
    """The messages name the numbers involved and the way out."""
    with pytest.raises(ConfigError, match="needs 1000"):
        dirichlet(LABELS[10][:500], 100, alpha=0.5, seed=0, min_samples=10)
    with pytest.raises(ConfigError, match="lower min_samples"):
        dirichlet(LABELS[10][:200], 10, alpha=0.01, seed=0, min_samples=19, max_attempts=5)
    with pytest.raises(ConfigError, match="multiple of 10"):
        classes(LABELS[10], 10, classes_per_node=3, seed=0)
    with pytest.raises(ConfigError, match="raise beta"):
        quantity(LABELS[10], 100, beta=0.1, seed=0)


def test_label_histograms_any_parts_counts_nodes_by_classes() -> None:
    """A nodes x classes count matrix whose rows sum to the node sizes."""
    labels = LABELS[10]
    parts = dirichlet(labels, 20, alpha=0.5, seed=0)
    hist = label_histograms(labels, parts, 10)
    assert hist.shape == (20, 10) and hist.sum(1).tolist() == [len(p) for p in parts]
