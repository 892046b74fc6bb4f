"""The in-process driver against the daemons: the quickstart experiment run by `build_local` (the
coordinator's engine, no broker, virtual time) and by `fedmq run` over the embedded broker gives the
same federation, round for round."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fedmq.experiments.build
from fedmq.experiments.config import load_config
from fedmq.experiments.local import build_local

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
ROUNDS = 8


def _both(
    out: Path, broker: str, overrides: list[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[list[dict], list[dict]]:
    """The quickstart with `overrides`, by the daemons over `broker` and in process: each one's metrics."""
    command = [sys.executable, "-m", "fedmq", "run", str(QUICKSTART), *(x for o in overrides for x in ("--set", o))]
    command += ["--broker", broker, "--out", str(out), "--processes", "2", "--quiet"]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    )
    assert done.returncode == 0, done.stdout + done.stderr
    daemons = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    monkeypatch.setattr(fedmq.experiments.build, "best_device", lambda: torch.device("cpu"))  # the evaluation's device
    fed = build_local(load_config(QUICKSTART, overrides), device=torch.device("cpu"))
    local = fed.run()
    assert fed.engine.state == "finished"
    return daemons, local


def test_quickstart_in_process_equals_the_daemons_round_for_round(
    tmp_path: Path, embedded_broker: str, one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight quickstart rounds: the same 5 nodes selected, the same train_loss and accuracy, bit for bit
    (both on the CPU: the daemons' nodes see no GPU, and the in-process evaluation runs on the CPU)."""
    daemons, local = _both(tmp_path / "run", embedded_broker, [f"rounds={ROUNDS}"], monkeypatch)
    assert [r["round"] for r in daemons] == [r["round"] for r in local] == list(range(ROUNDS))
    for ours, theirs in zip(local, daemons, strict=True):
        assert ours["selected"] == theirs["selected"] and len(ours["selected"]) == 5
        assert ours["accepted"] == theirs["accepted"] == ours["selected"]  # everyone answered in time, both ways
        assert ours["train_loss"] == theirs["train_loss"], ours["round"]
        assert ours["accuracy"] == theirs["accuracy"], ours["round"]
    assert len({tuple(r["selected"]) for r in local}) > 1  # the cohorts change: the sampler is compared, not one set


def test_bf16_travels_in_the_task_and_the_daemons_train_with_it(
    tmp_path: Path, embedded_broker: str, one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`train.precision: bf16` reaches the node daemons in their tasks over the broker: two rounds train
    bit for bit as in process in bf16, and not as in float32."""
    daemons, local = _both(tmp_path / "run", embedded_broker, ["rounds=2", "train.precision=bf16"], monkeypatch)
    assert [r["train_loss"] for r in daemons] == [r["train_loss"] for r in local]
    float32 = build_local(load_config(QUICKSTART, ["rounds=2"]), device=torch.device("cpu")).run()
    assert [r["selected"] for r in float32] == [r["selected"] for r in daemons]
    assert all(a["train_loss"] != b["train_loss"] for a, b in zip(float32, daemons, strict=True))
