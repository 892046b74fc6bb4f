"""`fedmq bench sim`'s torch.compile section (`sim_compile`): the bare vmap step in the form torch.compile
takes whole is SGD on each node's own augmented batch, compiled it updates as it does eager, and its
rows stand beside the references'."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from fedmq.experiments.bench.common import BenchOptions, Report
from fedmq.experiments.bench.sim_compile import CROP, PADDING, FunctionalVmapStep, add_rows
from fedmq.experiments.bench.simulator import MEAN, STD, Case, run, workload
from fedmq.fedcore.errors import ConfigError

CASE = Case(3, 128, 1)


def augmented_by_hand(x: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """Image by image, with nothing of fedmq's: zero padding, the window at (top, left), the flip, /255,
    the normalisation."""
    out = []
    for image, t, w, f in zip(x, top.tolist(), left.tolist(), flip.tolist(), strict=True):
        window = F.pad(image.float(), (PADDING,) * 4)[:, t : t + CROP, w : w + CROP]
        out.append(window.flip(-1) if f else window)
    images = torch.stack(out) / 255.0
    return (images - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def test_the_functional_step_is_sgd_with_momentum_on_each_nodes_own_augmented_batch() -> None:
    """Two steps of the eager functional update end where torch.optim.SGD ends for each node alone, from
    the same weights on the same crops and flips: what the section compiles is the reference's work."""
    cpu = torch.device("cpu")
    model, datasets = workload(CASE, cpu)
    step = FunctionalVmapStep(model, datasets, CASE, cpu)
    s = CASE.settings
    start = {n: p.clone() for n, p in step.params.items()}
    nets = [copy.deepcopy(model) for _ in range(CASE.k)]
    optimizers = [
        torch.optim.SGD(n.parameters(), lr=s.lr, momentum=s.momentum, weight_decay=s.weight_decay) for n in nets
    ]
    torch.manual_seed(0)
    for i in range(2):
        step.step_idx.copy_(step.idx[:, i])
        step._step()
        x, y = step._batch()
        images = augmented_by_hand(x.flatten(0, 1), step.top, step.left, step.flip).view(*x.shape[:2], 3, CROP, CROP)
        for k, (net, optimizer) in enumerate(zip(nets, optimizers, strict=True)):
            optimizer.zero_grad()
            F.cross_entropy(net(images[k]), y[k]).backward()
            optimizer.step()
    assert step.flip.any() and not step.flip.all() and step.top.unique().numel() > 1  # the draws vary
    for name, stacked in step.params.items():
        assert not torch.equal(stacked, start[name])  # it trained
        for k, net in enumerate(nets):
            torch.testing.assert_close(stacked[k], dict(net.named_parameters())[name], rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # compiles a step: about 20 s on the 2-core CPU with a cold Inductor cache
# torch 2.13's Inductor imports torch.utils.mkldnn, whose classes use the deprecated torch.jit.script_method
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_the_compiled_step_updates_as_the_eager_one_and_is_timed_beside_the_references() -> None:
    torch.manual_seed(0)
    report = Report("sim-compile", "t")
    add_rows(report, torch.device("cpu"), repeats=1, quick=True)
    rows = {f.label: f for f in report.figures}
    paths = [f for f in report.figures if f.unit == "images/s"]
    assert [f.label for f in paths] == [
        "reference: vmap over nodes",
        "reference: eager loop",
        "vmap step in torch.func form, eager",
        "vmap step in torch.func form, torch.compile",
    ]
    best = max(f.value for f in paths if f.label.startswith("reference"))
    for figure in paths:
        assert figure.value > 0 and figure.ratio == pytest.approx(figure.value / best)
    assert rows["torch.compile: the first step (the compile)"].value > 0
    difference = rows["compiled update against the eager function's, one step on the same batch"]
    assert 0 < difference.value < 1e-4 and "the median of 5 batches" in difference.note  # float32, not bitwise


def test_the_compile_option_is_an_on_off_switch_checked_before_anything_is_timed() -> None:
    with pytest.raises(ConfigError, match=r"--opt compile: 'maybe': expected true or false"):
        run(BenchOptions(quick=True, extra={"compile": "maybe"}))
