"""The step counter of `fedmq bench sim` (`experiments.bench.step_cost`): operators and bytes, on synthetic
tensors whose sizes are known."""

from __future__ import annotations

import pytest
import torch
from torch.func import vmap

from fedmq.experiments.bench.common import Report
from fedmq.experiments.bench.step_cost import MB, StepCost, StepCounter, add_cost_rows, counted


def test_an_operator_counts_once_with_the_bytes_of_its_arguments_and_result() -> None:
    a, b = torch.ones(10), torch.ones(10, dtype=torch.float64)
    assert counted(lambda: a + a) == StepCost(1, 3 * 40)
    assert counted(lambda: b.sum()) == StepCost(1, 80 + 8)
    assert counted(lambda: a.add_(a)) == StepCost(1, 3 * 40)  # in place: read twice, written once
    assert counted(lambda: a.copy_(b)) == StepCost(1, 40 + 80 + 40)  # the destination counted as read too
    out = torch.empty(10)
    assert counted(lambda: torch.mul(a, 2, out=out)) == StepCost(1, 40 + 40 + 40)  # out= as copy_'s destination


def test_fused_sgd_counts_its_gradients_as_read_only_as_it_leaves_them() -> None:
    """Its schema marks the gradients as written (it unscales them when given a scale): without one it
    reads them only, which the count says, and the gradients come back bitwise as they went in."""
    params, grads, bufs = [torch.ones(10)], [torch.full((10,), 0.5)], [torch.zeros(10)]
    before = grads[0].clone()
    lr = torch.tensor(0.1)

    def step() -> None:
        torch._fused_sgd_(params, grads, bufs, weight_decay=1e-3, momentum=0.9, lr=lr, dampening=0.0,
                          nesterov=False, maximize=False, is_first_step=False)  # fmt: skip

    # read: the parameters, gradients, buffers and lr; written: the parameters and buffers
    assert counted(step) == StepCost(1, 3 * 40 + 4 + 2 * 40)
    assert torch.equal(grads[0], before) and not torch.equal(params[0], torch.ones(10))


def test_views_and_allocations_move_nothing_and_are_not_counted() -> None:
    a = torch.ones(4, 6)
    assert counted(lambda: (a.view(6, 4), a.t(), a[1:], a.unsqueeze(0).expand(3, 4, 6))) == StepCost(0, 0)
    assert counted(lambda: (torch.empty(100), a.new_empty(7), torch.empty_strided((2, 2), (1, 2)))) == StepCost(0, 0)
    assert counted(lambda: torch.ops.aten._unsafe_view(a, [24])) == StepCost(0, 0)
    assert counted(lambda: a.t().reshape(24)) == StepCost(1, 2 * 96)  # a copy, then a view of it


def test_a_multi_tensor_operator_counts_once_with_every_tensor_of_its_lists() -> None:
    xs, ys = [torch.ones(3), torch.ones(5)], [torch.ones(3), torch.ones(5)]
    assert counted(lambda: torch._foreach_add_(xs, ys)) == StepCost(1, 3 * (12 + 20))  # as add_ counts
    assert counted(lambda: torch._foreach_mul(xs, 2.0)) == StepCost(1, 2 * (12 + 20))


def test_under_vmap_it_counts_the_batched_operators_a_device_runs() -> None:
    """vmap's batching rule runs one operator over the stacked (K, ...) tensors: counted once, at K's size."""
    x = torch.ones(5, 7)
    assert counted(lambda: vmap(torch.exp)(x)) == StepCost(1, 2 * 5 * 7 * 4)


def test_a_counter_adds_up_every_step_inside_it() -> None:
    a = torch.ones(100)
    with StepCounter() as counter:
        a * 2
        a.sum()
    assert counter.cost == StepCost(2, (400 + 400) + (400 + 4))


def test_the_rows_give_each_path_its_operators_and_megabytes_against_the_reference() -> None:
    report = Report("sim", "t")
    costs = {"ours": StepCost(50, 30_000_000), "theirs": StepCost(100, 60_000_000)}
    add_cost_rows(report, costs, "theirs", "a section", whose="the reference's")
    rows = {f.label: f for f in report.figures}
    assert rows["ours: operators a step"].value == 50 and rows["ours: operators a step"].ratio == pytest.approx(2.0)
    traffic = rows["ours: memory traffic a step"]
    assert traffic.unit == "MB" and traffic.value == pytest.approx(30_000_000 / MB) and traffic.ratio == 2.0
    assert rows["theirs: memory traffic a step"].ratio == 1.0
    assert all(f.section == "a section" for f in report.figures) and len(report.figures) == 4
