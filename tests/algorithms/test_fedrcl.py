"""FedRCL's two halves in-process: the hard-mined (official) and Eq. 2 (paper) SCL terms and the
divergence penalty against hand-computed values on 2-d features, level averaging, finite gradients
in degenerate batches, tap selection, the taps of a real ResNet-18 (GroupNorm), the per-epoch lr
decay, FedAvg at the neutral setting, the server's averaging, determinism; hyperparameters and checkpoints: test_contract.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedmq.fedcore.algorithms import build_hyperparams, fedrcl
from fedmq.fedcore.algorithms.base import Payload, TaskInput
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.models import build_model
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.training import TrainSettings, local_sgd
from tests.algorithms import common
from tests.algorithms.common import SETTINGS, Federation, same_state, shards, tiny_model

SPEC = fedrcl.SPEC
NEUTRAL = {"scl_weight": 0.0, "beta": 0.0, "local_lr_decay": 1.0}
SQRT3 = math.sqrt(3.0)


def at_angles(*degrees: float, norms: tuple[float, ...] | None = None) -> torch.Tensor:
    """2-d features at the given angles (with the given lengths: the losses must normalise them)."""
    norms = norms or (1.0,) * len(degrees)
    rad = [math.radians(d) for d in degrees]
    return torch.tensor([[n * math.cos(a), n * math.sin(a)] for a, n in zip(rad, norms, strict=True)])


# class 0 at 0 and 60 degrees, class 1 at 90 and 180: S01 = 1/2, S02 = 0, S03 = -1, S12 = sqrt3/2,
# S13 = -1/2, S23 = 0
FOUR = at_angles(0, 60, 90, 180, norms=(1.0, 2.0, 0.5, 3.0))
FOUR_LABELS = torch.tensor([0, 0, 1, 1])


def test_similarity_is_the_cosine_matrix_and_relu_option_clips_first() -> None:
    """S is the cosine matrix whatever the feature lengths; feature_relu clips the pooled features before it."""
    sim = fedrcl.similarity(FOUR)
    expected = torch.tensor(
        [[1, 0.5, 0, -1], [0.5, 1, SQRT3 / 2, -0.5], [0, SQRT3 / 2, 1, 0], [-1, -0.5, 0, 1]], dtype=torch.float32
    )
    assert torch.allclose(sim, expected, atol=1e-6)
    z = torch.tensor([[1.0, -1.0], [1.0, 1.0]])
    assert float(fedrcl.similarity(z)[0, 1]) == pytest.approx(0.0, abs=1e-7)
    assert float(fedrcl.similarity(z, relu=True)[0, 1]) == pytest.approx(1 / math.sqrt(2))


def test_scl_official_matches_hand_values_with_two_hard_negatives() -> None:
    """tau = 0.5: the hardest positive (S_ii = 1 included) against the two most similar other-class samples."""
    sim = fedrcl.similarity(FOUR)
    got = fedrcl.scl_official(sim, FOUR_LABELS, 0.5, topk_pos=1, topk_neg=2)
    e = math.exp
    expected = [
        math.log(1 + e(-1) + e(-3)),  # pos 1/2; negatives 0, -1
        math.log(1 + e(2 * (SQRT3 / 2 - 0.5)) + e(-2)),  # pos 1/2; negatives sqrt3/2, -1/2
        math.log(2 + e(SQRT3)),  # pos 0; negatives 0, sqrt3/2
        math.log(1 + e(-2) + e(-1)),  # pos 0; negatives -1, -1/2
    ]
    assert got.tolist() == pytest.approx(expected, rel=1e-5)
    # one negative: only the most similar other-class sample stays
    one = fedrcl.scl_official(sim, FOUR_LABELS, 0.5, topk_pos=1, topk_neg=1)
    assert one.tolist() == pytest.approx(
        [math.log(1 + e(-1)), math.log(1 + e(SQRT3 - 1)), math.log(1 + e(SQRT3)), math.log(1 + e(-1))], rel=1e-5
    )


def test_scl_official_two_positives_average_the_slots_and_singletons_use_themselves() -> None:
    """topk_pos = 2 averages two positive slots (the anchor's own S_ii = 1 among them); an anchor alone in
    its class has pos = S_ii = 1, and a slot with no second same-class sample counts 0."""
    sim = fedrcl.similarity(at_angles(0, 90, 180))
    labels = torch.tensor([0, 0, 1])
    tau = 1.0
    got = fedrcl.scl_official(sim, labels, tau, topk_pos=2, topk_neg=2)
    e = math.exp

    def slot(p: float, negs: list[float]) -> float:
        return -math.log(e(p / tau) / (e(p / tau) + sum(e(n / tau) for n in negs)))

    expected = [
        (slot(0.0, [-1.0]) + slot(1.0, [-1.0])) / 2,  # anchor 0: positives S01 = 0 and S00 = 1; negative S02 = -1
        (slot(0.0, [0.0]) + slot(1.0, [0.0])) / 2,  # anchor 1: positives 0, 1; negative S12 = 0
        slot(1.0, [-1.0, 0.0]) / 2,  # anchor 2: itself only, the second slot is empty
    ]
    assert got.tolist() == pytest.approx(expected, rel=1e-5)


def test_scl_paper_matches_eq2_averaged_over_positives() -> None:
    """Eq. 2: -log(e^{S_ij/tau} / sum_{k != i} e^{S_ik/tau}) averaged over the positives j, then over anchors."""
    e = math.exp
    got = fedrcl.scl_paper(fedrcl.similarity(FOUR), FOUR_LABELS, 0.5)
    expected = [
        math.log(e(1) + 1 + e(-2)) - 1,  # positive S01 = 1/2; others 1/2, 0, -1
        math.log(e(1) + e(SQRT3) + e(-1)) - 1,  # positive S10 = 1/2; others 1/2, sqrt3/2, -1/2
        math.log(2 + e(SQRT3)),  # positive S23 = 0; others 0, sqrt3/2, 0
        math.log(e(-2) + e(-1) + 1),  # positive S32 = 0; others -1, -1/2, 0
    ]
    assert got.tolist() == pytest.approx(expected, rel=1e-5)
    # three samples of one class at 0, 90, 180 degrees, tau = 1: anchor 0 has positives 0 and -1
    three = fedrcl.scl_paper(fedrcl.similarity(at_angles(0, 90, 180)), torch.zeros(3, dtype=torch.long), 1.0)
    assert float(three[0]) == pytest.approx(math.log(1 + e(-1)) + 0.5, rel=1e-5)
    # a singleton class has no positive: 0
    lone = fedrcl.scl_paper(fedrcl.similarity(FOUR), torch.tensor([0, 0, 1, 2]), 0.5)
    assert lone[2:].tolist() == [0.0, 0.0]


# class 0 at 0, 20 and 50 degrees (S = cos20, cos50, cos30), class 1 at 120 and 130 (cos10), class 2 alone
PEN = at_angles(0, 20, 50, 120, 130, 270)
PEN_LABELS = torch.tensor([0, 0, 0, 1, 1, 2])
COS = {d: math.cos(math.radians(d)) for d in (10, 20, 30, 50)}


def pen(*sims: float, tau: float = 0.05) -> float:
    return math.log1p(sum(math.exp((s - 1) / tau) for s in sims))


def test_penalty_official_fires_only_when_the_least_similar_batch_mate_is_above_lambda() -> None:
    """penalty_topk = 1 (code): log(1 + e^{(m_i - 1)/tau}) with m_i the least similar same-class sample, if m_i >= 0.7."""
    got = fedrcl.divergence_penalty(fedrcl.similarity(PEN), PEN_LABELS, 0.05, 0.7, topk=1)
    expected = [0.0, pen(COS[30]), 0.0, pen(COS[10]), pen(COS[10]), 0.0]  # cos50 = 0.64 < 0.7 blocks 0 and 2
    assert got.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-12)


def test_penalty_paper_set_sums_every_same_class_sample_above_lambda() -> None:
    """penalty_topk = 0 (Eq. 5's P(i)): log(e^{1/tau} + sum_{S_ik >= lambda} e^{S_ik/tau}) - 1/tau."""
    got = fedrcl.divergence_penalty(fedrcl.similarity(PEN), PEN_LABELS, 0.05, 0.7, topk=0)
    expected = [pen(COS[20]), pen(COS[20], COS[30]), pen(COS[30]), pen(COS[10]), pen(COS[10]), 0.0]
    assert got.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-12)
    # the Eq. 5 form, with its constant 1/tau, for anchor 1
    tau = 0.05
    eq5 = math.log(math.exp(1 / tau) + math.exp(COS[20] / tau) + math.exp(COS[30] / tau)) - 1 / tau
    assert float(got[1]) == pytest.approx(eq5, rel=1e-5)
    # two least similar: anchor 0 sees cos50 (below lambda, left out) and cos20
    two = fedrcl.divergence_penalty(fedrcl.similarity(PEN), PEN_LABELS, 0.05, 0.7, topk=2)
    assert float(two[0]) == pytest.approx(pen(COS[20]), rel=1e-5)


def test_penalty_gradient_pushes_too_similar_pairs_apart_and_is_zero_otherwise() -> None:
    """A descent step on the penalty lowers the similarity of a same-class pair above lambda; below it the
    gradient is exactly zero (the relaxation leaves well-spread classes alone)."""
    z = at_angles(0, 10, 90, 180).requires_grad_(True)
    labels = torch.tensor([0, 0, 1, 1])
    fedrcl.divergence_penalty(fedrcl.similarity(z), labels, 0.05, 0.7).mean().backward()
    assert z.grad is not None and float(z.grad[:2].abs().sum()) > 0 and float(z.grad[2:].abs().sum()) == 0.0
    before = float(fedrcl.similarity(z.detach())[0, 1])
    after = float(fedrcl.similarity(z.detach() - 0.5 * z.grad)[0, 1])
    assert after < before
    spread = at_angles(0, 80, 90, 180).requires_grad_(True)
    fedrcl.divergence_penalty(fedrcl.similarity(spread), labels, 0.05, 0.7).mean().backward()
    assert spread.grad is not None and float(spread.grad.abs().sum()) == 0.0


def test_rcl_loss_averages_levels_and_weights_the_two_terms() -> None:
    """w_scl mean_l mean_i l_scl + beta mean_l mean_i l_pen over the levels (averaged, not summed: spec B4)."""
    hp = build_hyperparams(SPEC, {"scl_weight": 0.5, "beta": 2.0})
    levels = [FOUR, at_angles(0, 10, 90, 180)]
    scl = [float(fedrcl.scl_official(fedrcl.similarity(z), FOUR_LABELS, 0.05).mean()) for z in levels]
    pen_ = [float(fedrcl.divergence_penalty(fedrcl.similarity(z), FOUR_LABELS, 0.05, 0.7).mean()) for z in levels]
    assert pen_[1] > 0.0  # the second level fires the penalty
    expected = 0.5 * sum(scl) / 2 + 2.0 * sum(pen_) / 2
    assert float(fedrcl.rcl_loss(levels, FOUR_LABELS, hp)) == pytest.approx(expected, rel=1e-5)
    paper = build_hyperparams(SPEC, {"rcl_variant": "paper", "beta": 0.0})
    expected_paper = sum(float(fedrcl.scl_paper(fedrcl.similarity(z), FOUR_LABELS, 0.05).mean()) for z in levels) / 2
    assert float(fedrcl.rcl_loss(levels, FOUR_LABELS, paper)) == pytest.approx(expected_paper, rel=1e-5)
    assert float(fedrcl.rcl_loss(levels, FOUR_LABELS, build_hyperparams(SPEC, NEUTRAL))) == 0.0


@pytest.mark.parametrize("variant", ["official", "paper"])
@pytest.mark.parametrize("penalty_topk", [0, 1])
@pytest.mark.parametrize("labels", [[0, 1, 2, 3], [0, 0, 0, 1], [5]], ids=["all-distinct", "one-singleton", "one"])
def test_rcl_gradients_are_finite_in_degenerate_batches(variant: str, penalty_topk: int, labels: list[int]) -> None:
    """Anchors without positives or negatives, and a batch of one, give finite losses and gradients (no inf * 0)."""
    hp = build_hyperparams(SPEC, {"rcl_variant": variant, "penalty_topk": penalty_topk, "threshold": -1.0})
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(len(labels), 3, generator=gen, requires_grad=True)
    loss = fedrcl.rcl_loss([z, z * 2], torch.tensor(labels), hp)
    loss.backward()
    assert math.isfinite(float(loss.detach())) and z.grad is not None and bool(torch.isfinite(z.grad).all())


def test_select_taps_auto_prefers_layer_taps_else_every_tap() -> None:
    """ "auto" takes layer0..layerN on a ResNet, every tap otherwise; a list is taken as given; a missing tap is a KeyError."""
    resnet = ("layer0", "layer1", "layer2", "layer3", "layer4", "features")
    assert fedrcl.select_taps("auto", resnet) == resnet[:5]
    assert fedrcl.select_taps("all", resnet) == resnet
    assert fedrcl.select_taps("auto", ("features",)) == ("features",)
    assert fedrcl.select_taps("auto", ("conv1", "conv2", "features")) == ("conv1", "conv2", "features")
    assert fedrcl.select_taps("layer4, features", resnet) == ("layer4", "features")
    with pytest.raises(KeyError, match="layer9"):
        fedrcl.select_taps("layer9", resnet)


def test_resnet18_gn_taps_feed_the_loss_and_reach_the_stem_not_the_head() -> None:
    """On a ResNet-18 (GroupNorm, 2 classes) and two 3x32x32 images, "auto" picks the five pre-ReLU
    stage taps (64, 64, 128, 256, 512 wide); one backward of the RCL term reaches the stem and not
    the linear head, with a finite loss and finite gradients."""
    model = build_model("resnet18", (3, 32, 32), 2, seed=0, norm="gn", groups=2)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 3, 32, 32, generator=gen), torch.tensor([0, 1])
    hp = build_hyperparams(SPEC, {})
    names = fedrcl.select_taps(hp.taps, model.tap_names)
    _, taps = model.forward_taps(x)
    assert names == ("layer0", "layer1", "layer2", "layer3", "layer4")
    assert [taps[n].shape[1] for n in names] == [64, 64, 128, 256, 512]
    rcl = fedrcl.rcl_loss([taps[n] for n in names], y, hp)
    rcl.backward()
    grad = model.conv1.weight.grad
    assert math.isfinite(float(rcl.detach())) and float(rcl.detach()) > 0
    assert grad is not None and bool(torch.isfinite(grad).all()) and float(grad.abs().sum()) > 0
    assert model.fc.weight.grad is None


def test_fedrcl_node_reports_ce_plus_rcl_on_the_models_taps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's objective feeds the selected taps (the MLP's 8-wide "features") to the RCL term and
    reports CE + RCL: in one full batch, the loss of the starting model."""
    seen: list[list[int]] = []
    real = fedrcl.rcl_loss

    def spy(features, labels, hp):  # type: ignore[no-untyped-def]
        seen.append([f.shape[1] for f in features])
        return real(features, labels, hp)

    monkeypatch.setattr(fedrcl, "rcl_loss", spy)
    data = shards()[1]
    assert len(set(data.y.tolist())) == 2  # positives and negatives in the batch
    model = tiny_model(0)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    hp = build_hyperparams(SPEC, {"threshold": 0.0})
    x, y = data.x, data.y
    with torch.no_grad():
        logits, taps = model.forward_taps(x)
        expected = float(nn.functional.cross_entropy(logits, y) + real([taps["features"]], y, hp))
    settings = TrainSettings(local_epochs=1, batch_size=len(data), lr=0.1)
    task = TaskInput(node_id="n0", round=0, payload=Payload(tensors={"model": start}), settings=settings)
    out = SPEC.node(hp, node_id="n0").train(task, tiny_model(5), data, torch_generator(0, "t"))
    assert seen == [[8]] and out.meta["steps"] == 1
    assert out.meta["loss"] == pytest.approx(expected, rel=1e-5)


def test_fedrcl_neutral_setting_equals_fedavg_exactly() -> None:
    """scl_weight = beta = 0 and no per-epoch decay give FedAvg's global model bit for bit; the defaults differ."""
    assert same_state(Federation("fedavg").run(2), Federation(SPEC, NEUTRAL).run(2))
    start = Payload(tensors={"model": tiny_model(0).state_dict()})
    assert not same_state(
        Federation("fedavg").train("node-001", start).payload.tensors["model"],
        Federation(SPEC).train("node-001", start).payload.tensors["model"],
    )


def test_local_lr_decay_trains_epoch_e_at_lr_times_decay_to_the_e() -> None:
    """The code's LambdaLR: with local_lr_decay 0.5 the two local epochs run at lr and lr / 2, in the same
    batch order; with one local epoch the decay changes nothing."""
    data = shards()[1]
    start = tiny_model(0).state_dict()
    fed = Federation(SPEC, {**NEUTRAL, "local_lr_decay": 0.5})
    got = fed.train("node-001", Payload(tensors={"model": {k: v.clone() for k, v in start.items()}}))
    manual = tiny_model(0)
    gen = torch_generator(0, "node-train", "node-001", 0, 0)  # Federation.train's (the driver's): round 0, attempt 0
    for epoch in range(SETTINGS.local_epochs):
        settings = TrainSettings(**{**SETTINGS.to_meta(), "local_epochs": 1, "lr": SETTINGS.lr * 0.5**epoch})
        local_sgd(manual, data, settings, gen)
    assert same_state(got.payload.tensors["model"], manual.state_dict())
    assert got.payload.meta["steps"] == SETTINGS.local_epochs * math.ceil(len(data) / SETTINGS.batch_size)


def test_fedrcl_training_is_deterministic_under_a_fixed_seed() -> None:
    """Two federations with the same seed end with the same model; another seed differs; losses are finite."""
    a = common.assert_deterministic(SPEC)
    assert all(math.isfinite(m["train_loss"]) for m in a.metrics)


def test_fedrcl_server_averages_by_size_or_plainly_and_ignores_bad_reported_losses() -> None:
    """weighted (default): (10 * 1 + 30 * 3) / 40; weighted false (the code): the plain mean 2; a reported
    loss that is not a finite number is left out of train_loss."""
    updates = [
        common.update("a", common.scalar_state(1.0), 10, loss="nan"),
        common.update("b", common.scalar_state(3.0), 30, loss=0.25),
    ]
    for weighted, value in ((True, 2.5), (False, 2.0)):
        coordinator = SPEC.coordinator(build_hyperparams(SPEC, {"weighted": weighted}), model=common.scalar_model())
        metrics = common.aggregate(coordinator, updates)
        assert float(coordinator.model.weight.detach()) == pytest.approx(value)
        assert metrics["train_loss"] == 0.25
        assert coordinator.state_dict() == {}


def test_fedrcl_model_without_taps_or_tap_raises_algorithm_error() -> None:
    """A model without forward_taps, or without a requested tap, is an AlgorithmError naming node and round."""
    with pytest.raises(AlgorithmError, match=r"forward_taps.*node n0, round 2"):
        common.train_alone(SPEC, common.plain_module())
    with pytest.raises(AlgorithmError, match=r"layer3.*node n0, round 2"):
        common.train_alone(SPEC, tiny_model(0), {"taps": "layer3"})
