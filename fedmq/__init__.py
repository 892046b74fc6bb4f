"""fedmq: event-driven federated learning over MQTT.

One import name for the whole framework. The design card's folders stay at the top of the
repository and are its subpackages: `fedmq.broker` (the bus), `fedmq.coordinator` and
`fedmq.fednode` (the daemons), `fedmq.aggregator` (site aggregators), `fedmq.fedcore` (models,
data, training and the methods) and `fedmq.experiments` (configuration, the command line, runs
and benchmarks). In a checkout they are reached through the links in this folder; a built wheel
holds them as plain folders under `fedmq/`.
"""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("fedmq")
except metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
