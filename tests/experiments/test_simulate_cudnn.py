"""`simulation.cudnn`: how cuDNN chooses a GPU's convolution algorithms in the simulating process. The
default, deterministic, replays bit for bit; the others are faster where cuDNN's choice matters and
are said to be unreplayable on a GPU. On this CPU the flags do nothing: the tests check what is asked."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch
import yaml

from fedmq.experiments import local
from fedmq.experiments.cli import main
from fedmq.experiments.config import SimulationConfig, apply_overrides, parse_config, read_yaml
from fedmq.experiments.replay import unreplayable
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.seeding import CUDNN_CHOICES

ROOT = Path(__file__).resolve().parents[2]


def _config(*overrides: str):  # type: ignore[no-untyped-def]
    return parse_config(apply_overrides(read_yaml(ROOT / "experiments" / "quickstart.yaml"), list(overrides)))


def test_the_setting_names_cudnn_s_ways_deterministic_by_default_and_refuses_others() -> None:
    field = SimulationConfig.model_fields["cudnn"]
    assert typing.get_args(field.annotation) == tuple(CUDNN_CHOICES) and field.default == "deterministic"
    assert _config("simulation.cudnn=benchmark").simulation.cudnn == "benchmark"
    with pytest.raises(
        ConfigError, match=r"simulation\.cudnn: Input should be 'deterministic', 'default' or 'benchmark'"
    ):
        _config("simulation.cudnn=fast")


def test_the_built_federation_asks_for_the_config_s_way_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the workspace and the half asked for deterministic algorithms: the setting wins, for the
    process's best device (the half's, a GPU where there is one) when the nodes train on a CPU."""
    asked: list[tuple[str, str]] = []
    monkeypatch.setattr(local, "cudnn_kernels", lambda device, choice: asked.append((str(device), choice)))
    local.build_local(_config("rounds=1", "simulation.cudnn=benchmark"), device=torch.device("cpu"))
    assert asked == [(str(local.best_device()), "benchmark")]


def test_a_replay_on_a_gpu_says_why_a_run_with_free_algorithms_may_differ() -> None:
    free, fixed = _config("simulation.cudnn=default"), _config()
    assert unreplayable(free, torch.device("cpu")) is None  # the CPU's kernels are the same either way
    assert unreplayable(fixed, torch.device("cuda")) is None
    why = unreplayable(free, torch.device("cuda"))
    assert why is not None and "simulation.cudnn: default" in why and "deterministic" in why


def test_cells_sharing_a_process_must_ask_for_one_way(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = {
        "extends": str(ROOT / "experiments" / "quickstart.yaml"),
        "name": "cudnn-ways",
        "rounds": 1,
        "grid": {"simulation.cudnn": ["deterministic", "benchmark"]},
    }
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(spec))
    args = ["simulate", str(path), "--out", str(tmp_path / "run"), "--cells-per-process", "2"]
    assert main(args) == 2
    assert "different simulation.cudnn (benchmark, deterministic)" in capsys.readouterr().err
