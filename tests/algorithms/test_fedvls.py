"""FedVLS's two halves in-process: each loss by hand on a tiny batch (Eq. 2's calibrated CE, Eq. 3's
vacant-class distillation, the official and the paper's logit suppression) and against literal
transcriptions of the authors' code, the invariants (no distillation for a node missing fewer than
two classes, gradients of L_dis only on vacant logits, the paper form's guard), the teacher's
BatchNorm mode, Algorithm 1's aggregation over the total data, FedAvg at the neutral setting,
determinism, what the update carries, bad wire values; hyperparameters and checkpoints: test_contract.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedmq.fedcore.algorithms import build_hyperparams, fedvls
from fedmq.fedcore.algorithms.base import Payload
from fedmq.fedcore.participation import ParticipationRecord
from tests.algorithms import common
from tests.algorithms.common import Federation, context, same_state, scalar_model, scalar_state, tiny_model, update

SPEC = fedvls.SPEC
EPS = 1e-9


# -- L_cal (Eq. 2) ------------------------------------------------------------------------------


def test_prior_calibrated_cross_entropy_matches_hand_value() -> None:
    """Counts (3, 1, 0): offsets log(p + eps); logits (1, 0, 5) on label 1 give
    -log(0.25 / (0.75 e + 0.25 + 1e-9 e^5)): the vacant class is all but removed from the softmax."""
    offsets = fedvls.prior_offsets(torch.tensor([3.0, 1.0, 0.0]), EPS)
    assert offsets.tolist() == pytest.approx([math.log(0.75), math.log(0.25), math.log(EPS)], rel=1e-6)
    loss = fedvls.calibrated_cross_entropy(torch.tensor([[1.0, 0.0, 5.0]]), torch.tensor([1]), offsets)
    expected = -math.log(0.25 / (0.75 * math.e + 0.25 + EPS * math.exp(5)))
    assert float(loss) == pytest.approx(expected, rel=1e-6)


# -- L_dis (Eq. 3) ------------------------------------------------------------------------------


def test_vacant_distillation_matches_hand_kl() -> None:
    """Vacant classes {2, 3}; teacher logits (ln 3, 0) there, student (0, 0): KL = 3/4 ln(3/2) + 1/4 ln(1/2)
    per sample, whatever the other logits, averaged over the batch."""
    student = torch.tensor([[5.0, -1.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    teacher = torch.tensor([[9.0, -3.0, math.log(3), 0.0], [0.0, 7.0, math.log(3), 0.0]])
    loss = fedvls.vacant_distillation(student, teacher, torch.tensor([2, 3]))
    assert float(loss) == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5), rel=1e-6)


@pytest.mark.parametrize("vacant", [[], [1]])
def test_vacant_distillation_is_zero_for_fewer_than_two_vacant_classes(vacant: list[int]) -> None:
    """|O| = 0 and |O| = 1 give exactly 0 even when teacher and student disagree everywhere."""
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g) * 3
    assert float(fedvls.vacant_distillation(student, teacher, torch.tensor(vacant, dtype=torch.long))) == 0.0


def test_vacant_distillation_equals_the_code_and_moves_only_vacant_logits() -> None:
    """On random logits it equals the code's KLDivLoss(batchmean)(log_softmax(s[:, O]), softmax(t[:, O]));
    its gradient is zero on every non-vacant logit and sums to zero over O for each sample."""
    g = torch.Generator().manual_seed(1)
    student = torch.randn(6, 5, generator=g).requires_grad_(True)
    teacher = torch.randn(6, 5, generator=g)
    vacant = fedvls.vacant_classes(torch.tensor([4.0, 0.0, 2.0, 0.0, 0.0]))
    assert vacant.tolist() == [1, 3, 4]
    code = nn.KLDivLoss(reduction="batchmean")(
        F.log_softmax(student[:, vacant], dim=1), F.softmax(teacher[:, vacant], dim=1)
    )
    loss = fedvls.vacant_distillation(student, teacher, vacant)
    assert float(loss.detach()) == pytest.approx(float(code.detach()), rel=1e-5)
    loss.backward()
    assert torch.equal(student.grad[:, [0, 2]], torch.zeros(6, 2))
    assert torch.allclose(student.grad[:, vacant].sum(dim=1), torch.zeros(6), atol=1e-7)


# -- L_logit (Eqs. 4-5 and the code's form) -----------------------------------------------------


def test_official_logit_suppression_matches_hand_value() -> None:
    """Counts (3, 1), K = 2, logits ((1, 2), (3, 4)), labels (0, 1): a = f - log p + log(1/2) adds
    (log 2/3, log 2); zero-filled own-class entries add exp(0) = 1; minus log B = log 2:
    0.75 [log(1 + 2/3 e^3) - log 2] + 0.25 [log(2 e^2 + 1) - log 2]."""
    prior = torch.tensor([0.75, 0.25])
    loss = fedvls.logit_suppression_official(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([0, 1]), prior, EPS)
    expected = 0.75 * (math.log(1 + 2 / 3 * math.exp(3)) - math.log(2)) + 0.25 * (
        math.log(2 * math.exp(2) + 1) - math.log(2)
    )
    assert float(loss) == pytest.approx(expected, rel=1e-6)


def _code_lade(y_pred: torch.Tensor, target: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """A literal transcription of the authors' ``new_LADEloss`` (fedvls.md 1.4), without its 0.005."""
    classes = y_pred.shape[1]
    prior = counts / counts.sum()
    balanced = torch.tensor(1.0 / classes)
    spread = (y_pred - torch.log(prior + 1e-9) + torch.log(balanced + 1e-9)).T * (
        target != torch.arange(0, classes).view(-1, 1).type_as(target)
    )
    second = torch.logsumexp(spread, -1) - math.log(spread.size(-1))
    return -torch.sum(-second * prior)


def test_official_logit_suppression_equals_the_code_on_random_batches() -> None:
    """Random logits, labels and a prior with vacant classes: the same value as the code's term."""
    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([7.0, 0.0, 3.0, 12.0, 0.0, 1.0])
    for _ in range(3):
        logits = torch.randn(9, 6, generator=g) * 2
        y = torch.multinomial(counts / counts.sum(), 9, replacement=True, generator=g)
        ours = fedvls.logit_suppression_official(logits, y, counts / counts.sum(), EPS)
        assert float(ours) == pytest.approx(float(_code_lade(logits, y, counts)), rel=1e-5)


def test_paper_logit_suppression_matches_hand_value() -> None:
    """p = (1/2, 1/2), logits ((1, 2), (3, 4)), labels (0, 1): L^0 = log(e^3 / 2), L^1 = log(e^2 / 2),
    L = 2.5 - log 2 (samples of class c are excluded, the mean is over B)."""
    loss = fedvls.logit_suppression_paper(
        torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([0, 1]), torch.tensor([0.5, 0.5])
    )
    assert float(loss) == pytest.approx(2.5 - math.log(2), rel=1e-6)


def test_paper_logit_suppression_skips_a_class_that_fills_the_batch() -> None:
    """Every sample has label 0: class 0's term (log 0) is left out, no NaN in value or gradient, and
    class 0's logits get no gradient; class 1 gives p(1) log((e^2 + e^4) / 2)."""
    logits = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    loss = fedvls.logit_suppression_paper(logits, torch.tensor([0, 0]), torch.tensor([2 / 3, 1 / 3]))
    assert float(loss.detach()) == pytest.approx(1 / 3 * math.log((math.exp(2) + math.exp(4)) / 2), rel=1e-6)
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert torch.equal(logits.grad[:, 0], torch.zeros(2))


def test_logit_suppression_dispatches_on_the_form() -> None:
    logits, y, prior = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([0, 1]), torch.tensor([0.5, 0.5])
    assert torch.equal(
        fedvls.logit_suppression(logits, y, prior, "paper", EPS), fedvls.logit_suppression_paper(logits, y, prior)
    )
    assert torch.equal(
        fedvls.logit_suppression(logits, y, prior, "official", EPS),
        fedvls.logit_suppression_official(logits, y, prior, EPS),
    )
    with pytest.raises(ValueError, match="logit_suppression"):
        fedvls.logit_suppression(logits, y, prior, "lade", EPS)


# -- the teacher --------------------------------------------------------------------------------


@pytest.mark.parametrize(("bn", "bn_training"), [("batch", True), ("running", False)])
def test_teacher_mode_puts_only_batchnorm_in_train_mode_for_batch(bn: str, bn_training: bool) -> None:
    """ "batch": BatchNorm uses batch statistics (the code's train-mode copy) while dropout stays off;
    "running": plain eval mode."""
    teacher = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2)).train()
    fedvls.set_teacher_mode(teacher, bn)
    assert teacher[1].training is bn_training
    assert not teacher.training and not teacher[2].training and not teacher[0].training


# -- the node half ------------------------------------------------------------------------------


def test_shards_have_two_one_and_one_vacant_classes() -> None:
    """The fixture the node tests rely on: node 0 lacks classes 1 and 2, nodes 1 and 2 lack one class."""
    fed = Federation(SPEC)
    assert [d.label_histogram() for d in fed.data] == [[20, 0, 0], [19, 11, 0], [0, 16, 24]]


def test_distillation_changes_nothing_for_nodes_missing_fewer_than_two_classes() -> None:
    """lam = 0 and lam = 5 train nodes 1 and 2 (one vacant class each) to the same model bit for bit,
    without ever building a teacher; node 0 (two vacant classes) differs and builds one."""
    start = Payload(tensors={"model": tiny_model(0).state_dict()})
    without, with_kd = Federation(SPEC, {"lam": 0.0}), Federation(SPEC, {"lam": 5.0})
    for node in ("node-001", "node-002"):
        a, b = without.train(node, start), with_kd.train(node, start)
        assert same_state(a.payload.tensors["model"], b.payload.tensors["model"])
    assert with_kd.scratch.modules == {}
    a, b = without.train("node-000", start), with_kd.train("node-000", start)
    assert not same_state(a.payload.tensors["model"], b.payload.tensors["model"])
    assert set(with_kd.scratch.modules) == {"fedvls-teacher"}


def _vacant_gap(fed: Federation, start: dict[str, torch.Tensor]) -> float:
    """KL over node 0's vacant classes between the start model (its teacher) and the model it trains."""
    out = fed.train("node-000", Payload(tensors={"model": {k: v.clone() for k, v in start.items()}}))
    fed.workspace.load_state_dict(out.payload.tensors["model"])
    teacher = tiny_model(0).eval()
    data = fed.data[0]
    with torch.no_grad():
        return float(fedvls.vacant_distillation(fed.workspace(data.x), teacher(data.x), torch.tensor([1, 2])))


def test_distillation_keeps_the_vacant_class_distribution_near_the_global_model() -> None:
    """Node 0 (class 0 only) trained on plain CE drifts on its vacant classes {1, 2}; with a large lambda
    it ends nearer its teacher there with lambda = 1 (lambda x lr much above 1 overshoots). With Eq. 2 and
    lam = 0 a single-class node hardly moves at all, so the base loss is plain CE here."""
    start = tiny_model(0).state_dict()
    plain = {"calibration": "none", "logit_scale": 0.0}
    drift = _vacant_gap(Federation(SPEC, {**plain, "lam": 0.0}), start)
    assert drift > 0.0
    assert _vacant_gap(Federation(SPEC, {**plain, "lam": 1.0}), start) < 0.75 * drift


def test_fedvls_neutral_setting_equals_fedavg_exactly() -> None:
    """calibration none, lam 0, logit_scale 0 gives FedAvg's global model bit for bit; the defaults do not."""
    fedavg = Federation("fedavg").run(1)
    neutral = {"calibration": "none", "lam": 0.0, "logit_scale": 0.0}
    assert same_state(fedavg, Federation(SPEC, neutral).run(1))
    assert not same_state(fedavg, Federation(SPEC).run(1))


def test_fedvls_training_is_deterministic_and_sends_only_the_model() -> None:
    """Same seed, same model; another seed differs; the update holds the model, the loss and the
    steps only (the histogram and the vacant set stay on the node)."""
    a = common.assert_deterministic(SPEC, {"lam": 1.0}, rounds=1)
    out = a.train("node-000", Payload(tensors={"model": tiny_model().state_dict()}))
    assert set(out.payload.tensors) == {"model"} and set(out.payload.meta) == {"loss", "steps"}


@pytest.mark.parametrize(
    "options",
    [
        {"logit_suppression": "paper", "logit_scale": 1.0},
        {"calibration": "fedlc", "fedlc_tau": 0.5},
        {"teacher_bn": "running", "lam": 0.5},
        {"aggregation": "total"},
    ],
)
def test_fedvls_options_train_to_finite_models(options: dict[str, object]) -> None:
    """Each paper/code option runs a round with every node reporting a finite loss and weights."""
    fed = Federation(SPEC, options)
    state = fed.run(1)
    assert all(torch.isfinite(t).all() for t in state.values())
    assert math.isfinite(fed.metrics[-1]["train_loss"])


# -- the coordinator half -----------------------------------------------------------------------


def _coordinator(**hp: object):  # type: ignore[no-untyped-def]
    return SPEC.coordinator(build_hyperparams(SPEC, hp), model=scalar_model(0.0))


def _round(coordinator, rows: list[tuple[str, float, int, object]], known: dict[str, int]):  # type: ignore[no-untyped-def]
    """Aggregate updates (node, value, num_samples, loss) with a participation record that also knows `known`."""
    record = ParticipationRecord()
    for node, n in known.items():
        record.ensure(node, num_samples=n)
    for node, _, n, _ in rows:
        record.accepted(node, 0, num_samples=n)
    updates = [update(node, scalar_state(v), n, 0, loss=loss) for node, v, n, loss in rows]
    metrics = coordinator.aggregate(context(0, tuple(r[0] for r in rows), participation=record), updates, [])
    return float(coordinator.model.weight.detach()), metrics


def test_total_aggregation_is_algorithm_1_and_participants_is_fedavg() -> None:
    """Global 0; updates 1 (10 samples) and 3 (30), a third known node with 60: Algorithm 1 gives
    0.6 x 0 + 0.1 x 1 + 0.3 x 3 = 1.0; over the participants (the code) (10 + 90) / 40 = 2.5."""
    rows = [("a", 1.0, 10, 1.0), ("b", 3.0, 30, 2.0)]
    value, metrics = _round(_coordinator(aggregation="total"), rows, {"c": 60})
    assert value == pytest.approx(1.0, abs=1e-6)
    assert metrics["global_share"] == pytest.approx(0.6)
    assert metrics["train_loss"] == pytest.approx(1.75)
    value, metrics = _round(_coordinator(), rows, {"c": 60})
    assert value == pytest.approx(2.5, abs=1e-6)


def test_total_aggregation_with_every_node_present_equals_fedavg() -> None:
    """When every known node takes part, |D| is the round's data and the two forms coincide."""
    rows = [("a", 1.0, 10, 1.0), ("b", 3.0, 30, 1.0)]
    value, metrics = _round(_coordinator(aggregation="total"), rows, {})
    assert value == pytest.approx(2.5, abs=1e-6) and metrics["global_share"] == 0.0


@pytest.mark.parametrize("aggregation", ["participants", "total"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1.0", None, True])
def test_bad_reported_loss_is_left_out_of_the_train_loss(aggregation: str, bad: object) -> None:
    """A loss from the wire that is not a finite number does not reach the round's train_loss."""
    rows = [("a", 1.0, 10, 0.5), ("b", 3.0, 30, bad)]
    _, metrics = _round(_coordinator(aggregation=aggregation), rows, {})
    assert metrics["train_loss"] == pytest.approx(0.5)
