"""Layers inside vectorised training run over the K nodes as one layer of K x C channels: GroupNorm,
BatchNorm at whole batches, max-pooling; Linear as one batched product with its bias; the per-sample
cross-entropy as one `nll_loss` over every node's samples (`negative_log_likelihood`).

`fedcore.vectorized` maps one forward pass over the nodes (`torch.vmap`), each node with its own
weights. A convolution with per-node weights (a grouped convolution under vmap) leaves its output
sample-major, (B, K x C, H, W) in memory. vmap's own rules for the layers after it did more than the
layer:

- GroupNorm and BatchNorm with per-node weights: normalised without them, then multiplied by the weight
  and added the bias, two more passes over the activations forward, and more backward (the weight's and
  bias's gradients summed apart); the GroupNorm rule first copied its input into node-major order.
  FedRCL's ResNet-18 (GroupNorm, two groups): 21.1 GB of memory traffic a step of 4 nodes of 50, then
  10.6; 524 operators, then 306. FedSA's (BatchNorm): 15.5 GB, then 10.1; 353 operators, then 193.
- max-pooling: the maps copied into node-major order, then the next convolution's input copied back,
  forward and backward. The MOON CNN (KDIA's model): 575 MB a step of 10 nodes of 64, then 434; 109
  operators, then 99.
- Linear with per-node weights: a product, then the bias scaled by one and added, forward, the bias's
  gradient scaled by one again backward, and the weights' gradient left transposed, which the fused SGD
  step (`fedcore.vectorized._sgd_all`) then copied. The MOON CNN: 93 operators a step, then 73 (the bare
  vmap step: 98); 404 MB, then 394 (its 490; `fedmq bench sim`); its CPU round about 12% faster
  (2026-11-29).

Here, under vmap only, such a layer is torch's own kernel over the nodes' activations seen as one batch
of K x C channels (a GroupNorm in K x G groups), node k's channels (and groups) the k-th block, its
weight and bias the k-th block of the flattened (K x C): the same groups and channels, so the same
arithmetic per node, in one kernel with its scale and shift forward and one backward, on the
activations as the convolution left them (a view, no copy). A BatchNorm's running statistics are the
nodes' own (K, C), updated in place through a (K x C) view, as torch's BatchNorm updates its own.
Pooling does no arithmetic: it is bitwise vmap's rule's. A Linear is one `baddbmm` of the nodes' rows
(K, N, I) by their weights (K, O, I), biases added in it, with its own backward: one product for the
inputs' gradient and one for the weights', laid out (K, O, I) as the weights are; a Linear whose
weight the nodes share (a frozen model's) is one `F.linear` over all their rows. Each rule is an
`autograd.Function`'s `vmap` staticmethod, torch.func's way of giving a function its own batching rule;
autograd differentiates the operators it runs. Outside a map the functions are plain `F.group_norm`,
`F.batch_norm` in training mode, `F.max_pool2d` and `F.linear`.

`over_nodes` makes the model the vectorised forward runs: a shallow copy with each GroupNorm, `nn.Linear`
and `nn.MaxPool2d` replaced (`fedcore.module_copies`), the model itself where it has none (the CNNs pool
with a module for this); `fedcore.masked_norm` calls `batch_norm_over_nodes` for a BatchNorm's whole
batches. In float64 the gradients of FedRCL's ResNet-18 are those of each node's own model within
1e-16 (vmap's rule: 1e-15); in float32 they are as close to float64 as one node trained alone is (5e-4
here, 2026-11-29).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from fedmq.fedcore.module_copies import replace_modules


class _GroupNorm(torch.autograd.Function):
    """`F.group_norm`, with a batching rule that runs the mapped nodes as one GroupNorm (`vmap`)."""

    @staticmethod
    def forward(
        x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
    ) -> torch.Tensor:
        return F.group_norm(x, groups, weight, bias, eps)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, groups, weight, bias, eps = inputs
        ctx.save_for_backward(x, weight, bias)
        ctx.groups, ctx.eps = groups, eps

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """`F.group_norm`'s own gradient, for a call outside a map (inside one, autograd differentiates the
        operators the batching rule ran)."""
        x, weight, bias = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3])
        x_grad, weight_grad, bias_grad = _gradients(
            lambda x, w, b: F.group_norm(x, ctx.groups, w, b, ctx.eps), (x, weight, bias), needs, grad
        )
        return x_grad, None, weight_grad, bias_grad, None

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        x: torch.Tensor,
        groups: int,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
    ) -> tuple[torch.Tensor, int]:
        """K nodes' (B, C, ...) inputs as one (B, K x C, ...) batch in K x G groups: node k's channels and
        groups are the k-th block; its weight and bias the k-th block of the flattened (K x C)."""
        x_dim, _, weight_dim, bias_dim, _ = in_dims
        k = info.batch_size
        weight, bias = _blocks(weight, weight_dim, k), _blocks(bias, bias_dim, k)
        return _as_channels(x, x_dim, k, lambda x: F.group_norm(x, k * groups, weight, bias, eps))


class _BatchNorm(torch.autograd.Function):
    """`F.batch_norm` in training mode (batch statistics; running statistics, when given, updated in
    place), with a batching rule that runs the mapped nodes as one BatchNorm (`vmap`)."""

    @staticmethod
    def forward(
        x: torch.Tensor,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        momentum: float,
        eps: float,
    ) -> torch.Tensor:
        return F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, _, _, weight, bias, _, eps = inputs
        ctx.save_for_backward(x, weight, bias)
        ctx.eps = eps

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """`F.batch_norm`'s own gradient in training mode (the running statistics take none), for a call
        outside a map."""
        x, weight, bias = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[3], ctx.needs_input_grad[4])
        x_grad, weight_grad, bias_grad = _gradients(
            lambda x, w, b: F.batch_norm(x, None, None, w, b, True, 0.0, ctx.eps), (x, weight, bias), needs, grad
        )
        return x_grad, None, None, weight_grad, bias_grad, None, None

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        x: torch.Tensor,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        momentum: float,
        eps: float,
    ) -> tuple[torch.Tensor, int]:
        """K nodes' (B, C, ...) inputs as one (B, K x C, ...) batch: node k's channels are the k-th block;
        its weight, bias and running statistics the k-th block of the flattened (K x C), the statistics
        views of the nodes' own (updated in place)."""
        x_dim, mean_dim, var_dim, weight_dim, bias_dim, _, _ = in_dims
        k = info.batch_size
        mean, var = _statistics(running_mean, mean_dim), _statistics(running_var, var_dim)
        weight, bias = _blocks(weight, weight_dim, k), _blocks(bias, bias_dim, k)
        return _as_channels(x, x_dim, k, lambda x: F.batch_norm(x, mean, var, weight, bias, True, momentum, eps))


def _as_channels(
    x: torch.Tensor, x_dim: int | None, k: int, kernel: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """`kernel` run on K nodes' (B, C, ...) inputs seen as one (B, K x C, ...) batch, node k's channels the
    k-th block (a view where the input is laid out sample-major, as a convolution under vmap leaves it);
    its output seen per node again, mapped at dimension 1."""
    x = x.movedim(x_dim, 1) if x_dim is not None else x.unsqueeze(1).expand(x.shape[0], k, *x.shape[1:])
    n, _, c, *rest = x.shape
    out = kernel(x.reshape(n, k * c, *rest))
    return out.view(n, k, c, *out.shape[2:]), 1


def _statistics(t: torch.Tensor | None, dim: int | None) -> torch.Tensor | None:
    """The nodes' own (C,) running statistics as a (K x C,) view, for the kernel to update in place."""
    if t is None:
        return None
    if dim is None:
        raise ValueError("a BatchNorm mapped over nodes needs each node's own running statistics, not one shared")
    return t.movedim(dim, 0).view(-1)  # a view or an error: a copy would lose the kernel's update


def batch_norm_over_nodes(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    momentum: float,
    eps: float,
) -> torch.Tensor:
    """`F.batch_norm(x, running_mean, running_var, weight, bias, training=True, momentum, eps)`, whose map
    over nodes is one BatchNorm of K x C channels (see the module docstring)."""
    return _BatchNorm.apply(x, running_mean, running_var, weight, bias, momentum, eps)  # type: ignore[no-any-return]


def _gradients(
    function: Any, inputs: tuple[torch.Tensor | None, ...], needs: tuple[bool, ...], grad: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of `function(*inputs)` against `grad` for the inputs that need one (None for the others),
    by running it again under autograd: the functions' backward outside a map."""
    leaves = tuple(None if t is None else t.detach().requires_grad_() for t in inputs)
    with torch.enable_grad():
        out = function(*leaves)
    wanted = [t for t, need in zip(leaves, needs, strict=True) if t is not None and need]
    found = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
    return tuple(next(found) if t is not None and need else None for t, need in zip(leaves, needs, strict=True))


def _nodes_first(t: torch.Tensor, dim: int | None, k: int) -> torch.Tensor:
    """The k nodes' tensors (mapped at `dim`, or one the nodes share) stacked on a first dimension: a view."""
    return t.movedim(dim, 0) if dim is not None else t.expand(k, *t.shape)


def _blocks(t: torch.Tensor | None, dim: int | None, k: int) -> torch.Tensor | None:
    """A per-channel (C,) tensor of each of k nodes (mapped at `dim`, or shared) as one (K x C,)."""
    if t is None:
        return None
    return t.repeat(k) if dim is None else t.movedim(dim, 0).reshape(-1)


class GroupNormOverNodes(nn.Module):
    """A `torch.nn.GroupNorm` whose map over nodes is one GroupNorm (see the module docstring). It holds
    the GroupNorm's own parameters under their names, so that `functional_call` with the model's names
    reaches them."""

    def __init__(self, norm: nn.GroupNorm) -> None:
        super().__init__()
        self.num_groups, self.num_channels, self.eps, self.affine = (
            norm.num_groups, norm.num_channels, norm.eps, norm.affine
        )  # fmt: skip
        for name, p in norm.named_parameters(recurse=False):
            self.register_parameter(name, p)

    def _parameter(self, name: str) -> torch.Tensor:
        """A parameter by name (what `functional_call` put there for this node)."""
        return cast(torch.Tensor, getattr(self, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = (self._parameter("weight"), self._parameter("bias")) if self.affine else (None, None)
        return _GroupNorm.apply(x, self.num_groups, weight, bias, self.eps)  # type: ignore[no-any-return]


class _MaxPool2d(torch.autograd.Function):
    """`F.max_pool2d`, with a batching rule that pools the mapped nodes' channels as one batch's (`vmap`)."""

    @staticmethod
    def forward(x: torch.Tensor, pool: tuple[Any, ...]) -> torch.Tensor:
        return F.max_pool2d(x, *pool)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, ctx.pool = inputs
        ctx.save_for_backward(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """`F.max_pool2d`'s own gradient, for a call outside a map."""
        (x,) = ctx.saved_tensors
        (x_grad,) = _gradients(lambda x: F.max_pool2d(x, *ctx.pool), (x,), (ctx.needs_input_grad[0],), grad)
        return x_grad, None

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[int | None, ...], x: torch.Tensor, pool: tuple[Any, ...]
    ) -> tuple[torch.Tensor, int]:
        """Pooling is channel by channel and image by image: K nodes' (B, C, H, W) maps pooled as one
        (B, K x C, H, W) batch, bitwise what each node's pooling gives, in the layout a convolution with
        per-node weights left them; or, laid out node by node (a convolution by weights the nodes share,
        a frozen teacher's), as one (K x B, C, H, W) batch: no copy either way."""
        x_dim, k = in_dims[0], info.batch_size
        if x.dim() - (x_dim is not None) == 4:  # a (B, C, H, W) batch a node
            nodes = x.movedim(x_dim, 0) if x_dim is not None else None
            if nodes is not None and nodes.is_contiguous():
                out = F.max_pool2d(nodes.flatten(0, 1), *pool)
                return out.view(*nodes.shape[:2], *out.shape[1:]), 0
            return _as_channels(x, x_dim, k, lambda x: F.max_pool2d(x, *pool))
        maps = _nodes_first(x, x_dim, k)  # a (C, H, W) map a node
        return F.max_pool2d(maps.flatten(0, 1), *pool).unflatten(0, maps.shape[:2]), 0


class MaxPool2dOverNodes(nn.Module):
    """A `torch.nn.MaxPool2d` whose map over nodes pools their channels as one batch's (see `_MaxPool2d`):
    after a convolution with per-node weights, vmap's own rule copies the maps into node order first."""

    def __init__(self, pool: nn.MaxPool2d) -> None:
        super().__init__()
        self.pool = (pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.ceil_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MaxPool2d.apply(x, self.pool)  # type: ignore[no-any-return]


class _Linear(torch.autograd.Function):
    """`F.linear`, with a batching rule that runs the mapped nodes as one batched matrix product with their
    biases added in it (`vmap`)."""

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """`F.linear`'s own gradient, for a call outside a map."""
        return _gradients(F.linear, ctx.saved_tensors, tuple(ctx.needs_input_grad), grad)

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, int]:
        """K nodes' (..., I) inputs times their own (O, I) weights, plus their (O,) biases: one `baddbmm`
        over (K, N, I) (`_NodesLinear`); a weight and bias shared by the nodes (a frozen model's) one
        `F.linear` over all the nodes' rows."""
        x_dim, weight_dim, bias_dim = in_dims
        k = info.batch_size
        x = _nodes_first(x, x_dim, k)
        if weight_dim is None and bias_dim is None:
            return F.linear(x, weight, bias), 0
        weight = _nodes_first(weight, weight_dim, k)
        bias = None if bias is None else _nodes_first(bias, bias_dim, k)
        rows = x.reshape(k, -1, x.shape[-1])
        out = _NodesLinear.apply(rows, weight, bias)
        return out.view(*x.shape[:-1], out.shape[-1]), 0


class _NodesLinear(torch.autograd.Function):
    """K nodes' rows (K, N, I) times their weights (K, O, I) plus their biases (K, O): forward one
    `baddbmm` (vmap's rule for `F.linear`: a product, a bias scaled by one, an addition), backward one
    product for the inputs' gradient and one for the weights', which comes out (K, O, I) contiguous, laid
    out as the weights are (vmap's rule left it transposed, which the fused SGD step had to copy). Its own
    batching rule, generated, serves a map around the nodes' map."""

    generate_vmap_rule = True

    @staticmethod
    def forward(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        product = weight.transpose(1, 2)
        return torch.bmm(rows, product) if bias is None else torch.baddbmm(bias.unsqueeze(1), rows, product)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        rows, weight, _ = inputs
        ctx.save_for_backward(rows, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """In the gradient's dtype: under autocast (bf16) the forward's product ran in it; autograd casts each
        gradient back to its input's dtype."""
        rows, weight = (t.to(grad.dtype) for t in ctx.saved_tensors)
        rows_grad = torch.bmm(grad, weight) if ctx.needs_input_grad[0] else None
        weight_grad = torch.bmm(grad.transpose(1, 2), rows) if ctx.needs_input_grad[1] else None
        bias_grad = grad.sum(1) if ctx.needs_input_grad[2] else None
        return rows_grad, weight_grad, bias_grad


class LinearOverNodes(nn.Module):
    """A `torch.nn.Linear` whose map over nodes is one batched product with the biases in it (see
    `_Linear`), holding the Linear's own parameters under their names (as `GroupNormOverNodes`)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Linear.apply(x, self.weight, self.bias)  # type: ignore[no-any-return]


class _NegativeLogLikelihood(torch.autograd.Function):
    """Per-sample cross-entropy, `-log_softmax(logits)[y]`, with a batching rule that runs the mapped nodes'
    samples as one batch of torch's `nll_loss` (`vmap`): vmap's rules for the gather take a log-softmax,
    a gather and a negation forward and a negation, a zeroed tensor and a scatter backward, where
    `nll_loss` takes one operator each way (its own rule under vmap is a decomposition, more operators
    and an import of sympy). The same values, bit for bit: each is the negated log-probability of the
    label, and its gradient the negated incoming one at the label."""

    @staticmethod
    def forward(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _gathered(logits, y)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The gathered form's own gradient, for a call outside a map."""
        logits, y = ctx.saved_tensors
        (logits_grad,) = _gradients(lambda t: _gathered(t, y), (logits,), (ctx.needs_input_grad[0],), grad)
        return logits_grad, None

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[int | None, ...], logits: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        logits_dim, y_dim = in_dims
        k = info.batch_size
        logits, y = _nodes_first(logits, logits_dim, k), _nodes_first(y, y_dim, k)
        rows = F.log_softmax(logits.reshape(-1, logits.shape[-1]), dim=-1)
        return F.nll_loss(rows, y.reshape(-1), reduction="none").view(logits.shape[:-1]), 0


def _gathered(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -F.log_softmax(logits, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)


def negative_log_likelihood(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each sample's cross-entropy over the last dimension of `logits` against its integer label `y`
    (`F.cross_entropy(..., reduction="none")`'s values), one operator each way over the nodes of a map."""
    return _NegativeLogLikelihood.apply(logits, y)  # type: ignore[no-any-return]


def _over_nodes(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.MaxPool2d):
        return MaxPool2dOverNodes(module)
    if isinstance(module, nn.Linear):
        return LinearOverNodes(module)
    return GroupNormOverNodes(cast(nn.GroupNorm, module))


def _replaced(module: nn.Module) -> bool:
    return type(module) in (nn.GroupNorm, nn.Linear) or (type(module) is nn.MaxPool2d and not module.return_indices)


def over_nodes(model: nn.Module) -> nn.Module:
    """`model` with each GroupNorm, Linear and max-pool one over the nodes: a shallow copy of the modules on
    the way to one, the model itself where there is none (the model is unchanged)."""
    return replace_modules(model, _replaced, lambda m, _: _over_nodes(m))
