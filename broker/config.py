"""Connection and transfer settings of one bus client."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal
from urllib.parse import unquote, urlsplit

from fedmq.fields import Bounds, check_fields

#: The MQTT protocol's own cap on a message: 256 MiB minus one byte.
MQTT_MAX_PACKET = 268_435_455
#: Room for the fixed header, topic and properties of a PUBLISH packet around the payload.
PUBLISH_OVERHEAD = 1024


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine (localhost or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, kw_only=True, slots=True)
class BusConfig:
    host: str = "127.0.0.1"
    port: Annotated[int, Bounds(ge=1, le=65535)] = 1883
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    protocol: Literal["auto", "5", "3.1.1"] = "auto"
    """'auto' tries MQTT v5 and falls back to 3.1.1 for brokers that refuse it (amqtt)."""
    keepalive_s: Annotated[int, Bounds(ge=1)] = 15
    connect_timeout_s: Annotated[float, Bounds(gt=0)] = 10.0
    operation_timeout_s: Annotated[float, Bounds(gt=0)] = 120.0
    """How long one publish or subscribe may wait, reconnections included."""
    reconnect_initial_s: Annotated[float, Bounds(gt=0)] = 0.25
    reconnect_max_s: Annotated[float, Bounds(gt=0)] = 10.0
    max_message_bytes: Annotated[int, Bounds(ge=65536, le=MQTT_MAX_PACKET, note="the MQTT limit")] = 64 * 2**20
    """The broker's limit on one MQTT message; nothing larger is ever published."""
    chunk_bytes: Annotated[int, Bounds(ge=4096)] = 2**20
    """Frames above this size travel as chunks published concurrently; a chunk leaves room for its
    headers under `max_message_bytes`."""
    max_reassembly_bytes: Annotated[int, Bounds(ge=1)] = 2 * 2**30
    """Memory bound on all partially received transfers together: of this connection, and of every
    bus client in the process together (`broker.chunking.process_budget`; its bound is the largest
    any of them sets), so that a host of many nodes holds no more than one node's bound."""
    max_transfer_bytes: Annotated[int, Bounds(ge=1)] = 2**30
    transfer_timeout_s: Annotated[float, Bounds(gt=0)] = 120.0
    max_concurrent_publishes: Annotated[int, Bounds(ge=1)] = 32
    max_inflight_messages: Annotated[int, Bounds(ge=1)] = 64
    incoming_queue: Annotated[int, Bounds(ge=1)] = 256
    dedup_window: Annotated[int, Bounds(ge=1)] = 65_536
    tcp_nodelay: bool = True
    tune_allocator: bool = True
    """Let glibc keep freed chunk-sized buffers for reuse instead of faulting in fresh pages for each
    chunk (twice the throughput of a large transfer; up to 64 MiB more held): `broker.allocator`."""
    persistent_session: bool = True
    """Keep subscriptions and queued QoS 1 messages on the broker across reconnects."""
    tls: bool = False
    """TLS to the broker (``mqtts://``), the broker's certificate and host name checked."""
    ca_file: str | None = None
    """The CA that signed the broker's certificate; None trusts the system's CAs."""
    cert_file: str | None = None
    """A client certificate, for brokers that require one (``require_certificate true``)."""
    key_file: str | None = field(default=None, repr=False)
    plaintext_credentials: bool = False
    """Send a password over plain ``mqtt://`` to another machine. Refused by default: anyone on the
    path reads it (a loopback broker is always allowed; the password never leaves the machine)."""

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("broker host is empty")
        check_fields(self)
        if self.chunk_bytes > self.max_message_bytes - PUBLISH_OVERHEAD - 4096:
            raise ValueError(
                f"chunk_bytes {self.chunk_bytes} must leave room for headers under max_message_bytes"
                f" {self.max_message_bytes} (at most {self.max_message_bytes - PUBLISH_OVERHEAD - 4096})"
            )
        if not self.tls and (self.ca_file or self.cert_file or self.key_file):
            raise ValueError("a CA file or client certificate is given but the broker URL is mqtt://; use mqtts://")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate needs its key, and a key its certificate")
        if self.password and not self.tls and not self.plaintext_credentials and not is_loopback(self.host):
            raise ValueError(
                f"the password would cross the network in clear to {self.host} (mqtt://): use mqtts://"
                " (`fedmq provision` and `fedmq broker --secure` set TLS up), or, on a network you trust,"
                " set bus.plaintext_credentials: true"
            )

    @property
    def url(self) -> str:
        """Without credentials: safe to log."""
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"

    @classmethod
    def from_url(cls, url: str, **overrides: Any) -> BusConfig:
        """``mqtt[s]://[user[:password]@]host[:port]`` (ports 1883 and 8883 by default); other settings
        come from `overrides`. A password in the URL shows in `ps`: `broker.servers.credentials` reads it
        from a file."""
        parts = urlsplit(url if "://" in url else f"mqtt://{url}")
        if parts.scheme not in ("mqtt", "mqtts"):
            raise ValueError(f"broker URL {url!r}: use mqtt://HOST:PORT, or mqtts://HOST:PORT for TLS")
        if not parts.hostname:
            raise ValueError(f"broker URL {url!r} has no host; expected {parts.scheme}://HOST:PORT")
        tls = parts.scheme == "mqtts"
        try:
            port = parts.port or (8883 if tls else 1883)
        except ValueError as exc:
            raise ValueError(f"broker URL {url!r} has an invalid port") from exc
        base: dict[str, Any] = {"host": parts.hostname, "port": port, "tls": tls}
        if parts.username:
            base["username"] = unquote(parts.username)
        if parts.password:
            base["password"] = unquote(parts.password)
        return cls(**(base | overrides))

    def with_(self, **changes: Any) -> BusConfig:
        return replace(self, **changes)
