"""Per-component random streams: one independent generator per (seed, role, node, round, ...).

No global RNG is touched: sampling, partitioning, initialisation and each node's training each
draw from their own stream, so that adding a component or a node never shifts another's draws.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn


def _key(part: str | int) -> int:
    if isinstance(part, bool) or not isinstance(part, int | str):
        raise TypeError(f"stream keys are str or int, got {type(part).__name__}")
    if isinstance(part, int):
        if part < 0:
            return (1 << 32) + (-part)  # keeps -1 (round before the first) distinct from 1
        return part
    return zlib.crc32(part.encode()) | (1 << 40)  # strings never collide with small ints


def seed_sequence(seed: int, *keys: str | int) -> np.random.SeedSequence:
    return np.random.SeedSequence(entropy=int(seed), spawn_key=tuple(_key(k) for k in keys))


def stream(seed: int, *keys: str | int) -> np.random.Generator:
    """An independent numpy generator for one component, e.g. ``stream(seed, "sampler", round)``."""
    return np.random.Generator(np.random.PCG64(seed_sequence(seed, *keys)))


def torch_generator(seed: int, *keys: str | int, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch generator seeded from the same scheme (for shuffling and dropout on a node)."""
    value = int(seed_sequence(seed, *keys).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))
    gen = torch.Generator(device=device)
    gen.manual_seed(value)
    return gen


_GLOBAL_STREAM = threading.RLock()


@contextmanager
def global_stream(seed: int | None = None) -> Iterator[None]:
    """torch's global random stream for the block only, seeded with `seed` (or as it is), then restored,
    held by one thread at a time: what a module's own initialisation draws from (`nn.Linear` takes no
    generator). Without the lock, two threads of one process (cells simulated side by side) would
    interleave their draws, and one thread's restore would rewind the other's stream."""
    with _GLOBAL_STREAM, torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        yield


def global_stream_layer(model: nn.Module) -> str | None:
    """The first layer of `model` that draws from torch's global random stream while it trains (dropout,
    RReLU: they take no generator), said in words, or None. Such a model's training depends on what
    else draws from that stream in the process (cells simulated side by side). A forward pass that
    calls `F.dropout` itself is not seen."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return f"{f'its layer {name!r}' if name else 'the model'} is a dropout layer"
        if isinstance(module, nn.RReLU):
            return f"{f'its layer {name!r}' if name else 'the model'} is an RReLU layer"
    return None


def torch_seed(seed: int, *keys: str | int) -> int:
    return int(seed_sequence(seed, *keys).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def deterministic_kernels(device: str | torch.device) -> None:
    """On a CUDA device, have cuDNN choose deterministic algorithms and never benchmark (for the whole
    process: torch's flags are global). By default cuDNN may pick a convolution backward that sums
    with atomics, so two runs of one seed differ in their last bits, more with every round, and a GPU
    run could not be replayed bit for bit. The CPU's kernels need nothing. fedmq's training processes
    call this once they know their device (`fednode.workspace.Workspace`, the coordinator's half)."""
    cudnn_kernels(device, "deterministic")


def cudnn_kernels(device: str | torch.device, choice: str) -> None:
    """On a CUDA device, have cuDNN choose its algorithms the `choice` way (`CUDNN_CHOICES`) for the whole
    process; a CPU's kernels need nothing. `fedmq simulate` asks for its `simulation.cudnn` once its
    federation is built: only "deterministic" replays bit for bit on a GPU."""
    flags = _cudnn_flags(choice)
    if torch.device(device).type == "cuda":
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags


CUDNN_CHOICES: dict[str, tuple[bool, bool]] = {
    "deterministic": (True, False),
    "default": (False, False),
    "benchmark": (False, True),
}
"""cuDNN's ways of choosing a convolution's algorithms, by name -> (torch.backends.cudnn's `deterministic`,
`benchmark`): deterministic ones only (`deterministic_kernels`: what fedmq's training processes ask, so
that a GPU run replays bit for bit), cuDNN's own default choice, or the fastest found by timing each
shape's candidates on its first run (both free to sum with atomics, in no fixed order)."""


@contextmanager
def cudnn_choice(name: str) -> Iterator[None]:
    """Inside the block, cuDNN chooses its algorithms the `name` way (`CUDNN_CHOICES`); its flags are
    restored after. For the whole process: torch's flags are global. A convolution's algorithm is
    chosen when it first runs, and a captured CUDA graph keeps the one it captured."""
    flags = _cudnn_flags(name)
    cudnn = torch.backends.cudnn
    before = cudnn.deterministic, cudnn.benchmark
    cudnn.deterministic, cudnn.benchmark = flags
    try:
        yield
    finally:
        cudnn.deterministic, cudnn.benchmark = before


def _cudnn_flags(name: str) -> tuple[bool, bool]:
    if name not in CUDNN_CHOICES:
        raise ValueError(f"cuDNN's choice must be one of {', '.join(CUDNN_CHOICES)}, not {name!r}")
    return CUDNN_CHOICES[name]
