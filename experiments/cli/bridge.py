"""`fedmq broker --bridge`: a site's mosquitto bridged to the central broker (hierarchical
federations, docs/hierarchy.md): its options, what they must say, and the mosquitto.conf they make
(rendered by `broker.servers.bridge`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from fedmq.fedcore.errors import ConfigError


def add_bridge(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "site broker (hierarchical federations, docs/hierarchy.md)",
        "A mosquitto for one site, bridged to the central broker: the site's nodes and aggregator connect here;"
        " the bridge carries only the aggregator's topics (its tasks and models in, its status and updates out).",
    )
    g.add_argument(
        "--bridge", metavar="URL", help="the central broker to bridge to, mqtt://HOST:PORT (needs mosquitto)"
    )
    g.add_argument("--site", help="the site this broker serves (its aggregator's node id), e.g. site-0")
    g.add_argument("--federation", help="the federation id of the run (its topics are bridged)")
    g.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="where the site broker keeps its config and its persistent sessions across restarts"
        " (default runs/brokers/FEDERATION-SITE)",
    )


def site_broker_config(args: argparse.Namespace) -> Path:
    """The site broker's mosquitto.conf, written into its state directory, once the options are
    checked: mosquitto (the embedded broker has no bridge), a site and a federation, a plain URL."""
    import pwd

    from fedmq.broker.config import BusConfig
    from fedmq.broker.servers.bridge import render_site_config
    from fedmq.broker.servers.mosquitto import find_mosquitto
    from fedmq.broker.topics import check_id

    if find_mosquitto() is None:
        raise ConfigError(
            "--bridge runs mosquitto's own bridge, but mosquitto is not installed (apt-get install mosquitto)"
        )
    if args.embedded:
        raise ConfigError("--bridge needs mosquitto (the embedded broker has no bridge); leave out --embedded")
    if not args.site or not args.federation:
        raise ConfigError("--bridge needs --site (the site's aggregator node id) and --federation (the run's)")
    try:
        check_id(args.site, "--site")
        check_id(args.federation, "--federation")
        central = BusConfig.from_url(args.bridge)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if central.tls:
        raise ConfigError("--bridge over TLS is not generated yet: bridge to an mqtt:// address (docs/hierarchy.md)")
    state = args.state_dir or Path("runs") / "brokers" / f"{args.federation}-{args.site}"
    state.mkdir(parents=True, exist_ok=True)
    path = state / "mosquitto.conf"
    path.write_text(
        render_site_config(
            port=args.port,
            bind=args.host,
            central=(central.host, central.port),
            federation=args.federation,
            site=args.site,
            persistence_dir=state.resolve(),
            user=pwd.getpwuid(os.geteuid()).pw_name,
        )
    )
    return path
