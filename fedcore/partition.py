"""Splitting a training set across nodes, reproducibly from a seed."""

from __future__ import annotations

import numpy as np

from fedcore.errors import ConfigError
from fedcore.seeding import stream


def iid(labels: np.ndarray, num_nodes: int, *, seed: int) -> list[np.ndarray]:
    rng = stream(seed, "partition", "iid")
    perm = rng.permutation(len(labels))
    return [np.sort(part) for part in np.array_split(perm, num_nodes)]


def dirichlet(
    labels: np.ndarray, num_nodes: int, *, alpha: float, seed: int, min_samples: int = 10, max_attempts: int = 1000
) -> list[np.ndarray]:
    """Label skew as MOON (and KDIA) do it.

    For each class, proportions over nodes come from Dir(alpha); a node already holding the average
    share (len/num_nodes) gets no more; the draw is repeated until every node has `min_samples`.
    """
    if alpha <= 0:
        raise ConfigError("alpha must be positive", field="partition.alpha")
    n = len(labels)
    if num_nodes * min_samples > n:
        raise ConfigError(
            f"{num_nodes} nodes x {min_samples} samples needs {num_nodes * min_samples}, the dataset has {n}",
            field="partition.min_samples",
        )
    rng = stream(seed, "partition", "dirichlet")
    classes = np.unique(labels)
    for _ in range(max_attempts):
        parts: list[list[int]] = [[] for _ in range(num_nodes)]
        for label in classes:
            idx = np.flatnonzero(labels == label)
            rng.shuffle(idx)
            p = rng.dirichlet(np.full(num_nodes, alpha))
            sizes = np.array([len(part) for part in parts])
            p = p * (sizes < n / num_nodes)
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
            for node, chunk in enumerate(np.split(idx, cuts)):
                parts[node].extend(chunk.tolist())
        if min(len(part) for part in parts) >= min_samples:
            return [np.sort(np.asarray(part, dtype=np.int64)) for part in parts]
    raise ConfigError(
        f"no Dirichlet(alpha={alpha}) split gave every one of {num_nodes} nodes {min_samples} samples in"
        f" {max_attempts} draws; lower min_samples or the number of nodes, or raise alpha",
        field="partition",
    )


def label_histograms(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """nodes x classes counts."""
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


PARTITIONERS = {"iid": iid, "dirichlet": dirichlet}


def partition(kind: str, labels: np.ndarray, num_nodes: int, *, seed: int, **options: object) -> list[np.ndarray]:
    try:
        fn = PARTITIONERS[kind]
    except KeyError:
        raise ConfigError(
            f"unknown partition {kind!r}; available: {', '.join(PARTITIONERS)}", field="partition.kind"
        ) from None
    return fn(labels, num_nodes, seed=seed, **options)  # type: ignore[operator]
