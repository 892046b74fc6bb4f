"""`fedmq methods`: every method is listed, and every hyperparameter says what it does."""

from __future__ import annotations

import pytest

from fedmq.experiments.cli import main
from fedmq.fedcore.algorithms import ALGORITHMS
from fedmq.fedcore.algorithms.describe import options


def test_methods_lists_every_registered_method(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["methods"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert {line.split()[0] for line in lines if line and not line.startswith("fedmq")} == set(ALGORITHMS)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_hyperparameter_is_documented(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    spec = ALGORITHMS[name]
    undocumented = [o.name for o in options(spec) if not o.doc]
    assert not undocumented, f"{name}: write a docstring under {undocumented}"
    assert main(["methods", name]) == 0
    out = capsys.readouterr().out
    assert all(f"  {o.name}: " in out for o in options(spec))


def test_unknown_method_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["methods", "fedsgd"]) == 2
    err = capsys.readouterr().err
    assert "unknown method 'fedsgd'; available: " in err and all(name in err for name in ALGORITHMS)


def test_methods_say_which_run_asynchronously(capsys: pytest.CaptureFixture[str]) -> None:
    """The list marks each method sync or sync/async from its half; a sync-only one says why."""
    assert main(["methods"]) == 0
    modes = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines() if line[:1].isalpha()}
    assert modes["fedavg"] == "sync/async" and modes["kdia"] == "sync/async" and modes["scaffold"] == "sync"
    assert main(["methods", "feddyn"]) == 0
    assert "asynchronous (engine.kind async): no: " in capsys.readouterr().out


def test_methods_list_the_averaging_rules_and_each_rules_options(capsys: pytest.CaptureFixture[str]) -> None:
    from fedmq.fedcore.aggregation import AGGREGATORS
    from fedmq.fedcore.algorithms.describe import class_options

    assert main(["methods"]) == 0
    assert f"method.aggregator.name): {', '.join(sorted(AGGREGATORS))}" in capsys.readouterr().out
    for name in ("clip", "trimmed_mean"):
        assert main(["methods", name]) == 0
        out = capsys.readouterr().out
        hyperparams = AGGREGATORS[name][0]
        assert hyperparams is not None
        assert all(f"  {o.name}: " in out and o.doc for o in class_options(hyperparams))
    assert main(["methods", "median"]) == 0
    assert "no options" in capsys.readouterr().out
