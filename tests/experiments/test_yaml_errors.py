"""One error format for experiment, grid and scenario files: ``FILE:LINE: dotted.path: message``."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from fedmq.api import load_config as api_load_config
from fedmq.experiments.config import load_config
from fedmq.experiments.grid import load_experiment
from fedmq.experiments.scenario import load_scenario
from fedmq.experiments.yaml_source import SourceMap, dotted, parse_yaml
from fedmq.fedcore.errors import ConfigError

EXPERIMENT = """\
name: e
nodes: 4
rounds: 2
# a comment, so that the lines are not the keys' positions
train:
  lr: 0.1
policy:
  fraction: {fraction}
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def error(call: object, *args: object) -> str:
    with pytest.raises(ConfigError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        call(*args)  # type: ignore[operator]
    return str(info.value)


def test_a_bad_value_in_an_experiment_file_names_its_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path / "exp.yaml", EXPERIMENT.format(fraction=1.5))
    text = error(load_config, path)
    assert f"{path} is invalid" in text
    assert f"{path}:8: policy.fraction: Input should be less than or equal to 1 (got 1.5)" in text


def test_a_value_from_the_file_extended_names_that_file(tmp_path: Path) -> None:
    write(tmp_path / "base.yaml", EXPERIMENT.format(fraction=1.5))
    path = write(tmp_path / "child.yaml", "extends: base.yaml\n\ntrain:\n  lr: -1\n")
    text = error(load_config, path)
    assert f"{path}:4: train.lr: Input should be greater than 0 (got -1)" in text
    assert f"{tmp_path / 'base.yaml'}:8: policy.fraction:" in text


def test_a_value_set_from_outside_the_file_names_where_it_came_from(tmp_path: Path) -> None:
    path = write(tmp_path / "exp.yaml", EXPERIMENT.format(fraction=0.5))
    text = error(load_config, path, ["policy.fraction=1.5"])
    assert "--set 'policy.fraction=1.5': policy.fraction: Input should be less than or equal to 1 (got 1.5)" in text
    assert f"{path}:8" not in text  # the file's own value is not the one refused
    text = error(lambda: api_load_config(path, **{"policy.fraction": 2}))
    assert "override policy.fraction: policy.fraction: Input should be less than or equal to 1 (got 2)" in text


def test_the_old_spelling_is_found_where_it_was_written(tmp_path: Path) -> None:
    path = write(tmp_path / "exp.yaml", "name: e\nnodes: 4\nrounds: 2\nfraction: 7\n")
    assert f"{path}:4: policy.fraction: Input should be less than or equal to 1 (got 7)" in error(load_config, path)


def test_a_grid_cell_names_the_line_of_its_axis_value(tmp_path: Path) -> None:
    text = EXPERIMENT.format(fraction=0.5) + "grid:\n  train.lr:\n    - 0.1\n    - -2\n"
    path = write(tmp_path / "grid.yaml", text)
    message = error(load_experiment, path)
    assert f"{path}:12: train.lr: Input should be greater than 0 (got -2)" in message
    bad_report = write(tmp_path / "report.yaml", EXPERIMENT.format(fraction=0.5) + "report:\n  last_k: 0\n")
    assert f"{bad_report}:10: report.last_k: Input should be greater than or equal to 1" in error(
        load_experiment, bad_report
    )


def test_a_bad_value_in_a_scenario_file_names_its_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path / "s.yaml", "seed: 1\ngroups:\n  - name: slow\n    drop_p: 2\n")
    assert f"{path}:4: groups[0].drop_p: Input should be less than or equal to 1 (got 2)" in error(load_scenario, path)


def test_a_scenario_read_into_an_experiment_names_the_scenario_files_line(tmp_path: Path) -> None:
    write(tmp_path / "s.yaml", "groups:\n  - nodes:\n      - node-001\n      - node-077\n")
    path = write(tmp_path / "exp.yaml", EXPERIMENT.format(fraction=0.5) + "scenario: s.yaml\n")
    text = error(load_config, path)
    assert f"{tmp_path / 's.yaml'}:4: groups[0].nodes[1]: 'node-077' is not a node of the experiment" in text
    inline = "scenario:\n  groups:\n    - nodes: [node-000,\n        node-009]\n"
    path = write(tmp_path / "inline.yaml", EXPERIMENT.format(fraction=0.5) + inline)
    assert f"{path}:12: groups[0].nodes[1]: 'node-009' is not a node" in error(load_config, path)


@pytest.mark.parametrize("loader", [load_config, load_scenario, load_experiment])
def test_a_syntax_error_names_file_line_and_column(tmp_path: Path, loader: object) -> None:
    path = write(tmp_path / "bad.yaml", "name: e\nnodes: 4\ntrain: {lr: 0.1\n")
    text = error(loader, path)
    assert text.startswith(f"{path}:4:1: not valid YAML: expected ',' or '}}'"), text
    assert "while parsing a flow mapping at line 3, column 8" in text
    assert "<unicode string>" not in text


def test_the_renderer_without_a_line_says_only_the_path() -> None:
    document = parse_yaml("a:\n  b:\n    - 1\n    - {c: 2}\n", "f.yaml")
    sources = SourceMap.of(document)
    assert sources.render(("a", "b", 1, "c"), "too big") == "f.yaml:4: a.b[1].c: too big"
    assert sources.render(("a", "missing"), "Field required", document.data) == "f.yaml:1: a.missing: Field required"
    assert SourceMap().render(("a", "b"), "too big") == "a.b: too big"
    assert dotted(()) == "(top level)"
