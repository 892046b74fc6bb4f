"""The embedded pure-Python broker (amqtt), so that a fresh machine runs federations with no install.

amqtt speaks MQTT 3.1.1 only; the bus client falls back to it automatically. It carries large
payloads at about a quarter of mosquitto's throughput (see ENVIRONMENT.md): fine for development
and the quickstart, mosquitto for anything heavy.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
from collections.abc import AsyncIterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from fedmq.broker.errors import CredentialsError
from fedmq.broker.servers.credentials import COORDINATOR

logger = logging.getLogger(__name__)


class _SnapshotDict(dict):  # type: ignore[type-arg]
    """Iterates over a snapshot of its keys.

    amqtt 0.12 iterates the broker-wide subscription dict while awaiting, on every new connection
    (`Broker._handle_client_session`) and every broadcast (`_run_broadcast`); a SUBSCRIBE from
    another client meanwhile raises "dictionary changed size during iteration" and kills that
    connection or broadcast. Seen in fedmq's integration tests.
    """

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(super().keys()))

    def items(self):  # type: ignore[no-untyped-def]
        return list(super().items())


def amqtt_config(host: str, port: int) -> dict[str, Any]:
    return {
        "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}"}},
        # only anonymous auth: the default plugin set adds $SYS publishing and per-packet logging
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }


def secure_amqtt_config(path: Path) -> dict[str, Any]:
    """amqtt's config from `fedmq provision`'s ``amqtt/amqtt.json``: a TLS listener, users from the
    password file (no anonymous access), and per-user topic rules for publishing and subscribing.

    What amqtt does not enforce that mosquitto does: it checks subscriptions, not each message
    delivered; it keeps no persistent sessions across its own restart. Its publish ACL covers wills
    here (`_acl_broker_class`), not in amqtt itself, and a node's retained messages are kept only on
    its status topic (`_may_retain`)."""
    try:
        spec = json.loads(path.read_text())
        listener = {
            "type": "tcp",
            "bind": spec["bind"],
            "ssl": True,
            "certfile": spec["certfile"],
            "keyfile": spec["keyfile"],
        }
        plugins = {
            "amqtt.plugins.authentication.FileAuthPlugin": {"password_file": spec["password_file"]},
            "amqtt.plugins.topic_checking.TopicAccessControlListPlugin": {
                "publish_acl": spec["publish_acl"],
                "acl": spec["subscribe_acl"],
            },
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CredentialsError(f"{path} is not a fedmq provision amqtt config ({exc!r}); run fedmq provision") from None
    return {"listeners": {"default": listener}, "plugins": plugins}


_CONNECTING: ContextVar[Any] = ContextVar("fedmq_amqtt_connecting", default=None)
"""The `AclBroker` reading a CONNECT in this task (`_bind_client_ids`)."""


def _bind_client_ids() -> None:
    """Make amqtt hand a client id only to its holder's user, checked before amqtt touches a session.

    amqtt gives a client id to the newest connection that asks for it, and does so before it checks
    that connection's credentials: with a clean session it deletes the holder's session (and its
    subscriptions) as soon as the CONNECT is read; otherwise the authenticated newcomer takes the
    connection over. So any node could knock the coordinator off the broker by connecting with its
    client id (issue 31, item 5). mosquitto's `use_username_as_clientid` closes this; amqtt has no
    such option and no hook between reading the CONNECT and looking up the session, so the one step
    that reads it (`BrokerProtocolHandler.init_from_connect`) is wrapped here, for the connections
    of an `AclBroker` only (`_CONNECTING`): a connection that asks for a client id held by another user,
    or whose credentials are wrong, is given a fresh id instead, and the holder keeps its session."""
    from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler

    original = BrokerProtocolHandler.__dict__["init_from_connect"]
    if getattr(original, "fedmq_bound", False):
        return
    read_connect = original.__func__

    async def init_from_connect(cls: Any, *args: Any, **kwargs: Any) -> Any:
        handler, session = await read_connect(cls, *args, **kwargs)
        broker = _CONNECTING.get()
        if broker is not None:
            await broker.bind_client_id(session)
        return handler, session

    init_from_connect.fedmq_bound = True  # type: ignore[attr-defined]
    BrokerProtocolHandler.init_from_connect = classmethod(init_from_connect)


@functools.cache
def _broker_class() -> type[Any]:  # made on demand: the bus itself does not need amqtt
    """amqtt's broker, sending a connecting client only the retained messages of its own subscriptions.

    amqtt 0.12, when any client connects, publishes to it the retained messages matching every topic
    filter *any* session has subscribed to (`Broker._handle_client_session` iterates the broker-wide
    subscription table), not only its own: a node connecting received other subscribers' retained
    messages (a retained node status reached a coordinator subscribed to updates only, seen in
    tests/integration/test_secure.py), unasked and unchecked against its subscribe ACL, and with many
    nodes every connection fanned out every retained status. Here a retained message goes out for a
    filter only if the session holds that subscription (after a SUBSCRIBE, or for a resumed session)."""
    from amqtt.broker import Broker

    class FedmqBroker(Broker):  # type: ignore[misc]
        async def _publish_retained_messages_for_subscription(self, subscription: Any, session: Any) -> None:
            holders = self._subscriptions.get(subscription[0], ())
            if any(held is session or held.client_id == session.client_id for held, _ in holders):
                await super()._publish_retained_messages_for_subscription(subscription, session)

    return FedmqBroker


def _acl_broker_class() -> type[Any]:  # made on demand: the bus itself does not need amqtt
    """amqtt's broker, with its publish ACL also on the messages it sends on a client's behalf, and
    client ids bound to their users (`_bind_client_ids`).

    amqtt checks a client's PUBLISH against the ACL, but not its will: a node could connect with a
    will on the coordinator's state topic, drop its connection, and have amqtt deliver and retain
    a forged "finished" that every honest node obeyed (issue 31, item 3). Every message published
    or retained for a session is checked here, the will included; broker-made ones have none."""
    from amqtt.broker import Action

    _bind_client_ids()

    class AclBroker(_broker_class()):  # type: ignore[misc]
        async def _initialize_client_session(self, *args: Any, **kwargs: Any) -> Any:
            token = _CONNECTING.set(self)
            try:
                return await super()._initialize_client_session(*args, **kwargs)
            finally:
                _CONNECTING.reset(token)

        async def bind_client_id(self, session: Any) -> None:
            """Give `session` a fresh client id if the one it asks for is held by another user's
            session, or its credentials are wrong (then its connection is refused after this anyway)."""
            held = self._sessions.get(session.client_id)
            if held is None:
                return
            if held[0].username == session.username and await self._authenticate(session, None):
                return  # its own id: a reconnection, as MQTT means it
            logger.warning(
                "embedded broker: user %r asked for client id %r, which user %r holds; given a fresh id instead",
                session.username,
                session.client_id,
                held[0].username,
            )
            session.client_id = f"refused-{os.urandom(8).hex()}"

        async def _allowed(self, session: Any, topic: str | None) -> bool:
            if session is None or topic is None:
                return True
            if await self._topic_filtering(session, topic=topic, action=Action.PUBLISH):
                return True
            logger.warning("embedded broker: %s may not publish on %s; its message is dropped", session.username, topic)
            return False

        async def _broadcast_message(self, session: Any, topic: Any, data: Any, force_qos: Any = None) -> None:
            if await self._allowed(session, topic):
                await super()._broadcast_message(session, topic, data, force_qos)

        async def retain_message(self, session: Any, topic_name: Any, data: Any, qos: Any = None) -> None:
            if data and not _may_retain(session, topic_name):
                logger.warning(
                    "embedded broker: %s may not retain a message on %s; delivered, not kept",
                    session.username, topic_name,
                )  # fmt: skip
                return
            if await self._allowed(session, topic_name):
                await super().retain_message(session, topic_name, data, qos)

    return AclBroker


def _may_retain(session: Any, topic: str | None) -> bool:
    """Whether the secure embedded broker keeps a message `session` published (or willed) retained:
    the coordinator's always; a node's only on a node status topic (its own, as the publish ACL
    checks), the one topic fedmq's nodes retain. A retained ack or update would be replayed to every
    coordinator that subscribes (issue 31, item 9); the coordinator refuses and clears such messages
    on either broker, and here they are not kept in the first place."""
    if session is None or topic is None or session.username == COORDINATOR:
        return True
    parts = topic.split("/")
    return len(parts) == 5 and parts[2] == "nodes" and parts[4] == "status"


@contextlib.asynccontextmanager
async def embedded_broker(
    host: str = "127.0.0.1", port: int = 1883, *, secure: Path | None = None
) -> AsyncIterator[None]:
    """Run an amqtt broker on host:port for the duration of the block; with `secure` (a provisioned
    amqtt.json), on the address it names, TLS and authenticated only."""
    for name in ("amqtt", "transitions"):
        logging.getLogger(name).setLevel(max(logging.getLogger(name).level, logging.WARNING))
    kind = _acl_broker_class() if secure is not None else _broker_class()
    broker = kind(secure_amqtt_config(secure) if secure is not None else amqtt_config(host, port))
    broker._subscriptions = _SnapshotDict(broker._subscriptions)  # see _SnapshotDict
    await broker.start()
    logger.info("embedded broker (amqtt) listening on %s://%s:%d", "mqtts" if secure else "mqtt", host, port)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            await broker.shutdown()


async def serve_embedded(
    host: str, port: int, stop: asyncio.Event | None = None, *, secure: Path | None = None
) -> None:
    """Run until `stop` is set or the task is cancelled."""
    async with embedded_broker(host, port, secure=secure):
        await (stop or asyncio.Event()).wait()
