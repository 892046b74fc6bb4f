"""`broker.servers.provision`: certificates that verify, hashes mosquitto's format, rules per identity, no
secret readable by others, nothing overwritten."""

from __future__ import annotations

import base64
import hashlib
import json
import ssl
import stat
from pathlib import Path

import pytest

from fedmq.broker.servers.provision import mosquitto_hash, provision, topic_rules
from fedmq.broker.topics import Topics


def test_provision_writes_a_ca_a_server_certificate_and_one_credential_per_identity(tmp_path: Path) -> None:
    out = provision(tmp_path / "secure", federation="demo", nodes=["node-000", "node-001"], port=18883)
    creds = sorted(p.name for p in out.credentials.iterdir())
    assert creds == ["coordinator.json", "monitor.json", "node-000.json", "node-001.json"]
    passwords = {json.loads(p.read_text())["password"] for p in out.credentials.iterdir()}
    assert len(passwords) == 4 and all(len(p) >= 32 for p in passwords)
    # the server certificate chains to the CA and names the loopback host, as a client checks it
    context = ssl.create_default_context(cafile=str(out.ca_file))
    assert context.get_ca_certs()[0]["subject"][0][0][1] == "fedmq CA demo"
    from cryptography import x509

    server = x509.load_pem_x509_certificate((out.directory / "server.crt").read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    for secret in ("ca.key", "server.key", "mosquitto/passwords", "amqtt/passwords", "credentials/node-000.json"):
        mode = stat.S_IMODE((out.directory / secret).stat().st_mode)
        assert mode & 0o077 == 0, f"{secret} is readable by others ({oct(mode)})"
    conf = out.mosquitto_conf.read_text()
    for line in ("allow_anonymous false", "persistence true", "listener 18883 127.0.0.1", "set_tcp_nodelay true"):
        assert line in conf
    # bounded cost of hostile traffic (issue 31): connections for 4 identities, and each client's queue
    assert "max_connections 32" in conf and f"max_queued_bytes {2 * 2**30}" in conf


def test_provision_never_overwrites_and_refuses_reserved_or_invalid_names(tmp_path: Path) -> None:
    provision(tmp_path / "a", federation="demo", nodes=["n1"])
    with pytest.raises(FileExistsError, match="not empty"):
        provision(tmp_path / "a", federation="demo", nodes=["n1"])
    with pytest.raises(ValueError, match="reserved"):
        provision(tmp_path / "b", federation="demo", nodes=["coordinator"])
    with pytest.raises(ValueError, match="node id 'a/b' is not valid"):
        provision(tmp_path / "c", federation="demo", nodes=["a/b"])


def test_mosquitto_hash_is_pbkdf2_sha512_in_mosquitto_passwd_format() -> None:
    _, kind, iterations, salt, digest = mosquitto_hash("s3cret").split("$")
    assert (kind, iterations, len(base64.b64decode(salt))) == ("7", "101", 12)
    assert base64.b64decode(digest) == hashlib.pbkdf2_hmac("sha512", b"s3cret", base64.b64decode(salt), 101)
    assert mosquitto_hash("s3cret") != mosquitto_hash("s3cret")  # a fresh salt each time


def test_each_node_may_publish_only_on_its_own_topics_and_read_only_its_own_inbox() -> None:
    topics = Topics("demo")
    publish, subscribe = topic_rules(topics, ["node-000", "node-001"])
    own = [topics.node_status("node-000"), topics.ack("node-000"), topics.update("node-000"), topics.secagg("node-000")]
    assert publish["node-000"] == own
    assert topics.node_secagg("node-000") in subscribe["node-000"]
    assert not any("node-001" in t for t in publish["node-000"] + subscribe["node-000"])
    assert topics.task("node-000") in subscribe["node-000"]
    assert publish["monitor"] == [] and subscribe["monitor"] == [topics.coordinator_status]
    assert publish["coordinator"] == ["fedmq/demo/#"]
