"""A user's own method, from their own folder: found as a module holding SPEC or as a `fedmq.methods`
entry point, listed and described by `fedmq methods`, its source in the method fingerprint, and every
broken plug-in a ConfigError on method.name that says what was tried and what to write."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedmq.experiments.cli import main
from fedmq.fedcore import plugins
from fedmq.fedcore.algorithms import ALGORITHMS, build_hyperparams, get_algorithm
from fedmq.fedcore.algorithms import plugins as method_plugins
from fedmq.fedcore.algorithms.fingerprint import MethodFingerprint, fingerprint_of
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.models import build_model
from fedmq.fedcore.tensors import schema_of
from tests.user_package import METHOD, forget_user_modules, user_folder, write_module, write_package

SCHEMA = schema_of(build_model("mlp", (64,), 10, seed=0).state_dict())


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Path]:
    with user_folder(write_package(tmp_path / "lab")) as folder:
        yield folder


def _fingerprints(name: str, **hp: object) -> tuple[MethodFingerprint, MethodFingerprint]:
    """(node half's, coordinator half's) fingerprint of method `name`."""
    spec = get_algorithm(name)
    values = build_hyperparams(spec, hp)
    coordinator = spec.coordinator(values, model=build_model("mlp", (64,), 10, seed=0))
    return fingerprint_of(spec.node(values, node_id="n"), SCHEMA), fingerprint_of(coordinator, SCHEMA)


def test_a_module_holding_spec_is_a_method_named_as_the_experiment_file_names_it(lab: Path) -> None:
    spec = get_algorithm(METHOD)
    assert spec.name == METHOD  # not SPEC.name ("sqrtavg"): every process finds it under the file's name
    assert build_hyperparams(spec, {"power": 1}).power == 1.0
    with pytest.raises(ConfigError, match="power must be"):
        build_hyperparams(spec, {"power": -1.0})
    assert get_algorithm(METHOD) is spec  # resolved once per process


def test_the_user_method_s_halves_agree_and_are_not_taken_for_fedavg(lab: Path) -> None:
    """Its halves subclass FedAvg's: the fingerprint names the user's method and carries its code."""
    node, coordinator = _fingerprints(METHOD)
    assert node.method == coordinator.method == METHOD
    assert node.digest == coordinator.digest and len(node.code) == 16
    assert MethodFingerprint.from_meta(node.to_meta()) == node
    fedavg, _ = _fingerprints("fedavg")
    assert fedavg.code == "" and "code" not in fedavg.to_meta()  # built-in fingerprints are as before


def test_another_version_of_the_user_s_code_changes_the_fingerprint_and_is_named(tmp_path: Path) -> None:
    """The coordinator's copy of mylab and a node's differ by one comment: the digests differ and the
    refusal's differences name the code; the same source in another folder gives the same digest."""
    fingerprints = []
    for folder, note in (("a", ""), ("b", ""), ("c", "version 2")):
        with user_folder(write_package(tmp_path / folder, method_note=note)):
            fingerprints.append(_fingerprints(METHOD)[0])
    here, same_elsewhere, changed = fingerprints
    assert here.digest == same_elsewhere.digest
    assert here.digest != changed.digest and here.hyperparams == changed.hyperparams
    differences = here.differences(changed, "here", "on the node")
    assert f"code of {METHOD}: {here.code} here, {changed.code} on the node" in differences
    assert "another version" in differences


def test_fedmq_methods_describes_a_module_from_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The `fedmq` script does not put the current folder on sys.path; resolving a plug-in does (last)."""
    folder = write_package(tmp_path / "lab")
    forget_user_modules()
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(folder))])
    try:
        assert main(["methods", METHOD]) == 0
    finally:
        forget_user_modules()
    out = capsys.readouterr().out
    assert out.startswith(f"{METHOD}: SqrtAvg: FedAvg weighting") and "power: " in out and "sqrtavg.py" in out
    assert sys.path[-1] == str(folder)


def _entry_points(folder: Path, lines: str) -> None:
    """A distribution's metadata declaring `lines` in fedmq.methods, as pip would install it."""
    info = folder / "mylab-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mylab\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[fedmq.methods]\n{lines}\n")


def test_an_entry_point_names_a_method_and_fedmq_methods_lists_it(
    lab: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _entry_points(lab, "sqrt = mylab.sqrtavg\nsqrt-spec = mylab.sqrtavg:SPEC\nfedavg = mylab.sqrtavg")
    assert method_plugins.installed() == ["fedavg", "sqrt", "sqrt-spec"]
    assert get_algorithm("sqrt-spec").name == "sqrt-spec"
    assert get_algorithm("fedavg") is ALGORITHMS["fedavg"]  # a built-in name cannot be taken over
    plugins.forget()  # one name per SPEC in a process, as in a daemon (two would be ambiguous)
    assert get_algorithm("sqrt").name == "sqrt" and _fingerprints("sqrt")[0].method == "sqrt"
    assert main(["methods"]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line[:1].isalpha()}
    assert "SqrtAvg" in listed["sqrt"] and "entry point mylab.sqrtavg in fedmq.methods" in listed["sqrt"]
    assert main(["methods", "sqrt"]) == 0
    assert "power: " in capsys.readouterr().out


BROKEN = {
    "no_spec": ('"""No SPEC here."""\nX = 1\n', "defines no 'SPEC'"),
    "not_a_spec": ("SPEC = {'name': 'x'}\n", "SPEC in .*not_a_spec.py is a dict, not a fedmq.fedcore"),
    "bad_half": (
        "from fedmq.fedcore.algorithms import base, fedavg\n"
        "SPEC = base.AlgorithmSpec(name='x', hyperparams=fedavg.Hyperparams, coordinator=fedavg.CoordinatorHalf,"
        " node=object)\n",
        "SPEC.node in .*bad_half.py must be a subclass of fedmq.fedcore.algorithms.base.NodeHalf",
    ),
    "bad_hyperparams": (
        "from fedmq.fedcore.algorithms import base, fedavg\n"
        "SPEC = base.AlgorithmSpec(name='x', hyperparams=dict, coordinator=fedavg.CoordinatorHalf,"
        " node=fedavg.NodeHalf)\n",
        "SPEC.hyperparams in .*bad_hyperparams.py must be a dataclass",
    ),
    "raises": ("raise RuntimeError('no GPU here')\n", "importing mylab.raises raised RuntimeError: no GPU here"),
    "imports_missing": ("import not_installed_anywhere\n", "importing mylab.imports_missing failed: No module"),
}


@pytest.mark.parametrize("module", sorted(BROKEN))
def test_a_broken_method_module_is_a_config_error_saying_what_to_fix(lab: Path, module: str) -> None:
    source, match = BROKEN[module]
    write_module(lab, module, source)
    with pytest.raises(ConfigError, match=match) as caught:
        get_algorithm(f"mylab.{module}")
    assert caught.value.field == "method.name"


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("fedsgd", "unknown method 'fedsgd'; available: fedacd, .*no fedmq.methods entry point .*no module 'fedsgd'"),
        ("nolab.method", "no module 'nolab' is on the path .*PYTHONPATH.*my_package.my_method"),
        ("fed avg", "unknown method 'fed avg'.*is no module reference"),
        ("mylab", "'mylab' names a module, not the method in it|mylab/__init__.py defines no 'SPEC'"),
    ],
)
def test_an_unknown_name_says_what_was_tried(lab: Path, name: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        get_algorithm(name)
