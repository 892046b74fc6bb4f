"""KDIA's teacher (kdia.teacher): the triFreqs weights against the spec's unit-test vector (kdia.md 1.3),
log-space robustness, the model stores (memory, disk and its crash safety, the safetensors codec), and
the four teacher modes driven over simulated rounds against a float64 hand-written Eq. 10."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmq.fedcore.algorithms.kdia.teacher import (
    DiskStore,
    MemoryStore,
    StoreTeacher,
    StreamingTeacher,
    Teacher,
    TeacherStep,
    TeacherWeights,
    Upload,
    load_safetensors,
    log_factors,
    log_teacher_weights,
    make_teacher,
    save_safetensors,
    uploads_from_record,
    weights_from_record,
)
from fedmq.fedcore.participation import ParticipationRecord
from fedmq.fedcore.tensors import StateDict

# -- the spec's unit-test vector (kdia.md 1.3): N=4, K=2, t=2; S_0={A,B}, S_1={B,D}, S_2={A,D} ----

NODES = ("A", "B", "C", "D")
SIZES = {"A": 100, "B": 200, "C": 300, "D": 50}
SCHEDULE = (("A", "B"), ("B", "D"), ("A", "D"))
LAST_ROUND = np.array([2, 1, -1, 2])
COUNT = np.array([2, 2, 0, 2])
NUM_SAMPLES = np.array([100, 200, 300, 50])
TABLE = {  # F^intv, F^part, F^num, F (GM), F (AM)
    "intv": [0.413622, 0.152163, 0.020593, 0.413622],
    "part": [1 / 3, 1 / 3, 0.0, 1 / 3],
    "num": [0.153846, 0.307692, 0.461538, 0.076923],
    "gm": [0.370855, 0.334798, 0.0, 0.294348],
    "am": [0.300267, 0.264396, 0.160710, 0.274626],
}


def spec_record(*, size_of_c: bool = False) -> ParticipationRecord:
    """The vector's record, driven as the coordinator drives it: C is selected in round 0 but never delivers."""
    record = ParticipationRecord()
    for t, accepted in enumerate(SCHEDULE):
        selected = (*accepted, "C") if t == 0 else accepted
        record.selected(selected, t)
        for node in accepted:
            record.accepted(node, t, num_samples=SIZES[node])
        if t == 0:
            record.lost("C")
    if size_of_c:
        record.ensure("C", num_samples=SIZES["C"])
    return record


def test_spec_vector_factors_match_table() -> None:
    """F^intv, F^part and F^num of Eq. 5, 7, 8 reproduce the spec's columns to 1e-6 (C has F^part exactly 0)."""
    log_intv, log_part, log_num = log_factors(2, LAST_ROUND, COUNT, NUM_SAMPLES)
    np.testing.assert_allclose(np.exp(log_intv), TABLE["intv"], atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.exp(log_part), TABLE["part"], atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.exp(log_num), TABLE["num"], atol=1e-6, rtol=0)
    assert np.exp(log_part)[2] == 0.0


@pytest.mark.parametrize("weighting", ["gm", "am", "intv", "part", "num"])
@pytest.mark.parametrize("literal", [False, True])
def test_spec_vector_weights_match_table(weighting: str, literal: bool) -> None:
    """Every weighting (GM closed form and literal, AM, each factor alone) equals its table column to 1e-6, normalised."""
    log_w = log_teacher_weights(2, LAST_ROUND, COUNT, NUM_SAMPLES, weighting, literal=literal)
    np.testing.assert_allclose(np.exp(log_w), TABLE[weighting], atol=1e-6, rtol=0)
    assert math.isclose(float(np.exp(log_w).sum()), 1.0, rel_tol=1e-12)
    if weighting in ("gm", "part"):
        assert log_w[2] == -math.inf  # never participated: weight exactly 0


def test_spec_vector_from_participation_record_gives_gm_column_and_zero_for_unseen() -> None:
    """weights_from_record on the coordinator-driven record: (t_k, n_k) as in the table, GM column, C exactly 0."""
    weights = weights_from_record(spec_record(), 2)
    assert weights.node_ids == NODES
    np.testing.assert_array_equal(weights.last_round, LAST_ROUND)
    np.testing.assert_array_equal(weights.count, COUNT)
    np.testing.assert_allclose(weights.weights, TABLE["gm"], atol=1e-6, rtol=0)
    assert weights.weights[2] == 0.0
    # C never delivered, so the record has no size for it: the mean of the known sizes stands in
    assert weights.num_samples[2] == pytest.approx((100 + 200 + 50) / 3)


def test_spec_vector_from_record_with_known_size_of_unseen_node_gives_am_column() -> None:
    """With C's size 300 in the record the AM ablation (where C's size matters) reproduces its column."""
    record = spec_record(size_of_c=True)
    np.testing.assert_allclose(weights_from_record(record, 2, "am").weights, TABLE["am"], atol=1e-6, rtol=0)
    np.testing.assert_allclose(weights_from_record(record, 2, "num").weights, TABLE["num"], atol=1e-6, rtol=0)
    assert weights_from_record(record, 2, "gm").weights[2] == 0.0


def test_virtual_unseen_nodes_take_weight_only_under_am() -> None:
    """num_nodes pads never-seen nodes: 0 weight under GM, positive under AM; records() leaves them out."""
    record = spec_record()
    gm = weights_from_record(record, 2, num_nodes=6)
    am = weights_from_record(record, 2, "am", num_nodes=6)
    assert len(gm.node_ids) == 6 and gm.virtual == 2
    assert np.all(gm.weights[4:] == 0.0) and np.all(am.weights[4:] > 0.0)
    np.testing.assert_allclose(gm.weights[:4], TABLE["gm"], atol=1e-6, rtol=0)
    assert [r["node_id"] for r in gm.records("gm")] == list(NODES)


def _random_record_arrays(rng: np.random.Generator, nodes: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    t = int(rng.integers(0, 200))
    last_round = rng.integers(-1, t + 1, size=nodes)
    count = np.array([0 if r < 0 else int(rng.integers(1, r + 2)) for r in last_round])
    sizes = rng.integers(1, 5000, size=nodes)
    return t, last_round, count, sizes


@pytest.mark.parametrize("seed", range(5))
def test_closed_form_gm_equals_literal_eq_5_to_9(seed: int) -> None:
    """softmax((t_k - t)/3 + (log n_k + log N_k)/3) equals the literal normalised geometric mean of the factors."""
    rng = np.random.default_rng(seed)
    t, last_round, count, sizes = _random_record_arrays(rng, 60)
    closed = log_teacher_weights(t, last_round, count, sizes, "gm")
    literal = log_teacher_weights(t, last_round, count, sizes, "gm", literal=True)
    np.testing.assert_array_equal(np.isneginf(closed), count == 0)
    np.testing.assert_array_equal(np.isneginf(literal), count == 0)
    np.testing.assert_allclose(np.exp(closed), np.exp(literal), rtol=1e-10, atol=1e-15)
    # and the literal formula itself, straight from Eq. 5-9 in float64
    f_intv = np.exp(-(t - last_round.astype(float)))
    f_intv /= f_intv.sum()
    tri = (f_intv * (count / count.sum()) * (sizes / sizes.sum())) ** (1 / 3)
    np.testing.assert_allclose(np.exp(closed), tri / tri.sum(), rtol=1e-9, atol=1e-15)


def test_unknown_weighting_raises_value_error() -> None:
    with pytest.raises(ValueError, match="weighting"):
        log_teacher_weights(2, LAST_ROUND, COUNT, NUM_SAMPLES, "hm")


# -- robustness of the weights -------------------------------------------------------------------


def test_never_seen_node_weighs_exactly_zero_under_gm() -> None:
    """A node that was only selected (never accepted) gets weight 0.0 exactly, whatever its data size."""
    record = ParticipationRecord()
    record.selected(["a", "b", "ghost"], 0)
    record.accepted("a", 0, num_samples=10)
    record.accepted("b", 0, num_samples=20)
    record.ensure("ghost", num_samples=10**9)
    weights = weights_from_record(record, 0)
    index = weights.index()
    assert weights.weights[index["ghost"]] == 0.0
    assert weights.log_weights[index["ghost"]] == -math.inf
    assert weights.weights.sum() == pytest.approx(1.0)


def test_lost_update_keeps_previous_participation_and_weight_relation() -> None:
    """Selected in round 1 but its update lost: b keeps (t_k, n_k) = (0, 1), weighing as if never selected."""
    lost, unselected = ParticipationRecord(), ParticipationRecord()
    for record in (lost, unselected):
        record.selected(["a", "b"], 0)
        record.accepted("a", 0, num_samples=100)
        record.accepted("b", 0, num_samples=200)
    lost.selected(["a", "b"], 1)
    lost.accepted("a", 1, num_samples=100)
    lost.lost("b")
    unselected.selected(["a"], 1)
    unselected.accepted("a", 1, num_samples=100)

    entry = lost.get("b")
    assert entry is not None and (entry.last_round, entry.count, entry.rounds_selected, entry.lost) == (0, 1, 2, 1)
    w_lost, w_unselected = weights_from_record(lost, 1), weights_from_record(unselected, 1)
    np.testing.assert_array_equal(w_lost.last_round, [1, 0])
    np.testing.assert_array_equal(w_lost.count, [2, 1])
    np.testing.assert_array_equal(w_lost.log_weights, w_unselected.log_weights)
    # w_b / w_a = e^((0 - 1)/3) (1 x 200)^(1/3) / (2 x 100)^(1/3) = e^(-1/3)
    assert w_lost.weights[1] / w_lost.weights[0] == pytest.approx(math.exp(-1 / 3), rel=1e-12)


@pytest.mark.parametrize("weighting", ["gm", "am", "intv", "part", "num"])
def test_ten_thousand_rounds_of_staleness_give_finite_weights(weighting: str) -> None:
    """At t = 10,000 with nodes idle since round 0: no NaN, no inf, weights sum to 1, current participants > 0."""
    t = 10_000
    last_round = np.array([0, 3, t, t, 9_990, -1])
    count = np.array([1, 4, 7, 1, 2, 0])
    sizes = np.array([100, 50, 200, 10, 30, 70])
    for literal in (False, True):
        log_w = log_teacher_weights(t, last_round, count, sizes, weighting, literal=literal)
        w = np.exp(log_w)
        assert not np.any(np.isnan(log_w)) and not np.any(np.isposinf(log_w))
        assert np.all(np.isfinite(w))
        assert w.sum() == pytest.approx(1.0, abs=1e-12)
        if weighting in ("gm", "intv", "am"):
            assert w[2] > 0 and w[3] > 0
        if weighting in ("gm", "intv"):
            assert w[2] > w[4] > w[0]  # recency still orders the weights
        if weighting == "gm":
            assert w[5] == 0.0


def test_all_nodes_stale_for_ten_thousand_rounds_still_normalise() -> None:
    """Nobody accepted for 10,000 rounds: every naive exp(-(t - t_k)) underflows, the log-space weights do not."""
    t = 10_000
    last_round, count, sizes = np.array([0, 1, 2]), np.array([1, 1, 1]), np.array([10, 10, 10])
    naive = np.exp(-(t - last_round.astype(float)))
    assert np.all(naive == 0.0)  # the failure the log space avoids
    for weighting in ("gm", "am", "intv"):
        w = np.exp(log_teacher_weights(t, last_round, count, sizes, weighting))
        assert np.all(np.isfinite(w)) and np.all(w > 0) and w.sum() == pytest.approx(1.0)
        assert w[2] > w[1] > w[0]


def test_record_and_teachers_after_ten_thousand_rounds_are_finite() -> None:
    """A record spanning 10,000 rounds, through weights_from_record and every teacher mode: finite teachers."""
    record = ParticipationRecord()
    record.accepted("old", 0, num_samples=100)
    initial = {"w": torch.zeros(2)}
    old_state, new_state = {"w": torch.full((2,), 5.0)}, {"w": torch.full((2,), 1.0)}
    teachers = {
        "exact": make_teacher("exact", initial, MemoryStore()),
        "incremental": make_teacher("incremental", initial, MemoryStore(), resync_every=0),
        "streaming": make_teacher("streaming", initial, None),
    }
    first = uploads_from_record(record, 0, [("old", old_state)])
    for teacher in teachers.values():
        teacher.step(weights_from_record(record, 0), first)
    t = 10_000
    record.accepted("new", t, num_samples=100)
    weights = weights_from_record(record, t)
    assert np.all(np.isfinite(weights.weights)) and weights.weights[weights.index()["new"]] > 0
    assert weights.weights.sum() == pytest.approx(1.0)
    uploads = uploads_from_record(record, t, [("new", new_state)])
    for name, teacher in teachers.items():
        step = teacher.step(weights, uploads)
        assert torch.isfinite(step.state["w"]).all(), name
        torch.testing.assert_close(step.state["w"], new_state["w"], rtol=0, atol=1e-6, msg=name)


# -- TeacherWeights.records and uploads_from_record ---------------------------------------------


def test_records_report_weight_and_participation_of_every_known_node() -> None:
    """records(): one dict per known node with round, id, weight, (t_k, n_k, N_k) and the three factors."""
    record = spec_record(size_of_c=True)
    weights = weights_from_record(record, 2)
    rows = weights.records("gm")
    assert [row["node_id"] for row in rows] == list(NODES)
    for i, row in enumerate(rows):
        entry = record.get(row["node_id"])
        assert entry is not None
        assert row["round"] == 2 and row["weighting"] == "gm"
        assert (row["last_round"], row["count"], row["num_samples"]) == (
            entry.last_round,
            entry.count,
            entry.num_samples,
        )
        assert row["weight"] == pytest.approx(TABLE["gm"][i], abs=1e-6)
        assert row["f_intv"] == pytest.approx(TABLE["intv"][i], abs=1e-6)
        assert row["f_part"] == pytest.approx(TABLE["part"][i], abs=1e-6)
        assert row["f_num"] == pytest.approx(TABLE["num"][i], abs=1e-6)
        assert all(type(row[k]) is int for k in ("round", "last_round", "count", "num_samples"))
        assert all(type(row[k]) is float for k in ("weight", "f_intv", "f_part", "f_num"))


def test_uploads_from_record_recover_previous_participation() -> None:
    """Each upload carries the node's (t_k, n_k) before this round's acceptance; first uploads carry (-1, 0)."""
    record = ParticipationRecord()
    for t, nodes in enumerate([["a"], ["b"], [], ["a"], [], [], [], ["a", "b", "c"]]):
        record.selected(nodes, t)
        for node in nodes:
            record.accepted(node, t, num_samples=10)
    state = {"w": torch.zeros(1)}
    uploads = uploads_from_record(record, 7, [("a", state), ("b", state), ("c", state)])
    assert [(u.node_id, u.previous_round, u.previous_count) for u in uploads] == [
        ("a", 3, 2),
        ("b", 1, 1),
        ("c", -1, 0),
    ]
    assert uploads[0].state is state


def test_uploads_from_record_refuse_node_not_accepted_this_round() -> None:
    record = ParticipationRecord()
    record.accepted("a", 0, num_samples=10)
    record.selected(["a", "b"], 1)
    record.lost("a")
    with pytest.raises(ValueError, match="no accepted participation"):
        uploads_from_record(record, 1, [("a", {"w": torch.zeros(1)})])
    with pytest.raises(ValueError, match="no accepted participation"):
        uploads_from_record(record, 1, [("b", {"w": torch.zeros(1)})])


# -- model stores -------------------------------------------------------------------------------


def _state(value: float) -> StateDict:
    return {"w": torch.full((2, 3), value), "n": torch.tensor(int(value), dtype=torch.int64)}


def _same(a: StateDict | None, b: StateDict) -> bool:
    return a is not None and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_store_put_get_discard_rounds(kind: str, tmp_path: Path) -> None:
    """put overwrites and records the round, get returns a copy's content, discard forgets, unknown is None."""
    store = MemoryStore() if kind == "memory" else DiskStore(tmp_path / "store")
    store.begin_round(-1)
    original = _state(1.0)
    store.put("a", 0, original)
    store.put("b", 0, _state(2.0))
    original["w"].fill_(99.0)  # the store holds its own copy
    assert _same(store.get("a"), _state(1.0))
    assert store.rounds() == {"a": 0, "b": 0} and len(store) == 2 and "a" in store
    store.begin_round(0)
    store.put("a", 1, _state(3.0))
    assert _same(store.get("a"), _state(3.0)) and store.rounds() == {"a": 1, "b": 0}
    store.discard("b")
    store.discard("never")
    assert store.get("b") is None and store.get("never") is None and "b" not in store
    assert store.rounds() == {"a": 1}


def test_memory_store_state_dict_round_trip() -> None:
    """A MemoryStore rebuilt from state_dict holds the same models and rounds, as independent copies."""
    store = MemoryStore()
    store.put("node-1", 3, {"layer/w": torch.randn(2, 2), "n": torch.tensor(4)})
    store.put("node-2", 5, {"layer/w": torch.randn(2, 2), "n": torch.tensor(7)})
    state = store.state_dict()
    restored = MemoryStore()
    restored.load_state_dict(state, last_committed=5)
    assert restored.rounds() == {"node-1": 3, "node-2": 5}
    for node in ("node-1", "node-2"):
        assert _same(restored.get(node), store.get(node))  # type: ignore[arg-type]
    state["node-1/layer/w"].fill_(0.0)
    assert not torch.equal(restored.get("node-1")["layer/w"], state["node-1/layer/w"])  # type: ignore[index]


def _files(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def _disk_store(directory: Path, **models: tuple[int, float]) -> DiskStore:
    """A new DiskStore in `directory` at its first round, holding each ``node=(round, value)`` as
    `_state(value)` put at that round."""
    store = DiskStore(directory)
    store.begin_round(-1)
    for node, (round, value) in models.items():
        store.put(node, round, _state(value))
    return store


def test_disk_store_rolls_back_writes_newer_than_last_checkpoint(tmp_path: Path) -> None:
    """Round 0 is checkpointed, round 1 replaces a (twice), adds c, then crashes: resume restores round 0 exactly."""
    directory = tmp_path / "store"
    store = _disk_store(directory, a=(0, 1.0), b=(0, 2.0))
    store.begin_round(0)  # round 0 checkpointed
    assert _files(directory) == ["a.safetensors", "b.safetensors"]
    store.put("a", 1, _state(5.0))
    store.put("a", 1, _state(6.0))  # a second write keeps the checkpointed predecessor
    store.put("c", 1, _state(7.0))
    assert _files(directory) == ["a.prev.safetensors", "a.safetensors", "b.safetensors", "c.safetensors"]
    assert _same(load_safetensors(directory / "a.prev.safetensors")[0], _state(1.0))

    resumed = DiskStore(directory)  # the crash: a new process resumes from the round-0 checkpoint
    resumed.load_state_dict({}, last_committed=0)
    assert resumed.rounds() == {"a": 0, "b": 0}
    assert _same(resumed.get("a"), _state(1.0)) and _same(resumed.get("b"), _state(2.0))
    assert resumed.get("c") is None
    assert _files(directory) == ["a.safetensors", "b.safetensors"]


def test_disk_store_begin_round_clears_previous_versions(tmp_path: Path) -> None:
    """Once round 1 is checkpointed, begin_round drops the .prev files and the round-1 models stay."""
    directory = tmp_path / "store"
    store = _disk_store(directory, a=(0, 1.0))
    store.begin_round(0)
    store.put("a", 1, _state(5.0))
    assert (directory / "a.prev.safetensors").exists()
    store.begin_round(1)
    assert _files(directory) == ["a.safetensors"]
    assert _same(store.get("a"), _state(5.0)) and store.rounds() == {"a": 1}
    resumed = DiskStore(directory)
    resumed.load_state_dict({}, last_committed=1)
    assert _same(resumed.get("a"), _state(5.0))


def test_disk_store_fresh_run_empties_directory(tmp_path: Path) -> None:
    """A store that was not resumed starts empty at its first round, whatever an earlier run left."""
    directory = tmp_path / "store"
    _disk_store(directory, a=(0, 1.0), b=(3, 2.0))  # what an earlier run left
    fresh = DiskStore(directory)
    fresh.begin_round(-1)
    assert fresh.rounds() == {} and _files(directory) == []


def _codec_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 4, generator=gen),
        "f16": torch.randn(5, generator=gen).half(),
        "bf16": torch.randn(2, 3, generator=gen).to(torch.bfloat16),
        "i64": torch.tensor([-(2**40), 0, 7, 2**62], dtype=torch.int64),
        "bool": torch.tensor([[True, False], [False, True]]),
        "scalar_f32": torch.tensor(3.25),
        "scalar_i64": torch.tensor(-9, dtype=torch.int64),
        "scalar_bool": torch.tensor(True),
        "empty_f32": torch.empty(0, 3),
        "empty_i64": torch.empty(0, dtype=torch.int64),
        "transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # not contiguous
    }


def test_safetensors_round_trip_preserves_dtype_shape_and_values(tmp_path: Path) -> None:
    """float32/16, bfloat16, int64, bool, 0-d, empty and non-contiguous tensors and the metadata survive."""
    tensors = _codec_tensors()
    path = tmp_path / "x.safetensors"
    save_safetensors(path, tensors, {"round": "4", "node_id": "n"})
    loaded, metadata = load_safetensors(path)
    assert metadata == {"round": "4", "node_id": "n"}
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name], tensor), name
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]  # no temporary file left


def test_safetensors_files_are_readable_by_the_reference_implementation(tmp_path: Path) -> None:
    """The hand-written writer produces files the safetensors package reads, and reads the package's files."""
    st = pytest.importorskip("safetensors.torch")
    tensors = {k: v.contiguous() for k, v in _codec_tensors().items()}
    ours = tmp_path / "ours.safetensors"
    save_safetensors(ours, tensors, {"round": "1"})
    theirs = st.load_file(str(ours))
    assert all(torch.equal(theirs[k], v) and theirs[k].dtype == v.dtype for k, v in tensors.items())
    reference = tmp_path / "theirs.safetensors"
    st.save_file(tensors, str(reference), metadata={"round": "2"})
    loaded, metadata = load_safetensors(reference)
    assert metadata == {"round": "2"}
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in tensors.items())


# -- teacher modes over simulated rounds --------------------------------------------------------

NUM_NODES, PER_ROUND, ROUNDS = 40, 4, 30


@dataclass
class SimRound:
    weights: TeacherWeights
    uploads: list[Upload]
    models: dict[str, StateDict]
    """Every node's last accepted model after this round (the exact teacher's theta_k)."""


def initial_state() -> StateDict:
    gen = torch.Generator().manual_seed(1234)
    return {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(3, generator=gen), "n": torch.tensor(0)}


def simulate(seed: int = 0, rounds: int = ROUNDS, lose: float = 0.25, random_ints: bool = False) -> list[SimRound]:
    """Rounds as the coordinator drives the record: PER_ROUND of NUM_NODES selected by a seeded RNG, some updates
    lost; every delivered model is fresh random tensors. `n` is the round (monotone, like num_batches_tracked)
    or, with `random_ints`, a random integer."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    ids = [f"node-{i:03d}" for i in range(NUM_NODES)]
    sizes = {node: int(rng.integers(10, 600)) for node in ids}
    record = ParticipationRecord()
    models: dict[str, StateDict] = {}
    out = []
    for t in range(rounds):
        selected = [ids[j] for j in sorted(rng.choice(NUM_NODES, PER_ROUND, replace=False))]
        record.selected(selected, t)
        delivered = []
        for node in selected:
            if t > 0 and rng.random() < lose:
                record.lost(node)
                continue
            record.accepted(node, t, num_samples=sizes[node])
            n = int(rng.integers(0, 1000)) if random_ints else t
            state = {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(3, generator=gen), "n": torch.tensor(n)}
            delivered.append((node, state))
        models = {**models, **dict(delivered)}
        out.append(SimRound(weights_from_record(record, t), uploads_from_record(record, t, delivered), models))
    return out


def exact_reference(weights: TeacherWeights, models: dict[str, StateDict], initial: StateDict) -> StateDict:
    """Eq. 10 by hand in float64: theta_T = sum_k F_k theta_k over every node's last accepted model."""
    w = weights.weights
    if not np.any(w > 0):
        return {k: v.double() for k, v in initial.items()}
    out: StateDict = {}
    for key in ("w", "b"):
        total = torch.zeros(initial[key].shape, dtype=torch.float64)
        for i, node in enumerate(weights.node_ids):
            if w[i] > 0:
                total += float(w[i]) * models[node][key].double()
        out[key] = total
    assert sum(float(w[i]) for i, node in enumerate(weights.node_ids) if node in models) == pytest.approx(1.0)
    return out


def spread(rounds: list[SimRound], initial: StateDict) -> float:
    """max_ij |theta_i - theta_j|_inf over every model ever uploaded and the initial one (floating tensors)."""
    result = 0.0
    for key in ("w", "b"):
        stacked = torch.stack([initial[key]] + [u.state[key] for r in rounds for u in r.uploads])
        result = max(result, float((stacked.amax(0) - stacked.amin(0)).max()))
    return result


def max_diff(a: StateDict, b: StateDict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in ("w", "b"))


def run(teacher: Teacher, rounds: list[SimRound]) -> list[TeacherStep]:
    return [teacher.step(r.weights, r.uploads) for r in rounds]


def test_simulation_exercises_lost_updates_and_re_participation() -> None:
    """The scenario is what the checks need: lost updates, nodes coming back, nodes never seen."""
    rounds = simulate()
    last = rounds[-1].weights
    assert sum(len(r.uploads) for r in rounds) < ROUNDS * PER_ROUND  # some selected nodes did not deliver
    assert any(u.previous_round >= 0 for r in rounds for u in r.uploads)
    assert np.any(last.count == 0) or len(last.node_ids) < NUM_NODES
    assert np.any(last.count >= 2)


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_exact_teacher_equals_hand_written_eq_10(store: str, tmp_path: Path) -> None:
    """Every round, the exact teacher is sum_k F_k theta_k over every stored model (float64 reference, 1e-6)."""
    rounds, initial = simulate(), initial_state()
    model_store = MemoryStore() if store == "memory" else DiskStore(tmp_path / "store")
    teacher = make_teacher("exact", initial, model_store)
    assert isinstance(teacher, StoreTeacher)
    for t, r in enumerate(rounds):
        model_store.begin_round(t - 1)
        step = teacher.step(r.weights, r.uploads)
        reference = exact_reference(r.weights, r.models, initial)
        assert max_diff(step.state, reference) < 1e-6, t
        assert step.error_share == 0.0
        assert step.models_held == len(r.models) == len(model_store)
        assert step.state["w"].dtype == torch.float32 and step.state["n"].dtype == torch.int64
        # integer buffer: the max over the contributing models
        assert int(step.state["n"]) == max(int(m["n"]) for m in r.models.values())


@pytest.mark.parametrize("resync_every", [0, 1, 7])
def test_incremental_teacher_equals_exact(resync_every: int) -> None:
    """The incremental running sums (reading only the replaced models) equal the exact teacher to 1e-6."""
    rounds, initial = simulate(seed=1), initial_state()
    exact = run(make_teacher("exact", initial, MemoryStore()), rounds)
    store = MemoryStore()
    teacher = make_teacher("incremental", initial, store, resync_every=resync_every)
    assert isinstance(teacher, StreamingTeacher)
    for t, (r, step, reference) in enumerate(zip(rounds, run(teacher, rounds), exact, strict=True)):
        assert max_diff(step.state, reference.state) < 1e-6, t
        assert max_diff(step.state, exact_reference(r.weights, r.models, initial)) < 1e-6, t
        assert step.error_share == 0.0 and step.models_held == len(r.models)
        assert torch.equal(step.state["n"], reference.state["n"])
    assert len(store) == len(rounds[-1].models)


@pytest.mark.parametrize(("window", "min_share"), [(1, 0.0), (3, 0.0), (0, 0.03), (4, 0.01)])
def test_windowed_teacher_within_its_error_bound(window: int, min_share: float) -> None:
    """|theta_win - theta_exact|_inf <= error_share x max_ij |theta_i - theta_j|_inf every round; some mass dropped."""
    rounds, initial = simulate(seed=2), initial_state()
    bound_range = spread(rounds, initial)
    store = MemoryStore()
    teacher = make_teacher("windowed", initial, store, window_rounds=window, min_share=min_share)
    shares = []
    for t, r in enumerate(rounds):
        step = teacher.step(r.weights, r.uploads)
        reference = exact_reference(r.weights, r.models, initial)
        assert 0.0 <= step.error_share < 1.0
        assert max_diff(step.state, reference) <= step.error_share * bound_range + 1e-6, t
        shares.append(step.error_share)
        held = store.rounds()
        assert step.models_held == len(held)
        if window > 0:
            assert all(t - held_round <= window for held_round in held.values()), t
            assert len(held) <= (window + 1) * PER_ROUND
        current = {u.node_id for u in r.uploads}
        assert current <= held.keys()  # this round's models are never dropped
        if min_share > 0:
            index = r.weights.index()
            assert all(r.weights.weights[index[n]] >= min_share for n in held.keys() - current)
        # the dropped share is exactly the exact weight of the nodes whose models are gone
        gone = sum(
            float(r.weights.weights[i]) for i, n in enumerate(r.weights.node_ids) if n in r.models and n not in held
        )
        assert step.error_share == pytest.approx(gone, abs=1e-12)
    assert max(shares) > 0.0
    assert len(store) < len(rounds[-1].models)


def test_windowed_teacher_with_large_window_equals_exact() -> None:
    """A window longer than the run drops nothing: the windowed teacher is the exact one."""
    rounds, initial = simulate(seed=3), initial_state()
    exact = run(make_teacher("exact", initial, MemoryStore()), rounds)
    windowed = run(make_teacher("windowed", initial, MemoryStore(), window_rounds=ROUNDS + 1), rounds)
    for a, b in zip(exact, windowed, strict=True):
        assert b.error_share == 0.0 and a.models_held == b.models_held
        assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)


def test_streaming_teacher_within_its_error_bound() -> None:
    """|theta_stream - theta_exact|_inf <= error_share x range over every model ever uploaded; error_share > 0."""
    rounds, initial = simulate(seed=4), initial_state()
    bound_range = spread(rounds, initial)
    teacher = make_teacher("streaming", initial, None)
    shares = []
    for t, (r, step) in enumerate(zip(rounds, run(teacher, rounds), strict=True)):
        reference = exact_reference(r.weights, r.models, initial)
        assert 0.0 <= step.error_share < 1.0 and step.models_held == 0
        assert max_diff(step.state, reference) <= step.error_share * bound_range + 1e-6, t
        if step.error_share == 0.0:
            assert max_diff(step.state, reference) < 1e-6
        shares.append(step.error_share)
    assert shares[0] == 0.0 and max(shares) > 0.0
    # and the error is real, not only a loose bound: the stale contributions move the teacher
    assert max_diff(step.state, exact_reference(rounds[-1].weights, rounds[-1].models, initial)) > 1e-6


def test_streaming_error_share_is_stale_mass_fraction() -> None:
    """Two nodes, one re-participating: error_share is its decayed old mass over the total mass, by hand."""
    record = ParticipationRecord()
    initial = {"w": torch.zeros(1)}
    teacher = make_teacher("streaming", initial, None)
    record.accepted("a", 0, num_samples=8)
    record.accepted("b", 0, num_samples=8)
    teacher.step(
        weights_from_record(record, 0),
        uploads_from_record(record, 0, [("a", {"w": torch.ones(1)}), ("b", {"w": torch.zeros(1)})]),
    )
    record.accepted("a", 1, num_samples=8)
    step = teacher.step(
        weights_from_record(record, 1), uploads_from_record(record, 1, [("a", {"w": torch.full((1,), 3.0)})])
    )
    # masses at t=1: stale a_old = e^(-1/3) 8^(1/3) = 2 e^(-1/3), b = 2 e^(-1/3), a_new = 16^(1/3)
    stale, b, new = 2 * math.exp(-1 / 3), 2 * math.exp(-1 / 3), 16 ** (1 / 3)
    assert step.error_share == pytest.approx(stale / (stale + b + new), rel=1e-12)
    assert float(step.state["w"]) == pytest.approx((stale * 1.0 + 3.0 * new) / (stale + b + new), rel=1e-6)


def test_integer_buffers_take_max_over_contributing_models() -> None:
    """Integer buffers are never averaged: the exact teacher takes the max over the stored models, the windowed
    one over the models it kept."""
    rounds, initial = simulate(seed=5, random_ints=True), initial_state()
    exact = make_teacher("exact", initial, MemoryStore())
    store = MemoryStore()
    windowed = make_teacher("windowed", initial, store, window_rounds=2)
    for t, r in enumerate(rounds):
        expected = max(int(m["n"]) for m in r.models.values())
        assert int(exact.step(r.weights, r.uploads).state["n"]) == expected, t
        step = windowed.step(r.weights, r.uploads)
        kept = max(int(r.models[n]["n"]) for n in store.rounds())
        assert int(step.state["n"]) == kept, t
        assert step.state["n"].dtype == torch.int64


def test_am_weighting_gives_never_seen_nodes_the_initial_model() -> None:
    """Under the AM ablation never-seen nodes weigh > 0 and stand in with theta_g^0 (spec A10), also virtual ones."""
    rounds, initial = simulate(seed=7, rounds=8), initial_state()
    teacher = make_teacher("exact", initial, MemoryStore())
    for r in rounds:
        am = weights_from_record_like(r.weights, "am", extra_unseen=3)
        step = teacher.step(am, r.uploads)
        w = am.weights
        unseen = float(sum(w[i] for i, n in enumerate(am.node_ids) if n not in r.models))
        assert unseen > 0
        expected = {
            k: sum(float(w[i]) * r.models[n][k].double() for i, n in enumerate(am.node_ids) if n in r.models)
            + unseen * initial[k].double()
            for k in ("w", "b")
        }
        assert max_diff(step.state, expected) < 1e-6


def weights_from_record_like(weights: TeacherWeights, weighting: str, extra_unseen: int) -> TeacherWeights:
    """The same participation as `weights` under another weighting, padded with never-seen nodes."""
    virtual = extra_unseen
    last_round = np.concatenate([weights.last_round, np.full(virtual, -1)])
    count = np.concatenate([weights.count, np.zeros(virtual, dtype=np.int64)])
    sizes = np.concatenate([weights.num_samples, np.full(virtual, float(np.mean(weights.num_samples)))])
    ids = weights.node_ids + tuple(f"(unseen {i})" for i in range(virtual))
    log_w = log_teacher_weights(weights.round, last_round, count, sizes, weighting)
    return TeacherWeights(weights.round, ids, last_round, count, sizes, log_w, virtual)


def test_teacher_before_any_accepted_update_is_the_initial_model() -> None:
    """With no accepted update yet every mode returns theta_g^0 (the teacher used during round 0)."""
    initial = initial_state()
    record = ParticipationRecord()
    record.selected(["a"], 0)
    record.lost("a")
    weights = weights_from_record(record, 0)
    for mode, store in (("exact", MemoryStore()), ("incremental", MemoryStore()), ("streaming", None)):
        step = make_teacher(mode, initial, store).step(weights, [])
        assert all(torch.equal(step.state[k], initial[k]) for k in initial), mode


# -- make_teacher and state round trips ---------------------------------------------------------


def test_make_teacher_rejects_unknown_mode_and_missing_store() -> None:
    initial = initial_state()
    with pytest.raises(ValueError, match="teacher mode must be one of"):
        make_teacher("ema", initial, MemoryStore())
    for mode in ("exact", "windowed", "incremental"):
        with pytest.raises(ValueError, match="needs a model store"):
            make_teacher(mode, initial, None)
    assert isinstance(make_teacher("streaming", initial, None), StreamingTeacher)
    assert isinstance(make_teacher("windowed", initial, MemoryStore(), window_rounds=3), StoreTeacher)


def _resume_check(mode: str, split: int) -> None:
    rounds, initial = simulate(seed=6), initial_state()
    store = MemoryStore() if mode == "incremental" else None
    uninterrupted = make_teacher(mode, initial, store, resync_every=5)
    reference = run(uninterrupted, rounds)

    store = MemoryStore() if mode == "incremental" else None
    first = make_teacher(mode, initial, store, resync_every=5)
    run(first, rounds[:split])
    teacher_state = {k: v.clone() for k, v in first.state_dict().items()}
    store_state = {k: v.clone() for k, v in store.state_dict().items()} if store is not None else {}
    run(first, rounds[split : split + 2])  # the first process goes on, then dies; the checkpoint is unaffected

    restored_store = MemoryStore() if mode == "incremental" else None
    if restored_store is not None:
        restored_store.load_state_dict(store_state, last_committed=split - 1)
    restored = make_teacher(mode, initial, restored_store, resync_every=5)
    restored.load_state_dict(teacher_state)
    for t, step in enumerate(run(restored, rounds[split:]), start=split):
        assert step.error_share == reference[t].error_share
        assert all(torch.equal(step.state[k], reference[t].state[k]) for k in initial), t
    # the float64 running sums too, bit for bit (the resync schedule included)
    final, expected = restored.state_dict(), uninterrupted.state_dict()
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in final)


@pytest.mark.parametrize("mode", ["streaming", "incremental"])
def test_reloaded_teacher_continues_as_uninterrupted_one(mode: str) -> None:
    """A teacher (and its memory store) restored from state_dict after round 11 produces the same teachers."""
    _resume_check(mode, split=12)


def test_fresh_streaming_teacher_differs_from_resumed_one() -> None:
    """Without the loaded state the continuation differs (the round trip is not vacuous)."""
    rounds, initial = simulate(seed=6), initial_state()
    reference = run(make_teacher("streaming", initial, None), rounds)
    fresh = run(make_teacher("streaming", initial, None), rounds[12:])
    assert not torch.equal(fresh[0].state["w"], reference[12].state["w"])
    empty = make_teacher("streaming", initial, None)
    empty.load_state_dict({})  # nothing checkpointed yet: a no-op
    assert empty.state_dict()["last_round"] == -1
