"""The experiment file: validated on load, errors name the field and what is allowed."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import get_type_hints

import pytest
import yaml

from fedmq.broker.config import BusConfig
from fedmq.coordinator.config import AsyncPolicy, RoundPolicy
from fedmq.experiments.build import bus_config, coordinator_config, node_faults, node_scripts
from fedmq.experiments.config import (
    BusSettings,
    CompressionConfig,
    EngineConfig,
    FaultConfig,
    PolicyConfig,
    StalenessConfig,
    TrainConfig,
    apply_overrides,
    load_config,
    parse_config,
    read_yaml,
)
from fedmq.fedcore.compression import Compression
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.staleness import Staleness
from fedmq.fedcore.training import TrainSettings
from fedmq.fednode.scenario import Faults
from fedmq.fields import field_bounds

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = {"name": "t", "nodes": 4, "rounds": 2}


def test_quickstart_config_loads_with_the_documented_settings() -> None:
    cfg = load_config(ROOT / "experiments" / "quickstart.yaml")
    assert (cfg.nodes, cfg.fraction, cfg.partition.alpha, cfg.method.name, cfg.data.dataset) == (
        20,
        0.25,
        0.3,
        "fedavg",
        "digits",
    )
    assert cfg.node_ids()[0] == "node-000" and len(cfg.node_ids()) == 20


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"nodes": 0}, "nodes: Input should be greater than or equal to 1"),
        ({"policy": {"fraction": 1.5}}, "policy.fraction: Input should be less than or equal to 1"),
        ({"train": {"lr": -1}}, "train.lr: Input should be greater than 0"),
        (
            {"train": {"optimiser": "sgd"}},
            "train.optimiser: unknown field; allowed here: batch_size, drop_last, local_epochs",
        ),
        ({"bogus": 1}, "bogus: unknown field; allowed here: bus, compression, data, engine"),
        ({"partition": {"kind": "bogus"}}, "partition.kind: unknown kind 'bogus'; allowed: iid, dirichlet"),
        ({"name": "a/b"}, "name: String should match pattern"),
        ({"faults": {"node-999": {"delay_s": 1}}}, "faults name nodes that do not exist"),
        ({"faults": {"x": {"delay_s": 1}}}, "is not a node id"),
        ({"policy": {"min_nodes": 9}}, "policy.min_nodes 9 exceeds nodes 4"),
        ({"rounds": None}, "rounds: required for synchronous rounds"),
        ({"engine": {"kind": "async", "buffer": 0}}, "engine.buffer: Input should be greater than or equal to 1"),
        ({"engine": {"kind": "later"}}, "engine.kind: Input should be 'sync' or 'async'"),
        ({"engine": {"staleness": {"fn": "linear"}}}, "engine.staleness.fn: Input should be 'constant', 'polynomial'"),
        ({"engine": {"kind": "async"}, "method": {"name": "scaffold"}}, "scaffold cannot fold stale updates: "),
        ({"policy": {"late_updates": "carry"}, "method": {"name": "feddyn"}}, "policy.late_updates carry: feddyn"),
        (
            {"engine": {"kind": "async"}, "method": {"aggregator": {"name": "fedsa"}}},
            "engine.kind async: fedavg cannot fold stale updates",
        ),
        ({"policy": {"inline_model_bytes": -1}}, "policy.inline_model_bytes: Input should be greater than or equal"),
    ],
)
def test_invalid_config_names_the_field(change: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(MINIMAL | change, source="exp.yaml")
    assert message in str(info.value) and "exp.yaml is invalid" in str(info.value)


def test_config_file_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the experiment file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="YAML mapping"):
        load_config(bad)
    bad.write_text("name: x\nnodes: 2\nrounds: 1\nmodel: !!python/object:os.system {}\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_overrides_apply_and_validate(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "experiments" / "quickstart.yaml", ["rounds=3", "train.lr=0.2", "policy.min_nodes=2"])
    assert (cfg.rounds, cfg.train.lr, cfg.policy.min_nodes) == (3, 0.2, 2)
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(ROOT / "experiments" / "quickstart.yaml", ["rounds"])
    with pytest.raises(ConfigError, match="rounds: Input should be greater than or equal to 1"):
        load_config(ROOT / "experiments" / "quickstart.yaml", ["rounds=0"])


def test_resolved_config_round_trips_through_yaml() -> None:
    cfg = load_config(ROOT / "experiments" / "quickstart.yaml")
    import yaml

    assert parse_config(yaml.safe_load(cfg.to_yaml())) == cfg


def test_extends_merges_maps_and_replaces_values(tmp_path: Path) -> None:
    """A reduced config names only what it changes: maps merge, lists, values and grid axes are replaced."""
    (tmp_path / "full.yaml").write_text(
        "name: full\nnodes: 10\nrounds: 200\ntrain: {local_epochs: 10, lr: 0.05}\n"
        "model: {name: mobilenetv2, options: {variant: cifar}}\ndata: {dataset: cifar10, augment: none}\n"
        "grid: {seed: [0, 1, 2], method: {A: {name: fedavg}, B: {name: fedavg}}}\n"
        "report: {paper: {A: {x: 2}}}\n"
    )
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "reduced.yaml").write_text(
        "extends: ../full.yaml\nrounds: 20\ntrain: {local_epochs: 2}\ngrid: {method: {A: {name: fedavg}}}\n"
        "model: {name: dnn}\ndata: {augment: default}\n"
    )
    data = read_yaml(tmp_path / "sub" / "reduced.yaml")
    assert data == {
        "name": "full",
        "nodes": 10,
        "rounds": 20,
        "train": {"local_epochs": 2, "lr": 0.05},
        "model": {"name": "dnn"},  # another model: its section is replaced, the old options dropped
        "data": {"dataset": "cifar10", "augment": "default"},
        "grid": {"seed": [0, 1, 2], "method": {"A": {"name": "fedavg"}}},  # an axis named again is replaced whole
        "report": {"paper": {"A": {"x": 2}}},
    }
    (tmp_path / "one-seed.yaml").write_text("extends: full.yaml\ngrid: {seed: null}\nreport: {paper: {B: {x: 1}}}\n")
    assert read_yaml(tmp_path / "one-seed.yaml")["report"] == {"paper": {"B": {"x": 1}}}  # figures replaced whole
    assert read_yaml(tmp_path / "one-seed.yaml")["grid"] == {
        "method": {"A": {"name": "fedavg"}, "B": {"name": "fedavg"}}
    }


def test_extends_cycle_and_missing_parent_are_clear_errors(tmp_path: Path) -> None:
    """A file that extends itself (through another) or a missing parent gives a ConfigError, not a crash."""
    (tmp_path / "a.yaml").write_text("extends: b.yaml\nname: a\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\nname: b\n")
    with pytest.raises(ConfigError, match="cycle"):
        read_yaml(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("extends: nowhere.yaml\nname: c\n")
    with pytest.raises(ConfigError, match="cannot read the experiment file"):
        read_yaml(tmp_path / "c.yaml")


def test_a_cell_finished_before_settings_were_added_or_moved_is_still_done(tmp_path: Path) -> None:
    """A finished grid cell's config.yaml is compared as read: one written before settings existed (here
    without privacy, simulation, policy.inline_model_bytes) or in the old spelling (fraction at the top)
    is the same experiment, and is not run again; a changed value is another experiment, and is."""
    from fedmq.experiments.build import inline_model_bytes
    from fedmq.experiments.grid import cell_is_done, expand

    cell = expand(MINIMAL | {"policy": {"fraction": 0.5}}, source="exp.yaml").cells[0]
    old = cell.config.model_dump(mode="json")
    for name in ("privacy", "simulation", "hierarchy", "federation"):
        del old[name]
    del old["policy"]["inline_model_bytes"], old["policy"]["fraction"]
    (tmp_path / "summary.json").write_text(json.dumps({"state": "finished"}))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old | {"fraction": 0.5}))
    assert cell_is_done(tmp_path, cell)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old | {"fraction": 0.25}))
    assert not cell_is_done(tmp_path, cell)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old | {"fraction": 0.5, "gone": 1}))
    assert not cell_is_done(tmp_path, cell)  # a setting that no longer exists: run again
    assert inline_model_bytes(cell.config) == 65536
    vectorized = parse_config(MINIMAL | {"hosting": {"vectorize": True}, "bus": {"tune_allocator": False}}, source="x")
    assert inline_model_bytes(vectorized) == 0 and vectorized.model_dump()["bus"]["tune_allocator"] is False
    chosen = parse_config(MINIMAL | {"hosting": {"vectorize": True}, "policy": {"inline_model_bytes": 10}}, source="x")
    assert inline_model_bytes(chosen) == 10 and chosen.model_dump()["policy"]["inline_model_bytes"] == 10


def test_fraction_and_deadline_at_the_top_are_read_as_the_policys_with_a_warning() -> None:
    """The old spelling (before issue 30) still loads, as the same experiment, saying what to write; set
    in both places it is refused; `--set fraction=...` and a grid axis named so move too."""
    new = parse_config(MINIMAL | {"policy": {"fraction": 0.5, "deadline_s": 9}})
    with pytest.warns(FutureWarning, match=r"write it as policy\.(fraction|deadline_s)") as said:
        old = parse_config(MINIMAL | {"fraction": 0.5, "deadline_s": 9})
    assert len(said) == 2
    assert old == new and (old.fraction, old.deadline_s) == (0.5, 9)
    with pytest.raises(ConfigError, match=r"fraction is set at the top level and as policy\.fraction"):
        parse_config(MINIMAL | {"fraction": 0.5, "policy": {"fraction": 0.25}})
    with pytest.warns(FutureWarning, match=r"deadline_s is deprecated: write policy\.deadline_s"):
        overridden = apply_overrides(dict(MINIMAL), ["deadline_s=9", "policy.fraction=0.5"])
    assert parse_config(overridden) == new


def test_async_experiment_needs_no_rounds_and_counts_model_versions() -> None:
    """An async file without rounds loads; what the run counts to is engine.aggregations."""
    cfg = parse_config(MINIMAL | {"rounds": None, "engine": {"kind": "async", "aggregations": 7}})
    assert (cfg.steps, cfg.step_name) == (7, "version")
    assert (parse_config(MINIMAL).steps, parse_config(MINIMAL).step_name) == (2, "round")
    shipped = load_config(ROOT / "experiments" / "quickstart-async.yaml")
    assert shipped.engine.kind == "async" and shipped.rounds is None and shipped.engine.buffer == 5


def test_file_that_says_nothing_gives_the_daemons_their_own_defaults(tmp_path: Path) -> None:
    """The policy, engine, bus and faults sections are derived from the daemons' dataclasses, so their
    defaults are the daemons' own (min_nodes and inline_model_bytes aside, which build.py derives)."""
    cfg = parse_config(MINIMAL)
    built = coordinator_config(cfg, tmp_path)
    assert built.policy == RoundPolicy(min_nodes=4) and built.asynchronous == AsyncPolicy()
    assert (built.rounds, built.eval_every, built.engine) == (2, 1, "sync")
    assert bus_config(cfg, "mqtt://h:1") == BusConfig.from_url("mqtt://h:1")
    assert node_faults(cfg, "node-001") == Faults()
    faulty = parse_config(MINIMAL | {"faults": {"node-001": {"delay_s": 2, "delay_rounds": [3, 1]}}})
    assert node_faults(faulty, "node-001") == Faults(delay_s=2.0, delay_rounds=frozenset({1, 3}))


def test_faults_are_a_preset_of_the_nodes_script() -> None:
    """Issue 30: one fault mechanism. `faults:` writes the faults of the node's scenario script, which
    the daemon plays (a node with a scenario keeps its scenario's part beside them); a node with
    neither keeps the default script."""
    faults = {"node-001": {"delay_s": 2, "delay_rounds": [3]}, "node-002": {"fail_at_round": 1}}
    scripts = node_scripts(parse_config(MINIMAL | {"faults": faults}))
    assert sorted(scripts) == ["node-001", "node-002"]
    assert scripts["node-001"].faults.delay_for(3) == 2.0 and scripts["node-001"].faults.delay_for(2) == 0.0
    assert scripts["node-002"].faults.fail_at_round == 1 and scripts["node-002"].transitions == ()
    scenario = {"compute": {"task_s": 4}, "groups": [{"nodes": ["node-002"], "drop_p": 0.5}]}
    scripted = node_scripts(parse_config(MINIMAL | {"faults": faults, "scenario": scenario}))
    assert scripted["node-002"].drop_p == 0.5 and scripted["node-002"].faults.fail_at_round == 1
    assert scripted["node-000"].task_s == 4 and scripted["node-000"].faults == Faults()


def _outside(limits: dict[str, float]) -> float:
    """A value just outside the first bound of `limits`."""
    name, bound = next(iter(limits.items()))
    return {"gt": bound, "ge": bound - 1, "lt": bound, "le": bound + 1}[name]


def _bounded_settings() -> list[tuple[str, type, str]]:
    """(file section, daemon dataclass, setting) for every setting with bounds that a file can set."""
    sections = {"policy": (PolicyConfig, RoundPolicy), "engine": (EngineConfig, AsyncPolicy)}
    sections |= {"bus": (BusSettings, BusConfig), "faults.node-001": (FaultConfig, Faults)}
    sections |= {"train": (TrainConfig, TrainSettings), "compression": (CompressionConfig, Compression)}
    sections |= {"engine.staleness": (StalenessConfig, Staleness)}
    return [
        (section, settings, f.name)
        for section, (model, settings) in sections.items()
        for f in fields(settings)
        if f.name in model.model_fields and field_bounds(get_type_hints(settings, include_extras=True)[f.name])
    ]


@pytest.mark.parametrize(("section", "settings", "name"), _bounded_settings())
def test_setting_outside_its_bounds_is_refused_from_a_file_and_from_python(
    section: str, settings: type, name: str
) -> None:
    """One definition of each bound: the file's section and the daemon's dataclass refuse the same value."""
    bounds = field_bounds(get_type_hints(settings, include_extras=True)[name])
    assert bounds is not None
    value = _outside(bounds.limits())
    with pytest.raises(ValueError, match=name):
        settings(**{name: value})
    change: dict[str, object] = {name: value}
    for part in reversed(section.split(".")):
        change = {part: change}
    with pytest.raises(ConfigError, match=f"{section}.{name}: Input should be"):
        parse_config(MINIMAL | change)


def test_section_fields_carry_the_daemons_docstrings() -> None:
    """A derived setting's description is its dataclass docstring; a None default says what None means."""
    described = PolicyConfig.model_fields
    assert (described["late_updates"].description or "").startswith("An update that comes after its round closed")
    assert (described["min_nodes"].description or "").endswith("None: all of them.")
    assert (TrainConfig.model_fields["lr_decay"].description or "").startswith("Per-round multiplier")


def test_core_sections_keep_the_file_schema() -> None:
    """train, engine.staleness and compression are derived from the core's dataclasses with the file's own
    rules kept: dp_noise_multiplier comes from privacy (not train), staleness a > 0 for every function
    (Staleness asks it only of the functions that use a)."""
    assert "dp_noise_multiplier" not in TrainConfig.model_fields
    assert list(TrainConfig.model_fields) == [f.name for f in fields(TrainSettings) if f.name != "dp_noise_multiplier"]
    with pytest.raises(ConfigError, match=r"engine\.staleness\.a: Input should be greater than 0"):
        parse_config(MINIMAL | {"engine": {"staleness": {"fn": "constant", "a": 0}}})
    assert Staleness(fn="constant", a=0.0)(3) == 1.0
    assert parse_config(MINIMAL).model_dump()["train"]["drop_last"] is False
    chosen = parse_config(MINIMAL | {"compression": {"mode": "int8-block", "block": 64}})
    assert chosen.compression.compression() == Compression(mode="int8-block", block=64)  # type: ignore[attr-defined]


def test_bus_chunk_without_room_for_headers_is_refused_by_the_bus_rule() -> None:
    """The rule between chunk_bytes and max_message_bytes is BusConfig's, applied when the file loads."""
    with pytest.raises(ConfigError, match="bus: Value error, chunk_bytes 65536 must leave room for headers"):
        parse_config(MINIMAL | {"bus": {"chunk_bytes": 65536, "max_message_bytes": 70000}})
