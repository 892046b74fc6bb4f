"""Opt-in downloads (``data.download: true``) through torchvision, for machines where it imports.

torchvision is imported inside `fetch` only, never at module level: the core does not depend on
it, and its PyPI build does not import with the CPU build of torch. The files land where the
loaders look for them (``ROOT/mnist/MNIST/raw``, ``ROOT/cifar10/cifar-10-batches-py``, ...).
"""

from __future__ import annotations

import logging
from pathlib import Path

from fedmq.fedcore.errors import DataError

logger = logging.getLogger(__name__)

# dataset name -> (torchvision.datasets class, folder under the data root)
TORCHVISION = {
    "mnist": ("MNIST", "mnist"),
    "fashion-mnist": ("FashionMNIST", "fashion-mnist"),
    "cifar10": ("CIFAR10", "cifar10"),
    "cifar100": ("CIFAR100", "cifar100"),
}


def fetch(name: str, root: Path | None) -> None:
    """Fetch `name`'s files into `root` with torchvision; DataError when it cannot."""
    if name not in TORCHVISION:
        raise DataError(f"dataset {name!r} cannot be downloaded automatically; its loader's error says where to get it")
    if root is None:
        raise DataError(f"downloading {name!r} needs a data root: set data.root or FEDMQ_DATA_ROOT")
    try:
        import torchvision.datasets as tv  # optional, and imported only here
    except Exception as exc:  # torchvision fails in several ways when it does not match torch
        raise DataError(f"data.download needs torchvision, which does not import here ({exc})") from exc
    cls, folder = TORCHVISION[name]
    target = root / folder
    logger.info("downloading %s into %s", name, target)
    try:
        for train in (True, False):
            getattr(tv, cls)(root=str(target), train=train, download=True)
    except (OSError, RuntimeError) as exc:
        raise DataError(f"downloading {name!r} into {target} failed: {exc}") from exc
