"""The experiment file: one YAML document, validated strictly on load.

Every error names the field and says what is allowed; an unknown key is an error, never ignored.
`ExperimentConfig` composes the daemons' own settings (`CoordinatorConfig`, `NodeConfig`,
`BusConfig`); only this package parses files. The sections that carry those settings (`policy`,
`engine` and its `staleness`, `bus`, `faults`, `train`, `compression`) are derived from the daemons'
and the core's dataclasses, where each setting's type, default, bounds and docstring are written once
(`_section`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import inspect
import itertools
import math
import textwrap
import warnings
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from fedmq.broker.config import BusConfig
from fedmq.coordinator.config import AsyncPolicy, CoordinatorConfig, RoundPolicy
from fedmq.experiments.scenario import ScenarioConfig, resolve_scenario_sourced
from fedmq.experiments.yaml_source import Loc, SourceMap, dotted, read_yaml_file
from fedmq.fedcore.compression import Compression
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.host_memory import HostMemory
from fedmq.fedcore.staleness import Staleness
from fedmq.fedcore.training import TrainSettings
from fedmq.fedcore.vectorized import vectorizes_by_default
from fedmq.fednode.scenario import Faults
from fedmq.fields import Bounds, field_bounds, unannotated

if TYPE_CHECKING:
    from fedmq.fedcore.privacy import CentralDP
    from fedmq.fedcore.secagg import SecAggSettings


class _Strict(BaseModel):
    """A section of the experiment file: unknown keys refused, frozen once read. A run's dump
    (config.yaml) holds every field; a config written before a field existed is read with its default,
    so comparing configs means comparing them read (`experiments.grid.cell_is_done`), never their text."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _field(
    cls: type, name: str, *, unset: str | None = None, default_factory: Any = None, bounds: Bounds | None = None
) -> Any:
    """The pydantic field of setting `name` of the config dataclass `cls`: its default, bounds
    (`fedmq.fields.Bounds`) and docstring as written there. `unset`: the experiment file's default is
    None instead, which `experiments.build` resolves as this says. `bounds`: the file's, where they are
    narrower than the dataclass's."""
    spec = next(f for f in dataclasses.fields(cls) if f.name == name)
    bounds = bounds or field_bounds(get_type_hints(cls, include_extras=True)[name]) or Bounds()
    doc = _docstrings(cls).get(name)
    default: Any = ... if spec.default is dataclasses.MISSING else spec.default
    if unset is not None:
        doc, default = f"{doc or ''} None: {unset}.".lstrip(), None
    elif default_factory is not None or spec.default_factory is not dataclasses.MISSING:  # a nested section
        factory: Any = default_factory or spec.default_factory
        return Field(default_factory=factory, description=doc)
    return Field(default, description=doc, gt=bounds.gt, ge=bounds.ge, lt=bounds.lt, le=bounds.le)


def _section(
    cls: type,
    *,
    include: Collection[str] | None = None,
    exclude: Collection[str] = (),
    unset: Mapping[str, str] | None = None,
    types: Mapping[str, Any] | None = None,
    before: Mapping[str, tuple[type, str]] | None = None,
    bounds: Mapping[str, Bounds] | None = None,
) -> type[_Strict]:
    """A section of the experiment file holding settings of the config dataclass `cls` (a daemon's or
    the core's): `include` (in that order) or all but `exclude`, each as `_field` derives it. `unset`:
    settings whose file default is None (see `_field`); `types`: a setting's type in the file where it
    is not the dataclass's (a section of its own for a nested dataclass, a list for a set); `before`:
    settings of other dataclasses, by their name in the file, ahead of these; `bounds`: a setting's
    bounds in the file where they are narrower than the dataclass's (see `_field`)."""
    unset, types, bounds = unset or {}, types or {}, bounds or {}
    fields: dict[str, Any] = {
        name: (unannotated(get_type_hints(owner)[setting]), _field(owner, setting))
        for name, (owner, setting) in (before or {}).items()
    }
    hints = get_type_hints(cls, include_extras=True)
    names = list(include) if include is not None else [f.name for f in dataclasses.fields(cls) if f.name not in exclude]
    for name in names:
        kind = types.get(name, unannotated(hints[name]))
        nested = isinstance(kind, type) and issubclass(kind, BaseModel)
        info = _field(
            cls, name, unset=unset.get(name), default_factory=kind if nested else None, bounds=bounds.get(name)
        )
        fields[name] = (kind | None if name in unset else kind, info)
    model: type[_Strict] = create_model(f"{cls.__name__}Fields", __base__=_Strict, **fields)
    return model


@functools.cache
def _docstrings(cls: type) -> dict[str, str]:
    """The attribute docstrings of class `cls` (a string right below a field), by field name."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    return {
        field.target.id: inspect.cleandoc(doc.value.value)
        for field, doc in itertools.pairwise(body)
        if isinstance(field, ast.AnnAssign)
        and isinstance(field.target, ast.Name)
        and isinstance(doc, ast.Expr)
        and isinstance(doc.value, ast.Constant)
        and isinstance(doc.value.value, str)
    }


class AugmentConfig(_Strict):
    """A training augmentation on the batch's device (`fedcore.transforms.Augment`); evaluation only centre-crops."""

    crop: int | None = Field(None, ge=1, description="side of the random crop; default: the image's side")
    padding: int = Field(0, ge=0, description="pixels added on each side before cropping")
    padding_mode: Literal["zero", "reflect", "replicate"] = "zero"
    flip: bool = Field(False, description="mirror half the images left-right")
    rotation_deg: float = Field(0.0, ge=0, le=180, description="a uniform random angle in [-deg, deg] per image")
    order: list[Literal["crop", "flip", "rotation"]] = Field(
        ["crop", "flip", "rotation"], description="the order the steps run in"
    )


class NormalizeConfig(_Strict):
    mean: list[float] = Field(..., min_length=1, description="per channel, for pixels in [0, 1]")
    std: list[float] = Field(..., min_length=1)

    @model_validator(mode="after")
    def _per_channel(self) -> NormalizeConfig:
        if len(self.mean) != len(self.std) or min(self.std) <= 0:
            raise ValueError("normalize needs one mean and one positive std per channel")
        return self


class PooledSplit(_Strict):
    """The FedVLS authors' MNIST pipeline (``system/data/generate_mnist.py`` of github.com/krumpguo/FedVLS):
    the official training and test sets are pooled (training images first), shuffled by one NumPy
    permutation under ``np.random.seed(seed)``, and cut as sklearn's ``train_test_split(train_size=1 -
    test_fraction)`` cuts it: the first ``n - floor((1 - test_fraction) n)`` permuted images are the
    held-out part, the next ``floor((1 - test_fraction) n)`` the training part, which the nodes are
    partitioned from. Their ``main.py`` unpacks ``generate_mnist``'s loaders in swapped order, so their
    reported test accuracy is measured on the training part (the nodes' own data): ``evaluate_on:
    train_part`` is what their code does, ``held_out_part`` what their paper says."""

    kind: Literal["pooled"] = "pooled"
    test_fraction: float = Field(0.25, gt=0, lt=1, description="share of the pooled images held out (authors: 0.25)")
    seed: int = Field(1, ge=0, le=2**32 - 1, description="NumPy's legacy global seed for the permutation (authors: 1)")
    evaluate_on: Literal["train_part", "held_out_part"] = Field(
        ...,
        description="train_part: the authors' code (its swapped loaders evaluate on the training part);"
        " held_out_part: the paper's description (a 75/25 re-split tested on the 25%)",
    )


class NodeHeldOutSplit(_Strict):
    """PFLlib's convention, which FedSA's Table 1 reports by (fedsa.md section 2): the official training and
    test sets pooled (``pool``), partitioned over the nodes, and each node's part cut 75/25 as
    ``train_test_split(train_size=0.75, shuffle=True)`` cuts it; the global model is evaluated on the
    held-out parts together (each node's accuracy on its own part, in its own proportions of classes,
    pooled by its samples). The cut follows the partition's seed (`fedcore.data.held_out_by_node`)."""

    kind: Literal["per_node"] = "per_node"
    test_fraction: float = Field(0.25, gt=0, lt=1, description="share of each node's part held out (PFLlib: 0.25)")
    pool: bool = Field(
        True, description="true: the official training and test sets pooled first (PFLlib); false: the training set"
    )


SPLIT_KINDS: dict[str, type[BaseModel]] = {"pooled": PooledSplit, "per_node": NodeHeldOutSplit}
"""`data.split`'s mappings, by `kind` (``pooled`` when it is left out, as before there were two)."""


class DataConfig(_Strict):
    dataset: str = Field(
        "digits",
        description="digits | synthetic | mnist | fashion-mnist | cifar10 | cifar100 | cinic10 | tiny-imagenet,"
        " or your own loader: my_package.data:load or a fedmq.datasets entry point (docs/plugins.md)",
    )
    root: str | None = Field(None, description="folder holding the datasets' files; FEDMQ_DATA_ROOT when unset")
    cache_dir: str | None = Field(
        None, description="decoded arrays are kept here; FEDMQ_CACHE_DIR, else ~/.cache/fedmq, when unset"
    )
    cache: bool = Field(True, description="false: decode the files on every load")
    download: bool = Field(False, description="fetch missing files with torchvision (where it imports)")
    augment: Literal["default", "none"] | AugmentConfig = Field(
        "default", description="default: the dataset's standard (crop 4 + flip for CIFAR-like, none for MNIST)"
    )
    normalize: Literal["dataset", "half", "imagenet", "none"] | NormalizeConfig = Field(
        "dataset", description="dataset: its own train mean/std; half: 0.5/0.5; imagenet; none; or {mean, std}"
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="loader options, e.g. test_fraction (digits), labels (cifar100)"
    )
    validation_fraction: float = Field(
        0.0, ge=0, lt=1, description="held out of the training set (stratified) to pick the final model"
    )
    split: Literal["official"] | PooledSplit | NodeHeldOutSplit = Field(
        "official",
        description="official: the dataset's own training and test sets; {kind: pooled, test_fraction,"
        " seed, evaluate_on}: the FedVLS authors' pooled re-split (see PooledSplit); {kind: per_node,"
        " test_fraction, pool}: each node's part cut 75/25 and the global model tested on the held-out"
        " parts, PFLlib's way (FedSA; see NodeHeldOutSplit)",
    )

    @field_validator("split", mode="before")
    @classmethod
    def _split_choice(cls, value: Any) -> Any:
        """One readable error for a bad split (not one per member of the union)."""
        if isinstance(value, str):
            if value != "official":
                raise PydanticCustomError(
                    "data_choice",
                    "expected official or a mapping with {kinds}",
                    {
                        "kinds": " or ".join(
                            f"kind: {kind} (fields: {', '.join(model.model_fields)})"
                            for kind, model in SPLIT_KINDS.items()
                        )
                    },
                )
            return value
        if isinstance(value, dict):
            kind = value.get("kind", "pooled")
            if kind not in SPLIT_KINDS:
                raise PydanticCustomError(
                    "data_choice",
                    "unknown split kind {kind}; allowed: {allowed}",
                    {"kind": repr(kind), "allowed": ", ".join(SPLIT_KINDS)},
                )
            return _mapping_choice(SPLIT_KINDS[kind], value)
        return value

    @model_validator(mode="after")
    def _validation_beside_the_split(self) -> DataConfig:
        if isinstance(self.split, NodeHeldOutSplit) and self.validation_fraction:
            raise ValueError(
                "validation_fraction does not apply with data.split kind per_node (the nodes' held-out parts are"
                " its test set and every other sample is a node's): leave it at 0"
            )
        return self

    @field_validator("augment", "normalize", mode="before")
    @classmethod
    def _name_or_mapping(cls, value: Any, info: ValidationInfo) -> Any:
        """One readable error for a bad name or a bad mapping (not one per member of the union)."""
        names, model = _DATA_CHOICES[str(info.field_name)]
        if isinstance(value, str):
            if value not in names:
                raise PydanticCustomError(
                    "data_choice",
                    "expected {names} or a mapping with {fields}",
                    {"names": ", ".join(names), "fields": ", ".join(model.model_fields)},
                )
            return value
        if isinstance(value, dict):
            return _mapping_choice(model, value)
        return value


def _mapping_choice(model: type[BaseModel], value: dict[str, Any]) -> BaseModel:
    """`value` validated as `model`, with one readable error naming each problem and the allowed fields."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(map(str, e['loc'])) or '(mapping)'}: "
            + ("unknown field" if e["type"] == "extra_forbidden" else e["msg"])
            for e in exc.errors()
        ]
        raise PydanticCustomError(
            "data_choice",
            "{problems} (allowed fields: {fields})",
            {"problems": "; ".join(problems), "fields": ", ".join(model.model_fields)},
        ) from None


_DATA_CHOICES: dict[str, tuple[tuple[str, ...], type[BaseModel]]] = {
    "augment": (("default", "none"), AugmentConfig),
    "normalize": (("dataset", "half", "imagenet", "none"), NormalizeConfig),
}


class _Partition(_Strict):
    """One kind of split of the training set across nodes (`fedcore.partition`, where each is documented)."""

    seed: int | None = Field(
        None,
        ge=0,
        le=2**32 - 1,
        description="the partition's own seed (default: the experiment's): fixed, every seed of a grid trains on"
        " the same shards, as papers whose trials share one split (FedVLS's code draws it once, NumPy seed 1)",
    )

    def options(self) -> dict[str, Any]:
        """The keyword options of `fedcore.partition.partition` for this kind."""
        return self.model_dump(exclude={"kind", "seed"})

    def seed_for(self, experiment_seed: int) -> int:
        return experiment_seed if self.seed is None else self.seed

    def describe(self) -> str:
        """``kind(param=value, ...)``, for titles and logs."""
        params = ", ".join(f"{k}={v}" for k, v in self.options().items() if v is not None)
        return f"{self.kind}({params})" if params else str(self.kind)  # type: ignore[attr-defined]


class IidPartition(_Partition):
    """Uniform random split; sizes differ by at most one."""

    kind: Literal["iid"] = "iid"


class DirichletPartition(_Partition):
    """Label skew as MOON and KDIA: per class Dir(alpha) over nodes, capped at the average size."""

    kind: Literal["dirichlet"] = "dirichlet"
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration (label skew grows as it shrinks)")
    min_samples: int = Field(10, ge=1, description="every node gets at least this many samples (MOON: 10)")


class BalancedDirichletPartition(_Partition):
    """Label skew with equal node sizes, as FedRCL: per node Dir(alpha) over classes."""

    kind: Literal["dirichlet-balanced"] = "dirichlet-balanced"
    alpha: float = Field(0.3, gt=0, description="Dirichlet concentration (FedRCL: 0.05, 0.1, 0.3, 0.6)")


class ClassesPartition(_Partition):
    """A fixed number of classes per node, as FedSA (PFLlib "pat") or FedVLS."""

    kind: Literal["classes"] = "classes"
    classes_per_node: int = Field(2, ge=1, description="classes each node holds (FedSA: 2/10/20, FedVLS: 0.2 x C)")
    style: Literal["pflib", "fedvls"] = Field("pflib", description="whose assignment and size rule to follow")
    min_samples: int | None = Field(None, ge=1, description="every node gets at least this many; default: the code's")


class ShardsPartition(_Partition):
    """McMahan et al.'s shards (FedRCL's quantity-based skew): sort by label, shards_per_node random shards each."""

    kind: Literal["shards"] = "shards"
    shards_per_node: int = Field(2, ge=1, description="shards per node (FedRCL: 2, 5 for CIFAR-10; 20, 50 for 100)")


class QuantityPartition(_Partition):
    """Quantity skew with IID labels, as NIID-Bench "iid-diff-quantity": node sizes from Dir(beta)."""

    kind: Literal["quantity"] = "quantity"
    beta: float = Field(0.5, gt=0, description="Dirichlet concentration over node sizes (skew grows as it shrinks)")
    min_samples: int = Field(10, ge=1, description="every node gets at least this many samples (NIID-Bench: 10)")


PARTITION_KINDS: dict[str, type[_Partition]] = {
    cls.model_fields["kind"].default: cls
    for cls in (
        IidPartition,
        DirichletPartition,
        BalancedDirichletPartition,
        ClassesPartition,
        ShardsPartition,
        QuantityPartition,
    )
}


def _partition_kind(value: Any) -> str | None:
    """The tag of a partition mapping: its `kind`, ``dirichlet`` when left out (the default before kinds)."""
    if isinstance(value, dict):
        return str(value.get("kind", "dirichlet"))
    return getattr(value, "kind", None)


PartitionConfig = Annotated[
    Annotated[IidPartition, Tag("iid")]
    | Annotated[DirichletPartition, Tag("dirichlet")]
    | Annotated[BalancedDirichletPartition, Tag("dirichlet-balanced")]
    | Annotated[ClassesPartition, Tag("classes")]
    | Annotated[ShardsPartition, Tag("shards")]
    | Annotated[QuantityPartition, Tag("quantity")],
    Discriminator(_partition_kind),
]
"""`partition:` in an experiment file, one of `PARTITION_KINDS` chosen by its `kind`."""


class ModelConfig(_Strict):
    name: str = Field(
        "cnn",
        description="mlp | dnn | cnn | moon-cnn | fedavg-cnn | conv2cifar | resnet18 | resnet34 | resnet32 |"
        " mobilenetv2, or your own nn.Module: my_package.nets:MyNet or a fedmq.models entry point (docs/plugins.md)",
    )
    options: dict[str, Any] = Field(default_factory=dict)


class AggregatorConfig(_Strict):
    name: str = Field(
        "mean",
        description="mean (the method's own weighted mean) | fedsa | clip | median | trimmed_mean"
        " (`fedmq methods` lists each one's options)",
    )
    options: dict[str, Any] = Field(default_factory=dict)


class MethodConfig(_Strict):
    name: str = Field(
        "fedavg",
        description="the algorithm: a built-in one (`fedmq methods`), or your own: a module holding SPEC"
        " (my_package.my_method) or a fedmq.methods entry point (docs/plugins.md)",
    )
    hyperparams: dict[str, Any] = Field(default_factory=dict)
    aggregator: AggregatorConfig = Field(
        default_factory=AggregatorConfig,
        description="the rule that turns client models into one, for any method whose server averages models",
    )


class TrainConfig(
    _section(  # type: ignore[misc]  # a base built at runtime, which mypy cannot follow
        TrainSettings,
        exclude=("dp_noise_multiplier",),  # set from privacy: (experiments.build.train_settings)
    )
):
    """`train:` the nodes' local training (`fedcore.training.TrainSettings`)."""


class PolicyConfig(
    _section(  # type: ignore[misc]  # a base built at runtime, which mypy cannot follow
        RoundPolicy,
        unset={
            "inline_model_bytes": "65536, or 0 with hosting.vectorize (its groups form at the acknowledgements)",
            "min_nodes": "all of them",
        },
    )
):
    """`policy:` who is selected and when a round ends (`coordinator.config.RoundPolicy`)."""

    sample_limits: Literal["partition", "none"] = Field(
        "partition",
        description="partition: a node may announce (and claim in an update) at most its shard of the"
        " experiment's partition, a site its nodes' shards together, so that one node's credentials cannot"
        " take the federation's weight; none: only max_node_samples bounds the counts (nodes that bring"
        " their own data with `fedmq node --data`: set max_node_samples then)",
    )


class BusSettings(
    _section(  # type: ignore[misc]  # a base built at runtime, which mypy cannot follow
        BusConfig,
        include=(
            "protocol",
            "chunk_bytes",
            "max_message_bytes",
            "keepalive_s",
            "transfer_timeout_s",
            "tune_allocator",
            "plaintext_credentials",
        ),
    )
):
    """`bus:` the transfer settings of every client (`broker.BusConfig`); the broker's address and
    credentials come from the command line."""

    @model_validator(mode="after")
    def _together(self) -> BusSettings:
        BusConfig(**dict(self))  # the rules between settings: a chunk leaves room for its headers
        return self


class FaultConfig(_section(Faults, types={"delay_rounds": list[int] | None})):  # type: ignore[misc]
    """A node's injected faults (`fednode.scenario.Faults`), for experiments: a preset of its scenario
    script (`experiments.build.node_scripts`), with the same meaning in the daemons and in simulation."""


class HostingConfig(_Strict):
    processes: int | None = Field(None, ge=1, description="node-host processes for `fedmq run`; default: cores")
    threads_per_process: int = Field(1, ge=1, description="torch threads per process (fixed for determinism)")
    vectorize: bool = Field(
        False,
        description="train a process's nodes of the same task together, as one vectorised computation (the"
        " methods with a group form: FedAvg, FedAvgM, FedSA, FedDisco, FedProx, FedLC, FedRS, FedNTD, FedGKD, MOON,"
        " FedVLS, FedRCL, FedDecorr, FedDyn, SCAFFOLD (options I and II), FedProto, FedNH, KDIA, FedACD,"
        " docs/simulation.md; no BatchNorm): equal to one-by-one training within float tolerance, so a run is"
        " then reproducible from its seed only within that tolerance",
    )
    vectorize_wait_s: float = Field(
        2.0, gt=0, description="how long a group waits for its nodes' models; a later one trains alone"
    )
    host_memory: HostMemory = Field(
        "system",
        description="what a node process does with the host memory it frees: system (the default: the C"
        " library's own policy, which hands large freed tensors back to the kernel between tasks) or keep"
        " (glibc keeps it for the next tensors, as `fedmq simulate` does by default: no page faults for a"
        " large model's tensors at every step, and the process's peak heap kept until it ends);"
        " simulation.host_memory says more",
    )


class SimulationConfig(_Strict):
    """`fedmq simulate`'s own settings: how it trains a round's nodes in its one process (and `fedmq
    replay` with it), and how often it leaves a checkpoint to resume from."""

    vectorize: Literal["auto"] | bool = Field(
        "auto",
        description="train each round's selected nodes (each async wave's) as one vectorised computation where"
        " the method allows (every built-in method;"
        " fedcore.vectorized; equal to one by one within float tolerance): true, false, or"
        " auto (true with a CUDA device, where it is several times faster; false on a CPU, where one by one is"
        " as fast and bitwise equal to the daemons)",
    )
    graphs: Literal["auto"] | bool = Field(
        "auto",
        description="capture each vectorised step (and KDIA's generator step) as a CUDA graph: auto (with a CUDA"
        " device), true, false",
    )
    pipeline: Literal["auto"] | bool = Field(
        "auto",
        description="draw each vectorised round's plan (batches, augmentation, an objective's draws) in chunks as"
        " its steps need them, so that the host draws while the GPU trains the steps before: auto (with a CUDA"
        " device), true, false (all of it before the first step); bitwise the same results",
    )
    outputs_ahead: Literal["auto"] | bool = Field(
        "auto",
        description="make each vectorised step's augmented batch (crop, flip, normalisation), and what a method's"
        " objective reads of a frozen model on it (KDIA's and FedGKD's teachers, the global model of FedNTD, FedVLS"
        " and MOON, MOON's previous models), for a chunk of steps before they run, so that a step launches none of"
        " those kernels: auto (with a CUDA device), true, false (inside each step: what a CPU does under auto); the"
        " same batches bit for bit, and the frozen outputs within float rounding",
    )
    reuse_rounds: bool = Field(
        False,
        description="keep each vectorised group's round, its buffers and on a GPU its captured CUDA graphs, for"
        " the next group of the same shape (every built-in method that trains in groups; a decayed lr is the same"
        " shape), so that later rounds replay the graphs with no warm-up steps and no capture; bitwise the same"
        " results (the summary's rounds_kept counts them)",
    )
    cudnn: Literal["deterministic", "default", "benchmark"] = Field(
        "deterministic",
        description="how cuDNN chooses a GPU's convolution algorithms in the simulating process: deterministic"
        " (the default: the same seed gives the same bits, and `fedmq replay` on a GPU reproduces the run),"
        " default (cuDNN's own choice) or benchmark (the fastest found by timing each shape once); the last two"
        " may sum with atomics in no fixed order, so such a run differs in its last bits from one run to the next"
        " and does not replay bit for bit on a GPU (`fedmq bench sim` on a GPU measures what deterministic"
        " algorithms cost); no effect on a CPU",
    )
    host_memory: HostMemory = Field(
        "keep",
        description="what the simulating process does with the host memory it frees: keep (the default: glibc"
        " serves every allocation from its heap and keeps what is freed for the next, so that a round's large"
        " tensors do not fault their pages in again at every step; the process keeps its peak heap until it"
        " ends) or system (the C library's own policy: allocations above its mmap threshold, at most 32 MiB, are"
        " mapped afresh and unmapped when freed); fedcore.host_memory; the same bits either way, and nothing"
        " is done where the C library has no mallopt",
    )
    checkpoint_every: int = Field(
        10,
        ge=0,
        description="`fedmq simulate` checkpoints every this many rounds (at a round's end with no update in"
        " flight, else at the next such end) so that `--resume` continues a cut-off run; 0: never",
    )

    def vectorizes(self, device_type: str) -> bool:
        """Whether nodes train vectorised on a device of this type ("cuda", "cpu")."""
        return vectorizes_by_default(device_type) if self.vectorize == "auto" else bool(self.vectorize)

    def graph_mode(self) -> str:
        """`graphs` as fedcore.vectorized.train_vectorized takes it."""
        return _mode(self.graphs)

    def pipeline_mode(self) -> str:
        """`pipeline` as fedcore.round_plan.plan_pipeline takes it."""
        return _mode(self.pipeline)

    def outputs_ahead_mode(self) -> str:
        """`outputs_ahead` as fedcore.round_plan.outputs_ahead takes it."""
        return _mode(self.outputs_ahead)


def _mode(setting: Literal["auto"] | bool) -> str:
    """A setting of auto, true or false as fedcore.vectorized's modes spell it: auto, on, off."""
    return "auto" if setting == "auto" else ("on" if setting else "off")


class StalenessConfig(
    _section(  # type: ignore[misc]  # a base built at runtime, which mypy cannot follow
        Staleness,
        bounds={"a": Bounds(gt=0)},  # for every function, where Staleness asks it only of those that use a
    )
):
    """s(tau), the weight of an update tau model versions old (`fedcore.staleness`)."""


class EngineConfig(
    _section(  # type: ignore[misc]  # a base built at runtime, which mypy cannot follow
        AsyncPolicy,
        before={"kind": (CoordinatorConfig, "engine")},
        types={"staleness": StalenessConfig},
    )
):
    """How the coordinator turns updates into models: synchronous rounds, or buffered asynchronous
    aggregation (`coordinator.config.AsyncPolicy`)."""


class CompressionConfig(_section(Compression)):  # type: ignore[misc]  # a base built at runtime
    """How nodes compress their updates for thin links (`fedcore.compression`, docs/compression.md);
    the coordinator decodes them and refuses any other compression."""

    def compression(self) -> Compression:
        return Compression(**dict(self))


NODE_DP_METHODS = frozenset({"fedavg", "fedavgm"})
"""Methods whose node trains `local_sgd` on the plain cross-entropy, which Opacus's per-sample
gradients cover whole (a proximal or distillation term would be left out of them)."""


class SecureAggregationConfig(_Strict):
    """SecAgg+ (Bell et al. 2020; docs/privacy.md#secure-aggregation): each node masks its update so
    that the coordinator (and the broker) can unmask only the sum of those that arrived."""

    neighbours: int = Field(
        0,
        ge=0,
        le=100_000,
        description="each node's neighbours in the masking graph (SecAgg+: a few dozen keep the cost logarithmic);"
        " 0: every other participant (SecAgg)",
    )
    threshold: float = Field(
        0.5,
        gt=0,
        le=1,
        description="the share of a node's neighbours whose shares recover its secrets: a node's mask survives"
        " fewer colluders than this, and the sum survives fewer dropouts among its neighbours than the rest",
    )
    clip: float = Field(
        8.0,
        gt=0,
        le=1e6,
        description="each entry of a node's weighted change from the global model is clipped to [-clip, clip]"
        " before 32-bit fixed-point quantisation (resolution clip / 2^30)",
    )
    timeout_s: float = Field(
        30.0, gt=0, le=86_400, description="how long each step (keys, shares, reveals) waits for the nodes"
    )

    def settings(self) -> SecAggSettings:
        from fedmq.fedcore.secagg import SecAggSettings

        return SecAggSettings(neighbours=self.neighbours, threshold=self.threshold, clip=self.clip)


class PrivacyConfig(_Strict):
    """Differential privacy of the released models (docs/privacy.md; `fedcore.privacy`)."""

    secure_aggregation: SecureAggregationConfig | None = Field(
        None,
        description="mask the updates so that the coordinator sees only their sum ({} for the defaults; default:"
        " updates in clear)",
    )

    mechanism: Literal["none", "central", "node"] = Field(
        "none",
        description="central: DP-FedAvg (McMahan et al. 2018): each update's change clipped to clip_norm, Gaussian"
        " noise of noise_multiplier x clip_norm on the sum, divided by the cohort; node: DP-SGD on every node"
        " (Abadi et al. 2016, Opacus): each sample's gradient clipped to clip_norm, noise on each batch's sum;"
        " epsilon reported each round",
    )
    noise_multiplier: float = Field(1.0, gt=0, le=1000, description="z: the noise in units of clip_norm")
    clip_norm: float = Field(1.0, gt=0, description="S: the largest L2 norm of an update's change that is kept")
    delta: float | None = Field(
        None, gt=0, lt=1, description="the delta epsilon is reported for; default a tenth of 1 / nodes"
    )
    target_epsilon: float | None = Field(
        None,
        gt=0,
        description="stop the run after the last round whose epsilon stays at or below this (the rounds are cut,"
        " and the run says so when it starts)",
    )
    adaptive_clipping: bool = Field(
        False,
        description="Andrew et al. 2021: clip_norm is where the norm starts; each round it moves toward the"
        " target_quantile of the updates' norms, estimated with count_noise (part of the privacy budget)",
    )
    target_quantile: float = Field(0.5, gt=0, lt=1, description="the share of updates left unclipped")
    clip_learning_rate: float = Field(0.2, gt=0, description="the geometric step of the clip norm")
    count_noise: float | None = Field(
        None, gt=0, description="the noise on the count of unclipped updates; default cohort / 20"
    )

    def resolved_delta(self, nodes: int) -> float:
        """The delta epsilon is reported for: the file's, or `fedcore.privacy.default_delta`."""
        from fedmq.fedcore.privacy import default_delta

        return self.delta if self.delta is not None else default_delta(nodes)

    def central(self, nodes: int, fraction: float, seed: int) -> CentralDP | None:
        """The mechanism's settings for a federation of `nodes` selecting `fraction` a round; None without."""
        if self.mechanism != "central":
            return None
        from fedmq.fedcore.privacy import CentralDP

        return CentralDP(
            noise_multiplier=self.noise_multiplier,
            clip_norm=self.clip_norm,
            delta=self.resolved_delta(nodes),
            cohort=max(1, math.floor(fraction * nodes + 1e-9)),
            nodes=nodes,
            seed=seed,
            adaptive=self.adaptive_clipping,
            target_quantile=self.target_quantile,
            clip_learning_rate=self.clip_learning_rate,
            count_noise=self.count_noise,
        )


class HierarchyConfig(_Strict):
    """Hierarchical aggregation (docs/hierarchy.md): the nodes are split into sites, each behind an
    aggregator (`fedmq aggregator`) that sends the coordinator one partial update per round."""

    sites: int = Field(0, ge=0, le=1000, description="sites the nodes are split among, in node order (0: flat)")
    site_deadline: float = Field(
        0.8,
        gt=0,
        lt=1,
        description="a site round closes at this fraction of deadline_s, so that its partial reaches the"
        " coordinator before the round does",
    )
    workers: int = Field(
        1, ge=1, le=16, description="aggregator processes per site, sharing its rounds (MQTT v5 shared subscription)"
    )
    bridge: bool = Field(
        True,
        description="`fedmq run`: a mosquitto per site, bridged to the central one (nodes reach only their site's);"
        " false: every site on the one broker",
    )

    def site_names(self) -> list[str]:
        return [f"site-{i}" for i in range(self.sites)]


DROP_LAST_REFUSED = {
    "kdia": "the generated labels of each batch",
    "fedacd": "the steps of an epoch for its estimate",
    "fedproto": "the first step of the last epoch, where its prototypes are recorded",
}
"""Methods whose node counts `local_sgd`'s batches without `drop_last`, and what it counts."""


MOVED_TO_POLICY = frozenset({"fraction", "deadline_s"})
"""Settings once at the top of the experiment file, now in `policy:` (the old spelling is still read)."""


class ExperimentConfig(_Strict):
    name: str = Field(..., min_length=1, max_length=48, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
    federation: str | None = Field(None, description="topic namespace; `fedmq run` makes a unique one")
    seed: int = 0
    nodes: int = Field(..., ge=1, le=100_000)
    rounds: int | None = _field(CoordinatorConfig, "rounds", unset="only with engine.kind async (required otherwise)")
    eval_every: int = _field(CoordinatorConfig, "eval_every")
    eval_last: int = _field(CoordinatorConfig, "eval_last")
    data: DataConfig = Field(default_factory=DataConfig)
    partition: PartitionConfig = Field(default_factory=DirichletPartition)
    model: ModelConfig = Field(default_factory=ModelConfig)
    method: MethodConfig = Field(default_factory=MethodConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    bus: BusSettings = Field(default_factory=BusSettings)
    faults: dict[str, FaultConfig] = Field(default_factory=dict, description="per node id, for experiments")
    hosting: HostingConfig = Field(default_factory=HostingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    scenario: ScenarioConfig | None = Field(
        None, description="what happens to the nodes over time (docs/scenarios.md); a file is read inline"
    )
    compression: CompressionConfig = Field(
        CompressionConfig(),
        description="update compression for thin links (default: none)",
    )
    hierarchy: HierarchyConfig = Field(
        HierarchyConfig(), description="site aggregators between the nodes and the coordinator (default: none)"
    )
    simulation: SimulationConfig = Field(
        SimulationConfig(),
        description="how `fedmq simulate` trains a round's nodes (vectorised on a GPU) and checkpoints",
    )
    privacy: PrivacyConfig = Field(
        PrivacyConfig(),
        description="differential privacy of the released models (default: none; docs/privacy.md)",
    )

    @model_validator(mode="before")
    @classmethod
    def _policy_moved(cls, data: Any) -> Any:
        """The old spelling, ``fraction`` and ``deadline_s`` at the top of the file, read as the policy's
        (with a warning that says what to write); set in both places, it is an error."""
        if not isinstance(data, dict) or not MOVED_TO_POLICY & data.keys():
            return data
        policy = {} if data.get("policy") is None else data["policy"]
        if not isinstance(policy, dict):
            return data  # the policy's own error says what is wrong with it
        data, policy = dict(data), dict(policy)
        for name in sorted(MOVED_TO_POLICY & data.keys()):
            if name in policy:
                raise ValueError(f"{name} is set at the top level and as policy.{name}: keep policy.{name} only")
            policy[name] = data.pop(name)
            warnings.warn(
                f"{name} at the top of the experiment file is deprecated: write it as policy.{name}",
                FutureWarning,
                stacklevel=2,
            )
        data["policy"] = policy
        return data

    @property
    def fraction(self) -> float:
        """C, the share of the nodes selected a round (`policy.fraction`)."""
        return self.policy.fraction

    @property
    def deadline_s(self) -> float:
        """When a round closes with what it has (`policy.deadline_s`)."""
        return self.policy.deadline_s

    @field_validator("faults")
    @classmethod
    def _fault_ids(cls, value: dict[str, FaultConfig]) -> dict[str, FaultConfig]:
        for node_id in value:
            if not node_id.startswith("node-"):
                raise ValueError(f"fault key {node_id!r} is not a node id like 'node-003'")
        return value

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> ExperimentConfig:
        ids = set(self.node_ids())
        unknown = sorted(set(self.faults) - ids)
        if unknown:
            raise ValueError(f"faults name nodes that do not exist: {unknown} (ids are node-000 .. {max(ids)})")
        if self.scenario is not None:
            # a ConfigError naming the unknown ids, at their lines when parse_config knows the files
            sources = (info.context or {}).get("sources")
            self.scenario.check(ids, sources, ("scenario",) if sources is not None else ())
        if self.policy.min_nodes is not None and self.policy.min_nodes > self.nodes:
            raise ValueError(f"policy.min_nodes {self.policy.min_nodes} exceeds nodes {self.nodes}")
        if self.engine.kind == "sync" and self.rounds is None:
            raise ValueError(
                "rounds: required for synchronous rounds (or set engine.kind: async and engine.aggregations)"
            )
        if self.train.drop_last and self.method.name in DROP_LAST_REFUSED:
            raise ValueError(
                f"train.drop_last: {self.method.name} counts local_sgd's batches itself"
                f" ({DROP_LAST_REFUSED[self.method.name]}) and does not know drop_last yet; leave it false"
            )
        if self.hierarchy.sites:
            if self.hierarchy.sites > self.nodes:
                raise ValueError(f"hierarchy.sites {self.hierarchy.sites} exceeds nodes {self.nodes}")
            if self.compression.mode != "none":
                raise ValueError(
                    "hierarchy: site aggregators do not relay compressed updates yet; set compression.mode: none"
                )
        if self.privacy.mechanism != "none":
            self._check_privacy()
        if self.privacy.secure_aggregation is not None:
            why = self._secure_refusal()
            if why is not None:
                raise ValueError(f"privacy.secure_aggregation: {why}")
        if self.engine.kind == "sync":
            from fedmq.fedcore.aggregation.robust import ineffective

            # the updates a round aggregates: C x N of the nodes, or one partial per site
            cohort = self.hierarchy.sites or max(1, math.floor(self.fraction * self.nodes + 1e-9))
            why = ineffective(self.method.aggregator.name, self.method.aggregator.options, cohort)
            if why is not None:
                raise ValueError(
                    f"method.aggregator: {why}; or select more nodes a round (fraction x nodes = {cohort})"
                )
        if self.engine.kind == "async" or self.policy.late_updates == "carry":
            from fedmq.fedcore.algorithms import async_refusal

            reason = async_refusal(self.method.name, self.method.aggregator.name)
            what = "engine.kind async" if self.engine.kind == "async" else "policy.late_updates carry"
            if reason is not None:
                raise ValueError(f"{what}: {self.method.name} cannot fold stale updates: {reason}")
        return self

    def _check_privacy(self) -> None:
        """Central DP replaces the averaging of synchronous rounds, node DP the nodes' SGD; what either
        cannot cover is refused here, with what both need (a delta below 1 / nodes, Opacus)."""
        mechanism = self.privacy.mechanism
        why = self._central_refusal() if mechanism == "central" else self._node_refusal()
        if why is None and self.privacy.delta is not None and self.privacy.delta >= 1 / self.nodes:
            why = f"delta {self.privacy.delta:g} is not below 1 / nodes ({1 / self.nodes:g}): it could release a node"
        if why is None and importlib.util.find_spec("opacus") is None:
            why = "it needs Opacus (its accountant and DP-SGD), which is not installed (pip install 'fedmq[privacy]')"
        if why is not None:
            raise ValueError(f"privacy.mechanism {mechanism}: {why}")
        if mechanism == "central":
            self._check_target_epsilon()

    def _central_refusal(self) -> str | None:
        if self.engine.kind != "sync" or self.policy.late_updates == "carry":
            return (
                "it is for synchronous rounds, each aggregating its own updates (engine.kind sync, late_updates drop)"
            )
        if self.method.aggregator.name != "mean":
            return f"it replaces the averaging rule, and method.aggregator is {self.method.aggregator.name!r}"
        if self.hierarchy.sites:
            return "site aggregators would see and sum the updates before the noise (hierarchy.sites must be 0)"
        return None

    def _secure_refusal(self) -> str | None:
        """What secure aggregation cannot run with: anything that must see one node's update."""
        cohort = max(1, math.floor(self.fraction * self.nodes + 1e-9))
        if self.engine.kind != "sync" or self.policy.late_updates == "carry":
            return (
                "it unmasks one attempt's updates together, so it is for synchronous rounds whose late updates"
                " are dropped (engine.kind sync, policy.late_updates drop)"
            )
        if self.method.aggregator.name != "mean":
            return (
                f"method.aggregator {self.method.aggregator.name!r} must see each update to weigh it against the"
                " others, which the masks hide; secure aggregation sums them (aggregator mean)"
            )
        if self.privacy.mechanism == "central" and self.privacy.adaptive_clipping:
            return (
                "adaptive clipping needs the count of updates under the clip norm, which the masks hide"
                " (with fixed clipping, the nodes clip and the coordinator adds the noise to the sum)"
            )
        if self.hierarchy.sites:
            return "site aggregators would unmask their nodes' updates (hierarchy.sites must be 0)"
        if self.compression.mode != "none":
            return "masked integers do not compress (compression.mode must be none)"
        if cohort < 3:
            return f"a round selects {cohort} node(s) (fraction x nodes); it takes at least 3 to hide one in the sum"
        return None

    def _node_refusal(self) -> str | None:
        if self.method.name not in NODE_DP_METHODS:
            return (
                f"method {self.method.name!r} trains on its own objective, whose terms outside the model's layers"
                f" Opacus's per-sample gradients would drop; node DP-SGD is for {', '.join(sorted(NODE_DP_METHODS))}"
            )
        if self.train.max_grad_norm is not None:
            return "each sample's gradient is clipped to privacy.clip_norm: leave train.max_grad_norm unset"
        if self.simulation.vectorize is True or self.hosting.vectorize:
            return (
                "vectorised training has no per-sample clipping: leave simulation.vectorize and hosting.vectorize off"
            )
        if self.privacy.target_epsilon is not None or self.privacy.adaptive_clipping:
            return "target_epsilon and adaptive_clipping are for the central mechanism"
        return None

    def _check_target_epsilon(self) -> None:
        try:
            central = self.privacy.central(self.nodes, self.fraction, self.seed)
        except ValueError as exc:
            raise ValueError(f"privacy: {exc}") from None
        target = self.privacy.target_epsilon
        if central is not None and target is not None and central.rounds_within(target) == 0:
            raise ValueError(
                f"privacy.target_epsilon {target:g}: one round already spends epsilon {central.epsilon(1):.3g}"
                f" (delta {central.delta:g}); raise noise_multiplier or the target"
            )

    @property
    def steps(self) -> int:
        """What the run counts to: rounds (sync) or model versions (async); with privacy.target_epsilon,
        no more rounds than stay within it."""
        if self.engine.kind == "async":
            return self.engine.aggregations
        rounds = int(self.rounds or 0)
        central = self.privacy.central(self.nodes, self.fraction, self.seed)
        if central is not None and self.privacy.target_epsilon is not None:
            return min(rounds, central.rounds_within(self.privacy.target_epsilon))
        return rounds

    @property
    def step_name(self) -> str:
        return "version" if self.engine.kind == "async" else "round"

    def node_ids(self) -> list[str]:
        width = max(3, len(str(self.nodes - 1)))
        return [f"node-{i:0{width}d}" for i in range(self.nodes)]

    def site_nodes(self) -> dict[str, list[str]]:
        """Each site's node ids (hierarchical mode): the nodes split evenly, in order; {} when flat."""
        names = self.hierarchy.site_names()
        return dict(zip(names, split_evenly(self.node_ids(), len(names)), strict=True)) if names else {}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def split_evenly(items: list[str], parts: int) -> list[list[str]]:
    """`items` in order, in at most `parts` runs whose sizes differ by one at most (node hosts, sites)."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def _tagged(annotation: Any) -> dict[str, Any]:
    """The members of a union tagged by `kind` (the partition kinds), by kind; {} for anything else."""
    members: dict[str, Any] = {}
    if get_origin(annotation) is not Union:
        return members
    for arg in get_args(annotation):
        member = get_args(arg)[0] if get_origin(arg) is Annotated else arg
        if isinstance(member, type) and issubclass(member, BaseModel) and "kind" in member.model_fields:
            members[str(member.model_fields["kind"].default)] = member
    return members


def _problem(error: Mapping[str, Any], model: type[BaseModel]) -> tuple[Loc, str]:
    """A pydantic error as (the path shown, the message)."""
    # walk the location through the models; a union tag (``partition.dirichlet.alpha``) picks the
    # member and is left out of the location shown
    parent: Any = model
    shown: list[str] = []
    for i, part in enumerate(error["loc"]):
        members = _tagged(parent)
        if str(part) in members:
            parent = members[str(part)]
            continue
        shown.append(str(part))
        if i < len(error["loc"]) - 1:
            is_model = isinstance(parent, type) and issubclass(parent, BaseModel)
            field = parent.model_fields.get(str(part)) if is_model else None
            parent = field.annotation if field is not None else None
    loc = tuple(shown)
    if error["type"] == "extra_forbidden":
        allowed = sorted(parent.model_fields) if isinstance(parent, type) and issubclass(parent, BaseModel) else []
        kind = f" for kind {parent.model_fields['kind'].default!r}" if "kind" in allowed else ""
        return loc, f"unknown field{kind}" + (f"; allowed here: {', '.join(allowed)}" if allowed else "")
    kinds = ", ".join(PARTITION_KINDS)
    if error["type"] == "union_tag_invalid" and loc == ("partition",):
        return ("partition", "kind"), f"unknown kind {error['ctx']['tag']!r}; allowed: {kinds}"
    if error["type"] == "union_tag_not_found" and loc == ("partition",):
        return loc, f"expected a mapping with a kind (got {error.get('input')!r}); kinds: {kinds}"
    value = error.get("input")
    got = f" (got {value!r})" if not isinstance(value, dict) and value is not None else ""
    return loc, f"{error['msg']}{got}"


def _written_at(loc: Loc, data: Any) -> Loc:
    """Where in the file a setting's value was written: the policy's settings in their old spelling at
    the top of the file (`_policy_moved`) are found there."""
    moved = len(loc) >= 2 and loc[0] == "policy" and loc[1] in MOVED_TO_POLICY
    return loc[1:] if moved and isinstance(data, dict) and loc[1] in data else loc


def parse_config(data: Any, *, source: str = "config", sources: SourceMap | None = None) -> ExperimentConfig:
    """The validated experiment; a ConfigError names each bad setting, and with `sources` (where the
    data was read from: `read_yaml_sourced`) the file and line it was written on, or the ``--set``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: an experiment file is a YAML mapping, got {type(data).__name__}")
    sources = sources or SourceMap()
    try:
        return ExperimentConfig.model_validate(data, context={"sources": sources})
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            loc, message = _problem(error, ExperimentConfig)
            where = sources.where(_written_at(loc, data), data)
            lines.append(f"{where + ': ' if where else ''}{dotted(loc)}: {message}")
        raise ConfigError(f"{source} is invalid:\n  " + "\n  ".join(lines)) from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``key.sub=value`` pairs from the command line; values are parsed as YAML scalars."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set rounds=5")
        set_path(data, key, yaml.safe_load(raw), where=f"--set {item!r}")
    return data


def override_sources(sources: SourceMap, overrides: list[str]) -> SourceMap:
    """`sources` after `apply_overrides`: each ``--set`` key's value now comes from that ``--set``."""
    for item in overrides:
        sources = sources.set(key_path(item.partition("=")[0]), f"--set {item!r}")
    return sources


def key_path(key: str) -> tuple[str, ...]:
    """Where `set_path` puts a dotted key (an old spelling in today's place), without its warning."""
    return tuple(_current_key(key).split("."))


def moved_key(key: str) -> str:
    """A setting's key as it is written now: ``fraction`` and ``deadline_s`` (a ``--set``, a grid axis, an
    override), once at the top of the file, are the policy's, read with a warning that says so."""
    if key in MOVED_TO_POLICY:
        warnings.warn(f"{key} is deprecated: write policy.{key}", FutureWarning, stacklevel=3)
    return _current_key(key)


def _current_key(key: str) -> str:
    return f"policy.{key}" if key in MOVED_TO_POLICY else key


def set_path(data: dict[str, Any], key: str, value: Any, *, where: str) -> None:
    """Set ``a.b.c`` in nested maps, creating the sections on the way."""
    node = data
    parts = moved_key(key).split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{where}: {part} is not a section of the config")
    node[parts[-1]] = value


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The experiment file as a mapping; a clear ConfigError for an unreadable or non-mapping file.

    ``extends: OTHER.yaml`` (relative to the file) starts from another experiment file: maps merge
    key by key, anything else (lists, values) is replaced, and so is each grid axis the file names
    (``axis: null`` removes one), and so is the report's table of paper figures.
    A reduced-scale config says only what it reduces.
    """
    return read_yaml_sourced(path)[0]


def read_yaml_sourced(path: str | Path, *, _seen: tuple[Path, ...] = ()) -> tuple[dict[str, Any], SourceMap]:
    """`read_yaml`, and where each value was written (this file over those it extends, a scenario
    file at ``scenario``), for `parse_config` to name the file and line of a bad one."""
    path = Path(path)
    document = read_yaml_file(path, "experiment file")
    data = document.data
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: an experiment file is a YAML mapping, got {type(data).__name__}")
    sources = SourceMap.of(document)
    if "scenario" in data:  # a scenario file (and its trace) relative to this file, read inline
        data["scenario"], scenario_sources = resolve_scenario_sourced(data["scenario"], path.parent)
        sources = scenario_sources.mounted(("scenario",)).over(sources)
    parent = data.pop("extends", None)
    if parent is None:
        return data, sources
    where = sources.where(("extends",)) or str(path)
    if not isinstance(parent, str):
        raise ConfigError(f"{where}: extends names one experiment file, got {parent!r}")
    base_path = (path.parent / parent).resolve()
    if base_path in _seen or base_path == path.resolve():
        raise ConfigError(f"{where}: extends {parent} makes a cycle")
    base, base_sources = read_yaml_sourced(base_path, _seen=(*_seen, path.resolve()))
    return merge(base, data), sources.over(base_sources)


_IDENTITY = ("name", "kind", "dataset")


def merge(base: dict[str, Any], changes: dict[str, Any], *, _path: tuple[str, ...] = ()) -> dict[str, Any]:
    """`base` updated by `changes`, recursively for maps. Replaced whole instead: a grid axis, and a
    section that names another model, method, partition kind or dataset (its options would not fit)."""
    out = dict(base)
    for key, value in changes.items():
        if _path == ("grid",) and value is None:
            out.pop(key, None)  # `axis: null` removes an axis the parent file varies
            continue
        old = out.get(key)
        if (
            isinstance(value, dict)
            and isinstance(old, dict)
            and _path != ("grid",)
            and (*_path, key) != ("report", "paper")  # another table's figures: all replaced
            and not any(k in value and k in old and value[k] != old[k] for k in _IDENTITY)
        ):
            out[key] = merge(old, value, _path=(*_path, key))
        else:
            out[key] = value
    return out


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """One experiment (the daemons' view); a file with a grid is loaded with `experiments.grid`."""
    data, sources = read_yaml_sourced(path)
    if overrides:
        data = apply_overrides(data, overrides)
        sources = override_sources(sources, overrides)
    if "grid" in data or "report" in data:
        raise ConfigError(
            f"{path} declares a grid or report: run it with `fedmq run`, which gives each cell's own config"
            " to the daemons"
        )
    return parse_config(data, source=str(path), sources=sources)
