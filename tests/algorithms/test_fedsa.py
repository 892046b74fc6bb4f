"""The FedSA method in-process: FedAvg's halves with skew-aware aggregation (SA) as the average.

Covers: FedSA equal to FedAvg bit for bit at the neutral setting, determinism, the metrics and
per-tensor records (and ``log_layers``), SA as FedProx's and FedAvgM's averaging step. The rule
itself, step by step: tests/fedcore/test_skew_aware.py; hyperparameters and checkpoints:
test_contract.py.
"""

from __future__ import annotations

import math

import torch

from fedmq.fedcore.aggregation import skew_aware, weighted_average
from fedmq.fedcore.aggregation.skew_aware import coefficient_of_variation, high_dispersion
from fedmq.fedcore.algorithms import fedsa
from fedmq.fedcore.algorithms.fedsa import Hyperparams
from tests.algorithms import common
from tests.algorithms.common import Federation, context, same_state, update

SPEC = fedsa.SPEC


# -- the halves in a federation -----------------------------------------------------------------


def test_fedsa_neutral_setting_equals_fedavg_exactly() -> None:
    """cv_t = 1 (nothing dispersed) is FedAvg bit for bit: weighted, or the unweighted mean."""
    assert same_state(Federation("fedavg").run(2), Federation(SPEC, {"cv_t": 1.0, "weighted": True}).run(2))
    plain = Federation("fedavg", {"weighted": False}).run(2)
    assert same_state(plain, Federation(SPEC, {"cv_t": 1.0}).run(2))
    # with two clusters the default SA is not the mean: three clients that agree and two that agree. (Three
    # clients always form one cluster: the last free client joins the first pair's, skew_aware.greedy_cluster;
    # and equal groups deviate equally from the mean, so squared deviations cannot tell them apart.)
    a = {"w": torch.tensor([[0.0, 1.0, 2.0, 3.0]]), "b": torch.tensor([1.0])}
    b = {"w": a["w"] + torch.tensor([[0.0, 3.0, 0.0, 3.0]]), "b": a["b"]}
    states = [a, dict(a), dict(a), b, dict(b)]
    sa = skew_aware.aggregator(Hyperparams())
    out = sa(states, [1.0] * 5)
    assert sa.metrics["sa_clusters_mean"] == 2.0
    assert not same_state(out, weighted_average(states, [1.0] * 5))


def test_fedsa_is_deterministic_and_reports_its_statistics() -> None:
    """Same seed, same model; the metrics and the per-tensor records describe what SA did."""
    a = common.assert_deterministic(SPEC)
    metrics = a.metrics[-1]
    assert math.isfinite(metrics["train_loss"])
    assert 0 < metrics["sa_high_share"] < 1 and metrics["sa_layers_clustered"] >= 1
    assert 1 <= metrics["sa_clusters_mean"] <= 3 and 0 <= metrics["sa_unclustered_mean"] <= 3
    records = a.coordinator.round_records()["fedsa_layers"]
    assert [r["layer"] for r in records] == list(a.coordinator.model.state_dict())
    assert all(r["round"] == 1 and 0 <= r["high"] <= r["size"] for r in records)
    clustered = [r for r in records if r["high"]]
    assert all(sum(r["cluster_sizes"]) + len(r["unclustered"]) == 3 for r in clustered)
    quiet = Federation(SPEC, {"log_layers": False})
    quiet.run(1)
    assert quiet.coordinator.round_records() == {}


def test_fedsa_as_fedprox_average_differs_from_the_mean_only_where_dispersed() -> None:
    """FedProx's coordinator with SA as `average`: the mean exactly at low-dispersion positions, not at all high ones.

    Three nodes send one trained model and two others that model with every other entry moved by 0.5,
    so the groups cluster apart wherever they disagree (three clients always form one cluster, whose
    mean is the plain mean: skew_aware.greedy_cluster)."""
    fed = Federation("fedprox", {"mu": 0.01})
    hp = Hyperparams()
    fed.coordinator.average = skew_aware.aggregator(hp)
    ctx = context(0, fed.node_ids)
    trained = fed.train(fed.node_ids[0], fed.coordinator.configure_round(ctx))
    base = trained.payload.tensors["model"]
    moved = {k: v + 0.5 * (torch.arange(v.numel()) % 2).reshape(v.shape) for k, v in base.items()}
    states = [base, dict(base), dict(base), moved, dict(moved)]
    ids = [f"node-{i:03d}" for i in range(5)]
    updates = [update(n, state, trained.num_samples, loss=0.1) for n, state in zip(ids, states, strict=True)]
    metrics = fed.coordinator.aggregate(ctx, updates, [])
    assert math.isfinite(metrics["train_loss"])
    out, mean = fed.coordinator.model.state_dict(), weighted_average(states, [1.0] * 5)
    differs = 0
    for name, value in out.items():
        rows = torch.stack([s[name].reshape(-1) for s in states])
        mu = skew_aware.client_mean(rows, [1 / 5] * 5)
        var = skew_aware.client_variance(rows, mu, [1 / 5] * 5)
        high = high_dispersion(coefficient_of_variation(var, mu, hp.eps), hp.cv_t)
        changed = value.reshape(-1) != mean[name].reshape(-1)
        assert not (changed & ~high).any(), name
        differs += int(changed.sum())
    assert differs > 0


def test_fedsa_as_fedavgm_average_without_momentum_equals_fedsa() -> None:
    """FedAvgM with beta = 0 and SA as its average is FedSA bit for bit (SA then the identity step)."""
    sa = Federation(SPEC)
    fedavgm = Federation("fedavgm", {"momentum": 0.0})
    fedavgm.coordinator.average = skew_aware.aggregator(Hyperparams())
    assert same_state(sa.run(2), fedavgm.run(2))
