"""Splitting a training set across nodes, reproducibly from a seed.

Every partitioner takes the training labels (a 1-D integer array) and the number of nodes, draws
only from ``stream(seed, "partition", KIND)``, and returns one sorted int64 index array per node.
The parts are always disjoint. They cover the whole training set except where noted:

| kind | follows | parameters | covers every sample |
|---|---|---|---|
| ``iid`` | uniform split (MOON/NIID-Bench "homo") | | yes |
| ``dirichlet`` | MOON and KDIA (NIID-Bench "noniid-labeldir") | alpha, min_samples | yes |
| ``dirichlet-balanced`` | FedRCL ``cifar_dirichlet_balanced`` | alpha | when N divides it [1] |
| ``classes`` | FedSA (PFLlib "pat") or FedVLS | classes_per_node, style, min_samples | yes |
| ``shards`` | McMahan et al., FedRCL ``cifar_noniid`` | shards_per_node | when N x shards divides it [1] |
| ``quantity`` | NIID-Bench "iid-diff-quantity" | beta, min_samples | yes |

[1] Otherwise the remainder (fewer than N, or N x shards, samples) belongs to no node.

A request that cannot be met raises `ConfigError` naming the ``partition.FIELD`` to change.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.seeding import stream


def _check(labels: np.ndarray, num_nodes: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise TypeError(f"labels must be a 1-D integer array, got {labels.dtype} with shape {labels.shape}")
    if num_nodes < 1:
        raise ConfigError(f"need at least one node, got {num_nodes}", field="nodes")
    if num_nodes > len(labels):
        raise ConfigError(
            f"{num_nodes} nodes but only {len(labels)} training samples; use at most {len(labels)} nodes",
            field="nodes",
        )
    return labels


def _check_min_samples(n: int, num_nodes: int, min_samples: int) -> None:
    if num_nodes * min_samples > n:
        raise ConfigError(
            f"{num_nodes} nodes x {min_samples} samples needs {num_nodes * min_samples}, the dataset has {n}",
            field="partition.min_samples",
        )


def _by_class(labels: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """The classes present, ascending, and each one's sample indices, ascending."""
    order = np.argsort(labels, kind="stable")
    classes, starts = np.unique(labels[order], return_index=True)
    return classes, np.split(order, starts[1:])


def _groups(owner: np.ndarray, num_nodes: int) -> list[np.ndarray]:
    """Sorted index arrays per node from an owner per sample (-1: left out)."""
    order = np.argsort(owner, kind="stable")  # stable over arange: ascending indices within a node
    counts = np.bincount(owner[owner >= 0], minlength=num_nodes)
    skip = int(np.count_nonzero(owner < 0))
    bounds = skip + np.cumsum(counts)[:-1]
    return [part.astype(np.int64) for part in np.split(order[skip:], bounds - skip)]


def iid(labels: np.ndarray, num_nodes: int, *, seed: int) -> list[np.ndarray]:
    """Uniform random split, sizes differing by at most one (MOON/NIID-Bench "homo", FedRCL "iid")."""
    labels = _check(labels, num_nodes)
    rng = stream(seed, "partition", "iid")
    perm = rng.permutation(len(labels))
    return [np.sort(part) for part in np.array_split(perm, num_nodes)]


def dirichlet(
    labels: np.ndarray, num_nodes: int, *, alpha: float, seed: int, min_samples: int = 10, max_attempts: int = 1000
) -> list[np.ndarray]:
    """Label skew as MOON and KDIA do it (NIID-Bench ``partition_data``, "noniid-labeldir").

    For each class in turn: shuffle its samples, draw proportions p ~ Dir(alpha * 1_N) over the
    nodes, zero p for every node already holding at least the average share (len/num_nodes) (the
    cap), renormalise, and cut the class at the cumulative proportions. The whole draw is repeated
    until every node has `min_samples` (10 in MOON and KDIA). Node sizes are unequal; the whole set
    is covered. Deviation: where the nodes below the cap all drew p = 0 (possible for tiny alpha),
    the class is shared evenly among them instead of dividing by zero as the code would.
    """
    labels = _check(labels, num_nodes)
    if alpha <= 0:
        raise ConfigError("alpha must be positive", field="partition.alpha")
    n = len(labels)
    _check_min_samples(n, num_nodes, min_samples)
    rng = stream(seed, "partition", "dirichlet")
    _, per_class = _by_class(labels)
    nodes = np.arange(num_nodes)
    for _ in range(max_attempts):
        owner = np.empty(n, dtype=np.int64)
        sizes = np.zeros(num_nodes, dtype=np.int64)
        for members in per_class:
            idx = members.copy()
            rng.shuffle(idx)
            below_cap = sizes < n / num_nodes
            p = rng.dirichlet(np.full(num_nodes, alpha)) * below_cap
            total = p.sum()
            p = p / total if total > 0 else below_cap / below_cap.sum()
            cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
            counts = np.diff(cuts, prepend=0, append=len(idx))
            owner[idx] = np.repeat(nodes, counts)
            sizes += counts
        if sizes.min() >= min_samples:
            return _groups(owner, num_nodes)
    raise ConfigError(
        f"no Dirichlet(alpha={alpha}) split gave every one of {num_nodes} nodes {min_samples} samples in"
        f" {max_attempts} draws; lower min_samples or the number of nodes, or raise alpha",
        field="partition",
    )


def _weighted_class_counts(
    rng: np.random.Generator, weights: np.ndarray, remaining: np.ndarray, size: int
) -> np.ndarray:
    """Per-class counts of `size` draws without replacement, each item weighted by its class's weight.

    The same law as ``torch.multinomial(item_weights, size, replacement=False)`` (successive
    draws): an item's rank is its exponential key E/w, and a class's smallest keys are the
    cumulated spacings E_j / ((r - j) w), so only the first `size` keys of each class are drawn.
    Items of zero-weight classes come last, uniformly among themselves.
    """
    live = (weights > 0) & (remaining > 0)
    counts = np.zeros(len(weights), dtype=np.int64)
    available = int(remaining[live].sum())
    if available <= size:
        counts[live] = remaining[live]
        rest = np.where(live, 0, remaining)
        if size > available:
            counts += rng.multivariate_hypergeometric(rest, size - available)
        return counts
    cls = np.flatnonzero(live)
    depth = int(min(size, remaining[cls].max()))
    left = (remaining[cls, None] - np.arange(depth)[None, :]).astype(float)
    spacing = rng.standard_exponential((len(cls), depth)) / np.where(left > 0, left, np.nan)
    # log key = log(cumulated spacings) - log(w), in logs so that tiny weights do not overflow
    with np.errstate(invalid="ignore", divide="ignore"):
        log_keys = np.log(np.cumsum(spacing, axis=1)) - np.log(weights[cls])[:, None]
    log_keys[~(left > 0)] = np.inf  # past a class's last item
    first = np.argpartition(log_keys.ravel(), size - 1)[:size]
    counts[cls] = np.bincount(first // depth, minlength=len(cls))
    return counts


def dirichlet_balanced(labels: np.ndarray, num_nodes: int, *, alpha: float, seed: int) -> list[np.ndarray]:
    """Equal-size label skew as FedRCL does it (``cifar_dirichlet_balanced``, after Hsu et al.).

    For each node in turn: draw q ~ Dir(alpha * 1_K) over the classes, weight every sample not yet
    assigned by q[its label], and draw len/num_nodes of them without replacement. Every node gets
    the same number of samples; when num_nodes does not divide the set, the remainder (fewer than
    num_nodes samples) is left out, as in the code. The draws are made per class (see
    `_weighted_class_counts`), which follows the same law as the code's per-sample
    ``torch.multinomial`` but not its exact stream. Deviation: when fewer unassigned samples than
    needed have positive weight (q underflows to 0 for tiny alpha), the rest is drawn uniformly from
    the remaining samples, where the code would fail.
    """
    labels = _check(labels, num_nodes)
    if alpha <= 0:
        raise ConfigError("alpha must be positive", field="partition.alpha")
    rng = stream(seed, "partition", "dirichlet-balanced")
    _, per_class = _by_class(labels)
    size = len(labels) // num_nodes
    remaining = np.array([len(m) for m in per_class], dtype=np.int64)
    taken = np.zeros((num_nodes, len(per_class)), dtype=np.int64)
    for node in range(num_nodes):
        q = rng.dirichlet(np.full(len(per_class), alpha))
        taken[node] = _weighted_class_counts(rng, q, remaining, size)
        remaining -= taken[node]
    owner = np.full(len(labels), -1, dtype=np.int64)
    nodes = np.arange(num_nodes)
    for c, members in enumerate(per_class):
        idx = rng.permutation(members)  # which samples of a class a node gets is uniform
        owner[idx[: taken[:, c].sum()]] = np.repeat(nodes, taken[:, c])
    return _groups(owner, num_nodes)


STYLES = ("pflib", "fedvls")


def _class_holders(num_classes: int, num_nodes: int, per_node: int, style: str) -> list[np.ndarray]:
    """PFLlib's deterministic assignment: each class goes to the first m nodes still short of classes."""
    share = num_nodes * per_node / num_classes
    m = math.ceil(share) if style == "pflib" else int(share)
    quota = np.full(num_nodes, per_node)
    holders = []
    for _ in range(num_classes):
        chosen = np.flatnonzero(quota > 0)[:m]
        quota[chosen] -= 1
        holders.append(chosen)
    return holders


def classes(
    labels: np.ndarray,
    num_nodes: int,
    *,
    classes_per_node: int,
    seed: int,
    style: str = "pflib",
    min_samples: int | None = None,
    max_attempts: int = 100,
) -> list[np.ndarray]:
    """A fixed number of classes per node, as FedSA (PFLlib ``separate_data``, "pat") or FedVLS do it.

    Class assignment (both styles, deterministic): classes in ascending order each go to the first
    m nodes that still hold fewer than `classes_per_node` classes, m = ceil(N k / C) for ``pflib``
    and int(N k / C) for ``fedvls`` (``partition_data``, "noniid-labeldir", with k = 0.2 C in the
    paper). Nodes 0 .. m-1 thus share classes 0 .. k-1, the next m nodes the next k classes, and
    so on. A request where this does not give every node exactly k classes and every class a node
    (N k a multiple of C and C a multiple of k, e.g.) is refused.

    Sizes (random, unequal): a class of n_c samples held by h nodes, n_per = n_c / h; each holder
    but the last draws randint(max(n_per / 10, least / C, 1), high) samples, the last the rest.
    high = n_per, except for ``fedvls`` on a 10-class set with two holders per class, where the
    code's CIFAR-10 branch uses high = n_c. ``least`` is `min_samples` when given, else the code's
    own: PFLlib's min(40, len / N / 2) (a batch of 10 in its 25% test split), FedVLS's 10.
    Deviations: each class is shuffled before it is cut (the code cuts it in file order); the sizes
    are redrawn until every node has `min_samples` when it is given, or at least one sample when it
    is not (the code checks nothing). The whole set is covered.
    """
    labels = _check(labels, num_nodes)
    if style not in STYLES:
        raise ConfigError(f"unknown style {style!r}; allowed: {', '.join(STYLES)}", field="partition.style")
    class_ids, per_class = _by_class(labels)
    num_classes, n = len(class_ids), len(labels)
    k = classes_per_node
    if not 1 <= k <= num_classes:
        raise ConfigError(
            f"{k} classes per node but the training set has {num_classes} classes; use 1 .. {num_classes}",
            field="partition.classes_per_node",
        )
    if min_samples is not None and num_nodes * min_samples > n:
        raise ConfigError(
            f"{num_nodes} nodes x {min_samples} samples needs {num_nodes * min_samples}, the dataset has {n}",
            field="partition.min_samples",
        )
    least = min_samples if min_samples is not None else (min(40, n // (2 * num_nodes)) if style == "pflib" else 10)
    required = min_samples if min_samples is not None else 1
    holders = _class_holders(num_classes, num_nodes, k, style)
    held = np.bincount(np.concatenate(holders), minlength=num_nodes)
    orphans = [int(class_ids[c]) for c, h in enumerate(holders) if len(h) == 0]
    if orphans or (held != k).any():
        short = np.flatnonzero(held != k)
        problem = (
            f"classes {orphans[:5]} go to no node" if orphans else f"node {short[0]} gets {held[short[0]]} classes"
        )
        raise ConfigError(
            f"the {style} assignment of {k} classes to each of {num_nodes} nodes over {num_classes} classes fails:"
            f" {problem}; choose classes_per_node so that nodes x classes_per_node is a multiple of {num_classes}"
            f" and {num_classes} a multiple of classes_per_node",
            field="partition.classes_per_node",
        )
    rng = stream(seed, "partition", "classes", style)
    for _ in range(max_attempts):
        owner = np.empty(n, dtype=np.int64)
        for c, (members, nodes) in enumerate(zip(per_class, holders, strict=True)):
            n_c, h = len(members), len(nodes)
            n_per = n_c / h
            high = n_c if (style == "fedvls" and num_classes == 10 and h == 2) else n_per
            low = max(1, int(max(n_per / 10, least / num_classes)))  # every holder gets its class
            if h > 1 and low >= int(high):
                raise ConfigError(
                    f"class {int(class_ids[c])} has {n_c} samples for {h} nodes, too few to split unequally;"
                    " use fewer nodes or more classes_per_node",
                    field="partition.classes_per_node",
                )
            sizes = rng.integers(low, int(high), size=h - 1) if h > 1 else np.zeros(0, dtype=np.int64)
            sizes = np.append(sizes, n_c - sizes.sum())
            idx = rng.permutation(members)
            owner[idx] = np.repeat(nodes, sizes)
        if np.bincount(owner, minlength=num_nodes).min() >= required:
            return _groups(owner, num_nodes)
    raise ConfigError(
        f"no {style} split gave every one of {num_nodes} nodes {required} samples in {max_attempts} draws;"
        " lower min_samples or the number of nodes",
        field="partition.min_samples",
    )


def shards(labels: np.ndarray, num_nodes: int, *, shards_per_node: int, seed: int) -> list[np.ndarray]:
    """McMahan et al.'s pathological split, as FedRCL's quantity-based skew (``cifar_noniid``).

    Sort the samples by label, cut them into shards_per_node x N shards of equal size, and give
    each node shards_per_node shards drawn at random without replacement. Every node gets the same
    number of samples; a node holds at most shards_per_node classes (fewer when its shards share
    one). When the shards do not divide the set, the remainder (fewer than N x shards_per_node
    samples) is left out, chosen at random before sorting (the code requires an exact fit).
    Samples of one class are in random order within the sorted sequence.
    """
    labels = _check(labels, num_nodes)
    if shards_per_node < 1:
        raise ConfigError("shards_per_node must be at least 1", field="partition.shards_per_node")
    num_shards = shards_per_node * num_nodes
    size = len(labels) // num_shards
    if size == 0:
        raise ConfigError(
            f"{num_nodes} nodes x {shards_per_node} shards is {num_shards} shards for {len(labels)} samples;"
            f" use at most {len(labels) // num_nodes} shards per node",
            field="partition.shards_per_node",
        )
    rng = stream(seed, "partition", "shards")
    kept = rng.permutation(len(labels))[: num_shards * size]
    ordered = kept[np.argsort(labels[kept], kind="stable")]
    shard_owner = np.empty(num_shards, dtype=np.int64)
    shard_owner[rng.permutation(num_shards)] = np.repeat(np.arange(num_nodes), shards_per_node)
    owner = np.full(len(labels), -1, dtype=np.int64)
    owner[ordered] = np.repeat(shard_owner, size)
    return _groups(owner, num_nodes)


def quantity(
    labels: np.ndarray, num_nodes: int, *, beta: float, seed: int, min_samples: int = 10, max_attempts: int = 1000
) -> list[np.ndarray]:
    """Quantity skew with IID labels, as NIID-Bench's "iid-diff-quantity".

    Shuffle the whole set, draw node proportions p ~ Dir(beta * 1_N), and cut the shuffled set at
    the cumulative proportions; redraw p until every node has `min_samples` (10 in NIID-Bench).
    Sizes grow more unequal as beta shrinks; labels within a node follow the global distribution.
    The whole set is covered. Deviation: the minimum is checked on the integer sizes after cutting,
    where the code checks p x len, which can leave a node one sample short.
    """
    labels = _check(labels, num_nodes)
    if beta <= 0:
        raise ConfigError("beta must be positive", field="partition.beta")
    n = len(labels)
    _check_min_samples(n, num_nodes, min_samples)
    rng = stream(seed, "partition", "quantity")
    perm = rng.permutation(n)
    for _ in range(max_attempts):
        p = rng.dirichlet(np.full(num_nodes, beta))
        cuts = (np.cumsum(p / p.sum()) * n).astype(int)[:-1]
        if np.diff(cuts, prepend=0, append=n).min() >= min_samples:
            return [np.sort(part) for part in np.split(perm, cuts)]
    raise ConfigError(
        f"no Dir(beta={beta}) draw gave every one of {num_nodes} nodes {min_samples} samples in {max_attempts}"
        " draws; raise beta, or lower min_samples or the number of nodes",
        field="partition.beta",
    )


def label_histograms(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """nodes x classes counts."""
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


PARTITIONERS: dict[str, Callable[..., list[np.ndarray]]] = {
    "iid": iid,
    "dirichlet": dirichlet,
    "dirichlet-balanced": dirichlet_balanced,
    "classes": classes,
    "shards": shards,
    "quantity": quantity,
}


def partition(kind: str, labels: np.ndarray, num_nodes: int, *, seed: int, **options: Any) -> list[np.ndarray]:
    """The partition `kind` (a key of `PARTITIONERS`) with its own keyword options."""
    try:
        fn = PARTITIONERS[kind]
    except KeyError:
        raise ConfigError(
            f"unknown partition {kind!r}; available: {', '.join(PARTITIONERS)}", field="partition.kind"
        ) from None
    return fn(labels, num_nodes, seed=seed, **options)
