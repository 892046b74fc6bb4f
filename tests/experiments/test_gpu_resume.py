"""`fedmq.experiments.gpu_resume`: a grid cut off on a GPU machine comes back in parts that fit what a call
brings back, and, carried to a fresh machine, resumes to the model the uncut grid ends on."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from fedmq.experiments import gpu_resume as gr
from fedmq.experiments.cli import EXIT_OK, main
from fedmq.experiments.config import read_yaml
from fedmq.experiments.grid import expand
from tests.experiments.test_simulate_resume import _cut_run, two_seed_grid

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: sums in one order, bit for bit
ROOT = Path(__file__).resolve().parents[2]
KIB = 1024


def _run_dir(tmp_path: Path, files: dict[str, bytes]) -> Path:
    run = tmp_path / "runs" / "demo"
    for name, data in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(data)
    return run


def test_a_cut_grid_packed_in_parts_and_unpacked_elsewhere_resumes_to_the_uncut_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU machine's grid: one cell finished, one cut after its round-1 checkpoint. Packed into parts of
    64 KiB (as 15 MiB parts a ResNet-18's), the machine's runs/ lost, the parts unpacked on another: the
    grid resumed there ends the cut cell on the uncut one's model and metrics, and keeps the finished one."""
    grid_file = two_seed_grid(tmp_path, "quickstart-gpu-resume")
    machine = tmp_path / "machine" / "runs" / "grid"
    assert main(["simulate", str(grid_file), "--out", str(machine)]) == EXIT_OK
    kept, cut = sorted((machine / "cells").iterdir())
    reference = json.loads((cut / "summary.json").read_text()), (cut / "metrics.jsonl").read_text()
    cell = next(c for c in expand(read_yaml(grid_file), source="grid").cells if c.cell_id == cut.name)
    shutil.rmtree(cut)
    _cut_run(cell.config, cut, monkeypatch)

    packed = gr.pack(machine, tmp_path / "out", files_left=8, bytes_left=64 << 20, part_bytes=64 * KIB)
    assert len(packed.parts) >= 2 and all(p.stat().st_size <= 64 * KIB for p in packed.parts)
    assert sum(p.stat().st_size for p in packed.parts) == packed.archive_bytes
    carried = tmp_path / "next-session" / ".gpu" / "resume"
    carried.mkdir(parents=True)
    for part in packed.parts:
        shutil.copy(part, carried / part.name)
    shutil.rmtree(tmp_path / "machine")  # the machine went back: nothing of it is left

    runs = tmp_path / "next-session" / "runs"
    said = gr.unpack(carried, runs)
    assert said == [f"grid: {len(packed.parts)} part(s) joined, sha256 checked, extracted to {runs / 'grid'}"]
    again = runs / "grid"
    stamp = (again / "cells" / kept.name / "summary.json").stat().st_mtime_ns
    assert main(["simulate", str(grid_file), "--out", str(again), "--resume"]) == EXIT_OK
    assert (again / "cells" / kept.name / "summary.json").stat().st_mtime_ns == stamp  # finished: not run again
    summary = json.loads((again / "cells" / cut.name / "summary.json").read_text())
    assert summary["resumed_from_round"] == 1
    assert summary["model_sha256"] == reference[0]["model_sha256"]
    assert (again / "cells" / cut.name / "metrics.jsonl").read_text() == reference[1]


def test_the_archive_leaves_out_finished_cells_checkpoints_and_cut_writes_and_is_the_same_bytes_each_time(
    tmp_path: Path,
) -> None:
    run = _run_dir(
        tmp_path,
        {
            "grid.json": b"{}",
            "cells/a/summary.json": b"{}",
            "cells/a/checkpoint.safetensors": b"a" * 100,
            "cells/b/checkpoint.safetensors": b"b" * 100,
            "cells/b/events.jsonl": b"{}\n",
            "cells/b/.checkpoint.safetensors.x1y2.tmp": b"half a write",
        },
    )
    data = gr.archive(run)
    assert data == gr.archive(run)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        names = sorted(tar.getnames())
    assert names == [
        "demo/cells/a/summary.json",
        "demo/cells/b/checkpoint.safetensors",
        "demo/cells/b/events.jsonl",
        "demo/grid.json",
    ]


def test_a_grid_with_nothing_to_resume_is_not_packed(tmp_path: Path) -> None:
    """Every cell finished (or none reached its first checkpoint): no parts, and the reason."""
    run = _run_dir(tmp_path, {"cells/a/summary.json": b"{}", "cells/a/checkpoint.safetensors": b"a"})
    packed = gr.pack(run, tmp_path / "out", files_left=8, bytes_left=1 << 20)
    assert packed.parts == [] and "nothing to resume" in packed.reason and not (tmp_path / "out").exists()


def test_parts_that_do_not_fit_what_the_call_brings_back_are_not_written(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, {"cells/b/checkpoint.safetensors": os.urandom(3 * KIB)})
    out = tmp_path / "out"
    too_few = gr.pack(run, out, files_left=2, bytes_left=1 << 20, part_bytes=KIB)
    assert too_few.parts == [] and "in 4 part(s)" in too_few.reason and "2 more file(s)" in too_few.reason
    too_small = gr.pack(run, out, files_left=8, bytes_left=KIB, part_bytes=KIB)
    assert too_small.parts == [] and "not written" in too_small.reason
    assert not out.exists()
    fits = gr.pack(run, out, files_left=4, bytes_left=1 << 20, part_bytes=KIB)
    assert [p.name.rsplit(".", 1)[1] for p in fits.parts] == ["1of4", "2of4", "3of4", "4of4"]


def test_the_command_line_counts_what_is_already_in_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`pack` leaves room for the files already in $OUT and a reserve for the steps after it."""
    run = _run_dir(tmp_path, {"cells/b/checkpoint.safetensors": os.urandom(2 * KIB)})
    out = tmp_path / "out"
    out.mkdir()
    for i in range(5):
        (out / f"report-{i}.md").write_text("x")
    assert gr.main(["pack", str(run), str(out), "--reserve-files", "2"]) == 0
    assert "gpu_resume: wrote" in capsys.readouterr().out  # 8 - 5 - 2 = 1 file: one part fits
    assert len(list(out.glob("demo.resume.*"))) == 1
    assert gr.main(["pack", str(run), str(out), "--reserve-files", "2"]) == 0  # now 6 files: none left
    assert "0 more file(s)" in capsys.readouterr().out


def test_unpack_refuses_a_missing_part_a_corrupt_set_and_a_stray_file(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, {"cells/b/checkpoint.safetensors": os.urandom(3 * KIB)})
    parts = gr.pack(run, tmp_path / "out", files_left=8, bytes_left=1 << 20, part_bytes=KIB).parts
    carried = tmp_path / "carried"
    carried.mkdir()
    for part in parts[1:]:
        shutil.copy(part, carried / part.name)
    with pytest.raises(gr.ResumeError, match=r"part\(s\) \[1\] of 4 were not carried"):
        gr.unpack(carried, tmp_path / "next" / "runs")
    (carried / parts[0].name).write_bytes(b"0" * parts[0].stat().st_size)
    with pytest.raises(gr.ResumeError, match="hash to"):
        gr.unpack(carried, tmp_path / "next" / "runs")
    assert not (tmp_path / "next" / "runs").exists()
    (carried / "notes.txt").write_text("x")
    with pytest.raises(gr.ResumeError, match="not a resume part"):
        gr.unpack(carried, tmp_path / "next" / "runs")


def test_unpack_keeps_the_machines_own_newer_grid(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, {"grid.json": b"{}", "cells/b/checkpoint.safetensors": b"b"})
    carried = tmp_path / "carried"
    gr.pack(run, carried, files_left=8, bytes_left=1 << 20)
    assert gr.unpack(carried, tmp_path / "runs") == [
        "demo: kept the machine's own runs/demo (newer than the carried parts)"
    ]


def test_an_archive_reaching_outside_its_grid_is_refused(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("demo/../../evil")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    data = buffer.getvalue()
    import hashlib

    carried = tmp_path / "carried"
    carried.mkdir()
    (carried / f"demo.resume.{hashlib.sha256(data).hexdigest()}.1of1").write_bytes(data)
    with pytest.raises(gr.ResumeError, match="not a file of the grid"):
        gr.unpack(carried, tmp_path / "runs")
    assert not (tmp_path / "evil").exists()


def test_unpack_runs_on_the_standard_library_alone(tmp_path: Path) -> None:
    """`python -S -m fedmq.experiments.gpu_resume unpack`, no site-packages, as on a GPU machine before its wheels."""
    run = _run_dir(tmp_path, {"grid.json": b"{}", "cells/b/checkpoint.safetensors": b"b" * 10})
    carried = tmp_path / "carried"
    gr.pack(run, carried, files_left=8, bytes_left=1 << 20)
    cmd = [sys.executable, "-S", "-m", "fedmq.experiments.gpu_resume", "unpack", str(carried)]
    cmd += ["--into", str(tmp_path / "runs")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "runs" / "demo" / "cells" / "b" / "checkpoint.safetensors").read_bytes() == b"b" * 10
