"""Who a bus client is and what it trusts, kept out of the broker URL (which shows in `ps`).

Each identity (the coordinator, the run monitor, one per node) may have a credentials file, JSON::

    {"username": "node-003", "password": "...", "ca_file": "../ca.crt"}

(optional ``cert_file`` and ``key_file`` for a client certificate; relative paths are read from the
file's folder). `fedmq provision` writes one per identity into ``OUT/credentials/``. A process that
hosts several identities (``fedmq node --node-id a --node-id b``) is given that folder, and each
identity takes ``IDENTITY.json`` from it. Environment variables and command-line flags fill in or
override: flags > file > environment > URL.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fedmq.broker.errors import CredentialsError

COORDINATOR = "coordinator"
MONITOR = "monitor"
"""The identities besides the nodes (whose identity is their node id): what their credentials file is called."""
ENV_USERNAME = "FEDMQ_BROKER_USERNAME"
ENV_PASSWORD = "FEDMQ_BROKER_PASSWORD"
ENV_PASSWORD_FILE = "FEDMQ_BROKER_PASSWORD_FILE"
_PATH_KEYS = ("ca_file", "cert_file", "key_file")


@dataclass(frozen=True, kw_only=True, slots=True)
class Credentials:
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = field(default=None, repr=False)

    def over(self, base: Credentials) -> Credentials:
        """These, with `base`'s where these have none."""
        return Credentials(**{f.name: getattr(self, f.name) or getattr(base, f.name) for f in fields(self)})

    def bus_overrides(self) -> dict[str, Any]:
        """The BusConfig fields these set (nothing for what is unset, so the URL's stay)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def read_password_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CredentialsError(f"cannot read the password file {path}: {exc.strerror or exc}") from None
    password = text.rstrip("\r\n")
    if not password:
        raise CredentialsError(f"the password file {path} is empty")
    return password


def read_credentials_file(path: Path) -> Credentials:
    """One identity's credentials file; a clear error for anything missing, unknown or unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CredentialsError(f"cannot read the credentials file {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise CredentialsError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, Mapping):
        raise CredentialsError(f"{path}: expected a JSON object with username, password and ca_file")
    known = {f.name for f in fields(Credentials)} | {"password_file", "comment"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise CredentialsError(f"{path}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key == "comment":
            continue
        if not isinstance(value, str) or not value:
            raise CredentialsError(f"{path}: {key} must be a non-empty string")
        if key in _PATH_KEYS or key == "password_file":
            resolved = (path.parent / value).resolve()
            if not resolved.is_file():
                raise CredentialsError(f"{path}: {key} {value!r} does not exist (looked for {resolved})")
            value = str(resolved)
        values[key] = value
    password_file = values.pop("password_file", None)
    if password_file is not None:
        if "password" in values:
            raise CredentialsError(f"{path}: give password or password_file, not both")
        values["password"] = read_password_file(Path(password_file))
    return Credentials(**values)


def from_environment(env: Mapping[str, str] | None = None) -> Credentials:
    env = os.environ if env is None else env
    password = env.get(ENV_PASSWORD) or None
    if password is None and env.get(ENV_PASSWORD_FILE):
        password = read_password_file(Path(env[ENV_PASSWORD_FILE]))
    return Credentials(username=env.get(ENV_USERNAME) or None, password=password)


@dataclass(frozen=True, kw_only=True, slots=True)
class Access:
    """Where each identity of this process finds its credentials: a file for one identity or a
    folder of ``IDENTITY.json`` (`source`), the environment, and `flags` that override both."""

    source: Path | None = None
    flags: Credentials = Credentials()
    use_environment: bool = True

    def __post_init__(self) -> None:
        if self.source is not None and not self.source.exists():
            raise CredentialsError(f"--credentials {self.source} does not exist (fedmq provision writes them)")

    def for_identity(self, identity: str) -> Credentials:
        found = Credentials()
        if self.source is not None:
            path = self.source / f"{identity}.json" if self.source.is_dir() else self.source
            if not path.is_file():
                raise CredentialsError(
                    f"no credentials for {identity!r} in {self.source} (expected {path.name}; `fedmq provision`"
                    " writes one file per node and one for the coordinator)"
                )
            found = read_credentials_file(path)
        base = from_environment() if self.use_environment else Credentials()
        return self.flags.over(found.over(base))

    def bus_overrides(self, identity: str) -> dict[str, Any]:
        return self.for_identity(identity).bus_overrides()


NO_ACCESS = Access(use_environment=False)
"""Credentials from the URL alone: for tests and benchmarks that must not read the environment."""
