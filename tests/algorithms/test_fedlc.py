"""FedLC's two halves in-process: the margins tau n_c^{-1/4} and the calibrated cross-entropy by hand,
the missing class at -inf (no NaN, no gradient), the shared label-count helper, FedAvg at tau = 0,
determinism, what the update carries; hyperparameters and checkpoints: test_contract.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from fedmq.fedcore.algorithms import fedlc
from fedmq.fedcore.algorithms.base import Payload
from fedmq.fedcore.errors import AlgorithmError
from tests.algorithms import common
from tests.algorithms.common import Federation, same_state, tiny_model

SPEC = fedlc.SPEC


def test_fedlc_offsets_are_minus_tau_n_to_the_minus_quarter_and_minus_inf_when_missing() -> None:
    """Counts (16, 1, 0), tau 0.5: offsets (-0.5 / 2, -0.5, -inf); tau 0 gives zeros, not NaN."""
    offsets = fedlc.fedlc_offsets(torch.tensor([16.0, 1.0, 0.0]), 0.5)
    assert offsets[:2].tolist() == pytest.approx([-0.25, -0.5])
    assert offsets[2] == float("-inf")
    assert fedlc.fedlc_offsets(torch.tensor([16.0, 1.0, 0.0]), 0.0).tolist() == [0.0, 0.0, 0.0]


def test_calibrated_cross_entropy_matches_hand_value() -> None:
    """Zero logits, label 0, offsets (-0.25, -0.5, -inf): -log(e^-0.25 / (e^-0.25 + e^-0.5)); the missing
    class contributes nothing to the denominator."""
    offsets = fedlc.fedlc_offsets(torch.tensor([16.0, 1.0, 0.0]), 0.5)
    loss = fedlc.calibrated_cross_entropy(torch.zeros(1, 3), torch.tensor([0]), offsets)
    expected = -math.log(math.exp(-0.25) / (math.exp(-0.25) + math.exp(-0.5)))
    assert float(loss) == pytest.approx(expected, rel=1e-6)


def test_calibrated_cross_entropy_equals_the_fedvls_code_rule_on_present_classes() -> None:
    """On random logits with every class present, the loss is CE(f - tau n^{-1/4}, y), as in FedVLS's
    ``clientlogitcal.py`` (``output -= cal_tem * class2data ** (-0.25)``)."""
    g = torch.Generator().manual_seed(0)
    logits, y = torch.randn(6, 4, generator=g), torch.tensor([0, 1, 2, 3, 3, 1])
    counts = torch.tensor([5.0, 2.0, 9.0, 30.0])
    reference = F.cross_entropy(logits - 0.1 * counts ** (-0.25), y)
    assert float(fedlc.calibrated_cross_entropy(logits, y, fedlc.fedlc_offsets(counts, 0.1))) == pytest.approx(
        float(reference), rel=1e-6
    )


def test_missing_class_gets_no_gradient_and_no_nan() -> None:
    """A class at -inf is out of the softmax: finite loss, finite gradient, exactly 0 on its logit."""
    logits = torch.randn(4, 3, generator=torch.Generator().manual_seed(1), requires_grad=True)
    offsets = fedlc.fedlc_offsets(torch.tensor([3.0, 0.0, 2.0]), 1.0)
    loss = fedlc.calibrated_cross_entropy(logits, torch.tensor([0, 2, 2, 0]), offsets)
    loss.backward()
    assert math.isfinite(float(loss.detach()))
    assert torch.isfinite(logits.grad).all()
    assert torch.equal(logits.grad[:, 1], torch.zeros(4))
    assert (logits.grad[:, [0, 2]] != 0).any()


def test_calibrated_cross_entropy_with_wrong_width_raises_value_error() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        fedlc.calibrated_cross_entropy(torch.zeros(2, 3), torch.tensor([0, 1]), torch.zeros(4))


def test_node_with_empty_shard_raises_algorithm_error() -> None:
    with pytest.raises(AlgorithmError, match=r"empty.*node n0, round 2"):
        common.train_alone(SPEC, tiny_model(), data=common.empty_shard())


def test_fedlc_neutral_setting_equals_fedavg_exactly() -> None:
    """tau = 0 gives FedAvg's global model bit for bit; the default tau does not."""
    fedavg = Federation("fedavg").run(2)
    assert same_state(fedavg, Federation(SPEC, {"tau": 0.0}).run(2))
    assert not same_state(fedavg, Federation(SPEC).run(2))


def test_fedlc_training_is_deterministic_finite_and_sends_only_the_model() -> None:
    """Same seed, same model; another seed differs; every node (each lacks a class) reports a finite
    loss, and the update holds the model, the loss and the steps only: the histogram stays home."""
    a = common.assert_deterministic(SPEC, {"tau": 1.0})
    payload = Payload(tensors={"model": tiny_model().state_dict()})
    for node in a.node_ids:
        out = a.train(node, payload)
        assert set(out.payload.tensors) == {"model"} and set(out.payload.meta) == {"loss", "steps"}
        assert math.isfinite(out.payload.meta["loss"])
        assert all(torch.isfinite(t).all() for t in out.payload.tensors["model"].values())
