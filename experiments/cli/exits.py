"""The exit codes of `fedmq`, and which error is which: one table, read by `main` for every command.

A command raises the error that says what went wrong, or returns `EXIT_FAILED` or `EXIT_MISMATCH`;
`main` turns an error into its code and one line on stderr, never a traceback. The Python API
(`fedmq.api`) raises the same errors, so a notebook and a shell script read a failure alike.
"""

from __future__ import annotations

from collections.abc import Callable

from fedmq.broker.errors import BusError, CredentialsError
from fedmq.fedcore.errors import ConfigError, DataError

EXIT_OK = 0
EXIT_CONFIG = 2  # invalid configuration, data, credentials or arguments
EXIT_BUS = 3  # the broker cannot be reached
EXIT_FAILED = 4  # the federation failed (no nodes, no progress)
EXIT_MISMATCH = 5  # a replay differs from its recorded run
EXIT_INTERRUPTED = 130  # SIGINT (and SIGTERM, but for a daemon, which drains)

Say = Callable[[BaseException], str | None]

FILE_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def _labelled(label: str) -> Say:
    return lambda exc: f"fedmq: {label}: {exc}"


def _file(exc: BaseException) -> str:
    """A file that cannot be read or written is named, with the system's reason."""
    assert isinstance(exc, OSError)
    return f"fedmq: {exc.filename}: {exc.strerror or exc}" if exc.filename else f"fedmq: {exc}"


def _errors() -> tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], int, Say], ...]:
    """Each error the commands raise on purpose, its exit code and the line that says it; the first
    that matches wins. Built when an error comes, so that `fedmq --help` imports no coordinator."""
    from fedmq.coordinator.errors import CoordinatorError

    return (
        (ConfigError, EXIT_CONFIG, _labelled("configuration error")),
        (DataError, EXIT_CONFIG, _labelled("data error")),
        (CredentialsError, EXIT_CONFIG, _labelled("credentials error")),
        # raised before the run starts: a checkpoint that cannot be resumed
        (CoordinatorError, EXIT_CONFIG, _labelled("coordinator error")),
        (FILE_ERRORS, EXIT_CONFIG, _file),
        (BusError, EXIT_BUS, _labelled("broker error")),
        (KeyboardInterrupt, EXIT_INTERRUPTED, lambda exc: None),
    )


def exit_for(exc: BaseException) -> tuple[int, str | None] | None:
    """The exit code of `exc` and the line to print (None: nothing), or None for an error no command
    raises on purpose: a bug, which keeps its traceback."""
    for kinds, code, say in _errors():
        if isinstance(exc, kinds):
            return code, say(exc)
    return None
