"""The topic scheme and the bus settings: ids that cannot break topics, URLs, limits."""

from __future__ import annotations

import pytest

from fedmq.broker.config import BusConfig
from fedmq.broker.topics import Route, Topics, check_id


@pytest.mark.parametrize("bad", ["", "a/b", "a+b", "x#", " node", "-lead", "n" * 65, "é"])
def test_check_id_refuses_what_would_break_a_topic(bad: str) -> None:
    """Wildcards, separators, spaces and overlong ids are refused with a message saying what is allowed."""
    with pytest.raises(ValueError, match="letters, digits"):
        check_id(bad, "node id")


def test_topics_route_parses_every_channel() -> None:
    """Every topic the daemons use parses back to its channel and its node or round."""
    t = Topics("fed-1")
    assert t.route(t.coordinator_status) == Route("coordinator-status")
    assert t.route(t.coordinator_state) == Route("coordinator-state")
    assert t.route(t.node_status("n1")) == Route("node-status", node="n1")
    assert t.route(t.task("n1")) == Route("node-task", node="n1")
    assert t.route(t.direct_model("n1")) == Route("node-model", node="n1")
    assert t.route(t.receipt("n1")) == Route("node-receipt", node="n1")
    assert t.route(t.model(12)) == Route("model", round=12)
    assert t.route(t.ack("n1")) == Route("acks", node="n1")
    assert t.route(t.update("n1")) == Route("updates", node="n1")
    for foreign in ["fedmq/other/acks/n1", "x/fed-1/acks/n1", "fedmq/fed-1/model/x", "fedmq/fed-1/nodes/n1/x"]:
        assert t.route(foreign) is None


def test_topics_route_refuses_node_ids_that_are_not_ids() -> None:
    """Issue 31: a node id that makes its receipt topic one byte over MQTT's 65,535 reached paho in
    the coordinator's driver. A topic naming a node by anything but a valid id is outside the scheme,
    so no daemon ever builds a topic from it."""
    from fedmq.broker.topics import check_id

    t = Topics("fed-1")
    long_id = "n" * (65_535 - len(t.receipt("")) + 1)
    assert len(t.receipt(long_id).encode()) == 65_536
    for bad in [long_id, "n" * 65, "a b", "n1\n", "-n1", "n\u00e9"]:
        for topic in (t.node_status(bad), t.update(bad), t.ack(bad), t.task(bad)):
            assert t.route(topic) is None, (bad[:10], topic[:40])
        with pytest.raises(ValueError):
            check_id(bad, "node id")
    assert t.route(t.update("n" * 64)) == Route("updates", node="n" * 64)


def test_bus_config_from_url_reads_credentials_and_port() -> None:
    c = BusConfig.from_url("mqtts://user:p%40ss@broker.example:1999", chunk_bytes=65536)
    assert (c.host, c.port, c.username, c.password, c.chunk_bytes) == ("broker.example", 1999, "user", "p@ss", 65536)
    assert "p@ss" not in repr(c)
    assert BusConfig.from_url("localhost").port == 1883


@pytest.mark.parametrize(
    ("url", "overrides", "match"),
    [
        ("http://x", {}, "use mqtt://HOST:PORT, or mqtts://"),
        ("mqtt://:1883", {}, "no host"),
        ("mqtt://h:99999", {}, "port"),
        ("mqtt://h", {"chunk_bytes": 100}, "chunk_bytes"),
        ("mqtt://h", {"max_message_bytes": 300_000_000}, "MQTT limit"),
        ("mqtt://h", {"protocol": "4"}, "protocol"),
        ("mqtt://h", {"keepalive_s": 0}, "keepalive_s"),
    ],
)
def test_bus_config_invalid_settings_say_what_is_wrong(url: str, overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BusConfig.from_url(url, **overrides)


def test_a_password_is_never_sent_in_clear_to_another_machine_unless_told_to() -> None:
    """Issue 31, item 9: a client given credentials and a plain mqtt:// URL sent its password in clear."""
    with pytest.raises(ValueError, match=r"cross the network in clear to 192\.0\.2\.7 \(mqtt://\): use mqtts://"):
        BusConfig.from_url("mqtt://node-000:s3cret@192.0.2.7:1883")
    with pytest.raises(ValueError, match=r"bus\.plaintext_credentials: true"):
        BusConfig.from_url("mqtt://broker.example.org", username="node-000", password="s3cret")
    assert BusConfig.from_url("mqtt://192.0.2.7", username="u", password="p", plaintext_credentials=True).password
    for url in ("mqtts://u:p@192.0.2.7", "mqtt://u:p@127.0.0.1", "mqtt://u:p@localhost", "mqtt://u:p@[::1]:1883"):
        assert BusConfig.from_url(url).password == "p", url  # TLS, or the password stays on this machine
    assert BusConfig.from_url("mqtt://u@192.0.2.7").username == "u"  # a user name alone reveals no secret


def test_the_experiment_file_and_the_command_line_say_the_same() -> None:
    from fedmq.experiments.build import bus_config
    from fedmq.experiments.config import parse_config
    from fedmq.fedcore.errors import ConfigError

    cfg = parse_config({"name": "x", "nodes": 2, "rounds": 1})
    with pytest.raises(ConfigError, match="use mqtts://"):
        bus_config(cfg, "mqtt://u:p@192.0.2.7")
    trusted = parse_config({"name": "x", "nodes": 2, "rounds": 1, "bus": {"plaintext_credentials": True}})
    assert bus_config(trusted, "mqtt://u:p@192.0.2.7").plaintext_credentials
