"""MOON's two halves in-process: the contrastive loss by hand, the previous models a node keeps,
FedAvg at mu = 0, the projection head of "moon-cnn", determinism; hyperparameters and checkpoints: test_contract.py."""

from __future__ import annotations

import math

import pytest
import torch

from fedmq.fedcore.algorithms import get_algorithm, moon
from fedmq.fedcore.algorithms.base import Payload
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.errors import AlgorithmError
from tests.algorithms import common
from tests.algorithms.common import Federation, same_state, tiny_model

SPEC = get_algorithm("moon")


def test_contrastive_loss_on_fixed_vectors_matches_hand_value() -> None:
    """sim(z, z_glob) = 1, sim(z, z_prev) = 0, tau = 0.5: -log(e^2 / (e^2 + e^0)) = log(1 + e^-2)."""
    z, z_glob, z_prev = torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 3.0]])
    assert float(moon.contrastive_loss(z, z_glob, [z_prev], 0.5)) == pytest.approx(math.log1p(math.exp(-2)))
    # a second negative with similarity -1 adds e^-2 / e^2 = e^-4; the loss is averaged over the batch
    two = moon.contrastive_loss(z.repeat(2, 1), z_glob.repeat(2, 1), [z_prev.repeat(2, 1), -z.repeat(2, 1)], 0.5)
    assert float(two) == pytest.approx(math.log(1 + math.exp(-2) + math.exp(-4)))
    # no negative: the softmax over the positive alone is 1, the loss 0
    assert float(moon.contrastive_loss(z, z_glob, [], 0.5)) == 0.0


def test_moon_first_participation_trains_as_fedavg() -> None:
    """Without a previous model there is no negative: a node's first training equals FedAvg's bit for bit."""
    fedavg, moon_fed = Federation("fedavg"), Federation("moon")
    start = {k: v.clone() for k, v in tiny_model(0).state_dict().items()}
    a = fedavg.train("node-001", Payload(tensors={"model": start}))
    b = moon_fed.train("node-001", Payload(tensors={"model": start}))
    assert same_state(a.payload.tensors["model"], b.payload.tensors["model"])
    assert len(moon_fed.nodes["node-001"].previous) == 1 and not moon_fed.scratch.modules


def test_moon_node_keeps_its_last_previous_models_fifo() -> None:
    """With previous_models = 2, three trainings leave the last two local models, the newest last, on the CPU."""
    fed = Federation("moon", {"previous_models": 2})
    start = tiny_model(0).state_dict()
    trained = []
    for r in range(3):
        fed.round = r
        trained.append(fed.train("node-000", Payload(tensors={"model": {k: v.clone() for k, v in start.items()}})))
    previous = fed.nodes["node-000"].previous
    assert len(previous) == 2
    assert same_state(previous[0], trained[1].payload.tensors["model"])
    assert same_state(previous[1], trained[2].payload.tensors["model"])
    assert all(t.device.type == "cpu" for state in previous for t in state.values())
    assert set(fed.scratch.modules) == {"moon-global", "moon-previous-0", "moon-previous-1"}


def test_moon_neutral_setting_equals_fedavg_exactly() -> None:
    """mu = 0 gives FedAvg's global model bit for bit; mu = 5 differs from round 1 on (the first round with negatives)."""
    fedavg = Federation("fedavg").run(2)
    assert same_state(fedavg, Federation("moon", {"mu": 0.0}).run(2))
    assert same_state(Federation("fedavg").run(1), Federation("moon").run(1))
    assert not same_state(fedavg, Federation("moon").run(2))


def test_moon_training_is_deterministic_under_a_fixed_seed() -> None:
    """Two federations with the same seed end with the same model; another seed differs."""
    a = common.assert_deterministic("moon", rounds=3)
    assert all(math.isfinite(m["train_loss"]) for m in a.metrics)


def test_moon_cnn_contrasts_the_projection_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """On "moon-cnn" the compared representations are the 256-wide projections (l2), not the 16 features."""
    seen: list[tuple[int, ...]] = []
    real = moon.contrastive_loss

    def spy(z, z_glob, z_prev, tau):  # type: ignore[no-untyped-def]
        seen.append((z.shape[1], z_glob.shape[1], *(p.shape[1] for p in z_prev)))
        return real(z, z_glob, z_prev, tau)

    monkeypatch.setattr(moon, "contrastive_loss", spy)
    gen = torch.Generator().manual_seed(0)
    images = [TensorDataset(torch.randn(12, 3, 16, 16, generator=gen), torch.arange(12) % 3, 3) for _ in range(2)]
    fed = Federation("moon", model="moon-cnn", input_shape=(3, 16, 16), data=images)
    fed.run(2)
    assert seen and set(seen) == {(256, 256, 256)}


def test_moon_model_without_represent_raises_algorithm_error() -> None:
    """A model that cannot give (z, logits) is an AlgorithmError naming the node and the round."""
    with pytest.raises(AlgorithmError, match=r"represent.*node n0, round 2"):
        common.train_alone(SPEC, common.plain_module())
