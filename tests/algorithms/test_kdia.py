"""KDIA's two halves in-process: the KD loss in both directions, the node's generated labels, the
generator (shapes, parameter counts, diversity loss, ensemble), the teacher the coordinator builds
from the participation record, where the generator term's gradient goes, FedAvg when both terms
are off, the teacher modes across a checkpoint, determinism; hyperparameters and the default
checkpoint: test_contract.py. Data are synthetic."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm, kdia
from fedmq.fedcore.algorithms.base import Payload, RoundContext, TaskInput
from fedmq.fedcore.algorithms.kdia.generator import (
    FeatureGenerator,
    GeneratorStats,
    HeadEnsemble,
    build_generator,
    diversity_loss,
    fused_adam,
    train_generator,
)
from fedmq.fedcore.algorithms.kdia.teacher import weights_from_record
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.models import build_model
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.training import TrainSettings
from tests.algorithms.common import Federation, Scratch, context, same_state

SPEC = get_algorithm("kdia")
SMALL_GEN = {"gen_epochs": 1, "gen_batches_per_epoch": 4, "gen_batch_size": 8, "noise_dim": 4}


# -- the KD term ---------------------------------------------------------------------------------


def test_kd_loss_forward_and_reverse_match_hand_computed_kl() -> None:
    """Teacher (2 ln 3, 0) at tau = 2 gives P = (3/4, 1/4); student (0, 0) gives Q = (1/2, 1/2).
    forward = KL(P || Q) (the paper), reverse = KL(Q || P) (the authors' code); no tau^2 unless asked."""
    student = torch.zeros(3, 2)
    teacher = torch.tensor([[2 * math.log(3), 0.0]]).repeat(3, 1)
    forward = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    reverse = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert float(kdia.kd_loss(student, teacher, 2.0, "forward")) == pytest.approx(forward)
    assert float(kdia.kd_loss(student, teacher, 2.0, "reverse")) == pytest.approx(reverse)
    assert float(kdia.kd_loss(student, teacher, 2.0, "forward", tau2_scale=True)) == pytest.approx(4 * forward)
    assert forward != pytest.approx(reverse)
    assert float(kdia.kd_loss(teacher, teacher, 2.0, "reverse")) == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_kd_loss_gradient_reaches_the_student_only_and_pulls_it_towards_the_teacher(direction: str) -> None:
    student = torch.zeros(1, 2, requires_grad=True)
    teacher = torch.tensor([[1.0, 0.0]], requires_grad=True)
    kdia.kd_loss(student, teacher, 1.0, direction).backward()
    assert teacher.grad is None
    assert student.grad is not None and float(student.grad[0, 0]) < 0 < float(student.grad[0, 1])


# -- labels for generated features on the node ----------------------------------------------------


def test_small_node_draws_new_labels_for_every_epoch() -> None:
    """N_k <= B (spec A8): N_k E labels, a different slice per epoch."""
    labels = kdia.generated_labels(10, 64, 3, 100, torch_generator(0, "t"))
    assert labels.shape == (30,) and labels.dtype == torch.int64
    assert int(labels.min()) >= 0 and int(labels.max()) < 100
    assert not torch.equal(labels[:10], labels[10:20])


def test_large_node_reshuffles_one_pool_every_epoch() -> None:
    labels = kdia.generated_labels(100, 16, 3, 10, torch_generator(0, "t")).view(3, 100)
    assert all(torch.equal(labels[0].sort().values, labels[e].sort().values) for e in (1, 2))
    assert not torch.equal(labels[0], labels[1])


def test_batch_offsets_skip_the_trailing_batch_of_one_as_local_sgd_does() -> None:
    assert kdia.batch_offsets(10, 4) == [0, 4, 8]
    assert kdia.batch_offsets(9, 4) == [0, 4]
    assert kdia.batch_offsets(1, 4) == [0]


# -- the generator --------------------------------------------------------------------------------


@pytest.mark.parametrize(("classes", "params"), [(10, 890_724), (100, 1_084_944)])
def test_generator_for_moon_cnn_has_the_spec_shape_and_parameter_count(classes: int, params: int) -> None:
    model = build_model("moon-cnn", (3, 32, 32), classes, seed=0)
    gen = build_generator(100, model)
    assert sum(p.numel() for p in gen.parameters()) == params
    y = torch.arange(6) % classes
    with torch.no_grad():
        out = gen(torch.randn(6, 100, 1, 1), y)
    assert out.shape == (6, 16, 5, 5) and float(out.min()) > 0 and float(out.max()) < 1
    assert model.classify(out).shape == (6, classes)


def test_generator_for_a_vector_feature_model_gives_vectors() -> None:
    model = build_model("mlp", (4,), 3, seed=0, hidden=[8])
    gen = build_generator(5, model)
    with torch.no_grad():
        assert gen(torch.randn(4, 5), torch.tensor([0, 1, 2, 0])).shape == (4, *model.feature_shape)


def test_diversity_loss_matches_the_code_formula() -> None:
    """Halves z1 = 0, z2 = 2 (mean |dz| = 2); G1 = 0, G2 = 1 (mean |dG| = 1): 1 / (1/2 + eps)."""
    z = torch.cat([torch.zeros(2, 3), torch.full((2, 3), 2.0)])
    g = torch.cat([torch.zeros(2, 4), torch.ones(2, 4)])
    assert float(diversity_loss(z, g)) == pytest.approx(1 / (0.5 + 1e-5))
    with pytest.raises(ValueError):
        diversity_loss(z[:1], g[:1])


def test_batched_head_ensemble_equals_the_loop_and_weights_logits() -> None:
    """sum_k p_k h_k(features), without the paper's 1/K (A2); batched (vmap) = loop."""
    model = build_model("moon-cnn", (3, 32, 32), 10, seed=0)
    states = [build_model("moon-cnn", (3, 32, 32), 10, seed=s).state_dict() for s in (1, 2)]
    features = torch.rand(5, 16, 5, 5)
    cpu = torch.device("cpu")
    batched = HeadEnsemble(model, states, [1.0, 3.0], cpu)(features)
    looped = HeadEnsemble(model, states, [1.0, 3.0], cpu, batched=False)(features)
    by_hand = 0.25 * _classify(model, states[0], features) + 0.75 * _classify(model, states[1], features)
    torch.testing.assert_close(batched, looped, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched, by_hand, rtol=1e-5, atol=1e-5)


def _classify(model: torch.nn.Module, state: dict[str, torch.Tensor], features: torch.Tensor) -> torch.Tensor:
    model.load_state_dict(state)
    with torch.no_grad():
        return model.classify(features)


def test_generator_training_lowers_the_ensemble_loss_and_is_reproducible() -> None:
    model = build_model("mlp", (4,), 3, seed=0, hidden=[8])
    # a decisive head (its features are the 8 hidden units): a generator can learn features it classifies
    ensemble = HeadEnsemble(model, [{k: 20 * v for k, v in model.state_dict().items()}], [1.0], torch.device("cpu"))

    def train(gen: FeatureGenerator, seed: int, epochs: int) -> float:
        stats, _ = train_generator(
            gen, ensemble, epochs=epochs, batches_per_epoch=10, batch_size=16, lr=1e-2, weight_decay=0.0,
            rng=torch_generator(seed, "gen", epochs), device=torch.device("cpu"),
        )  # fmt: skip
        return stats.ce

    def fresh() -> FeatureGenerator:
        gen = build_generator(6, model)
        gen.reset_parameters(torch_generator(0, "init"))
        return gen

    a, b = fresh(), fresh()
    first = train(a, 0, 1)
    assert train(b, 0, 1) == first and same_state(a.state_dict(), b.state_dict())
    assert train(a, 0, 10) < 0.8 * first  # ten more epochs: the head classifies its features better


def _loop_by_hand(
    gen: FeatureGenerator,
    ensemble: HeadEnsemble,
    epochs: int,
    rng: torch.Generator,
    state: dict | None,
    *,
    fused: bool = True,
) -> tuple[float, dict]:
    """The round's loop as kdia.md 1.6 writes it, each step drawing its labels and noise as it goes
    (with torch's fused Adam, as KDIA trains it on a CPU, or its default form)."""
    optimizer = torch.optim.Adam(gen.parameters(), lr=1e-2, weight_decay=1e-4, fused=fused)
    if state is not None:
        optimizer.load_state_dict(state)
    pool = torch.randint(0, gen.num_classes, (5 * 16,), generator=rng)
    ce_sum = 0.0
    for _ in range(epochs):
        pool = pool[torch.randperm(len(pool), generator=rng)]
        for b in range(5):
            y = pool[b * 16 : (b + 1) * 16]
            z = torch.randn(16, gen.noise_dim, 1, 1, generator=rng)
            features = gen(z, y)
            ce = F.cross_entropy(ensemble(features), y)
            optimizer.zero_grad(set_to_none=True)
            (ce + diversity_loss(z, features)).backward()
            optimizer.step()
            ce_sum += float(ce.detach())
    return ce_sum / (epochs * 5), optimizer.state_dict()


@dataclass
class _Round:
    """One round of `train_generator` beside `_loop_by_hand`'s, from the same generator and draws."""

    stats: GeneratorStats
    ce_by_hand: float
    ours: dict[str, torch.Tensor]
    theirs: dict[str, torch.Tensor]
    optimizer: dict
    optimizer_by_hand: dict


def _two_rounds_against_the_loop_by_hand(*, fused_by_hand: bool) -> list[_Round]:
    """Two rounds of ten steps each way, the second from the first's Adam state (gen_keep_optimizer)."""
    model = build_model("mlp", (4,), 3, seed=0, hidden=[8])
    ensemble = HeadEnsemble(model, [model.state_dict()], [1.0], torch.device("cpu"))
    ours, theirs = build_generator(6, model), build_generator(6, model)
    ours.reset_parameters(torch_generator(0, "init"))
    theirs.reset_parameters(torch_generator(0, "init"))
    mine: dict | None = None
    state: dict | None = None
    rounds = []
    for round_ in (1, 2):
        stats, mine = train_generator(
            ours, ensemble, epochs=2, batches_per_epoch=5, batch_size=16, lr=1e-2, weight_decay=1e-4,
            rng=torch_generator(0, "gen", round_), device=torch.device("cpu"), optimizer_state=mine,
        )  # fmt: skip
        ce, state = _loop_by_hand(theirs, ensemble, 2, torch_generator(0, "gen", round_), state, fused=fused_by_hand)
        snapshot = {k: v.clone() for k, v in ours.state_dict().items()}
        rounds.append(_Round(stats, ce, snapshot, {k: v.clone() for k, v in theirs.state_dict().items()}, mine, state))
    return rounds


def test_generator_training_with_its_draws_made_first_is_the_loop_drawing_as_it_goes() -> None:
    """Every label and noise drawn before the first step (so that the steps wait for no host copy)
    gives, bit for bit, the generator, BatchNorm statistics, Adam state and loss of the loop that draws
    them step by step; a second round from the first's Adam state too."""
    for r in _two_rounds_against_the_loop_by_hand(fused_by_hand=True):
        assert r.stats.steps == 10 and r.stats.ce == pytest.approx(r.ce_by_hand, rel=1e-6)
        assert same_state(r.ours, r.theirs)
        assert all(
            torch.equal(r.optimizer["state"][k][name], r.optimizer_by_hand["state"][k][name])
            for k in r.optimizer_by_hand["state"]
            for name in ("exp_avg", "exp_avg_sq")
        )


def test_the_generators_fused_adam_is_torchs_default_adam_within_float_tolerance() -> None:
    """KDIA's generator steps with torch's fused Adam (fewer kernels): the same update as the default
    Adam the spec names, up to the last bits, over two rounds of ten steps (the second from the first's
    optimiser state, as gen_keep_optimizer runs it)."""
    assert fused_adam(torch.device("cpu")) and fused_adam(torch.device("cuda")) and not fused_adam(torch.device("meta"))
    rounds = _two_rounds_against_the_loop_by_hand(fused_by_hand=False)
    for r in rounds:
        assert r.stats.ce == pytest.approx(r.ce_by_hand, rel=1e-5)
        assert r.optimizer["param_groups"][0]["fused"]
    for k, v in rounds[-1].theirs.items():
        torch.testing.assert_close(rounds[-1].ours[k], v, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_generator_training_captured_as_a_cuda_graph_is_the_eager_loop_within_tolerance() -> None:
    """On a GPU the steps after the third replay one captured graph: the same generator as the eager
    steps within float tolerance (a capturable Adam computes its bias corrections as tensors), the
    same number of steps, and bit for bit the same twice (what a replay of the run needs)."""
    cuda = torch.device("cuda")
    model = build_model("mlp", (4,), 3, seed=0, hidden=[8])
    ensemble = HeadEnsemble(model, [model.state_dict()], [1.0], cuda)
    results = []
    for graphs in ("off", "on", "on"):
        gen = build_generator(6, model)
        gen.reset_parameters(torch_generator(0, "init"))
        stats, _ = train_generator(
            gen, ensemble, epochs=3, batches_per_epoch=5, batch_size=16, lr=1e-2, weight_decay=1e-4,
            rng=torch_generator(0, "gen", 1), device=cuda, graphs=graphs,
        )  # fmt: skip
        assert stats.steps == 15
        results.append((stats.ce, {k: v.detach().cpu() for k, v in gen.state_dict().items()}))
    (eager_ce, eager), (ce, graphed), (again_ce, again) = results
    assert ce == again_ce and same_state(graphed, again)
    assert ce == pytest.approx(eager_ce, rel=1e-4)
    for k, v in eager.items():
        torch.testing.assert_close(graphed[k].double(), v.double(), rtol=1e-3, atol=1e-4)


# -- both halves -----------------------------------------------------------------------------------


def _kdia(**hp: object) -> Federation:
    return Federation("kdia", {**SMALL_GEN, **hp})


def test_teacher_is_the_trifreqs_average_of_every_stored_model_from_the_record() -> None:
    """After rounds with changing participants, theta_T = sum_k F_k theta_k over each node's last
    accepted model, F from the record the coordinator wrote; the logged weights are those F."""
    fed = _kdia()
    last: dict[str, dict[str, torch.Tensor]] = {}
    for chosen in (("node-000", "node-001"), ("node-001", "node-002"), ("node-002",)):
        fed.run(1, selected=chosen)
    # each node's last accepted model, from the store; Eq. 10 by hand in float64
    store = fed.coordinator.store
    assert store is not None and set(store.rounds()) == set(fed.node_ids)
    for node in fed.node_ids:
        state = store.get(node)
        assert state is not None
        last[node] = state
    weights = weights_from_record(fed.participation, 2)
    expected = {
        k: sum(float(weights.weights[weights.index()[n]]) * last[n][k].double() for n in fed.node_ids)
        for k in last["node-000"]
    }
    teacher = fed.coordinator.teacher_model.state_dict()
    for k, value in expected.items():
        torch.testing.assert_close(teacher[k].double(), value, rtol=1e-6, atol=1e-6)
    records = fed.coordinator.round_records()["teacher_weights"]
    entry = {r["node_id"]: r for r in records}
    assert entry["node-002"]["last_round"] == 2 and entry["node-002"]["count"] == 2
    assert entry["node-000"]["last_round"] == 0 and entry["node-000"]["count"] == 1
    assert sum(r["weight"] for r in records) == pytest.approx(1.0)
    for node, r in entry.items():
        gm = math.exp((r["last_round"] - 2) / 3) * (r["count"] * r["num_samples"]) ** (1 / 3)
        total = sum(math.exp((q["last_round"] - 2) / 3) * (q["count"] * q["num_samples"]) ** (1 / 3) for q in records)
        assert r["weight"] == pytest.approx(gm / total), node


def test_a_selected_node_that_delivers_nothing_keeps_its_old_model_and_record() -> None:
    """node-000, selected again in round 1, goes offline before its update arrives: the engine records
    it lost, and KDIA keeps its round-0 model and its (last_round, count)."""
    fed = _kdia()
    fed.run(1, selected=("node-000", "node-001"))
    kept = {k: v.clone() for k, v in fed.coordinator.store.get("node-000").items()}  # type: ignore[union-attr]
    assert fed.local is not None
    now = fed.local.clock.now()
    fed.local.compute_s = lambda node, task: 1.0 if node == "node-000" else 0.0
    fed.local.offline("node-000", at=now + 0.5)  # after node-002's update, before its own
    fed.run(1, selected=("node-000", "node-002"))
    record = fed.participation.get("node-000")
    assert record is not None and (record.rounds_selected, record.lost, record.last_round) == (2, 1, 0)
    assert same_state(fed.coordinator.store.get("node-000"), kept)  # type: ignore[arg-type]
    entry = {r["node_id"]: r for r in fed.coordinator.round_records()["teacher_weights"]}
    assert entry["node-000"]["last_round"] == 0 and entry["node-000"]["count"] == 1


def test_without_either_term_kdia_trains_the_student_as_fedavg() -> None:
    fedavg = Federation("fedavg").run(3)
    student = _kdia(lambda_kd=0.0, lambda_gen=0.0).run(3)
    assert same_state(fedavg, student)


def test_kdia_is_deterministic_and_its_terms_change_the_training() -> None:
    a, b = _kdia().run(3), _kdia().run(3)
    assert same_state(a, b)
    assert not same_state(a, _kdia(lambda_gen=0.0).run(3))
    assert not same_state(a, _kdia(lambda_kd=0.0).run(3))


def _image_node_step(lambda_gen: float) -> dict[str, torch.Tensor]:
    """One SGD step of a "moon-cnn" node with the KD term off: the generator term's only route is the head."""
    model = build_model("moon-cnn", (3, 32, 32), 10, seed=0)
    data = TensorDataset(torch.randn(8, 3, 32, 32, generator=torch_generator(0, "data")), torch.arange(8) % 10, 10)
    gen = build_generator(4, model)
    gen.reset_parameters(torch_generator(0, "g"))
    hp = build_hyperparams(SPEC, {**SMALL_GEN, "lambda_kd": 0.0, "lambda_gen": lambda_gen})
    node = SPEC.node(hp, node_id="n0")
    task = TaskInput(
        node_id="n0",
        round=0,
        payload=Payload(
            tensors={"model": model.state_dict(), "generator": gen.state_dict()},
            meta={"distill": False, "generate": True},
        ),
        settings=TrainSettings(local_epochs=1, batch_size=8, lr=0.1),
        scratch=Scratch(model),
    )
    workspace = build_model("moon-cnn", (3, 32, 32), 10, seed=5)
    out = node.train(task, workspace, data, torch_generator(0, "train"))
    assert ("gen_loss" in out.meta) == (lambda_gen > 0)
    return {k: v.clone() for k, v in out.tensors["model"].items()}


def test_generator_term_updates_the_classifier_head_only() -> None:
    with_gen, without = _image_node_step(1.0), _image_node_step(0.0)
    head = set(build_model("moon-cnn", (3, 32, 32), 10, seed=0).head_keys())
    assert head and head != set(with_gen)
    for key in with_gen:  # the batch order differs (the labels are drawn first): equal up to rounding
        gap = float((with_gen[key] - without[key]).abs().max())
        assert (gap > 1e-4) if key in head else (gap < 1e-6), (key, gap)


def test_the_task_carries_student_teacher_and_generator_and_warmups_withhold_them() -> None:
    coordinator = _kdia(kd_warmup_rounds=1, gen_warmup_rounds=2).coordinator
    first = coordinator.configure_round(context(0, ("node-000",)))
    assert set(first.tensors) == {"model"} and first.meta == {"distill": False, "generate": False}
    third = coordinator.configure_round(context(2, ("node-000",)))
    assert set(third.tensors) == {"model", "teacher", "generator"}
    assert third.meta == {"distill": True, "generate": True}


def test_node_rejects_a_task_without_the_announced_teacher_or_generator() -> None:
    fed = _kdia()
    model = fed.coordinator.model.state_dict()
    with pytest.raises(AlgorithmError, match="teacher"):
        fed.train("node-000", Payload(tensors={"model": model}, meta={"distill": True, "generate": False}))
    with pytest.raises(AlgorithmError, match="generator"):
        fed.train("node-000", Payload(tensors={"model": model}, meta={"distill": False, "generate": True}))
    with pytest.raises(AlgorithmError, match="true or false"):
        fed.train("node-000", Payload(tensors={"model": model}, meta={"distill": "yes"}))


@pytest.mark.parametrize("mode", ["exact", "incremental", "streaming"])
def test_checkpoint_resumes_to_the_same_teacher_and_generator(mode: str) -> None:
    """A coordinator half restored from the state of round 1 continues as the uninterrupted one."""
    straight = _kdia(teacher_mode=mode)
    straight.run(2, selected=("node-000", "node-001"))
    saved = {k: v.clone() for k, v in straight.coordinator.state_dict().items()}
    saved_model = {k: v.clone() for k, v in straight.coordinator.model.state_dict().items()}
    straight.run(1, selected=("node-001", "node-002"))

    resumed = _kdia(teacher_mode=mode)
    resumed.participation = straight.participation  # the record, as the checkpoint restores it
    resumed.coordinator.model.load_state_dict(saved_model)
    resumed.coordinator.load_state_dict(saved)
    # replay round 2's training on the same inputs: same updates, so the same aggregation
    resumed.round = 2
    payload = resumed.coordinator.configure_round(_ctx(resumed, 2))
    assert same_state(payload.tensors["teacher"], _teacher_at(saved))
    updates = [resumed.train(node, payload) for node in ("node-001", "node-002")]
    resumed.coordinator.aggregate(_ctx(resumed, 2), updates, [])
    for key, value in straight.coordinator.teacher_model.state_dict().items():
        torch.testing.assert_close(resumed.coordinator.teacher_model.state_dict()[key], value)
    assert same_state(resumed.coordinator.generator.state_dict(), straight.coordinator.generator.state_dict())  # type: ignore[union-attr]


def _ctx(fed: Federation, round: int) -> RoundContext:
    return context(round, ("node-001", "node-002"), fed.seed, fed.participation)


def _teacher_at(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("teacher/"): v for k, v in state.items() if k.startswith("teacher/")}


def test_teacher_and_student_are_both_evaluated() -> None:
    models = _kdia().coordinator.evaluation_models()
    assert list(models) == ["global", "teacher"]


def test_effective_nodes_and_participant_share_metrics_are_consistent() -> None:
    fed = _kdia()
    fed.run(2, selected=("node-000", "node-001"))
    fed.run(1, selected=("node-002",))
    metrics = fed.metrics[-1]
    w = np.array([r["weight"] for r in fed.coordinator.round_records()["teacher_weights"]])
    assert metrics["teacher_effective_nodes"] == pytest.approx(1 / float(np.sum(w**2)))
    share = [r["weight"] for r in fed.coordinator.round_records()["teacher_weights"] if r["node_id"] == "node-002"]
    assert metrics["teacher_participant_share"] == pytest.approx(share[0])
