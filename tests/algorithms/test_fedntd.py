"""FedNTD's two halves in-process: the not-true logits and L_NTD by hand, its blindness to the true
class, the KD scale option, FedAvg at beta = 0, the pull towards the global model's not-true
distribution, determinism, a missing model; hyperparameters and checkpoints: test_contract.py."""

from __future__ import annotations

import math

import pytest
import torch

from fedmq.fedcore.algorithms import build_hyperparams, fedntd
from fedmq.fedcore.algorithms.base import Payload
from fedmq.fedcore.errors import AlgorithmError
from tests.algorithms import common
from tests.algorithms.common import Federation, same_state, tiny_model

SPEC = fedntd.SPEC


def test_not_true_logits_drop_the_true_class_and_keep_the_order() -> None:
    """Rows (1, 2, 3) with label 2 and (4, 5, 6) with label 0 become (1, 2) and (5, 6)."""
    logits = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    out = fedntd.not_true_logits(logits, torch.tensor([2, 0]))
    assert torch.equal(out, torch.tensor([[1.0, 2.0], [5.0, 6.0]]))


def test_ntd_loss_matches_hand_computed_kl() -> None:
    """Student (1, 2, 3), teacher (0, 0, 5), label 2, tau = 1: not-true q~^l = softmax(1, 2) = (s(-1), s(1)),
    q~^g = (1/2, 1/2), so KL = -ln 2 - (ln s(-1) + ln s(1)) / 2 with s the logistic function."""
    student = torch.tensor([[1.0, 2.0, 3.0]])
    teacher = torch.tensor([[0.0, 0.0, 5.0]])

    def log_sigmoid(v: float) -> float:
        return -math.log1p(math.exp(-v))

    expected = -math.log(2) - 0.5 * (log_sigmoid(-1.0) + log_sigmoid(1.0))
    loss = fedntd.ntd_loss(student, teacher, torch.tensor([2]), 1.0)
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert expected == pytest.approx(0.1201145, abs=1e-6)


def test_ntd_loss_temperature_softens_both_distributions() -> None:
    """At tau = 2 the student's not-true logits (1, 2) act as (1/2, 1): KL = -ln 2 - (ln s(-1/2) + ln s(1/2)) / 2."""
    student = torch.tensor([[1.0, 2.0, 3.0]])
    teacher = torch.tensor([[0.0, 0.0, 5.0]])
    expected = -math.log(2) + 0.5 * (math.log1p(math.exp(0.5)) + math.log1p(math.exp(-0.5)))
    assert float(fedntd.ntd_loss(student, teacher, torch.tensor([2]), 2.0)) == pytest.approx(expected, rel=1e-6)


def test_ntd_loss_ignores_the_true_class_logit_and_gives_it_no_gradient() -> None:
    """Changing either model's true-class logit leaves L_NTD unchanged, and its gradient there is exactly 0."""
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(4, 5, generator=gen, requires_grad=True)
    teacher = torch.randn(4, 5, generator=gen)
    y = torch.tensor([0, 3, 3, 1])
    loss = fedntd.ntd_loss(student, teacher, y, 1.5)
    loss.backward()
    assert torch.all(student.grad[torch.arange(4), y] == 0.0)
    assert student.grad.abs().sum() > 0
    moved_student, moved_teacher = student.detach().clone(), teacher.clone()
    moved_student[torch.arange(4), y] += 7.0
    moved_teacher[torch.arange(4), y] -= 3.0
    moved = fedntd.ntd_loss(moved_student, moved_teacher, y, 1.5)
    assert float(moved) == pytest.approx(float(loss.detach()), rel=1e-6)


def test_ntd_loss_is_zero_when_the_not_true_distributions_agree() -> None:
    """The same not-true logits up to a per-row shift (softmax is shift-invariant) give 0, whatever the true logits."""
    logits = torch.tensor([[0.5, -1.0, 2.0], [3.0, 0.0, 1.0]])
    shifted = logits + torch.tensor([[4.0], [-2.0]])
    shifted[0, 1] = 9.0  # row 0's true class (label 1)
    assert float(fedntd.ntd_loss(logits, shifted, torch.tensor([1, 2]), 3.0)) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(("kd_scale", "weight"), [("plain", 0.3), ("tau2", 0.3 * 9.0)])
def test_fedntd_kd_weight_follows_the_chosen_scale(kd_scale: str, weight: float) -> None:
    """beta = 0.3, tau = 3: the authors' code weighs KL by beta, FedVLS's code by beta tau^2."""
    hp = build_hyperparams(SPEC, {"beta": 0.3, "temperature": 3.0, "kd_scale": kd_scale})
    assert hp.kd_weight == pytest.approx(weight)


def test_fedntd_neutral_setting_equals_fedavg_exactly() -> None:
    """beta = 0 gives FedAvg's global model bit for bit (no teacher is built); beta > 0 differs."""
    fedavg = Federation("fedavg").run(2)
    neutral = Federation(SPEC, {"beta": 0.0})
    assert same_state(fedavg, neutral.run(2))
    assert not neutral.scratch.modules
    assert not same_state(fedavg, Federation(SPEC, {"beta": 1.0}).run(2))


def test_fedntd_training_is_deterministic_under_a_fixed_seed() -> None:
    """Two federations with the same seed end with the same model; another seed differs; the teacher is one scratch."""
    a = common.assert_deterministic(SPEC)
    assert set(a.scratch.modules) == {"fedntd-global"}
    assert all(math.isfinite(m["train_loss"]) for m in a.metrics)


def test_fedntd_keeps_the_local_not_true_distribution_nearer_the_global_one() -> None:
    """After local training on a skewed shard, the local model's not-true softmax on that shard is closer
    (in L_NTD) to the global model's with a large beta than without distillation."""
    start = tiny_model(3).state_dict()
    data = Federation(SPEC).data[0]
    global_model = tiny_model(3)
    global_model.eval()

    def divergence(beta: float) -> float:
        fed = Federation(SPEC, {"beta": beta, "temperature": 2.0})
        out = fed.train("node-000", Payload(tensors={"model": {k: v.clone() for k, v in start.items()}}))
        local = tiny_model(3)
        local.load_state_dict(out.payload.tensors["model"])
        local.eval()
        with torch.no_grad():
            return float(fedntd.ntd_loss(local(data.x), global_model(data.x), data.y, 1.0))

    assert divergence(20.0) < divergence(0.0)


def test_fedntd_node_without_model_in_task_raises_algorithm_error() -> None:
    """A task without its model group is an AlgorithmError naming the node and the round."""
    fed = Federation(SPEC)
    with pytest.raises(AlgorithmError, match=r"no usable model.*node node-000, round 0"):
        fed.train("node-000", Payload(tensors={}))
