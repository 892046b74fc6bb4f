"""The loss-term methods trained as one group (`LossTermNode.train_group` on their `group_term`) give
each node what its own `train` gives it: in float64, where rounding cannot hide another objective,
every weight within 1e-10, and the term visibly changes the result (so a group that ignored it fails)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch

from fedmq.fedcore.algorithms import build_hyperparams, fedacd, get_algorithm
from fedmq.fedcore.algorithms.base import GroupMember, Payload, TaskInput
from fedmq.fedcore.data import TensorDataset, load_dataset
from fedmq.fedcore.models import build_model
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.training import TrainSettings
from fedmq.fedcore.vectorized import NodeBatch, graph_mode
from tests.fedcore.captured_steps import every_step_whole

SETTINGS = TrainSettings(local_epochs=2, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-3)
SIZES = (30, 17, 1, 45)
"""Unequal shards: a trailing batch of one (17), a single sample, and one longer than the rest."""
EXACT = 1e-10
CPU = torch.device("cpu")

CASES: dict[str, dict[str, Any]] = {
    "fedprox": {"mu": 0.5},
    "fedlc": {"tau": 1.0},
    "fedrs": {"alpha": 0.5},
    "fedntd": {"beta": 1.0, "temperature": 2.0},
    "fedgkd": {"gamma": 0.5},
    "kdia": {"lambda_kd": 0.5, "lambda_gen": 0.5, "kd_direction": "reverse", "noise_dim": 8},
    "moon": {"mu": 1.0, "temperature": 0.5, "previous_models": 2},
    "fedvls": {"lam": 1.0, "logit_scale": 0.5},
    "fedrcl": {"threshold": 0.3, "topk_pos": 2, "topk_neg": 3},  # local_lr_decay 0.998: epoch by epoch
    "fedacd": {},  # the paper's: log Delta from the running P, renewed each epoch, and Mixup (alpha 1)
    "feddecorr": {"beta": 1.0},  # the code's form; a batch of one (17 = 16 + 1) gives 0
}
FLOAT32 = 1e-5
"""FedRCL computes its similarities in float32 (in `train` too): agreement to float32 rounding only."""
TOLERANCE = {"fedrcl": FLOAT32}
NEUTRAL: dict[str, dict[str, Any]] = {
    "fedprox": {"mu": 0.0},
    "fedlc": {"tau": 0.0},
    "fedrs": {"alpha": 1.0},
    "fedntd": {"beta": 0.0},
    "fedgkd": {"gamma": 0.0},
    "kdia": {"lambda_kd": 0.0, "lambda_gen": 0.0},
    "moon": {"mu": 0.0},
    "fedvls": {"calibration": "none", "lam": 0.0, "logit_scale": 0.0},
    "fedrcl": {"scl_weight": 0.0, "beta": 0.0, "local_lr_decay": 1.0},
    "fedacd": {"l1_weight": 0.0, "logit_adjust": False, "mixup_alpha": 0.0},
    "feddecorr": {"beta": 0.0},
}


@pytest.fixture(scope="module")
def digits() -> TensorDataset:
    data = load_dataset("digits", seed=0, augment={"crop": 8, "padding": 1, "flip": True}).train
    return dataclasses.replace(data, x=data.x.double())


def shards(data: TensorDataset, sizes: Sequence[int] = SIZES) -> list[TensorDataset]:
    gen = torch.Generator().manual_seed(3)
    # skewed labels, so that label-dependent terms (FedLC, FedRS) differ per node
    order = torch.argsort(data.y.double() + torch.rand(len(data), generator=gen, dtype=torch.float64) * 4)
    out, start = [], 0
    for n in sizes:
        out.append(data.subset(order[start : start + n].numpy()))
        start += n * 7
    return out


def spare_models(input_shape: tuple[int, ...], device: torch.device) -> Callable[..., torch.nn.Module]:
    """A task's `scratch`: spare models kept by key, on `device`, as a node's workspace keeps them
    (fednode.workspace)."""
    scratch: dict[str, torch.nn.Module] = {}

    def spare(key: str, build: Any = None) -> torch.nn.Module:
        if key not in scratch:
            module = build() if build is not None else build_model("cnn", input_shape, 10, seed=0)
            scratch[key] = module.double().to(device)
        return scratch[key]

    return spare


def members(method: str, hp: Mapping[str, Any], datasets: Sequence[TensorDataset]) -> list[GroupMember]:
    spec = get_algorithm(method)
    params = build_hyperparams(spec, dict(hp))
    model = build_model("cnn", datasets[0].input_shape, 10, seed=5).double()
    tensors = {"model": model.state_dict()}
    meta: dict[str, Any] = {}
    if method in ("fedgkd", "kdia"):  # a teacher other than the model, as the buffer's mean would be
        tensors["teacher"] = build_model("cnn", datasets[0].input_shape, 10, seed=9).double().state_dict()
        meta["distill"] = True
    if method == "kdia":  # and a trained generator's weights, with running statistics of its own
        from fedmq.fedcore.algorithms.kdia.generator import build_generator

        generator = build_generator(params.noise_dim, model).double()
        with torch.no_grad():
            for name, t in generator.named_buffers():
                if name.endswith("running_mean"):
                    t.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
        tensors["generator"] = generator.state_dict()
        meta["generate"] = True
    if method == "scaffold":  # the server's control c
        gen = torch.Generator().manual_seed(30)
        tensors["control"] = {
            n: torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.05 for n, p in model.named_parameters()
        }
    if method == "fedproto":  # global prototypes for some classes only
        present = torch.arange(model.num_classes) % 3 != 0
        centres = torch.randn(model.num_classes, model.feature_dim, generator=torch.Generator().manual_seed(60))
        tensors["prototypes"] = {"weight": centres * present[:, None], "present": present}
    if method == "fednh":  # the coordinator's prototypes and s, as its task carries them
        classes, dim = model.num_classes, model.feature_dim
        prototypes = torch.randn(classes, dim, generator=torch.Generator().manual_seed(80), dtype=torch.float64)
        tensors["prototypes"], tensors["scale"] = {"weight": prototypes}, {"value": torch.tensor([3.0])}
    spare = spare_models(datasets[0].input_shape, datasets[0].x.device)
    group = [
        GroupMember(
            half=spec.node(params, node_id=f"node-{i}"),
            task=TaskInput(
                node_id=f"node-{i}",
                round=1,
                payload=Payload(tensors=tensors, meta=meta),
                settings=SETTINGS,
                scratch=spare,
            ),
            data=data,
            generator=torch_generator(4, "node-train", f"node-{i}", 1),
        )
        for i, data in enumerate(datasets)
    ]
    if method == "moon":  # node i has min(i, 2) previous models of its own: none, one, a full FIFO
        for i, member in enumerate(group):
            member.half.previous = [  # type: ignore[attr-defined]
                build_model("cnn", datasets[0].input_shape, 10, seed=20 + 2 * i + j).double().state_dict()
                for j in range(min(i, 2))
            ]
    return group


def difference(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("method", sorted(CASES))
def test_group_term_trains_each_node_as_its_own_objective(digits: TensorDataset, method: str) -> None:
    assert_group_is_each_own_train(digits, method, CASES[method], shards(digits))


def assert_group_is_each_own_train(
    digits: TensorDataset,
    method: str,
    hp: Mapping[str, Any],
    datasets: list[TensorDataset],
    device: torch.device = CPU,
) -> None:
    """The group's updates are each member's own `train`'s (float64, 1e-10), and differ from FedAvg's;
    the data and models on `device`."""
    datasets = [d.to(device) for d in datasets]
    group = members(method, hp, datasets)
    workspace = build_model("cnn", digits.input_shape, 10, seed=6).double().to(device)
    assert group[0].half.group_refusal(workspace) is None
    grouped = group[0].half.train_group(group, workspace)
    plain = members("fedavg", {}, datasets)
    fedavg = plain[0].half.train_group(plain, copy.deepcopy(workspace))
    moved = []
    for member, payload, baseline in zip(members(method, hp, datasets), grouped, fedavg, strict=True):
        alone = member.half.train(member.task, copy.deepcopy(workspace), member.data, member.generator)
        assert payload.meta["steps"] == alone.meta["steps"] and set(payload.meta) == set(alone.meta)
        for term in ("kd_loss", "gen_loss"):
            if term in alone.meta:
                assert payload.meta[term] == pytest.approx(alone.meta[term], rel=1e-9)
        assert payload.meta["loss"] == pytest.approx(alone.meta["loss"], rel=TOLERANCE.get(method, 1e-9))
        if "score" in alone.meta:  # FedACD's, from a float32 softmax of the trained model
            assert payload.meta["score"] == pytest.approx(alone.meta["score"], rel=1e-6)
        assert difference(payload.tensors["model"], alone.tensors["model"]) < TOLERANCE.get(method, EXACT)
        moved.append(difference(payload.tensors["model"], baseline.tensors["model"]))
    assert max(moved) > 1e-4, "the term changed nothing"


@pytest.mark.parametrize("method", sorted(CASES))
def test_group_term_with_every_step_as_its_captured_kind_trains_each_node_as_its_own_objective(
    digits: TensorDataset, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The steps a GPU replays (each its kind's first b nodes, masked where some of them have no batch
    left: `step_kind`), run eagerly on the CPU: each member still gets its own `train`'s update. Five
    shards whose steps (4, 2, 2, 6, 6) make the kinds 5 nodes, 4 masked (3 train) and 2."""
    from fedmq.fedcore import vectorized

    monkeypatch.setattr(vectorized, "run_steps", every_step_whole)
    assert_group_is_each_own_train(digits, method, CASES[method], shards(digits, (*SIZES, 40)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", sorted(CASES))
def test_group_term_captured_as_a_cuda_graph_trains_each_node_as_its_own_objective(
    digits: TensorDataset, method: str
) -> None:
    """On a GPU, each step after the third a replay of one captured graph (whatever the objective keeps
    across steps: terms, sums, FedACD's carried P), each member still gets its own `train`'s update."""
    with graph_mode("on"):
        assert_group_is_each_own_train(digits, method, CASES[method], shards(digits), torch.device("cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fedacd_clean_p_renewed_between_cuda_graph_replays(digits: TensorDataset) -> None:
    """On a GPU with graphs, FedACD's clean P is renewed between replays (outside the graph, into the
    buffers it reads): each member still gets its own `train`'s update."""
    with graph_mode("on"):
        hp = {"p_estimate": "clean", "mixup_alpha": 0.0}
        assert_group_is_each_own_train(digits, "fedacd", hp, shards(digits), torch.device("cuda"))


@pytest.mark.parametrize("method", sorted(CASES))
def test_group_term_at_the_neutral_setting_is_fedavg(digits: TensorDataset, method: str) -> None:
    datasets = shards(digits)
    group = members(method, NEUTRAL[method], datasets)
    workspace = build_model("cnn", digits.input_shape, 10, seed=6).double()
    plain = members("fedavg", {}, datasets)
    for got, want in zip(
        group[0].half.train_group(group, copy.deepcopy(workspace)),
        plain[0].half.train_group(plain, copy.deepcopy(workspace)),
        strict=True,
    ):
        assert difference(got.tensors["model"], want.tensors["model"]) == 0.0


def test_moon_group_keeps_each_members_trained_model_and_reads_its_own_previous_ones(digits: TensorDataset) -> None:
    """Each member's half keeps its own trained model as `train` keeps it (FIFO of previous_models), and
    the negatives are each member's own previous models: swapping two members' histories changes the
    result (so a group that read one member's history for all would fail the agreement above)."""
    datasets = shards(digits)
    workspace = build_model("cnn", digits.input_shape, 10, seed=6).double()
    group = members("moon", CASES["moon"], datasets)
    grouped = group[0].half.train_group(group, copy.deepcopy(workspace))
    for i, (member, payload) in enumerate(zip(group, grouped, strict=True)):
        previous = member.half.previous  # type: ignore[attr-defined]
        assert len(previous) == min(i + 1, 2)
        assert difference(previous[-1], payload.tensors["model"]) == 0.0
        assert previous[-1]["classifier.3.bias"].data_ptr() != payload.tensors["model"]["classifier.3.bias"].data_ptr()
    swapped = members("moon", CASES["moon"], datasets)
    history = [m.half.previous for m in swapped]  # type: ignore[attr-defined]
    swapped[2].half.previous, swapped[3].half.previous = history[3], history[2]  # type: ignore[attr-defined]
    other = swapped[0].half.train_group(swapped, copy.deepcopy(workspace))
    assert difference(other[2].tensors["model"], grouped[2].tensors["model"]) > 1e-6


@pytest.mark.parametrize(
    "hp",
    [
        {"logit_suppression": "paper", "logit_scale": 1.0, "calibration": "fedlc", "fedlc_tau": 1.0, "lam": 1.0},
        {"calibration": "none", "logit_scale": 0.0, "lam": 1.0},  # L_dis alone
        {"calibration": "none", "logit_scale": 0.5, "lam": 0.0},  # the code's L_logit alone
    ],
    ids=["paper-fedlc", "distillation", "suppression"],
)
def test_fedvls_group_forms_of_each_term(digits: TensorDataset, hp: dict[str, Any]) -> None:
    """Each FedVLS term alone, and the paper's L_logit with FedLC's margins, on the skewed shards and on
    two shards that hold every class or all but one (|O| < 2: no L_dis, while the others distil)."""
    datasets = shards(digits)
    gen = torch.Generator().manual_seed(8)
    spread = digits.subset(torch.randperm(len(digits), generator=gen)[:70].numpy())
    one_missing = digits.subset(torch.nonzero(digits.y != 3).flatten()[:40].numpy())
    assert len(spread.label_histogram()) == 10 and min(spread.label_histogram()) > 0
    assert_group_is_each_own_train(digits, "fedvls", hp, [*datasets, spread, one_missing])


@pytest.mark.parametrize(
    "hp",
    [
        {"lambda_kd": 0.0, "lambda_gen": 0.5, "noise_dim": 8},
        {"lambda_kd": 0.5, "lambda_gen": 0.0, "kd_direction": "forward", "kd_tau2_scale": True},
    ],
    ids=["generator-alone", "teacher-alone-scaled"],
)
def test_kdia_group_form_of_each_term_alone(digits: TensorDataset, hp: dict[str, Any]) -> None:
    """KDIA's group objective with one of its terms (its means taken at once, `NodeBatch.means`): the
    generated features' cross-entropy alone, and the forward KL alone with the tau^2 scale (its weight and
    its reported kd_loss scaled): each node as its own `train`."""
    assert_group_is_each_own_train(digits, "kdia", hp, shards(digits))


@pytest.mark.parametrize("method", ["moon", "fedvls", "fedrcl"])
def test_group_term_of_a_node_with_no_batch_left_stays_finite(digits: TensorDataset, method: str) -> None:
    """A captured CUDA graph steps all K nodes, a node with no batch left with every weight 0 (and its
    count clamped to 1): its loss and gradient must stay finite, or its masked update (0 x NaN) is NaN."""
    datasets = shards(digits)
    member = members(method, CASES[method], datasets)[3]
    model = build_model("cnn", digits.input_shape, 10, seed=6).double()
    model.load_state_dict(member.task.payload.tensors["model"])
    term = member.half.group_term(member.task, model, member.data)  # type: ignore[attr-defined]
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    start = {n: p.detach() for n, p in model.named_parameters()}
    x, y = member.data.x[:16], member.data.y[:16]

    def forward(p: dict[str, torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model, p, (inputs,))
        assert isinstance(out, torch.Tensor)
        return out

    weight, count = torch.zeros(16, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
    step = {name: out.of(x, term.inputs) for name, out in term.outputs.items()}  # what the round makes ahead
    loss = term.objective(NodeBatch(forward, params, start, x, y, weight, count, term.inputs, step))
    assert isinstance(loss, torch.Tensor) and torch.isfinite(loss)
    grads = torch.autograd.grad(loss, list(params.values()))
    assert all(bool(torch.isfinite(g).all()) for g in grads)


@pytest.mark.parametrize(
    "hp",
    [
        {"rcl_variant": "paper", "penalty_topk": 0, "threshold": 0.0, "local_lr_decay": 1.0},
        {"scl_weight": 0.0, "beta": 2.0, "threshold": 0.0, "feature_relu": True, "local_lr_decay": 0.9},
        {"topk_pos": 1, "topk_neg": 2, "taps": "conv2,features"},
    ],
    ids=["paper", "penalty", "official"],
)
def test_fedrcl_group_forms_of_each_term(digits: TensorDataset, hp: dict[str, Any]) -> None:
    """FedRCL's paper form with Eq. 5's penalty set, the penalty alone at a steep lr decay, and the code's
    defaults on two taps: each node as its own `train` (float32 similarities: to 1e-5)."""
    assert_group_is_each_own_train(digits, "fedrcl", hp, shards(digits))


@pytest.mark.parametrize(
    "hp",
    [
        {"l2_weight": 0.0, "mixup_alpha": 0.4, "detach_target": False},
        {"logit_adjust": False, "mixup_alpha": 0.0, "l2_weight": 2.0},
        {"logit_adjust": False},
        {"mixup_alpha": 0.0, "l1_weight": 0.0, "delta_missing": 1e-3},
        {"log_delta_clip": 0.5, "mixup_alpha": 0.4, "l2_weight": 2.0},
        {"l1_weight": 0.5, "mixup_alpha": 0.4},
    ],
    ids=["flatten-mixup", "no-mixup", "mixup-without-log-delta", "log-delta-alone", "clipped-log-delta", "l1-weighted"],
)
def test_fedacd_group_forms(digits: TensorDataset, hp: dict[str, Any]) -> None:
    """FedACD's L1 alone (gradient through q) with Mixup; L1 + lambda CE without Mixup (no draws) and
    with it; log Delta from the running P with no Mixup and no L1 (P still carried and renewed), and
    clipped, beside Mixup; L1 at half weight (the test above has the paper's setting)."""
    assert_group_is_each_own_train(digits, "fedacd", hp, shards(digits))


def test_fedacd_group_renews_each_members_p_every_epoch(digits: TensorDataset, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over three epochs each member's P is renewed twice from its own previous epoch, as its own `train`
    renews it; a group that never renewed P (its epoch made longer than the training) differs from it
    on every shard with two classes or more, so the carried state is what makes the two agree."""
    three = dataclasses.replace(SETTINGS, local_epochs=3)

    def group_of() -> list[GroupMember]:
        return [
            dataclasses.replace(m, task=dataclasses.replace(m.task, settings=three))
            for m in members("fedacd", {"mixup_alpha": 0.0}, shards(digits))
        ]

    workspace = build_model("cnn", digits.input_shape, 10, seed=6).double()
    group = group_of()
    grouped = group[0].half.train_group(group, copy.deepcopy(workspace))
    with monkeypatch.context() as patch:
        patch.setattr(fedacd, "_RenewedRows", _NeverRenewed)
        stale = group_of()
        never = stale[0].half.train_group(stale, copy.deepcopy(workspace))
    for got, unrenewed, member in zip(grouped, never, group_of(), strict=True):
        alone = member.half.train(member.task, copy.deepcopy(workspace), member.data, member.generator)
        assert got.meta["steps"] == alone.meta["steps"]
        assert difference(got.tensors["model"], alone.tensors["model"]) < EXACT
        if len(member.data.y.unique()) > 1:  # with one class, log Delta is log(delta_missing) whatever P is
            assert difference(unrenewed.tensors["model"], alone.tensors["model"]) > 1e-6


@pytest.mark.parametrize("mixup_alpha", [0.0, 1.0])
def test_fedacd_group_with_a_clean_p_renews_each_members_p_from_its_own_model(
    digits: TensorDataset, mixup_alpha: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``p_estimate: clean``: before each epoch but the first, each member's P is a clean pass of its own
    model as it then is over its whole shard, as its own `train` makes it (three epochs, float64, with
    and without Mixup); a group that never renewed P differs on every shard with two classes, so the
    renewal between steps is what makes the two agree."""
    spec = get_algorithm("fedacd")
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    assert spec.node(build_hyperparams(spec, {"p_estimate": "clean"}), node_id="node-0").group_refusal(model) is None
    three = dataclasses.replace(SETTINGS, local_epochs=3)
    hp = {"p_estimate": "clean", "mixup_alpha": mixup_alpha}

    def group_of() -> list[GroupMember]:
        return [
            dataclasses.replace(m, task=dataclasses.replace(m.task, settings=three))
            for m in members("fedacd", hp, shards(digits))
        ]

    workspace = build_model("cnn", digits.input_shape, 10, seed=6).double()
    group = group_of()
    grouped = group[0].half.train_group(group, copy.deepcopy(workspace))
    with monkeypatch.context() as patch:
        patch.setattr(fedacd, "_CleanP", _NeverRenewed)
        stale = group_of()
        never = stale[0].half.train_group(stale, copy.deepcopy(workspace))
    for got, unrenewed, member in zip(grouped, never, group_of(), strict=True):
        alone = member.half.train(member.task, copy.deepcopy(workspace), member.data, member.generator)
        assert got.meta["steps"] == alone.meta["steps"] and got.meta["score"] == pytest.approx(alone.meta["score"])
        assert difference(got.tensors["model"], alone.tensors["model"]) < EXACT
        if len(member.data.y.unique()) > 1:  # with one class, log Delta is log(delta_missing) whatever P is
            assert difference(unrenewed.tensors["model"], alone.tensors["model"]) > 1e-6


class _NeverRenewed:
    """A renewal of P (running or clean) that keeps each node's carried state as it is: P stays the received
    model's, what no renewal between steps would give."""

    def __init__(self, *args: object) -> None:
        pass

    def __call__(
        self, k: int, params: dict[str, torch.Tensor], carried: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in carried.items()}


def test_feddisco_group_is_fedavgs_with_each_members_own_discrepancy(digits: TensorDataset) -> None:
    """FedDisco's nodes train as FedAvg's do; in a group each update carries the d_k of its own node's
    labels, as its own `train` gives it (the shards' label mixes differ, so a shared d_k would fail)."""
    datasets = shards(digits)
    group = members("feddisco", {}, datasets)
    workspace = build_model("cnn", digits.input_shape, 10, seed=6).double()
    assert group[0].half.group_refusal(workspace) is None
    grouped = group[0].half.train_group(group, copy.deepcopy(workspace))
    alone = [
        m.half.train(m.task, copy.deepcopy(workspace), m.data, m.generator) for m in members("feddisco", {}, datasets)
    ]
    assert len({p.meta["discrepancy"] for p in alone}) > 1
    for got, want in zip(grouped, alone, strict=True):
        assert got.meta["discrepancy"] == want.meta["discrepancy"] and got.meta["steps"] == want.meta["steps"]
        assert difference(got.tensors["model"], want.tensors["model"]) < EXACT


def test_feddecorr_group_form_of_the_papers_formula(digits: TensorDataset) -> None:
    """The paper's form (population z-scores, ||K||_F^2 / d^2) as well as the code's."""
    assert_group_is_each_own_train(digits, "feddecorr", {"beta": 1.0, "form": "paper"}, shards(digits))


def group_and_alone(
    method: str,
    hp: Mapping[str, Any],
    datasets: list[TensorDataset],
    workspace: torch.nn.Module,
    prepare: Callable[[list[GroupMember]], list[GroupMember]],
) -> list[tuple[Payload, Payload, GroupMember, GroupMember]]:
    """(the group's update, the member's own `train`'s, the member trained in the group, the one trained
    alone) for each member: the members are made twice by `prepare`, so that what each half keeps (its
    state across rounds) is compared, half against half. The group form must be admitted, and each
    member take as many steps as alone."""
    group = prepare(members(method, hp, datasets))
    assert group[0].half.group_refusal(workspace) is None
    grouped = group[0].half.train_group(group, copy.deepcopy(workspace))
    out = []
    for got, member, mine in zip(grouped, prepare(members(method, hp, datasets)), group, strict=True):
        alone = member.half.train(member.task, copy.deepcopy(workspace), member.data, member.generator)
        assert got.meta["steps"] == alone.meta["steps"]
        out.append((got, alone, mine, member))
    return out


def test_feddyn_group_uses_each_members_own_gradient_state_and_steps_it(digits: TensorDataset) -> None:
    """FedDyn's regulariser in a group reads each member's own grad_k (different here, so a shared one
    fails), reports the cross-entropy as `train` does, and leaves each member's new grad_k as `train`
    leaves it (float64, 1e-10)."""
    datasets = shards(digits)
    workspace = build_model("cnn", digits.input_shape, 10, seed=6).double()
    params = [(n, p) for n, p in workspace.named_parameters() if p.requires_grad]

    def with_states(group: list[GroupMember]) -> list[GroupMember]:
        for i, member in enumerate(group):
            gen = torch.Generator().manual_seed(40 + i)
            member.half.gradient = {  # type: ignore[attr-defined]
                n: torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.05 for n, p in params
            }
        return group

    plain = members("fedavg", {}, datasets)
    fedavg = plain[0].half.train_group(plain, copy.deepcopy(workspace))
    trained = group_and_alone("feddyn", {"alpha": 0.1}, datasets, workspace, with_states)
    for (got, alone, mine, member), baseline in zip(trained, fedavg, strict=True):
        assert got.meta["loss"] == pytest.approx(alone.meta["loss"], rel=1e-9)
        assert difference(got.tensors["model"], alone.tensors["model"]) < EXACT
        assert difference(mine.half.gradient, member.half.gradient) < EXACT  # type: ignore[attr-defined]
        assert difference(got.tensors["model"], baseline.tensors["model"]) > 1e-4


SGD = dataclasses.replace(SETTINGS, momentum=0.0, weight_decay=0.0)
"""Plain SGD, as SCAFFOLD's option II assumes."""


@pytest.mark.parametrize(
    ("option", "settings"),
    [("option_ii", SGD), ("option_i", SGD), ("gradient_mean", dataclasses.replace(SETTINGS, max_grad_norm=0.5))],
    ids=["option_ii", "option_i", "gradient_mean-momentum-clipped"],
)
def test_scaffold_group_corrects_each_member_by_its_own_control(
    digits: TensorDataset, option: str, settings: TrainSettings
) -> None:
    """SCAFFOLD in a group: each member's correction c - c_i from its own c_i (different here), its own
    control delta and new c_i, each as its own `train` gives them (float64, 1e-10); plain SGD for
    options I and II; gradient_mean (the mean of each step's raw gradient, before clipping) with
    momentum, weight decay and clipping, which would show a sum taken after the correction or the clip."""
    datasets = shards(digits)
    workspace = build_model("cnn", digits.input_shape, 10, seed=6).double()
    params = [(n, p) for n, p in workspace.named_parameters() if p.requires_grad]
    server = torch.Generator().manual_seed(30)
    c = {n: torch.randn(p.shape, generator=server, dtype=torch.float64) * 0.05 for n, p in params}

    def prepared(group: list[GroupMember]) -> list[GroupMember]:
        out = []
        for i, member in enumerate(group):
            gen = torch.Generator().manual_seed(50 + i)
            member.half.control = {  # type: ignore[attr-defined]
                n: torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.05 for n, p in params
            }
            payload = Payload(tensors={**member.task.payload.tensors, "control": c}, meta=member.task.payload.meta)
            task = dataclasses.replace(member.task, payload=payload, settings=settings)
            out.append(dataclasses.replace(member, task=task))
        return out

    for got, alone, mine, member in group_and_alone(
        "scaffold", {"control_update": option}, datasets, workspace, prepared
    ):
        assert got.meta["loss"] == pytest.approx(alone.meta["loss"], rel=1e-9)
        assert difference(got.tensors["model"], alone.tensors["model"]) < EXACT
        assert difference(got.tensors["control_delta"], alone.tensors["control_delta"]) < EXACT
        assert difference(mine.half.control, member.half.control) < EXACT  # type: ignore[attr-defined]


@pytest.mark.parametrize("hp", [{}, {"prototype_pass": "eval"}, {"local_models": False, "proto_weight": 2.0}])
def test_fedproto_group_trains_each_member_from_its_own_model_with_its_own_prototypes(
    digits: TensorDataset, hp: dict[str, Any]
) -> None:
    """FedProto in a group: each member from its own local model (different here), CE plus the
    prototype term (prototypes for some classes only), and its local prototypes from its last epoch's
    representations summed as it trains (the default) or from a pass of its trained model, each as its
    own `train` gives them (float64 models; the prototypes are float32 in `train` too)."""
    datasets = shards(digits)
    workspace = build_model("cnn", digits.input_shape, 10, seed=6).double()
    classes, dim = workspace.num_classes, workspace.feature_dim
    gen = torch.Generator().manual_seed(60)
    present = torch.arange(classes) % 3 != 0
    prototypes = torch.randn(classes, dim, generator=gen) * present[:, None]

    def prepared(group: list[GroupMember]) -> list[GroupMember]:
        out = []
        for i, member in enumerate(group):
            own = build_model("cnn", digits.input_shape, 10, seed=70 + i).double().state_dict()
            member.half.local = own if i != 1 else None  # type: ignore[attr-defined]  # node 1: its first round
            tensors = {**member.task.payload.tensors, "prototypes": {"weight": prototypes, "present": present}}
            task = dataclasses.replace(member.task, payload=Payload(tensors=tensors, meta={}))
            out.append(dataclasses.replace(member, task=task))
        return out

    for got, alone, mine, member in group_and_alone("fedproto", hp, datasets, workspace, prepared):
        assert got.meta["loss"] == pytest.approx(alone.meta["loss"], rel=1e-9)
        assert difference(got.tensors["model"], alone.tensors["model"]) < EXACT
        assert torch.equal(got.tensors["class_means"]["counts"], alone.tensors["class_means"]["counts"])
        means, want = got.tensors["class_means"]["means"], alone.tensors["class_means"]["means"]
        assert means.dtype == want.dtype and torch.allclose(means, want, rtol=1e-5, atol=1e-6)
        if hp.get("local_models", True):
            assert difference(mine.half.local, member.half.local) < EXACT  # type: ignore[attr-defined]


@pytest.mark.parametrize("learn_scale", [True, False])
def test_fednh_group_trains_the_cosine_classifier_of_each_member(digits: TensorDataset, learn_scale: bool) -> None:
    """FedNH in a group: the body (and s when learnt) on the fixed prototypes, each member's model, loss,
    s and class means as its own `train` gives them (float64 model; s is float32 in `train` too)."""
    datasets = shards(digits)
    workspace = build_model("cnn", digits.input_shape, 10, seed=6).double()
    classes, dim = workspace.num_classes, workspace.feature_dim
    prototypes = torch.randn(classes, dim, generator=torch.Generator().manual_seed(80), dtype=torch.float64)
    extra = {"prototypes": {"weight": prototypes}, "scale": {"value": torch.tensor([3.0])}}  # W in the model's dtype

    def prepared(group: list[GroupMember]) -> list[GroupMember]:
        payloads = [Payload(tensors={**m.task.payload.tensors, **extra}, meta={}) for m in group]
        return [
            dataclasses.replace(m, task=dataclasses.replace(m.task, payload=p))
            for m, p in zip(group, payloads, strict=True)
        ]

    plain = members("fedavg", {}, datasets)
    fedavg = plain[0].half.train_group(plain, copy.deepcopy(workspace))
    trained = group_and_alone("fednh", {"learn_scale": learn_scale}, datasets, workspace, prepared)
    for (got, alone, _, _), baseline in zip(trained, fedavg, strict=True):
        assert got.tensors.keys() == alone.tensors.keys()
        assert got.meta["loss"] == pytest.approx(alone.meta["loss"], rel=1e-6)
        assert difference(got.tensors["model"], alone.tensors["model"]) < 1e-6
        assert torch.equal(got.tensors["class_means"]["counts"], alone.tensors["class_means"]["counts"])
        assert torch.allclose(got.tensors["class_means"]["means"], alone.tensors["class_means"]["means"], atol=1e-5)
        if learn_scale:
            assert torch.allclose(got.tensors["scale"]["value"], alone.tensors["scale"]["value"], atol=1e-6)
        assert difference(got.tensors["model"], baseline.tensors["model"]) > 1e-4


KEYED: dict[str, tuple[str, dict[str, Any]]] = {
    **{m: (m, CASES[m]) for m in ("fedprox", "fedlc", "fedrs", "fedntd", "fedgkd", "moon", "fedvls", "feddecorr")},
    "kdia": ("kdia", CASES["kdia"]),
    "fedacd": ("fedacd", CASES["fedacd"]),  # the running P carried from step to step, and Mixup's draws
    "fedacd-clean": ("fedacd", {"p_estimate": "clean", "mixup_alpha": 0.0}),  # P renewed each epoch
    "fedrcl": ("fedrcl", CASES["fedrcl"]),  # a call per epoch, each at its own lr, all in one kept round
    "fednh": ("fednh", {"learn_scale": True}),  # its prototypes loose tensors of a spare model, loaded in place
    "fednh-fixed-s": ("fednh", {"learn_scale": False}),  # s a loose tensor too
    "feddyn": ("feddyn", {"alpha": 0.1}),  # each member's grad_k, stepped by each round, in its inputs
    "scaffold": ("scaffold", {"control_update": "gradient_mean"}),  # c - c_i, each member's c_i its own
    "fedproto": ("fedproto", {}),  # each member from its own local model; the global prototypes as inputs
}
"""The methods whose group objective has a key (`GroupTerm.key`, `keep_as`): kept from round to round."""


def rounds_of(
    method: str, hp: Mapping[str, Any], digits: TensorDataset, device: torch.device
) -> list[list[GroupMember]]:
    """Three rounds of one group: each round other shards of the same sizes (other label counts) and a
    new global model (teacher, generator) sent to the same nodes, whose spare models (a teacher's, a
    generator's) and own state (MOON's previous models) stay theirs from round to round, as a node's
    workspace and half keep them."""
    first = members(method, hp, [d.to(device) for d in shards(digits)])
    rounds = []
    for r in range(3):
        perm = torch.randperm(len(digits), generator=torch.Generator().manual_seed(50 + r)).numpy()
        datasets = [d.to(device) for d in shards(digits.subset(perm))]
        payload = first[0].task.payload
        tensors = dict(payload.tensors)
        tensors["model"] = build_model("cnn", digits.input_shape, 10, seed=30 + r).double().to(device).state_dict()
        if "teacher" in tensors:
            tensors["teacher"] = build_model("cnn", digits.input_shape, 10, seed=40 + r).double().state_dict()
        if "scale" in tensors:  # FedNH's prototypes: moved and rescaled by the coordinator each round
            tensors["prototypes"] = {"weight": tensors["prototypes"]["weight"].roll(r, dims=0) + 0.1 * r}
            tensors["scale"] = {"value": tensors["scale"]["value"] + r}
        elif "prototypes" in tensors:  # FedProto's: other centres, and other classes known, each round
            present = tensors["prototypes"]["present"].roll(r)
            centres = tensors["prototypes"]["weight"].roll(r, dims=0) + 0.1 * r
            tensors["prototypes"] = {"weight": centres * present[:, None], "present": present}
        if "control" in tensors:  # SCAFFOLD's c, moved by each round's control deltas
            tensors["control"] = {name: t * (1 + r) for name, t in tensors["control"].items()}
        if "generator" in tensors:
            tensors["generator"] = {
                name: t + 0.01 * r if t.is_floating_point() else t for name, t in tensors["generator"].items()
            }
        rounds.append(
            [
                dataclasses.replace(
                    m,
                    task=dataclasses.replace(m.task, round=r, payload=Payload(tensors=tensors, meta=payload.meta)),
                    data=data,
                    generator=torch_generator(4, "node-train", m.task.node_id, r),
                )
                for m, data in zip(first, datasets, strict=True)
            ]
        )
    return rounds


def assert_kept_rounds_are_fresh_rounds(case: str, digits: TensorDataset, device: torch.device) -> None:
    from fedmq.fedcore import vectorized

    method, hp = KEYED[case]

    def train(rounds: list[list[GroupMember]], workspace: torch.nn.Module) -> list[list[Payload]]:
        return [group[0].half.train_group(group, workspace) for group in rounds]

    workspace = build_model("cnn", digits.input_shape, 10, seed=6).double().to(device)
    # fresh rounds with spare models of their own: a kept round must not lean on what a spare kept
    alone = []
    for group in rounds_of(method, hp, digits, device):
        spare = spare_models(digits.input_shape, device)
        alone.append([dataclasses.replace(m, task=dataclasses.replace(m.task, scratch=spare)) for m in group])
    fresh = train(alone, workspace)
    with vectorized.keep_rounds():
        kept = train(rounds_of(method, hp, digits, device), workspace)
        held = vectorized.KEPT.get()
        assert held is not None and len(held) == 1  # built by the first round, trained in by the others
    for want, have in zip(fresh, kept, strict=True):
        for a, b in zip(want, have, strict=True):
            assert a.meta == b.meta
            assert all(torch.equal(a.tensors["model"][k], b.tensors["model"][k]) for k in a.tensors["model"])
    assert difference(fresh[0][0].tensors["model"], fresh[1][0].tensors["model"]) > 1e-3  # the rounds differ


@pytest.mark.parametrize("case", sorted(KEYED))
def test_a_keyed_objective_trains_in_a_kept_round_as_in_a_fresh_one(digits: TensorDataset, case: str) -> None:
    """An objective that reads its batch, its members' inputs and carried state, its hyperparameters and
    spare models loaded in place (KDIA's and FedGKD's teachers) can be kept (`GroupTerm.key`, `keep_as`):
    three rounds of other shards and new models, teachers and generators give bitwise what fresh rounds
    give, in one kept round (FedACD's P carried from step to step, or renewed each epoch, and FedRCL's
    epochs at their own lr, and FedNH's prototypes and s loaded in place into its spare model, included)."""
    assert_kept_rounds_are_fresh_rounds(case, digits, CPU)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["fedprox", "moon", "kdia", "fedacd", "fedacd-clean", "fedrcl", "fednh", "fedproto"])
def test_kept_rounds_of_a_keyed_objective_replay_their_cuda_graphs_as_fresh_rounds(
    digits: TensorDataset, case: str
) -> None:
    """On a GPU with graphs, the later rounds replay the graphs the first captured: bitwise fresh rounds."""
    with graph_mode("on"):
        assert_kept_rounds_are_fresh_rounds(case, digits, torch.device("cuda"))


def assert_pipelined_plan_is_the_whole_plan(digits: TensorDataset, method: str, device: torch.device) -> None:
    """A group trained with its plan drawn in chunks as the steps need them (`round_plan.plan_pipeline`)
    gives bitwise the updates and losses of the plan drawn before the first step."""
    from fedmq.fedcore import round_plan

    datasets = [d.to(device) for d in shards(digits)]
    name, hp = KEYED.get(method, (method, {}))
    updates = []
    for mode in ("off", "on"):
        group = members(name, hp, datasets)
        workspace = build_model("cnn", digits.input_shape, 10, seed=6).double().to(device)
        with round_plan.plan_pipeline(mode):
            updates.append(group[0].half.train_group(group, workspace))
    whole, chunked = updates
    for a, b in zip(whole, chunked, strict=True):
        assert a.meta == b.meta
        assert all(torch.equal(a.tensors["model"][k], b.tensors["model"][k]) for k in a.tensors["model"])


@pytest.mark.parametrize("method", ["fedavg", *sorted(KEYED)])
def test_a_plan_drawn_as_the_steps_need_it_trains_as_the_whole_plan(digits: TensorDataset, method: str) -> None:
    """On a GPU the plan's chunks are drawn while the device trains (auto); forced on the CPU here, every
    method's group (KDIA's noise and generated features made chunk by chunk, FedRCL's epochs, FedACD's
    epoch starts, FedDyn's, SCAFFOLD's and FedProto's inputs) trains bitwise as with the plan drawn whole."""
    assert_pipelined_plan_is_the_whole_plan(digits, method, CPU)


@pytest.mark.parametrize("method", ["kdia", "fedgkd", "fedntd", "fedvls", "moon"])
def test_frozen_outputs_made_before_the_steps_train_as_made_in_each_step(
    digits: TensorDataset, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen model's outputs on the steps' batches (KDIA's and FedGKD's teachers, the global model of
    FedNTD, FedVLS and MOON, MOON's previous models of each node: `shared.frozen_output`) made for the
    plan's chunks before the steps run, as on a GPU (`round_plan.outputs_ahead`), train each member as
    when each step makes them (a CPU's way); the chunks (pipelined) change nothing, nor several steps'
    batches made at once (`CPU_OUTPUT_ROWS` 200: 3 of the 6 steps a call, as a GPU makes them)."""
    from fedmq.fedcore import round_plan, vectorized

    name, hp = KEYED[method]
    updates = []
    for ahead, pipeline, rows_a_call in (("off", "off", 0), ("on", "off", 0), ("on", "on", 0), ("on", "off", 200)):
        monkeypatch.setattr(vectorized, "CPU_OUTPUT_ROWS", rows_a_call)
        group = members(name, hp, shards(digits))
        workspace = build_model("cnn", digits.input_shape, 10, seed=6).double()
        with round_plan.outputs_ahead(ahead), round_plan.plan_pipeline(pipeline):
            updates.append(group[0].half.train_group(group, workspace))
    in_step, *made_ahead = updates
    for other in made_ahead:
        for a, b in zip(in_step, other, strict=True):
            assert a.meta == pytest.approx(b.meta, rel=1e-12)
            ours, theirs = a.tensors["model"], b.tensors["model"]
            assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) < 1e-12


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["fedavg", "kdia", "fedrcl", "fedacd"])
def test_a_plan_drawn_while_the_gpu_trains_trains_as_the_whole_plan(digits: TensorDataset, method: str) -> None:
    """On a GPU, each later chunk sent from page-locked memory without waiting (the host draws it while
    the device trains the steps before): bitwise the plan drawn whole (KDIA's features within the
    generator's own kernels: its chunks' batches are smaller)."""
    with graph_mode("on"):
        assert_pipelined_plan_is_the_whole_plan(digits, method, torch.device("cuda"))
