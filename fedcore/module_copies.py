"""A model with some of its modules replaced for one use, the model itself left as it is.

Vectorised training runs a model's forward pass with a few layers done another way (BatchNorm over each
node's real samples, `fedcore.masked_norm`; GroupNorm and max-pooling as one over the nodes,
`fedcore.layers_over_nodes`). The copy it runs shares every tensor with the model: only the modules on
the way to a replaced one are copied, shallowly (their own parameter, buffer and module tables), so a
large model costs nothing to copy and the model's parameters stay the ones trained.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from torch import nn


def replace_modules(
    model: nn.Module,
    match: Callable[[nn.Module], bool],
    make: Callable[[nn.Module, str], nn.Module],
    prefix: str = "",
) -> nn.Module:
    """`model` with each module that `match`es replaced by `make(module, its state-dict prefix)`: a shallow
    copy of the modules on the way to one, the model itself where none matches below."""
    if match(model):
        return make(model, prefix)
    if not any(match(m) for m in model.modules()):
        return model
    copied = copy.copy(model)
    copied._parameters = dict(model._parameters)
    copied._buffers = dict(model._buffers)
    copied._modules = {
        name: None if child is None else replace_modules(child, match, make, f"{prefix}{name}.")
        for name, child in model._modules.items()
    }
    return copied
