"""`fedmq broker`: a development broker, mosquitto when installed and the embedded one otherwise; a
provisioned federation's (`--secure DIR`), or a site's bridged to the central one (`cli.bridge`)."""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

from fedmq.broker.errors import BusError
from fedmq.experiments.cli import bridge
from fedmq.experiments.cli.exits import EXIT_FAILED, EXIT_OK
from fedmq.experiments.cli.loop import run_async
from fedmq.fedcore.errors import ConfigError

HELP = "run a development broker"
DESCRIPTION = (
    "mosquitto with a generated config (TCP_NODELAY, large packets) when it is installed,"
    " otherwise the embedded pure-Python broker (amqtt, MQTT 3.1.1). Runs until interrupted."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=1883, help="TCP port (default 1883)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--config", type=Path, help="a mosquitto.conf to use instead of the generated one")
    p.add_argument("--embedded", action="store_true", help="use the embedded broker even if mosquitto is installed")
    p.add_argument(
        "--secure",
        type=Path,
        metavar="DIR",
        help="serve a federation provisioned into DIR by `fedmq provision`: TLS, its users and topic rules"
        " (its own address and port; --port and --host are ignored)",
    )
    bridge.add_bridge(p)


def run(args: argparse.Namespace) -> int:
    return run_async(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    from fedmq.broker.servers.embedded import serve_embedded
    from fedmq.broker.servers.mosquitto import find_mosquitto, start_mosquitto

    config_file, secure_amqtt, host, port = args.config, None, args.host, args.port
    scheme = "mqtt"
    if args.secure is not None:
        if args.config is not None:
            raise ConfigError("--secure DIR brings its own broker config; leave out --config")
        secure_amqtt, (host, port) = _provisioned(args.secure)
        config_file, scheme = args.secure / "mosquitto" / "mosquitto.conf", "mqtts"
    if args.bridge is not None:
        if args.config is not None or args.secure is not None:
            raise ConfigError("--bridge writes the site broker's config itself; leave out --config and --secure")
        config_file = bridge.site_broker_config(args)
    if args.config is None:  # a mosquitto.conf of the user's says where it listens itself
        _check_free(host, port)
    if not args.embedded and find_mosquitto() is not None:
        proc = start_mosquitto(port, bind=host, config_file=config_file)
        print(f"mosquitto listening on {scheme}://{host}:{port} (pid {proc.pid}); Ctrl-C stops it", flush=True)
        try:
            await asyncio.to_thread(proc.wait)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)
        return EXIT_OK if proc.returncode in (0, -signal.SIGTERM) else EXIT_FAILED
    if args.config is not None and not args.embedded:
        raise ConfigError("--config is a mosquitto.conf, but mosquitto is not installed (apt-get install mosquitto)")
    version = "MQTT 3.1.1" + (", TLS, provisioned users and topic rules" if secure_amqtt else "")
    print(f"embedded broker (amqtt, {version}) listening on {scheme}://{host}:{port}; Ctrl-C stops it", flush=True)
    await serve_embedded(host, port, secure=secure_amqtt)
    return EXIT_OK


def _check_free(host: str, port: int) -> None:
    """A broker that cannot listen exits 3 saying where, before it starts (mosquitto would exit 1
    without a word here; amqtt with a traceback)."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        why = exc.strerror or exc
        raise BusError(f"cannot listen on {host}:{port}: {why} (is another broker running there?)") from None


def _provisioned(directory: Path) -> tuple[Path, tuple[str, int]]:
    """A provisioned folder's embedded-broker config (checked as the embedded broker reads it) and the
    address both brokers listen on."""
    from fedmq.broker.servers.embedded import secure_amqtt_config

    path = directory / "amqtt" / "amqtt.json"
    if not path.is_file():
        raise ConfigError(f"{directory} was not written by `fedmq provision` (no {path})")
    host, _, port = secure_amqtt_config(path)["listeners"]["default"]["bind"].rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{path}: bind must be HOST:PORT; run fedmq provision again")
    return path, (host, int(port))
