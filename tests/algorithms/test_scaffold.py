"""SCAFFOLD's two halves in-process: the corrected local step and options I, II and gradient_mean by
hand on a two-weight model, the node's control variate across rounds, the server's x and c by hand,
N from the participation record, the update schema, FedAvg at the first round, determinism, bad
tasks; hyperparameters and checkpoints: test_contract.py."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from fedmq.fedcore.algorithms import build_hyperparams
from fedmq.fedcore.algorithms.base import NodeUpdate, Payload, RoundContext, TaskInput
from fedmq.fedcore.algorithms.scaffold import (
    CONTROL,
    CONTROL_DELTA,
    SPEC,
    corrected_gradient,
    option_ii_delta,
    server_control_step,
    server_model_step,
)
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.participation import ParticipationRecord
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.tensors import schema_mismatch
from fedmq.fedcore.training import TrainSettings
from tests.algorithms import common
from tests.algorithms.common import Federation, column, context, same_state, scalar_value, two_samples, two_weight_model

G0 = (common.TWO_SAMPLE_GRADIENT, -common.TWO_SAMPLE_GRADIENT)
"""The gradient of the mean cross-entropy of `two_samples()` at W = 0: ((p - onehot(y)) x) averaged, p = (1/2, 1/2)."""


def _task(c: tuple[float, float], settings: TrainSettings, round: int = 0, w=(0.0, 0.0)) -> TaskInput:  # type: ignore[no-untyped-def]
    tensors = {"model": two_weight_model(w).state_dict(), CONTROL: {"weight": column(*c)}}
    return TaskInput(node_id="n0", round=round, payload=Payload(tensors=tensors), settings=settings)


def _node(**hp: object):  # type: ignore[no-untyped-def]
    return SPEC.node(build_hyperparams(SPEC, hp), node_id="n0")


def _plain(steps: int = 1, lr: float = 0.5, **extra: object) -> TrainSettings:
    """Full-batch SGD (the two samples in one batch), `steps` epochs of one step each."""
    return TrainSettings(local_epochs=steps, batch_size=2, lr=lr, **extra)  # type: ignore[arg-type]


def _train(node, task: TaskInput):  # type: ignore[no-untyped-def]
    out = node.train(task, two_weight_model((9.0, 9.0)), two_samples(), torch_generator(0, "t"))
    return out.tensors["model"]["weight"], out.tensors[CONTROL_DELTA]["weight"], out.meta


# -- the rules by hand ---------------------------------------------------------------------------


def test_rule_functions_match_hand_values() -> None:
    """g - c_i + c; (x - y)/(K lr) - c; x + eta_g (avg - x); c + sum(delta) / N: small numbers by hand."""
    t = torch.tensor
    assert torch.allclose(corrected_gradient(t([1.0]), t([0.25]), t([0.5])), t([1.25]))
    assert torch.allclose(option_ii_delta(t([1.0]), t([0.4]), t([0.1]), 3, 0.2), t([0.6 / 0.6 - 0.1]))
    assert torch.allclose(server_model_step(t([1.0]), t([3.0]), 0.5), t([2.0]))
    avg = t([3.0])
    assert server_model_step(t([1.0]), avg, 1.0) is avg  # eta_g = 1 takes the average itself
    assert torch.allclose(server_control_step(t([0.1]), [t([0.4]), t([0.8])], 4), t([0.4]))


def test_first_round_single_step_corrected_gradient_and_option_ii_by_hand() -> None:
    """c = (0.1, -0.3), c_i = 0, one full-batch step of lr 0.5 from W = 0: y = -lr (g + c), and
    Delta c_i = (x - y)/(1 lr) - c = g exactly the gradient, (0.25, -0.25); the node keeps c_i = g."""
    node = _node()
    y, delta, meta = _train(node, _task((0.1, -0.3), _plain()))
    assert torch.allclose(y, column(-0.5 * (0.25 + 0.1), -0.5 * (-0.25 - 0.3)))
    assert torch.allclose(delta, column(*G0), atol=1e-6)
    assert torch.allclose(node.control["weight"], column(*G0), atol=1e-6)
    assert meta["steps"] == 1 and meta["loss"] == pytest.approx(math.log(2))


def test_node_control_variate_persists_into_the_next_round() -> None:
    """Round 2 from the same x with c = 0 and c_i = g: the corrected gradient g - g + 0 is zero, the
    node does not move and Delta c_i = 0; with c = (0.1, -0.3) it moves by -lr c and Delta c_i = 0."""
    node = _node()
    _train(node, _task((0.1, -0.3), _plain()))
    y, delta, _ = _train(node, _task((0.0, 0.0), _plain(), round=1))
    assert torch.allclose(y, column(0.0, 0.0), atol=1e-7)
    assert torch.allclose(delta, column(0.0, 0.0), atol=1e-6)
    y, delta, _ = _train(node, _task((0.1, -0.3), _plain(), round=2))
    assert torch.allclose(y, column(-0.05, 0.15), atol=1e-6)
    assert torch.allclose(delta, column(0.0, 0.0), atol=1e-6)
    assert torch.allclose(node.control["weight"], column(*G0), atol=1e-6)


def test_two_steps_option_ii_is_the_mean_of_the_two_gradients() -> None:
    """c = c_i = 0, two steps of lr 0.5: W1 = -lr g0, W2 = W1 - lr g(W1); Delta c_i = (x - W2)/(2 lr)
    = (g0 + g(W1)) / 2, with g(W1) from the softmax by hand."""
    g1 = common.two_sample_gradient(-0.125)
    y, delta, meta = _train(_node(), _task((0.0, 0.0), _plain(steps=2)))
    w2 = -0.125 - 0.5 * g1
    assert meta["steps"] == 2
    assert torch.allclose(y, column(w2, -w2), atol=1e-6)
    mean = (G0[0] + g1) / 2
    assert torch.allclose(delta, column(mean, -mean), atol=1e-6)


def test_option_i_sets_c_i_to_the_gradient_at_x() -> None:
    """Option I: Delta c_i = g_i(x) - c_i = (0.25, -0.25) at the first round, whatever the two local
    steps did; the local steps themselves are option II's."""
    y_i, delta_i, _ = _train(_node(control_update="option_i"), _task((0.0, 0.0), _plain(steps=2)))
    y_ii, delta_ii, _ = _train(_node(), _task((0.0, 0.0), _plain(steps=2)))
    assert torch.allclose(delta_i, column(*G0), atol=1e-6)
    assert torch.equal(y_i, y_ii)
    assert not torch.allclose(delta_i, delta_ii, atol=1e-3)


def test_gradient_mean_equals_option_ii_under_plain_sgd_but_not_under_momentum() -> None:
    """Without momentum (x - y)/(K lr) - c is the mean raw gradient minus c_i; with momentum 0.9 the
    model moves further and option II over-estimates it, gradient_mean does not."""
    plain = _plain(steps=4, lr=0.3)
    _, mean_delta, _ = _train(_node(control_update="gradient_mean"), _task((0.1, -0.3), plain))
    _, ii_delta, _ = _train(_node(), _task((0.1, -0.3), plain))
    assert torch.allclose(mean_delta, ii_delta, atol=1e-6)
    heavy = _plain(steps=4, lr=0.3, momentum=0.9)
    _, mean_delta_m, _ = _train(_node(control_update="gradient_mean"), _task((0.0, 0.0), heavy))
    _, ii_delta_m, _ = _train(_node(), _task((0.0, 0.0), heavy))
    assert float(ii_delta_m.abs().sum()) > 1.5 * float(mean_delta_m.abs().sum())


# -- the server ----------------------------------------------------------------------------------


def _coordinator(**hp: object):  # type: ignore[no-untyped-def]
    return SPEC.coordinator(build_hyperparams(SPEC, hp), model=common.scalar_model(0.0))


def _update(node: str, value: float, delta: float, n: int, round: int = 0) -> NodeUpdate:
    tensors = {"model": {"weight": torch.full((1, 1), value)}, CONTROL_DELTA: {"weight": torch.full((1, 1), delta)}}
    return NodeUpdate(node_id=node, round=round, num_samples=n, payload=Payload(tensors=tensors, meta={"loss": 1.0}))


def _aggregate(coordinator, rows, round: int = 0, participation=None) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """One round of updates (value, control delta, num_samples), each reporting loss 1."""
    updates = [_update(f"n{i}", v, d, n, round) for i, (v, d, n) in enumerate(rows)]
    return common.aggregate(coordinator, updates, round, participation)


@pytest.mark.parametrize(
    ("hp", "x1", "x2"),
    [
        # uniform: avg 2, x1 = 0 + 0.5 (2 - 0) = 1; round 2 avg 2, x2 = 1 + 0.5 (2 - 1) = 1.5
        ({"server_lr": 0.5, "num_nodes": 4}, 1.0, 1.5),
        # sample-weighted: avg (10 + 90) / 40 = 2.5, x1 = 1.25; round 2 x2 = 1.25 + 0.5 (2 - 1.25) = 1.625
        ({"server_lr": 0.5, "num_nodes": 4, "weighted": True}, 1.25, 1.625),
        # eta_g = 1: x is the average
        ({"num_nodes": 4}, 2.0, 2.0),
    ],
)
def test_server_steps_x_and_c_by_hand(hp: dict[str, object], x1: float, x2: float) -> None:
    """x = 0, c = 0, N = 4; round 1: models (1, 3), deltas (0.4, 0.8): c = 0 + (0.4 + 0.8)/4 = 0.3;
    round 2: models (2, 2), deltas (0.1, 0.1): c = 0.3 + 0.2/4 = 0.35, unweighted in both cases."""
    coordinator = _coordinator(**hp)
    metrics = _aggregate(coordinator, [(1.0, 0.4, 10), (3.0, 0.8, 30)])
    assert scalar_value(coordinator.model.weight) == pytest.approx(x1, abs=1e-6)
    assert scalar_value(coordinator.control["weight"]) == pytest.approx(0.3, abs=1e-6)
    assert metrics["federation_size"] == 4.0 and metrics["control_norm"] == pytest.approx(0.3, abs=1e-6)
    _aggregate(coordinator, [(2.0, 0.1, 10), (2.0, 0.1, 30)], round=1)
    assert scalar_value(coordinator.model.weight) == pytest.approx(x2, abs=1e-6)
    assert scalar_value(coordinator.control["weight"]) == pytest.approx(0.35, abs=1e-6)
    payload = coordinator.configure_round(context(2, ("n0",)))
    assert scalar_value(payload.tensors[CONTROL]["weight"]) == pytest.approx(0.35, abs=1e-6)
    assert scalar_value(payload.tensors["model"]["weight"]) == pytest.approx(x2, abs=1e-6)


def test_federation_size_comes_from_the_participation_record_by_default() -> None:
    """num_nodes = 0: N = the 5 nodes the record knows, c = (0.4 + 0.8) / 5; a num_nodes below the
    known count is raised to it with a warning."""
    record = ParticipationRecord()
    for i in range(5):
        record.ensure(f"n{i}")
    coordinator = _coordinator()
    assert _aggregate(coordinator, [(1.0, 0.4, 10), (3.0, 0.8, 30)], participation=record)["federation_size"] == 5.0
    assert scalar_value(coordinator.control["weight"]) == pytest.approx(0.24, abs=1e-6)
    coordinator = _coordinator(num_nodes=2)
    metrics = _aggregate(coordinator, [(1.0, 0.4, 10), (3.0, 0.8, 30)], participation=record)
    assert metrics["federation_size"] == 5.0


def test_too_small_num_nodes_logs_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """num_nodes = 1 with two updates: N = 2, and the misconfiguration is logged."""
    with caplog.at_level(logging.WARNING, logger="fedmq.fedcore.algorithms.shared"):
        metrics = _aggregate(_coordinator(num_nodes=1), [(1.0, 0.4, 10), (3.0, 0.8, 30)])
    assert metrics["federation_size"] == 2.0
    assert "num_nodes = 1" in caplog.text


def test_replaced_averaging_step_moves_x_while_c_keeps_its_own_rule() -> None:
    """With `average` swapped (as FedSA does) for "the first model", x follows it; c still sums the deltas over N."""
    coordinator = _coordinator(num_nodes=4)
    coordinator.average = lambda states, weights: {k: v.clone() for k, v in states[0].items()}
    _aggregate(coordinator, [(1.0, 0.4, 10), (3.0, 0.8, 30)])
    assert scalar_value(coordinator.model.weight) == pytest.approx(1.0)
    assert scalar_value(coordinator.control["weight"]) == pytest.approx(0.3, abs=1e-6)


def test_server_control_is_the_mean_of_the_node_controls_with_partial_participation() -> None:
    """N = 3, rounds with nodes {0, 2}, {0, 1, 2}, {1}: c = (1/N) sum_i c_i after each round (Alg. 1's invariant)."""
    fed = Federation(SPEC, {"num_nodes": 3})
    for chosen in (("node-000", "node-002"), None, ("node-001",)):
        fed.run(1, chosen)
        controls = [node.control for node in fed.nodes.values()]
        for name, c in fed.coordinator.control.items():
            total = sum(ci[name] for ci in controls if ci is not None)
            assert torch.allclose(c, total / 3, atol=1e-6), name
    assert all(node.control is not None for node in fed.nodes.values())


# -- state, schema, FedAvg, determinism ----------------------------------------------------------


def test_update_schema_declares_the_control_delta_and_rejects_bad_shapes() -> None:
    """A node's update fits the schema (model and control_delta); a delta of the wrong shape or
    dtype, or a missing tensor, is what the coordinator daemon rejects (schema_mismatch)."""
    fed = Federation(SPEC)
    schema = fed.coordinator.update_schema()
    assert schema.keys() == {"model", CONTROL_DELTA}
    params = dict(fed.coordinator.model.named_parameters())
    assert schema[CONTROL_DELTA].keys() == params.keys()
    out = fed.train("node-000", fed.coordinator.configure_round(context(0, fed.node_ids)))
    assert out.payload.tensors.keys() == schema.keys()
    for group, expected in schema.items():
        assert schema_mismatch(out.payload.tensors[group], expected) is None
    delta = dict(out.payload.tensors[CONTROL_DELTA])
    name = sorted(delta)[0]
    assert schema_mismatch({**delta, name: torch.zeros(3)}, schema[CONTROL_DELTA])[0] == "wrong-shape"
    assert schema_mismatch({**delta, name: delta[name].double()}, schema[CONTROL_DELTA])[0] == "wrong-dtype"
    del delta[name]
    assert schema_mismatch(delta, schema[CONTROL_DELTA])[0] == "wrong-shape"


def test_first_round_equals_fedavg_exactly_with_zero_control_variates() -> None:
    """c = c_i = 0 and eta_g = 1: the first round's global model is unweighted FedAvg's bit for bit
    (momentum 0.5 in the shared settings); the second round differs (c and c_i are no longer zero)."""
    fedavg = Federation("fedavg", {"weighted": False})
    scaffold = Federation(SPEC)
    assert same_state(fedavg.run(1), scaffold.run(1))
    weighted = Federation(SPEC, {"weighted": True}).run(1)
    assert same_state(Federation("fedavg").run(1), weighted)
    assert not same_state(fedavg.run(1), scaffold.run(1))


def test_scaffold_training_is_deterministic_under_a_fixed_seed() -> None:
    """Two federations with the same seed end with the same model and c; another seed differs."""
    a = common.assert_deterministic(SPEC)
    assert all(math.isfinite(m["train_loss"]) for m in a.metrics)


# -- bad tasks -----------------------------------------------------------------------------------


def test_task_without_or_with_misshapen_control_is_an_algorithm_error() -> None:
    """No control group, a missing entry or a wrong shape: AlgorithmError naming the node and round."""
    node = _node()
    task = _task((0.0, 0.0), _plain())
    no_control = TaskInput(
        node_id="n0", round=0, payload=Payload(tensors={"model": task.payload.tensors["model"]}), settings=_plain()
    )
    with pytest.raises(AlgorithmError, match=r"no control group.*node n0, round 0"):
        node.train(no_control, two_weight_model(), two_samples(), torch_generator(0, "t"))
    for control in ({}, {"weight": torch.zeros(2)}):
        bad = TaskInput(
            node_id="n0",
            round=0,
            payload=Payload(tensors={"model": task.payload.tensors["model"], CONTROL: control}),
            settings=_plain(),
        )
        with pytest.raises(AlgorithmError, match="control"):
            node.train(bad, two_weight_model(), two_samples(), torch_generator(0, "t"))
    assert node.control is None  # a refused task leaves the node's state alone


def test_option_ii_with_adam_is_refused_on_both_halves() -> None:
    """Option II's (x - y)/(K lr) assumes SGD: Adam is an AlgorithmError; gradient_mean trains with Adam."""
    adam = _plain(optimizer="adam")
    with pytest.raises(AlgorithmError, match="SGD"):
        _train(_node(), _task((0.0, 0.0), adam))
    with pytest.raises(AlgorithmError, match="SGD"):
        ctx = RoundContext(round=0, selected=("n0",), participation=ParticipationRecord(), settings=adam)
        SPEC.coordinator(build_hyperparams(SPEC, {}), model=two_weight_model()).configure_round(ctx)
    _, delta, _ = _train(_node(control_update="gradient_mean"), _task((0.0, 0.0), adam))
    assert torch.allclose(delta, column(*G0), atol=1e-6)  # one step: the mean gradient is g(x)


def test_node_without_local_steps_is_an_algorithm_error() -> None:
    """An empty shard takes no step, so (x - y)/(K lr) is undefined: AlgorithmError."""
    empty = common.empty_shard()
    fed = Federation(SPEC)
    task = TaskInput(
        node_id="node-000",
        round=0,
        payload=fed.coordinator.configure_round(context(0, ("node-000",))),
        settings=_plain(),
    )
    with pytest.raises(AlgorithmError, match="no local step"):
        fed.nodes["node-000"].train(task, common.tiny_model(3), empty, torch_generator(0, "t"))
