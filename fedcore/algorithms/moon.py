"""MOON: model-contrastive federated learning.

Li, He and Song, "Model-Contrastive Federated Learning", CVPR 2021, https://arxiv.org/abs/2103.16257;
code https://github.com/QinbinLi/MOON (``train_net_fedcon``). A node starts from the global model
w^t and minimises, per mini-batch,

    l = l_sup(w; x, y) + mu l_con                                                (Eq. 4)
    l_con = -log [ exp(sim(z, z_glob) / tau)
                   / (exp(sim(z, z_glob) / tau) + sum_j exp(sim(z, z_prev_j) / tau)) ]  (Eq. 3)

where z, z_glob and z_prev_j are the representations of x under the model being trained, the
global model w^t and the node's previous local models, and sim is the cosine similarity. The code
computes l_con as the cross-entropy of the logits [sim(z, z_glob), sim(z, z_prev_1), ...] / tau
with label 0, averaged over the batch; so does `contrastive_loss`. The representation is the
model's `represent` (the projection head's output for "moon-cnn", MOON's simple CNN; the features
for any other model). The global and previous models run in eval mode, without gradients, as in
the code. The coordinator is FedAvg's (sample-weighted average).

Per-node state: the last `previous_models` local models this node trained (the code's
``model_buffer_size``, default 1; FIFO), kept by the node half as state dicts on the CPU, and
loaded into the process's spare models (`TaskInput.scratch`) while the node trains.

Choices and deviations:
- A node's first participation has no previous model, so l_con is left out (a softmax over the
  positive alone is exactly 0). The code does the same in round 0; from round 1 on it uses, for a
  client that has not trained yet, that client's never-trained random initial network as the
  negative, a by-product of keeping N networks, not part of the method.
- The previous models live as long as the node daemon: a restarted node starts without one.
- ``mu = 0`` trains exactly as FedAvg does (the term is skipped, not multiplied by zero).

Group form (`group_term`, `fedcore.vectorized`): the same objective as a pure function of a node's
batch. The global model is the model every member started from (`NodeBatch.start`); each member's
previous models enter as its own tensors (`GroupTerm.inputs`, ``previous{j}.{name}``), in
`previous_models` slots with a mask ``present`` over the global model and the slots: an empty slot (a
node with fewer previous models, or none on its first participation) is filled with the global model
and its similarity set to -inf,
so it drops out of the softmax, and a node with none gets l_con = log(e^s / e^s) = 0 with zero
gradient, as `train`'s skipped term. The frozen models' representations of each step's batch, scaled to
unit length, are made before the steps on a GPU (`shared.frozen_output`; the previous models' per node,
from the members' inputs), so that a step runs the model being trained alone. After the group trains,
each member's half keeps its own trained model (`trained`, called by `LossTermNode.train_group`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fedmq.fedcore.algorithms import base, shared
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.tensors import StateDict, cpu_copy
from fedmq.fedcore.training import LossFn
from fedmq.fedcore.vectorized import NodeBatch, functional_method, nll, weighted_sum


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    mu: float = 5.0
    """Weight of the model-contrastive loss, non-negative (KDIA paper: grid 1, 5, 10; default 5)."""
    temperature: float = 0.5
    """The contrastive temperature tau, positive (MOON's and KDIA's code: 0.5)."""
    previous_models: int = 1
    """How many of the node's previous local models serve as negatives (MOON's code: 1)."""

    def __post_init__(self) -> None:
        base.require_non_negative(self, "mu")
        base.require_positive(self, "temperature")
        if self.previous_models < 1:
            raise ValueError(f"previous_models must be at least 1, got {self.previous_models!r}")


def contrastive_loss(
    z: torch.Tensor, z_global: torch.Tensor, z_previous: Sequence[torch.Tensor], temperature: float
) -> torch.Tensor:
    """MOON's l_con (Eq. 3), averaged over the batch: the positive pair is (z, z_global), the
    negatives (z, z_previous[j]); similarities are cosine, divided by `temperature`."""
    sims = [F.cosine_similarity(z, z_global, dim=-1)]
    sims += [F.cosine_similarity(z, zp, dim=-1) for zp in z_previous]
    logits = torch.stack(sims, dim=1) / temperature
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


COSINE_EPS = 1e-8
"""`F.cosine_similarity`'s eps: the least norm each side is divided by."""


def unit(z: torch.Tensor) -> torch.Tensor:
    """z over its norm along the last dimension (at least `COSINE_EPS`), as `F.cosine_similarity` scales
    each side, its gradient included (the clamp is left out of it): so that a frozen side is scaled once,
    before the steps, and the sum of the products of the scaled sides is the similarity."""
    norm = torch.linalg.vector_norm(z, dim=-1, keepdim=True).clone()  # the norm's backward reads its own output
    with torch.no_grad():
        norm.clamp_min_(COSINE_EPS)
    return z / norm


CoordinatorHalf = shared.AveragingCoordinator
"""FedAvg's server: the global model is the sample-weighted average of the updates."""


class NodeHalf(shared.LossTermNode[Hyperparams]):
    def __init__(self, hp: Hyperparams, *, node_id: str) -> None:
        super().__init__(hp, node_id=node_id)
        self.previous: list[StateDict] = []
        """This node's last local models, oldest first, on the CPU (at most `previous_models`)."""

    def objective(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> LossFn | None:
        mu, tau = self.hp.mu, self.hp.temperature
        if mu == 0.0:
            return None
        represent = self._representation(model, task.round)
        frozen = [self._representation(m, task.round) for m in self._frozen_models(task)]

        def objective(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            z, logits = represent(x)
            loss = F.cross_entropy(logits, y)  # l_sup
            if frozen:  # [global model, previous models...]; none before a first previous model
                with torch.no_grad():
                    z_glob, *z_prev = (rep(x)[0] for rep in frozen)
                loss = loss + mu * contrastive_loss(z, z_glob, z_prev, tau)  # l_sup + mu l_con
            return loss

        return objective

    def group_term(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> shared.GroupTerm | None:
        mu, tau, slots = self.hp.mu, self.hp.temperature, self.hp.previous_models
        if mu == 0.0:
            return None
        self._representation(model, task.round)  # the same AlgorithmError as `train` for a model without one
        represent = functional_method(model, "represent")
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        start = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
        # column 0 the global model's (always there), column 1 + j previous model j's, if the node has one
        inputs = {"present": torch.arange(1 + slots) <= len(self.previous)}
        for j in range(slots):  # an empty slot holds the global model, masked out by `present`
            state = self.previous[j] if j < len(self.previous) else start
            inputs |= {f"previous{j}.{name}": state[name].to(start[name]) for name in names}

        def z_of(params: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = represent(params, x)
            assert isinstance(out, tuple)
            return out[0], out[1]

        # the representations of each step's batch under the global model (the workspace holds it) and under
        # each of the node's previous models (its inputs), made before the steps, each scaled to unit length
        def z_only(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return unit(out[0])

        outputs = {"global_z": shared.frozen_output(model, data, method="represent", then=z_only)}
        for j in range(slots):
            made = shared.frozen_output(model, data, method="represent", then=z_only, node_params=f"previous{j}.")
            outputs[f"previous{j}_z"] = made

        def objective(batch: NodeBatch) -> torch.Tensor:
            z, logits = z_of(batch.params, batch.x)
            others = [batch.step["global_z"], *(batch.step[f"previous{j}_z"] for j in range(slots))]
            # every cosine similarity at once, (B, 1 + slots): z scaled once, its gradient one sum, where one
            # cosine_similarity per model took a dozen operators each way; the frozen sides came scaled
            sims = (unit(z).unsqueeze(-2) * torch.stack(others, dim=-2).detach()).sum(-1)
            con = torch.where(batch.inputs["present"], sims, float("-inf")) / tau
            # l_con: -log softmax of the positive (column 0)
            l_con = torch.logsumexp(con, dim=-1) - con[..., 0]
            # l_sup + mu l_con, one mean of their per-sample sum (`fedcore.vectorized.weighted_sum`)
            return batch.mean(weighted_sum(nll(logits, batch.y), (mu, l_con)))

        return shared.GroupTerm(objective, inputs, key=self.hp, outputs=outputs)

    def group_refusal(self, model: nn.Module) -> str | None:
        if not callable(getattr(model, "represent", None)):  # `train` then says so, as an AlgorithmError
            return f"MOON needs a model with represent(x) -> (z, logits), not {type(model).__name__}"
        return super().group_refusal(model)

    def trained(self, model: nn.Module) -> None:
        # the model just trained is this node's newest previous model (FIFO of `previous_models`)
        self.previous.append(cpu_copy(model.state_dict()))
        del self.previous[: -self.hp.previous_models]

    def _frozen_models(self, task: base.TaskInput) -> list[nn.Module]:
        """The global model, then the previous local models, in the process's spare modules in eval
        mode; none while this node has no previous model (l_con needs a negative)."""
        if not self.previous:
            return []
        global_model = task.scratch("moon-global")
        shared.load_group(task, "model", global_model, node_id=self.node_id)
        frozen = [global_model]
        for i, state in enumerate(self.previous):
            module = task.scratch(f"moon-previous-{i}")
            module.load_state_dict(state)
            frozen.append(module)
        for module in frozen:
            module.eval()
        return frozen

    def _representation(
        self, model: nn.Module, round: int
    ) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        represent = getattr(model, "represent", None)
        if represent is None:
            raise AlgorithmError(
                f"MOON needs a model with represent(x) -> (z, logits), not {type(model).__name__}",
                node_id=self.node_id,
                round=round,
            )
        return represent  # type: ignore[no-any-return]


SPEC = base.AlgorithmSpec(name="moon", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
