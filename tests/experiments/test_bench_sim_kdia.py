"""`fedmq bench sim`'s section on KDIA's node objective (`experiments.bench.sim_kdia`), on this CPU."""

from __future__ import annotations

import pytest
import torch

from fedmq.experiments.bench.common import Report
from fedmq.experiments.bench.sim_batch_norm import minutes_text
from fedmq.experiments.bench.sim_kdia import CELL_IMAGES, CELL_ROUNDS, FEDAVG, KDIA, add_rows, kdia_round
from fedmq.experiments.bench.simulator import Case, workload


def test_the_section_gives_kdias_round_and_step_against_fedavgs_and_a_cell_as_arithmetic() -> None:
    report = Report("sim", "t")
    add_rows(report, torch.device("cpu"), repeats=1, quick=True)
    rows = {f.label: f for f in report.figures}
    kdia, fedavg = rows[KDIA], rows[FEDAVG]
    assert kdia.unit == fedavg.unit == "images/s" and kdia.value > 0 and fedavg.ratio == pytest.approx(1.0)
    assert kdia.ratio == pytest.approx(kdia.value / fedavg.value)
    minutes = minutes_text(CELL_IMAGES * CELL_ROUNDS / kdia.value / 60)
    assert f"would take {minutes} (arithmetic, not timed)" in kdia.note
    ops = rows[f"{KDIA}: operators a step"], rows[f"{FEDAVG}: operators a step"]
    assert "would take" not in fedavg.note
    # the teacher's forward pass and the head on the generated features come on top of FedAvg's step
    assert ops[1].value > 50 and ops[0].value > ops[1].value
    traffic = rows[f"{KDIA}: memory traffic a step"], rows[f"{FEDAVG}: memory traffic a step"]
    assert traffic[0].unit == "MB" and traffic[0].value > traffic[1].value > 1
    assert all(f.section.startswith("KDIA's node objective against FedAvg's: 3 nodes") for f in report.figures)


def test_a_kdia_round_trains_every_node_with_both_of_its_terms() -> None:
    """What the section times is KDIA's training: each node's payload reports its distillation and
    generator losses, and its weights moved."""
    case = Case(2, 128, 1)  # two steps of 64 a node
    model, datasets = workload(case, torch.device("cpu"))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    payloads = kdia_round(model, datasets, case)()
    assert isinstance(payloads, list) and len(payloads) == 2
    for payload in payloads:
        assert payload.meta["steps"] == 2 and payload.meta["kd_loss"] > 0 and payload.meta["gen_loss"] > 0
        weights = payload.tensors["model"]
        assert any(not torch.equal(weights[n], start[n]) for n in start)
