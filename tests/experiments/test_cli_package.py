"""The command line as a package: each command a module in the table, and one table of exit codes."""

from __future__ import annotations

import argparse

import pytest

from fedmq.broker.errors import BusError, CredentialsError
from fedmq.coordinator.errors import CoordinatorError
from fedmq.experiments.bench import SUITES
from fedmq.experiments.cli import COMMANDS, DESCRIPTION, build_parser
from fedmq.experiments.cli.exits import exit_for
from fedmq.fedcore.errors import ConfigError, DataError


def _subparsers() -> argparse._SubParsersAction[argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub


def test_commands_each_module_declares_the_subparser_of_its_name_in_the_tables_order() -> None:
    """`fedmq --help` lists the commands as COMMANDS holds them, each subparser made from its module's
    declaration: HELP its line there, DESCRIPTION heading its own help, then the module's options."""
    sub = _subparsers()
    assert list(sub.choices) == list(COMMANDS)
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    for name, module in COMMANDS.items():
        parser = sub.choices[name]
        assert (parser.prog, helps[name], parser.description) == (f"fedmq {name}", module.HELP, module.DESCRIPTION)
        alone = argparse.ArgumentParser()
        module.add_arguments(alone)
        assert {a.dest for a in alone._actions} <= {a.dest for a in parser._actions}, name


def test_the_summary_atop_fedmq_help_names_every_command_and_every_benchmark_suite() -> None:
    """The summary is written by hand (a line of use for each command): it had left out `status`,
    `provision` and two suites added later."""
    lines = DESCRIPTION.splitlines()
    for name in COMMANDS:
        assert any(line.strip().startswith(f"fedmq {name} ") for line in lines), name
    (bench_at,) = [i for i, line in enumerate(lines) if line.strip().startswith("fedmq bench ")]
    named = " ".join(lines[bench_at : bench_at + 2]).split("suite:")[1]
    assert [s.strip() for s in named.split(",")] == list(SUITES)


def test_every_command_takes_the_logging_options_after_its_own() -> None:
    """`main` reads the logging options whatever the command: `build_parser` adds them to each, last."""
    for name, parser in _subparsers().choices.items():
        assert [a.dest for a in parser._actions][-4:] == ["verbose", "log_file", "log_config", "log_format"], name


def test_a_description_laid_out_by_hand_keeps_its_lines() -> None:
    """A DESCRIPTION with line breaks (examples, a table) keeps them; argparse would run its lines
    together."""
    sub = _subparsers()
    laid_out = [name for name, module in COMMANDS.items() if "\n" in module.DESCRIPTION]
    assert laid_out  # bench, provision, aggregator
    for name in laid_out:
        text = sub.choices[name].format_help()
        for line in COMMANDS[name].DESCRIPTION.splitlines():
            assert line in text, (name, line)


@pytest.mark.parametrize(
    ("error", "code", "line"),
    [
        (ConfigError("rounds: must be 1 or more"), 2, "fedmq: configuration error: rounds: must be 1 or more"),
        (DataError("no such dataset"), 2, "fedmq: data error: no such dataset"),
        (CredentialsError("bad.json does not exist"), 2, "fedmq: credentials error: bad.json does not exist"),
        (CoordinatorError("checkpoint unreadable"), 2, "fedmq: coordinator error: checkpoint unreadable"),
        (
            FileNotFoundError(2, "No such file or directory", "exp.yaml"),
            2,
            "fedmq: exp.yaml: No such file or directory",
        ),
        (PermissionError("denied"), 2, "fedmq: denied"),
        (BusError("cannot connect"), 3, "fedmq: broker error: cannot connect"),
        (KeyboardInterrupt(), 130, None),
    ],
)
def test_exit_for_an_expected_error_gives_its_code_and_one_line(error: BaseException, code: int, line: str) -> None:
    """Each error a command raises on purpose is one exit code and one line, never a traceback."""
    assert exit_for(error) == (code, line)


def test_exit_for_an_unexpected_error_is_none_so_it_keeps_its_traceback() -> None:
    """A bug is no exit code of the table: `main` lets it through."""
    assert exit_for(RuntimeError("a bug")) is None
    assert exit_for(OSError("not a file error")) is None
