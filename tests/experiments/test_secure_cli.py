"""`fedmq provision` and the broker-access flags: what they write, and exit code 2 with a message
for every mistake a user can make with them (no traceback, no broker needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedmq.experiments.cli import main

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "experiments" / "quickstart.yaml")


def test_provision_writes_one_credential_per_node_of_the_experiment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "secure"
    assert main(["provision", str(out), "--config", QUICKSTART, "--host", "broker.example", "--port", "18883"]) == 0
    printed = capsys.readouterr().out
    assert "20 nodes" in printed and "fedmq broker --secure" in printed
    creds = json.loads((out / "credentials" / "node-019.json").read_text())
    assert creds["username"] == "node-019" and creds["ca_file"] == "../ca.crt"
    assert "listener 18883 127.0.0.1" in (out / "mosquitto" / "mosquitto.conf").read_text()
    assert "user node-019" in (out / "mosquitto" / "acl").read_text()
    # never over an earlier provision: its keys and passwords may be in use
    assert main(["provision", str(out), "--config", QUICKSTART]) == 2
    assert "not empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["node", "--broker", "mqtts://127.0.0.1:1", "--node-id", "node-000", "--credentials", "{tmp}/none"],
         "credentials error: --credentials {tmp}/none does not exist"),
        (["node", "--broker", "mqtts://127.0.0.1:1", "--node-id", "node-000", "--credentials", "{tmp}"],
         "no credentials for 'node-000'"),
        (["coordinator", "--broker", "mqtt://127.0.0.1:1", "--ca-file", "{tmp}/ca.crt", "--out", "{tmp}/run"],
         "use mqtts://"),
        (["node", "--broker", "mqtts://127.0.0.1:1", "--node-id", "node-000", "--password-file", "{tmp}/empty"],
         "password file {tmp}/empty is empty"),
        (["run", "--secure", "--broker", "mqtt://127.0.0.1:1"], "--secure starts a broker of its own"),
        (["broker", "--secure", "{tmp}"], "was not written by `fedmq provision`"),
        (["broker", "--secure", "{tmp}/bad"], "is not a fedmq provision amqtt config"),
    ],
)  # fmt: skip
def test_broker_access_mistakes_exit_2_with_what_to_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    (tmp_path / "ca.crt").write_text("synthetic, never read")
    (tmp_path / "empty").write_text("")
    (tmp_path / "bad" / "amqtt").mkdir(parents=True)
    (tmp_path / "bad" / "amqtt" / "amqtt.json").write_text('{"bind": "127.0.0.1:1"')  # cut short
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if argv[0] == "run":
        argv.insert(1, QUICKSTART)
    elif argv[0] != "broker":
        argv += ["--config", QUICKSTART]
    assert main(argv) == 2
    assert message.replace("{tmp}", str(tmp_path)) in capsys.readouterr().err


def test_secure_runs_clip_against_the_rounds_median_unless_the_experiment_chose_or_cannot() -> None:
    """`fedmq run --secure`'s averaging rule (experiments/secure_defaults.py): clip with max_norm auto
    where the experiment leaves the mean and a round aggregates 3 or more updates; the experiment's own
    rule, async runs and small cohorts keep theirs, and the sentence says so."""
    from fedmq.experiments.config import parse_config
    from fedmq.experiments.secure_defaults import secure_aggregator

    base = {"name": "x", "nodes": 20, "policy": {"fraction": 0.25}, "rounds": 2}
    cfg, said = secure_aggregator(parse_config(base))
    assert cfg.method.aggregator.name == "clip" and cfg.method.aggregator.options == {"max_norm": "auto"}
    assert said.startswith("averaging: clip, max_norm auto")
    chosen, said = secure_aggregator(parse_config(base | {"method": {"aggregator": {"name": "median"}}}))
    assert chosen.method.aggregator.name == "median" and "as the experiment says" in said
    small, said = secure_aggregator(parse_config(base | {"policy": {"fraction": 0.1}}))
    assert small.method.aggregator.name == "mean" and "2 update(s) a round" in said
    async_cfg, said = secure_aggregator(parse_config(base | {"engine": {"kind": "async"}}))
    assert async_cfg.method.aggregator.name == "mean" and "asynchronous folding" in said
    masked, said = secure_aggregator(parse_config(base | {"privacy": {"secure_aggregation": {}}}))
    assert masked.method.aggregator.name == "mean" and "secure aggregation hides each update" in said
