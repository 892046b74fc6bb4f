"""``train.drop_last`` (PyTorch's DataLoader ``drop_last=True``, the FedVLS authors' loaders): local_sgd
skips each epoch's short last batch, and vectorised group training does the same, node for node."""

from __future__ import annotations

import copy

import pytest
import torch

from fedmq.fedcore.data import load_dataset
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.models import build_model
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.training import TrainSettings, local_sgd
from fedmq.fedcore.vectorized import steps_per_epoch, train_vectorized

SETTINGS = TrainSettings(local_epochs=2, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-3, drop_last=True)
SIZES = (40, 17, 1, 33, 64, 9)


def _shards() -> list:
    data = load_dataset("digits", seed=0).train
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(7))
    starts = [sum(SIZES[:i]) for i in range(len(SIZES))]
    return [data.subset(perm[s : s + n].numpy()) for s, n in zip(starts, SIZES, strict=True)]


def _generators() -> list[torch.Generator]:
    return [torch_generator(3, "node-train", f"node-{i}", 0) for i in range(len(SIZES))]


@pytest.mark.parametrize(
    ("n", "drop_last", "steps"), [(40, False, 3), (40, True, 2), (17, False, 1), (9, True, 0), (64, True, 4)]
)
def test_steps_per_epoch(n: int, drop_last: bool, steps: int) -> None:
    assert steps_per_epoch(n, 16, drop_last) == steps


def test_local_sgd_with_drop_last_trains_on_full_batches_only() -> None:
    """40 samples in batches of 16: 2 full batches an epoch (32 samples seen), not 3; a shard smaller
    than a batch takes no step and is left as it was."""
    shards = _shards()
    model = build_model("mlp", shards[0].input_shape, 10, seed=0)
    for data in shards:
        trained = copy.deepcopy(model)
        stats = local_sgd(trained, data, SETTINGS, torch_generator(0, "t"))
        full = len(data) // 16
        assert (stats.steps, stats.samples_seen) == (2 * full, 2 * full * 16)
        moved = any(
            not torch.equal(a, b)
            for a, b in zip(model.state_dict().values(), trained.state_dict().values(), strict=True)
        )
        assert moved == (full > 0)
    plain = local_sgd(
        copy.deepcopy(model), shards[0], TrainSettings(local_epochs=2, batch_size=16), torch_generator(0, "t")
    )
    assert (plain.steps, plain.samples_seen) == (6, 80)


def test_vectorized_with_drop_last_equals_local_sgd() -> None:
    shards = _shards()
    model = build_model("mlp", shards[0].input_shape, 10, seed=0)
    got = train_vectorized(model, shards, SETTINGS, _generators())
    for data, gen, (state, stats) in zip(shards, _generators(), got, strict=True):
        alone = copy.deepcopy(model)
        want = local_sgd(alone, data, SETTINGS, gen)
        assert (stats.steps, stats.samples_seen) == (want.steps, want.samples_seen)
        assert stats.steps == 2 * steps_per_epoch(len(data), 16, True)
        for key, value in alone.state_dict().items():
            torch.testing.assert_close(state[key], value, atol=1e-5, rtol=1e-4)


def test_drop_last_must_be_a_bool_on_the_wire() -> None:
    with pytest.raises(ConfigError, match=r"train\.drop_last"):
        TrainSettings.from_meta({"drop_last": "yes"})
    assert TrainSettings.from_meta(SETTINGS.to_meta()) == SETTINGS
