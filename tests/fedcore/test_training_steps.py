"""`SGDSteps`, local training's SGD without torch's Optimizer class: bitwise the class's steps, and no
torch._dynamo import (what the class costs a process at its first use)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedmq.fedcore.training import LossTotal, SGDSteps, TrainSettings
from tests.interpreter import fresh_python

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])]  # fmt: skip


class Net(nn.Module):
    """Two layers and a parameter that some steps leave without a gradient (SGD skips it then)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 3)
        self.spare = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor, use_spare: bool) -> torch.Tensor:
        out = self.b(torch.relu(self.a(x)))
        return out * self.spare if use_spare else out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "settings",
    [TrainSettings(lr=0.05, momentum=0.9, weight_decay=1e-3), TrainSettings(lr=0.1, momentum=0.0, weight_decay=0.0)],
    ids=["momentum-decay", "plain"],
)
def test_sgd_steps_are_bitwise_torch_optim_sgd(settings: TrainSettings, dtype: torch.dtype, device: str) -> None:
    """Eight steps, some of them with a parameter that has no gradient: every weight and every momentum
    buffer equal torch.optim.SGD's, bit for bit."""
    torch.manual_seed(0)
    ours, theirs = Net().to(device, dtype), Net().to(device, dtype)
    theirs.load_state_dict(ours.state_dict())
    steps = SGDSteps(ours, settings)
    optimizer = torch.optim.SGD(
        theirs.parameters(), lr=settings.lr, momentum=settings.momentum, weight_decay=settings.weight_decay
    )
    gen = torch.Generator().manual_seed(1)
    for s in range(8):
        x = torch.randn(16, 6, generator=gen).to(device, dtype)
        y = torch.randint(0, 3, (16,), generator=gen).to(device)
        for model, opt in ((ours, steps), (theirs, optimizer)):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x, use_spare=s % 3 != 1), y).backward()
            opt.step()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p, q), name
    if settings.momentum:
        kept = [optimizer.state[q]["momentum_buffer"] for q in theirs.parameters()]
        assert all(b is not None and torch.equal(b, k) for b, k in zip(steps.buffers, kept, strict=True))
    assert not torch.equal(ours.spare, torch.ones(3, device=device, dtype=dtype))  # the spare did train


def test_local_training_imports_no_torch_dynamo() -> None:
    """A process that trains with `local_sgd` (a node daemon) never imports torch._dynamo, which torch's
    Optimizer classes import at their first use (1.6 s on a 2-core CPU)."""
    code = (
        "import sys, torch\n"
        "from fedmq.fedcore.data import TensorDataset\n"
        "from fedmq.fedcore.training import TrainSettings, local_sgd\n"
        "data = TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,)), 3)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(6, 3))\n"
        "local_sgd(model, data, TrainSettings(momentum=0.9, batch_size=8), torch.Generator().manual_seed(0))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    assert fresh_python(code).strip() == "False"


@pytest.mark.parametrize("device", DEVICES)
def test_the_loss_total_kept_on_the_device_is_pythons_float_sum_bitwise(device: str) -> None:
    """`LossTotal` on the device (a GPU's: read once, not at every step) adds the same bits as the
    Python float sum local training kept before, over a thousand float32 losses and batch sizes; the
    default decides by the losses' device."""
    gen = torch.Generator().manual_seed(0)
    losses = (torch.rand(1000, generator=gen) * 5).float().to(device)
    sizes = torch.randint(1, 65, (1000,), generator=gen).tolist()
    want = 0.0
    for loss, n in zip(losses.cpu().tolist(), sizes, strict=True):
        want += loss * n
    totals = {"python": LossTotal(on_device=False), "device": LossTotal(on_device=True), "default": LossTotal()}
    for loss, n in zip(losses, sizes, strict=True):
        for total in totals.values():
            total.add(loss, n)
    assert {name: total.value() for name, total in totals.items()} == dict.fromkeys(totals, want)
    assert (totals["default"].device_total is not None) == (device == "cuda")
