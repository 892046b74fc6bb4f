"""FedDecorr's two halves in-process: both forms of the decorrelation loss on hand-computed batches
and the exact relation between them, the one-sample batch, FedAvg at beta = 0, the node actually
decorrelating its features, determinism, a model without extract/classify; hyperparameters and checkpoints: test_contract.py."""

from __future__ import annotations

import math

import pytest
import torch

from fedmq.fedcore.algorithms import build_hyperparams, feddecorr
from fedmq.fedcore.algorithms.base import Payload, TaskInput
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.training import TrainSettings
from tests.algorithms import common
from tests.algorithms.common import Federation, same_state, tiny_model

SPEC = feddecorr.SPEC

PERFECTLY_CORRELATED = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
UNCORRELATED = torch.tensor([[1.0, 1.0], [-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]])
# columns a = (1, -1, 1, -1), b = (1, 1, -1, -1), c = a + b: corr(a, b) = 0, corr(a, c) = corr(b, c) = 1 / sqrt(2)
PARTLY_CORRELATED = torch.tensor([[1.0, 1.0, 2.0], [-1.0, 1.0, 0.0], [1.0, -1.0, 0.0], [-1.0, -1.0, -2.0]])


@pytest.mark.parametrize(
    ("features", "code", "paper"),
    [
        # K = all ones: the code's M = Z^T Z with unbiased z-scores is all ones too; off-diagonal mean 1, / N = 2
        (PERFECTLY_CORRELATED, 0.5, 1.0),
        # K = I: no off-diagonal mass for the code; the paper keeps the diagonal, d / d^2 = 1/2
        (UNCORRELATED, 0.0, 0.5),
        # K has 3 ones and four entries 1/sqrt(2): paper (3 + 2) / 9; code M = 3 K, off-diagonal squares
        # (0, 0, 9/2 x 4) have mean 3, / N = 4 gives 3/4
        (PARTLY_CORRELATED, 0.75, 5.0 / 9.0),
    ],
    ids=["perfect", "none", "partial"],
)
def test_decorrelation_loss_matches_hand_computed_values(features: torch.Tensor, code: float, paper: float) -> None:
    """Both forms on batches whose correlation matrix is known in closed form."""
    assert float(feddecorr.decorrelation_loss(features, "code")) == pytest.approx(code, abs=1e-6)
    assert float(feddecorr.decorrelation_loss(features, "paper")) == pytest.approx(paper, abs=1e-6)


def test_code_form_is_a_batch_size_scaled_off_diagonal_mean_of_the_paper_correlation() -> None:
    """On a random batch, code = (N - 1)^2 / N x mean of the squared off-diagonal correlations, and
    paper = (d + sum of those squares) / d^2: the two forms differ only by scale and the constant diagonal."""
    n, d = 16, 5
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    corr = torch.corrcoef(x.t())
    off = corr[~torch.eye(d, dtype=torch.bool)].pow(2)
    code = feddecorr.decorrelation_loss(x, "code")
    paper = feddecorr.decorrelation_loss(x, "paper")
    assert float(code) == pytest.approx((n - 1) ** 2 / n * float(off.mean()), rel=1e-6)
    assert float(paper) == pytest.approx((d + float(off.sum())) / d**2, rel=1e-6)


def test_decorrelation_loss_is_invariant_to_feature_scale_and_shift() -> None:
    """Correlation ignores a per-feature affine rescaling (positive scale), in both forms."""
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = x * torch.tensor([2.0, 0.5, 10.0], dtype=torch.float64) + torch.tensor([1.0, -3.0, 7.0], dtype=torch.float64)
    for form in feddecorr.FORMS:
        a, b = feddecorr.decorrelation_loss(x, form), feddecorr.decorrelation_loss(y, form)
        assert float(a) == pytest.approx(float(b), rel=1e-6)


def test_decorrelation_loss_of_one_sample_is_zero_with_a_gradient() -> None:
    """A batch of one sample has no correlation: 0, as in the code, and backward still works (zero gradient)."""
    h = torch.ones(1, 4, requires_grad=True)
    for form in feddecorr.FORMS:
        loss = feddecorr.decorrelation_loss(h, form)
        loss.backward()
        assert float(loss.detach()) == 0.0
        assert torch.equal(h.grad, torch.zeros(1, 4))


def test_decorrelation_loss_rejects_an_unknown_form() -> None:
    with pytest.raises(ValueError, match="form"):
        feddecorr.decorrelation_loss(UNCORRELATED, "frobenius")


def test_feddecorr_neutral_setting_equals_fedavg_exactly() -> None:
    """beta = 0 gives FedAvg's global model bit for bit; beta > 0 differs."""
    fedavg = Federation("fedavg").run(2)
    assert same_state(fedavg, Federation(SPEC, {"beta": 0.0}).run(2))
    assert not same_state(fedavg, Federation(SPEC, {"beta": 1.0}).run(2))


def test_feddecorr_tiny_beta_trains_as_fedavg_up_to_the_penalty() -> None:
    """The CE part goes through extract and classify, which forward equals bit for bit: a negligible beta
    stays within float noise of FedAvg (a wrong forward would move the model by far more)."""
    fedavg = Federation("fedavg").run(1)
    tiny = Federation(SPEC, {"beta": 1e-12}).run(1)
    assert all(torch.allclose(fedavg[k], tiny[k], atol=1e-6) for k in fedavg)


def test_feddecorr_node_decorrelates_its_features() -> None:
    """Full-batch local training with a large beta leaves the shard's features less correlated (in the
    paper's measure) than plain CE training from the same start does."""
    data = Federation(SPEC).data[2]
    settings = TrainSettings(local_epochs=30, batch_size=len(data), lr=0.1)
    task = TaskInput(
        node_id="n0", round=0, payload=Payload(tensors={"model": tiny_model(2).state_dict()}), settings=settings
    )

    def correlation(beta: float) -> float:
        half = SPEC.node(build_hyperparams(SPEC, {"beta": beta}), node_id="n0")
        model = tiny_model(99)
        half.train(task, model, data, torch_generator(0, "t"))
        with torch.no_grad():
            return float(feddecorr.decorrelation_loss(model.extract(data.x).flatten(1), "paper"))

    assert correlation(1.0) < correlation(0.0)


@pytest.mark.parametrize("form", feddecorr.FORMS)
def test_feddecorr_training_is_deterministic_under_a_fixed_seed(form: str) -> None:
    """Two federations with the same seed end with the same model; another seed differs."""
    a = common.assert_deterministic(SPEC, {"form": form})
    assert all(math.isfinite(m["train_loss"]) for m in a.metrics)


def test_feddecorr_model_without_extract_raises_algorithm_error() -> None:
    """A plain module cannot give the features before the classifier: AlgorithmError naming node and round."""
    with pytest.raises(AlgorithmError, match=r"extract.*node n0, round 2"):
        common.train_alone(SPEC, common.plain_module())
