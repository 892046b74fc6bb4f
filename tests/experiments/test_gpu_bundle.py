"""gpu_bundle: a dataset cut into parts that fit 64 MiB calls, joined on the GPU machine only when whole and checked.

Synthetic files of a few MiB and rooms of about a MiB stand in for the 101 MiB CIFAR pack and the
call limit; nothing here reaches the network (the wheel download is checked as a command line).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import fedmq
from fedmq.experiments import gpu_bundle as gb

pytestmark = pytest.mark.timed  # subprocesses with timeouts: never in the compute lane (conftest)

MIB = gb.MIB
CHECKOUT = Path(fedmq.__file__).resolve().parent.parent  # the checkout under test: fedmq/ sits at its top


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """A dataset folder like cifar10's: one large pack of random bytes and a small metadata file."""
    folder = tmp_path / "src" / "synth"
    folder.mkdir(parents=True)
    rng = random.Random(7)
    (folder / "pack.npz").write_bytes(rng.randbytes(3 * MIB + 12345))
    (folder / "batches.meta").write_bytes(b"labels" * 20)
    return folder


def _calls(dest: Path) -> list[Path]:
    """The call folders split wrote, in call order."""
    return sorted(dest.glob("call-*"), key=lambda p: int(p.name.split("-")[1]))


def test_plan_parts_fewest_calls_each_within_its_room() -> None:
    """Parts cover every byte of every file once, in order; no call holds more than its room, the first less the wheels."""
    files = [("a", 5 * MIB + 3), ("b", 10), ("c", 0), ("d", 2 * MIB)]
    room, extra = 2 * MIB, MIB // 2
    parts, calls = gb.plan_parts(files, room, extra, part_cap=MIB)
    total = sum(size for _, size in files)
    assert calls == -(-(total + extra) // room)  # 4: the fewest that hold the data and the wheels
    for name, size in files:
        mine = [p for p in parts if p.file == name]
        assert [p.offset for p in mine] == [sum(q.size for q in mine[:i]) for i in range(len(mine))]
        assert sum(p.size for p in mine) == size
        assert [p.name for p in mine] == [f"{name}.part{i:03d}" for i in range(1, len(mine) + 1)]
    assert all(p.size <= MIB for p in parts)
    load = {n: sum(p.size for p in parts if p.call == n) for n in range(1, calls + 1)}
    assert load[1] <= room - extra
    assert all(load[n] <= room for n in range(2, calls + 1))


def test_plan_parts_balances_the_calls() -> None:
    """Two calls for 4.2 rooms' worth split evenly (wheels counted), not 4 + 0.2: each keeps headroom under the limit."""
    parts, calls = gb.plan_parts([("a", 4 * MIB + MIB // 5)], room=4 * MIB, first_extra=MIB)
    assert calls == 2
    sends = [sum(p.size for p in parts if p.call == n) + (MIB if n == 1 else 0) for n in (1, 2)]
    assert max(sends) - min(sends) <= 1
    assert max(sends) < 3 * MIB


def test_plan_parts_refuses_when_the_wheels_leave_no_room() -> None:
    """A first call that the wheels fill alone cannot carry anything: said, not planned."""
    with pytest.raises(gb.BundleError, match="no room for data"):
        gb.plan_parts([("a", 10)], room=MIB, first_extra=MIB)


def test_split_then_join_across_calls_in_any_order(dataset: Path, tmp_path: Path) -> None:
    """Call folders arriving one at a time, last first: missing parts reported until the last, then the files match."""
    dest = tmp_path / "here" / ".gpu" / "synth"
    manifest = gb.split(dataset, dest, "synth", room=MIB, first_extra=MIB // 4)
    calls = _calls(dest)
    assert len(calls) == manifest["calls"] >= 4
    for call in calls:  # every call folder carries the whole manifest and only its own parts
        assert json.loads((call / gb.MANIFEST).read_text()) == manifest
        n = int(call.name.split("-")[1])
        assert sorted(p.name for p in call.iterdir() if p.name != gb.MANIFEST) == sorted(
            p["name"] for p in manifest["parts"] if p["call"] == n
        )
    there = tmp_path / "there"  # the GPU machine's checkout: its store and data root
    order = [calls[-1], calls[0], *calls[1:-1]]
    for i, call in enumerate(order):
        result = gb.join([call], there / "store", there / "data")
        assert sorted(result.stored) == sorted(p.name for p in call.iterdir() if p.name != gb.MANIFEST)
        arrived = {int(c.name.split("-")[1]) for c in order[: i + 1]}
        expected_missing = [(p["name"], p["call"]) for p in manifest["parts"] if p["call"] not in arrived]
        assert result.missing == expected_missing
        assert result.complete == (i == len(order) - 1)
        assert bool(result.joined) == result.complete
    for spec in manifest["files"]:
        out = there / "data" / "synth" / spec["name"]
        assert out.read_bytes() == (dataset / spec["name"]).read_bytes()
        assert hashlib.sha256(out.read_bytes()).hexdigest() == spec["sha256"]
    again = gb.join([], there / "store", there / "data", bundle="synth")  # a later call: nothing carried
    assert again.complete and all("already in place" in line for line in again.joined)


def test_a_corrupt_part_is_refused_and_not_stored(dataset: Path, tmp_path: Path) -> None:
    """One flipped byte: join names the part and its sha256, stores nothing of it, and the good part still goes in."""
    dest = tmp_path / ".gpu" / "synth"
    gb.split(dataset, dest, "synth", room=MIB, first_extra=0)
    call = _calls(dest)[1]
    part = next(p for p in call.iterdir() if p.name != gb.MANIFEST)
    good = part.read_bytes()
    part.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    store = tmp_path / "store"
    with pytest.raises(gb.BundleError, match=rf"part .*{re.escape(part.name)} is corrupt: .*expected .* sha256"):
        gb.join([call], store, tmp_path / "data")
    assert not (store / "synth" / part.name).exists()
    assert not list((store / "synth").glob("*.tmp"))
    part.write_bytes(good)
    assert part.name in gb.join([call], store, tmp_path / "data").stored


def test_a_joined_file_that_does_not_match_its_sha256_is_refused(dataset: Path, tmp_path: Path) -> None:
    """Parts that each match but join to the wrong file (a manifest edited by hand): no file written."""
    dest = tmp_path / ".gpu" / "synth"
    gb.split(dataset, dest, "synth", room=64 * MIB, first_extra=0)
    manifest_path = dest / "call-1" / gb.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][1]["sha256"] = "0" * 64
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(gb.BundleError, match="joined parts hash to"):
        gb.join([dest / "call-1"], tmp_path / "store", tmp_path / "data")
    assert not (tmp_path / "data" / "synth" / manifest["files"][1]["name"]).exists()


def test_join_command_line_reports_missing_parts(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 0 with the missing parts listed; with --complete exit 3 and which calls to send; 1 on a fresh machine."""
    dest = tmp_path / ".gpu" / "synth"
    manifest = gb.split(dataset, dest, "synth", room=2 * MIB, first_extra=0)
    calls = _calls(dest)
    assert len(calls) == 2
    paths = ["--store", str(tmp_path / "store"), "--into", str(tmp_path / "data")]
    assert gb.main(["join", *paths, "--bundle", "synth", "--complete"]) == 1
    assert "never stored on this machine" in capsys.readouterr().err
    assert gb.main(["join", str(calls[1]), *paths]) == 0
    missing = [p["name"] for p in manifest["parts"] if p["call"] == 1]
    assert f"still lacks {len(missing)} part(s): {', '.join(missing)} (from call(s) [1])" in capsys.readouterr().out
    assert gb.main(["join", *paths, "--bundle", "synth", "--complete"]) == 3
    assert "send call(s) [1] before this one" in capsys.readouterr().err
    assert gb.main(["join", str(calls[0]), *paths, "--complete"]) == 0
    assert "(joined, sha256 checked)" in capsys.readouterr().out


def test_join_runs_on_the_standard_library_alone(dataset: Path, tmp_path: Path) -> None:
    """`python -S -m fedmq.experiments.gpu_bundle join`, no site-packages at all, as on a GPU machine before the wheels."""
    dest = tmp_path / ".gpu" / "synth"
    gb.split(dataset, dest, "synth", room=64 * MIB, first_extra=0)
    cmd = [sys.executable, "-S", "-m", "fedmq.experiments.gpu_bundle", "join", str(dest / "call-1"), "--complete"]
    cmd += ["--store", str(tmp_path / "store"), "--into", str(tmp_path / "data")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(cmd, cwd=CHECKOUT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "data" / "synth" / "pack.npz").read_bytes() == (dataset / "pack.npz").read_bytes()


def _git_repo(path: Path, ignore: str = ".gpu/\n") -> Path:
    """A checkout with a tracked file of 2 MiB, as the tree every call sends."""
    path.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=path, check=True)
    (path / ".gitignore").write_text(ignore)
    (path / "big.bin").write_bytes(b"x" * 2 * MIB)
    return path


def test_prepare_keeps_every_call_within_the_limit(dataset: Path, tmp_path: Path) -> None:
    """Tree + call folder (+ wheels on the first call) is measured per call and stays under the limit; the
    first call installs the wheels under .gpu/site and runs `first`, the last joins the bundle and runs `run`."""
    repo = _git_repo(tmp_path / "repo")
    (repo / "untracked.txt").write_bytes(b"y" * 1000)  # untracked, not ignored: it travels too
    wheels = repo / gb.WHEELS_DIR
    wheels.mkdir(parents=True)
    (wheels / "demo_pkg-1.0-py3-none-any.whl").write_bytes(b"w" * (MIB // 2))
    limit = 4 * MIB
    tree = gb.tree_bytes(repo)
    assert tree == 2 * MIB + 1000 + len(".gpu/\n")
    manifest, calls, again, fetched = gb.prepare(
        dataset,
        repo,
        "synth",
        run="python3 train.py",
        first="python3 -m pytest tests/gpu",
        limit=limit,
        margin=64 * 1024,
        pins=["demo-pkg==1.0"],
    )
    assert [w.name for w in fetched] == ["demo_pkg-1.0-py3-none-any.whl"]
    assert len(calls) == manifest["calls"] > 1
    for n, call in enumerate(calls, 1):
        carried = sum(gb.path_bytes(repo / c) for c in call.carry)
        assert call.sends == tree + carried <= limit
        assert call.carry[0] == f".gpu/synth/call-{n}"
    assert calls[0].carry == [".gpu/synth/call-1", gb.WHEELS_DIR]
    assert all(gb.WHEELS_DIR not in c.carry for c in calls[1:])
    first = calls[0].command
    assert first.startswith("python3 -m fedmq.experiments.gpu_bundle join .gpu/synth/call-1 && ")
    assert "--no-index --no-deps" in first and "--target .gpu/site .gpu/wheels/*.whl" in first
    assert "export PYTHONPATH=$PWD/.gpu/site:$PWD" in first and first.endswith(" && python3 -m pytest tests/gpu")
    assert "--complete" not in first and "FEDMQ_DATA_ROOT" not in first and "train.py" not in first
    last = calls[-1].command
    assert last.startswith(f"python3 -m fedmq.experiments.gpu_bundle join .gpu/synth/call-{len(calls)} --complete && ")
    assert "pip install" not in last and "export PYTHONPATH=$PWD/.gpu/site:$PWD" in last
    assert "export FEDMQ_DATA_ROOT=$PWD/.gpu/data" in last and last.endswith(" && python3 train.py")
    assert "pytest" not in last
    assert again.carry == [] and again.sends == tree and "join --bundle synth --complete" in again.command
    assert again.command.endswith(" && python3 train.py")


def test_a_one_call_bundle_runs_first_then_run_whatever_first_returns() -> None:
    """One call carries it all: install, the path, the data root, then `first` (its failure, tests that
    fail say, does not stop the run) and `run`; without wheels no install and no path step."""
    (call,), _ = gb.plan_calls("synth", "python3 train.py", 10, [20], wheels=5, first="python3 -m pytest")
    assert call.carry == [".gpu/synth/call-1", gb.WHEELS_DIR] and call.sends == 35
    assert "join .gpu/synth/call-1 --complete && python3 -m pip install" in call.command
    assert call.command.endswith(" && { python3 -m pytest; true; } && python3 train.py")
    (bare,), again = gb.plan_calls("synth", "python3 train.py", 10, [20], wheels=None)
    assert "pip install" not in bare.command and ".gpu/site" not in bare.command + again.command
    assert bare.carry == [".gpu/synth/call-1"] and bare.sends == 30


def test_resume_parts_travel_in_a_call_of_their_own_just_before_the_last() -> None:
    """The data calls are full: the grids' resume parts get a call before the last, which unpacks them
    under runs/ (standard library only), so that the last call's grids resume."""
    calls, _ = gb.plan_calls("synth", "scripts/gpu-tables", 10, [20, 20], wheels=5, resume=30)
    assert [c.carry for c in calls] == [[".gpu/synth/call-1", gb.WHEELS_DIR], [gb.RESUME_DIR], [".gpu/synth/call-2"]]
    assert calls[1].command == "python3 -m fedmq.experiments.gpu_resume unpack .gpu/resume --into runs"
    assert calls[1].sends == 40 and calls[2].command.endswith("scripts/gpu-tables")
    (only, last), _ = gb.plan_calls("synth", "scripts/gpu-tables", 10, [20], wheels=None, resume=30)
    assert only.carry == [gb.RESUME_DIR] and last.carry == [".gpu/synth/call-1"]


def test_prepare_with_resume_needs_parts_and_keeps_their_call_within_the_limit(dataset: Path, tmp_path: Path) -> None:
    repo = _git_repo(tmp_path / "repo")
    with pytest.raises(gb.BundleError, match="holds no resume parts"):
        gb.prepare(dataset, repo, "synth", limit=64 * MIB, wheels=False, resume=True)
    (repo / gb.RESUME_DIR).mkdir(parents=True)
    (repo / gb.RESUME_DIR / "grid.resume.0.1of1").write_bytes(b"r" * MIB)
    _, calls, _, _ = gb.prepare(dataset, repo, "synth", limit=64 * MIB, wheels=False, resume=True)
    assert calls[-2].carry == [gb.RESUME_DIR] and calls[-2].sends <= 64 * MIB
    (repo / gb.RESUME_DIR / "grid.resume.0.1of1").write_bytes(b"r" * 63 * MIB)
    with pytest.raises(gb.BundleError, match="carry the parts of fewer grids"):
        gb.prepare(dataset, repo, "synth", limit=64 * MIB, wheels=False, resume=True)


def test_site_step_stops_the_call_when_the_machine_lost_the_wheels(tmp_path: Path) -> None:
    """The path step, run by bash: exit 3 with what to do when .gpu/site is gone (a machine given back
    between calls starts bare), else the installed wheels and the checkout on PYTHONPATH."""
    script = f'{gb.site_command()} && echo "$PYTHONPATH"'
    gone = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert gone.returncode == 3 and "start again from call 1" in gone.stderr
    (tmp_path / gb.SITE_DIR).mkdir(parents=True)
    kept = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert kept.stdout.strip() == f"{tmp_path}/.gpu/site:{tmp_path}"


def test_prepare_refuses_what_cannot_fit(dataset: Path, tmp_path: Path) -> None:
    """A tree that fills the call, and a .gpu/ that git would send, are refused with the reason."""
    repo = _git_repo(tmp_path / "repo")
    with pytest.raises(gb.BundleError, match=r"impossible: the tree sends 2\.0 MiB"):
        gb.prepare(dataset, repo, "synth", limit=2 * MIB, wheels=False)
    exposed = _git_repo(tmp_path / "exposed", ignore="")
    with pytest.raises(gb.BundleError, match=r"\.gpu/ is not ignored by git"):
        gb.prepare(dataset, exposed, "synth", wheels=False)


def test_pip_download_command_fetches_binary_cp312_manylinux_wheels_only(tmp_path: Path) -> None:
    """The command fetches no dependencies and no source, for CPython 3.12 on x86-64 manylinux."""
    cmd = gb.pip_download_command(tmp_path, ["cffi==2.1.1", "pydantic==2.14.4"], python="py")
    assert cmd[:4] == ["py", "-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and cmd[cmd.index("--implementation") + 1] == "cp"
    platforms = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--platform"]
    assert "manylinux2014_x86_64" in platforms and all(p.endswith("x86_64") for p in platforms)
    assert platforms[0] == "manylinux_2_28_x86_64"  # pip prefers the first: a glibc the image surely has
    assert cmd[-4:] == ["-d", str(tmp_path), "cffi==2.1.1", "pydantic==2.14.4"]


def test_sync_wheels_keeps_one_version_and_downloads_only_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wheel of another version goes (two stop the install there); pip is asked only for the missing pin."""
    (tmp_path / "pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"keep")
    (tmp_path / "pydantic_core-2.40.0-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"old")
    asked: list[list[str]] = []

    def fake_run(cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        asked.append(cmd)
        (tmp_path / "typing_extensions-4.16.0-py3-none-any.whl").write_bytes(b"new")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gb.subprocess, "run", fake_run)
    wheels = gb.sync_wheels(tmp_path, ["pydantic-core==2.50.5", "typing-extensions==4.16.0"])
    assert [w.name.split("-")[:2] for w in wheels] == [["pydantic_core", "2.50.5"], ["typing_extensions", "4.16.0"]]
    assert len(asked) == 1 and asked[0][-1] == "typing-extensions==4.16.0"
    asked.clear()
    gb.sync_wheels(tmp_path, ["pydantic-core==2.50.5", "typing-extensions==4.16.0"])
    assert asked == []


# The GPU machine's Python, for evaluating requirement markers: CPython 3.12 on Linux, no extras.
GPU_MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "implementation_name": "cpython",
    "os_name": "posix",
    "extra": "",
}


def _needs(dist: str) -> set[str]:
    """The normalized names a distribution requires on the GPU machine's Python, extras left out."""
    out = set()
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(GPU_MARKERS):
            out.add(gb.normalize(req.name))
    return out


def test_the_carried_wheels_and_the_image_cover_what_fedmq_needs() -> None:
    """Every fedmq dependency, and every need of a carried wheel, is carried or in the GPU image (KINDS.md)."""
    covered = {gb.normalize(n) for n in (*gb.GPU_WHEELS, *gb.GPU_PRESENT)}
    assert _needs("fedmq") - covered == set()
    for name in gb.GPU_WHEELS:
        assert _needs(name) - covered == set(), name
    assert "torch" not in {gb.normalize(n) for n in gb.GPU_WHEELS}  # the machine's own CUDA build stays


def test_a_command_over_the_tools_limit_is_refused_before_any_call() -> None:
    """A `--first` or `--run` that makes a call's command longer than the device tool takes (2,000
    characters) is refused when planned, with the length said, not sent to fail there."""
    long = "echo " + "x" * gb.COMMAND_LIMIT
    with pytest.raises(gb.BundleError, match=r"characters, over the 2000 allowed"):
        gb.plan_calls("synth", "python3 train.py", 10, [20, 20], wheels=5, first=long)
    with pytest.raises(gb.BundleError, match=r"characters, over the 2000 allowed"):
        gb.plan_calls("synth", long, 10, [20, 20], wheels=5)
    calls, _ = gb.plan_calls("synth", "python3 train.py", 10, [20, 20], wheels=5, first="echo ok")
    assert all(len(c.command) <= gb.COMMAND_LIMIT for c in calls)
