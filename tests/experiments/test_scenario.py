"""Scenario files: strict validation with file and line, seeded expansion into one NodeScript per node."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from fedmq.experiments.config import load_config, parse_config
from fedmq.experiments.scenario import ScenarioConfig, expand, load_scenario, load_trace, parse_scenario
from fedmq.fedcore.errors import ConfigError
from fedmq.fednode.scenario import NodeScript, Transition

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "experiments" / "scenarios").glob("*.yaml"))


def ids(n: int) -> list[str]:
    width = max(3, len(str(n - 1)))
    return [f"node-{i:0{width}d}" for i in range(n)]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_expand_same_seed_same_scripts_other_seed_other_draws() -> None:
    """Expansion is a pure function of the scenario, the node ids and the seed."""
    s = load_scenario(ROOT / "experiments" / "scenarios" / "churn.yaml")
    assert expand(s, ids(30), 5) == expand(s, ids(30), 5)
    assert expand(s, ids(30), 5) != expand(s, ids(30), 6)
    assert {v.seed for v in expand(s, ids(3), 5).values()} == {5}


def test_expand_adding_nodes_keeps_each_nodes_draws() -> None:
    """A node's speed, link and on/off periods do not depend on which other nodes exist."""
    s = parse_scenario(
        {
            "groups": [
                {
                    "speed": {"lognormal": {"median": 1, "sigma": 1}},
                    "link": {"latency_s": {"exponential": {"mean": 0.1}}},
                    "availability": {"onoff": {"on_s": {"exponential": {"mean": 60}}, "off_s": 30}},
                }
            ]
        }
    )
    small, large = expand(s, ids(10), 1), expand(s, ids(200), 1)
    assert all(small[n] == large[n] for n in small)
    assert len({v.compute_factor for v in large.values()}) == 200


def test_expand_every_node_present_unmentioned_nodes_get_the_default() -> None:
    """Nodes no group or trace row selects get the default script (with the scenario's base compute)."""
    s = parse_scenario({"groups": [{"nodes": ["node-001"], "speed": 3}]})
    out = expand(s, ids(4), 9)
    assert list(out) == ids(4)
    assert out["node-000"] == NodeScript(seed=9) and out["node-001"].compute_factor == 3
    based = expand(parse_scenario({"compute": {"task_s": 2, "per_sample_s": 0.1}, "seed": 1}), ids(2), 9)
    assert based["node-000"] == NodeScript(task_s=2, per_sample_s=0.1, seed=10)
    assert based["node-000"].compute_s(10) == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("dist", "mean", "low", "high"),
    [
        ({"constant": 2.5}, 2.5, 2.5, 2.5),
        (2.5, 2.5, 2.5, 2.5),
        ({"exponential": {"mean": 3}}, 3.0, 0, math.inf),
        ({"lognormal": {"mu": 0, "sigma": 0.5}}, math.exp(0.125), 0, math.inf),
        ({"lognormal": {"median": 2, "sigma": 0.5}}, 2 * math.exp(0.125), 0, math.inf),
        ({"pareto": {"alpha": 3, "scale": 2}}, 3.0, 2, math.inf),
        ({"uniform": {"low": 1, "high": 5}}, 3.0, 1, 5),
    ],
)
def test_distribution_draws_match_its_mean_and_support(dist: object, mean: float, low: float, high: float) -> None:
    """Each distribution's draws over many nodes have the right mean and stay in the support."""
    s = parse_scenario({"groups": [{"speed": dist}]})
    factors = np.array([v.compute_factor for v in expand(s, ids(4000), 0).values()])
    assert factors.min() >= low and factors.max() <= high
    assert factors.mean() == pytest.approx(mean, rel=0.06)


def test_windows_produce_transitions_open_end_and_starts_online() -> None:
    """Windows give online/offline transitions; a window at 0 means starts online; null is open-ended."""
    s = parse_scenario({"groups": [{"availability": {"windows": [[0, 10], [20, 30], [40, None]]}}]})
    script = expand(s, ["node-000"], 0)["node-000"]
    assert script.starts_online
    assert script.transitions == (
        Transition(10, False),
        Transition(20, True),
        Transition(30, False),
        Transition(40, True),
    )
    late = expand(parse_scenario({"groups": [{"availability": {"windows": [[5, 8]]}}]}), ["node-000"], 0)
    assert not late["node-000"].starts_online
    assert [(t.at, t.online) for t in late["node-000"].transitions] == [(5, True), (8, False)]


def test_repeated_windows_follow_the_period_until_the_horizon() -> None:
    """period_s repeats the windows; after horizon_s the state at the horizon stays."""
    s = parse_scenario({"horizon_s": 250, "groups": [{"availability": {"windows": [[50, 100]], "period_s": 100}}]})
    script = expand(s, ["node-000"], 0)["node-000"]
    assert not script.starts_online
    assert [(t.at, t.online) for t in script.transitions] == [(50, True), (100, False), (150, True), (200, False)]
    assert script.online_at(260) is False and script.online_at(175) is True


def test_onoff_alternates_until_the_horizon() -> None:
    """An on/off process alternates and stops drawing at the horizon."""
    spec = {"onoff": {"on_s": {"exponential": {"mean": 20}}, "off_s": 10, "start": "offline"}}
    s = parse_scenario({"horizon_s": 1000, "groups": [{"availability": spec}]})
    script = expand(s, ["node-000"], 3)["node-000"]
    states = [t.online for t in script.transitions]
    assert not script.starts_online and states[0] and all(a != b for a, b in itertools.pairwise(states))
    offline = [b.at - a.at for a, b in itertools.pairwise(script.transitions) if not a.online]
    assert offline and all(d == pytest.approx(10) for d in offline)
    assert 900 < script.transitions[-1].at < 1000 + 10


def test_join_leave_and_crashes_shape_the_timeline() -> None:
    """join_at/leave_at bound the online time; a crash goes offline (crash=True) and reconnects later."""
    group = {"join_at": 5, "leave_at": 100, "crashes": [{"at": 20, "reconnect_after": 10}, {"at": 200}]}
    script = expand(parse_scenario({"groups": [group]}), ["node-000"], 0)["node-000"]
    assert not script.starts_online
    assert script.transitions == (
        Transition(5, True),
        Transition(20, False, crash=True),
        Transition(30, True),
        Transition(100, False),
    )


def test_crash_while_offline_changes_nothing() -> None:
    """A crash in an offline window is tolerated and scripts nothing."""
    group = {"availability": {"windows": [[0, 10]]}, "crashes": [{"at": 15, "reconnect_after": 1}]}
    script = expand(parse_scenario({"groups": [group]}), ["node-000"], 0)["node-000"]
    assert script.transitions == (Transition(10, False),)


def test_fraction_selection_is_seeded_and_rounded() -> None:
    """fraction picks a seeded share of the nodes: the same for the same seed, another for another."""
    s = parse_scenario({"groups": [{"fraction": 0.1, "speed": 10}]})

    def slow(seed: int, n: int = 200) -> set[str]:
        return {k for k, v in expand(s, ids(n), seed).items() if v.compute_factor == 10}

    assert len(slow(0)) == 20 and slow(0) == slow(0) and slow(0) != slow(1)
    assert len(slow(0, 20)) == 2
    assert len(slow(0) ^ slow(0, 210)) <= 1 + 1  # one more picked, at most one other swapped


def test_later_groups_override_earlier_ones_per_setting() -> None:
    """A later group replaces only the settings it gives, for the nodes it selects."""
    s = parse_scenario(
        {
            "groups": [
                {"speed": 2, "link": {"latency_s": 0.1, "bandwidth_bps": 1000}, "drop_p": 0.1},
                {"nodes": ["node-001"], "speed": 5, "link": {"bandwidth_bps": 50}},
            ]
        }
    )
    out = expand(s, ids(2), 0)
    assert (out["node-000"].compute_factor, out["node-000"].bandwidth_bps) == (2, 1000)
    assert (out["node-001"].compute_factor, out["node-001"].latency_s, out["node-001"].bandwidth_bps) == (5, 0.1, 50)
    assert out["node-001"].drop_p == 0.1


CSV = """node,event,time,value
node-001,offline,10,
node-001,online,25,
node-001,offline,25.5,
node-001,offline,26,
node-002,online,5,
node-002,crash,7,
node-002,online,9,
node-003,speed,0,4
node-003,bandwidth,0,1e6
"""


def test_trace_csv_scripts_availability_and_values(tmp_path: Path) -> None:
    """A CSV trace: the state before a node's first event is the opposite; repeated events are ignored."""
    write(tmp_path / "t.csv", CSV)
    s = load_scenario(write(tmp_path / "s.yaml", "trace: t.csv\ngroups: [{nodes: [node-003], speed: 2}]\n"))
    out = expand(s, ids(4), 0)
    assert out["node-001"].starts_online
    assert [(t.at, t.online) for t in out["node-001"].transitions] == [(10, False), (25, True), (25.5, False)]
    assert not out["node-002"].starts_online
    assert out["node-002"].transitions == (Transition(5, True), Transition(7, False, crash=True), Transition(9, True))
    assert (out["node-003"].compute_factor, out["node-003"].bandwidth_bps) == (4, 1e6)
    assert len(load_trace(tmp_path / "t.csv")) == 9


@pytest.mark.parametrize("form", ["list", "lines"])
def test_trace_json_list_and_json_lines(tmp_path: Path, form: str) -> None:
    """A JSON trace: a list of objects or one object per line, same keys as the CSV."""
    rows = [{"node": "node-000", "event": "offline", "time": 3}, {"node": "node-000", "event": "online", "time": 4}]
    text = json.dumps(rows, indent=1) if form == "list" else "\n".join(map(json.dumps, rows))
    path = write(tmp_path / ("t.json" if form == "list" else "t.jsonl"), text)
    assert [r.event for r in load_trace(path)] == ["offline", "online"]
    s = parse_scenario({"trace": path.name}, base=tmp_path)
    assert expand(s, ids(1), 0)["node-000"].transitions == (Transition(3, False), Transition(4, True))


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "t.csv",
            "node,event,time\nnode-000,online,1\nnode-000,reboot,2\n",
            "t.csv:3: event: Input should be 'online'",
        ),
        ("t.csv", "node,event,time\nnode-000,online,-1\n", "t.csv:2: time: Input should be greater than or equal to 0"),
        ("t.csv", "node,event,time\n\nnode-000,online,soon\n", "t.csv:3: time: Input should be a valid number"),
        ("t.csv", "node,event,when\n", "t.csv:1: the header is node,event,when"),
        (
            "t.csv",
            "node,event,time,value\nnode-000,speed,5,2\n",
            "t.csv:2: (top level): speed is set for the whole run",
        ),
        ("t.csv", "node,event,time,value\nnode-0,speed,0,2\nnode-0,speed,0,3\n", "t.csv:3: node-0's speed is given"),
        ("t.json", '[\n {"node": "a", "event": "online", "time": 0},\n {"node": "a", "time": 1}\n]', "t.json:3: event"),
        ("t.json", '[{"node": "a", "event": "online", "time": 0, "why": 1}]', "t.json:1: why: unknown field"),
        ("t.jsonl", '{"node": "a", "event": "online", "time": 0}\n{"node": ', "t.jsonl:2: not valid JSON"),
        ("t.txt", "", "expected a .csv, .json or .jsonl file"),
    ],
)
def test_bad_trace_rows_are_refused_with_the_line(tmp_path: Path, name: str, text: str, message: str) -> None:
    """A bad trace row names the file, the row's line and the reason."""
    with pytest.raises(ConfigError) as info:
        load_trace(write(tmp_path / name, text))
    assert message in str(info.value)


BAD = [
    ("groups:\n  - bogus: 1\n", "s.yaml:2: groups[0].bogus: unknown field; allowed here: name, nodes, fraction"),
    ("horizon: 5\n", "s.yaml:1: horizon: unknown field; allowed here: horizon_s, seed"),
    (
        "groups:\n  - availability:\n      windows:\n        - [0, 10]\n        - [5, 20]\n",
        "s.yaml:5: groups[0].availability.windows[1]: window [5.0, 20.0] starts before the previous one ends",
    ),
    (
        "groups:\n  - availability:\n      windows:\n        - [20, 30]\n        - [0, 10]\n",
        "s.yaml:5: groups[0].availability.windows[1]: window [0.0, 10.0] starts before",
    ),
    (
        "groups:\n  - availability: {windows: [[-1, 10]]}\n",
        "s.yaml:2: groups[0].availability.windows[0][0]: Input should be greater than or equal to 0",
    ),
    ("groups:\n  - crashes:\n      - at: -3\n", "s.yaml:3: groups[0].crashes[0].at: must be non-negative"),
    (
        "groups:\n  - crashes: [{at: 5, reconnect_after: -1}]\n",
        "groups[0].crashes[0].reconnect_after: must be positive",
    ),
    ("groups:\n  - speed: {gamma: {k: 1}}\n", "s.yaml:2: groups[0].speed.gamma: unknown field; allowed here: constant"),
    ("groups:\n  - speed: {uniform: {low: 0, high: 2}}\n", "groups[0].speed: must be positive, but this can draw 0"),
    ("groups:\n  - nodes: some\n", "s.yaml:2: groups[0].nodes: expected all or a list of node ids (got 'some')"),
    ("groups:\n  - drop_p: 2\n", "s.yaml:2: groups[0].drop_p: Input should be less than or equal to 1"),
    (
        "horizon_s: 86400\ngroups:\n  - availability: {onoff: {on_s: 0.1, off_s: 0.1}}\n",
        "s.yaml:3: groups[0].availability: about 864000 transitions per node",
    ),
    ("groups:\n  - {name: a}\n  - {name: a}\n", "s.yaml:3: groups[1].name: group name 'a' is used twice"),
    ("- 1\n", "a scenario is a YAML mapping"),
]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_bad_scenario_is_refused_with_line_and_reason(tmp_path: Path, text: str, message: str) -> None:
    """Bad input names the file, the line, the field and what is wrong."""
    with pytest.raises(ConfigError) as info:
        load_scenario(write(tmp_path / "s.yaml", text))
    assert message in str(info.value)


def test_unknown_nodes_are_refused_with_the_line(tmp_path: Path) -> None:
    """Node ids are checked against the experiment's, naming the scenario's (or the trace's) line."""
    write(tmp_path / "t.csv", "node,event,time\nnode-000,offline,1\nnode-042,offline,2\n")
    s = load_scenario(
        write(tmp_path / "s.yaml", "trace: t.csv\ngroups:\n  - nodes:\n      - node-001\n      - node-077\n")
    )
    with pytest.raises(ConfigError) as info:
        expand(s, ids(4), 0)
    text = str(info.value)
    assert "s.yaml:5: groups[0].nodes[1]: 'node-077' is not a node of the experiment" in text
    assert "t.csv:3: trace[1]: node 'node-042' is not a node" in text and "node-000 .. node-003" in text


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
@pytest.mark.parametrize("nodes", [20, 1000])
def test_shipped_scenarios_validate_and_expand(path: Path, nodes: int) -> None:
    """Every shipped scenario validates and expands for any node count."""
    out = expand(load_scenario(path), ids(nodes), 0)
    assert len(out) == nodes and all(isinstance(v, NodeScript) for v in out.values())


def test_shipped_scenarios_do_what_their_names_say() -> None:
    """Stragglers: a tenth ~10x slower; diurnal: half online at a time; churn: transitions and crashes."""
    scenarios = {p.stem: load_scenario(p) for p in SHIPPED}
    assert set(scenarios) >= {"stable", "heavy-stragglers", "diurnal", "churn"}
    assert not any(v.transitions for v in expand(scenarios["stable"], ids(50), 0).values())
    slow = [v for v in expand(scenarios["heavy-stragglers"], ids(1000), 0).values() if v.compute_factor > 5]
    assert 90 <= len(slow) <= 115
    diurnal = expand(scenarios["diurnal"], ids(1000), 0).values()
    assert 400 <= sum(v.online_at(1000.0) for v in diurnal) <= 600
    churn = list(expand(scenarios["churn"], ids(1000), 0).values())
    assert sum(any(t.crash for t in v.transitions) for v in churn) > 50 and all(v.drop_p == 0.02 for v in churn)


def test_experiment_file_resolves_scenario_file_and_trace_relative_to_it(tmp_path: Path) -> None:
    """``scenario: FILE`` is read relative to the experiment, its trace relative to the scenario; the
    saved config holds it inline and loads back equal."""
    write(tmp_path / "sc" / "t.csv", "node,event,time\nnode-002,offline,4\n")
    write(tmp_path / "sc" / "s.yaml", "trace: t.csv\ngroups: [{fraction: 0.5, speed: 3}]\n")
    exp = write(tmp_path / "exp" / "e.yaml", "name: t\nnodes: 4\nrounds: 2\nscenario: ../sc/s.yaml\n")
    cfg = load_config(exp)
    assert isinstance(cfg.scenario, ScenarioConfig) and cfg.scenario.trace[0].node == "node-002"
    assert cfg.scenario == load_scenario(tmp_path / "sc" / "s.yaml")
    out = expand(cfg.scenario, cfg.node_ids(), cfg.seed)
    assert sum(v.compute_factor == 3 for v in out.values()) == 2 and not out["node-002"].online_at(5)
    saved = yaml.safe_load(cfg.to_yaml())
    assert isinstance(saved["scenario"], dict) and parse_config(saved) == cfg


def test_inline_scenario_in_an_experiment(tmp_path: Path) -> None:
    """An inline scenario works; its trace file is read relative to the experiment file."""
    write(tmp_path / "t.json", '[{"node": "node-001", "event": "crash", "time": 2}]')
    text = (
        "name: t\nnodes: 3\nrounds: 1\nscenario:\n  trace: t.json\n  groups:\n    - {nodes: [node-000], drop_p: 0.5}\n"
    )
    cfg = load_config(write(tmp_path / "e.yaml", text))
    assert cfg.scenario is not None
    out = expand(cfg.scenario, cfg.node_ids(), 0)
    assert out["node-000"].drop_p == 0.5 and out["node-001"].transitions == (Transition(2, False, crash=True),)


def test_experiment_refuses_scenario_nodes_it_does_not_have() -> None:
    """The experiment's validation names the scenario's unknown node ids."""
    with pytest.raises(ConfigError) as info:
        parse_config({"name": "t", "nodes": 4, "rounds": 1, "scenario": {"groups": [{"nodes": ["node-009"]}]}})
    assert "groups[0].nodes[0]: 'node-009' is not a node of the experiment" in str(info.value)


def test_experiment_without_scenario_reads_back_the_same() -> None:
    """An experiment without a scenario dumps it as null, and its dump, or a file without the key
    (a run made before scenarios existed), reads back as the same experiment."""
    cfg = parse_config({"name": "t", "nodes": 2, "rounds": 1})
    dumped = cfg.model_dump(mode="json")
    assert cfg.scenario is None and dumped["scenario"] is None and parse_config(dumped) == cfg


def test_scenario_file_name_outside_a_file_is_explained() -> None:
    """A file name where a mapping is needed (e.g. from --set) says where file names are read."""
    with pytest.raises(ConfigError) as info:
        parse_config({"name": "t", "nodes": 2, "rounds": 1, "scenario": "churn.yaml"})
    assert "a scenario file is read only where an experiment file names it" in str(info.value)
