"""The local training loop and evaluation that algorithms reuse (FedAvg uses them as they are)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Annotated, Any, Literal, Protocol

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.sgd import sgd

from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.errors import ConfigError, check_section
from fedmq.fields import Bounds

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSettings:
    """Local training hyperparameters, sent by the coordinator with every task."""

    local_epochs: Annotated[int, Bounds(ge=1)] = 1
    batch_size: Annotated[int, Bounds(ge=1)] = 32
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: Annotated[float, Bounds(gt=0)] = 0.01
    momentum: Annotated[float, Bounds(ge=0, lt=1)] = 0.0
    weight_decay: Annotated[float, Bounds(ge=0)] = 0.0
    lr_decay: Annotated[float, Bounds(gt=0, le=1)] = 1.0
    """Per-round multiplier: round r trains with lr * lr_decay**r."""
    max_grad_norm: Annotated[float | None, Bounds(gt=0)] = None
    drop_last: bool = False
    """skip each epoch's last batch when short of batch_size (DataLoader drop_last; the FedVLS authors' MNIST
    loaders). Weight decay is weight_decay (their FedVLS client: 0, the rest 1e-5)"""
    # false: the short last batch trains too, unless it is a single sample (BatchNorm cannot train on one)
    dp_noise_multiplier: Annotated[float | None, Bounds(gt=0, le=1000)] = None
    """Node-level DP-SGD (Abadi et al. 2016, through Opacus): every sample's gradient clipped to
    `max_grad_norm` and Gaussian noise of this times it added to each batch's sum; None: plain SGD.
    Sent in a task only when set, so tasks without it are as before (`fedcore.privacy`). Set from the
    experiment file's ``privacy:`` section, not from ``train:``."""
    precision: Literal["float32", "bf16"] = "float32"
    """bf16: each step's forward pass and loss under torch.autocast in bfloat16 (matrix products and
    convolutions in bfloat16; weights, gradients and the optimizer stay in the model's dtype), for a
    GPU's tensor cores; float32: none. Sent in a task only when bf16, so other tasks are as before."""

    def __post_init__(self) -> None:
        check_section(self, "train")
        if not isinstance(self.drop_last, bool):
            raise ConfigError(f"{self.drop_last!r} is not allowed; must be true or false", field="train.drop_last")
        if self.dp_noise_multiplier is not None and self.max_grad_norm is None:
            raise ConfigError(
                f"{self.dp_noise_multiplier!r} is not allowed; must be given with max_grad_norm set"
                " (each sample's gradient is clipped to it)",
                field="train.dp_noise_multiplier",
            )
        if self.precision != "float32" and self.dp_noise_multiplier is not None:
            raise ConfigError(
                "bf16 is not offered with node-level DP-SGD (Opacus's per-sample gradients under autocast are"
                " untested here); use float32",
                field="train.precision",
            )

    def for_round(self, round: int) -> TrainSettings:
        return replace(self, lr=self.lr * self.lr_decay ** max(round, 0))

    def to_meta(self) -> dict[str, Any]:
        meta = asdict(self)
        if meta["dp_noise_multiplier"] is None:
            del meta["dp_noise_multiplier"]  # tasks without DP-SGD stay byte for byte what they were
        if meta["precision"] == "float32":
            del meta["precision"]  # and tasks in float32 too
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> TrainSettings:
        if not isinstance(meta, Mapping):
            raise ConfigError("train settings must be a map", field="train")
        known = {f.name for f in fields(cls)}
        unknown = set(meta) - known
        if unknown:
            raise ConfigError(f"unknown keys {sorted(unknown)}; allowed: {sorted(known)}", field="train")
        try:
            return cls(**meta)
        except TypeError as exc:
            raise ConfigError(str(exc), field="train") from exc


@dataclass(frozen=True, slots=True)
class TrainStats:
    loss: float
    steps: int
    samples_seen: int
    terms: dict[str, float] = field(default_factory=dict)
    """A method's own loss terms, each averaged over the steps (KDIA's kd_loss and gen_loss)."""
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    """A method's own tensors summed over the steps (vectorised training: FedProto's per-class sums of
    the representations it records)."""
    carry: dict[str, torch.Tensor] = field(default_factory=dict)
    """A vectorised objective's carried state as the node's last step left it (`train_vectorized`)."""
    gradient_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    """Each trainable parameter's gradient of the objective summed over the node's steps, before any
    clipping (`train_vectorized(sum_gradients=True)`: SCAFFOLD's gradient_mean)."""


class Stepper(Protocol):
    """What local training asks of its optimiser: a torch Optimizer, or `SGDSteps`."""

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def step(self) -> Any: ...


def make_optimizer(model: nn.Module, settings: TrainSettings) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if settings.optimizer == "adam":
        return torch.optim.Adam(params, lr=settings.lr, weight_decay=settings.weight_decay)
    return torch.optim.SGD(params, lr=settings.lr, momentum=settings.momentum, weight_decay=settings.weight_decay)


class SGDSteps:
    """`torch.optim.SGD`'s steps, made by the function its `step` calls (`torch.optim.sgd.sgd`) with the
    arguments it passes, for local training without DP-SGD. Why not the class: torch's Optimizer classes
    import torch._dynamo at their first use (`add_param_group` and `zero_grad` are `_disable_dynamo`'d),
    1.6 s on a 2-core CPU that every node daemon's first round waited for; the function imports
    nothing. Bitwise the class's steps (tests/fedcore/test_training_steps.py)."""

    def __init__(self, model: nn.Module, settings: TrainSettings) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.settings = settings
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)
        """Each parameter's momentum buffer, made at its first step with a gradient (as SGD's state)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        held = [i for i, p in enumerate(self.params) if p.grad is not None]  # SGD skips a parameter with none
        params: list[torch.Tensor] = [self.params[i] for i in held]
        grads = [p.grad for p in params if p.grad is not None]
        buffers = [self.buffers[i] for i in held]
        settings = self.settings
        sgd(
            params,
            grads,
            buffers,
            weight_decay=settings.weight_decay,
            momentum=settings.momentum,
            lr=settings.lr,
            dampening=0.0,
            nesterov=False,
            maximize=False,
            has_sparse_grad=any(g.is_sparse for g in grads),
            foreach=None,  # torch's default for the tensors' device, as the class leaves it
            fused=None,
        )
        if settings.momentum != 0:
            for i, buffer in zip(held, buffers, strict=True):
                self.buffers[i] = buffer


def _stepper(model: nn.Module, settings: TrainSettings) -> Stepper:
    """SGD without DP-SGD by `SGDSteps`; Adam, and any optimiser Opacus wraps, by torch's class."""
    if settings.optimizer == "sgd" and settings.dp_noise_multiplier is None:
        return SGDSteps(model, settings)
    return make_optimizer(model, settings)


def cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def local_sgd(
    model: nn.Module,
    data: TensorDataset,
    settings: TrainSettings,
    generator: torch.Generator,
    *,
    loss_fn: LossFn = cross_entropy,
    after_backward: Callable[[nn.Module], None] | None = None,
) -> TrainStats:
    """`local_epochs` passes over `data` in batches shuffled by `generator`; a trailing batch of one
    sample is skipped, and with `settings.drop_last` any trailing batch short of `batch_size`.

    `loss_fn` lets an algorithm add its terms (FedProx's proximal term, distillation);
    `after_backward` lets it correct gradients (SCAFFOLD's control variates).
    """
    model.train()
    optimizer = _stepper(model, settings)
    trained, close = model, None
    if settings.dp_noise_multiplier is not None:
        from fedmq.fedcore.privacy import private_training  # Opacus, only for DP-SGD

        assert isinstance(optimizer, torch.optim.Optimizer)  # what Opacus wraps (`_stepper`)
        trained, optimizer, close = private_training(model, optimizer, settings, generator)
    try:
        return _epochs(trained, optimizer, data, settings, generator, loss_fn, after_backward)
    finally:
        if close is not None:
            close()


def autocast(settings: TrainSettings, device: torch.device) -> AbstractContextManager[object]:
    """The step's autocast: bfloat16 when `settings.precision` asks for it, otherwise nothing (a float32
    step enters no autocast at all). Its cache of cast weights is off, as a CUDA graph's capture requires
    (the weights change every step anyway)."""
    if settings.precision != "bf16":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=False)


class LossTotal:
    """The local epochs' sum of each batch's loss times its size, added as Python adds floats (float64,
    in order). On a GPU the sum stays on the device and is read once, at the end: a read at every step
    would make the host wait for each step to finish before launching the next, so host and GPU would
    take turns instead of working side by side (the issue-28 table: 17,177 images/s against 21,756 for
    the same loop without the read, on an H100). On a CPU, where nothing runs beside the host, it is a
    Python float: a tensor's operations would cost more than the read. Either way the same bits."""

    def __init__(self, on_device: bool | None = None) -> None:
        self.on_device = on_device
        """None: decided by the first loss's device (a CUDA device or not)."""
        self.total = 0.0
        self.device_total: torch.Tensor | None = None

    def add(self, loss: torch.Tensor, samples: int) -> None:
        if self.on_device is None:
            self.on_device = loss.device.type != "cpu"
        if not self.on_device:
            self.total += float(loss.detach()) * samples
            return
        if self.device_total is None:
            self.device_total = torch.zeros((), dtype=torch.float64, device=loss.device)
        self.device_total += loss.detach().double() * samples  # float32 to float64 is exact, as float() is

    def value(self) -> float:
        return self.total if self.device_total is None else float(self.device_total)


def _epochs(
    model: nn.Module,
    optimizer: Stepper,
    data: TensorDataset,
    settings: TrainSettings,
    generator: torch.Generator,
    loss_fn: LossFn,
    after_backward: Callable[[nn.Module], None] | None,
) -> TrainStats:
    n = len(data)
    total, steps, seen = LossTotal(), 0, 0
    private = settings.dp_noise_multiplier is not None  # the DP optimizer clips each sample's gradient itself
    for _ in range(settings.local_epochs):
        order = torch.randperm(n, generator=generator, device=generator.device).to(data.x.device)
        for start in range(0, n, settings.batch_size):
            idx = order[start : start + settings.batch_size]
            if len(idx) == 1 and n > 1:
                break  # a trailing batch of one sample: BatchNorm cannot train on it (and it weighs nothing)
            if settings.drop_last and len(idx) < settings.batch_size:
                break  # DataLoader(drop_last=True): a short last batch is not trained on
            x, y = data.train_batch(idx, generator)
            optimizer.zero_grad(set_to_none=True)
            with autocast(settings, x.device):
                loss = loss_fn(model, x, y)
            loss.backward()
            if after_backward is not None:
                after_backward(model)
            if settings.max_grad_norm is not None and not private:
                nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
            optimizer.step()
            total.add(loss, len(idx))
            steps += 1
            seen += len(idx)
    return TrainStats(loss=total.value() / max(seen, 1), steps=steps, samples_seen=seen)


@torch.no_grad()
def evaluate(
    model: nn.Module, data: TensorDataset, *, batch_size: int = 1024, device: torch.device | None = None
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) over `data`, on `device` (a copy of the model goes there) or the model's."""
    here = next(model.parameters()).device
    if device is not None and device != here:
        model = copy.deepcopy(model).to(device)
        here = device
    model.eval()
    # summed on the device and read once (a read per batch waits for the device each time); each batch's
    # float32 loss added in float64, as Python's float sum of them adds
    correct = torch.zeros((), dtype=torch.long, device=here)
    loss_sum = torch.zeros((), dtype=torch.float64, device=here)
    for start in range(0, len(data), batch_size):
        x, y = data.eval_batch(start, start + batch_size)
        x, y = x.to(here, non_blocking=True), y.to(here, non_blocking=True)
        logits = model(x)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").double()
        correct += (logits.argmax(1) == y).sum()
    n = max(len(data), 1)
    return int(correct) / n, float(loss_sum) / n


def best_device() -> torch.device:
    """CUDA when present, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with `n` torch threads (sums then run in one order: reproducible), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
