"""The built wheel, installed as a user installs it (issue 29, item 2).

The wheel is built from a copy of the checkout and installed into a fresh virtualenv; the commands
then run from a user's folder that holds packages of its own named `experiments` and `broker`, both
of which raise when imported. Before fedmq had one import name, its wheel put six generic top-level
packages into site-packages, and such a folder shadowed two of them. The fresh virtualenv borrows
the test environment's third-party packages (torch and the rest) through a .pth file, so nothing is
downloaded; the checkout itself stays out of reach, because .pth files in a directory added that way
(the editable install's finder) are not processed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
DECOYS = ("experiments", "broker")
"""Folders a user's own project commonly has, and fedmq once installed as top-level packages."""
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "runs", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", ".gpu"
)
"""What .gitignore keeps out of a clean clone: a stale build/ or egg-info would leak into the wheel."""
ONE_ROUND = {
    "name": "wheel",
    "seed": 0,
    "nodes": 3,
    "rounds": 1,
    "policy": {"fraction": 1.0, "deadline_s": 30},
    "data": {"dataset": "digits"},
    "partition": {"kind": "dirichlet", "alpha": 0.5, "min_samples": 10},
    "model": {"name": "mlp", "options": {"hidden": [32]}},
    "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.1},
}


@dataclass(frozen=True)
class Installed:
    """A fresh virtualenv with the wheel installed, and the user's folder to run fedmq from."""

    python: Path
    script: Path
    site_packages: Path
    before: frozenset[str]
    after: frozenset[str]
    version: str
    folder: Path
    env: Mapping[str, str]

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """`args` as a command in the user's folder, with that folder on the path as a project's would be."""
        return subprocess.run(
            args, cwd=self.folder, env=dict(self.env), capture_output=True, text=True, timeout=timeout, check=False
        )


def _checked(args: list[str]) -> subprocess.CompletedProcess[str]:
    """Runs a setup step; a failure shows the tool's own output, not only its exit status."""
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, f"{args} exited {result.returncode}:\n{result.stdout}{result.stderr}"
    return result


def build_wheel(work: Path) -> Path:
    """The wheel of a copy of the checkout, built without dependencies or network by this environment's
    setuptools: the copy keeps the checkout free of build/ and egg-info, and their leftovers out of the wheel."""
    source = work / "source"
    shutil.copytree(ROOT, source, symlinks=True, ignore=NOT_SOURCE)
    dist = work / "dist"
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--quiet"]
    _checked([*pip, "--wheel-dir", str(dist), str(source)])
    (wheel,) = dist.glob("fedmq-*.whl")
    return wheel


def make_venv(where: Path) -> tuple[Path, Path]:
    """A virtualenv without pip (this environment's pip installs into it), seeing this environment's
    third-party packages but not the checkout. Returns its python and its site-packages."""
    _checked([sys.executable, "-m", "venv", "--without-pip", str(where)])
    python = where / "bin" / "python"
    purelib = _checked([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    site_packages = Path(purelib.stdout.strip())
    borrowed = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site_packages / "fedmq-test-dependencies.pth").write_text("".join(f"{path}\n" for path in borrowed))
    return python, site_packages


def install(wheel: Path, python: Path) -> None:
    """`pip install --no-deps` of the wheel into the virtualenv of `python`."""
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "--quiet"]
    _checked([*pip, str(wheel)])


def user_folder(where: Path) -> Path:
    """A user's project folder whose own `experiments` and `broker` packages fail loudly if imported."""
    for name in DECOYS:
        package = where / name
        package.mkdir(parents=True)
        message = f"the user's own {name!r} package was imported: it shadows fedmq's"
        (package / "__init__.py").write_text(f"raise ImportError({message!r})\n")
    (where / "exp.yaml").write_text(yaml.safe_dump(ONE_ROUND))
    return where


def user_env(folder: Path) -> dict[str, str]:
    """The caller's environment without what would change how the fresh interpreter finds modules, and the
    user's folder on PYTHONPATH, so that the `fedmq` script (whose path starts at bin/) meets the decoys too."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONSTARTUP", "VIRTUAL_ENV"}
    return {k: v for k, v in os.environ.items() if k not in drop} | {"PYTHONPATH": str(folder)}


def listing(site_packages: Path) -> frozenset[str]:
    return frozenset(entry.name for entry in site_packages.iterdir())


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    work = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(work)
    python, site_packages = make_venv(work / "venv")
    before = listing(site_packages)
    install(wheel, python)
    folder = user_folder(work / "project")
    version = wheel.name.split("-")[1]
    return Installed(
        python=python,
        script=python.parent / "fedmq",
        site_packages=site_packages,
        before=before,
        after=listing(site_packages),
        version=version,
        folder=folder,
        env=user_env(folder),
    )


def test_the_wheel_adds_one_import_name_and_its_metadata_to_site_packages(installed: Installed) -> None:
    assert installed.before <= installed.after, sorted(installed.before - installed.after)
    gained = sorted(installed.after - installed.before)
    assert gained == ["fedmq", f"fedmq-{installed.version}.dist-info"], gained


def test_the_subpackages_are_plain_folders_with_their_data_files(installed: Installed) -> None:
    """In the checkout they are links; the wheel must hold their files, package data included."""
    package = installed.site_packages / "fedmq"
    for name in ["broker", "coordinator", "fednode", "aggregator", "fedcore", "experiments"]:
        assert (package / name).is_dir() and not (package / name).is_symlink(), name
        assert (package / name / "__init__.py").is_file(), name
    for data in ["py.typed", "experiments/quickstart.yaml", "coordinator/observers/dashboard.html"]:
        assert (package / data).is_file(), data
    assert list((package / "broker" / "servers" / "conf").glob("*.conf"))


def test_the_users_own_packages_break_whoever_imports_them(installed: Installed) -> None:
    """The trap works: were fedmq to import a bare `experiments` or `broker`, it would get these."""
    for name in DECOYS:
        result = installed.run(str(installed.python), "-c", f"import {name}")
        assert result.returncode == 1 and "it shadows fedmq's" in result.stderr, result.stderr


def test_fedmq_imports_from_the_fresh_venv_with_the_wheels_version(installed: Installed) -> None:
    """`fedmq`, its subpackages and its metadata come from the installed wheel, not from the checkout
    (whose editable install's metadata is on the borrowed path too)."""
    probe = (
        "import json, fedmq, fedmq.experiments.cli, fedmq.broker; from importlib import metadata;"
        "print(json.dumps({'version': fedmq.__version__, 'files': [fedmq.__file__, fedmq.experiments.cli.__file__,"
        " fedmq.broker.__file__, str(metadata.distribution('fedmq').locate_file('fedmq'))]}))"
    )
    result = installed.run(str(installed.python), "-c", probe)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["version"] == installed.version
    for path in found["files"]:
        assert Path(path).is_relative_to(installed.site_packages / "fedmq"), path


@pytest.mark.parametrize("how", ["fedmq", "python -m fedmq"])
def test_help_works_in_a_folder_with_its_own_experiments_and_broker(installed: Installed, how: str) -> None:
    command = [str(installed.script)] if how == "fedmq" else [str(installed.python), "-m", "fedmq"]
    result = installed.run(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: fedmq" in result.stdout and "fedmq run EXP.yaml" in result.stdout


def test_a_one_round_federation_runs_from_the_wheel_in_that_folder(installed: Installed) -> None:
    """`fedmq run` on the embedded broker: its broker, coordinator and node host are `python -m fedmq`
    processes started in the user's folder, where the decoys are first on the path."""
    out = installed.folder / "run"
    result = installed.run(
        str(installed.script), "run", "exp.yaml", "--out", str(out), "--processes", "1", "--quiet", timeout=120
    )
    logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted((out / "logs").glob("*")) if p.is_file())
    assert result.returncode == 0, result.stdout + result.stderr + logs
    assert "final accuracy" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["state"], summary["nodes"], summary["rounds_completed"]) == ("finished", 3, 1)
    assert summary["participation_totals"]["accepted"] == 3


def test_the_python_api_simulates_a_shipped_experiment_from_the_wheel(installed: Installed) -> None:
    """`fedmq.load_config` finds the shipped experiment inside the installed package (package data),
    and `fedmq.simulate` runs it in the user's folder."""
    script = (
        "import fedmq;"
        "cfg = fedmq.load_config('quickstart', nodes=4, rounds=1, fraction=1.0, model={'name': 'mlp'});"
        "run = fedmq.simulate(cfg, 'api-run', progress=False);"
        "print(run.state, len(run.metrics), fedmq.api.__file__)"
    )
    result = installed.run(str(installed.python), "-c", script, timeout=120)
    assert result.returncode == 0, result.stderr
    state, rows, api_file = result.stdout.split()
    assert (state, rows) == ("finished", "1") and Path(api_file).is_relative_to(installed.site_packages)
