"""`fedmq methods`: the methods and averaging rules a config may name, and each one's options."""

from __future__ import annotations

import argparse
import textwrap

from fedmq.experiments.cli.exits import EXIT_OK
from fedmq.fedcore.errors import ConfigError

HELP = "list the methods and their hyperparameters"
DESCRIPTION = (
    "Without NAME: every method a config's method.name may give. With NAME: its"
    " hyperparameters (method.hyperparams), their types, defaults and what each does."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="one method, e.g. kdia, or your own, e.g. my_package.my_method")


def run(args: argparse.Namespace) -> int:
    from fedmq.fedcore.aggregation import AGGREGATORS
    from fedmq.fedcore.algorithms import ALGORITHMS, get_algorithm
    from fedmq.fedcore.algorithms.describe import options, summary
    from fedmq.fedcore.algorithms.plugins import installed, origin_of

    if args.name is None:
        width = max(map(len, [*ALGORITHMS, *installed()]))
        for name, spec in ALGORITHMS.items():
            mode = "sync" if spec.coordinator.sync_only else "sync/async"
            print(f"{name:<{width}}  {mode:<10}  {summary(spec)}")
        for name in installed():  # the user's, from fedmq.methods entry points
            if name in ALGORITHMS:
                print(f"{name:<{width}}  {'ignored':<10}  a fedmq.methods entry point with a built-in name: rename it")
                continue
            try:
                spec = get_algorithm(name)
            except ConfigError as exc:
                print(f"{name:<{width}}  {'broken':<10}  {exc}")
                continue
            mode = "sync" if spec.coordinator.sync_only else "sync/async"
            print(f"{name:<{width}}  {mode:<10}  {summary(spec)} [{origin_of(name)}]")
        print("\nfedmq methods NAME: its hyperparameters (method.hyperparams in an experiment file), and why a")
        print("fedmq method marked sync cannot run with engine.kind async")
        print("fedmq methods my_package.my_method: a method of your own, a module holding SPEC (docs/plugins.md);")
        print("fedmq methods declared as fedmq.methods entry points are listed above")
        print(f"\nfedmq averaging rules (method.aggregator.name): {', '.join(sorted(AGGREGATORS))};")
        print("fedmq methods RULE: its options (method.aggregator.options)")
        return EXIT_OK
    if args.name in AGGREGATORS and args.name not in ALGORITHMS:
        return _rule(args.name)
    spec = get_algorithm(args.name)
    origin = origin_of(spec.name)
    print(f"{spec.name}: {summary(spec)}" + (f"\n  from {origin}" if origin else "") + "\n")
    reason = spec.coordinator.sync_only
    print(f"  asynchronous (engine.kind async): {'no: ' + reason if reason else 'yes'}\n")
    for option in options(spec):
        print(f"  {option.name}: {option.type} = {option.default!r}")
        if option.doc:
            for line in textwrap.wrap(option.doc, 92):
                print(f"      {line}")
    return EXIT_OK


def _rule(name: str) -> int:
    """`fedmq methods RULE`: an averaging rule (method.aggregator.name) and its options."""
    import inspect

    from fedmq.fedcore.aggregation import async_refusal, rule
    from fedmq.fedcore.algorithms.describe import class_options

    hyperparams, _ = rule(name)
    print(f"{name}: an averaging rule for method.aggregator.name\n")
    reason = async_refusal(name)
    print(f"  asynchronous (engine.kind async): {'no: ' + reason if reason else 'yes'}\n")
    if hyperparams is None:
        print("  no options")
    for option in class_options(hyperparams) if hyperparams is not None else []:
        print(f"  {option.name}: {option.type} = {option.default!r}")
        for line in textwrap.wrap(option.doc or inspect.getdoc(hyperparams) or "", 92):
            print(f"      {line}")
    return EXIT_OK
