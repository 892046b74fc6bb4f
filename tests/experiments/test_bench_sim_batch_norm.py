"""`fedmq bench sim`'s section on FedSA's BatchNorm ResNet-18 (`sim_batch_norm`): its reference is the
simulator's work written in bare PyTorch, and its rows say what they measured."""

from __future__ import annotations

import pytest
import torch

from fedmq.experiments.bench.common import Report
from fedmq.experiments.bench.sim_batch_norm import (
    CELL_IMAGES,
    CELL_ROUNDS,
    MASKED,
    ONE_BY_ONE,
    REFERENCE,
    SETTINGS,
    VECTORISED,
    VmapBatchStatistics,
    add_rows,
    minutes_text,
    workload,
)
from fedmq.experiments.bench.training import generators
from fedmq.fedcore.vectorized import train_vectorized

CPU = torch.device("cpu")


def test_the_reference_trains_the_simulators_steps() -> None:
    """From the same weights, on each node's batches in its generator's order, the bare vmap reference
    ends where the vectorised simulator does (whole batches, so its BatchNorm's batch statistics are the
    masked ones): the same work, but for float32 rounding and the running statistics it does not keep."""
    work = workload(CPU, 2, 20)
    reference = VmapBatchStatistics(work)
    reference()
    ours = train_vectorized(work.model, work.datasets, SETTINGS, generators(2, CPU))
    start = dict(work.model.named_parameters())
    for k, (state, _) in enumerate(ours):
        assert any(not torch.equal(state[n], p) for n, p in start.items())  # it trained
        for name in start:
            torch.testing.assert_close(reference.params[name][k], state[name], rtol=1e-4, atol=1e-5)


def test_the_section_gives_each_path_its_rate_against_the_reference_and_a_cell_as_arithmetic() -> None:
    report = Report("sim", "t")
    add_rows(report, CPU, repeats=1, quick=True)
    rows = {f.label: f for f in report.figures}
    assert {ONE_BY_ONE, VECTORISED, MASKED, REFERENCE} <= set(rows)
    reference = rows[REFERENCE]
    assert reference.ratio == pytest.approx(1.0)
    for name in (ONE_BY_ONE, VECTORISED, MASKED):
        assert rows[name].unit == "images/s" and rows[name].value > 0
        assert rows[name].ratio == pytest.approx(rows[name].value / reference.value)
    minutes = CELL_IMAGES * CELL_ROUNDS / rows[VECTORISED].value / 60
    assert f"would take {minutes_text(minutes)} (arithmetic, not timed)" in rows[VECTORISED].note
    ops = (
        rows[f"{VECTORISED}: operators a step"],
        rows[f"{MASKED}: operators a step"],
        rows[f"{REFERENCE}: operators a step"],
    )
    assert all(o.unit == "ops" and o.value > 100 for o in ops)  # a ResNet-18's step: the count counts
    # torch's BatchNorm at whole batches (the section's shards are whole) dispatches fewer than the masked sums
    assert ops[0].value < ops[1].value
    traffic = [rows[f"{name}: memory traffic a step"] for name in (VECTORISED, MASKED, REFERENCE)]
    assert all(t.unit == "MB" and t.value > 10 for t in traffic)  # a ResNet-18's activations and weights
    assert traffic[0].value < traffic[2].value  # each BatchNorm one kernel: no scale and shift apart
    assert all("FedSA's ResNet-18 with BatchNorm" in f.section for f in report.figures)
