"""fedmq: event-driven federated learning over MQTT.

One import name for the whole framework. The design card's folders stay at the top of the
repository and are its subpackages: `fedmq.broker` (the bus), `fedmq.coordinator` and
`fedmq.fednode` (the daemons), `fedmq.aggregator` (site aggregators), `fedmq.fedcore` (models,
data, training and the methods) and `fedmq.experiments` (configuration, the command line, runs
and benchmarks). In a checkout they are reached through the links in this folder; a built wheel
holds them as plain folders under `fedmq/`.

The Python API (`fedmq.api`) is here too: `load_config`, `simulate`, `run`, `open_run`, `replay`,
the `Run` they give, and the errors each standing for one of the command line's exit codes. They are
imported when first used, so `import fedmq` (and the `fedmq` command's start) stays light.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedmq.api import FederationFailed, ReplayDiffers, Run, load_config, open_run, replay, run, simulate
    from fedmq.broker.errors import BusError, CredentialsError
    from fedmq.coordinator.drivers.replay import ReplayError
    from fedmq.coordinator.errors import CoordinatorError
    from fedmq.fedcore.errors import ConfigError, DataError

try:
    __version__ = metadata.version("fedmq")
except metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

_LAZY = {
    **dict.fromkeys(
        ("load_config", "simulate", "run", "open_run", "replay", "Run", "FederationFailed", "ReplayDiffers"),
        "fedmq.api",
    ),
    "ConfigError": "fedmq.fedcore.errors",
    "DataError": "fedmq.fedcore.errors",
    "BusError": "fedmq.broker.errors",
    "CredentialsError": "fedmq.broker.errors",
    "CoordinatorError": "fedmq.coordinator.errors",
    "ReplayError": "fedmq.coordinator.drivers.replay",
}

__all__ = [
    "BusError",
    "ConfigError",
    "CoordinatorError",
    "CredentialsError",
    "DataError",
    "FederationFailed",
    "ReplayDiffers",
    "ReplayError",
    "Run",
    "__version__",
    "load_config",
    "open_run",
    "replay",
    "run",
    "simulate",
]


def __getattr__(name: str) -> Any:
    """The API's names, imported on first use (torch and the rest load only then)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fedmq' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
