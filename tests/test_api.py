"""The Python API (`fedmq.load_config`, `simulate`, `run`, `open_run`, `replay`), as a notebook uses
it: a shipped experiment changed by keyword, a simulated run read back as rows and curves and
replayed, a run of real daemons on the embedded broker from inside a running event loop, and the
command line's typed errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import fedmq

SMALL = {"nodes": 6, "rounds": 2, "policy.fraction": 0.5, "model": {"name": "mlp", "options": {"hidden": [32]}}}


def test_importing_fedmq_loads_neither_torch_nor_the_api() -> None:
    """`fedmq --help` and `import fedmq` stay light: the API's names are imported on first use."""
    code = "import sys, fedmq; print(sorted(m for m in ('torch', 'fedmq.api') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
    assert fedmq.load_config is fedmq.api.load_config and "simulate" in dir(fedmq)
    with pytest.raises(AttributeError, match="no attribute 'simulat'"):
        fedmq.simulat  # noqa: B018


def test_load_config_takes_a_shipped_name_and_overrides_by_keyword() -> None:
    cfg = fedmq.load_config("quickstart", rounds=3, train={"lr": 0.01}, **{"partition.alpha": 0.5})
    assert (cfg.name, cfg.rounds, cfg.train.lr, cfg.partition.alpha) == ("quickstart", 3, 0.01, 0.5)
    assert cfg.train.momentum == 0.9  # the section was merged into the file's, not replaced
    again = fedmq.load_config(cfg, nodes=8)  # a loaded config, changed again
    assert (again.nodes, again.rounds, cfg.nodes) == (8, 3, 20)
    from_mapping = fedmq.load_config(again.model_dump(mode="json"))
    assert from_mapping == again


def test_load_config_errors_are_the_command_lines() -> None:
    with pytest.raises(fedmq.ConfigError, match="rounds"):
        fedmq.load_config("quickstart", rounds=-1)
    with pytest.raises(fedmq.ConfigError, match="cannot read the experiment file"):
        fedmq.load_config("no-such-experiment.yaml")
    with pytest.raises(fedmq.ConfigError, match="grid"):
        fedmq.load_config("quickstart", grid={"seed": [0, 1]})


def test_a_simulated_run_reads_back_as_rows_curves_and_a_replay(tmp_path: Path) -> None:
    cfg = fedmq.load_config("quickstart", **SMALL)
    run = fedmq.simulate(cfg, tmp_path / "run", progress=False)
    assert run.state == "finished" and run.directory == tmp_path / "run"
    assert [row["round"] for row in run.metrics] == [0, 1]
    assert run.final_accuracy == run.metrics[-1]["accuracy"] == run.curves["global"][-1][1]
    assert sorted(run.participation) == sorted({n for row in run.metrics for n in row["selected"]})
    assert sum(n["count"] for n in run.participation.values()) == sum(len(r["accepted"]) for r in run.metrics)
    assert "finished, final accuracy" in repr(run)
    run.plot(tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(KeyError, match="has no record log 'teacher'; it has metrics"):
        run.records("teacher")

    reopened = fedmq.open_run(tmp_path / "run")
    assert reopened.config == cfg and reopened.summary == run.summary
    assert run.replay().ok

    # a recorded model hash that the replay cannot reproduce: the command line's exit 5, as an error
    log = tmp_path / "run" / "events.jsonl"
    lines = log.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if '"model_sha256"' in line)
    entry = json.loads(lines[at])
    entry["model_sha256"] = "0" * 64
    lines[at] = json.dumps(entry)
    log.write_text("\n".join(lines) + "\n")
    with pytest.raises(fedmq.ReplayDiffers) as differs:
        fedmq.replay(tmp_path / "run")
    assert not differs.value.outcome.ok and isinstance(differs.value, fedmq.ReplayError)
    assert not fedmq.replay(tmp_path / "run", check=False).ok


def test_a_simulation_that_cannot_finish_raises_federation_failed(tmp_path: Path) -> None:
    """Nodes that come online only after wait_for_nodes_s fail the run (the command line's exit 4):
    the error says why and carries the run to read."""
    cfg = fedmq.load_config(
        "quickstart", **SMALL, policy={"wait_for_nodes_s": 10}, scenario={"groups": [{"name": "late", "join_at": 60}]}
    )
    with pytest.raises(fedmq.FederationFailed, match="ended failed: only 0 of the 6 nodes") as failed:
        fedmq.simulate(cfg, tmp_path / "run", progress=False)
    assert failed.value.run.state == "failed" and "within 10 s" in failed.value.run.summary["error"]


def test_open_run_says_what_a_folder_is_not(tmp_path: Path) -> None:
    with pytest.raises(fedmq.ConfigError, match="not a run directory"):
        fedmq.open_run(tmp_path)
    (tmp_path / "grid.json").write_text("{}")
    (tmp_path / "cell-a").mkdir()
    (tmp_path / "cell-a" / "config.yaml").write_text("name: a\n")
    with pytest.raises(fedmq.ConfigError, match="grid's directory: open one of its cells \\(cell-a"):
        fedmq.open_run(tmp_path)


@pytest.mark.slow
async def test_run_starts_the_daemons_from_inside_a_running_event_loop(tmp_path: Path) -> None:
    """As in a notebook, whose event loop is running: `fedmq.run` still runs a federation of real
    processes (an embedded broker, the coordinator, a node host) and gives its run directory."""
    cfg = fedmq.load_config("quickstart", **{**SMALL, "nodes": 3, "policy.fraction": 1.0, "rounds": 1})
    run = fedmq.run(cfg, tmp_path / "run", processes=1, progress=False, timeout_s=120)
    assert run.state == "finished" and len(run.metrics) == 1
    assert sorted(run.metrics[0]["accepted"]) == cfg.node_ids()
    assert (tmp_path / "run" / "report.md").exists()
