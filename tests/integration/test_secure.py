"""A provisioned federation on real brokers (mosquitto with the generated config, and the embedded
broker with the same users and rules), over TLS: what an attacker on the network, or a node with
its own valid credentials, can no longer do; clear errors for bad credentials; and the quickstart's
results unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

import fedmq.experiments.build
from fedmq.broker import BusClient, BusConfig, BusError, Kind, Message, Topics
from fedmq.broker.client import Will
from fedmq.broker.servers.credentials import Access
from fedmq.broker.servers.mosquitto import find_mosquitto, free_port, start_mosquitto, wait_for_port
from fedmq.broker.servers.provision import Provisioned, provision
from fedmq.experiments.config import load_config
from fedmq.experiments.local import build_local
from fedmq.experiments.secure_defaults import secure_aggregator

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
FEDERATION = "secure-test"
NODES = ["node-000", "node-001"]


def _provision(directory: Path) -> Provisioned:
    # the broker runs as the user running the tests (pytest's folders are private to that user)
    user = pwd.getpwuid(os.geteuid()).pw_name
    return provision(directory, federation=FEDERATION, nodes=NODES, port=free_port(), broker_user=user)


@pytest.fixture(scope="module", params=["embedded", "mosquitto"])
def secure_broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Provisioned]:
    provisioned = _provision(tmp_path_factory.mktemp("secure") / "federation")
    if request.param == "mosquitto":
        if find_mosquitto() is None:
            if os.environ.get("FEDMQ_REQUIRE_MOSQUITTO"):
                pytest.fail("mosquitto is required (FEDMQ_REQUIRE_MOSQUITTO is set) but not installed")
            pytest.skip("mosquitto is not installed")
        proc = start_mosquitto(provisioned.port, config_file=provisioned.mosquitto_conf)
    else:
        command = [sys.executable, "-m", "fedmq", "broker", "--embedded", "--secure", str(provisioned.directory)]
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_for_port("127.0.0.1", provisioned.port, 30.0, proc)
    yield provisioned
    proc.terminate()
    proc.wait(10)


def _config(provisioned: Provisioned, identity: str, **changes: object) -> BusConfig:
    overrides = Access(source=provisioned.credentials, use_environment=False).bus_overrides(identity)
    return BusConfig.from_url(provisioned.url(), **(overrides | {"connect_timeout_s": 5.0} | changes))


def _client(provisioned: Provisioned, identity: str, **changes: object) -> BusClient:
    return BusClient(_config(provisioned, identity, **changes), client_id=identity, federation=FEDERATION)


def _update(sender: str) -> Message:
    meta = {"num_samples": 10**11, "task": b"t" * 16}
    return Message(kind=Kind.UPDATE, federation=FEDERATION, round=0, sender=sender, meta=meta)


async def _drain(bus: BusClient, seconds: float) -> list[str]:
    topics: list[str] = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            async for envelope in bus.messages():
                topics.append(envelope.topic)
    return topics


async def test_a_node_cannot_publish_an_update_on_another_nodes_topic(secure_broker: Provisioned) -> None:
    """The forgery of the issue, now by an authenticated node: its own update arrives, the forged one
    on node-000's topic is dropped by the broker and never reaches the coordinator."""
    topics = Topics(FEDERATION)
    async with _client(secure_broker, "coordinator") as coordinator, _client(secure_broker, "node-001") as attacker:
        await coordinator.subscribe(topics.all_updates)
        await attacker.publish(topics.update("node-000"), _update("node-000"))
        await attacker.publish(topics.update("node-001"), _update("node-001"))
        assert await _drain(coordinator, 1.5) == [topics.update("node-001")]


async def test_a_node_cannot_read_another_nodes_task(secure_broker: Provisioned) -> None:
    """mosquitto grants the subscription and delivers nothing; amqtt refuses the subscription."""
    topics = Topics(FEDERATION)
    task = Message(kind=Kind.TASK, federation=FEDERATION, round=0, sender="coordinator", meta={"task": b"t" * 16})
    async with _client(secure_broker, "coordinator") as coordinator, _client(secure_broker, "node-001") as reader:
        await reader.subscribe(topics.task("node-001"))
        with contextlib.suppress(BusError):  # amqtt: "the broker refused ... not authorised by its ACL"
            await reader.subscribe(topics.task("node-000"))
        await coordinator.publish(topics.task("node-000"), task)
        await coordinator.publish(topics.task("node-001"), task)
        assert await _drain(reader, 1.5) == [topics.task("node-001")]


async def test_the_monitor_reads_the_coordinators_status_and_publishes_nothing(secure_broker: Provisioned) -> None:
    topics = Topics(FEDERATION)
    status = Message(kind=Kind.COORDINATOR_STATUS, federation=FEDERATION, round=0, sender="coordinator", meta={})
    async with _client(secure_broker, "monitor") as monitor, _client(secure_broker, "coordinator") as coordinator:
        await monitor.subscribe(topics.coordinator_status)
        await coordinator.subscribe(topics.all_node_status)
        await monitor.publish(topics.node_status("node-000"), status)  # not the monitor's to publish
        await coordinator.publish(topics.coordinator_status, status)
        assert await _drain(monitor, 1.0) == [topics.coordinator_status]
        assert await _drain(coordinator, 0.5) == []


@pytest.mark.parametrize("where", ["coordinator_state", "update"])
async def test_a_will_on_a_forbidden_topic_is_never_delivered_nor_retained(
    secure_broker: Provisioned, where: str
) -> None:
    """Issue 31, item 3: a node connected with a will on a topic its ACL forbids (the coordinator's
    state, another node's update) and dropped its connection; amqtt delivered and retained it, and
    one retained forged "finished" made every honest node exit. Neither broker may now deliver it."""
    topics = Topics(FEDERATION)
    forged = Message(
        kind=Kind.COORDINATOR_STATUS, federation=FEDERATION, round=-1, sender="coordinator",
        meta={"state": "finished", "run_id": "forged"},
    )  # fmt: skip
    topic = topics.coordinator_state if where == "coordinator_state" else topics.update("node-000")
    fresh = {"persistent_session": False}  # no subscription left from another test's session
    watcher = BusClient(
        _config(secure_broker, "coordinator", **fresh), client_id=f"watch-{where}", federation=FEDERATION
    )
    async with watcher as coordinator:
        await coordinator.subscribe(topic)
        evil = BusClient(
            _config(secure_broker, "node-001"),
            client_id=f"node-001-{where}",
            federation=FEDERATION,
            will=Will(topic, forged, retain=True),
        )
        await evil.__aenter__()
        evil.abort()  # as a crash: the broker fires the will
        await evil.__aexit__(None, None, None)
        assert await _drain(coordinator, 1.5) == []
    newcomer = BusClient(
        _config(secure_broker, "coordinator", **fresh), client_id=f"new-{where}", federation=FEDERATION
    )
    async with newcomer as later:  # nothing retained there for whoever subscribes next
        with contextlib.suppress(BusError):
            await later.subscribe(topic)
        assert await _drain(later, 1.0) == []


async def test_a_nodes_retained_update_is_kept_only_where_the_broker_cannot_refuse_it(
    secure_broker: Provisioned, request: pytest.FixtureRequest
) -> None:
    """Issue 31, item 9: a node may publish with the retain flag on its own update and ack topics, and
    the broker replays that message to every coordinator that subscribes. The embedded broker keeps a
    node's retained message only on its status topic; mosquitto's ACL cannot refuse the flag, so it
    keeps it, and the coordinator refuses and clears it (`test_a_retained_update_or_ack_is_refused_and_cleared`)."""
    topics = Topics(FEDERATION)
    fresh = {"persistent_session": False}
    status = Message(
        kind=Kind.NODE_STATUS, federation=FEDERATION, round=-1, sender="node-001", meta={"state": "online"}
    )
    left = [topics.update("node-001"), topics.ack("node-001"), topics.node_status("node-001")]
    node = BusClient(_config(secure_broker, "node-001", **fresh), client_id="node-001-retain", federation=FEDERATION)
    async with node:
        await node.publish(left[0], _update("node-001"), retain=True)
        ack = Message(kind=Kind.ACK, federation=FEDERATION, round=0, sender="node-001", meta={"task": b"t" * 16})
        await node.publish(left[1], ack, retain=True)
        await node.publish(left[2], status, retain=True)
    later = BusClient(_config(secure_broker, "coordinator", **fresh), client_id="retain-watch", federation=FEDERATION)
    async with later as coordinator:
        await coordinator.subscribe(*left)
        replayed = sorted(await _drain(coordinator, 1.0))
        for topic in left:  # leave nothing for the other tests
            await coordinator.publish_frame(topic, b"", round=-1, retain=True)
    if request.node.callspec.params["secure_broker"] == "mosquitto":
        assert replayed == sorted(left)
    else:
        assert replayed == [topics.node_status("node-001")]


async def test_a_node_cannot_take_over_the_coordinators_connection(secure_broker: Provisioned) -> None:
    """Issue 31, item 5: a node connecting with the coordinator's client id (it is the federation's
    name and a suffix) made the broker close the coordinator's connection; 16 takeovers stalled a
    round 30 s. mosquitto now takes each connection's client id from its user name; the embedded
    broker gives a connection asking for another user's client id a fresh one. Neither the thief
    with its own valid credentials nor one with the coordinator's name and a wrong password moves
    the coordinator's connection or its subscriptions."""
    topics = Topics(FEDERATION)
    coordinator_id = f"{FEDERATION}-coordinator"
    fresh = {"persistent_session": False}
    real = BusClient(_config(secure_broker, "coordinator", **fresh), client_id=coordinator_id, federation=FEDERATION)
    async with real as coordinator:
        await coordinator.subscribe(topics.all_updates)
        thief = BusClient(_config(secure_broker, "node-001", **fresh), client_id=coordinator_id, federation=FEDERATION)
        async with thief:
            await thief.publish(topics.update("node-001"), _update("node-001"))
            assert await _drain(coordinator, 1.5) == [topics.update("node-001")]
        impostor = BusClient(
            _config(secure_broker, "coordinator", password="not-the-password", **fresh),
            client_id=coordinator_id,
            federation=FEDERATION,
        )
        with pytest.raises(BusError, match="refused the connection"):
            async with impostor:
                pass
        async with BusClient(_config(secure_broker, "node-000", **fresh), client_id="x", federation=FEDERATION) as n:
            await n.publish(topics.update("node-000"), _update("node-000"))
            assert await _drain(coordinator, 1.5) == [topics.update("node-000")]  # still subscribed
        assert coordinator.stats.reconnects == 0 and coordinator.connected


async def test_a_wrong_password_is_refused_with_a_clear_error(secure_broker: Provisioned) -> None:
    with pytest.raises(BusError, match=r"refused the connection.*user 'node-000'.*check the credentials"):
        async with _client(secure_broker, "node-000", password="not-the-password"):
            pass


async def test_no_anonymous_access(secure_broker: Provisioned) -> None:
    with pytest.raises(BusError, match="refused the connection"):
        async with _client(secure_broker, "node-000", username=None, password=None):
            pass


async def test_an_untrusted_broker_certificate_is_refused_at_once(secure_broker: Provisioned, tmp_path: Path) -> None:
    """A CA of another federation, or none (the system's CAs): the handshake fails, and says why."""
    other = _provision(tmp_path / "other")
    for ca_file in (str(other.ca_file), None):
        with pytest.raises(BusError, match=r"TLS with mqtts://127\.0\.0\.1.*CERTIFICATE_VERIFY_FAILED"):
            async with _client(secure_broker, "node-000", ca_file=ca_file, connect_timeout_s=30.0):
                pass


async def test_plain_mqtt_to_the_tls_port_gets_nowhere(secure_broker: Provisioned) -> None:
    config = BusConfig.from_url(f"mqtt://127.0.0.1:{secure_broker.port}", connect_timeout_s=3.0)
    with pytest.raises(BusError):
        async with BusClient(config, client_id="plain", federation=FEDERATION):
            pass


@pytest.mark.slow
def test_secure_quickstart_equals_the_in_process_federation_round_for_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    """`fedmq run --secure`: provisioned, TLS, a password and an ACL per node on a mosquitto it starts
    (the embedded broker without mosquitto); the same rounds, losses and accuracies, bit for bit, as the
    engine in process with no broker at all."""
    rounds = 8
    out = tmp_path / "run"
    command = [sys.executable, "-m", "fedmq", "run", str(QUICKSTART), "--set", f"rounds={rounds}", "--secure"]
    command += ["--out", str(out), "--processes", "2", "--quiet"]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "secure" / "credentials" / "node-000.json").is_file()
    assert "listening on mqtts://" in (out / "logs" / "broker.out").read_text()
    daemons = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    monkeypatch.setattr(fedmq.experiments.build, "best_device", lambda: torch.device("cpu"))
    # with --secure's averaging rule (clip, max_norm auto), which the run wrote into its config
    written = yaml.safe_load((out / "config.yaml").read_text())["method"]["aggregator"]
    assert written == {"name": "clip", "options": {"max_norm": "auto"}}, written
    secure_cfg, _ = secure_aggregator(load_config(QUICKSTART, [f"rounds={rounds}"]))
    assert secure_cfg.method.aggregator.name == "clip"
    local = build_local(secure_cfg, device=torch.device("cpu")).run()
    assert [(r["selected"], r["train_loss"], r["accuracy"]) for r in daemons] == [
        (r["selected"], r["train_loss"], r["accuracy"]) for r in local
    ]


@pytest.mark.slow
@pytest.mark.parametrize("given", ["folder", "flags"])
def test_run_against_a_provisioned_embedded_broker(tmp_path: Path, given: str) -> None:
    """The other way to run securely: `fedmq provision`, `fedmq broker --embedded --secure`, then `fedmq
    run --broker mqtts://...` with `--credentials DIR` (each process takes its identity's file, the
    progress monitor the read-only one) or one identity's `--username`, `--password-file` and
    `--ca-file` for every process. The run uses the provisioned federation id, which the ACL names, and
    its progress lines show that the monitor got in too. With the nodes' own credentials, the run uses
    secure aggregation: each node's keys, shares and reveals go through its own topics under the ACL."""
    out = tmp_path / "run"
    secure = tmp_path / "secure"
    port = free_port()
    argv = [sys.executable, "-m", "fedmq"]
    setup = [*argv, "provision", str(secure), "--config", str(QUICKSTART), "--port", str(port)]
    assert subprocess.run(setup, capture_output=True, timeout=60, cwd=ROOT).returncode == 0
    if given == "folder":
        access = ["--credentials", str(secure / "credentials")]
    else:  # the coordinator's identity may publish and read everything: every process can use it
        creds = json.loads((secure / "credentials" / "coordinator.json").read_text())
        (tmp_path / "password").write_text(creds["password"] + "\n")
        access = ["--username", "coordinator", "--password-file", str(tmp_path / "password")]
        access += ["--ca-file", str(secure / "ca.crt")]
    broker = subprocess.Popen([*argv, "broker", "--embedded", "--secure", str(secure)], stderr=subprocess.PIPE)
    try:
        wait_for_port("127.0.0.1", port, 30.0, broker)
        command = [*argv, "run", str(QUICKSTART), "--set", "rounds=3", "--broker", f"mqtts://127.0.0.1:{port}"]
        command += [*access, "--out", str(out), "--processes", "2"]
        if given == "folder":
            command += ["--set", "privacy.secure_aggregation={}"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stdout + done.stderr
        summary = json.loads((out / "summary.json").read_text())
        assert summary["state"] == "finished" and summary["federation"] == "quickstart"
        assert summary["participation_totals"]["accepted"] == 15  # 3 rounds of 5 nodes
        if given == "folder":
            lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            assert [line["secagg_survivors"] for line in lines] == [5, 5, 5]
        assert "round 3/3" in done.stdout  # the monitor's progress line (not a terminal: one per round)
    finally:
        broker.terminate()
        broker.wait(10)
