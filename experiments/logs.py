"""Logging setup, done once by the command line (library code only creates loggers).

Two formats: ``text`` (the default) and ``json``, one JSON object per line with the time (UTC, ISO
8601), level, logger, message and process id, the node id where a node daemon logged it, and the
exception's traceback as text when there is one: what journald, Docker's log drivers or a log
shipper read without a parsing rule.
"""

from __future__ import annotations

import json
import logging.config
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from fedmq.fedcore.errors import ConfigError

FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(self.fields(record), ensure_ascii=False, default=str)

    def fields(self, record: logging.LogRecord) -> dict[str, Any]:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
        }
        node_id = getattr(record, "node_id", None)
        if node_id is not None:
            out["node_id"] = node_id
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return out


def line(message: str, fmt: str, *, level: str = "ERROR", logger: str = "fedmq") -> str:
    """`message` as the command prints it to the user: as is, or as a JSON log line."""
    if fmt != "json":
        return message
    record = logging.LogRecord(logger, getattr(logging, level), __file__, 0, message, None, None)
    return JsonFormatter().format(record)


def default_config(
    verbose: int = 0, *, file: Path | None = None, console: bool = True, fmt: str = "text"
) -> dict[str, Any]:
    if fmt not in FORMATS:
        raise ConfigError(f"log format {fmt!r}: use {' or '.join(FORMATS)}")
    level = "DEBUG" if verbose > 1 else "INFO" if verbose == 1 or file is not None else "WARNING"
    handlers: dict[str, Any] = {}
    if console:
        handlers["console"] = {
            "class": "logging.StreamHandler",
            "formatter": "json" if fmt == "json" else "short",
            "stream": "ext://sys.stderr",
            "level": "DEBUG" if verbose > 1 else "INFO" if verbose == 1 else "WARNING",
        }
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        handlers["file"] = {
            "class": "logging.FileHandler",
            "formatter": "json" if fmt == "json" else "full",
            "filename": str(file),
            "level": level,
        }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "short": {"format": "%(levelname)-7s %(name)s: %(message)s"},
            "full": {"format": "%(asctime)s %(levelname)-7s %(process)d %(name)s: %(message)s"},
            "json": {"()": JsonFormatter},
        },
        "handlers": handlers,
        "root": {"level": level, "handlers": list(handlers)},
        "loggers": {
            # third-party chatter: amqtt logs every connection, paho every packet
            "amqtt": {"level": "WARNING"},
            "transitions": {"level": "WARNING"},
            "fedmq.broker.client.mqtt": {"level": "WARNING"},
            "fedmq.coordinator.drivers.mqtt.bus.mqtt": {"level": "WARNING"},
            "fedmq.fednode.daemon.bus.mqtt": {"level": "WARNING"},
        },
    }


def setup(
    verbose: int = 0,
    *,
    file: Path | None = None,
    console: bool = True,
    config_file: Path | None = None,
    fmt: str = "text",
) -> None:
    """Configure logging; a log file that cannot be opened, or a logging config that cannot be
    applied, is a `ConfigError` saying which (the command line exits 2 with it)."""
    try:
        if config_file is not None:
            logging.config.dictConfig(yaml.safe_load(config_file.read_text()))
            return
        logging.config.dictConfig(default_config(verbose, file=file, console=console, fmt=fmt))
    except OSError as exc:
        raise ConfigError(f"cannot open {exc.filename or config_file or file}: {exc.strerror or exc}") from None
    except (ValueError, TypeError, AttributeError, ImportError, yaml.YAMLError) as exc:
        where = f"--log-config {config_file}" if config_file is not None else "logging"
        raise ConfigError(f"{where}: {exc}") from None
    logging.captureWarnings(True)
