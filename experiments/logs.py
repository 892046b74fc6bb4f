"""Logging setup, done once by the command line (library code only creates loggers)."""

from __future__ import annotations

import logging.config
from pathlib import Path
from typing import Any


def default_config(verbose: int = 0, *, file: Path | None = None, console: bool = True) -> dict[str, Any]:
    level = "DEBUG" if verbose > 1 else "INFO" if verbose == 1 or file is not None else "WARNING"
    handlers: dict[str, Any] = {}
    if console:
        handlers["console"] = {
            "class": "logging.StreamHandler",
            "formatter": "short",
            "stream": "ext://sys.stderr",
            "level": "DEBUG" if verbose > 1 else "INFO" if verbose == 1 else "WARNING",
        }
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        handlers["file"] = {"class": "logging.FileHandler", "formatter": "full", "filename": str(file), "level": level}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "short": {"format": "%(levelname)-7s %(name)s: %(message)s"},
            "full": {"format": "%(asctime)s %(levelname)-7s %(process)d %(name)s: %(message)s"},
        },
        "handlers": handlers,
        "root": {"level": level, "handlers": list(handlers)},
        "loggers": {
            # third-party chatter: amqtt logs every connection, paho every packet
            "amqtt": {"level": "WARNING"},
            "transitions": {"level": "WARNING"},
            "broker.client.mqtt": {"level": "WARNING"},
            "coordinator.daemon.bus.mqtt": {"level": "WARNING"},
            "fednode.daemon.bus.mqtt": {"level": "WARNING"},
        },
    }


def setup(verbose: int = 0, *, file: Path | None = None, console: bool = True, config_file: Path | None = None) -> None:
    if config_file is not None:
        import yaml

        logging.config.dictConfig(yaml.safe_load(config_file.read_text()))
        return
    logging.config.dictConfig(default_config(verbose, file=file, console=console))
    logging.captureWarnings(True)
