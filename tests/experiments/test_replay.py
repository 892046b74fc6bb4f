"""Recorded runs replayed in process (`fedmq replay`), on runs made by the in-process simulation
(fast; the daemons' runs are replayed in tests/integration/test_replay_daemons.py): a sync run with
stragglers and an async run with stragglers replay bit for bit; an edited, truncated or resumed log
is refused with a message naming the line; a counterfactual replay runs another method on the
recorded trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedmq.coordinator.drivers.replay import ReplayError, read_log
from fedmq.experiments.cli import EXIT_MISMATCH, EXIT_OK, main
from fedmq.experiments.config import apply_overrides, parse_config, read_yaml
from fedmq.experiments.replay import counterfactual, replay_run, trace_of
from fedmq.experiments.scenario import resolve_scenario
from fedmq.experiments.simulate import simulate
from tests.helpers import QUICKSTART_STRAGGLERS as STRAGGLERS
from tests.helpers import one_torch_thread

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: as the node hosts train
ROOT = Path(__file__).resolve().parents[2]


def _simulated(tmp_path: Path, name: str, overrides: list[str], scenario: str | None = None) -> Path:
    data = apply_overrides(read_yaml(ROOT / "experiments" / name), overrides)
    if scenario is not None:
        data["scenario"] = resolve_scenario(scenario, ROOT / "experiments" / "scenarios")
    cfg = parse_config(data)
    out = tmp_path / name.removesuffix(".yaml")
    with one_torch_thread():  # as the tests that replay it run (a module's run is made before their fixture)
        summary = simulate(cfg, out, device=torch.device("cpu"))
    assert summary["state"] == "finished"
    return out


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _simulated(tmp_path_factory.mktemp("sync"), "quickstart.yaml", ["rounds=4", *STRAGGLERS])


@pytest.fixture(scope="module")
def async_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _simulated(
        tmp_path_factory.mktemp("async"),
        "quickstart-async.yaml",
        ["engine.aggregations=8", "eval_every=2"],
        scenario="heavy-stragglers.yaml",
    )


def _lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def _write(run: Path, lines: list[dict]) -> None:
    (run / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def _copy(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    target.mkdir()
    for name in ("config.yaml", "summary.json", "metrics.jsonl", "events.jsonl"):
        (target / name).write_bytes((run / name).read_bytes())
    return target


@pytest.mark.parametrize("which", ["sync_run", "async_run"])
def test_a_run_with_stragglers_replays_bit_for_bit(which: str, request: pytest.FixtureRequest) -> None:
    run: Path = request.getfixturevalue(which)
    lines = _lines(run)
    if which == "async_run":  # the stragglers' updates were folded stale
        assert any(u[3] > 0 for x in lines if x.get("cmd") == "Aggregate" for u in x["updates"])
    outcome = replay_run(run)
    assert outcome.mismatch is None and outcome.notes == [] and outcome.ok
    summary = json.loads((run / "summary.json").read_text())
    assert outcome.report.final_model_sha256 == summary["model_sha256"]
    aggregated = [x for x in lines if x.get("ev") == "Aggregated"]
    assert outcome.report.aggregations == len(aggregated) >= 4
    assert outcome.report.updates == sum(1 for x in lines if x.get("ev") == "UpdateArrived" and x["tensors"])


def test_the_sync_run_had_late_updates(sync_run: Path) -> None:
    metrics = [json.loads(line) for line in (sync_run / "metrics.jsonl").read_text().splitlines()]
    assert sum(len(r.get("late", [])) for r in metrics) > 0, metrics  # the stragglers really straggled


def test_an_edited_model_hash_is_found_at_its_line(async_run: Path, tmp_path: Path) -> None:
    run = _copy(async_run, tmp_path)
    lines = _lines(run)
    index = [i for i, x in enumerate(lines) if x.get("ev") == "Aggregated"][2]
    lines[index]["model_sha256"] = "0" * 64
    _write(run, lines)
    outcome = replay_run(run)
    assert outcome.mismatch is not None and not outcome.ok
    assert outcome.mismatch.line == index + 1
    assert "aggregated model differs" in str(outcome.mismatch)
    assert outcome.report.aggregations == 2


def test_an_edited_sample_count_is_found_where_it_changes_a_decision(sync_run: Path, tmp_path: Path) -> None:
    run = _copy(sync_run, tmp_path)
    lines = _lines(run)
    index = next(i for i, x in enumerate(lines) if x.get("ev") == "UpdateArrived")
    lines[index]["meta"]["num_samples"] -= 1  # fewer than announced: taken, weighted differently
    _write(run, lines)
    outcome = replay_run(run)
    assert outcome.mismatch is not None
    assert "Aggregate" in str(outcome.mismatch) or "aggregated model" in str(outcome.mismatch)
    lines[index]["meta"]["num_samples"] += 2  # more than announced (and than its shard): the replay refuses it
    _write(run, lines)
    outcome = replay_run(run)
    assert outcome.mismatch is not None and outcome.mismatch.line == index + 1
    assert "samples-over-limit" in str(outcome.mismatch) and "above the node's limit" in str(outcome.mismatch)


def test_a_log_from_before_announced_counts_were_logged_still_replays(sync_run: Path, tmp_path: Path) -> None:
    """Older logs' NodeSeen lines have no num_samples: the counts were never checked then, so the
    replay does not check them either (a current log says null for a node that announced none)."""
    run = _copy(sync_run, tmp_path)
    lines = _lines(run)
    seen = [x for x in lines if x.get("ev") == "NodeSeen"]
    assert seen and all(isinstance(x["num_samples"], int) for x in seen if x["online"])
    for x in seen:
        del x["num_samples"]
    _write(run, lines)
    outcome = replay_run(run)
    assert outcome.mismatch is None and outcome.ok


def test_a_deleted_update_is_a_difference(sync_run: Path, tmp_path: Path) -> None:
    run = _copy(sync_run, tmp_path)
    lines = _lines(run)
    index = next(i for i, x in enumerate(lines) if x.get("ev") == "UpdateArrived")
    del lines[index]
    _write(run, lines)
    assert replay_run(run).mismatch is not None


def test_a_log_cut_at_a_line_is_incomplete_and_one_cut_mid_line_is_refused(sync_run: Path, tmp_path: Path) -> None:
    run = _copy(sync_run, tmp_path)
    text = (run / "events.jsonl").read_text()
    lines = text.splitlines(keepends=True)
    (run / "events.jsonl").write_text("".join(lines[: len(lines) // 2]))
    outcome = replay_run(run)
    assert outcome.mismatch is None and not outcome.ok
    assert any("before the run finished" in note for note in outcome.notes)
    (run / "events.jsonl").write_text("".join(lines[: len(lines) // 2]) + lines[len(lines) // 2][:25])
    with pytest.raises(ReplayError, match="truncated"):
        replay_run(run)


def test_the_command_exits_0_on_a_match_and_5_with_a_message_on_a_difference(
    sync_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", str(sync_run), "--out", str(tmp_path / "replayed")]) == EXIT_OK
    assert "identical to the recorded run" in capsys.readouterr().out
    assert json.loads((tmp_path / "replayed" / "replay.json").read_text())["ok"] is True
    run = _copy(sync_run, tmp_path)
    lines = _lines(run)
    index = next(i for i, x in enumerate(lines) if x.get("ev") == "UpdateArrived" and x["tensors"])
    lines[index]["sha256"] = "f" * 64
    _write(run, lines)
    assert main(["replay", str(run)]) == EXIT_MISMATCH
    err = capsys.readouterr().err
    assert f"line {index + 1}" in err and lines[index]["node"] in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"not": "a log"}\n', "not a fedmq event log"),
        ('{"log": "fedmq-events", "format": 99}\n', "format 99"),
        (
            '{"log": "fedmq-events", "format": 2}\n{"n": 1, "t": 0, "ev": "Start"}\n{"resume": {"round": 3}}\n',
            "resumed",
        ),
        ('{"log": "fedmq-events", "format": 2}\n[1, 2]\n', "line 2"),
    ],
)
def test_logs_that_cannot_be_replayed_are_refused_clearly(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(content)
    with pytest.raises(ReplayError, match=message):
        read_log(path)


def test_a_malformed_event_is_refused_with_its_line(sync_run: Path, tmp_path: Path) -> None:
    run = _copy(sync_run, tmp_path)
    lines = _lines(run)
    index = next(i for i, x in enumerate(lines) if x.get("ev") == "NodeSeen")
    del lines[index]["node"]
    _write(run, lines)
    with pytest.raises(ReplayError, match=f"line {index + 1}"):
        replay_run(run)


def test_the_trace_holds_availability_and_each_tasks_duration(async_run: Path) -> None:
    _, entries = read_log(async_run / "events.jsonl")
    trace = trace_of(entries)
    assert {node for _, node, online in trace.availability if online} == {f"node-{i:03d}" for i in range(20)}
    per_node = {node: {d for d in ds if d is not None} for node, ds in trace.durations.items() if ds}
    per_node = {node: ds for node, ds in per_node.items() if ds}
    assert len(per_node) >= 10 and all(max(ds) - min(ds) < 1e-9 for ds in per_node.values())  # a node's tasks alike
    times = sorted(min(ds) for ds in per_node.values())
    assert times[0] > 0.1 and times[-1] > 3 * times[0]  # the scenario's speeds: lognormal, and stragglers


def test_a_counterfactual_replay_runs_another_method_on_the_recorded_trace(async_run: Path, tmp_path: Path) -> None:
    result = counterfactual(async_run, ["method.name=fedprox"], tmp_path / "cf")
    assert result["original"]["method"] == "fedavg" and result["counterfactual"]["method"] == "fedprox"
    assert result["counterfactual"]["model_sha256"] != result["original"]["model_sha256"]
    summary = json.loads((tmp_path / "cf" / "summary.json").read_text())
    assert summary["state"] == "finished" and summary["counterfactual_of"] == str(async_run)
    # the counterfactual is itself a recorded run: it replays exactly
    assert replay_run(tmp_path / "cf").ok


def test_fedmq_simulate_runs_a_churn_scenario_and_its_run_replays(tmp_path: Path) -> None:
    """20 quickstart nodes under the churn scenario, asynchronously: nodes come and go, some tasks are
    dropped or lost with their node; the virtual clock runs far ahead of the wall clock."""
    out = tmp_path / "sim"
    args = ["simulate", str(ROOT / "experiments" / "quickstart-async.yaml"), "--out", str(out)]
    args += ["--scenario", str(ROOT / "experiments" / "scenarios" / "churn.yaml")]
    args += ["--set", "engine.aggregations=40", "--set", "eval_every=10", "--set", "policy.min_nodes=5"]
    args += ["--set", "engine.deadline_s=20"]
    assert main(args) == EXIT_OK
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "finished" and summary["mode"] == "simulated"
    assert summary["simulated_seconds"] > 20  # virtual time passed (no wall-clock ratio: machines and load differ)
    lines = _lines(out)
    offline = [x for x in lines if x.get("ev") == "NodeSeen" and not x["online"]]
    assert offline and any(x["t"] > 0 for x in offline)  # churn: nodes left during the run
    assert replay_run(out).ok


def test_a_scenario_naming_an_unknown_node_is_refused_by_simulate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = tmp_path / "bad.yaml"
    scenario.write_text("groups:\n  - nodes: [node-000, node-777]\n    drop_p: 0.5\n")
    args = ["simulate", str(ROOT / "experiments" / "quickstart.yaml"), "--scenario", str(scenario)]
    assert main([*args, "--out", str(tmp_path / "sim")]) == 2
    err = capsys.readouterr().err
    assert "node-777" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["replay", "RUN", "--threads", "0"], "at least 1"),
        (["simulate", "EXP.yaml", "--device", "gpu0"], "not a torch device"),
        (["replay", "RUN", "--device", "cuda:x"], "not a torch device"),
    ],
)
def test_bad_options_are_refused_before_anything_runs(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_replay_of_a_directory_that_is_not_a_run_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(tmp_path)]) == 2
    assert "config.yaml" in capsys.readouterr().err


def test_a_bf16_run_replays_bit_for_bit_and_not_as_float32(tmp_path: Path) -> None:
    """`train.precision: bf16` is deterministic on one device: its run replays bit for bit; its log
    replayed with the config edited back to float32 differs (the precision is what its models were)."""
    run = _simulated(tmp_path, "quickstart.yaml", ["rounds=2", "train.precision=bf16"])
    outcome = replay_run(run)
    assert outcome.ok and outcome.mismatch is None and outcome.report.aggregations == 2
    edited = _copy(run, tmp_path)
    config = edited / "config.yaml"
    config.write_text(config.read_text().replace("precision: bf16", "precision: float32"))
    assert "precision: float32" in config.read_text()
    assert replay_run(edited).mismatch is not None
