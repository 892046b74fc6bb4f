"""FedDyn: federated learning with dynamic regularisation.

Acar, Zhao, Matas, Mattina, Whatmough and Saligrama, "Federated Learning Based on Dynamic
Regularization", ICLR 2021, https://arxiv.org/abs/2111.04263; code
https://github.com/alpemreacar/FedDyn (``utils_methods.py`` ``train_FedDyn``, ``utils_general.py``
``train_feddyn_mdl``). Algorithm 1, with theta^{t-1} the server model, node k's gradient state
grad_k (zero before its first round), alpha > 0 and m the number of nodes in the federation:

    node k:  theta_k^t = argmin_theta L_k(theta) - <grad_k, theta> + (alpha/2) ||theta - theta^{t-1}||^2
             grad_k <- grad_k - alpha (theta_k^t - theta^{t-1})
    server:  h^t = h^{t-1} - alpha (1/m) sum_{k in P_t} (theta_k^t - theta^{t-1})      (h^0 = 0)
             theta^t = (1/|P_t|) sum_{k in P_t} theta_k^t - (1/alpha) h^t

The argmin is approximated, as in the paper's experiments, by the round's local SGD on that
objective: every mini-batch gradient of the cross-entropy gets - grad_k + alpha (theta - theta^{t-1})
added (``local_sgd``'s ``after_backward``), the gradient of the two regularisers. The mean of the
theta_k comes from `self.average` (FedSA's rule can replace it, spec fedsa.md section 1.11); h
follows its own rule, the plain sum of the node drifts over m. h is checkpointed (`state_dict`);
grad_k lives on the node half, on the CPU, as long as the node daemon (a restarted node starts
again from zero).

Choices and deviations:
- The regularisers and grad_k, h cover the trainable parameters only; buffers (BatchNorm's running
  statistics) take the average, as in FedAvg. Parameters the loss does not reach are left alone,
  as the optimiser leaves them.
- The reported training loss is the cross-entropy alone (comparable with FedAvg's), not the
  regularised objective, whose linear term has no natural scale.
- `weighted` (default false): the paper's and the code's plain mean over P_t; true weighs the
  models by sample count like FedAvg. h is always the unweighted sum over m.
- m (`num_nodes`): the coordinator knows only the nodes it has selected so far (the participation
  record); 0 (the default) takes m = the number of nodes the record holds, which is the
  federation's size once every node has been selected (at once with full participation) and
  smaller before that (h then moves faster). Set `num_nodes` to the federation's size to follow
  the paper from the first round; a value below the nodes already seen is raised to that count,
  with a warning.
- The authors' code scales alpha per client by the mean sample count over n_k (``alpha_coef /
  weight_list[clnt]``, "adaptive alpha"); the paper's alpha is the same for every node, and so is
  this module's (a node does not know the federation's mean sample count). The code folds
  alpha (theta) into SGD's weight decay and clips gradients at norm 10 (here ``train.max_grad_norm``).
- The code reports the accuracy of the mean of the round's node models as well as the server
  model's; `evaluate_average` adds that mean as a second evaluated model ("average"); the server
  model theta^t stays the first, reported as ``accuracy``.
- Momentum and weight decay (``train.momentum``, ``train.weight_decay``) act on the regularised
  gradient as torch's SGD does; the update of grad_k assumes an exact local minimiser whatever the
  optimiser, as the paper does.
- A node updates grad_k when it sends its update; if the update is then dropped, h misses that
  drift (the paper assumes the sampled nodes' updates arrive).
- The first local step of a node's first round is FedAvg's exactly (both regularisers have zero
  gradient at theta = theta^{t-1} with grad_k = 0); alpha must be positive (the server divides by it).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from fedmq.fedcore.algorithms import base, shared
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.training import local_sgd
from fedmq.fedcore.vectorized import NodeBatch, train_vectorized, unsupported

STATE_PREFIX = "h/"
"""Prefix of h's entries in `CoordinatorHalf.state_dict`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    alpha: float = 0.01
    """Regularisation weight alpha, positive (paper grid 0.1, 0.01, 0.001; the authors' example script: 0.01)."""
    weighted: bool = False
    """Weight the node models by sample count in the mean (false: the paper's and code's plain mean)."""
    num_nodes: int = 0
    """m in h's update, non-negative; 0: the nodes the coordinator has selected so far (the participation record)."""
    evaluate_average: bool = False
    """Also evaluate the plain mean of the round's node models ("average"), as the authors' code reports."""

    def __post_init__(self) -> None:
        base.require_positive(self, "alpha")
        if self.num_nodes < 0:
            raise ValueError(f"num_nodes must be 0 (from the participation record) or positive, got {self.num_nodes!r}")


# -- the rules, as small functions -------------------------------------------------------------


def regulariser_gradient(theta: torch.Tensor, anchor: torch.Tensor, grad_k: torch.Tensor, alpha: float) -> torch.Tensor:
    """The gradient of - <grad_k, theta> + (alpha/2) ||theta - anchor||^2: alpha (theta - anchor) - grad_k."""
    return alpha * (theta - anchor) - grad_k


def gradient_state_step(
    grad_k: torch.Tensor, theta_k: torch.Tensor, theta_server: torch.Tensor, alpha: float
) -> torch.Tensor:
    """grad_k - alpha (theta_k - theta^{t-1}), the node's new gradient state (Alg. 1)."""
    return grad_k - alpha * (theta_k - theta_server)


def server_state_step(
    h: torch.Tensor, models: Sequence[torch.Tensor], theta_server: torch.Tensor, alpha: float, num_nodes: int
) -> torch.Tensor:
    """h - alpha (1/m) sum_k (theta_k - theta^{t-1}) over the round's node models (Alg. 1)."""
    drift = torch.zeros_like(h)
    for theta_k in models:
        drift.add_(theta_k.to(h.dtype) - theta_server.to(h.dtype))
    return h - (alpha / num_nodes) * drift


def server_model(average: torch.Tensor, h: torch.Tensor, alpha: float) -> torch.Tensor:
    """theta^t = mean_k theta_k - h / alpha (Alg. 1)."""
    return average - h / alpha


# -- the two halves ----------------------------------------------------------------------------


class CoordinatorHalf(base.CoordinatorHalf[Hyperparams]):
    sync_only = (
        "FedDyn updates its server state h from the drift of one round's models from the model they "
        "all trained from, so it has no form for updates trained from different versions"
    )

    def __init__(self, hp: Hyperparams, *, model: nn.Module, device: torch.device | None = None) -> None:
        super().__init__(hp, model=model, device=device)
        self.h: dict[str, torch.Tensor] = shared.zero_state(shared.trainable(model))
        """h, one tensor per trainable parameter; zero before the first round."""
        self.average_model: nn.Module | None = copy.deepcopy(model) if hp.evaluate_average else None
        """The last round's mean of the node models (only with `evaluate_average`)."""

    def configure_round(self, ctx: base.RoundContext) -> base.Payload:
        return base.Payload(tensors={"model": self.model.state_dict()})

    def aggregate(
        self, ctx: base.RoundContext, updates: Sequence[base.NodeUpdate], failures: Sequence[base.Failure]
    ) -> Mapping[str, float]:
        weights = shared.sample_weights(updates, weighted=self.hp.weighted)
        average = shared.sync_average(self, ctx, updates, weights)
        models = [u.payload.tensors["model"] for u in updates]
        m = shared.federation_size(self.hp.num_nodes, ctx, len(updates), method="FedDyn")
        alpha = self.hp.alpha
        new: dict[str, torch.Tensor] = {}
        for name, current in self.model.state_dict().items():
            if name not in self.h:
                new[name] = average[name]  # buffers: the average, as in FedAvg
                continue
            h = self.h[name]
            h.copy_(server_state_step(h, [state[name] for state in models], current, alpha, m))
            new[name] = server_model(average[name].to(h.dtype), h, alpha).to(current.dtype)
        self.model.load_state_dict(new)
        if self.average_model is not None:
            self.average_model.load_state_dict(average)
        return {
            "train_loss": shared.mean_reported_loss(updates, weights),
            "h_norm": shared.state_norm(self.h.values()),
            "federation_size": float(m),
        }

    def evaluation_models(self) -> Mapping[str, nn.Module]:
        if self.average_model is None:
            return {"global": self.model}
        return {"global": self.model, "average": self.average_model}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {STATE_PREFIX + name: h for name, h in self.h.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        shared.load_tensors(self.h, state, STATE_PREFIX, owner="FedDyn", what="h")


class NodeHalf(base.NodeHalf[Hyperparams]):
    def __init__(self, hp: Hyperparams, *, node_id: str) -> None:
        super().__init__(hp, node_id=node_id)
        self.gradient: dict[str, torch.Tensor] | None = None
        """grad_k on the CPU, one tensor per trainable parameter; None (meaning zero) before the first task."""

    def train(
        self, task: base.TaskInput, model: nn.Module, data: TensorDataset, generator: torch.Generator
    ) -> base.Payload:
        shared.load_group(task, "model", model, node_id=self.node_id)
        alpha = self.hp.alpha
        params = shared.trainable(model)
        self._check_state(params, task.round)
        assert self.gradient is not None
        anchor = {name: p.detach().clone() for name, p in params}  # theta^{t-1}
        terms = [(p, anchor[name], self.gradient[name].to(p.device, p.dtype)) for name, p in params]

        def regularise(_: nn.Module) -> None:
            for p, a, g in terms:
                if p.grad is None:
                    continue
                # grad of L_k(theta) - <grad_k, theta> + (alpha/2) ||theta - theta^{t-1}||^2
                p.grad.add_(regulariser_gradient(p.detach(), a, g, alpha))

        stats = local_sgd(model, data, task.settings, generator, after_backward=regularise)
        self._step_state({name: p.detach() for name, p in params}, anchor)
        return shared.model_update(model.state_dict(), stats)

    def train_group(self, members: Sequence[base.GroupMember], model: nn.Module) -> list[base.Payload]:
        """`train` for every member at once: the regulariser as a loss term on each member's parameters,
        with its own grad_k in the group's inputs. The term is added to the loss as ``reg - reg.detach()``
        (`shared.gradient_terms`): its gradient is the one `train` adds after the backward pass, and the
        loss reported stays the cross-entropy, as `train` reports it."""
        first = shared.start_group(self, members, model)
        params = shared.trainable(model)
        halves = [cast(NodeHalf, m.half) for m in members]
        for half, member in zip(halves, members, strict=True):
            half._check_state(params, member.task.round)
        anchor = {name: p.detach().clone() for name, p in params}
        names, alpha = [name for name, _ in params], self.hp.alpha
        dtypes = {name: p.dtype for name, p in params}
        inputs = {
            name: torch.stack([h.gradient[name].to(dtypes[name]) for h in halves])  # type: ignore[index]
            for name in names
        }

        def regulariser(batch: NodeBatch) -> Iterator[torch.Tensor]:
            """- <grad_k, theta> + (alpha/2) ||theta - theta^{t-1}||^2, parameter by parameter."""
            for n in names:
                theta, start, grad_k = batch.params[n], batch.start[n], batch.inputs[n]
                yield (alpha / 2) * (theta - start).pow(2).sum() - (grad_k * theta).sum()

        # kept from round to round (`keep_as`): the regulariser reads its batch, its inputs and alpha
        results = train_vectorized(
            model, [m.data for m in members], first.task.settings, [m.generator for m in members],
            objective=shared.gradient_terms(regulariser), inputs=inputs, keep_as=("feddyn", self.hp),
        )  # fmt: skip
        for half, (state, _) in zip(halves, results, strict=True):
            half._step_state({name: state[name] for name in names}, anchor)
        return [shared.model_update(state, stats) for state, stats in results]

    def group_refusal(self, model: nn.Module) -> str | None:
        return super().group_refusal(model) or unsupported(model)

    def _check_state(self, params: Sequence[tuple[str, nn.Parameter]], round: int) -> None:
        """grad_k made (zero before the first round) and matching the model's parameters."""
        self.gradient = shared.node_state(self.gradient, params, node_id=self.node_id, round=round)

    def _step_state(self, trained: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor]) -> None:
        """grad_k <- grad_k - alpha (theta_k - theta^{t-1}), from the node's trained parameters."""
        assert self.gradient is not None
        for name, theta in trained.items():
            state = self.gradient[name]
            theta_k, theta_server = theta.to("cpu", state.dtype), anchor[name].to("cpu", state.dtype)
            self.gradient[name] = gradient_state_step(state, theta_k, theta_server, self.hp.alpha)


SPEC = base.AlgorithmSpec(name="feddyn", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
