"""The broker flags that every command reaching a broker takes: `--broker URL`, and the access flags
(`--credentials`, `--username`, TLS files): how they are declared, what Access they describe, and how
`fedmq run` passes them on."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedmq.broker.errors import CredentialsError

BROKER_URL_HELP = "mqtt://HOST:PORT, or mqtts://HOST:PORT for TLS"


def add_broker(p: argparse.ArgumentParser, help: str = BROKER_URL_HELP, *, required: bool = True) -> None:
    """`--broker URL`: the broker a daemon connects to (`fedmq run`'s is optional: it starts one without)."""
    p.add_argument("--broker", required=required, metavar="URL", help=help)


def add_access(p: argparse.ArgumentParser) -> None:
    """Who connects and how (credentials, TLS), read back by `broker_access`, passed on by `access_flags`."""
    g = p.add_argument_group(
        "broker access",
        "For a broker with TLS (mqtts://) and per-identity credentials, e.g. one set up by `fedmq provision`."
        " A password is never needed in the URL, which any user can see in `ps`; FEDMQ_BROKER_USERNAME,"
        " FEDMQ_BROKER_PASSWORD and FEDMQ_BROKER_PASSWORD_FILE are read too (the flags win).",
    )
    g.add_argument(
        "--credentials",
        type=Path,
        metavar="PATH",
        help="a credentials file (JSON: username, password, ca_file) for one identity, or a folder of"
        " IDENTITY.json files, one per node id and coordinator.json (what `fedmq provision` writes)",
    )
    g.add_argument("--username", help="MQTT user name")
    g.add_argument("--password-file", type=Path, metavar="FILE", help="read the MQTT password from FILE")
    g.add_argument("--ca-file", type=Path, metavar="FILE", help="the CA that signed the broker's certificate")
    g.add_argument("--cert-file", type=Path, metavar="FILE", help="a client certificate (PEM), with --key-file")
    g.add_argument("--key-file", type=Path, metavar="FILE", help="the client certificate's private key (PEM)")


def broker_access(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The Access the broker-access flags describe."""
    from fedmq.broker.servers.credentials import Access, Credentials, read_password_file

    def path(value: Path | None) -> str | None:
        if value is not None and not value.is_file():
            raise CredentialsError(f"{value} does not exist")
        return str(value.resolve()) if value is not None else None

    flags = Credentials(
        username=args.username,
        password=read_password_file(args.password_file) if args.password_file else None,
        ca_file=path(args.ca_file),
        cert_file=path(args.cert_file),
        key_file=path(args.key_file),
    )
    return Access(source=args.credentials, flags=flags)


def access_flags(args: argparse.Namespace) -> list[str]:
    """The broker-access flags as given, for the processes `fedmq run` starts."""
    out: list[str] = []
    for flag in ("credentials", "username", "password_file", "ca_file", "cert_file", "key_file"):
        value = getattr(args, flag, None)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(Path(value).resolve()) if isinstance(value, Path) else value]
    return out
