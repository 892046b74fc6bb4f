"""The experiment file's `compression:` block: validated strictly, left out of a default config's dump
(earlier runs' configs stay equal), and simulated runs with compressed updates (late updates
carried in sync, stale ones in async FedBuff) replayed bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from fedmq.experiments.config import apply_overrides, parse_config, read_yaml
from fedmq.experiments.replay import replay_run
from fedmq.experiments.scenario import resolve_scenario
from fedmq.experiments.simulate import simulate
from fedmq.fedcore.compression import Compression
from fedmq.fedcore.errors import ConfigError
from tests.helpers import QUICKSTART_STRAGGLERS as STRAGGLERS

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: as the node hosts train
ROOT = Path(__file__).resolve().parents[2]


def _config(overrides: list[str], name: str = "quickstart.yaml", scenario: str | None = None) -> object:
    data = apply_overrides(read_yaml(ROOT / "experiments" / name), overrides)
    if scenario is not None:
        data["scenario"] = resolve_scenario(scenario, ROOT / "experiments" / "scenarios")
    return parse_config(data)


def test_compression_option_reaches_a_compression() -> None:
    cfg = _config(["compression.mode=int8-block", "compression.block=64", "compression.delta=false"])
    assert cfg.compression.compression() == Compression(mode="int8-block", block=64, delta=False)  # type: ignore[attr-defined]


def test_default_compression_is_none_and_its_dump_reads_back() -> None:
    cfg = _config([])
    assert not cfg.compression.compression().enabled  # type: ignore[attr-defined]
    assert yaml.safe_load(cfg.to_yaml())["compression"]["mode"] == "none"  # type: ignore[attr-defined]
    chosen = _config(["compression.mode=float16"])
    assert parse_config(yaml.safe_load(chosen.to_yaml())) == chosen  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("compression.mode=int4", "compression.mode"),
        ("compression.block=4", "compression.block"),
        ("compression.delta=maybe", "compression.delta"),
        ("compression.scale=1", "compression.scale: unknown field"),
    ],
)
def test_bad_compression_option_is_refused_naming_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config([override])


@pytest.mark.parametrize(
    ("name", "overrides", "scenario"),
    [
        ("quickstart.yaml", ["rounds=4", "policy.late_updates=carry", "compression.mode=int8", *STRAGGLERS], None),
        ("quickstart-async.yaml", ["engine.aggregations=6", "compression.mode=bfloat16"], "heavy-stragglers.yaml"),
        ("quickstart.yaml", ["rounds=3", "compression.mode=int8-block", "compression.delta=false"], None),
    ],
    ids=["sync-int8-late-carried", "fedbuff-bfloat16-stale", "sync-int8-block-weights"],
)
def test_compressed_simulation_replays_bit_for_bit(
    name: str, overrides: list[str], scenario: str | None, tmp_path: Path
) -> None:
    """The replay compresses each recomputed update as the run's nodes did: every update hash, model
    hash and evaluation matches, and the event log records the compressed updates' bytes."""
    cfg = _config(overrides, name, scenario)
    summary = simulate(cfg, tmp_path / "run", device=torch.device("cpu"))  # type: ignore[arg-type]
    assert summary["state"] == "finished"
    lines = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    updates = [x for x in lines if x.get("ev") == "UpdateArrived" and x["tensors"]]
    assert updates and all("compression" in x["meta"] for x in updates)
    assert not [x for x in lines if x.get("cmd") == "Refused" and x["reason"] == "bad-compression"]
    if "policy.late_updates=carry" in overrides:
        assert any(u[3] > 0 for a in lines if a.get("cmd") == "Aggregate" for u in a["updates"])  # folded late
    outcome = replay_run(tmp_path / "run")
    assert outcome.mismatch is None and outcome.ok, outcome.mismatch
    assert outcome.report.final_model_sha256 == summary["model_sha256"]
    assert outcome.report.updates == len(updates)
