"""What a federation on an untrusted network needs, written to one folder.

- a CA and a broker certificate signed by it (the ``cryptography`` package; EC P-256, SANs for every
  host name and address the broker is reached by);
- one random password per identity (the coordinator, the run monitor, each node) and a credentials
  file for each (`broker.servers.credentials`), which is all a node's machine needs besides ``ca.crt``;
- a mosquitto config: a TLS listener only, no anonymous access, persistence on, and an ACL in which
  a node publishes only on its own status, ack and update topics and reads only its own inbox, the
  model broadcasts and the coordinator's state; only the coordinator publishes the coordinator's
  topics, tasks, models and receipts;
- the same users and topic rules for the embedded broker (amqtt), with TLS.

The passwords are 192-bit random tokens, so the broker's hash cost does not protect them and is kept
at mosquitto's default (PBKDF2-SHA512, 101 iterations; argon2 with small parameters for amqtt).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
import json
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedmq.broker.config import MQTT_MAX_PACKET
from fedmq.broker.servers.credentials import COORDINATOR, MONITOR
from fedmq.broker.servers.mosquitto import tuning
from fedmq.broker.topics import Topics, check_id

RESERVED = (COORDINATOR, MONITOR)
DEFAULT_HOSTS = ("localhost", "127.0.0.1")


@dataclass(frozen=True, slots=True)
class Provisioned:
    """Where `provision` put things."""

    directory: Path
    federation: str
    port: int
    nodes: tuple[str, ...]

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def credentials(self) -> Path:
        return self.directory / "credentials"

    @property
    def mosquitto_conf(self) -> Path:
        return self.directory / "mosquitto" / "mosquitto.conf"

    @property
    def amqtt_config(self) -> Path:
        return self.directory / "amqtt" / "amqtt.json"

    def url(self, host: str = "127.0.0.1") -> str:
        return f"mqtts://{host}:{self.port}"


def provision(
    out: Path,
    *,
    federation: str,
    nodes: Sequence[str],
    hosts: Sequence[str] = DEFAULT_HOSTS,
    port: int = 8883,
    bind: str = "127.0.0.1",
    days: int = 365,
    max_message_bytes: int = MQTT_MAX_PACKET,
    broker_user: str | None = None,
) -> Provisioned:
    """Write everything into `out` (which must be empty or absent: keys are never overwritten).

    mosquitto started as root drops to the user `mosquitto` before it reads the password file; the
    broker's files are handed to that user, or with `broker_user` (a broker started by the user who
    provisioned, as `fedmq run --secure` does) the config says to stay that user."""
    topics = Topics(federation)
    nodes = tuple(check_id(n, "node id") for n in nodes)
    clash = sorted(set(nodes) & set(RESERVED))
    if clash:
        raise ValueError(f"node id(s) {', '.join(clash)} are reserved for the coordinator and the monitor")
    if not nodes:
        raise ValueError("no nodes to provision")
    if not hosts:
        raise ValueError("the broker needs at least one host name or address for its certificate")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; provision into a new folder (keys are never overwritten)")
    result = Provisioned(out.resolve(), federation, port, nodes)
    root = result.directory
    for sub in ("credentials", "mosquitto/data", "amqtt"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "credentials", 0o700)

    ca_key, ca_cert = _ca(federation, days)
    server_key, server_cert = _server_certificate(ca_key, ca_cert, hosts, days)
    _write(root / "ca.crt", _pem_cert(ca_cert))
    _write(root / "ca.key", _pem_key(ca_key), secret=True)
    _write(root / "server.crt", _pem_cert(server_cert))
    _write(root / "server.key", _pem_key(server_key), secret=True)

    passwords = {identity: secrets.token_urlsafe(24) for identity in (*RESERVED, *nodes)}
    for identity, password in passwords.items():
        creds = {"username": identity, "password": password, "ca_file": "../ca.crt"}
        _write(root / "credentials" / f"{identity}.json", json.dumps(creds, indent=2) + "\n", secret=True)

    _write(
        root / "mosquitto" / "passwords",
        "".join(f"{u}:{mosquitto_hash(p)}\n" for u, p in passwords.items()),
        secret=True,
    )
    _write(root / "mosquitto" / "acl", mosquitto_acl(topics, nodes))
    conf = _mosquitto_conf(root, port, bind, max_message_bytes, broker_user, identities=len(passwords))
    _write(root / "mosquitto" / "mosquitto.conf", conf)
    if broker_user is None:
        _hand_to_broker_user([root / "server.key", root / "mosquitto" / "passwords", root / "mosquitto" / "data"])

    from argon2 import PasswordHasher  # amqtt's own dependency (pwdlib[argon2])

    hasher = PasswordHasher(time_cost=1, memory_cost=8192, parallelism=1)
    _write(
        root / "amqtt" / "passwords",
        "".join(f"{u}:{hasher.hash(p)}\n" for u, p in passwords.items()),
        secret=True,
    )
    publish, subscribe = topic_rules(topics, nodes)
    amqtt = {
        "bind": f"{bind}:{port}",
        "certfile": str(root / "server.crt"),
        "keyfile": str(root / "server.key"),
        "password_file": str(root / "amqtt" / "passwords"),
        "publish_acl": publish,
        "subscribe_acl": subscribe,
    }
    _write(root / "amqtt" / "amqtt.json", json.dumps(amqtt, indent=1) + "\n")
    _write(root / "README.txt", _readme(result, hosts))
    return result


# -- the broker's rules ------------------------------------------------------------------------------


def topic_rules(topics: Topics, nodes: Sequence[str]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(what each user may publish, what each may subscribe to): the ACL, user by user."""
    everything = [f"{topics.prefix}/#"]
    publish: dict[str, list[str]] = {COORDINATOR: everything, MONITOR: []}
    subscribe: dict[str, list[str]] = {COORDINATOR: everything, MONITOR: [topics.coordinator_status]}
    for node in nodes:
        publish[node] = [topics.node_status(node), topics.ack(node), topics.update(node), topics.secagg(node)]
        subscribe[node] = [
            *topics.node_inbox(node),
            f"{topics.prefix}/model/+",
            topics.coordinator_state,
            topics.coordinator_status,
        ]
    return publish, subscribe


def mosquitto_acl(topics: Topics, nodes: Sequence[str]) -> str:
    """mosquitto's acl_file from `topic_rules`: a block per user, so that both brokers enforce the same
    rules (patterns with %u would be shorter, but mosquitto applies them to every user)."""
    publish, subscribe = topic_rules(topics, nodes)
    lines = ["# generated by fedmq provision: what each user may read (subscribe to) and write (publish)"]
    for user in publish:
        writes, reads = set(publish[user]), set(subscribe[user])
        lines += ["", f"user {user}"]
        lines += [f"topic readwrite {t}" for t in publish[user] if t in reads]
        lines += [f"topic write {t}" for t in publish[user] if t not in reads]
        lines += [f"topic read {t}" for t in subscribe[user] if t not in writes]
    return "\n".join(lines) + "\n"


def mosquitto_hash(password: str, *, iterations: int = 101) -> str:
    """mosquitto_passwd's format: ``$7$ITERATIONS$SALT$HASH``, PBKDF2-HMAC-SHA512 with a 12-byte salt."""
    salt = secrets.token_bytes(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def _mosquitto_conf(
    root: Path, port: int, bind: str, max_message_bytes: int, user: str | None, *, identities: int
) -> str:
    # each identity holds one connection, two while a reconnection overlaps the old one, and the
    # protocol probe and `fedmq run`'s monitor add a few: more means someone is flooding the port
    connections = 4 * identities + 16
    return "\n".join(
        [
            "# generated by fedmq provision: TLS only, no anonymous access, an ACL per identity",
            *([f"user {user}"] if user else []),
            "per_listener_settings false",
            f"listener {port} {bind}",
            f"max_connections {connections}",
            f"cafile {root / 'ca.crt'}",
            f"certfile {root / 'server.crt'}",
            f"keyfile {root / 'server.key'}",
            "tls_version tlsv1.2",
            "allow_anonymous false",
            # an identity's connection is its user name's: no other identity can take it over by
            # connecting with its client id (issue 31: a node knocked the coordinator off the broker)
            "use_username_as_clientid true",
            f"password_file {root / 'mosquitto' / 'passwords'}",
            f"acl_file {root / 'mosquitto' / 'acl'}",
            *tuning(max_message_bytes),
            "persistence true",
            f"persistence_location {root / 'mosquitto' / 'data'}/",
            "autosave_interval 60",
            "log_dest stderr",
            "log_type error",
            "log_type warning",
            "",
        ]
    )


def _readme(result: Provisioned, hosts: Sequence[str]) -> str:
    return f"""Provisioned by fedmq for federation {result.federation!r}: {len(result.nodes)} nodes.

ca.crt                  the CA every client trusts (public; copy it to every machine)
ca.key                  the CA's private key: keep it offline; it can sign a broker certificate
server.crt, server.key  the broker's certificate (for {", ".join(hosts)}) and its key (broker machine only)
credentials/ID.json     one per identity: user name, password, path to ca.crt (each goes to its own machine only)
mosquitto/              mosquitto.conf (TLS on port {result.port}, no anonymous access, persistence), passwords, acl
amqtt/                  the same users and topic rules for the embedded broker

Broker:       fedmq broker --secure {result.directory}          (or: mosquitto -c {result.mosquitto_conf})
Coordinator:  fedmq coordinator --broker mqtts://HOST:{result.port} --config EXP.yaml \\
                --credentials {result.credentials}
A node:       fedmq node --broker mqtts://HOST:{result.port} --config EXP.yaml --node-id node-000 \\
                --credentials credentials/node-000.json
"""


# -- certificates ------------------------------------------------------------------------------------


def _ca(federation: str, days: int):  # type: ignore[no-untyped-def]
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fedmq CA {federation}")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _server_certificate(ca_key, ca_cert, hosts: Sequence[str], days: int):  # type: ignore[no-untyped-def]
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _pem_cert(cert) -> str:  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM).decode()


def _pem_key(key) -> str:  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def _hand_to_broker_user(paths: Sequence[Path], user: str = "mosquitto") -> None:
    """mosquitto started as root drops to the `mosquitto` user before it reads the password file and
    writes persistence: as root, give it the files it needs (still unreadable by anyone else)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return
    import pwd

    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return
    for path in paths:
        os.chown(path, entry.pw_uid, entry.pw_gid)


def _write(path: Path, text: str, *, secret: bool = False) -> None:
    """Secrets are created 0600 from the start, never readable by others for an instant."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
