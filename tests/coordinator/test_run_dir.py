"""Checkpoints and run files: atomic, readable without pickle, and refused clearly when corrupt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedmq.coordinator.errors import CoordinatorError
from fedmq.coordinator.storage.run_dir import CHECKPOINT, RunDir


def test_checkpoint_round_trip_is_plain_safetensors(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    tensors = {
        "model/w": torch.randn(3, 4),
        "model/n": torch.tensor(7),
        "extra/m": torch.randn(2, dtype=torch.bfloat16),
    }
    run.save_checkpoint(tensors, {"round": 4, "participation": {"a": {"node_id": "a"}}})
    loaded = run.load_checkpoint()
    assert loaded is not None
    back, meta = loaded
    assert meta["round"] == 4 and set(back) == set(tensors)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    assert set(load_file(str(tmp_path / CHECKPOINT))) == set(tensors)  # any safetensors reader opens it
    assert not list(tmp_path.glob(".*.tmp"))


def test_corrupt_checkpoint_gives_advice(tmp_path: Path) -> None:
    (tmp_path / CHECKPOINT).write_bytes(b"\x00\x01garbage")
    with pytest.raises(CoordinatorError, match="move it away"):
        RunDir(tmp_path).load_checkpoint()


def test_metrics_truncation_on_resume(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    for r in range(5):
        run.append_metrics({"round": r})
    run.truncate_metrics_after(2)
    assert [json.loads(x)["round"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_algorithm_record_logs_are_appended_and_truncated_with_the_metrics(tmp_path: Path) -> None:
    """KDIA's teacher_weights.jsonl: many records a round; a resume drops the rounds after the checkpoint."""
    run = RunDir(tmp_path)
    for r in range(4):
        run.append_metrics({"round": r})
        run.append_records("teacher_weights", [{"round": r, "node_id": n} for n in ("a", "b")])
    run.truncate_metrics_after(1)
    lines = [json.loads(x) for x in (tmp_path / "teacher_weights.jsonl").read_text().splitlines()]
    assert [(x["round"], x["node_id"]) for x in lines] == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    with pytest.raises(ValueError, match="plain name"):
        run.append_records("../escape", [{"round": 0}])


def test_a_file_rewritten_while_another_process_reads_it_is_never_seen_empty(tmp_path: Path) -> None:
    """A node host of the scale benchmark read the run's config.yaml while the coordinator wrote it
    again (truncate, then write) and stopped on 'an experiment file is a YAML mapping, got NoneType';
    the whole ramp then waited out its nodes. The file is replaced atomically now."""
    import threading

    from fedmq.coordinator.storage.run_dir import write_text

    path = tmp_path / "config.yaml"
    text = "name: x\n" + "seed: 0\n" * 20_000
    write_text(path, text)
    seen: list[int] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            seen.append(len(path.read_text()))

    reader = threading.Thread(target=read)
    reader.start()
    for _ in range(300):
        write_text(path, text)
    done.set()
    reader.join()
    assert seen and set(seen) == {len(text)}
