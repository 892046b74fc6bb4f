"""Errors of the shared core, with the field or node they concern."""

from __future__ import annotations

from fedmq.fields import FieldError, check_fields


class ConfigError(ValueError):
    """A setting is invalid; the message names it and says what is allowed."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


def check_section(config: object, section: str) -> None:
    """`check_fields` of the dataclass `config`, whose fields are the settings of `section` ("train"): a
    value outside its bounds or choices is a ConfigError naming it as ``section.name``."""
    try:
        check_fields(config)
    except FieldError as exc:
        raise ConfigError(
            f"{exc.value!r} is not allowed; must be {exc.allowed}", field=f"{section}.{exc.field}"
        ) from None


class DataError(RuntimeError):
    """A dataset is missing or malformed; the message says which files are expected and where."""


class AlgorithmError(RuntimeError):
    """An algorithm half received input it cannot use (for instance a payload without its model)."""

    def __init__(self, message: str, *, node_id: str | None = None, round: int | None = None) -> None:
        where = ", ".join(
            p for p in (f"node {node_id}" if node_id else "", f"round {round}" if round is not None else "") if p
        )
        super().__init__(f"{message} ({where})" if where else message)
        self.node_id = node_id
        self.round = round
