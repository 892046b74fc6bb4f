"""What `fedmq methods` prints: each method's summary and its hyperparameters with their defaults
and the attribute docstrings written under them in the module (read from the source, so the text
the code documents is the text users see)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
from dataclasses import dataclass

from fedmq.fedcore.algorithms import plugins
from fedmq.fedcore.algorithms.base import AlgorithmSpec


@dataclass(frozen=True, slots=True)
class Option:
    name: str
    type: str
    default: object
    doc: str


def summary(spec: AlgorithmSpec) -> str:
    """The first line of the method module's docstring (a user method's: the module holding its SPEC,
    which may reuse a built-in method's Hyperparams)."""
    module = plugins.module_of(spec.name) or spec.hyperparams.__module__
    doc = (inspect.getdoc(sys.modules[module]) or "").strip()
    return doc.splitlines()[0] if doc else spec.name


def options(spec: AlgorithmSpec) -> list[Option]:
    """The Hyperparams fields in order, each with the docstring string that follows it in the class body."""
    return class_options(spec.hyperparams)


def class_options(hyperparams: type) -> list[Option]:
    """`options` of any options dataclass (an aggregator's too). A field's docstring is read from the
    class that declares it, so a Hyperparams that extends a rule's options (FedSA's extends SA's)
    shows the inherited fields' docs too."""
    docs: dict[str, str] = {}
    for cls in reversed(hyperparams.__mro__):  # a subclass's own docstring wins over its base's
        if dataclasses.is_dataclass(cls):
            docs.update(_field_docs(cls))
    out = []
    for f in dataclasses.fields(hyperparams):
        default = f.default if f.default is not dataclasses.MISSING else None
        out.append(Option(f.name, str(f.type), default, docs.get(f.name, "")))
    return out


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring strings written under the fields in `cls`'s own body, by field name."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            text = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else ""
            docs[node.target.id] = " ".join(str(text).split())
    return docs
