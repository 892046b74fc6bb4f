"""FedGKD: federated learning with global knowledge distillation.

Yao, Pan, Dai, Wan, Ding, Yu, Jin, Xu and Sun, "FedGKD: Toward Heterogeneous Federated Learning via
Global Knowledge Distillation", IEEE Transactions on Computers 73(1), 2024 (arXiv 2021 as "Local-
Global Knowledge Distillation in Heterogeneous Federated Learning with Non-IID Data"),
https://arxiv.org/abs/2107.00051; code https://github.com/CGCL-codes/FedGKD (``master_fedgkd.py``,
``worker_fedgkd.py``).

The coordinator keeps a buffer of the last M global models and sends, besides the global model,
their parameter average as the teacher (the "FedGKD" variant; FedGKD-VOTE, which weights the buffer
by validation loss, is not implemented). A node starts from the global model and minimises

    CE(w; x, y) + (gamma / 2) KL(q_teacher^tau || q_w^tau)

where q^tau = softmax(logits / tau), the KL is averaged over the batch and the teacher runs in eval
mode without gradients. The coordinator aggregates as FedAvg does (sample-weighted average), then
appends the new global model to the buffer (FIFO of `buffer_size`).

Paper vs code, and choices:
- KD scale (`kd_scale`): "paper" (default) is (gamma / 2) KL, the paper's proximal-style weight,
  which KDIA's code also uses for its FedGKD baseline; "code" is the authors' code,
  gamma tau^2 KL (``_divergence``: tau^2 x batchmean forward KL).
- KDIA's code implements the KD term as ``CrossEntropyLoss(softmax(s / tau), softmax(t / tau))``,
  which applies softmax twice (kdia.md section 4); that quirk is not reproduced.
- Buffer timing follows the authors' code: only aggregated global models enter the buffer (not the
  random initial model), so round 0 trains without distillation (the code skips KD in its first
  round) and round t >= 1 distils from the mean of the last min(t, M) global models, the current
  one included. KDIA's code instead fills its ring buffer with 5 copies of the initial model and
  uses each client's starting model as the teacher for rounds < 5.
- ``gamma = 0`` trains exactly as FedAvg does (no teacher is sent, the term is skipped).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fedmq.fedcore.aggregation import weighted_average
from fedmq.fedcore.algorithms import base, shared
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.tensors import StateDict, cpu_copy
from fedmq.fedcore.training import LossFn
from fedmq.fedcore.vectorized import NodeBatch, nll, weighted_sum

BUFFER = "buffer/"
"""Prefix of the buffered models in `CoordinatorHalf.state_dict`: ``buffer/{i}/{name}``, oldest first."""
KD_SCALES = ("paper", "code")


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    gamma: float = 0.2
    """Weight of the distillation term, non-negative (KDIA paper's mu: grid 0.02, 0.1, 0.2; default 0.2)."""
    temperature: float = 2.0
    """Distillation temperature tau, positive (KDIA's code: 2)."""
    buffer_size: int = 5
    """M, how many of the latest global models the teacher averages (the code's ``buffer_length``: 5)."""
    kd_scale: str = "paper"
    """"paper": (gamma / 2) KL; "code": gamma tau^2 KL, as the authors' code computes it."""

    def __post_init__(self) -> None:
        base.require_non_negative(self, "gamma")
        base.require_positive(self, "temperature")
        if self.buffer_size < 1:
            raise ValueError(f"buffer_size must be at least 1, got {self.buffer_size!r}")
        if self.kd_scale not in KD_SCALES:
            raise ValueError(f"kd_scale must be one of {', '.join(map(repr, KD_SCALES))}, got {self.kd_scale!r}")

    @property
    def kd_weight(self) -> float:
        """The factor in front of the batch-mean KL."""
        return self.gamma / 2.0 if self.kd_scale == "paper" else self.gamma * self.temperature**2


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(softmax(teacher / tau) || softmax(student / tau)), summed over classes, averaged over the batch."""
    return F.kl_div(
        F.log_softmax(student_logits / temperature, dim=1),
        F.log_softmax(teacher_logits / temperature, dim=1),
        reduction="batchmean",
        log_target=True,
    )


class CoordinatorHalf(base.CoordinatorHalf[Hyperparams]):
    """Async mode: every aggregation's model (one per version) enters the buffer, so the teacher is
    the mean of the last M model versions."""

    sync_only = None

    def __init__(self, hp: Hyperparams, *, model: nn.Module, device: torch.device | None = None) -> None:
        super().__init__(hp, model=model, device=device)
        self.buffer: list[StateDict] = []
        """The latest global models (copies, on the CPU), oldest first: at most `buffer_size`."""

    def teacher(self) -> StateDict:
        """The ensemble teacher: the plain parameter mean of the buffered global models."""
        return weighted_average(self.buffer, [1.0] * len(self.buffer))

    def configure_round(self, ctx: base.RoundContext) -> base.Payload:
        distill = self.hp.gamma > 0.0 and bool(self.buffer)
        tensors = {"model": self.model.state_dict()}
        if distill:
            tensors["teacher"] = self.teacher()
        return base.Payload(tensors=tensors, meta={"distill": distill})

    def aggregate(
        self, ctx: base.RoundContext, updates: Sequence[base.NodeUpdate], failures: Sequence[base.Failure]
    ) -> Mapping[str, float]:
        weights = [float(u.num_samples) for u in updates]
        # w_{t+1} = sum_k (n_k / n) w^k_{t+1}, as FedAvg; then w_{t+1} joins the buffer of global models
        self.model.load_state_dict(self.next_model(ctx, updates, weights))
        self.buffer.append(cpu_copy(self.model.state_dict()))
        del self.buffer[: -self.hp.buffer_size]
        return {"train_loss": shared.mean_reported_loss(updates, weights)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{BUFFER}{i}/{name}": t for i, state in enumerate(self.buffer) for name, t in state.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        reference = self.model.state_dict()
        slots: dict[int, StateDict] = {}
        for key, tensor in state.items():
            index, sep, name = key.removeprefix(BUFFER).partition("/")
            if not key.startswith(BUFFER) or not sep or not index.isdigit():
                raise ValueError(f"FedGKD state holds an unexpected entry {key!r}")
            slots.setdefault(int(index), {})[name] = tensor
        if sorted(slots) != list(range(len(slots))):
            raise ValueError(f"FedGKD buffer slots {sorted(slots)} are not 0..{len(slots) - 1}")
        buffer = []
        for i in range(len(slots)):
            saved = slots[i]
            if saved.keys() != reference.keys():
                raise ValueError(f"FedGKD buffered model {i} does not match the model's state dict")
            for name, t in saved.items():
                if t.shape != reference[name].shape or t.dtype != reference[name].dtype:
                    raise ValueError(f"FedGKD buffered model {i}: {name} does not match the model")
            buffer.append(cpu_copy(saved))
        self.buffer = buffer[-self.hp.buffer_size :]


class NodeHalf(shared.LossTermNode[Hyperparams]):
    def objective(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> LossFn | None:
        distill = shared.task_flag(task, "distill", node_id=self.node_id)
        if not distill or self.hp.gamma == 0.0:
            return None
        teacher = shared.frozen_model(task, "fedgkd-teacher", "teacher", node_id=self.node_id)
        weight, tau = self.hp.kd_weight, self.hp.temperature

        def objective(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = m(x)
            with torch.no_grad():
                teacher_logits = teacher(x)
            # CE + (gamma / 2) KL(q_teacher^tau || q^tau)   [or gamma tau^2 KL: kd_scale "code"]
            return F.cross_entropy(logits, y) + weight * distillation_loss(logits, teacher_logits, tau)

        return objective

    def group_term(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> shared.GroupTerm | None:
        distill = shared.task_flag(task, "distill", node_id=self.node_id)
        if not distill or self.hp.gamma == 0.0:
            return None
        teacher_model = shared.frozen_model(task, "fedgkd-teacher", "teacher", node_id=self.node_id)
        device = next(model.parameters()).device
        # the teacher is the task's, the same for every member of the group: captured, not an input
        teacher = {name: p.detach().to(device) for name, p in teacher_model.named_parameters()}
        weight, tau = self.hp.kd_weight, self.hp.temperature
        # the teacher's log softmax at tau on each step's batch, made before the steps
        log_p = shared.frozen_output(model, data, teacher, then=lambda logits: F.log_softmax(logits / tau, dim=-1))

        def objective(batch: NodeBatch) -> torch.Tensor:
            logits = batch.logits()
            s = F.log_softmax(logits / tau, dim=-1)
            t = batch.step["teacher_log_p"]
            return batch.mean(weighted_sum(nll(logits, batch.y), (weight, (t.exp() * (t - s)).sum(-1))))

        # the teacher's tensors are the spare model's, loaded in place each round: their addresses in the key
        key = (self.hp, tuple(t.data_ptr() for t in teacher.values()))
        return shared.GroupTerm(objective, key=key, outputs={"teacher_log_p": log_p})


SPEC = base.AlgorithmSpec(name="fedgkd", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
