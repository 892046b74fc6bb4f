"""From an experiment config to running parts: data shards, models, algorithm halves, daemons.

The only place where names in a config (dataset, model, method) become objects.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedmq.aggregator import SiteAggregator, SiteCoordinator, SiteTrainer, no_data
from fedmq.broker import BusConfig
from fedmq.broker.servers.credentials import COORDINATOR, Access, Credentials
from fedmq.broker.topics import check_id
from fedmq.coordinator.config import INLINE_MODEL_BYTES, AsyncPolicy, CoordinatorConfig, RoundPolicy
from fedmq.coordinator.drivers.mqtt import Coordinator
from fedmq.coordinator.engine.relay import ENDLESS
from fedmq.coordinator.observers.reporting import Evaluator
from fedmq.coordinator.storage.persistence import Persistence
from fedmq.coordinator.storage.run_dir import RunDir
from fedmq.experiments.config import ExperimentConfig, NodeHeldOutSplit, PooledSplit
from fedmq.experiments.scenario import expand as expand_scenario
from fedmq.fedcore.aggregation import build_aggregator
from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm
from fedmq.fedcore.algorithms.base import CoordinatorHalf
from fedmq.fedcore.data import (
    Split,
    TensorDataset,
    held_out_by_node,
    hold_out_validation,
    load_dataset,
    load_local,
    pooled_resplit,
    pooled_sets,
)
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.host_memory import set_host_memory
from fedmq.fedcore.models import build_model
from fedmq.fedcore.partition import label_histograms, partition
from fedmq.fedcore.privacy import DPFedAvg
from fedmq.fedcore.seeding import deterministic_kernels, torch_seed
from fedmq.fedcore.staleness import Staleness
from fedmq.fedcore.training import TrainSettings, best_device
from fedmq.fednode.config import NodeConfig
from fedmq.fednode.daemon import NodeDaemon
from fedmq.fednode.scenario import Faults, NodeScript
from fedmq.fednode.workspace import Workspace

logger = logging.getLogger(__name__)


def bus_config(cfg: ExperimentConfig, url: str, credentials: Credentials | None = None) -> BusConfig:
    """The experiment's bus settings for one identity, with its credentials (a password never has to be
    in the URL: `broker.servers.credentials`)."""
    try:
        return BusConfig.from_url(
            url, **(credentials.bus_overrides() if credentials is not None else {}), **dict(cfg.bus)
        )
    except ValueError as exc:
        raise ConfigError(str(exc), field="--broker") from None


def inline_model_bytes(cfg: ExperimentConfig) -> int:
    """The policy's, or by default `INLINE_MODEL_BYTES`; 0 with vectorised hosting, whose groups are
    the nodes that acknowledged a task before its model came (an inline model comes with the task)."""
    if cfg.policy.inline_model_bytes is not None:
        return cfg.policy.inline_model_bytes
    return 0 if cfg.hosting.vectorize else INLINE_MODEL_BYTES


def federation_id(cfg: ExperimentConfig) -> str:
    return cfg.federation or cfg.name


def data_root(cfg: ExperimentConfig) -> Path | None:
    """``data.root``, else the environment variable FEDMQ_DATA_ROOT, else None (loaders then say what to set)."""
    root = cfg.data.root or os.environ.get("FEDMQ_DATA_ROOT")
    return Path(root).expanduser() if root else None


def cache_dir(cfg: ExperimentConfig) -> Path | None:
    """``data.cache_dir``, else FEDMQ_CACHE_DIR, else ~/.cache/fedmq; None when ``data.cache`` is false."""
    if not cfg.data.cache:
        return None
    return Path(cfg.data.cache_dir or os.environ.get("FEDMQ_CACHE_DIR") or "~/.cache/fedmq").expanduser()


def _preprocessing(cfg: ExperimentConfig) -> dict[str, object]:
    """The data's augmentation and normalisation choices and loader options, as `load_dataset` takes them."""
    d = cfg.data
    reserved = sorted({"seed", "root", "cache_dir", "download", "augment", "normalize"} & set(d.options))
    if reserved:
        raise ConfigError(f"{reserved} are fields of data, not loader options", field="data.options")
    augment = d.augment if isinstance(d.augment, str) else d.augment.model_dump()
    normalize = d.normalize if isinstance(d.normalize, str) else d.normalize.model_dump()
    return {"augment": augment, "normalize": normalize, **d.options}


def load_split(cfg: ExperimentConfig) -> Split:
    """The experiment's dataset with its augmentation and normalisation, from the resolved data root and
    cache; re-split as ``data.split`` says, then with ``data.validation_fraction`` held out."""
    d = cfg.data
    split = load_dataset(
        d.dataset,
        seed=cfg.seed,
        root=data_root(cfg),
        cache_dir=cache_dir(cfg),
        download=d.download,
        **_preprocessing(cfg),  # type: ignore[arg-type]
    )
    if isinstance(d.split, PooledSplit):  # the FedVLS authors' pooled re-split
        split = pooled_resplit(
            split, test_fraction=d.split.test_fraction, seed=d.split.seed, evaluate_on=d.split.evaluate_on
        )
    elif isinstance(d.split, NodeHeldOutSplit):  # PFLlib's: the test set cut from each node's part
        data = pooled_sets(split) if d.split.pool else split.train
        parts = _partition(cfg, data.y.numpy())
        seed = cfg.partition.seed_for(cfg.seed)
        split = held_out_by_node(data, parts, test_fraction=d.split.test_fraction, seed=seed)
    return hold_out_validation(split, d.validation_fraction, seed=cfg.seed) if d.validation_fraction else split


def load_node_data(cfg: ExperimentConfig, path: Path) -> TensorDataset:
    """A node's own data (`fedmq node --data PATH`) in place of its shard: checked against the experiment's
    dataset (input shape, classes), with the same transforms; neither the dataset nor its partition is loaded."""
    return load_local(path, cfg.data.dataset, **_preprocessing(cfg))  # type: ignore[arg-type]


def shards(cfg: ExperimentConfig, split: Split) -> dict[str, np.ndarray]:
    """Node id -> indices into the training set; the same on every process for the same seed. The
    experiment's partition of the training set, or the nodes' parts the split made (``data.split`` kind
    per_node: partitioned before their test parts were cut)."""
    parts = split.node_parts if split.node_parts is not None else _partition(cfg, split.train.y.numpy())
    return dict(zip(cfg.node_ids(), parts, strict=True))


def _partition(cfg: ExperimentConfig, labels: np.ndarray) -> list[np.ndarray]:
    seed = cfg.partition.seed_for(cfg.seed)
    return partition(cfg.partition.kind, labels, cfg.nodes, seed=seed, **cfg.partition.options())


def save_shard(cfg: ExperimentConfig, node_id: str, path: Path) -> int:
    """Write `node_id`'s shard of the experiment's partition as a node data file (``x`` and ``y`` as the
    dataset keeps them, what `fedmq node --data` reads); returns its number of examples."""
    split = load_split(cfg)
    idx = torch.as_tensor(shards(cfg, split)[node_id], dtype=torch.long)
    np.savez(path, x=split.train.x[idx].numpy(), y=split.train.y[idx].numpy())
    return len(idx)


def partition_report(cfg: ExperimentConfig, split: Split) -> dict[str, object]:
    """partition.json: the kind and its parameters, each node's shard size and label histogram, and what the
    global model is tested on (``test_set``: the official test set, the pooled re-split's part, or the
    nodes' held-out parts)."""
    parts = shards(cfg, split)
    hist = label_histograms(split.train.y.numpy(), list(parts.values()), split.train.num_classes)
    sizes = {node: len(idx) for node, idx in parts.items()}
    return {
        "kind": cfg.partition.kind,
        "parameters": cfg.partition.options(),
        "seed": cfg.partition.seed_for(cfg.seed),
        "num_classes": split.train.num_classes,
        "train_samples": len(split.train),
        "assigned_samples": sum(sizes.values()),
        "test_samples": len(split.test),
        "test_set": "official" if isinstance(cfg.data.split, str) else cfg.data.split.kind,
        "sizes": sizes,
        "label_histograms": {node: row.tolist() for node, row in zip(parts, hist, strict=True)},
    }


def preflight(cfg: ExperimentConfig) -> torch.nn.Module:
    """Build every part once in this process, so that a missing dataset, an impossible partition or a
    bad model or method option is a clear error before any daemon starts (and the data cache is warm).
    The model built, for checks of the caller's own."""
    split = load_split(cfg)
    shards(cfg, split)
    model = make_model(cfg, split.train)
    build_hyperparams(get_algorithm(cfg.method.name), cfg.method.hyperparams)
    build_aggregator(cfg.method.aggregator.name, cfg.method.aggregator.options)
    train_settings(cfg)
    if cfg.hierarchy.sites:
        check_hierarchy(cfg, coordinator_half(cfg, split))
    return model


def train_settings(cfg: ExperimentConfig) -> TrainSettings:
    """The nodes' training, with node DP-SGD's noise and per-sample clip when the experiment asks for it."""
    settings = TrainSettings(**cfg.train.model_dump())
    if cfg.privacy.mechanism == "node":
        return dataclasses.replace(
            settings, dp_noise_multiplier=cfg.privacy.noise_multiplier, max_grad_norm=cfg.privacy.clip_norm
        )
    return settings


def make_model(cfg: ExperimentConfig, data: TensorDataset) -> torch.nn.Module:
    return build_model(
        cfg.model.name, data.input_shape, data.num_classes, seed=torch_seed(cfg.seed, "model-init"), **cfg.model.options
    )


def coordinator_half(cfg: ExperimentConfig, split: Split) -> CoordinatorHalf:
    """The method's coordinator half on the global model, with the experiment's averaging rule."""
    spec = get_algorithm(cfg.method.name)
    hp = build_hyperparams(spec, cfg.method.hyperparams)
    device = best_device()
    deterministic_kernels(device)  # KDIA's generator trains there: the same seed, the same bits
    half = spec.coordinator(hp, model=make_model(cfg, split.test), device=device)
    if cfg.method.aggregator.name != "mean":
        half.average = build_aggregator(
            cfg.method.aggregator.name, cfg.method.aggregator.options, model=half.model, device=half.device
        )
    if cfg.privacy.secure_aggregation is not None:
        why = secure_refusal(half)
        if why is not None:
            raise ConfigError(
                f"{cfg.method.name} cannot run with secure aggregation: {why}", field="privacy.secure_aggregation"
            )
    central = cfg.privacy.central(cfg.nodes, cfg.fraction, cfg.seed)
    if central is not None:
        try:
            half.average = DPFedAvg(central, model=half.model)
        except ValueError as exc:
            raise ConfigError(str(exc), field="privacy.mechanism") from None
        if cfg.steps < (cfg.rounds or 0):
            logger.warning(
                "privacy.target_epsilon %g: the run stops after %d of its %d rounds (epsilon %.3g at delta %g; one"
                " more round would spend %.3g)",
                cfg.privacy.target_epsilon,
                cfg.steps,
                cfg.rounds,
                central.epsilon(cfg.steps),
                central.delta,
                central.epsilon(cfg.steps + 1),
            )
    return half


def secure_refusal(half: CoordinatorHalf) -> str | None:
    """Why `half` cannot aggregate from the unmasked sum alone: its aggregation must read each update
    (the condition is the one site aggregators' partial means need), or its updates carry more than
    the model."""
    why = half.partial_refusal()
    if why is not None:
        return f"its aggregation needs more of the updates than their sample-weighted mean, all the masks leave ({why})"
    groups = sorted(half.update_schema())
    if groups != ["model"]:
        return f"its updates carry the groups {groups}, and only the model is masked"
    return None


def round_policy(cfg: ExperimentConfig, **changes: object) -> RoundPolicy:
    """The experiment's round policy, with `changes` (a hierarchy's levels)."""
    derived = {"inline_model_bytes": inline_model_bytes(cfg), "min_nodes": cfg.policy.min_nodes or cfg.nodes}
    fields = dict(cfg.policy) | derived
    fields.pop("sample_limits")  # the experiment's, resolved into each node's limit (`sample_limits`)
    return RoundPolicy(**(fields | changes))  # type: ignore[arg-type]


def sample_limits(cfg: ExperimentConfig, split: Split) -> dict[str, int] | None:
    """Each node's shard size, and each site's nodes' together: the most it may announce
    (``policy.sample_limits: partition``); None when the experiment bounds counts otherwise."""
    if cfg.policy.sample_limits != "partition":
        return None
    sizes = {node: len(idx) for node, idx in shards(cfg, split).items()}
    for site, nodes in cfg.site_nodes().items():
        sizes[site] = sum(sizes[n] for n in nodes)
    return sizes


def coordinator_config(
    cfg: ExperimentConfig,
    out_dir: Path,
    *,
    federation: str | None = None,
    resume: bool = False,
    node_samples: Mapping[str, int] | None = None,
) -> CoordinatorConfig:
    """The coordinator's settings. With sites, its nodes are the site aggregators: it gives every one a
    task each round (each site samples its own nodes, with the experiment's fraction) and waits for all."""
    sites = cfg.hierarchy.sites
    policy = round_policy(cfg, fraction=1.0, over_selection=1.0, min_nodes=sites) if sites else round_policy(cfg)
    return CoordinatorConfig(
        federation=federation or federation_id(cfg),
        rounds=cfg.steps,
        seed=cfg.seed,
        out_dir=out_dir,
        policy=policy,
        train=train_settings(cfg),
        eval_every=cfg.eval_every,
        eval_last=cfg.eval_last,
        method=cfg.method.name,
        resume=resume,
        eval_device=str(best_device()),
        engine=cfg.engine.kind,
        asynchronous=async_policy(cfg),
        compression=cfg.compression.compression(),
        nodes=frozenset(cfg.hierarchy.site_names() if sites else cfg.node_ids()),
        node_samples=node_samples,
        node_dp_delta=cfg.privacy.resolved_delta(cfg.nodes) if cfg.privacy.mechanism == "node" else None,
        **secure_settings(cfg),
    )


def secure_settings(cfg: ExperimentConfig) -> dict[str, Any]:
    """The coordinator's secure-aggregation fields, when the experiment asks for it."""
    secure = cfg.privacy.secure_aggregation
    if secure is None:
        return {}
    settings = secure.settings()
    central = cfg.privacy.central(cfg.nodes, cfg.fraction, cfg.seed)
    if central is not None:  # the nodes clip to S and divide by K; the coordinator adds the noise
        settings = dataclasses.replace(settings, l2_clip=central.clip_norm, fixed_total=central.cohort)
    return {"secure_aggregation": settings, "secure_timeout_s": secure.timeout_s}


def build_coordinator(
    cfg: ExperimentConfig,
    url: str,
    out_dir: Path,
    *,
    federation: str | None = None,
    resume: bool = False,
    access: Access | None = None,
) -> Coordinator:
    split = load_split(cfg)
    half = coordinator_half(cfg, split)
    check_hierarchy(cfg, half)  # its sites' aggregators would refuse the method: say so here, not after a wait
    limits = sample_limits(cfg, split)
    config = coordinator_config(cfg, out_dir, federation=federation, resume=resume, node_samples=limits)
    extra = {
        "experiment": cfg.name,
        "dataset": cfg.data.dataset,
        "model": cfg.model.name,
        "fraction": cfg.fraction,
        "seed": cfg.seed,
    }
    credentials = access.for_identity(COORDINATOR) if access is not None else None
    bus = update_sized(bus_config(cfg, url, credentials), half)
    evaluator = Evaluator(half, split.test, split.val, config.eval_device)
    persistence = Persistence(RunDir(config.out_dir), half)
    return Coordinator(config, bus, half, evaluator=evaluator, persistence=persistence, extra_summary=extra)


UPDATE_HEADER_ALLOWANCE = 1 << 20
"""Room for an update frame's header and meta besides its tensors (a method's payload scalars)."""


def update_sized(bus: BusConfig, half: CoordinatorHalf) -> BusConfig:
    """`bus` with its largest transfer bounded by what an update may hold (the half's update schema,
    plus a header): a chunk header declaring more is refused as soon as it arrives, before any buffer
    is allocated, and a few forged headers declaring 1 GiB each no longer take the whole reassembly
    budget from every node's real update (issue 31, item 7)."""
    specs = [spec for group in half.update_schema().values() for spec in group.values()]
    tensors = sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in specs)
    bound = 2 * tensors + UPDATE_HEADER_ALLOWANCE  # twice: a site's partial may carry double-precision sums
    return dataclasses.replace(bus, max_transfer_bytes=min(bus.max_transfer_bytes, bound))


def async_policy(cfg: ExperimentConfig) -> AsyncPolicy:
    settings = {name: value for name, value in cfg.engine if name != "kind"}  # kind: CoordinatorConfig.engine
    return AsyncPolicy(**(settings | {"staleness": Staleness(**dict(cfg.engine.staleness))}))


def node_faults(cfg: ExperimentConfig, node_id: str) -> Faults:
    """The faults the experiment injects into `node_id` (none by default)."""
    fault = cfg.faults.get(node_id)
    if fault is None:
        return Faults()
    rounds = frozenset(fault.delay_rounds) if fault.delay_rounds is not None else None
    return Faults(**(dict(fault) | {"delay_rounds": rounds}))


def node_scripts(cfg: ExperimentConfig) -> dict[str, NodeScript]:
    """Each node's script: its part of the experiment's scenario, expanded (seeded), with the faults
    the experiment's `faults:` section injects into it (a preset of the script: one mechanism plays
    both). A node with neither is left out: it keeps the default script, which changes nothing."""
    scripts = expand_scenario(cfg.scenario, cfg.node_ids(), cfg.seed) if cfg.scenario is not None else {}
    for node_id in cfg.faults:
        script = scripts.get(node_id, NodeScript(seed=cfg.seed))
        scripts[node_id] = dataclasses.replace(script, faults=node_faults(cfg, node_id))
    return scripts


def build_nodes(
    cfg: ExperimentConfig,
    url: str,
    node_ids: list[str],
    *,
    federation: str | None = None,
    exit_when_done: bool = False,
    announce_label_histogram: bool = True,
    device: torch.device | None = None,
    data_path: Path | None = None,
    access: Access | None = None,
) -> list[NodeDaemon]:
    """Daemons for `node_ids`, sharing one dataset load and one training workspace (one process).

    With `data_path` (one node only) the node trains on that file or folder (`load_node_data`)
    instead of its shard of the experiment's partition, and the dataset is never loaded."""
    unknown = sorted(set(node_ids) - set(cfg.node_ids()))
    if unknown:
        raise ConfigError(
            f"node ids {unknown} are not in this experiment (node-000 .. {cfg.node_ids()[-1]}, from `nodes`)",
            field="--node-id",
        )
    if data_path is not None and len(node_ids) != 1:
        raise ConfigError(
            f"--data gives one node its own data, but {len(node_ids)} nodes were asked for: one --node-id"
        )
    set_host_memory(cfg.hosting.host_memory)  # the process's, for its nodes' training
    spec = get_algorithm(cfg.method.name)
    hp = build_hyperparams(spec, cfg.method.hyperparams)
    own = load_node_data(cfg, data_path) if data_path is not None else None
    if own is None:
        split = load_split(cfg)
        parts = shards(cfg, split)
    device = device or best_device()
    group_wait_s = cfg.hosting.vectorize_wait_s if cfg.hosting.vectorize else None
    workspace = Workspace(make_model(cfg, own if own is not None else split.train), device, group_wait_s=group_wait_s)
    scripts = node_scripts(cfg)
    daemons = []
    for node_id in node_ids:
        node_config = NodeConfig(
            node_id=node_id,
            federation=federation or federation_id(cfg),
            seed=cfg.seed,
            exit_when_done=exit_when_done,
            announce_label_histogram=announce_label_histogram,
            script=scripts.get(node_id, NodeScript()),
            compression=cfg.compression.compression(),
        )
        data = (own if own is not None else split.train.subset(parts[node_id])).to(device)
        bus = bus_config(cfg, url, access.for_identity(node_id) if access is not None else None)
        daemons.append(NodeDaemon(node_config, bus, spec.node(hp, node_id=node_id), data, workspace))
    return daemons


def site_federation(federation: str, site: str) -> str:
    """The federation id of a site's own nodes and aggregator (topics fedmq/FED.SITE/...)."""
    try:
        return check_id(f"{federation}.{site}", "site federation id (the federation id, a dot and the site name)")
    except ValueError as exc:
        raise ConfigError(str(exc), field="federation") from None


def site_config(
    cfg: ExperimentConfig,
    site: str,
    out_dir: Path,
    *,
    federation: str,
    node_samples: Mapping[str, int] | None = None,
) -> CoordinatorConfig:
    """A site aggregator's downstream settings: the experiment's fraction and round policy over the
    site's nodes, closing at ``hierarchy.site_deadline`` of the deadline, never retrying or carrying
    late updates (upstream decides those), rounds without end (upstream's run decides)."""
    policy = round_policy(
        cfg,
        deadline_s=cfg.deadline_s * cfg.hierarchy.site_deadline,
        min_nodes=1,
        min_updates=1,
        on_insufficient="skip",
        late_updates="drop",
        max_rounds_without_model=None,  # upstream's run decides when the federation stops
    )
    return CoordinatorConfig(
        federation=site_federation(federation, site),
        rounds=ENDLESS,
        seed=cfg.seed,
        out_dir=out_dir,
        policy=policy,
        train=train_settings(cfg),
        method=cfg.method.name,
        nodes=frozenset(cfg.site_nodes()[site]) if site in cfg.site_nodes() else None,
        node_samples=node_samples,
    )


def check_hierarchy(cfg: ExperimentConfig, half: CoordinatorHalf) -> None:
    """A hierarchical experiment's method must aggregate in parts (ConfigError saying why not)."""
    if cfg.hierarchy.sites:
        reason = half.partial_refusal()
        if reason is not None:
            raise ConfigError(f"{cfg.method.name} cannot run with site aggregators: {reason}", field="hierarchy.sites")


def build_site_aggregator(
    cfg: ExperimentConfig,
    url: str,
    site: str,
    out_dir: Path,
    *,
    federation: str | None = None,
    upstream_url: str | None = None,
    worker: int = 0,
    exit_when_done: bool = False,
) -> SiteAggregator:
    """Site `site`'s aggregator: its nodes' coordinator on `url` (the site's broker), and one node of the
    federation on `upstream_url` (by default the same broker, bridged to the central one). With
    ``hierarchy.workers`` above 1, `worker` numbers this process among the site's."""
    names = cfg.hierarchy.site_names()
    if not names:
        raise ConfigError("the experiment has no sites: set hierarchy.sites", field="hierarchy.sites")
    if site not in names:
        raise ConfigError(f"site {site!r} is not in this experiment ({', '.join(names)})", field="--site")
    if not 0 <= worker < cfg.hierarchy.workers:
        raise ConfigError(
            f"worker {worker} is not one of the site's {cfg.hierarchy.workers} (hierarchy.workers)", field="--worker"
        )
    federation = federation or federation_id(cfg)
    split = load_split(cfg)
    half = coordinator_half(cfg, split)
    check_hierarchy(cfg, half)
    config = site_config(cfg, site, out_dir, federation=federation, node_samples=sample_limits(cfg, split))
    site_coordinator = SiteCoordinator(config, bus_config(cfg, url), half, site=site)
    shared = cfg.hierarchy.workers > 1
    upstream_bus = bus_config(cfg, upstream_url or url)
    if shared:
        site_coordinator.coordinator.client_id += f"-{worker}"
        # a worker's session ends with its connection, so that the broker stops handing it tasks
        upstream_bus = dataclasses.replace(upstream_bus, persistent_session=False)
    spec = get_algorithm(cfg.method.name)
    node_config = NodeConfig(node_id=site, federation=federation, seed=cfg.seed, exit_when_done=exit_when_done)
    expected = len(cfg.site_nodes()[site])
    min_live = expected if cfg.policy.min_nodes is None else max(1, cfg.policy.min_nodes * expected // cfg.nodes)
    trainer = SiteTrainer(site_coordinator, node_config, min_live=min_live)
    upstream = NodeDaemon(
        node_config,
        upstream_bus,
        spec.node(build_hyperparams(spec, cfg.method.hyperparams), node_id=site),
        no_data(),
        Workspace(make_model(cfg, split.train), torch.device("cpu")),
        trainer=trainer,
        share_group=f"fedmq-{federation}-{site}" if shared else None,
    )
    if shared:
        upstream.client_id += f"-{worker}"
    return SiteAggregator(upstream, trainer, site_coordinator)
