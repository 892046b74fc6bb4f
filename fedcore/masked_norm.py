"""BatchNorm inside vectorised training: each node's batch statistics over its real samples only, and
each node's own running statistics.

`fedcore.vectorized` pads a node's short batch to the batch size with copies of its first sample
(weighted 0) and maps one forward pass over the nodes. torch's BatchNorm would then (1) take the
padding into its batch statistics, so a padded node's normalisation, and with it its gradient, would
differ from its own `local_sgd`, and (2) update its running statistics in place inside the forward
pass, which a map over nodes cannot do for one node's buffers alone, nor undo for a node with no batch
left at a step. Here a BatchNorm is replaced, for the vectorised forward only, by `MaskedBatchNorm`:

- the batch mean and the biased variance (what normalises) are sums over the node's real samples
  (weight 1), divided by their count times the spatial size, which is what `F.batch_norm` computes on
  the node's unpadded batch;
- the running statistics are not written inside the map: each BatchNorm hands back its batch's mean
  and unbiased variance (n / (n - 1) times the biased one, as torch updates with it;
  `NormStep.statistics`), and after the map `update_running_statistics` blends them into the running
  mean and variance and counts the batch, for the nodes that trained at that step (a node with no batch
  left keeps its own): with every node training and one momentum for every BatchNorm, one multi-tensor
  lerp and one multi-tensor add for the whole model, where a lerp a statistic and an add a count inside
  the map took 61 operators a step of FedSA's ResNet-18;
- momentum None (torch's cumulative average) uses 1 / the batch count after the step, as torch does.

A step in which every node that trains has a whole batch (`NormStep.whole`, known on the host from the
shard sizes: a node pads only the trailing batch of an epoch) has nothing to mask: there the output is
torch's own BatchNorm (one kernel forward, one backward, over the nodes as one BatchNorm of K x C channels
with its scale and shift: `fedcore.layers_over_nodes.batch_norm_over_nodes`),
where the masked sums take about ten operators forward and more backward. If every node of the step
trains at it (`NormStep.everyone`: none masked), torch's BatchNorm also updates each node's running mean
and variance itself, in place, as the module's own training step does (the K nodes' channels run as one
BatchNorm of K x C channels, each node's running statistics a view of the round's); only the counts are
left to add after the map. Otherwise (some node masked, or momentum None, whose factor is per node) it
normalises in batch-statistics mode and the running statistics take one `torch.var_mean` of the detached
input. The caller sets `whole` and `everyone` per step (a captured step's kind holds them), so every kind
of step is exact.

The structure is a shallow copy of the model (`masked_norms`): the modules holding a BatchNorm are
copies sharing their tensors and attributes, every other module is the model's own, so nothing of a
large model is copied.

What it does not reproduce: torch refuses a BatchNorm1d batch of one value per channel in training;
here such a batch normalises to zeros and its variance of 0 enters the running variance. `local_sgd`
never trains one (it skips a trailing batch of one sample) unless a node's whole shard is one sample.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from fedmq.fedcore.layers_over_nodes import batch_norm_over_nodes
from fedmq.fedcore.module_copies import replace_modules

TORCH_AT_WHOLE_BATCHES: ContextVar[bool] = ContextVar("fedmq_torch_norm_at_whole_batches", default=True)
"""Whether a step of whole batches takes torch's own BatchNorm (the default); off, every step takes the
masked sums, as a padded step does: what `fedmq bench sim` compares against (`masked_at_every_step`)."""


@contextmanager
def masked_at_every_step() -> Iterator[None]:
    """Within the block, vectorised training masks every BatchNorm step's statistics, whole batches too
    (the same results within rounding; the comparison that says what torch's BatchNorm saves)."""
    token = TORCH_AT_WHOLE_BATCHES.set(False)
    try:
        yield
    finally:
        TORCH_AT_WHOLE_BATCHES.reset(token)


@dataclass(frozen=True, slots=True)
class Counts:
    """What every BatchNorm over maps of one size shares in a forward pass, made once for them all."""

    share: torch.Tensor
    """(B,) each sample's share of the mean: 1 / n for a real sample, 0 for padding."""
    bessel: torch.Tensor
    """n / (n - 1): the unbiased variance over the biased one (the running variance's update)."""


@dataclass
class NormStep:
    """What the BatchNorms of one node's forward pass read and leave: the node's sample weights (1 real,
    0 padding), set by the caller around the pass, and each running statistic's new value by state-dict
    name."""

    weight: torch.Tensor | None = None
    statistics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Each tracking BatchNorm's batch mean and unbiased variance, under the names of the running statistics
    they update (`update_running_statistics`)."""
    momenta: dict[str, float | None] = field(default_factory=dict)
    """Each tracking BatchNorm's momentum, by its prefix (None: the cumulative average)."""
    made: dict[tuple[int, torch.dtype], Counts] = field(default_factory=dict)
    whole: bool = False
    """Every node that trains at this step has a whole batch (no padding): torch's own BatchNorm applies.
    Set by the caller for the step (a Python value: a captured step is recorded with it)."""
    everyone: bool = False
    """Every node of the step trains at it (none masked): with `whole`, torch's BatchNorm updates each
    node's running mean and variance itself, in place (momentum None aside). Set by the caller, as `whole`
    is."""
    in_kernel: list[str] = field(default_factory=list)
    """The prefixes of the BatchNorms whose running mean and variance torch's BatchNorm updated in place at
    this step: only their counts are left to `update_running_statistics`."""

    @contextmanager
    def batch(self, weight: torch.Tensor) -> Iterator[dict[str, torch.Tensor]]:
        """Within the block, the BatchNorms normalise over the samples `weight` marks real; yields the
        batch statistics they leave (filled as the forward pass runs)."""
        self.weight, self.statistics, self.made, self.in_kernel = weight, {}, {}, []
        try:
            yield self.statistics
        finally:
            self.weight, self.made = None, {}

    def counts(self, values: int, dtype: torch.dtype) -> Counts:
        """The shares and Bessel factor for maps of `values` values a sample and channel: n = the real
        samples x `values` (at least 1: a node with no batch left, whose results are discarded)."""
        if self.weight is None:
            raise RuntimeError("a masked BatchNorm ran outside NormStep.batch: it does not know the real samples")
        key = (values, dtype)
        if key not in self.made:
            real = self.weight.to(dtype)
            n = (real.sum() * values).clamp(min=1)
            self.made[key] = Counts(share=real / n, bessel=n / (n - 1).clamp(min=1))
        return self.made[key]


class MaskedBatchNorm(nn.Module):
    """A `torch.nn.BatchNorm{1,2,3}d` in training mode, over the real samples of a padded batch (see the
    module docstring). It holds the BatchNorm's own parameters and buffers under their names, so that
    `functional_call` with the model's state-dict names reaches them."""

    def __init__(self, norm: nn.modules.batchnorm._BatchNorm, prefix: str, step: NormStep) -> None:
        super().__init__()
        self.eps, self.momentum, self.prefix, self.norm_step = norm.eps, norm.momentum, prefix, step
        self.affine, self.tracked = norm.affine, norm.track_running_stats
        if self.tracked:
            step.momenta[prefix] = norm.momentum
        for name, p in norm.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in norm.named_buffers(recurse=False):
            self.register_buffer(name, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = x.dtype in (torch.float16, torch.bfloat16)  # statistics in float32, as torch's kernels keep them
        xs = x.float() if low else x
        channel = (1, -1, *([1] * (xs.dim() - 2)))
        if self.norm_step.whole:
            out = self._whole_batch(xs)
            return out.to(x.dtype) if low else out
        counts = self.norm_step.counts(xs[0, 0].numel() if xs.dim() > 2 else 1, xs.dtype)
        # few passes over the activations (on a GPU each is a kernel, forward and backward): each mean over the
        # real samples a product with their shares and one sum (858 operators a FedSA step against einsum's 888,
        # with no copy for a batched product), the scale and shift one fused multiply-add
        dims = (0, *range(2, xs.dim()))
        share = counts.share.view(-1, *([1] * (xs.dim() - 1)))
        mean = (xs * share).sum(dims)
        centred = xs - mean.view(channel)
        var = (centred * centred * share).sum(dims)
        scale = torch.rsqrt(var + self.eps)
        if self.affine:
            scale = scale * self._tensor("weight")
            out = torch.addcmul(self._tensor("bias").view(channel), centred, scale.view(channel))
        else:
            out = centred * scale.view(channel)
        if self.tracked:
            self._leave_running_statistics(mean.detach(), var.detach() * counts.bessel)
        return out.to(x.dtype) if low else out

    def _whole_batch(self, xs: torch.Tensor) -> torch.Tensor:
        """A batch with no padding: torch's BatchNorm normalises it by its own statistics. With every node
        training and a momentum, it updates the running statistics too (the counts follow the map);
        otherwise they take the batch's mean and unbiased variance, computed once more on the detached input
        (torch's kernel keeps the inverse standard deviation, from which the variance would come back
        rounded)."""
        weight, bias = (self._tensor("weight"), self._tensor("bias")) if self.affine else (None, None)
        if self.tracked and self.norm_step.everyone and self.momentum is not None:  # as the module's own step
            self.norm_step.in_kernel.append(self.prefix)
            mean, var = self._tensor("running_mean"), self._tensor("running_var")
            return batch_norm_over_nodes(xs, mean, var, weight, bias, self.momentum, self.eps)
        out = batch_norm_over_nodes(xs, None, None, weight, bias, 0.0, self.eps)
        if self.tracked:
            var, mean = torch.var_mean(xs.detach(), (0, *range(2, xs.dim())), correction=1)
            self._leave_running_statistics(mean, var)
        return out

    def _tensor(self, name: str) -> torch.Tensor:
        """A parameter or buffer by name (what `functional_call` put there for this node)."""
        return cast(torch.Tensor, getattr(self, name))

    def _leave_running_statistics(self, mean: torch.Tensor, unbiased: torch.Tensor) -> None:
        """The batch's mean and unbiased variance, for `update_running_statistics` after the map."""
        statistics = self.norm_step.statistics
        statistics[f"{self.prefix}running_mean"] = mean
        statistics[f"{self.prefix}running_var"] = unbiased


def update_running_statistics(
    step: NormStep,
    buffers: dict[str, torch.Tensor],
    statistics: dict[str, torch.Tensor],
    active: torch.Tensor,
    masked: bool,
) -> None:
    """Blend each BatchNorm's batch statistics (`NormStep.statistics`, (a, C) for the first a nodes) into the
    nodes' running mean and variance and count their batch, in `buffers` ((a, ...) views of the round's), for
    the nodes that trained: torch's update, old + factor (new - old) (it rounds as (1 - factor) old + factor
    new), factor the momentum or, for momentum None, 1 / the count after the step. `masked`: some of the a
    nodes did not train (`active` 0), and keep theirs. A BatchNorm that did not run at the step left no
    statistics and keeps its own. Those torch's BatchNorm updated in place (`NormStep.in_kernel`: every node
    trained) only count their batch."""
    if step.in_kernel:
        torch._foreach_add_([buffers[f"{p}num_batches_tracked"] for p in step.in_kernel], 1)
    momenta = step.momenta
    prefixes = [p for p in momenta if f"{p}running_mean" in statistics]
    if not prefixes:
        return
    runnings = [buffers[f"{p}{s}"] for p in prefixes for s in ("running_mean", "running_var")]
    news = [
        statistics[f"{p}{s}"].to(buffers[f"{p}{s}"].dtype) for p in prefixes for s in ("running_mean", "running_var")
    ]
    counts = [buffers[f"{p}num_batches_tracked"] for p in prefixes]
    shared = {momenta[p] for p in prefixes}
    momentum = next(iter(shared))
    if not masked and len(shared) == 1 and momentum is not None:  # the usual case: two operators a step
        torch._foreach_lerp_(runnings, news, momentum)
        torch._foreach_add_(counts, 1)
        return
    for i, prefix in enumerate(prefixes):
        count = counts[i] + 1
        for running, new in zip(runnings[2 * i : 2 * i + 2], news[2 * i : 2 * i + 2], strict=True):
            m, dtype = momenta[prefix], statistics[f"{prefix}running_mean"].dtype
            factor = (1.0 / count.to(dtype)).view(-1, *([1] * (new.dim() - 1))) if m is None else m
            blended = torch.lerp(running, new, factor)
            running.copy_(torch.where(_trained(active, running), blended, running) if masked else blended)
        counts[i].copy_(torch.where(active > 0, count, counts[i]) if masked else count)


def _trained(active: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Which of the (a, ...) rows of `like` belong to nodes that trained, broadcastable against it."""
    return (active > 0).view(-1, *([1] * (like.dim() - 1)))


def has_batch_norm(model: nn.Module) -> bool:
    """Whether `model` holds a BatchNorm anywhere (the modules `masked_norms` copies lead to one)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def masked_norms(model: nn.Module, step: NormStep) -> nn.Module:
    """`model` with each BatchNorm replaced by a `MaskedBatchNorm` reading `step`: a shallow copy of the
    modules on the way to a BatchNorm (`fedcore.module_copies`), the model itself where there is none
    below, so the model is unchanged."""
    return replace_modules(
        model,
        lambda m: isinstance(m, nn.modules.batchnorm._BatchNorm),
        lambda m, prefix: MaskedBatchNorm(cast(nn.modules.batchnorm._BatchNorm, m), prefix, step),
    )
