"""FedProx's two halves in-process: the proximal term and its gradient by hand, FedAvg at mu = 0,
determinism; hyperparameters and checkpoints: test_contract.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from fedmq.experiments.bench.step_cost import StepCounter
from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm
from fedmq.fedcore.algorithms.base import Payload, TaskInput
from fedmq.fedcore.algorithms.fedprox import flat_proximal_term, proximal_term
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.training import TrainSettings
from tests.algorithms import common
from tests.algorithms.common import Federation, same_state, shards, tiny_model

SPEC = get_algorithm("fedprox")


def test_proximal_term_value_and_gradient_match_hand_computation() -> None:
    """mu = 0.1, w = (1, 2) and (3,), w^t = 0: (0.1 / 2)(1 + 4 + 9) = 0.7, gradient mu w."""
    w = [torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([3.0], requires_grad=True)]
    anchor = [torch.zeros(2), torch.zeros(1)]
    term = proximal_term(w, anchor, 0.1)
    term.backward()
    assert float(term.detach()) == pytest.approx(0.7)
    assert torch.allclose(w[0].grad, torch.tensor([0.1, 0.2])) and torch.allclose(w[1].grad, torch.tensor([0.3]))


def test_the_flat_proximal_term_over_nodes_is_each_nodes_term_in_a_few_operators() -> None:
    """Under vmap over 3 nodes of 12 tensors, the vectorised form's value and gradient are each node's
    `proximal_term`'s (float64, to 1e-12), in 6 operators forward however many tensors (the sum term by
    term: 4 a tensor) and 6 backward besides laying each tensor's gradient out as its own (a copy here; in
    a training step, the addition to the objective's other gradient for it)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 3, 3, 3), (4,), (7, 5), (7,)] * 3
    stacked = [torch.randn(3, *s, generator=gen, dtype=torch.float64, requires_grad=True) for s in shapes]
    anchor = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes]
    with StepCounter() as forward:
        terms = torch.vmap(lambda ps: flat_proximal_term(ps, anchor, 0.3))(stacked)
    with StepCounter() as backward:
        terms.sum().backward()
    assert forward.ops <= 6 and backward.ops <= 6 + len(shapes)
    for k in range(3):
        own = [p[k].detach().clone().requires_grad_(True) for p in stacked]
        term = proximal_term(own, anchor, 0.3)
        term.backward()
        assert float(terms[k].detach()) == pytest.approx(float(term.detach()), rel=1e-12)
        for p, mine in zip(own, stacked, strict=True):
            torch.testing.assert_close(mine.grad[k], p.grad, rtol=1e-12, atol=1e-12)


def test_fedprox_node_training_follows_the_proximal_gradient() -> None:
    """Two full-batch SGD steps: the first is plain SGD (w = w^t), the second adds mu (w_1 - w^t) to the gradient."""
    mu, lr = 0.5, 0.1
    data = shards()[2]
    settings = TrainSettings(local_epochs=2, batch_size=len(data), lr=lr)
    start = tiny_model(1).state_dict()
    half = SPEC.node(build_hyperparams(SPEC, {"mu": mu}), node_id="n0")
    workspace = tiny_model(99)
    task = TaskInput(node_id="n0", round=0, payload=Payload(tensors={"model": start}), settings=settings)
    out = half.train(task, workspace, data, torch_generator(0, "t"))

    manual = tiny_model(1)
    anchor = [p.detach().clone() for p in manual.parameters()]
    for _ in range(2):
        manual.zero_grad()
        F.cross_entropy(manual(data.x), data.y).backward()
        with torch.no_grad():
            for p, a in zip(manual.parameters(), anchor, strict=True):
                p -= lr * (p.grad + mu * (p - a))
    for name, p in manual.state_dict().items():
        assert torch.allclose(out.tensors["model"][name], p, atol=1e-6), name
    plain = Federation("fedavg").nodes["node-000"]
    fedavg_out = plain.train(task, tiny_model(99), data, torch_generator(0, "t"))
    assert not same_state(out.tensors["model"], fedavg_out.tensors["model"])


def test_fedprox_neutral_setting_equals_fedavg_exactly() -> None:
    """mu = 0 gives FedAvg's global model bit for bit, on the same seed."""
    fedavg = Federation("fedavg").run(2)
    assert same_state(fedavg, Federation("fedprox", {"mu": 0.0}).run(2))
    assert not same_state(fedavg, Federation("fedprox", {"mu": 1.0}).run(2))


def test_fedprox_training_is_deterministic_under_a_fixed_seed() -> None:
    """Two federations with the same seed end with the same model; another seed differs."""
    a = common.assert_deterministic("fedprox")
    assert a.metrics[-1]["train_loss"] < 1.2


def test_fedprox_larger_mu_keeps_the_node_nearer_the_global_model() -> None:
    """The squared distance a node travels from w^t shrinks when mu grows."""
    start = tiny_model(0).state_dict()

    def drift(mu: float) -> float:
        fed = Federation("fedprox", {"mu": mu})
        out = fed.train("node-002", Payload(tensors={"model": {k: v.clone() for k, v in start.items()}}))
        return sum(float((out.payload.tensors["model"][k] - start[k]).pow(2).sum()) for k in start)

    assert drift(5.0) < drift(0.0)


def test_fedprox_node_without_model_in_task_raises_algorithm_error() -> None:
    """A task whose model group is missing is an AlgorithmError naming the node and round."""
    fed = Federation("fedprox")
    with pytest.raises(AlgorithmError, match=r"no usable model.*node node-000, round 0"):
        fed.train("node-000", Payload(tensors={"teacher": copy.deepcopy(tiny_model().state_dict())}))
