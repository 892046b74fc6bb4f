"""The `fedmq` command: broker, coordinator, node and run.

Exit codes: 0 success, 2 invalid configuration or arguments, 3 broker unreachable, 4 the federation
failed (no nodes, no progress), 5 a replay differs from its recorded run, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

from fedmq.broker.errors import BusError, CredentialsError
from fedmq.experiments.broker_flags import add_access, broker_access
from fedmq.experiments.service import die_with_parent
from fedmq.fedcore.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_CONFIG, EXIT_BUS, EXIT_FAILED, EXIT_MISMATCH, EXIT_INTERRUPTED = 0, 2, 3, 4, 5, 130

DESCRIPTION = """\
fedmq: event-driven federated learning over MQTT.

  fedmq run EXP.yaml                 run a federation (or every cell of a grid) on this machine
  fedmq broker                       run a development broker (mosquitto if installed, else embedded)
  fedmq coordinator --broker URL --config EXP.yaml    the server daemon
  fedmq node --broker URL --config EXP.yaml --node-id node-000    a node daemon
  fedmq aggregator --broker URL --config EXP.yaml --site site-0   a site aggregator (hierarchy.sites)
  fedmq report RUN_DIR               rebuild the tables and plots of a run from its saved metrics
  fedmq replay RUN_DIR [--set K=V]   replay a recorded run in process and check every model hash
                                     (with --set: the same availability and timing, something changed)
  fedmq simulate EXP.yaml [--scenario FILE]    the federation in one process on a virtual clock
  fedmq methods [NAME]               the methods, and each one's hyperparameters with their defaults
  fedmq bench [SUITE ...|all]        the benchmark suite: codec, transport, rounds, flower, scale, hierarchy,
                                     train, async, node, fedsa, teacher

Start with:  fedmq run experiments/quickstart.yaml
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _device(text: str) -> str:
    """A torch device name, checked without importing torch here: cpu, cuda, cuda:N, mps."""
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda", "mps") or (index and not index.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (cpu, cuda, cuda:1, mps)")
    return text


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    p.add_argument("--log-file", type=Path, help="also write the log to this file")
    p.add_argument("--log-config", type=Path, help="a logging dictConfig YAML file, replacing the defaults")
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=os.environ.get("FEDMQ_LOG_FORMAT") or "text",
        help="text (default), or json: one JSON object a line (time, level, logger, message, process, exception);"
        " FEDMQ_LOG_FORMAT sets the default, and processes `fedmq run` starts inherit it",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, 0 or more, got {text}")
    return value


def _add_service(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "service",
        "As a daemon under systemd, Docker or another supervisor (docs/services.md): with $NOTIFY_SOCKET set it"
        " tells systemd when it is ready, its status and watchdog pings. SIGTERM drains and exits 0; SIGINT"
        " exits 130.",
    )
    g.add_argument(
        "--connect-timeout",
        type=_seconds,
        default=10.0,
        metavar="SECONDS",
        help="at start, wait up to SECONDS for an unreachable broker, retrying with exponential backoff and"
        " jitter, then exit 3 (default 10; 0 tries once; the systemd units wait 300)",
    )
    g.add_argument(
        "--drain-timeout",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="on SIGTERM, the longest the drain may take before the process stops at once with exit 130"
        " (default 60; a second SIGTERM also stops at once)",
    )


def _http_address(text: str) -> tuple[str, int]:
    from fedmq.coordinator.errors import CoordinatorError
    from fedmq.coordinator.http import parse_address

    try:
        return parse_address(text)
    except CoordinatorError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _add_http(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP API and dashboard")
    g.add_argument(
        "--http",
        type=_http_address,
        metavar="[HOST:]PORT",
        help="serve the JSON API, /metrics and a live dashboard on this address (off by default; a bare port"
        " listens on loopback only; 0 picks a free port, written to OUT/http.json)",
    )
    g.add_argument(
        "--http-token-file",
        type=Path,
        metavar="FILE",
        help="require this bearer token (the file's first line, 16 characters or more) on every endpoint but"
        " /healthz and /readyz; a browser opens /?token=TOKEN once and keeps it in an HttpOnly cookie",
    )


def _add_experiment(p: argparse.ArgumentParser, *, positional: bool = False) -> None:
    if positional:
        p.add_argument("config", type=Path, metavar="EXP.yaml", help="the experiment file")
    else:
        p.add_argument("--config", required=True, type=Path, metavar="EXP.yaml", help="the experiment file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set rounds=5 --set train.lr=0.1 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedmq", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "run",
        help="run a whole federation on this machine",
        description="Start a broker (the embedded one unless --broker is given), the coordinator and the nodes as"
        " separate processes; show progress; write the results to the run directory.",
    )
    _add_experiment(p, positional=True)
    p.add_argument("--out", type=Path, help="run directory (default: runs/NAME-TIMESTAMP)")
    p.add_argument(
        "--broker", metavar="URL", help="use this broker, e.g. mqtt://127.0.0.1:1883, instead of starting one"
    )
    p.add_argument("--processes", type=int, help="node-host processes (default: hosting.processes or the core count)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--timeout", type=float, default=None, help="stop the run after this many seconds")
    p.add_argument(
        "--secure",
        action="store_true",
        help="provision the federation (OUT/secure: a CA, a password per node, ACLs) and run it over TLS on a"
        " broker started for it (mosquitto when installed, else the embedded one), no anonymous access",
    )
    p.add_argument(
        "--tensorboard",
        action="store_true",
        help="the coordinator also writes TensorBoard scalars to OUT/tensorboard (each grid cell's to its own;"
        " needs pip install 'fedmq[tensorboard]')",
    )
    _add_http(p)
    add_access(p)
    _add_common(p)

    p = sub.add_parser(
        "status",
        help="a running coordinator's state, from its HTTP API",
        description="Prints what the dashboard shows: the state, the round or model version, accuracy, the last"
        " rounds and the nodes, from a coordinator started with --http. Exit 0, 2 when the token is missing or"
        " wrong, 3 when nothing answers.",
    )
    p.add_argument("target", metavar="URL|RUN_DIR", help="http://HOST:PORT/, or a run directory with http.json")
    p.add_argument("--token-file", type=Path, metavar="FILE", help="the bearer token, if the API wants one")
    p.add_argument("--json", action="store_true", help="print the raw state as JSON instead of tables")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until the run ends")
    p.add_argument("--last", type=_positive_int, default=10, help="rounds shown (default 10)")
    _add_common(p)

    p = sub.add_parser(
        "report",
        help="rebuild a run's report from its saved metrics",
        description="Write report.md (accuracy tables as mean +- std over seeds, rounds to the target, the"
        " paper's figures beside ours), report.json and the accuracy curves (PNG) into RUN_DIR, from the"
        " metrics saved there. Works on a grid's directory and on a single run's.",
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a directory written by `fedmq run`")
    p.add_argument("--no-plots", action="store_true", help="tables only, no PNG curves")
    _add_common(p)

    p = sub.add_parser(
        "replay",
        help="replay a recorded run and check it, or re-run it counterfactually",
        description="Without --set: drive the engine in this process (no broker, the recorded clock) with the"
        " run's recorded events, recompute every node's update and every aggregation, and check each update's"
        " and each model's hash against events.jsonl; exit 0 when all match, 5 at the first difference (the"
        " message names the log line, the step, the node and what differed). With --set: the same"
        " availability and per-task timing the run recorded, with the experiment changed (another method,"
        " seed, buffer size...), written to --out.",
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory with events.jsonl and config.yaml")
    p.add_argument("--out", type=Path, help="write the replay's metrics and summary here (default: none for an exact"
                   " replay; runs/NAME-counterfactual-TIMESTAMP with --set)")  # fmt: skip
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a counterfactual change, e.g. --set method.name=kdia or --set engine.buffer=5 (repeatable)",
    )
    p.add_argument(
        "--device", type=_device, help="torch device (default cpu: a CPU run replays bit for bit on the CPU)"
    )
    p.add_argument(
        "--threads", type=_positive_int, default=1, help="torch threads (default 1, as the node hosts train)"
    )
    _add_common(p)

    p = sub.add_parser(
        "simulate",
        help="run a federation in one process on a virtual clock, under a scenario",
        description="The same engine, methods, data and seeds as `fedmq run`, with no broker and no sleeping:"
        " node availability, compute and link times and dropped tasks come from the scenario (the"
        " experiment's `scenario:` or --scenario), so hours of a federation run in the time its training"
        " takes. Writes a run directory with events.jsonl, which `fedmq replay` can check.",
    )
    _add_experiment(p, positional=True)
    p.add_argument("--scenario", type=Path, metavar="FILE", help="a scenario file (replaces the experiment's)")
    p.add_argument("--out", type=Path, help="run directory (default: runs/NAME-sim-TIMESTAMP)")
    p.add_argument("--device", type=_device, help="torch device (default: cuda when present, else cpu)")
    p.add_argument("--threads", type=_positive_int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--jobs",
        type=_positive_int,
        default=1,
        help="for a grid: cells simulated at once, each in a process of its own (default 1); with a GPU,"
        " several cells share it",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its last checkpoint (simulation.checkpoint_every), ending as an"
        " uncut run would; without one yet, start from the beginning; a finished run or grid cell is not run"
        " again",
    )
    _add_common(p)

    p = sub.add_parser(
        "methods",
        help="list the methods and their hyperparameters",
        description="Without NAME: every method a config's method.name may give. With NAME: its"
        " hyperparameters (method.hyperparams), their types, defaults and what each does.",
    )
    p.add_argument("name", nargs="?", help="one method, e.g. kdia, or your own, e.g. my_package.my_method")
    _add_common(p)

    p = sub.add_parser(
        "bench",
        help="run the benchmark suite",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Measure fedmq side by side with the limits of this machine and with other libraries,"
        " as ratios measured in one run, and print a table per suite (and the targets it meets).\n\n"
        "suites:\n  codec      encode/decode of a ResNet-18-sized model vs memcpy, torch.save, safetensors\n"
        "  transport  45 MB to 1 and to 10 nodes through the broker vs a raw TCP socket; small round trips\n"
        "  rounds     round overhead with no training, 10/100/1000 nodes at C = 0.1 and 1.0\n"
        "  flower     the same FedAvg federation in fedmq and in Flower (simulation and deployment)\n"
        "  scale      the most node daemons on one broker, memory per idle node, rounds at 1% participation\n"
        "  hierarchy  1,000 nodes flat vs in 10 bridged sites: bytes into the central broker, coordinator CPU\n"
        "  train      many simulated nodes trained together (vmap) vs one at a time\n"
        "  sim        the simulator's node training vs bare PyTorch (eager, CUDA graph, vmap); simulate's share\n"
        "  async      sync FedAvg vs FedAsync and FedBuff under heterogeneous speeds; async ingest rate; KDIA\n"
        "  node       one node process: start-up time and memory, on the partition and on its own data (--data)\n"
        "  fedsa      FedSA's skew-aware aggregation vs the weighted mean, K = 5 to 50 updates of ResNet-18\n"
        "  teacher    KDIA's teacher modes with 10,000 nodes: memory and time a round vs the exact teacher\n"
        "  all        every suite above, in that order",
    )
    p.add_argument("suites", nargs="*", default=["all"], metavar="SUITE", help="suites to run (default: all)")
    p.add_argument("--json", type=Path, help="write every figure, ratio and target to this JSON file")
    p.add_argument("--markdown", type=Path, help="write the tables to this markdown file")
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats: checks the suites run")
    p.add_argument(
        "--broker",
        default="auto",
        help="mosquitto, embedded, auto (mosquitto when installed; default) or an mqtt:// URL",
    )
    p.add_argument("--repeats", type=int, help="timed repetitions per figure (default: each suite's own)")
    p.add_argument("--work-dir", type=Path, default=Path("runs/bench"), help="scratch space (default runs/bench)")
    p.add_argument(
        "--opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a suite-specific setting, e.g. --opt nodes=10,100 (repeatable; see docs/bench.md)",
    )
    _add_common(p)

    p = sub.add_parser(
        "broker",
        help="run a development broker",
        description="mosquitto with a generated config (TCP_NODELAY, large packets) when it is installed,"
        " otherwise the embedded pure-Python broker (amqtt, MQTT 3.1.1). Runs until interrupted.",
    )
    p.add_argument("--port", type=int, default=1883, help="TCP port (default 1883)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--config", type=Path, help="a mosquitto.conf to use instead of the generated one")
    p.add_argument("--embedded", action="store_true", help="use the embedded broker even if mosquitto is installed")
    p.add_argument(
        "--secure",
        type=Path,
        metavar="DIR",
        help="serve a federation provisioned into DIR by `fedmq provision`: TLS, its users and topic rules"
        " (its own address and port; --port and --host are ignored)",
    )
    g = p.add_argument_group(
        "site broker (hierarchical federations, docs/hierarchy.md)",
        "A mosquitto for one site, bridged to the central broker: the site's nodes and aggregator connect here;"
        " the bridge carries only the aggregator's topics (its tasks and models in, its status and updates out).",
    )
    g.add_argument(
        "--bridge", metavar="URL", help="the central broker to bridge to, mqtt://HOST:PORT (needs mosquitto)"
    )
    g.add_argument("--site", help="the site this broker serves (its aggregator's node id), e.g. site-0")
    g.add_argument("--federation", help="the federation id of the run (its topics are bridged)")
    g.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="where the site broker keeps its config and its persistent sessions across restarts"
        " (default runs/brokers/FEDERATION-SITE)",
    )
    _add_common(p)

    p = sub.add_parser(
        "provision",
        help="write what a secure federation needs: CA, broker certificate, credentials, broker configs",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write into OUT_DIR (which must be new or empty): a CA and a broker certificate for --host, one"
        " credentials file per identity (the coordinator, the run monitor, each node of the experiment), and a"
        " mosquitto config (and the embedded broker's) with TLS, no anonymous access, persistence, and an ACL in"
        " which each node publishes only on its own topics and reads only its own tasks, the model broadcasts and"
        " the coordinator's state.\n\n"
        "  fedmq provision secure/ --config EXP.yaml --host broker.example.org\n"
        "  fedmq broker --secure secure/\n"
        "  fedmq coordinator --broker mqtts://broker.example.org:8883 --credentials secure/credentials ...\n"
        "  fedmq node --broker mqtts://broker.example.org:8883 --credentials node-003.json --node-id node-003 ...",
    )
    p.add_argument("out", type=Path, metavar="OUT_DIR", help="where to write (new or empty)")
    _add_experiment(p)
    p.add_argument("--federation", help="topic namespace (default: the config's federation or name)")
    p.add_argument(
        "--host",
        dest="hosts",
        action="append",
        metavar="NAME",
        help="a host name or address the broker is reached by, for its certificate (repeatable; default"
        " localhost and 127.0.0.1)",
    )
    p.add_argument("--port", type=int, default=8883, help="the broker's TLS port (default 8883)")
    p.add_argument("--bind", default="127.0.0.1", help="the address the broker listens on (default 127.0.0.1)")
    p.add_argument("--days", type=_positive_int, default=365, help="certificate lifetime in days (default 365)")
    _add_common(p)

    p = sub.add_parser(
        "coordinator",
        help="run the coordinator daemon",
        description="Waits for the experiment's nodes, runs its rounds, writes metrics, participation,"
        " checkpoints and a summary to --out.",
    )
    p.add_argument("--broker", required=True, metavar="URL", help="mqtt://HOST:PORT, or mqtts://HOST:PORT for TLS")
    _add_experiment(p)
    p.add_argument(
        "--out", type=Path, default=Path("runs/coordinator"), help="run directory (default runs/coordinator)"
    )
    p.add_argument("--federation", help="topic namespace (default: the config's federation or name)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint in --out; without one yet, start from the beginning (so a supervisor"
        " can always restart with --resume)",
    )
    _add_service(p)
    p.add_argument("--threads", type=_positive_int, help="torch threads")
    p.add_argument(
        "--tensorboard",
        nargs="?",
        const=True,
        type=Path,
        metavar="DIR",
        help="write accuracy, loss, round time and update counts per round (or version) as TensorBoard scalars"
        " to DIR (default OUT/tensorboard); needs pip install 'fedmq[tensorboard]'",
    )
    _add_http(p)
    add_access(p)
    _add_common(p)

    p = sub.add_parser(
        "node",
        help="run node daemon(s)",
        description="One node daemon per --node-id, all in this process (one MQTT connection each, one"
        " shared dataset load, training one at a time). In an experiment a node takes its shard of the partition;"
        " with --data, a deployed node trains on its own data instead and the dataset is never loaded.",
    )
    p.add_argument("--broker", required=True, metavar="URL", help="mqtt://HOST:PORT, or mqtts://HOST:PORT for TLS")
    p.add_argument(
        "--node-id",
        dest="node_ids",
        action="append",
        required=True,
        metavar="ID",
        help="node id, e.g. node-003 (repeatable; 'all' hosts every node of the experiment)",
    )
    _add_experiment(p)
    p.add_argument("--federation", help="topic namespace (default: the config's federation or name)")
    p.add_argument("--exit-when-done", action="store_true", help="exit when the coordinator finishes the run")
    _add_service(p)
    p.add_argument("--threads", type=_positive_int, help="torch threads")
    p.add_argument("--device", type=_device, help="torch device (default: cuda when present, else cpu)")
    p.add_argument(
        "--data",
        type=Path,
        metavar="PATH",
        help="this node's own data: an .npz of x and y, or a folder PATH/<class index>/*.png (one --node-id;"
        " docs/local-data.md)",
    )
    p.add_argument(
        "--metrics",
        type=_http_address,
        metavar="[HOST:]PORT",
        help="serve Prometheus metrics of this process's nodes at http://HOST:PORT/metrics (a bare port listens on"
        " loopback only; 0 picks a free port, printed at start; docs/metrics.md)",
    )
    add_access(p)
    _add_common(p)

    p = sub.add_parser(
        "aggregator",
        help="run a site aggregator daemon (hierarchical federations)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="One site of an experiment with hierarchy.sites: the coordinator of the site's nodes (on"
        " --broker, the site's broker, federation FED.SITE) and, upstream, one node of the federation (node id"
        " SITE) that sends one partial update a round for all of them. By default upstream is reached through"
        " --broker, bridged to the central broker (`fedmq broker --bridge`); --upstream connects directly."
        " Only methods whose aggregation splits into parts run this way (FedAvg and the methods that reuse its"
        " server); docs/hierarchy.md.\n\n"
        "  fedmq broker --port 1884 --bridge mqtt://central:1883 --federation FED --site site-0\n"
        "  fedmq aggregator --broker mqtt://127.0.0.1:1884 --site site-0 --config EXP.yaml --federation FED\n"
        "  fedmq node --broker mqtt://127.0.0.1:1884 --federation FED.site-0 --node-id node-000 ...",
    )
    p.add_argument("--broker", required=True, metavar="URL", help="the site's broker, where its nodes are")
    p.add_argument("--site", required=True, metavar="SITE", help="the site, e.g. site-0 (hierarchy.sites names them)")
    _add_experiment(p)
    p.add_argument("--upstream", metavar="URL", help="reach the coordinator's broker directly, not through the bridge")
    p.add_argument("--federation", help="topic namespace (default: the config's federation or name)")
    p.add_argument(
        "--worker",
        type=int,
        default=0,
        metavar="N",
        help="this process's number among the site's hierarchy.workers (0 ..), which share the site's rounds",
    )
    p.add_argument("--out", type=Path, help="the site's run directory (default runs/SITE)")
    p.add_argument("--exit-when-done", action="store_true", help="exit when the coordinator finishes the run")
    _add_service(p)
    p.add_argument("--threads", type=_positive_int, help="torch threads")
    _add_common(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    die_with_parent()
    from fedmq.coordinator.errors import CoordinatorError
    from fedmq.experiments import logs

    def say(text: str) -> None:
        print(logs.line(text, args.log_format), file=sys.stderr, flush=True)

    console = not (args.command == "run" and not args.verbose)
    if args.log_format == "json":
        os.environ["FEDMQ_LOG_FORMAT"] = "json"  # the processes `fedmq run` starts log alike
    try:
        logs.setup(
            args.verbose,
            file=args.log_file,
            console=console or args.command != "run",
            config_file=args.log_config,
            fmt=args.log_format,
        )
        if args.command == "broker":
            return _run_async(_broker(args))
        if args.command in ("coordinator", "node", "aggregator"):
            daemons = {"coordinator": _coordinator, "node": _node, "aggregator": _aggregator_daemon}
            return _daemon(daemons[args.command], args)
        if args.command == "report":
            return _report(args)
        if args.command == "status":
            return _status(args)
        if args.command == "methods":
            return _methods(args)
        if args.command == "provision":
            return _provision(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "replay":
            return _replay(args)
        if args.command == "simulate":
            return _simulate(args)
        from fedmq.experiments.runner import run_from_cli

        return _run_async(run_from_cli(args))
    except ConfigError as exc:
        say(f"fedmq: configuration error: {exc}")
        return EXIT_CONFIG
    except DataError as exc:
        say(f"fedmq: data error: {exc}")
        return EXIT_CONFIG
    except CredentialsError as exc:
        say(f"fedmq: credentials error: {exc}")
        return EXIT_CONFIG
    except CoordinatorError as exc:  # raised before the run starts: a checkpoint that cannot be resumed
        say(f"fedmq: coordinator error: {exc}")
        return EXIT_CONFIG
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        say(f"fedmq: {exc.filename}: {exc.strerror or exc}" if exc.filename else f"fedmq: {exc}")
        return EXIT_CONFIG
    except BusError as exc:
        say(f"fedmq: broker error: {exc}")
        return EXIT_BUS
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _daemon(command: Callable[[argparse.Namespace, Any], Coroutine[Any, Any, int]], args: argparse.Namespace) -> int:
    """A daemon command: SIGTERM drains it (exit 0), SIGINT interrupts it (130); `experiments.service`."""
    from fedmq.experiments.service import Signals

    signals = Signals(drains=True, drain_s=args.drain_timeout, forced_exit=EXIT_INTERRUPTED)
    return _run_async(command(args, signals), signals)


def _run_async(coro: Coroutine[Any, Any, int], signals: Any = None) -> int:
    """Run `coro` until it returns its exit code. SIGINT cancels it (exit 130), and so does SIGTERM,
    except for a daemon (`signals`, an `experiments.service.Signals`), which SIGTERM drains (exit 0)."""
    from fedmq.experiments.service import Signals

    signals = signals or Signals(drains=False, forced_exit=EXIT_INTERRUPTED)

    async def runner() -> int:
        task = asyncio.current_task()
        assert task is not None
        signals.install(task)
        try:
            return await coro
        except asyncio.CancelledError:
            return EXIT_OK if signals.drained else EXIT_INTERRUPTED
        finally:
            signals.close()

    with asyncio.Runner(loop_factory=event_loop_factory()) as run:
        return run.run(runner())


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where it is installed (a round of 10 of 100 nodes: ~10% less time, `fedmq bench rounds`),
    unless FEDMQ_EVENT_LOOP=asyncio; None means asyncio's own loop."""
    choice = os.environ.get("FEDMQ_EVENT_LOOP", "uvloop")
    if choice not in ("uvloop", "asyncio"):
        raise ConfigError(f"FEDMQ_EVENT_LOOP={choice!r}: use 'uvloop' or 'asyncio'")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _load(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from fedmq.experiments.config import load_config

    return load_config(args.config, args.overrides)


def _threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def _methods(args: argparse.Namespace) -> int:
    from fedmq.fedcore.algorithms import AGGREGATORS, ALGORITHMS, get_algorithm
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
        return _aggregator(args.name)
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


def _aggregator(name: str) -> int:
    import inspect

    from fedmq.fedcore.algorithms import AGGREGATORS, async_refusal
    from fedmq.fedcore.algorithms.describe import class_options

    hyperparams, _ = AGGREGATORS[name]
    print(f"{name}: an averaging rule for method.aggregator.name\n")
    reason = async_refusal("fedavg", name)
    print(f"  asynchronous (engine.kind async): {'no: ' + reason if reason else 'yes'}\n")
    if hyperparams is None:
        print("  no options")
    for option in class_options(hyperparams) if hyperparams is not None else []:
        print(f"  {option.name}: {option.type} = {option.default!r}")
        for line in textwrap.wrap(option.doc or inspect.getdoc(hyperparams) or "", 92):
            print(f"      {line}")
    return EXIT_OK


def _bench(args: argparse.Namespace) -> int:
    from fedmq.experiments.bench import SUITES, run_suite
    from fedmq.experiments.bench.common import BenchOptions, write_results

    names = list(SUITES) if "all" in args.suites else args.suites
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise ConfigError(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(SUITES)} or all")
    if args.repeats is not None and args.repeats < 1:
        raise ConfigError("--repeats must be at least 1")
    extra: dict[str, str] = {}
    for item in args.opt:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--opt {item!r}: expected KEY=VALUE")
        extra[key.strip()] = value.strip()
    options = BenchOptions(
        quick=args.quick, broker=args.broker, work_dir=args.work_dir, repeats=args.repeats, extra=extra
    )
    reports = []
    for name in names:
        report = run_suite(name, options, log=lambda text: print(text, file=sys.stderr, flush=True))
        print(report.markdown(), flush=True)
        reports.append(report)
        write_results(reports, args.json, args.markdown)  # after each suite: a long run keeps what it measured
    missed = [(r.suite, t.text) for r in reports for t in r.targets if not t.met]
    if missed:
        print(f"{len(missed)} target(s) not met: " + "; ".join(f"{s}: {t}" for s, t in missed), flush=True)
    return EXIT_OK


def _replay(args: argparse.Namespace) -> int:
    import json
    from datetime import datetime

    import torch

    from fedmq.experiments.replay import ReplayError, counterfactual, replay_run

    device = torch.device(args.device) if args.device else None
    try:
        if args.overrides:
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            out = args.out or Path("runs") / f"{args.run_dir.resolve().name}-counterfactual-{stamp}"
            result = counterfactual(args.run_dir, args.overrides, out, device=device, threads=args.threads)
            print(json.dumps(result, indent=2))
            return EXIT_OK
        outcome = replay_run(args.run_dir, device=device, threads=args.threads)
    except ReplayError as exc:
        print(f"fedmq replay: {exc}", file=sys.stderr)
        return EXIT_MISMATCH
    r = outcome.report
    original = f"{outcome.original_wall_seconds:.1f} s" if outcome.original_wall_seconds is not None else "unknown"
    print(
        f"replayed {r.events} events in {outcome.wall_seconds:.1f} s (the run took {original}): {r.updates} updates,"
        f" {r.aggregations} aggregated models, {r.evaluations} evaluations and {r.commands} engine decisions matched"
    )
    if args.out is not None:
        from fedmq.experiments.replay import write_replay

        write_replay(args.out, outcome)
    if outcome.mismatch is not None:
        print(f"fedmq replay: differs from the recorded run at {outcome.mismatch}", file=sys.stderr)
        return EXIT_MISMATCH
    for note in outcome.notes:
        print(f"fedmq replay: {note}", file=sys.stderr)
    if not outcome.ok:
        return EXIT_MISMATCH
    print(f"final model sha256 {r.final_model_sha256}: identical to the recorded run")
    return EXIT_OK


def _simulate(args: argparse.Namespace) -> int:
    import json
    from datetime import datetime

    import torch

    from fedmq.experiments.config import parse_config, read_yaml
    from fedmq.experiments.simulate import simulate

    data = read_yaml(args.config)
    if args.overrides:
        from fedmq.experiments.config import apply_overrides

        data = apply_overrides(data, args.overrides)
    if args.scenario is not None:
        from fedmq.experiments.scenario import resolve_scenario

        data["scenario"] = resolve_scenario(str(args.scenario), Path.cwd())
    if args.resume and args.out is None:
        raise ConfigError("--resume needs --out DIR: the run directory to continue")
    if "grid" in data:
        return _simulate_grid(args, data)
    cfg = parse_config(data, source=str(args.config))
    _threads(args.threads)
    out = args.out or Path("runs") / f"{cfg.name}-sim-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    summary = simulate(cfg, out, device=torch.device(args.device) if args.device else None, resume=args.resume)
    keys = ("state", "final_accuracy", "simulated_seconds", "wall_seconds", "simulated_per_wall_second")
    print(json.dumps({k: summary.get(k) for k in keys} | {"out": str(out)}, indent=2))
    return EXIT_OK if summary["state"] == "finished" else EXIT_FAILED


def _simulate_grid(args: argparse.Namespace, data: dict[str, Any]) -> int:
    from datetime import datetime

    from fedmq.experiments.grid import expand
    from fedmq.experiments.simulate_grid import simulate_grid

    grid = expand(data, source=str(args.config))
    first = grid.cells[0].config
    out = args.out or Path("runs") / f"{first.name}-sim-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    return simulate_grid(grid, out, jobs=args.jobs, device=args.device, threads=args.threads, resume=args.resume)


def _status(args: argparse.Namespace) -> int:
    import json
    import time

    from rich.console import Console

    from fedmq.coordinator.errors import CoordinatorError
    from fedmq.coordinator.http import read_token
    from fedmq.experiments.status import Unreachable, render, resolve_url, snapshot

    try:
        token = read_token(args.token_file) if args.token_file else None
    except CoordinatorError as exc:
        raise ConfigError(str(exc)) from exc
    url = resolve_url(args.target)
    console = Console(highlight=False)
    seen = False
    while True:
        try:
            state = snapshot(url, token)
        except Unreachable as exc:
            if not seen:
                print(f"fedmq status: {exc}", file=sys.stderr)
                return EXIT_BUS
            # a daemon exits when its run is over: after answering, silence is the end, not a fault
            print(f"fedmq status: {url} stopped answering: the coordinator has exited", file=sys.stderr)
            return EXIT_OK
        seen = True
        if args.json:
            print(json.dumps(state, indent=2))
        else:
            if args.watch:
                console.clear()
            render(state, console, args.last)
        if not args.watch or state["status"]["state"] in ("finished", "failed", "stopped"):
            return EXIT_OK
        time.sleep(args.watch)


def _report(args: argparse.Namespace) -> int:
    from fedmq.experiments.report import write_report

    if not args.run_dir.is_dir():
        raise ConfigError(f"{args.run_dir} is not a directory; give the --out of a `fedmq run`")
    try:
        path = write_report(args.run_dir, plots=not args.no_plots)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    print(f"report written: {path}")
    return EXIT_OK


async def _broker(args: argparse.Namespace) -> int:
    from fedmq.broker.embedded import serve_embedded
    from fedmq.broker.mosquitto import find_mosquitto, start_mosquitto

    config_file, secure_amqtt, host, port = args.config, None, args.host, args.port
    scheme = "mqtt"
    if args.secure is not None:
        if args.config is not None:
            raise ConfigError("--secure DIR brings its own broker config; leave out --config")
        secure_amqtt, (host, port) = _provisioned(args.secure)
        config_file, scheme = args.secure / "mosquitto" / "mosquitto.conf", "mqtts"
    if args.bridge is not None:
        if args.config is not None or args.secure is not None:
            raise ConfigError("--bridge writes the site broker's config itself; leave out --config and --secure")
        config_file = _site_broker_config(args)
    if args.config is None:  # a mosquitto.conf of the user's says where it listens itself
        _check_free(host, port)
    if not args.embedded and find_mosquitto() is not None:
        proc = start_mosquitto(port, bind=host, config_file=config_file)
        print(f"mosquitto listening on {scheme}://{host}:{port} (pid {proc.pid}); Ctrl-C stops it", flush=True)
        try:
            await asyncio.to_thread(proc.wait)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)
        return EXIT_OK if proc.returncode in (0, -signal.SIGTERM) else EXIT_FAILED
    if args.config is not None and not args.embedded:
        raise ConfigError("--config is a mosquitto.conf, but mosquitto is not installed (apt-get install mosquitto)")
    version = "MQTT 3.1.1" + (", TLS, provisioned users and topic rules" if secure_amqtt else "")
    print(f"embedded broker (amqtt, {version}) listening on {scheme}://{host}:{port}; Ctrl-C stops it", flush=True)
    await serve_embedded(host, port, secure=secure_amqtt)
    return EXIT_OK


def _site_broker_config(args: argparse.Namespace) -> Path:
    """`fedmq broker --bridge`: the site broker's mosquitto.conf, written into its state directory."""
    import pwd

    from fedmq.broker.bridge import render_site_config
    from fedmq.broker.config import BusConfig
    from fedmq.broker.mosquitto import find_mosquitto
    from fedmq.broker.topics import check_id

    if find_mosquitto() is None:
        raise ConfigError(
            "--bridge runs mosquitto's own bridge, but mosquitto is not installed (apt-get install mosquitto)"
        )
    if args.embedded:
        raise ConfigError("--bridge needs mosquitto (the embedded broker has no bridge); leave out --embedded")
    if not args.site or not args.federation:
        raise ConfigError("--bridge needs --site (the site's aggregator node id) and --federation (the run's)")
    try:
        check_id(args.site, "--site")
        check_id(args.federation, "--federation")
        central = BusConfig.from_url(args.bridge)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if central.tls:
        raise ConfigError("--bridge over TLS is not generated yet: bridge to an mqtt:// address (docs/hierarchy.md)")
    state = args.state_dir or Path("runs") / "brokers" / f"{args.federation}-{args.site}"
    state.mkdir(parents=True, exist_ok=True)
    path = state / "mosquitto.conf"
    path.write_text(
        render_site_config(
            port=args.port,
            bind=args.host,
            central=(central.host, central.port),
            federation=args.federation,
            site=args.site,
            persistence_dir=state.resolve(),
            user=pwd.getpwuid(os.geteuid()).pw_name,
        )
    )
    return path


def _check_free(host: str, port: int) -> None:
    """A broker that cannot listen exits 3 saying where, before it starts (mosquitto would exit 1
    without a word here; amqtt with a traceback)."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        why = exc.strerror or exc
        raise BusError(f"cannot listen on {host}:{port}: {why} (is another broker running there?)") from None


def _provisioned(directory: Path) -> tuple[Path, tuple[str, int]]:
    """A provisioned folder's embedded-broker config (checked as the embedded broker reads it) and the
    address both brokers listen on."""
    from fedmq.broker.embedded import secure_amqtt_config

    path = directory / "amqtt" / "amqtt.json"
    if not path.is_file():
        raise ConfigError(f"{directory} was not written by `fedmq provision` (no {path})")
    host, _, port = secure_amqtt_config(path)["listeners"]["default"]["bind"].rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{path}: bind must be HOST:PORT; run fedmq provision again")
    return path, (host, int(port))


def _provision(args: argparse.Namespace) -> int:
    from fedmq.broker.provision import DEFAULT_HOSTS, provision
    from fedmq.experiments.build import federation_id

    cfg = _load(args)
    try:
        result = provision(
            args.out,
            federation=args.federation or federation_id(cfg),
            nodes=cfg.node_ids(),
            hosts=args.hosts or DEFAULT_HOSTS,
            port=args.port,
            bind=args.bind,
            days=args.days,
        )
    except (ValueError, FileExistsError) as exc:
        raise ConfigError(str(exc)) from None
    print(f"provisioned federation {result.federation!r} ({len(result.nodes)} nodes) in {result.directory}")
    print((result.directory / "README.txt").read_text().split("\n\n", 1)[1], end="")
    return EXIT_OK


async def _coordinator(args: argparse.Namespace, signals: Any) -> int:
    from fedmq.broker.tuning import tune_process
    from fedmq.coordinator.run_dir import write_json, write_text
    from fedmq.experiments.build import build_coordinator, load_split, partition_report
    from fedmq.experiments.plots import partition_png
    from fedmq.experiments.service import Notifier, coordinator_status

    if args.tensorboard is not None:
        from fedmq.coordinator.tensorboard import check_installed

        check_installed()  # before loading anything: exit 2 saying what to install
    cfg = _load(args)
    notifier = Notifier()
    signals.on_stop = notifier.stopping
    notifier.status("loading the data")
    _threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.resume:
        _resume_or_start(args.out)
    # atomically: `fedmq run` starts node hosts reading this very file while the coordinator starts
    write_text(args.out / "config.yaml", cfg.to_yaml())
    report = partition_report(cfg, load_split(cfg))
    write_json(args.out / "partition.json", report)
    partition_png(args.out / "partition.png", report)
    coordinator = build_coordinator(
        cfg, args.broker, args.out, federation=args.federation, resume=args.resume, access=broker_access(args)
    )
    tune_process(coordinator.bus_config)
    with _tensorboard(args, coordinator):
        # the HTTP API first: its options are checked at once, and /readyz says 503 while the broker is awaited
        async with _http_api(args, coordinator, cfg):
            await _wait_for_broker(args, cfg, notifier)  # after what can be checked here: a mistake is said at once
            async with notifier.running(
                [coordinator.connected], lambda: coordinator_status(coordinator, cfg.step_name)
            ):
                summary = await coordinator.serve()
    if summary.final_accuracy is not None:
        print(
            f"final accuracy {summary.final_accuracy:.4f} (best {summary.best_accuracy:.4f}) after"
            f" {summary.rounds_completed} {cfg.step_name}s in {summary.wall_seconds:.1f} s"
        )
    return EXIT_OK if summary.state == "finished" else EXIT_FAILED


@contextlib.contextmanager
def _tensorboard(args: argparse.Namespace, coordinator: Any) -> Iterator[None]:
    """TensorBoard scalars of the metrics lines (`--tensorboard`) for as long as the coordinator serves."""
    if args.tensorboard is None:
        yield
        return
    from fedmq.coordinator.tensorboard import TensorBoardScalars

    scalars = TensorBoardScalars(args.out / "tensorboard" if args.tensorboard is True else args.tensorboard)
    coordinator.watchers.append(scalars)
    try:
        yield
    finally:
        scalars.close()


@contextlib.asynccontextmanager
async def _http_api(args: argparse.Namespace, coordinator: Any, cfg: Any) -> AsyncIterator[None]:
    """The HTTP API and dashboard (`--http`) for as long as the coordinator serves."""
    if args.http is None:
        yield
        return
    import yaml

    from fedmq.coordinator.errors import CoordinatorError
    from fedmq.coordinator.http import CoordinatorAPI, read_token
    from fedmq.coordinator.metrics import CoordinatorMetrics

    try:
        token = read_token(args.http_token_file) if args.http_token_file else None
        metrics = CoordinatorMetrics.attach(coordinator)
        api = CoordinatorAPI(coordinator, config=yaml.safe_load(cfg.to_yaml()), token=token, metrics=metrics.render)
        url = await api.start(*args.http)
    except CoordinatorError as exc:
        raise ConfigError(str(exc)) from exc
    print(f"dashboard: {url}", file=sys.stderr, flush=True)
    try:
        yield
    finally:
        await api.stop()


async def _wait_for_broker(args: argparse.Namespace, cfg: Any, notifier: Any) -> None:
    """`--connect-timeout`: once what can be checked locally is (config, data, node ids: exit 2), a
    daemon waits for its broker, and exits 3 naming it if it does not come."""
    from fedmq.experiments.build import bus_config
    from fedmq.experiments.service import wait_for_broker

    config = bus_config(cfg, args.broker)
    notifier.status(f"connecting to the broker {config.url}")
    await wait_for_broker(
        config,
        args.connect_timeout,
        on_retry=lambda n, why: notifier.status(f"waiting for the broker {config.url} ({why}; attempt {n})"),
    )


def _resume_or_start(out: Path) -> None:
    """`--resume` without a checkpoint starts from the beginning: the records of an attempt that
    stopped before its first checkpoint go, as on a resume those after the checkpoint do."""
    from fedmq.coordinator.run_dir import CHECKPOINT, RunDir

    if not (out / CHECKPOINT).exists():
        logger.info("--resume: no checkpoint in %s yet; starting from the beginning", out)
        RunDir(out).truncate_metrics_after(-1)


async def _node(args: argparse.Namespace, signals: Any) -> int:
    import torch

    from fedmq.broker.tuning import tune_process
    from fedmq.experiments.build import build_nodes
    from fedmq.experiments.service import Notifier, nodes_status
    from fedmq.fednode.daemon import serve_nodes

    cfg = _load(args)
    notifier = Notifier()
    signals.on_stop = notifier.stopping
    _threads(args.threads)
    ids = cfg.node_ids() if args.node_ids == ["all"] else args.node_ids
    daemons = build_nodes(
        cfg,
        args.broker,
        ids,
        federation=args.federation,
        exit_when_done=args.exit_when_done,
        device=torch.device(args.device) if args.device else None,
        data_path=args.data,
        access=broker_access(args),
    )
    tune_process(daemons[0].bus_config)  # the process's, shared by its nodes' clients
    await _wait_for_broker(args, cfg, notifier)  # after what can be checked here: a mistake is said at once

    def drain() -> None:  # until here SIGTERM just stops
        for daemon in daemons:
            daemon.drain("SIGTERM")

    signals.drain = drain
    async with (
        _node_metrics(args, daemons),
        notifier.running([d.connected for d in daemons], lambda: nodes_status(daemons)),
    ):
        failed = await serve_nodes(daemons)
    if failed:
        print(f"fedmq node: {len(failed)} of {len(daemons)} node(s) stopped on a broker error: {', '.join(failed)}",
              file=sys.stderr)  # fmt: skip
        return EXIT_BUS
    return EXIT_OK


async def _aggregator_daemon(args: argparse.Namespace, signals: Any) -> int:
    from fedmq.broker.tuning import tune_process
    from fedmq.experiments.build import build_site_aggregator
    from fedmq.experiments.service import Notifier

    cfg = _load(args)
    notifier = Notifier()
    signals.on_stop = notifier.stopping
    _threads(args.threads)
    aggregator = build_site_aggregator(
        cfg,
        args.broker,
        args.site,
        args.out or Path("runs") / args.site,
        federation=args.federation,
        upstream_url=args.upstream,
        worker=args.worker,
        exit_when_done=args.exit_when_done,
    )
    tune_process(aggregator.site.bus_config)
    await _wait_for_broker(args, cfg, notifier)
    signals.drain = lambda: aggregator.drain("SIGTERM")
    connected = [aggregator.site.connected, aggregator.upstream.connected]
    async with notifier.running(connected, lambda: f"site {args.site}: {aggregator.site.live} nodes live"):
        state = await aggregator.serve()
    return EXIT_OK if state in ("finished", "stopped") else EXIT_FAILED


@contextlib.asynccontextmanager
async def _node_metrics(args: argparse.Namespace, daemons: list[Any]) -> AsyncIterator[None]:
    """Prometheus /metrics of the node daemons (`--metrics`) for as long as they serve."""
    if args.metrics is None:
        yield
        return
    from fedmq.fednode.metrics import NodeHostMetrics, serve_metrics

    host, port = args.metrics
    async with contextlib.AsyncExitStack() as stack:
        try:
            url = await stack.enter_async_context(serve_metrics(NodeHostMetrics(daemons).render, host, port))
        except OSError as exc:
            raise ConfigError(f"--metrics {host}:{port}: cannot listen there: {exc.strerror or exc}") from exc
        print(f"metrics: {url}/metrics", file=sys.stderr, flush=True)
        yield


if __name__ == "__main__":
    raise SystemExit(main())
