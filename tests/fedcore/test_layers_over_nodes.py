"""`fedcore.layers_over_nodes`: under a map over nodes, the nodes' GroupNorms and BatchNorms each as one of K x C
channels, each node's output, gradients (and running statistics) its own layer's; outside a map, torch's."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fedmq.fedcore.layers_over_nodes import (
    GroupNormOverNodes,
    LinearOverNodes,
    MaxPool2dOverNodes,
    _gathered,
    batch_norm_over_nodes,
    negative_log_likelihood,
    over_nodes,
)
from fedmq.fedcore.vectorized import functional_method

K, B, C, GROUPS = 3, 4, 6, 2


class Operators(TorchDispatchMode):
    """The operators dispatched inside it, by name, views aside."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def node_inputs(shared_x: bool = False, shared_affine: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = (B, C, 5, 5) if shared_x else (K, B, C, 5, 5)
    affine = (C,) if shared_affine else (K, C)
    return {
        "x": torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 1,
        "weight": torch.randn(affine, generator=gen, dtype=torch.float64),
        "bias": torch.randn(affine, generator=gen, dtype=torch.float64),
    }


def mapped(norm: nn.Module, inputs: dict[str, torch.Tensor], shared_x: bool, shared_affine: bool) -> torch.Tensor:
    """`norm` over the K nodes, each with its own x (or one for all) and its own weight and bias (or one)."""
    affine_dim = None if shared_affine else 0

    def one(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return functional_call(norm, {"weight": weight, "bias": bias}, (x,))

    in_dims = (None if shared_x else 0, affine_dim, affine_dim)
    return vmap(one, in_dims=in_dims)(inputs["x"], inputs["weight"], inputs["bias"])


@pytest.mark.parametrize(
    ("shared_x", "shared_affine"),
    [(False, False), (True, False), (False, True)],
    ids=["own", "shared-x", "shared-affine"],
)
def test_each_node_is_its_own_groupnorm_forward_and_backward_in_float64(shared_x: bool, shared_affine: bool) -> None:
    norm = GroupNormOverNodes(nn.GroupNorm(GROUPS, C).double())
    inputs = {n: t.requires_grad_() for n, t in node_inputs(shared_x, shared_affine).items()}
    out = mapped(norm, inputs, shared_x, shared_affine)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad((out * probe).sum(), list(inputs.values()))
    want_out = torch.stack(
        [
            F.group_norm(
                inputs["x"] if shared_x else inputs["x"][k],
                GROUPS,
                inputs["weight"] if shared_affine else inputs["weight"][k],
                inputs["bias"] if shared_affine else inputs["bias"][k],
                norm.eps,
            )
            for k in range(K)
        ]
    )
    want = torch.autograd.grad((want_out * probe).sum(), list(inputs.values()))
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_without_affine_parameters_each_node_is_normalised_alone() -> None:
    norm = GroupNormOverNodes(nn.GroupNorm(GROUPS, C, affine=False).double())
    x = node_inputs()["x"]
    out = vmap(norm)(x)
    torch.testing.assert_close(out, torch.stack([F.group_norm(x[k], GROUPS, eps=norm.eps) for k in range(K)]))


def test_under_a_map_it_is_one_groupnorm_kernel_with_no_copy_and_no_separate_scale() -> None:
    """What it is for: on activations laid out as a convolution under vmap leaves them, sample-major
    (B, K x C, ...), vmap's own rule for per-node weights copied them into node order, normalised, then
    multiplied and added; here one `native_group_norm` forward and one backward, and nothing else."""
    inputs = node_inputs()
    x = inputs["x"].transpose(0, 1).contiguous().requires_grad_()  # (B, K, C, ...) in memory
    weight, bias = inputs["weight"].requires_grad_(), inputs["bias"].requires_grad_()
    counted = {}
    for name, norm in (("torch", nn.GroupNorm(GROUPS, C)), ("over nodes", GroupNormOverNodes(nn.GroupNorm(GROUPS, C)))):

        def one(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, norm: nn.Module = norm) -> torch.Tensor:
            return functional_call(norm, {"weight": w, "bias": b}, (x,))

        with Operators() as ops:
            out = vmap(one, in_dims=(1, 0, 0))(x, weight, bias)
        probe = torch.randn_like(out)  # laid out as the output, as the next layer's gradient would be
        with ops:
            torch.autograd.grad(out, [x, weight, bias], probe)
        counted[name] = ops.counts
    ours, theirs = counted["over nodes"], counted["torch"]
    assert ours["native_group_norm"] == ours["native_group_norm_backward"] == 1
    assert ours["clone"] == ours["mul"] == ours["add"] == 0, ours
    assert theirs["clone"] > 0 and theirs["mul"] > 0, theirs  # the rule it replaces


def test_outside_a_map_it_is_torchs_groupnorm_and_its_gradient() -> None:
    torch_norm = nn.GroupNorm(GROUPS, C).double()
    with torch.no_grad():
        torch_norm.weight.uniform_(0.5, 2.0)
        torch_norm.bias.uniform_(-1.0, 1.0)
    ours = GroupNormOverNodes(torch_norm)
    x = node_inputs()["x"][0].requires_grad_()
    got = ours(x)
    got_grads = torch.autograd.grad(got.sum() + (got**2).sum(), [x, ours.weight, ours.bias])
    want = torch_norm(x)
    want_grads = torch.autograd.grad(want.sum() + (want**2).sum(), [x, torch_norm.weight, torch_norm.bias])
    assert torch.equal(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, C, 3), nn.GroupNorm(GROUPS, C), nn.ReLU())
        self.head = nn.Linear(C, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


def test_over_nodes_replaces_each_groupnorm_in_a_copy_sharing_the_models_tensors() -> None:
    model = Net()
    copied = over_nodes(model)
    assert isinstance(copied.body[1], GroupNormOverNodes) and type(model.body[1]) is nn.GroupNorm
    assert isinstance(copied.head, LinearOverNodes) and type(model.head) is nn.Linear
    assert copied.body[0] is model.body[0]  # only the way to a GroupNorm or Linear is copied
    assert dict(copied.named_parameters()).keys() == dict(model.named_parameters()).keys()
    for (name, mine), (_, theirs) in zip(copied.named_parameters(), model.named_parameters(), strict=True):
        assert mine is theirs, name
    plain = nn.Sequential(nn.Conv2d(2, 2, 1), nn.ReLU())
    assert over_nodes(plain) is plain


def test_an_objectives_model_method_runs_its_groupnorms_over_the_nodes() -> None:
    """`functional_method` (FedRCL's taps, MOON's representation) maps the same GroupNorm as the logits do."""
    model = Net().double()
    params = {n: p.detach().unsqueeze(0).repeat(K, *[1] * p.dim()) for n, p in model.named_parameters()}
    x = node_inputs()["x"][:, :, :3]
    forward = functional_method(model, "forward")
    with Operators() as ours:
        got = vmap(forward)(params, x)
    with Operators() as theirs:
        vmap(lambda p, x: functional_call(model, p, (x,)))(params, x)
    assert ours.counts["native_group_norm"] == theirs.counts["native_group_norm"] == 1
    assert ours.counts["mul"] < theirs.counts["mul"] and sum(ours.counts.values()) < sum(theirs.counts.values())
    for k in range(K):
        want = functional_call(model, {n: p[k] for n, p in params.items()}, (x[k],))
        torch.testing.assert_close(got[k], want, rtol=0, atol=1e-12)


def test_a_batchnorm_over_nodes_is_each_nodes_own_and_updates_its_running_statistics() -> None:
    """Forward, gradients and each node's running mean and variance (updated in place, through views of
    the nodes' (K, C) statistics) as each node's own `F.batch_norm` in training mode, in float64; one
    `native_batch_norm` forward and one backward, with no separate scale, shift or sums."""
    inputs = node_inputs()
    x = inputs["x"].transpose(0, 1).contiguous().requires_grad_()  # (B, K, C, ...) in memory, as a convolution's
    weight, bias = inputs["weight"].requires_grad_(), inputs["bias"].requires_grad_()
    means, variances = torch.randn(K, C, dtype=torch.float64), torch.rand(K, C, dtype=torch.float64) + 0.5
    want_means, want_variances = means.clone(), variances.clone()

    def one(x: torch.Tensor, m: torch.Tensor, v: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return batch_norm_over_nodes(x, m, v, w, b, 0.1, 1e-5)

    with Operators() as ops:
        out = vmap(one, in_dims=(1, 0, 0, 0, 0))(x, means, variances, weight, bias)
    probe = torch.randn_like(out)
    with ops:
        got = torch.autograd.grad(out, [x, weight, bias], probe)
    assert ops.counts["native_batch_norm"] == ops.counts["native_batch_norm_backward"] == 1
    assert ops.counts["mul"] == ops.counts["add"] == ops.counts["sum"] == ops.counts["clone"] == 0, ops.counts
    want_out = torch.stack(
        [F.batch_norm(x[:, k], want_means[k], want_variances[k], weight[k], bias[k], True, 0.1, 1e-5) for k in range(K)]
    )
    want = torch.autograd.grad(want_out, [x, weight, bias], probe)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    assert not torch.equal(means, torch.zeros_like(means))
    torch.testing.assert_close(means, want_means, rtol=0, atol=1e-12)
    torch.testing.assert_close(variances, want_variances, rtol=0, atol=1e-12)


def test_a_batchnorm_over_nodes_refuses_one_running_statistic_for_every_node() -> None:
    x = node_inputs()["x"]
    shared = torch.zeros(C, dtype=torch.float64)
    with pytest.raises(ValueError, match="each node's own running statistics"):
        vmap(lambda x: batch_norm_over_nodes(x, shared, shared.clone(), None, None, 0.1, 1e-5))(x)


def test_outside_a_map_the_batchnorm_is_torchs_in_training_mode() -> None:
    x = node_inputs()["x"][0].requires_grad_()
    weight = torch.rand(C, dtype=torch.float64).add_(0.5).requires_grad_()
    bias = torch.randn(C, dtype=torch.float64).requires_grad_()
    ours_stats = [torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)]
    torch_stats = [t.clone() for t in ours_stats]
    got = batch_norm_over_nodes(x, *ours_stats, weight, bias, 0.1, 1e-5)
    got_grads = torch.autograd.grad((got**2).sum(), [x, weight, bias])
    want = F.batch_norm(x, *torch_stats, weight, bias, True, 0.1, 1e-5)
    want_grads = torch.autograd.grad((want**2).sum(), [x, weight, bias])
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(ours_stats, torch_stats, strict=True))
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "pool", [nn.MaxPool2d(2), nn.MaxPool2d(3, stride=2, padding=1), nn.MaxPool2d(2, ceil_mode=True)], ids=str
)
def test_a_max_pool_over_nodes_is_each_nodes_own_bitwise_with_no_copy(pool: nn.MaxPool2d) -> None:
    """Pooling is channel by channel: the nodes' maps pooled as one batch's channels are each node's own,
    bit for bit, forward and backward, on the layout a convolution under vmap leaves (sample-major), where
    vmap's own rule copies the maps into node order first."""
    x = node_inputs()["x"][..., :5].transpose(0, 1).contiguous().requires_grad_()  # (B, K, C, 5, 5) in memory
    ours = MaxPool2dOverNodes(pool)
    with Operators() as ops:
        out = vmap(ours, in_dims=1)(x)
    probe = torch.randn_like(out)
    with ops:
        (got,) = torch.autograd.grad(out, [x], probe)
    assert ops.counts["clone"] == 0 and ops.counts["max_pool2d_with_indices"] == 1, ops.counts
    want_out = torch.stack([pool(x[:, k]) for k in range(K)])
    (want,) = torch.autograd.grad(want_out, [x], probe)
    assert torch.equal(out, want_out) and torch.equal(got, want)
    with Operators() as theirs:
        vmap(pool, in_dims=1)(x)
    assert theirs.counts["clone"] > 0  # the rule it replaces


def test_node_major_maps_are_pooled_as_one_batch_of_every_nodes_images_bitwise_with_no_copy() -> None:
    """A convolution by weights the nodes share (a frozen teacher's) leaves its maps node by node: pooled
    as one (K x B, C, H, W) batch, each node's own bit for bit, forward and backward, where pooling them
    as channels would copy them into sample-major order first."""
    pool = nn.MaxPool2d(2)
    x = node_inputs()["x"][..., :4, :4].contiguous().requires_grad_()  # (K, B, C, 4, 4) in memory
    with Operators() as ops:
        out = vmap(MaxPool2dOverNodes(pool))(x)
        probe = torch.randn_like(out)
        (got,) = torch.autograd.grad(out, [x], probe)
    assert ops.counts["clone"] == 0 and ops.counts["max_pool2d_with_indices"] == 1, ops.counts
    want_out = torch.stack([pool(x[k]) for k in range(K)])
    (want,) = torch.autograd.grad(want_out, [x], probe)
    assert torch.equal(out, want_out) and torch.equal(got, want)


def test_a_max_pool_over_nodes_of_unbatched_or_shared_maps_is_torchs() -> None:
    pool, x = nn.MaxPool2d(2), node_inputs()["x"]
    ours = MaxPool2dOverNodes(pool)
    assert torch.equal(vmap(ours)(x[:, 0]), vmap(pool)(x[:, 0]))  # each node one (C, H, W) map
    shared = x[0]
    assert torch.equal(vmap(lambda w: ours(shared) * w)(torch.ones(K)), torch.stack([pool(shared)] * K))
    leaf = x[0].clone().requires_grad_()
    (got,) = torch.autograd.grad((ours(leaf) ** 2).sum(), [leaf])
    (want,) = torch.autograd.grad((pool(leaf) ** 2).sum(), [leaf])
    assert torch.equal(ours(leaf), pool(leaf)) and torch.equal(got, want)  # outside a map


def test_over_nodes_leaves_a_pool_that_returns_its_indices() -> None:
    model = nn.Sequential(nn.MaxPool2d(2, return_indices=True), nn.MaxPool2d(2))
    copied = over_nodes(model)
    assert type(copied[0]) is nn.MaxPool2d and isinstance(copied[1], MaxPool2dOverNodes)


def linear_inputs(x_shape: tuple[int, ...], shared: set[str], bias: bool = True) -> dict[str, torch.Tensor]:
    """K nodes' float64 inputs of a Linear of 5 -> 4, each stacked on a first K dimension unless `shared`."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"x": x_shape, "weight": (4, 5)} | ({"bias": (4,)} if bias else {})
    return {
        n: torch.randn(s if n in shared else (K, *s), generator=gen, dtype=torch.float64).requires_grad_()
        for n, s in shapes.items()
    }


@pytest.mark.parametrize(
    ("x_shape", "shared", "bias"),
    [
        ((B, 5), set(), True),
        ((B, 5), {"x"}, True),
        ((B, 5), {"weight", "bias"}, True),
        ((B, 5), {"weight"}, True),
        ((B, 5), set(), False),
        ((B, 3, 5), set(), True),
        ((5,), set(), True),
    ],
    ids=["own", "shared-x", "shared-linear", "shared-weight", "no-bias", "3d-input", "one-sample"],
)
def test_each_node_is_its_own_linear_forward_and_backward_in_float64(
    x_shape: tuple[int, ...], shared: set[str], bias: bool
) -> None:
    linear = LinearOverNodes(nn.Linear(5, 4, bias=bias).double())
    inputs = linear_inputs(x_shape, shared, bias)
    names = list(inputs)

    def one(*tensors: torch.Tensor) -> torch.Tensor:
        params = dict(zip(names[1:], tensors[1:], strict=True))
        return functional_call(linear, params, (tensors[0],))

    in_dims = tuple(None if n in shared else 0 for n in names)
    out = vmap(one, in_dims=in_dims)(*inputs.values())
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad((out * probe).sum(), list(inputs.values()))

    def node(k: int, name: str) -> torch.Tensor:
        return inputs[name] if name in shared else inputs[name][k]

    want_out = torch.stack(
        [F.linear(node(k, "x"), node(k, "weight"), node(k, "bias") if bias else None) for k in range(K)]
    )
    want = torch.autograd.grad((want_out * probe).sum(), list(inputs.values()))
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    for name, g, w in zip(names, got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12, msg=name)


def test_under_a_map_a_linear_is_one_product_with_its_bias_and_its_weights_gradient_laid_out_as_they_are() -> None:
    """vmap's own rule: a product, the bias scaled by one and added forward, the bias's gradient scaled by
    one backward, and the weights' gradient transposed (which the fused SGD step copied); here one
    `baddbmm` forward, a product for each gradient and a sum for the bias's."""
    inputs = linear_inputs((B, 5), set())
    linear = LinearOverNodes(nn.Linear(5, 4).double())
    with Operators() as ops:
        out = vmap(lambda x, w, b: functional_call(linear, {"weight": w, "bias": b}, (x,)))(*inputs.values())
        grads = torch.autograd.grad(out.sum(), list(inputs.values()))
    assert ops.counts["baddbmm"] == 1 and ops.counts["bmm"] == 2, ops.counts
    assert not ops.counts["add"] and not ops.counts["mul"], ops.counts
    assert grads[1].shape == (K, 4, 5) and grads[1].is_contiguous()


def test_a_linear_over_nodes_inside_another_map_is_each_nodes_own() -> None:
    """A map around the nodes' (per-sample gradients, say): the product's own generated rule."""
    inputs = linear_inputs((B, 5), set())
    linear = LinearOverNodes(nn.Linear(5, 4).double())

    def node(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return vmap(lambda row: functional_call(linear, {"weight": w, "bias": b}, (row,)))(x)

    out = vmap(node)(*inputs.values())
    x, w, b = inputs.values()
    torch.testing.assert_close(out, torch.stack([F.linear(x[k], w[k], b[k]) for k in range(K)]), rtol=0, atol=1e-12)


def test_outside_a_map_a_linear_over_nodes_is_torchs_linear_and_its_gradient() -> None:
    x, w, b = linear_inputs((B, 5), {"x", "weight", "bias"}).values()
    linear = LinearOverNodes(nn.Linear(5, 4).double())
    out = functional_call(linear, {"weight": w, "bias": b}, (x,))
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=0, atol=0)
    got = torch.autograd.grad(out.square().sum(), [x, w, b])
    want = torch.autograd.grad(F.linear(x, w, b).square().sum(), [x, w, b])
    for g, v in zip(got, want, strict=True):
        torch.testing.assert_close(g, v, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("logits_shape", "shared_y"), [((B, 5), False), ((B, 5), True), ((B, 3, 5), False)], ids=["own", "shared-y", "3d"]
)
def test_the_nodes_cross_entropy_is_bitwise_the_gathered_forms_with_fewer_operators(
    logits_shape: tuple[int, ...], shared_y: bool
) -> None:
    """Per-sample cross-entropy over the nodes: torch's `nll_loss` over all their samples gives what the
    log-softmax gathered at the label gives, forward and backward, bit for bit, in fewer operators."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(K, *logits_shape, generator=gen) * 4).requires_grad_()
    y = torch.randint(0, 5, logits_shape[:-1] if shared_y else (K, *logits_shape[:-1]), generator=gen)
    probe = torch.randn(K, *logits_shape[:-1], generator=gen)
    in_dims = (0, None if shared_y else 0)
    with Operators() as ours_ops:
        ours = vmap(negative_log_likelihood, in_dims=in_dims)(logits, y)
        (ours_grad,) = torch.autograd.grad(ours, [logits], probe)
    with Operators() as theirs_ops:
        theirs = vmap(_gathered, in_dims=in_dims)(logits, y)
        (theirs_grad,) = torch.autograd.grad(theirs, [logits], probe)
    assert torch.equal(ours, theirs) and torch.equal(ours_grad, theirs_grad)
    assert ours_ops.counts["nll_loss_forward"] == 1 and ours_ops.counts["nll_loss_backward"] == 1
    kernels = sum(n for name, n in ours_ops.counts.items() if name != "_unsafe_view")  # a view autograd keeps
    fewer = 2 if shared_y else 3  # labels the nodes share are copied out to every node's samples first
    assert kernels <= sum(theirs_ops.counts.values()) - fewer, (ours_ops.counts, theirs_ops.counts)


def test_outside_a_map_the_cross_entropy_is_the_gathered_form_and_its_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(B, 5, generator=gen, requires_grad=True)
    y = torch.randint(0, 5, (B,), generator=gen)
    out = negative_log_likelihood(logits, y)
    torch.testing.assert_close(out, F.cross_entropy(logits, y, reduction="none"), rtol=0, atol=1e-6)
    assert torch.equal(out, _gathered(logits, y))
    (got,) = torch.autograd.grad(out.sum(), [logits])
    (want,) = torch.autograd.grad(_gathered(logits, y).sum(), [logits])
    assert torch.equal(got, want)
