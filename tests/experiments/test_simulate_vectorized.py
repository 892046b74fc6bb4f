"""`fedmq simulate` training each round's nodes as one vectorised computation (`simulation.vectorize`):
the same federation as one by one within float tolerance, a run that `fedmq replay` reproduces bit for
bit, and methods that cannot be grouped falling back to one by one with their reason said once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from fedmq.experiments.config import apply_overrides, parse_config, read_yaml
from fedmq.experiments.local import build_local
from fedmq.experiments.replay import replay_run
from fedmq.experiments.simulate import simulate
from fedmq.fedcore.algorithms.shared import AveragingCoordinator
from fedmq.fedcore.vectorized import GRAPHS
from tests.helpers import QUICKSTART_STRAGGLERS as STRAGGLERS

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: as the node hosts train
ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def _config(overrides: list[str]):  # type: ignore[no-untyped-def]
    return parse_config(apply_overrides(read_yaml(ROOT / "experiments" / "quickstart.yaml"), overrides))


def _final(overrides: list[str]) -> tuple[dict[str, torch.Tensor], list[dict], int]:
    fed = build_local(_config(overrides), device=CPU)
    records = fed.run()
    return fed.model(), records, fed.groups_trained


def test_auto_trains_one_by_one_on_a_cpu() -> None:
    assert _config([]).simulation.vectorizes("cpu") is False
    assert _config([]).simulation.vectorizes("cuda") is True
    assert build_local(_config(["rounds=1"]), device=CPU).vectorize is False


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "fedacd"])
def test_vectorised_rounds_equal_one_by_one_within_tolerance(method: str) -> None:
    common = ["rounds=3", f"method.name={method}"]
    alone, alone_records, none = _final([*common, "simulation.vectorize=false"])
    grouped, grouped_records, groups = _final([*common, "simulation.vectorize=true"])
    assert none == 0 and groups == 3, "every round's five nodes trained as one group"
    assert [r["selected"] for r in grouped_records] == [r["selected"] for r in alone_records]
    # float32 rounding of the batched sums, carried through three rounds of SGD with momentum (float64
    # agreement to 1e-10 is tests/fedcore/test_group_terms.py's); another objective would be off by far more
    assert max(float((grouped[k] - alone[k]).abs().max()) for k in alone) < 2e-3
    for a, g in zip(alone_records, grouped_records, strict=True):
        assert g["accuracy"] == pytest.approx(a["accuracy"], abs=0.02)


def test_a_vectorised_simulation_replays_bit_for_bit(tmp_path: Path) -> None:
    """Stragglers and a dropped task: groups hold what the engine sent, which the replay rebuilds."""
    cfg = _config(["rounds=4", "simulation.vectorize=true", *STRAGGLERS])
    summary = simulate(cfg, tmp_path / "run", device=CPU)
    assert summary["state"] == "finished" and summary["vectorized"] and summary["groups_trained"] >= 4
    assert 0 < summary["train_share"] <= 1
    outcome = replay_run(tmp_path / "run", device=CPU)
    assert outcome.ok, outcome.mismatch or outcome.notes
    assert outcome.report.final_model_sha256 == summary["model_sha256"]


@pytest.mark.parametrize("method", ["fedavg", "kdia", "moon", "fedacd", "fedrcl", "fednh"])
def test_rounds_kept_from_group_to_group_change_no_bit_and_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """`simulation.reuse_rounds` trains each round's group in the buffers of the first (on a GPU, replaying
    its graphs): the run ends on bitwise the model of fresh rounds, and replays bit for bit. FedAvg's
    objective, KDIA's with its teacher and generated features (its key: `keep_as`), MOON's with each
    node's previous models (its members' inputs, refilled in the kept round), and FedACD's with its P
    carried from step to step (refilled too). FedRCL's with the lr decaying from round to round and from
    epoch to epoch (a call per epoch): the lr is read from the device, so all of them share one round.
    FedNH's, whose prototypes and s are loaded in place into a spare model each round."""
    from fedmq.fedcore.vectorized import _Round

    cheap = ["method.hyperparams={gen_epochs: 1, gen_batches_per_epoch: 5}"] if method == "kdia" else []
    cheap += ["train.lr_decay=0.9"] if method == "fedrcl" else []
    common = ["rounds=4", "simulation.vectorize=true", f"method.name={method}", *cheap, *STRAGGLERS]
    fresh, fresh_records, _ = _final(common)
    resets: list[int] = []
    reset = _Round.reset
    monkeypatch.setattr(_Round, "reset", lambda self, *args: (resets.append(1), reset(self, *args))[1])
    fed = build_local(_config([*common, "simulation.reuse_rounds=true"]), device=CPU)
    assert fed.reuse_rounds
    kept_records = fed.run()
    assert len(resets) >= 2 and fed.groups_trained == 4  # rounds trained in a kept round's buffers
    assert all(torch.equal(fresh[k], v) for k, v in fed.model().items())
    assert [r["accuracy"] for r in kept_records] == [r["accuracy"] for r in fresh_records]
    summary = simulate(_config([*common, "simulation.reuse_rounds=true"]), tmp_path / "run", device=CPU)
    calls = 4 * (_config(common).train.local_epochs if method == "fedrcl" else 1)  # FedRCL: a call per epoch
    assert summary["rounds_kept"] == {"reused": calls - 1, "built": 1, "not kept": 0}  # one round, built once
    outcome = replay_run(tmp_path / "run", device=CPU)
    assert outcome.ok and outcome.report.final_model_sha256 == summary["model_sha256"], outcome.mismatch
    assert not outcome.notes, outcome.notes
    if method == "kdia":  # times the run measured, which the replay leaves out (measured_metrics)
        assert {"teacher_seconds", "gen_seconds"} <= set(kept_records[-1])


@pytest.mark.parametrize("method", ["fedavg", "kdia"])
def test_a_plan_drawn_as_the_steps_need_it_changes_no_bit_and_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """`simulation.pipeline` (auto: on a GPU, where the host draws a round's plan while the device trains)
    forced on for a CPU run, rounds kept too: the run draws its plans in chunks, ends on bitwise the
    model of plans drawn whole, and replays bit for bit."""
    from fedmq.fedcore import round_plan

    cheap = ["method.hyperparams={gen_epochs: 1, gen_batches_per_epoch: 5}"] if method == "kdia" else []
    common = ["rounds=3", "simulation.vectorize=true", f"method.name={method}", "train.local_epochs=2", *cheap]
    whole, whole_records, _ = _final([*common, "simulation.pipeline=false"])
    chunks: list[int] = []
    bounds = round_plan._chunk_bounds
    monkeypatch.setattr(
        round_plan, "_chunk_bounds", lambda n, on: (chunks.append(len(bounds(n, on)) - 1), bounds(n, on))[1]
    )
    overrides = [*common, "simulation.pipeline=true", "simulation.reuse_rounds=true"]
    fed = build_local(_config(overrides), device=CPU)
    assert fed.pipeline == "on" and build_local(_config(common), device=CPU).pipeline == "auto"
    records = fed.run()
    assert chunks and min(chunks) >= 3, chunks  # every round's plan drawn in chunks
    assert all(torch.equal(whole[k], v) for k, v in fed.model().items())
    assert [r["accuracy"] for r in records] == [r["accuracy"] for r in whole_records]
    summary = simulate(_config(overrides), tmp_path / "run", device=CPU)
    outcome = replay_run(tmp_path / "run", device=CPU)
    assert outcome.ok and outcome.report.final_model_sha256 == summary["model_sha256"], outcome.mismatch


@pytest.mark.parametrize("method", ["kdia", "moon"])
def test_frozen_outputs_made_before_the_steps_train_as_in_the_steps_and_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """`simulation.outputs_ahead` (auto: on a GPU) forced on for a CPU run, its plans pipelined and its rounds
    kept as on a GPU: KDIA's teacher and MOON's global model run on each chunk of steps before them, the run
    ends on the model of outputs made in each step (float32 rounding through three rounds) and replays bit for bit."""
    from fedmq.fedcore.vectorized import _Round

    cheap = ["method.hyperparams={gen_epochs: 1, gen_batches_per_epoch: 5}"] if method == "kdia" else []
    common = ["rounds=3", "simulation.vectorize=true", f"method.name={method}", *cheap]
    in_step, in_step_records, _ = _final([*common, "simulation.outputs_ahead=false"])
    filled: list[int] = []
    fill = _Round._fill_outputs
    monkeypatch.setattr(_Round, "_fill_outputs", lambda self, *args: (filled.append(1), fill(self, *args))[1])
    overrides = [*common, "simulation.outputs_ahead=true", "simulation.pipeline=true", "simulation.reuse_rounds=true"]
    fed = build_local(_config(overrides), device=CPU)
    assert fed.outputs_ahead == "on" and build_local(_config(common), device=CPU).outputs_ahead == "auto"
    records = fed.run()
    assert filled, "the outputs were made before the steps"
    assert max(float((in_step[k] - v).abs().max()) for k, v in fed.model().items()) < 1e-4
    assert [r["accuracy"] for r in records] == pytest.approx([r["accuracy"] for r in in_step_records], abs=0.02)
    summary = simulate(_config(overrides), tmp_path / "run", device=CPU)
    outcome = replay_run(tmp_path / "run", device=CPU)
    assert outcome.ok and outcome.report.final_model_sha256 == summary["model_sha256"], outcome.mismatch


def test_replay_one_by_one_of_a_vectorised_run_is_a_mismatch(tmp_path: Path) -> None:
    """The replay trains as the run did: told to train one by one instead, it finds the difference."""
    cfg = _config(["rounds=2", "simulation.vectorize=true"])
    simulate(cfg, tmp_path / "run", device=CPU)
    config = tmp_path / "run" / "config.yaml"
    config.write_text(config.read_text().replace("vectorize: true", "vectorize: false"))
    outcome = replay_run(tmp_path / "run", device=CPU)
    assert not outcome.ok and "differs from the recorded one" in str(outcome.mismatch)


def test_the_run_and_its_replay_aggregate_under_the_runs_graph_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator's own steps (KDIA's generator) follow `simulation.graphs` as the nodes' groups
    do, in the run and in its replay: every aggregation sees the recorded mode, not the default."""
    seen: list[str] = []
    aggregate = AveragingCoordinator.aggregate

    def recording(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(GRAPHS.get())
        return aggregate(self, *args, **kwargs)

    monkeypatch.setattr(AveragingCoordinator, "aggregate", recording)
    simulate(
        _config(["rounds=2", "simulation.vectorize=true", "simulation.graphs=false"]), tmp_path / "run", device=CPU
    )
    ran = len(seen)
    assert replay_run(tmp_path / "run", device=CPU).ok
    assert ran == 2 and len(seen) == 4 and set(seen) == {"off"}, seen


def test_a_batch_norm_model_trains_in_groups_as_one_by_one_and_replays(tmp_path: Path) -> None:
    """FedSA's setting in small: a BatchNorm ResNet and FedAvg's node objective train each round's nodes
    as one group (their running statistics each node's own), the same federation as one by one within
    float32 tolerance, and the run replays bit for bit. The tolerance: this deep ResNet on 8x8 images
    (2x2 maps in its last stage, statistics over few values) amplifies float32 rounding fast, as much in
    one by one as in groups (a start perturbed by 1e-7 moves one by one's weights by 0.7 after 8 steps at
    the quickstart's lr): at lr 0.01 and one epoch the two differ by 0.0056 at most; with the padding
    counted in the statistics, by 0.18 (measured). Exactness is tests/fedcore/test_vectorized_batch_norm.py's,
    in float64."""
    common = ["rounds=1", "model.name=resnet32", "method.name=fedsa", "train.lr=0.01", "train.momentum=0"]
    common += ["train.local_epochs=1"]
    alone, alone_records, none = _final([*common, "simulation.vectorize=false"])
    grouped, grouped_records, groups = _final([*common, "simulation.vectorize=true"])
    assert none == 0 and groups == 1
    assert any(k.endswith("running_var") for k in grouped)
    assert max(float((grouped[k].double() - alone[k].double()).abs().max()) for k in alone) < 0.05
    assert grouped_records[0]["accuracy"] == pytest.approx(alone_records[0]["accuracy"], abs=0.02)
    summary = simulate(_config([*common, "rounds=2", "simulation.vectorize=true"]), tmp_path / "run", device=CPU)
    assert summary["groups_trained"] == 2
    outcome = replay_run(tmp_path / "run", device=CPU)
    assert outcome.ok, outcome.mismatch or outcome.notes


def test_nodes_that_cannot_train_in_groups_train_one_by_one_and_say_why(caplog: pytest.LogCaptureFixture) -> None:
    """Every built-in method has a group form, so the refusal here is the model's with MOON's objective:
    BatchNorm outside FedAvg's objective is refused, said once, and the run trains one by one."""
    with caplog.at_level(logging.WARNING, logger="fedmq.coordinator.drivers.local"):
        _, records, groups = _final(
            ["rounds=2", "model.name=resnet32", "method.name=moon", "simulation.vectorize=true"]
        )
    assert groups == 0 and len(records) == 2
    reasons = [r.message for r in caplog.records if "simulation.vectorize" in r.message]
    assert len(reasons) == 1 and "BatchNorm" in reasons[0]


def test_a_simulations_processes_ask_for_deterministic_kernels_on_their_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The coordinator's half and the nodes' workspace each ask for cuDNN's deterministic kernels on the
    device they train on (KDIA's generator on the coordinator's, the nodes on theirs): a GPU run then
    repeats bit for bit."""
    from fedmq.experiments import build
    from fedmq.fednode import workspace

    asked: list[torch.device] = []
    monkeypatch.setattr(build, "deterministic_kernels", asked.append)
    monkeypatch.setattr(workspace, "deterministic_kernels", asked.append)
    fed = build_local(_config(["rounds=1"]), device=CPU)
    assert asked == [fed.half.device, CPU]
