"""SCAFFOLD: stochastic controlled averaging with server and node control variates.

Karimireddy, Kale, Mohri, Reddi, Stich and Suresh, "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning", ICML 2020, https://arxiv.org/abs/1910.06378. No official code was released;
the FedDyn authors' ``train_SCAFFOLD`` (https://github.com/alpemreacar/FedDyn, ``utils_methods.py``)
and NIID-Bench's are the usual references. Algorithm 1, with x the global model, c the server's
control variate and c_i node i's:

    node i (starting from y_i = x), K local steps:
        y_i <- y_i - eta_l (g_i(y_i) - c_i + c)                          (Alg. 1 line 10)
    c_i+ = g_i(x)                                                        (line 12, option I)
    c_i+ = c_i - c + (x - y_i) / (K eta_l)                               (line 12, option II)
    update: (Delta y_i, Delta c_i) = (y_i - x, c_i+ - c_i); c_i <- c_i+  (lines 13-14)
    server: x <- x + eta_g (1/|S|) sum_i Delta y_i                       (lines 16-17)
            c <- c + (|S| / N) (1/|S|) sum_i Delta c_i

The task carries x (group ``model``) and c (group ``control``); an update carries y_i (``model``)
and Delta c_i (``control_delta``, declared in `update_schema`). The server computes the mean of
the y_i with `self.average` (so FedSA's rule can replace it, spec fedsa.md section 1.11) and steps
x <- x + eta_g (average - x); c follows its own rule, the plain sum of the deltas over N.

Choices and deviations:
- Control variates exist for the trainable parameters only. Buffers (BatchNorm's running
  statistics) take the average as in FedAvg, not the eta_g step (extrapolating a running variance
  could make it negative). With eta_g = 1 the parameters take the average exactly, not
  x + (average - x), so the neutral case is bit for bit FedAvg's.
- `weighted` (default false): the paper averages the y_i with 1/|S|; true weighs them by sample
  count like FedAvg (NIID-Bench does). The Delta c_i are always summed unweighted, as in the paper.
- N, the number of nodes in the federation (`num_nodes`): the coordinator knows only the nodes it
  has selected so far (the participation record), so 0 (the default) takes N = the number of nodes
  the record holds, which is the federation's size once every node has been selected (at once with
  full participation) and smaller before that (c then moves faster in the first rounds). Set
  `num_nodes` to the federation's size to follow the paper from the first round; a value below the
  nodes already seen is raised to that count, with a warning.
- K is the number of local steps the node actually took (``local_sgd``'s count, which skips a
  trailing batch of one), so nodes with more data have larger K; the paper takes the same K for all.
- `control_update` picks c_i+: ``option_ii`` (default, the paper's choice in its experiments),
  ``option_i`` (the full-batch gradient of the cross-entropy at x, an extra pass over the node's
  data in train mode without augmentation, weight decay not included), or ``gradient_mean`` (the
  mean of the raw mini-batch gradients of the local steps, before the correction). Under plain SGD
  without weight decay, option II equals ``gradient_mean`` up to rounding: (x - y)/(K eta_l) is
  then the mean of the corrected gradients, (1/K) sum_k g_k - c_i + c.
- Momentum and weight decay (`train.momentum`, `train.weight_decay`): the corrected gradient
  g - c_i + c goes to torch's SGD, which adds weight_decay * y and then folds the sum into its
  momentum buffer, so with momentum beta > 0 every local step is a heavy-ball step on the corrected
  gradient. Option II's (x - y)/(K eta_l) then measures the mean momentum-accumulated step, which
  grows towards 1/(1 - beta) times the mean corrected gradient as K grows: c_i over-estimates the
  local gradient and the correction over-shoots (NIID-Bench keeps this as is). Weight decay makes
  option II estimate the gradient of the regularised loss, consistently in c and c_i. The paper
  assumes plain SGD; ``gradient_mean`` keeps c_i a gradient estimate under momentum. Option II
  with Adam makes no sense and is refused (AlgorithmError). Gradient clipping
  (`train.max_grad_norm`) acts on the corrected gradient.
- Parameters the loss does not reach (no gradient) are left alone, as the optimiser leaves them.
- A node updates c_i when it sends its update. If the update is then dropped (late, lost,
  rejected), c misses that node's Delta c_i and c is no longer the mean of the c_i: the paper
  assumes every sampled node's update arrives. c_i lives as long as the node daemon (on the CPU):
  a restarted node starts again from c_i = 0.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from fedmq.fedcore.algorithms import base, shared
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.tensors import TensorSpec, schema_of
from fedmq.fedcore.training import local_sgd
from fedmq.fedcore.vectorized import NodeBatch, train_vectorized, unsupported

CONTROL = "control"
"""The task's tensor group holding the server control variate c."""
CONTROL_DELTA = "control_delta"
"""The update's tensor group holding Delta c_i = c_i+ - c_i."""
STATE_PREFIX = "control/"
"""Prefix of c's entries in `CoordinatorHalf.state_dict`."""
CONTROL_UPDATES = ("option_ii", "option_i", "gradient_mean")


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    server_lr: float = 1.0
    """Global step size eta_g, positive (the paper's experiments and the FedDyn authors' code: 1)."""
    control_update: str = "option_ii"
    """How c_i+ is computed: "option_ii" (the paper's experiments), "option_i" (the gradient at x) or
    "gradient_mean" (the mean of the local mini-batch gradients; stays a gradient estimate under momentum)."""
    weighted: bool = False
    """Weight the node models by sample count in the average (false: the paper's 1/|S|; true: like FedAvg)."""
    num_nodes: int = 0
    """N in c <- c + (|S|/N) mean(Delta c_i), non-negative; 0: the nodes the coordinator has selected so far."""

    def __post_init__(self) -> None:
        base.require_positive(self, "server_lr")
        if self.control_update not in CONTROL_UPDATES:
            raise ValueError(f"control_update must be one of {', '.join(CONTROL_UPDATES)}, got {self.control_update!r}")
        if self.num_nodes < 0:
            raise ValueError(f"num_nodes must be 0 (from the participation record) or positive, got {self.num_nodes!r}")


# -- the rules, as small functions -------------------------------------------------------------


def corrected_gradient(g: torch.Tensor, c_i: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The direction of a local step: g_i(y) - c_i + c (Alg. 1 line 10)."""
    return g - c_i + c


def option_ii_delta(x: torch.Tensor, y: torch.Tensor, c: torch.Tensor, steps: int, lr: float) -> torch.Tensor:
    """Delta c_i for option II: c_i+ - c_i = (x - y) / (K eta_l) - c (Alg. 1 line 12)."""
    return (x - y) / (steps * lr) - c


def server_model_step(x: torch.Tensor, average: torch.Tensor, server_lr: float) -> torch.Tensor:
    """x + eta_g (average - x) (Alg. 1 line 17); exactly `average` when eta_g = 1."""
    if server_lr == 1.0:
        return average
    return x + server_lr * (average - x)


def server_control_step(c: torch.Tensor, deltas: Sequence[torch.Tensor], num_nodes: int) -> torch.Tensor:
    """c + (|S|/N) (1/|S|) sum_i Delta c_i = c + (1/N) sum_i Delta c_i (Alg. 1 line 17)."""
    total = torch.zeros_like(c)
    for delta in deltas:
        total.add_(delta.to(c.dtype))
    return c + total / num_nodes


def local_gradient(model: nn.Module, data: TensorDataset, batch_size: int) -> dict[str, torch.Tensor]:
    """The full-batch gradient of the mean cross-entropy over `data` at the model's weights (option
    I's g_i(x)), in batches of `batch_size` in train mode, without augmentation. A trailing batch of
    one joins the batch before it (BatchNorm cannot run on one sample). Leaves no gradients behind;
    BatchNorm's running statistics move, so reload the model afterwards."""
    params = shared.trainable(model)
    model.train()
    model.zero_grad(set_to_none=True)
    n = len(data)
    starts = list(range(0, n, batch_size))
    if len(starts) > 1 and n - starts[-1] == 1:
        starts.pop()
    for i, start in enumerate(starts):
        stop = starts[i + 1] if i + 1 < len(starts) else n
        x, y = data.eval_batch(start, stop)
        (F.cross_entropy(model(x), y, reduction="sum") / n).backward()
    grads = {name: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for name, p in params}
    model.zero_grad(set_to_none=True)
    return grads


# -- the two halves ----------------------------------------------------------------------------


class CoordinatorHalf(base.CoordinatorHalf[Hyperparams]):
    sync_only = (
        "SCAFFOLD moves its control variate c by each round's control deltas and sends c with the model, so "
        "an update trained from an older version carries a correction computed against a c the server no longer holds"
    )

    def __init__(self, hp: Hyperparams, *, model: nn.Module, device: torch.device | None = None) -> None:
        super().__init__(hp, model=model, device=device)
        self.control: dict[str, torch.Tensor] = shared.zero_state(shared.trainable(model))
        """c, one tensor per trainable parameter; zero before the first round (Alg. 1 input)."""
        self._dtypes = {name: p.dtype for name, p in shared.trainable(model)}

    def configure_round(self, ctx: base.RoundContext) -> base.Payload:
        if self.hp.control_update == "option_ii" and ctx.settings.optimizer != "sgd":
            message = "SCAFFOLD's option II assumes SGD local steps; use control_update gradient_mean"
            raise AlgorithmError(message, round=ctx.round)
        control = {name: c.to(self._dtypes[name], copy=True) for name, c in self.control.items()}
        return base.Payload(tensors={"model": self.model.state_dict(), CONTROL: control})

    def update_schema(self) -> dict[str, dict[str, TensorSpec]]:
        params = {name: p.detach() for name, p in shared.trainable(self.model)}
        return {"model": schema_of(self.model.state_dict()), CONTROL_DELTA: schema_of(params)}

    def aggregate(
        self, ctx: base.RoundContext, updates: Sequence[base.NodeUpdate], failures: Sequence[base.Failure]
    ) -> Mapping[str, float]:
        weights = shared.sample_weights(updates, weighted=self.hp.weighted)
        average = shared.sync_average(self, ctx, updates, weights)
        new: dict[str, torch.Tensor] = {}
        for name, current in self.model.state_dict().items():
            if name not in self.control:
                new[name] = average[name]  # buffers: the average, as in FedAvg
                continue
            acc = self.control[name].dtype
            step = server_model_step(current.to(acc), average[name].to(acc), self.hp.server_lr)
            new[name] = step.to(current.dtype)  # x <- x + eta_g (average - x)
        self.model.load_state_dict(new)
        n = shared.federation_size(self.hp.num_nodes, ctx, len(updates), method="SCAFFOLD")
        for name, c in self.control.items():
            deltas = [u.payload.tensors[CONTROL_DELTA][name] for u in updates]
            c.copy_(server_control_step(c, deltas, n))  # c <- c + (|S|/N) mean(Delta c_i)
        return {
            "train_loss": shared.mean_reported_loss(updates, weights),
            "control_norm": shared.state_norm(self.control.values()),
            "federation_size": float(n),
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {STATE_PREFIX + name: c for name, c in self.control.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        shared.load_tensors(self.control, state, STATE_PREFIX, owner="SCAFFOLD", what="control")


class NodeHalf(base.NodeHalf[Hyperparams]):
    def __init__(self, hp: Hyperparams, *, node_id: str) -> None:
        super().__init__(hp, node_id=node_id)
        self.control: dict[str, torch.Tensor] | None = None
        """c_i on the CPU, one tensor per trainable parameter; None (meaning zero) before the first task."""

    def train(
        self, task: base.TaskInput, model: nn.Module, data: TensorDataset, generator: torch.Generator
    ) -> base.Payload:
        shared.load_group(task, "model", model, node_id=self.node_id)
        settings, option = task.settings, self.hp.control_update
        if option == "option_ii" and settings.optimizer != "sgd":
            raise self._error(task, "SCAFFOLD's option II assumes SGD local steps, not " + repr(settings.optimizer))
        params = shared.trainable(model)
        c = self._server_control(task, params)
        c_i = self._control(task, params)
        assert self.control is not None
        x = {name: p.detach().clone() for name, p in params}
        g_x = None
        if option == "option_i":  # c_i+ = g_i(x), from an extra pass over the local data
            g_x = local_gradient(model, data, settings.batch_size)
            shared.load_group(task, "model", model, node_id=self.node_id)  # undo the pass's BatchNorm statistics
        grad_sum = {name: torch.zeros_like(p.detach()) for name, p in params} if option == "gradient_mean" else None

        def correct(_: nn.Module) -> None:
            for name, p in params:
                if p.grad is None:
                    continue
                if grad_sum is not None:
                    grad_sum[name].add_(p.grad)
                p.grad.copy_(corrected_gradient(p.grad, c_i[name], c[name]))  # g_i(y) - c_i + c (line 10)

        stats = local_sgd(model, data, settings, generator, after_backward=correct)
        if stats.steps == 0:
            raise self._error(task, "no local step was taken: SCAFFOLD needs K >= 1")
        deltas: dict[str, torch.Tensor] = {}
        for name, p in params:
            acc = shared.accumulator(p.dtype)
            if g_x is not None:  # option I: c_i+ - c_i = g_i(x) - c_i
                delta = g_x[name].to(acc) - c_i[name].to(acc)
            elif grad_sum is not None:  # gradient_mean: c_i+ - c_i = (1/K) sum_k g_i(y_k) - c_i
                delta = grad_sum[name].to(acc) / stats.steps - c_i[name].to(acc)
            else:  # option II: c_i+ - c_i = (x - y)/(K lr) - c
                delta = option_ii_delta(x[name].to(acc), p.detach().to(acc), c[name].to(acc), stats.steps, settings.lr)
            deltas[name] = delta.to(p.dtype)
            self.control[name] += deltas[name].to("cpu", self.control[name].dtype)  # c_i <- c_i+
        return base.Payload(
            tensors={"model": model.state_dict(), CONTROL_DELTA: deltas},
            meta={"loss": stats.loss, "steps": stats.steps},
        )

    def train_group(self, members: Sequence[base.GroupMember], model: nn.Module) -> list[base.Payload]:
        """`train` for every member at once: each member's correction c - c_i as a loss term
        ``<c - c_i, y>`` on its parameters (its gradient is the one `train` adds, the loss reported stays
        the cross-entropy), then each member's c_i+ from its own steps and trained model (gradient_mean:
        from its gradients summed over its steps, each the raw gradient plus c - c_i)."""
        first = shared.start_group(self, members, model)
        task, settings, option = first.task, first.task.settings, self.hp.control_update
        if option == "option_ii" and settings.optimizer != "sgd":
            raise self._error(task, "SCAFFOLD's option II assumes SGD local steps, not " + repr(settings.optimizer))
        params = shared.trainable(model)
        c = self._server_control(task, params)
        halves = [cast(NodeHalf, m.half) for m in members]
        controls = [half._control(member.task, params) for half, member in zip(halves, members, strict=True)]
        x = {name: p.detach().clone() for name, p in params}
        g_xs: list[dict[str, torch.Tensor]] = []
        if option == "option_i":  # c_i+ = g_i(x): each member's extra pass over its data, before training
            for member in members:
                g_xs.append(local_gradient(model, member.data, settings.batch_size))
                shared.load_group(task, "model", model, node_id=member.half.node_id)
        names = [name for name, _ in params]
        inputs = {name: torch.stack([c[name] - c_i[name] for c_i in controls]) for name in names}

        def correction(batch: NodeBatch) -> Iterator[torch.Tensor]:
            """<c - c_i, y>, parameter by parameter."""
            return ((batch.inputs[n] * batch.params[n]).sum() for n in names)

        # kept from round to round (`keep_as`): the correction reads its batch and its inputs (c - c_i)
        results = train_vectorized(
            model, [m.data for m in members], settings, [m.generator for m in members],
            objective=shared.gradient_terms(correction), inputs=inputs, sum_gradients=option == "gradient_mean",
            keep_as=("scaffold", self.hp),
        )  # fmt: skip
        payloads = []
        for i, (half, member, (state, stats)) in enumerate(zip(halves, members, results, strict=True)):
            if stats.steps == 0:
                raise half._error(member.task, "no local step was taken: SCAFFOLD needs K >= 1")
            assert half.control is not None
            deltas: dict[str, torch.Tensor] = {}
            for name, p in params:
                acc, c_i = shared.accumulator(p.dtype), controls[i][name]
                if g_xs:  # option I: c_i+ - c_i = g_i(x) - c_i
                    delta = g_xs[i][name].to(acc) - c_i.to(acc)
                elif option == "gradient_mean":  # (1/K) sum_k (g_i(y_k) + c - c_i) - c = (1/K) sum_k g_i(y_k) - c_i
                    delta = stats.gradient_sums[name].to(acc) / stats.steps - c[name].to(acc)
                else:  # option II: c_i+ - c_i = (x - y)/(K lr) - c
                    delta = option_ii_delta(
                        x[name].to(acc), state[name].to(acc), c[name].to(acc), stats.steps, settings.lr
                    )
                deltas[name] = delta.to(p.dtype)
                half.control[name] += deltas[name].to("cpu", half.control[name].dtype)  # c_i <- c_i+
            payloads.append(
                base.Payload(
                    tensors={"model": state, CONTROL_DELTA: deltas}, meta={"loss": stats.loss, "steps": stats.steps}
                )
            )
        return payloads

    def group_refusal(self, model: nn.Module) -> str | None:
        return super().group_refusal(model) or unsupported(model)

    def _control(self, task: base.TaskInput, params: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
        """c_i on the parameters' devices and dtypes (zero at the node's first participation)."""
        self.control = shared.node_state(self.control, params, node_id=self.node_id, round=task.round)
        return {name: self.control[name].to(p.device, p.dtype) for name, p in params}

    def _server_control(self, task: base.TaskInput, params: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
        """c from the task, on the parameters' devices and dtypes; a missing or misshapen c is an AlgorithmError."""
        sent = task.payload.tensors.get(CONTROL)
        if sent is None:
            raise self._error(task, f"task carries no {CONTROL} group")
        names = {name for name, _ in params}
        if set(sent) != names:
            missing, extra = sorted(names - set(sent)), sorted(set(sent) - names)
            raise self._error(
                task, f"task {CONTROL} does not fit the model: missing {missing[:5]}, unexpected {extra[:5]}"
            )
        out = {}
        for name, p in params:
            tensor = sent[name]
            if tuple(tensor.shape) != tuple(p.shape) or not tensor.is_floating_point():
                raise self._error(
                    task, f"task {CONTROL} {name} is {tensor.dtype} {tuple(tensor.shape)}, expected {tuple(p.shape)}"
                )
            out[name] = tensor.to(p.device, p.dtype)
        return out

    def _error(self, task: base.TaskInput, message: str) -> AlgorithmError:
        return AlgorithmError(message, node_id=self.node_id, round=task.round)


SPEC = base.AlgorithmSpec(name="scaffold", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
