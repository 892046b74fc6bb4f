"""FedDyn's two halves in-process: the regularised local steps and the gradient state by hand on a
two-weight model (and across rounds), the server's h and theta by hand, m from the participation
record, h = mean of the nodes' gradient states, the evaluated average, the update schema, FedAvg's
first local step, determinism; hyperparameters and checkpoints: test_contract.py."""

from __future__ import annotations

import math

import pytest
import torch

from fedmq.fedcore.algorithms import build_hyperparams
from fedmq.fedcore.algorithms.base import Payload, TaskInput
from fedmq.fedcore.algorithms.feddyn import (
    SPEC,
    gradient_state_step,
    regulariser_gradient,
    server_model,
    server_state_step,
)
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.participation import ParticipationRecord
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.tensors import schema_mismatch
from fedmq.fedcore.training import TrainSettings
from tests.algorithms import common
from tests.algorithms.common import Federation, column, same_state, scalar_value, two_weight_model


def _train(node, steps: int, round: int = 0) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """`steps` full-batch SGD steps of lr 0.5 from theta^{t-1} = 0; the node's model."""
    settings = TrainSettings(local_epochs=steps, batch_size=2, lr=0.5)
    payload = Payload(tensors={"model": two_weight_model().state_dict()})
    task = TaskInput(node_id="n0", round=round, payload=payload, settings=settings)
    out = node.train(task, two_weight_model((9.0, 9.0)), common.two_samples(), torch_generator(0, "t"))
    assert out.meta["steps"] == steps
    return out.tensors["model"]["weight"]


# -- the rules by hand ---------------------------------------------------------------------------


def test_rule_functions_match_hand_values() -> None:
    """alpha (theta - anchor) - grad_k; grad_k - alpha (theta_k - theta); h - alpha/m sum(theta_k - theta); avg - h/alpha."""
    t = torch.tensor
    assert torch.allclose(regulariser_gradient(t([2.0]), t([1.0]), t([0.3]), 0.5), t([0.2]))
    assert torch.allclose(gradient_state_step(t([0.0]), t([1.5]), t([0.5]), 0.1), t([-0.1]))
    assert torch.allclose(server_state_step(t([0.0]), [t([1.0]), t([3.0])], t([0.0]), 0.5, 4), t([-0.5]))
    assert torch.allclose(server_model(t([2.0]), t([-0.5]), 0.5), t([3.0]))


def test_node_two_steps_and_gradient_state_by_hand() -> None:
    """alpha = 0.1, grad_k = 0: step 1 is plain SGD, W1 = -lr g0 = (-0.125, 0.125); step 2 adds
    alpha (W1 - 0): W2 = W1 - lr (g(W1) + alpha W1); then grad_k = -alpha (W2 - 0)."""
    node = SPEC.node(build_hyperparams(SPEC, {"alpha": 0.1}), node_id="n0")
    w2 = -0.125 - 0.5 * (common.two_sample_gradient(-0.125) + 0.1 * -0.125)
    assert torch.allclose(_train(node, 2), column(w2, -w2), atol=1e-6)
    assert torch.allclose(node.gradient["weight"], column(-0.1 * w2, 0.1 * w2), atol=1e-6)


def test_gradient_state_persists_and_enters_the_next_round_as_the_linear_term() -> None:
    """Round 2 from theta = 0 again with grad_k from round 1: one step with gradient g0 - grad_k
    (the quadratic term is zero there); then grad_k' = grad_k - alpha (W - 0)."""
    node = SPEC.node(build_hyperparams(SPEC, {"alpha": 0.1}), node_id="n0")
    _train(node, 2)
    g = float(node.gradient["weight"][0, 0])
    w = -0.5 * (common.TWO_SAMPLE_GRADIENT - g)
    assert torch.allclose(_train(node, 1, round=1), column(w, -w), atol=1e-6)
    assert torch.allclose(node.gradient["weight"], column(g - 0.1 * w, -(g - 0.1 * w)), atol=1e-6)


def test_first_local_step_equals_fedavg_exactly() -> None:
    """A node's first round with one full-batch step: both regularisers have zero gradient at theta =
    theta^{t-1} with grad_k = 0, so the model is FedAvg's bit for bit; with two steps it is not."""
    data = common.shards()[2]
    start = common.tiny_model(1).state_dict()
    plain = Federation("fedavg").nodes["node-000"]
    for epochs, equal in ((1, True), (2, False)):
        settings = TrainSettings(local_epochs=epochs, batch_size=len(data), lr=0.5, momentum=0.5)
        task = TaskInput(node_id="n0", round=0, payload=Payload(tensors={"model": start}), settings=settings)
        node = SPEC.node(build_hyperparams(SPEC, {"alpha": 0.5}), node_id="n0")
        dyn = node.train(task, common.tiny_model(99), data, torch_generator(0, "t")).tensors["model"]
        avg = plain.train(task, common.tiny_model(99), data, torch_generator(0, "t")).tensors["model"]
        assert same_state(dyn, avg) is equal


# -- the server ----------------------------------------------------------------------------------


def _coordinator(**hp: object):  # type: ignore[no-untyped-def]
    return SPEC.coordinator(build_hyperparams(SPEC, hp), model=common.scalar_model(0.0))


def _aggregate(coordinator, rows, round: int = 0, participation=None) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """One round of updates (value, num_samples), each reporting loss 1."""
    updates = [common.update(f"n{i}", common.scalar_state(v), n, round, loss=1.0) for i, (v, n) in enumerate(rows)]
    return common.aggregate(coordinator, updates, round, participation)


@pytest.mark.parametrize(
    ("hp", "theta1", "theta2"),
    [
        # round 1: h = -0.5 (1/4)(1 + 3) = -0.5, theta = 2 + 1 = 3; round 2 from 3 with models (3.5, 4.5):
        # h = -0.5 - 0.5 (1/4)(0.5 + 1.5) = -0.75, theta = 4 + 1.5 = 5.5
        ({"alpha": 0.5, "num_nodes": 4}, 3.0, 5.5),
        # sample-weighted mean (10, 30): round 1 avg 2.5, theta 3.5; round 2 from 3.5: drifts 0 and 1,
        # h = -0.5 - 0.125 = -0.625, avg 4.25, theta = 4.25 + 1.25 = 5.5
        ({"alpha": 0.5, "num_nodes": 4, "weighted": True}, 3.5, 5.5),
    ],
)
def test_server_h_and_model_by_hand(hp: dict[str, object], theta1: float, theta2: float) -> None:
    """theta = 0, h = 0, alpha = 0.5, m = 4: h and theta after two rounds of two updates, by hand."""
    coordinator = _coordinator(**hp)
    metrics = _aggregate(coordinator, [(1.0, 10), (3.0, 30)])
    assert scalar_value(coordinator.model.weight) == pytest.approx(theta1, abs=1e-6)
    assert scalar_value(coordinator.h["weight"]) == pytest.approx(-0.5, abs=1e-6)
    assert metrics["federation_size"] == 4.0 and metrics["h_norm"] == pytest.approx(0.5, abs=1e-6)
    _aggregate(coordinator, [(3.5, 10), (4.5, 30)], round=1)
    assert scalar_value(coordinator.model.weight) == pytest.approx(theta2, abs=1e-6)
    payload = coordinator.configure_round(common.context(2, ("n0",)))
    assert payload.tensors.keys() == {"model"}
    assert scalar_value(payload.tensors["model"]["weight"]) == pytest.approx(theta2, abs=1e-6)


def test_m_comes_from_the_participation_record_by_default() -> None:
    """num_nodes = 0 with 5 nodes in the record: h = -0.5 (1/5)(1 + 3) = -0.4, theta = 2 + 0.8."""
    record = ParticipationRecord()
    for i in range(5):
        record.ensure(f"n{i}")
    coordinator = _coordinator(alpha=0.5)
    assert _aggregate(coordinator, [(1.0, 10), (3.0, 30)], participation=record)["federation_size"] == 5.0
    assert scalar_value(coordinator.h["weight"]) == pytest.approx(-0.4, abs=1e-6)
    assert scalar_value(coordinator.model.weight) == pytest.approx(2.8, abs=1e-6)


def test_replaced_averaging_step_keeps_h_on_its_own_rule() -> None:
    """With `average` swapped (as FedSA does) for "the first model": h = -0.5 still, theta = 1 + 1 = 2."""
    coordinator = _coordinator(alpha=0.5, num_nodes=4)
    coordinator.average = lambda states, weights: {k: v.clone() for k, v in states[0].items()}
    _aggregate(coordinator, [(1.0, 10), (3.0, 30)])
    assert scalar_value(coordinator.h["weight"]) == pytest.approx(-0.5, abs=1e-6)
    assert scalar_value(coordinator.model.weight) == pytest.approx(2.0, abs=1e-6)


def test_evaluate_average_adds_the_mean_of_the_node_models() -> None:
    """evaluate_average: "global" is theta (3.0 above), "average" the plain mean (2.0); off by default."""
    assert list(_coordinator().evaluation_models()) == ["global"]
    coordinator = _coordinator(alpha=0.5, num_nodes=4, evaluate_average=True)
    _aggregate(coordinator, [(1.0, 10), (3.0, 30)])
    models = coordinator.evaluation_models()
    assert list(models) == ["global", "average"]
    assert scalar_value(models["global"].weight) == pytest.approx(3.0, abs=1e-6)
    assert scalar_value(models["average"].weight) == pytest.approx(2.0, abs=1e-6)


def test_h_is_the_mean_of_the_node_gradient_states_with_partial_participation() -> None:
    """m = 3, rounds with nodes {0, 2}, {0, 1, 2}, {1}: h = (1/m) sum_k grad_k after each round."""
    fed = Federation(SPEC, {"alpha": 0.1, "num_nodes": 3})
    for chosen in (("node-000", "node-002"), None, ("node-001",)):
        fed.run(1, chosen)
        states = [node.gradient for node in fed.nodes.values() if node.gradient is not None]
        for name, h in fed.coordinator.h.items():
            assert torch.allclose(h, sum(s[name] for s in states) / 3, atol=1e-7), name
    assert max(float(h.abs().max()) for h in fed.coordinator.h.values()) > 0


# -- state, schema, determinism ------------------------------------------------------------------


def test_update_schema_is_the_model_alone_and_rejects_bad_shapes() -> None:
    """The update carries the model only (grad_k stays on the node); a misshapen tensor is rejected."""
    fed = Federation(SPEC)
    schema = fed.coordinator.update_schema()
    assert schema.keys() == {"model"}
    out = fed.train("node-000", fed.coordinator.configure_round(common.context(0, fed.node_ids)))
    assert out.payload.tensors.keys() == {"model"}
    assert schema_mismatch(out.payload.tensors["model"], schema["model"]) is None
    model = dict(out.payload.tensors["model"])
    name = sorted(model)[0]
    assert schema_mismatch({**model, name: torch.zeros(3)}, schema["model"])[0] == "wrong-shape"


def test_feddyn_training_is_deterministic_under_a_fixed_seed() -> None:
    """Two federations with the same seed end with the same model and h; another seed differs."""
    a = common.assert_deterministic(SPEC)
    assert all(math.isfinite(m["train_loss"]) for m in a.metrics)


def test_node_without_model_in_task_raises_algorithm_error() -> None:
    """A task whose model group is missing is an AlgorithmError; the node's state is untouched."""
    fed = Federation(SPEC)
    with pytest.raises(AlgorithmError, match=r"no usable model.*node node-000, round 0"):
        fed.train("node-000", Payload(tensors={}))
    assert fed.nodes["node-000"].gradient is None
