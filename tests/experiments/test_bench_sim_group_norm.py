"""`fedmq bench sim`'s section on FedRCL's GroupNorm ResNet-18 (`sim_group_norm`): its reference is the
simulator's work written in bare PyTorch, and its rows say what they measured."""

from __future__ import annotations

import pytest
import torch

from fedmq.experiments.bench.common import Report
from fedmq.experiments.bench.sim_batch_norm import minutes_text, workload
from fedmq.experiments.bench.sim_group_norm import (
    CELL_IMAGES,
    CELL_ROUNDS,
    ONE_BY_ONE,
    REFERENCE,
    SETTINGS,
    VECTORISED,
    VmapGroupNorm,
    add_rows,
    model,
)
from fedmq.experiments.bench.training import generators
from fedmq.fedcore.vectorized import train_vectorized

CPU = torch.device("cpu")


def test_the_reference_trains_the_simulators_steps_clipping_and_weight_decay_included() -> None:
    """From the same weights, on each node's batches in its generator's order, the bare vmap reference
    ends where the vectorised simulator does, but for float32 rounding: the same work. On this CPU every
    weight lay within 3.4e-5 of the simulator's; without its weight decay the reference lay 2.1e-4 away,
    without its clipping 0.38 (2026-11-29)."""
    work = workload(CPU, 2, 100, model())
    reference = VmapGroupNorm(work)
    reference()
    ours = train_vectorized(work.model, work.datasets, SETTINGS, generators(2, CPU))
    start = dict(work.model.named_parameters())
    for k, (state, _) in enumerate(ours):
        assert any(not torch.equal(state[n], p) for n, p in start.items())  # it trained
        assert max(float((reference.params[n][k] - state[n]).abs().max()) for n in start) < 1e-4


def test_the_section_gives_each_path_its_rate_and_operators_against_the_reference() -> None:
    report = Report("sim", "t")
    add_rows(report, CPU, repeats=1, k=2, size=50)
    rows = {f.label: f for f in report.figures}
    reference = rows[REFERENCE]
    assert reference.ratio == pytest.approx(1.0)
    for name in (ONE_BY_ONE, VECTORISED):
        assert rows[name].unit == "images/s" and rows[name].value > 0
        assert rows[name].ratio == pytest.approx(rows[name].value / reference.value)
    minutes = CELL_IMAGES * CELL_ROUNDS / rows[VECTORISED].value / 60
    assert f"would take {minutes_text(minutes)} (arithmetic, not timed)" in rows[VECTORISED].note
    ours, theirs = rows[f"{VECTORISED}: operators a step"], rows[f"{REFERENCE}: operators a step"]
    assert ours.unit == theirs.unit == "ops" and ours.value > 100  # a ResNet-18's step: the count counts
    assert ours.value < theirs.value  # each GroupNorm one kernel with its scale and shift, no copy before it
    ours, theirs = rows[f"{VECTORISED}: memory traffic a step"], rows[f"{REFERENCE}: memory traffic a step"]
    assert ours.unit == theirs.unit == "MB" and ours.value < theirs.value  # the same, in bytes
    assert all("FedRCL's ResNet-18 with GroupNorm" in f.section for f in report.figures)
