"""``data.split: {kind: per_node}``: PFLlib's evaluation convention, which FedSA's Table 1 reports by. The
nodes' parts are partitioned first (from the pooled training and test sets), each cut 75/25 as sklearn's
``train_test_split(train_size=0.75, shuffle=True)`` cuts it, and the global model is tested on the
held-out parts together: test data of each node's own label distribution (fedsa.md section 2)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedmq.experiments.build import load_split, shards
from fedmq.experiments.config import ExperimentConfig, parse_config
from fedmq.experiments.local import build_local
from fedmq.fedcore.data import TensorDataset, held_out_by_node, load_dataset, pooled_sets
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.partition import partition

PER_NODE = {"kind": "per_node", "test_fraction": 0.25}


def _config(split: object = PER_NODE, **data: object) -> ExperimentConfig:
    return parse_config({
        "name": "t", "nodes": 4, "rounds": 2, "data": {"split": split, **data},
        "partition": {"kind": "dirichlet", "alpha": 0.3},
    })  # fmt: skip


def _indexed(n: int) -> TensorDataset:
    """Synthetic: each sample's feature is its own index, so a subset says which samples it took."""
    return TensorDataset(torch.arange(n, dtype=torch.float32).view(n, 1), torch.arange(n) % 3, 3)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 13, 101, 3_000])
def test_each_part_is_cut_as_sklearns_train_test_split_cuts_it(n: int) -> None:
    from sklearn.model_selection import train_test_split

    split = held_out_by_node(_indexed(n), [np.arange(n)], test_fraction=0.25, seed=0)
    trained, held = train_test_split(np.arange(n), train_size=0.75, shuffle=True, random_state=0)
    assert (len(split.train), len(split.test)) == (len(trained), len(held)) == (math.floor(0.75 * n), n - len(trained))


def test_the_test_set_is_the_held_out_parts_and_each_node_trains_on_the_rest_of_its_own() -> None:
    data = _indexed(60)
    parts = [np.arange(0, 8), np.arange(8, 13), np.arange(13, 15), np.arange(15, 60)[::-1]]
    split = held_out_by_node(data, parts, test_fraction=0.25, seed=7)
    assert split.node_parts is not None and len(split.node_parts) == 4
    trained = [set(split.train.x[idx].view(-1).long().tolist()) for idx in split.node_parts]
    tested = split.test.x.view(-1).long().tolist()
    assert [len(t) for t in trained] == [6, 3, 1, 33]  # floor(0.75 n) of 8, 5, 2, 45
    assert len(tested) == len(set(tested)) == 2 + 2 + 1 + 12  # held out, each sample once
    offset = 0
    for part, mine in zip(parts, trained, strict=True):
        held = set(tested[offset : offset + len(part) - len(mine)])  # in node order
        offset += len(held)
        assert held | mine == set(part.tolist()) and not held & mine
    assert split.train.y.tolist() == [int(v) % 3 for v in split.train.x.view(-1).tolist()]  # labels follow
    again = held_out_by_node(data, parts, test_fraction=0.25, seed=7)
    other = held_out_by_node(data, parts, test_fraction=0.25, seed=8)
    assert torch.equal(again.test.x, split.test.x) and not torch.equal(other.test.x, split.test.x)


def test_a_node_left_nothing_to_train_on_is_refused_with_what_to_do() -> None:
    with pytest.raises(ConfigError, match=r"node 1's part of 1 sample\(s\).*raise partition.min_samples to 2 or"):
        held_out_by_node(_indexed(5), [np.arange(4), np.arange(4, 5)], test_fraction=0.25, seed=0)
    with pytest.raises(ConfigError, match=r"node 0's part of 2 sample\(s\).*min_samples to 3 or more"):
        held_out_by_node(_indexed(5), [np.arange(2), np.arange(2, 5)], test_fraction=0.6, seed=0)


def test_the_experiments_split_partitions_the_pooled_sets_then_cuts_each_part() -> None:
    cfg = _config()
    split = load_split(cfg)
    parts = shards(cfg, split)
    official = load_dataset("digits", seed=cfg.seed)
    pooled = pooled_sets(official)
    assert len(split.train) + len(split.test) == len(pooled) == 1_797
    # the partition of the pooled labels, made as the experiment makes it, and each part cut by 0.25
    expected = partition("dirichlet", pooled.y.numpy(), 4, seed=cfg.partition.seed_for(cfg.seed), alpha=0.3)
    assert [len(p) for p in parts.values()] == [math.floor(0.75 * len(p)) for p in expected]
    assert np.array_equal(np.sort(np.concatenate(list(parts.values()))), np.arange(len(split.train)))
    for idx, part in zip(parts.values(), expected, strict=True):  # each node's labels are its part's
        assert np.array_equal(
            np.bincount(split.train.y[idx].numpy(), minlength=10) <= np.bincount(pooled.y[part].numpy(), minlength=10),
            np.ones(10, dtype=bool),
        )
    alone = load_split(_config({**PER_NODE, "pool": False}))
    assert len(alone.train) + len(alone.test) == len(official.train)


def test_a_federation_trains_on_the_nodes_parts_and_tests_on_their_held_out_parts() -> None:
    cfg = _config()
    split = load_split(cfg)
    fed = build_local(cfg, device=torch.device("cpu"))
    assert torch.equal(fed.evaluate.test.x, split.test.x)
    assert sum(len(node.data) for node in fed.nodes.values()) == len(split.train)
    records = fed.run()
    assert len(records) == 2 and 0 < records[-1]["accuracy"] <= 1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"validation_fraction": 0.1}, "validation_fraction does not apply with data.split kind per_node"),
        ({"split": {"kind": "per_node", "test_fraction": 0}}, "test_fraction: Input should be greater than 0"),
        ({"split": {"kind": "per_node", "seed": 3}}, "seed: unknown field (allowed fields: kind, test_fraction, pool)"),
    ],
)
def test_bad_per_node_splits_are_refused_with_one_readable_error(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _config(**{"split": PER_NODE, **data})
    assert message in str(info.value)
