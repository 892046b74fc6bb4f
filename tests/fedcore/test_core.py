"""Seeded streams, tensors to and from the wire, aggregation and the participation record."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedmq.fedcore.aggregation import weighted_average
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.models import build_model, count_parameters
from fedmq.fedcore.participation import MAX_INTERVALS, ParticipationRecord
from fedmq.fedcore.seeding import stream, torch_generator
from fedmq.fedcore.tensors import flatten_groups, non_finite, schema_mismatch, schema_of, split_groups
from fedmq.fedcore.training import TrainSettings, local_sgd


def test_streams_are_reproducible_and_independent() -> None:
    """The same keys give the same draws; any other key gives different ones; -1 differs from 1."""
    draw = lambda *k: stream(7, *k).integers(0, 2**31, size=4).tolist()  # noqa: E731
    assert draw("sampler", 3) == draw("sampler", 3)
    assert (
        len({tuple(draw(*k)) for k in [("sampler", 3), ("sampler", 4), ("node", 3), ("sampler", -1), ("sampler", 1)]})
        == 5
    )
    g1, g2 = torch_generator(7, "node-train", "n1", 0), torch_generator(7, "node-train", "n1", 0)
    assert torch.equal(torch.randperm(50, generator=g1), torch.randperm(50, generator=g2))


def test_model_init_is_seeded_and_leaves_the_global_rng_alone() -> None:
    before = torch.random.get_rng_state()
    a = build_model("cnn", (1, 8, 8), 10, seed=1)
    b = build_model("cnn", (1, 8, 8), 10, seed=1)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    # the quickstart CNN: conv 1->16 (160) + 16->32 (4,640) + fc 512->64 (32,832) + 64->10 (650)
    assert count_parameters(a) == 38_282
    assert count_parameters(build_model("mlp", (1, 8, 8), 10, seed=0, hidden=(32,))) == 64 * 32 + 32 + 32 * 10 + 10


def test_tensor_groups_round_trip_including_bfloat16() -> None:
    state = {"w": torch.randn(3, 4), "h": torch.randn(5, dtype=torch.bfloat16), "n": torch.tensor(3)}
    flat = flatten_groups({"model": state, "teacher": {"w": torch.zeros(2)}})
    assert set(flat) == {"model/w", "model/h", "model/n", "teacher/w"}
    back = split_groups(flat)
    assert all(torch.equal(back["model"][k], v) for k, v in state.items())
    assert back["model"]["h"].dtype == torch.bfloat16


def test_schema_mismatch_names_the_problem() -> None:
    expected = schema_of({"w": torch.zeros(2, 3), "b": torch.zeros(3)})
    assert schema_mismatch({"w": torch.zeros(2, 3), "b": torch.zeros(3)}, expected) is None
    assert schema_mismatch({"w": torch.zeros(3, 2), "b": torch.zeros(3)}, expected)[0] == "wrong-shape"  # type: ignore[index]
    assert (
        schema_mismatch({"w": torch.zeros(2, 3, dtype=torch.float64), "b": torch.zeros(3)}, expected)[0]
        == "wrong-dtype"
    )  # type: ignore[index]
    assert "missing" in schema_mismatch({"w": torch.zeros(2, 3)}, expected)[1]  # type: ignore[index]
    assert (
        "unexpected"
        in schema_mismatch({**{"w": torch.zeros(2, 3), "b": torch.zeros(3)}, "x": torch.zeros(1)}, expected)[1]
    )  # type: ignore[index]
    assert non_finite({"a": torch.tensor([1.0, float("nan")])}) == "a"
    assert non_finite({"a": torch.tensor([1, 2])}) is None


def test_weighted_average_matches_hand_computation() -> None:
    """w = sum_k n_k w_k / sum n_k for floats; integer buffers take the maximum."""
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(5)}
    out = weighted_average([a, b], [1.0, 3.0])
    assert torch.allclose(out["w"], torch.tensor([2.5, 5.0]))
    assert int(out["n"]) == 5
    half = weighted_average([{"w": torch.tensor([1.0], dtype=torch.float16)}], [2.0])
    assert half["w"].dtype == torch.float16
    with pytest.raises(ValueError):
        weighted_average([a], [0.0])


def test_participation_record_arithmetic() -> None:
    """Counts, last round, intervals and their mean follow the accepted rounds only."""
    rec = ParticipationRecord()
    rec.selected(["a", "b"], 0)
    rec.accepted("a", 0, num_samples=10, rtt_s=0.5, train_s=0.2)
    rec.lost("b")
    rec.selected(["a", "b"], 3)
    rec.accepted("a", 3, num_samples=10)
    rec.late("b")
    rec.selected(["a"], 4)
    rec.accepted("a", 4, num_samples=12)
    a, b = rec.get("a"), rec.get("b")
    assert a is not None and b is not None
    assert (a.last_round, a.count, a.rounds_selected, a.intervals, a.mean_interval, a.num_samples) == (
        4,
        3,
        3,
        [3, 1],
        2.0,
        12,
    )
    assert (b.last_round, b.count, b.rounds_selected, b.lost, b.late) == (-1, 0, 2, 1, 1)
    arrays = rec.arrays(["a", "b", "never"])
    assert arrays["last_round"].tolist() == [4, -1, -1] and arrays["count"].tolist() == [3, 0, 0]
    with pytest.raises(ValueError):
        rec.accepted("a", 3, num_samples=1)  # an earlier round than the last (a repeat of 4 is allowed: async)
    back = ParticipationRecord.from_json(rec.to_json())
    assert back.to_json() == rec.to_json()


def test_participation_intervals_are_bounded_but_the_mean_is_exact() -> None:
    rec = ParticipationRecord()
    for r in range(0, 2 * (MAX_INTERVALS + 10), 2):
        rec.accepted("a", r, num_samples=1)
    node = rec.get("a")
    assert node is not None
    assert (
        len(node.intervals) == MAX_INTERVALS and node.mean_interval == 2.0 and node.interval_count == MAX_INTERVALS + 9
    )


def test_participation_from_json_rejects_malformed() -> None:
    with pytest.raises(ValueError):
        ParticipationRecord.from_json({"a": {"node_id": "b"}})
    with pytest.raises(ValueError):
        ParticipationRecord.from_json({"a": {"node_id": "a", "count": 1, "bogus": 2, "last_round": "x"}} | {"c": []})  # type: ignore[dict-item]
    _ = np  # numpy imported for parity with other tests


def test_local_sgd_skips_a_trailing_single_sample_batch_that_batchnorm_cannot_train_on() -> None:
    """11 samples in batches of 10 with a BatchNorm model: the last batch of one is skipped, not fatal."""
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(11, 4, generator=gen), torch.randint(0, 3, (11,), generator=gen), 3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    stats = local_sgd(model, data, TrainSettings(batch_size=10, local_epochs=2), torch.Generator().manual_seed(1))
    assert (stats.steps, stats.samples_seen) == (2, 20)


def test_deterministic_kernels_sets_cudnn_for_a_cuda_device_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA device gets cuDNN's deterministic algorithms, no benchmarking (torch's flags, set without a
    GPU too); a CPU leaves them; and a node's workspace asks for them on its device."""
    from fedmq.fedcore.seeding import deterministic_kernels
    from fedmq.fednode import workspace as ws

    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    deterministic_kernels("cpu")
    assert not torch.backends.cudnn.deterministic and torch.backends.cudnn.benchmark
    deterministic_kernels(torch.device("cuda"))
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    asked: list[torch.device] = []
    monkeypatch.setattr(ws, "deterministic_kernels", asked.append)
    ws.Workspace(torch.nn.Linear(2, 2), torch.device("cpu"))
    assert asked == [torch.device("cpu")]


def test_cudnn_kernels_sets_the_chosen_way_for_a_cuda_device_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """`simulation.cudnn`'s setter: each way's flags for a CUDA device, none for a CPU, a name refused."""
    from fedmq.fedcore.seeding import CUDNN_CHOICES, cudnn_kernels

    cudnn = torch.backends.cudnn
    monkeypatch.setattr(cudnn, "deterministic", True)
    monkeypatch.setattr(cudnn, "benchmark", False)
    cudnn_kernels("cpu", "benchmark")
    assert (cudnn.deterministic, cudnn.benchmark) == (True, False)
    for name, flags in CUDNN_CHOICES.items():
        cudnn_kernels(torch.device("cuda"), name)
        assert (cudnn.deterministic, cudnn.benchmark) == flags
    with pytest.raises(ValueError, match="one of deterministic, default, benchmark, not 'fast'"):
        cudnn_kernels("cuda", "fast")


def test_cudnn_choice_sets_each_ways_flags_inside_the_block_and_restores_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's cost of determinism times each of cuDNN's ways inside `cudnn_choice`: its flags there,
    the process's flags back after the block, an exception too; an unknown name is refused."""
    from fedmq.fedcore.seeding import CUDNN_CHOICES, cudnn_choice

    cudnn = torch.backends.cudnn
    monkeypatch.setattr(cudnn, "deterministic", True)
    monkeypatch.setattr(cudnn, "benchmark", False)
    seen = {}
    for name in CUDNN_CHOICES:
        with cudnn_choice(name):
            seen[name] = (cudnn.deterministic, cudnn.benchmark)
        assert (cudnn.deterministic, cudnn.benchmark) == (True, False)
    assert seen == {"deterministic": (True, False), "default": (False, False), "benchmark": (False, True)}
    with pytest.raises(RuntimeError), cudnn_choice("benchmark"):
        raise RuntimeError("a path failed")
    assert (cudnn.deterministic, cudnn.benchmark) == (True, False)
    with pytest.raises(ValueError, match="deterministic, default, benchmark"), cudnn_choice("fastest"):
        pass
