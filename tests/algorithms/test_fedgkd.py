"""FedGKD's two halves in-process: the KD term by hand, the buffer of global models and its
average, FedAvg at gamma = 0, the checkpointed buffer, bad input, determinism; hyperparameters and checkpoints: test_contract.py."""

from __future__ import annotations

import math

import pytest
import torch

from fedmq.fedcore.algorithms import build_hyperparams, fedgkd, get_algorithm
from fedmq.fedcore.algorithms.base import Payload
from fedmq.fedcore.errors import AlgorithmError
from tests.algorithms import common
from tests.algorithms.common import Federation, context, same_state, scalar_model, scalar_state, tiny_model, update

SPEC = get_algorithm("fedgkd")


def test_distillation_loss_matches_hand_computed_kl() -> None:
    """Teacher logits (2 ln 3, 0) at tau = 2 give (3/4, 1/4), student (0, 0) gives (1/2, 1/2):
    KL = 3/4 ln(3/2) + 1/4 ln(1/2), the same for every row of the batch."""
    student = torch.zeros(2, 2)
    teacher = torch.tensor([[2 * math.log(3), 0.0]]).repeat(2, 1)
    expected = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert float(fedgkd.distillation_loss(student, teacher, 2.0)) == pytest.approx(expected)
    assert float(fedgkd.distillation_loss(teacher, teacher, 2.0)) == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize(("kd_scale", "weight"), [("paper", 0.1), ("code", 0.8)])
def test_fedgkd_kd_weight_follows_the_chosen_scale(kd_scale: str, weight: float) -> None:
    """gamma = 0.2, tau = 2: the paper's gamma / 2 = 0.1, the authors' code's gamma tau^2 = 0.8."""
    assert build_hyperparams(SPEC, {"kd_scale": kd_scale}).kd_weight == pytest.approx(weight)


def _aggregate(coordinator, round: int, value: float) -> None:  # type: ignore[no-untyped-def]
    coordinator.aggregate(context(round, ("n0",)), [update("n0", scalar_state(value), 5, round)], [])


def test_fedgkd_teacher_is_the_mean_of_the_last_buffer_size_global_models() -> None:
    """No teacher before the first aggregation; then the mean of the latest (at most 2) global models."""
    coordinator = SPEC.coordinator(build_hyperparams(SPEC, {"buffer_size": 2}), model=scalar_model(7.0))
    first = coordinator.configure_round(context(0, ("n0",)))
    assert first.meta == {"distill": False} and set(first.tensors) == {"model"}
    expected_teachers = {1.0: 1.0, 2.0: 1.5, 4.0: 3.0}  # global models 1, 2, 4: buffers [1], [1, 2], [2, 4]
    for r, (value, teacher) in enumerate(expected_teachers.items()):
        _aggregate(coordinator, r, value)
        payload = coordinator.configure_round(context(r + 1, ("n0",)))
        assert payload.meta == {"distill": True}
        assert float(payload.tensors["teacher"]["weight"]) == teacher
        assert float(payload.tensors["model"]["weight"]) == value
    assert len(coordinator.buffer) == 2


def test_fedgkd_gamma_zero_sends_no_teacher() -> None:
    """With gamma = 0 the broadcast is FedAvg's: the global model and distill false."""
    coordinator = SPEC.coordinator(build_hyperparams(SPEC, {"gamma": 0.0}), model=scalar_model())
    _aggregate(coordinator, 0, 1.0)
    payload = coordinator.configure_round(context(1, ("n0",)))
    assert payload.meta == {"distill": False} and set(payload.tensors) == {"model"}


def test_fedgkd_neutral_setting_equals_fedavg_exactly() -> None:
    """gamma = 0 gives FedAvg's global model bit for bit; gamma > 0 equals it in round 0 (nothing to distil
    from yet) and differs once the teacher exists."""
    fedavg = Federation("fedavg").run(3)
    assert same_state(fedavg, Federation("fedgkd", {"gamma": 0.0}).run(3))
    assert same_state(Federation("fedavg").run(1), Federation("fedgkd").run(1))
    assert not same_state(fedavg, Federation("fedgkd", {"gamma": 2.0}).run(3))


def test_fedgkd_training_is_deterministic_under_a_fixed_seed() -> None:
    """Two federations with the same seed end with the same model and buffer; another seed differs."""
    a = common.assert_deterministic("fedgkd", {"buffer_size": 2}, rounds=3)
    assert set(a.scratch.modules) == {"fedgkd-teacher"}


def test_fedgkd_distillation_pulls_the_node_towards_the_teacher() -> None:
    """A node distilling with a large gamma ends nearer the teacher's predictions than without."""
    fed = Federation("fedgkd", {"gamma": 20.0})
    data = fed.data[0]
    start, teacher = tiny_model(0).state_dict(), tiny_model(5).state_dict()
    teacher_model = tiny_model(5).eval()

    def gap(distill: bool) -> float:
        groups = {"model": {k: v.clone() for k, v in start.items()}}
        if distill:
            groups["teacher"] = {k: v.clone() for k, v in teacher.items()}
        out = fed.train("node-000", Payload(tensors=groups, meta={"distill": distill}))
        fed.workspace.load_state_dict(out.payload.tensors["model"])
        with torch.no_grad():
            return float(fedgkd.distillation_loss(fed.workspace(data.x), teacher_model(data.x), 2.0))

    assert gap(True) < gap(False)


def test_fedgkd_state_round_trip_restores_the_buffer() -> None:
    """A coordinator restored from `state_dict` holds the same buffer and so sends the same teacher."""
    original = Federation("fedgkd", {"buffer_size": 2})
    original.run(3)
    state = {k: v.clone() for k, v in original.coordinator.state_dict().items()}
    assert sorted({k.split("/")[1] for k in state}) == ["0", "1"]
    restored = SPEC.coordinator(build_hyperparams(SPEC, {"buffer_size": 2}), model=tiny_model(3))
    restored.model.load_state_dict(original.coordinator.model.state_dict())
    restored.load_state_dict(state)
    assert same_state(restored.teacher(), original.coordinator.teacher())
    smaller = SPEC.coordinator(build_hyperparams(SPEC, {"buffer_size": 1}), model=tiny_model(3))
    smaller.load_state_dict(state)  # a smaller buffer keeps the newest models
    assert same_state(smaller.teacher(), original.coordinator.buffer[-1])


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"velocity/0/net.1.weight": torch.zeros(1)}, "unexpected entry"),
        ({"buffer/x/net.1.weight": torch.zeros(1)}, "unexpected entry"),
        ({"buffer/1/net.1.weight": torch.zeros(8, 4)}, "not 0..0"),
        ({"buffer/0/net.1.weight": torch.zeros(8, 4)}, "does not match"),
    ],
)
def test_fedgkd_load_state_dict_with_bad_entries_raises_value_error(state: dict[str, torch.Tensor], match: str) -> None:
    """Entries that are not a contiguous buffer of whole models of this architecture are refused."""
    coordinator = Federation("fedgkd").coordinator
    with pytest.raises(ValueError, match=match):
        coordinator.load_state_dict(state)


@pytest.mark.parametrize(
    ("meta", "groups", "match"),
    [
        ({"distill": True}, ("model",), "no usable teacher"),
        ({}, ("model", "teacher"), "'distill' must be true or false"),
        ({"distill": "yes"}, ("model", "teacher"), "'distill' must be true or false"),
    ],
)
def test_fedgkd_node_with_bad_task_raises_algorithm_error(
    meta: dict[str, object], groups: tuple[str, ...], match: str
) -> None:
    """A task that asks for distillation without a teacher, or has no valid distill flag, is an AlgorithmError."""
    fed = Federation("fedgkd")
    tensors = {g: tiny_model(0).state_dict() for g in groups}
    with pytest.raises(AlgorithmError, match=match):
        fed.train("node-000", Payload(tensors=tensors, meta=meta))
