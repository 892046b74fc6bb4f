"""KDIA: knowledge distillation with a teacher weighted by participation interval, count and data size.

Paper: shared/papers/004_c420cd39dccb3118.txt; spec: shared/specs/kdia.md (section numbers below).
Each round the coordinator sends the selected nodes the student theta_g (the sample-weighted
average of the last round's updates, Eq. 1), the teacher theta_T and the conditional feature
generator. A node starts from theta_g and minimises, per real mini-batch (x, y) of size B,

    L = CE(f(x), y) + lambda_kd KL_tau(teacher, student)(x) + lambda_gen CE(h(G(z, y~)), y~)

(Eq. 11-13, section 1.5): self-distillation from the frozen teacher on the real batch, and the
classifier head h on B generated features with labels y~ from the node's label pool. After
aggregating the student, the coordinator overwrites the participants' stored models, weighs every
stored model by triFreqs (`kdia.teacher`, from the participation record: only accepted updates
count) into the teacher (Eq. 10), and trains the generator against the round's uploaded heads
(`kdia.generator`, Eq. 3-4). Both student ("accuracy") and teacher ("accuracy_teacher") are
evaluated; the final model is picked on the validation split (A11).

Every ambiguity of the spec's section 5 is an option here, defaulting to the spec's recommendation:
A1 `kd_direction` / `kd_tau2_scale`; A3 `gen_epochs` / `gen_batches_per_epoch`; A4
`gen_keep_optimizer`; A5 `gen_warmup_rounds` / `kd_warmup_rounds`; A10 `weighting` and `num_nodes`
(stored models of never-seen nodes are theta_g^0); A15 participation counted on acceptance (the
coordinator's record); A16 integer buffers by max; A17 Nc from the model; A19 `generator_heads`.
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedmq.fedcore.algorithms import base, shared
from fedmq.fedcore.algorithms.kdia.generator import (
    FeatureGenerator,
    HeadEnsemble,
    build_generator,
    generator_state,
    train_generator,
)
from fedmq.fedcore.algorithms.kdia.teacher import (
    TEACHER_MODES,
    WEIGHTINGS,
    DiskStore,
    MemoryStore,
    ModelStore,
    StreamingTeacher,
    Teacher,
    make_teacher,
    uploads_from_record,
    weights_from_record,
)
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.models.base import FedModel
from fedmq.fedcore.round_plan import BatchOutput
from fedmq.fedcore.tensors import cpu_copy
from fedmq.fedcore.training import TrainSettings, local_sgd
from fedmq.fedcore.vectorized import NodeBatch, functional_method, nll, train_vectorized, unsupported

KD_DIRECTIONS = ("forward", "reverse")
STORES = ("memory", "disk")
GENERATOR_HEADS = ("participants", "teacher")


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    LOCAL_FIELDS: ClassVar[tuple[str, ...]] = ("store", "store_dir", "teacher_log_every")
    """Where and how often the coordinator keeps and logs: may differ between machines, so the method
    fingerprint (`fedcore.algorithms.fingerprint`) leaves them out."""

    lambda_kd: float = 0.5
    """Weight of the self-distillation term (paper: 0.5; grid 0.1, 0.5, 1.0). 0 switches l_kd off."""
    lambda_gen: float = 1.0
    """Weight of the generator term (paper: 0.01 at beta 0.1 and 5.0, 1.0 at beta 0.5). 0 switches
    l_gen off, and the generator is then neither trained nor sent (Table 7's "base + l_kd")."""
    temperature: float = 2.0
    """KD temperature tau (paper: 2.0)."""
    kd_direction: str = "forward"
    """A1: "forward" = KL(teacher || student), the paper's Eq. 11; "reverse" = KL(student || teacher),
    what the authors' code computes (``KLDivLoss(log p_T, q_S)``)."""
    kd_tau2_scale: bool = False
    """A1: multiply the KD term by tau^2 (Hinton); neither the paper nor the code does."""
    weighting: str = "gm"
    """Teacher weights: "gm" (triFreqs, Eq. 9), "am" (arithmetic mean), "intv", "part", "num" (Table 3)."""
    num_nodes: int = 0
    """Nodes the federation has, for the "am" and single-factor ablations: nodes not yet in the
    participation record then count as never seen (t_k = -1, n_k = 0, model theta_g^0). 0: only
    the nodes in the record. Irrelevant under "gm", where never-seen nodes weigh exactly 0."""
    teacher_mode: str = "exact"
    """"exact" (Eq. 10 over every stored model), "windowed", "incremental" or "streaming"
    (`kdia.teacher`); the last holds no per-node model at all."""
    store: str = "memory"
    """Where the exact, windowed and incremental modes keep every node's last model: "memory" or "disk"."""
    store_dir: str = ""
    """Directory of the disk store; empty: a fresh temporary directory (then a resumed run starts
    the store anew)."""
    window_rounds: int = 30
    """windowed: drop stored models older than this many rounds (spec 6.3: about 5e-5 of the mass)."""
    window_min_share: float = 0.0
    """windowed: also drop stored models whose weight share is below this."""
    resync_every: int = 50
    """incremental: recompute the running sums from the store every this many rounds (0: never)."""
    teacher_log_every: int = 1
    """Write every known node's teacher weight to teacher_weights.jsonl every this many rounds (0: never)."""
    noise_dim: int = 100
    """Dimension of the generator's Gaussian noise z (paper: 100)."""
    gen_epochs: int = 10
    """A3: generator epochs per round (paper 10; the code 20)."""
    gen_batches_per_epoch: int = 200
    """A3: generator batches per epoch (paper 200; the code 100); the label pool holds this many batches."""
    gen_batch_size: int = 64
    """Generated features per generator step (paper: 64); the diversity loss compares its two halves."""
    gen_lr: float = 1e-3
    """Adam's learning rate for the generator (paper: 1e-3)."""
    gen_weight_decay: float = 1e-5
    """Adam's weight decay for the generator (paper: 1e-5)."""
    gen_keep_optimizer: bool = False
    """A4: keep Adam's moments across rounds (the code re-creates Adam every round)."""
    generator_heads: str = "participants"
    """A19: train the generator against the round's uploaded heads (p_k-weighted, the paper) or the teacher's head."""
    gen_warmup_rounds: int = 0
    """A5: rounds before nodes use the generator (the code: 0, an untrained generator from round 0)."""
    kd_warmup_rounds: int = 0
    """A5: rounds before nodes distil from the teacher (the code: 0, the initial model from round 0)."""

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        base.require_non_negative(self, "lambda_kd", "lambda_gen", "window_min_share", "gen_weight_decay")
        base.require_positive(self, "temperature", "gen_lr")
        for name in ("noise_dim", "gen_epochs", "gen_batches_per_epoch"):
            check(name, getattr(self, name) >= 1, "at least 1")
        check("gen_batch_size", self.gen_batch_size >= 2, "at least 2 (the diversity loss compares halves)")
        for name in ("num_nodes", "window_rounds", "resync_every", "teacher_log_every"):
            check(name, getattr(self, name) >= 0, "non-negative")
        for name in ("gen_warmup_rounds", "kd_warmup_rounds"):
            check(name, getattr(self, name) >= 0, "non-negative")
        check("kd_direction", self.kd_direction in KD_DIRECTIONS, f"one of {KD_DIRECTIONS}")
        check("weighting", self.weighting in WEIGHTINGS, f"one of {WEIGHTINGS}")
        check("teacher_mode", self.teacher_mode in TEACHER_MODES, f"one of {TEACHER_MODES}")
        check("store", self.store in STORES, f"one of {STORES}")
        check("generator_heads", self.generator_heads in GENERATOR_HEADS, f"one of {GENERATOR_HEADS}")
        if self.teacher_mode in ("incremental", "streaming"):
            check(
                "weighting", self.weighting == "gm", f"'gm' for the {self.teacher_mode} teacher (it decays GM masses)"
            )


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float,
    direction: str = "forward",
    tau2_scale: bool = False,
) -> torch.Tensor:
    """KL at temperature tau, summed over classes and averaged over the batch (spec 1.5, A1).

    forward: KL(P || Q) with P = softmax(teacher / tau), Q = softmax(student / tau) (the paper);
    reverse: KL(Q || P), the authors' code. The teacher logits carry no gradient.
    """
    log_q = F.log_softmax(student_logits / temperature, dim=1)
    log_p = F.log_softmax(teacher_logits.detach() / temperature, dim=1)
    if direction == "forward":
        loss = F.kl_div(log_q, log_p, reduction="batchmean", log_target=True)
    elif direction == "reverse":
        loss = F.kl_div(log_p, log_q, reduction="batchmean", log_target=True)
    else:
        raise ValueError(f"direction must be one of {KD_DIRECTIONS}, got {direction!r}")
    return loss * temperature**2 if tau2_scale else loss


def generated_labels(
    num_samples: int, batch_size: int, epochs: int, num_classes: int, generator: torch.Generator
) -> torch.Tensor:
    """The node's labels for generated features, one per real sample per epoch (spec 1.5, A7, A8).

    Uniform i.i.d. draws. A node with at most one batch of data (N_k <= B) draws N_k E labels and
    uses a different slice each epoch; a larger node draws N_k labels once and reshuffles them
    every epoch. Returned as the epochs' sequences one after the other (length N_k E).
    """
    device = generator.device
    if num_samples <= batch_size:
        return torch.randint(0, num_classes, (num_samples * epochs,), generator=generator, device=device)
    pool = torch.randint(0, num_classes, (num_samples,), generator=generator, device=device)
    return torch.cat([pool[torch.randperm(num_samples, generator=generator, device=device)] for _ in range(epochs)])


def batch_offsets(num_samples: int, batch_size: int) -> list[int]:
    """Start of every batch `local_sgd` trains on in one epoch (it skips a trailing batch of one)."""
    starts = list(range(0, num_samples, batch_size))
    if num_samples > 1 and num_samples - starts[-1] == 1:
        starts.pop()
    return starts


class CoordinatorHalf(base.CoordinatorHalf[Hyperparams]):
    """Async mode: ``ctx.round`` is the model version index, so t_k, the intervals and the warm-up
    rounds count versions; the student folds every update by ``ctx.folding`` (`next_model`), the
    teacher stores each node's last update of the version, and the generator trains against every
    folded update's head."""

    sync_only = None
    measured_metrics = frozenset({"teacher_seconds", "gen_seconds"})

    def __init__(self, hp: Hyperparams, *, model: nn.Module, device: torch.device | None = None) -> None:
        super().__init__(hp, model=model, device=device)
        if hp.lambda_gen > 0 and not isinstance(model, FedModel):
            raise AlgorithmError(
                f"KDIA's generator needs a model split into extract/classify, not {type(model).__name__}"
            )
        initial = cpu_copy(model.state_dict())
        self.teacher_model = copy.deepcopy(model)
        """theta_T; theta_T^0 = theta_g^0 (the code's ``t_net = deepcopy(global_model)``)."""
        self.store: ModelStore | None = None
        if hp.teacher_mode != "streaming":
            self.store = (
                DiskStore(hp.store_dir or tempfile.mkdtemp(prefix="fedmq-kdia-store-"))
                if hp.store == "disk"
                else MemoryStore()
            )
        self.teacher: Teacher = make_teacher(
            hp.teacher_mode,
            initial,
            self.store,
            window_rounds=hp.window_rounds if hp.teacher_mode == "windowed" else 0,
            min_share=hp.window_min_share if hp.teacher_mode == "windowed" else 0.0,
            resync_every=hp.resync_every,
        )
        self.generator: FeatureGenerator | None = None
        if hp.lambda_gen > 0:
            assert isinstance(model, FedModel)
            self.generator = build_generator(hp.noise_dim, model)
        self._generator_ready = False
        self._optimizer_state: dict[str, Any] | None = None
        self._records: list[dict[str, Any]] = []
        self._last_round = -1

    # -- each round ----------------------------------------------------------------------------

    def configure_round(self, ctx: base.RoundContext) -> base.Payload:
        distill = self.hp.lambda_kd > 0 and ctx.round >= self.hp.kd_warmup_rounds
        generate = self.generator is not None and ctx.round >= self.hp.gen_warmup_rounds
        tensors = {"model": self.model.state_dict()}
        if distill:
            tensors["teacher"] = self.teacher_model.state_dict()
        if generate:
            tensors["generator"] = generator_state(self._ready_generator(ctx.generator))
        return base.Payload(tensors=tensors, meta={"distill": distill, "generate": generate})

    def aggregate(
        self, ctx: base.RoundContext, updates: Sequence[base.NodeUpdate], failures: Sequence[base.Failure]
    ) -> Mapping[str, float]:
        sizes = [float(u.num_samples) for u in updates]
        states = [u.payload.tensors["model"] for u in updates]
        # student, Eq. 1: theta_g = sum_{k in S_t} (N_k / sum_j N_j) theta_k^{t+1} (async: by ctx.folding,
        # every update folded, a node's two updates of one version both)
        self.model.load_state_dict(self.next_model(ctx, updates, sizes))

        # teacher, Eq. 5-10: overwrite the participants' stored models, weigh every stored model
        started = time.perf_counter()
        if self.store is not None:
            self.store.begin_round(ctx.round - 1)  # every earlier round is checkpointed by now
        weights = weights_from_record(ctx.participation, ctx.round, self.hp.weighting, num_nodes=self.hp.num_nodes)
        # one upload per node: its last update of this round (async: version) is the model stored for it
        uploads = uploads_from_record(
            ctx.participation, ctx.round, [(u.node_id, s) for u, s in zip(updates, states, strict=True)]
        )
        step = self.teacher.step(weights, uploads)
        self.teacher_model.load_state_dict(step.state)
        teacher_seconds = time.perf_counter() - started
        self._last_round = ctx.round
        w = weights.weights
        index = weights.index()
        metrics = {
            "train_loss": shared.mean_reported_loss(updates, sizes),
            "teacher_error_share": float(step.error_share),
            "teacher_models_held": float(step.models_held),
            "teacher_effective_nodes": float(1.0 / np.sum(w**2)) if np.any(w > 0) else 0.0,
            "teacher_participant_share": float(sum(w[index[up.node_id]] for up in uploads)),
            "teacher_seconds": teacher_seconds,
        }
        log_every = self.hp.teacher_log_every
        self._records = weights.records(self.hp.weighting) if log_every and ctx.round % log_every == 0 else []

        # generator, Eq. 3-4: trained against this round's uploaded heads (or the teacher's)
        if self.generator is not None:
            metrics |= self._train_generator(ctx, states, sizes)
        return metrics

    def _train_generator(
        self, ctx: base.RoundContext, states: Sequence[Mapping[str, torch.Tensor]], sizes: Sequence[float]
    ) -> dict[str, float]:
        assert self.generator is not None and isinstance(self.model, FedModel)
        generator = self._ready_generator(ctx.generator)
        if self.hp.generator_heads == "teacher":
            heads, head_weights = [self.teacher_model.state_dict()], [1.0]
        else:
            heads, head_weights = [dict(s) for s in states], list(sizes)
        ensemble = HeadEnsemble(self.model, heads, head_weights, self.device)
        stats, optimizer_state = train_generator(
            generator,
            ensemble,
            epochs=self.hp.gen_epochs,
            batches_per_epoch=self.hp.gen_batches_per_epoch,
            batch_size=self.hp.gen_batch_size,
            lr=self.hp.gen_lr,
            weight_decay=self.hp.gen_weight_decay,
            rng=ctx.generator,
            device=self.device,
            optimizer_state=self._optimizer_state,
        )
        generator.to("cpu")
        self._optimizer_state = _to_cpu(optimizer_state) if self.hp.gen_keep_optimizer else None
        return {"gen_ce": stats.ce, "gen_diversity": stats.diversity, "gen_seconds": stats.seconds}

    def _ready_generator(self, rng: torch.Generator) -> FeatureGenerator:
        """The generator; initialised from the run's seeded stream the first time (not the global one)."""
        assert self.generator is not None
        if not self._generator_ready:
            self.generator.reset_parameters(rng)
            self._generator_ready = True
        return self.generator

    # -- what the daemon reads ---------------------------------------------------------------

    def evaluation_models(self) -> Mapping[str, nn.Module]:
        return {"global": self.model, "teacher": self.teacher_model}

    def round_records(self) -> Mapping[str, Sequence[Mapping[str, Any]]]:
        return {"teacher_weights": self._records} if self._records else {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {f"teacher/{k}": v for k, v in self.teacher_model.state_dict().items()}
        out["last_round"] = torch.tensor(self._last_round, dtype=torch.int64)
        if self.generator is not None and self._generator_ready:
            out |= {f"generator/{k}": v for k, v in generator_state(self.generator).items()}
        if self.store is not None:
            out |= {f"store/{k}": v for k, v in self.store.state_dict().items()}
        out |= {f"stream/{k}": v for k, v in self.teacher.state_dict().items()}
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        groups: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            group, sep, name = key.partition("/")
            if not sep and key != "last_round":
                raise ValueError(f"KDIA state holds an unexpected entry {key!r}")
            groups.setdefault(group if sep else "", {})[name or key] = value
        unknown = set(groups) - {"", "teacher", "generator", "store", "stream"}
        if unknown:
            raise ValueError(f"KDIA state holds unexpected groups {sorted(unknown)}")
        self._last_round = int(groups.get("", {}).get("last_round", torch.tensor(-1)))
        if "generator" in groups and self.generator is None:
            raise ValueError("the checkpoint holds a generator but lambda_gen is 0")
        try:  # a group that does not fit its module is a ValueError, as every half's misfit state is
            if "teacher" in groups:
                self.teacher_model.load_state_dict(groups["teacher"])
            if "generator" in groups and self.generator is not None:
                self.generator.load_state_dict(groups["generator"])
                self._generator_ready = True
        except RuntimeError as exc:
            raise ValueError(f"KDIA state does not fit the model: {exc}") from exc
        if self.store is not None:
            self.store.load_state_dict(groups.get("store", {}), self._last_round)
        if isinstance(self.teacher, StreamingTeacher):
            self.teacher.load_state_dict(groups.get("stream", {}))


class NodeHalf(base.NodeHalf[Hyperparams]):
    def train(
        self, task: base.TaskInput, model: nn.Module, data: TensorDataset, generator: torch.Generator
    ) -> base.Payload:
        shared.load_group(task, "model", model, node_id=self.node_id)
        distill = shared.task_flag(task, "distill", node_id=self.node_id, default=False) and self.hp.lambda_kd > 0
        generate = shared.task_flag(task, "generate", node_id=self.node_id, default=False) and self.hp.lambda_gen > 0
        teacher = self._teacher(task) if distill else None
        feature_generator = self._generator(task, model) if generate else None
        settings = task.settings
        labels: torch.Tensor | None = None
        starts = batch_offsets(len(data), settings.batch_size)
        if feature_generator is not None:
            labels = generated_labels(
                len(data), settings.batch_size, settings.local_epochs, feature_generator.num_classes, generator
            ).to(data.x.device)
        calls = 0
        terms = {"kd": 0.0, "gen": 0.0}

        def objective(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            nonlocal calls
            logits = m(x)
            loss = F.cross_entropy(logits, y)  # l_CE
            if teacher is not None:
                with torch.no_grad():
                    teacher_logits = teacher(x)
                kd = kd_loss(logits, teacher_logits, self.hp.temperature, self.hp.kd_direction, self.hp.kd_tau2_scale)
                loss = loss + self.hp.lambda_kd * kd  # + lambda_kd l_kd, on the real batch only
                terms["kd"] += float(kd.detach())
            if feature_generator is not None and labels is not None:
                epoch, batch = divmod(calls, len(starts))
                offset = epoch * len(data) + starts[batch]
                y_gen = labels[offset : offset + len(y)]
                z = torch.randn(
                    len(y_gen), feature_generator.noise_dim, 1, 1, generator=generator, device=generator.device
                )
                with torch.no_grad():  # the generator is frozen; its features are detached (the code)
                    features = feature_generator(z.to(x.device), y_gen)
                gen = F.cross_entropy(m.classify(features), y_gen)  # type: ignore[operator]
                loss = loss + self.hp.lambda_gen * gen  # + lambda_gen l_gen, through the head only
                terms["gen"] += float(gen.detach())
            calls += 1
            return loss

        stats = local_sgd(model, data, settings, generator, loss_fn=objective)
        meta: dict[str, Any] = {"loss": stats.loss, "steps": stats.steps}
        if stats.steps:
            if teacher is not None:
                meta["kd_loss"] = terms["kd"] / stats.steps
            if feature_generator is not None:
                meta["gen_loss"] = terms["gen"] / stats.steps
        return base.Payload(tensors={"model": model.state_dict()}, meta=meta)

    def train_group(self, members: Sequence[base.GroupMember], model: nn.Module) -> list[base.Payload]:
        """`train` for every member at once (`fedcore.vectorized`): the same objective as a pure
        function of each node's batch, its generated labels and noise drawn into the plan in the order
        `train` draws them, the generator's features computed for every step at once on the device."""
        first = base.same_task(members)
        task = first.task
        shared.load_group(task, "model", model, node_id=first.half.node_id)
        distill = shared.task_flag(task, "distill", node_id=self.node_id, default=False) and self.hp.lambda_kd > 0
        generate = shared.task_flag(task, "generate", node_id=self.node_id, default=False) and self.hp.lambda_gen > 0
        device = next(model.parameters()).device
        teacher = None
        outputs: dict[str, BatchOutput] = {}
        if distill:  # the spare model's own tensors where it is on `device` (loaded in place each round)
            teacher = {n: p.detach().to(device) for n, p in self._teacher(task).named_parameters()}
            # log softmax(teacher / tau) on each step's batch, made a chunk of steps at a time before they run
            tau = self.hp.temperature
            outputs["teacher_log_p"] = shared.frozen_output(
                model, first.data, teacher, then=lambda logits: F.log_softmax(logits / tau, dim=-1)
            )  # fmt: skip
        draws = _GeneratedDraws(self._generator(task, model), self.hp.noise_dim) if generate else None
        # the model's halves, their layers as one over the nodes (fedcore.layers_over_nodes)
        extract, classify = functional_method(model, "extract"), functional_method(model, "classify")
        hp = self.hp
        # l = l_CE + lambda_gen l_gen + lambda_kd l_kd (the terms there are), each a mean over the batch's rows
        # (the generated features are one a row): every term's mean at once, then their weighted sum
        names = ["gen"] * (draws is not None) + ["kd"] * distill
        scale = hp.temperature**2 if hp.kd_tau2_scale else 1.0
        coefficients = [1.0] + [hp.lambda_gen] * (draws is not None) + [hp.lambda_kd * scale] * distill
        weights = torch.tensor(coefficients, dtype=next(model.parameters()).dtype, device=device)

        def objective(batch: NodeBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            if draws is not None:
                # the batch's features and the generated ones through the head at once, and their two
                # cross-entropies as one: half the operators, forward and backward (each row its own)
                features = cast(torch.Tensor, extract(batch.params, batch.x)).flatten(1)
                rows = torch.cat([features, batch.step["features"].flatten(1)])
                both = cast(torch.Tensor, classify(batch.params, rows))
                # (2, B): row 0 l_CE's per sample, row 1 l_gen's (through the head only)
                per_sample = nll(both, torch.cat([batch.y, batch.step["y_gen"]])).view(2, -1)
                logits = both[: len(features)]
            else:
                logits = batch.logits()
                per_sample = nll(logits, batch.y).unsqueeze(0)
            if teacher is not None:
                log_p = batch.step["teacher_log_p"].to(logits.dtype)
                kd = _kd_per_sample(logits, log_p, hp.temperature, hp.kd_direction)
                per_sample = torch.cat([per_sample, kd.unsqueeze(0)])
            if not names:
                return batch.mean(per_sample.squeeze(0)), {}
            means = batch.means(per_sample)  # (1 + terms,): l_CE's, then each term's
            with torch.no_grad():  # each term's own mean reported, off the gradient's path
                terms = {name: means[i].detach() for i, name in enumerate(names, start=1)}
                if "kd" in terms and hp.kd_tau2_scale:
                    terms["kd"] = terms["kd"] * hp.temperature**2
            return (means * weights).sum(), terms

        # the objective reads its batch, the teacher's tensors (their addresses in the key) and these
        # constants: a kept round of an earlier call with the same key trains as this call's would
        keep_as = ("kdia", hp, distill, generate, tuple(t.data_ptr() for t in (teacher or {}).values()))
        results = train_vectorized(
            model, [m.data for m in members], task.settings, [m.generator for m in members],
            objective=objective, draws=draws, keep_as=keep_as, outputs=outputs,
        )  # fmt: skip
        payloads = []
        for _, stats in results:
            meta: dict[str, Any] = {"loss": stats.loss, "steps": stats.steps}
            if stats.steps:
                if teacher is not None:
                    meta["kd_loss"] = stats.terms["kd"]
                if draws is not None:
                    meta["gen_loss"] = stats.terms["gen"]
            payloads.append(meta)
        return [
            base.Payload(tensors={"model": state}, meta=meta)
            for (state, _), meta in zip(results, payloads, strict=True)
        ]

    def group_refusal(self, model: nn.Module) -> str | None:
        return super().group_refusal(model) or unsupported(model)

    def _teacher(self, task: base.TaskInput) -> nn.Module:
        teacher = task.scratch("kdia-teacher")
        shared.load_group(task, "teacher", teacher, node_id=self.node_id)
        return teacher.eval()

    def _generator(self, task: base.TaskInput, model: nn.Module) -> FeatureGenerator:
        if not isinstance(model, FedModel):
            raise AlgorithmError(
                f"KDIA's generator term needs a model split into extract/classify, not {type(model).__name__}",
                node_id=self.node_id,
                round=task.round,
            )
        key = f"kdia-generator-{self.hp.noise_dim}"
        module = task.scratch(key, lambda: build_generator(self.hp.noise_dim, model))
        assert isinstance(module, FeatureGenerator)
        try:
            module.load_state_dict(task.payload.tensors["generator"])
        except (KeyError, RuntimeError) as exc:
            raise AlgorithmError(
                f"task carries no usable generator: {exc}", node_id=self.node_id, round=task.round
            ) from exc
        return module.eval()  # BatchNorm on its running statistics, as on the code's clients


def _kd_per_sample(student: torch.Tensor, log_p: torch.Tensor, temperature: float, direction: str) -> torch.Tensor:
    """`kd_loss` before its batch mean, given the teacher's log softmax at temperature tau (`log_p`): each
    sample's KL at tau, summed over classes."""
    log_q = F.log_softmax(student / temperature, dim=-1)
    if direction == "forward":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if direction == "reverse":
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    raise ValueError(f"direction must be one of {KD_DIRECTIONS}, got {direction!r}")


class _GeneratedDraws:
    """KDIA's draws besides the batches (`fedcore.round_plan.StepDraws`), as `NodeHalf.train` makes them:
    the generated labels before training, each step's noise after its batch; then the frozen generator's
    features for every step at once."""

    def __init__(self, generator: FeatureGenerator, noise_dim: int) -> None:
        self.generator, self.noise_dim = generator, noise_dim

    def first(self, data: TensorDataset, settings: TrainSettings, generator: torch.Generator) -> object:
        labels = generated_labels(
            len(data), settings.batch_size, settings.local_epochs, self.generator.num_classes, generator
        )
        return labels, batch_offsets(len(data), settings.batch_size), len(data)

    def step(self, state: object, s: int, rows: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        assert isinstance(state, tuple)
        labels: torch.Tensor = state[0]
        starts: list[int] = state[1]
        n: int = state[2]
        epoch, batch = divmod(s, len(starts))
        offset = epoch * n + starts[batch]
        z = torch.randn(rows, self.noise_dim, 1, 1, generator=generator, device=generator.device)
        return {"y_gen": labels[offset : offset + rows], "z": z}

    @torch.no_grad()
    def prepare(self, drawn: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        y_gen, z = drawn["y_gen"], drawn["z"]
        device = next(self.generator.parameters()).device
        features = self.generator(z.reshape(-1, self.noise_dim, 1, 1).to(device), y_gen.reshape(-1).to(device))
        return {"y_gen": y_gen, "features": features.view(*y_gen.shape, *features.shape[1:])}


def _to_cpu(state: Mapping[str, Any]) -> dict[str, Any]:
    """An optimiser state with its tensors on the CPU (kept between rounds, off the GPU)."""

    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to("cpu")
        if isinstance(value, dict):
            return {k: move(v) for k, v in value.items()}
        if isinstance(value, list):
            return [move(v) for v in value]
        return value

    return move(dict(state))


SPEC = base.AlgorithmSpec(name="kdia", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
