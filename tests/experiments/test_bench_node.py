"""`fedmq bench node`: one node process timed to its online status and its memory read, on the
partition and with --data (quick mode: the quickstart only; how fast or how small is never asserted)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedmq.experiments.bench import run_suite
from fedmq.experiments.bench.common import BenchOptions
from fedmq.experiments.cli import build_parser


@pytest.mark.slow  # a benchmark suite end to end: real processes, brokers or training
def test_node_suite_measures_one_node_on_the_partition_and_on_its_own_file(tmp_path: Path) -> None:
    report = run_suite("node", BenchOptions(quick=True, work_dir=tmp_path), log=lambda _: None)
    rows = {f"{f.section.split(':')[0]}: {f.label}": f for f in report.figures}
    for mode in ("partition", "--data"):
        assert 0 < rows[f"quickstart: {mode}: start-up to online"].value < 300  # s
        peak = rows[f"quickstart: {mode}: peak memory (VmHWM)"]
        steady = rows[f"quickstart: {mode}: steady memory (VmRSS, idle)"]
        assert 50 < steady.value <= peak.value  # MiB: an interpreter with torch
    part, own = rows["quickstart: partition: peak memory (VmHWM)"], rows["quickstart: --data: peak memory (VmHWM)"]
    assert own.ratio == pytest.approx(own.value / part.value)
    start = rows["quickstart: --data: start-up to online"]
    assert start.ratio == pytest.approx(start.value / rows["quickstart: partition: start-up to online"].value)
    assert rows["floor: peak memory (VmHWM)"].value > 50
    shard = np.load(tmp_path / "node" / "quickstart-node-000.npz")
    assert shard["x"].shape[1:] == (1, 8, 8) and len(shard["y"]) == len(shard["x"]) > 0
    (empty,) = (tmp_path / "node").glob("empty-root-*")  # the --data node's data root and cache
    assert list(empty.iterdir()) == []  # it read and decoded nothing there


def test_node_suite_is_listed_in_the_bench_help() -> None:
    parser = build_parser()
    assert "node" in parser.description  # type: ignore[operator]
    bench = parser._subparsers._group_actions[0].choices["bench"]  # type: ignore[union-attr]
    assert "  node       one node process" in bench.description
