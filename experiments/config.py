"""The experiment file: one YAML document, validated strictly on load.

Every error names the field and says what is allowed; an unknown key is an error, never ignored.
`ExperimentConfig` composes the daemons' own settings (`CoordinatorConfig`, `NodeConfig`,
`BusConfig`); only this package parses files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fedcore.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataConfig(_Strict):
    dataset: str = Field("digits", description="digits | synthetic (the data issue adds the image datasets)")
    root: str | None = Field(None, description="data root; FEDMQ_DATA_ROOT when unset")
    options: dict[str, Any] = Field(default_factory=dict, description="loader options, e.g. test_fraction")


class PartitionConfig(_Strict):
    kind: Literal["iid", "dirichlet"] = "dirichlet"
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration (label skew grows as it shrinks)")
    min_samples: int = Field(10, ge=1, description="every node gets at least this many samples")


class ModelConfig(_Strict):
    name: str = Field("cnn", description="mlp | cnn")
    options: dict[str, Any] = Field(default_factory=dict)


class MethodConfig(_Strict):
    name: str = Field("fedavg", description="the algorithm, from fedcore.algorithms")
    hyperparams: dict[str, Any] = Field(default_factory=dict)


class TrainConfig(_Strict):
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(32, ge=1)
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.01, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    lr_decay: float = Field(1.0, gt=0, le=1)
    max_grad_norm: float | None = Field(None, gt=0)


class PolicyConfig(_Strict):
    over_selection: float = Field(1.0, ge=1, description="select ceil(f x K), close the round at K updates")
    ack_timeout_s: float = Field(5.0, gt=0)
    min_updates: int = Field(1, ge=1)
    on_insufficient: Literal["retry", "skip"] = "retry"
    max_retries: int = Field(3, ge=0)
    min_nodes: int | None = Field(None, ge=1, description="live nodes before round 0; default: all of them")
    wait_for_nodes_s: float = Field(120.0, gt=0)


class BusSettings(_Strict):
    protocol: Literal["auto", "5", "3.1.1"] = "auto"
    chunk_bytes: int = Field(2**20, ge=4096)
    max_message_bytes: int = Field(64 * 2**20, ge=65536, le=268_435_455)
    keepalive_s: int = Field(15, ge=1)
    transfer_timeout_s: float = Field(120.0, gt=0)


class FaultConfig(_Strict):
    delay_s: float = Field(0.0, ge=0)
    delay_rounds: list[int] | None = None
    fail_at_round: int | None = Field(None, ge=0)


class HostingConfig(_Strict):
    processes: int | None = Field(None, ge=1, description="node-host processes for `fedmq run`; default: cores")
    threads_per_process: int = Field(1, ge=1, description="torch threads per process (fixed for determinism)")


class ExperimentConfig(_Strict):
    name: str = Field(..., min_length=1, max_length=48, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
    federation: str | None = Field(None, description="topic namespace; `fedmq run` makes a unique one")
    seed: int = 0
    nodes: int = Field(..., ge=1, le=100_000)
    fraction: float = Field(0.1, gt=0, le=1, description="C: the share of live nodes sampled per round")
    rounds: int = Field(..., ge=1)
    eval_every: int = Field(1, ge=1)
    deadline_s: float = Field(60.0, gt=0, description="a round closes at its deadline with what arrived")
    data: DataConfig = Field(default_factory=DataConfig)
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    method: MethodConfig = Field(default_factory=MethodConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    bus: BusSettings = Field(default_factory=BusSettings)
    faults: dict[str, FaultConfig] = Field(default_factory=dict, description="per node id, for experiments")
    hosting: HostingConfig = Field(default_factory=HostingConfig)

    @field_validator("faults")
    @classmethod
    def _fault_ids(cls, value: dict[str, FaultConfig]) -> dict[str, FaultConfig]:
        for node_id in value:
            if not node_id.startswith("node-"):
                raise ValueError(f"fault key {node_id!r} is not a node id like 'node-003'")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ExperimentConfig:
        ids = set(self.node_ids())
        unknown = sorted(set(self.faults) - ids)
        if unknown:
            raise ValueError(f"faults name nodes that do not exist: {unknown} (ids are node-000 .. {max(ids)})")
        if self.policy.min_nodes is not None and self.policy.min_nodes > self.nodes:
            raise ValueError(f"policy.min_nodes {self.policy.min_nodes} exceeds nodes {self.nodes}")
        if self.bus.chunk_bytes > self.bus.max_message_bytes - 8192:
            raise ValueError("bus.chunk_bytes must be at least 8 KiB below bus.max_message_bytes")
        return self

    def node_ids(self) -> list[str]:
        width = max(3, len(str(self.nodes - 1)))
        return [f"node-{i:0{width}d}" for i in range(self.nodes)]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _describe(error: dict[str, Any], model: type[BaseModel]) -> str:
    loc = ".".join(str(p) for p in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        parent: Any = model
        for part in error["loc"][:-1]:
            field = parent.model_fields.get(str(part)) if isinstance(parent, type) else None
            parent = field.annotation if field is not None else None
        allowed = sorted(parent.model_fields) if isinstance(parent, type) and issubclass(parent, BaseModel) else []
        return f"{loc}: unknown field" + (f"; allowed here: {', '.join(allowed)}" if allowed else "")
    value = error.get("input")
    shown = f" (got {value!r})" if not isinstance(value, dict) and value is not None else ""
    return f"{loc}: {error['msg']}{shown}"


def parse_config(data: Any, *, source: str = "config") -> ExperimentConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: an experiment file is a YAML mapping, got {type(data).__name__}")
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        lines = [_describe(e, ExperimentConfig) for e in exc.errors()]
        raise ConfigError(f"{source} is invalid:\n  " + "\n  ".join(lines)) from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``key.sub=value`` pairs from the command line; values are parsed as YAML scalars."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set rounds=5")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part} is not a section")
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the experiment file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if overrides:
        data = apply_overrides(data if isinstance(data, dict) else {}, overrides)
    return parse_config(data, source=str(path))
