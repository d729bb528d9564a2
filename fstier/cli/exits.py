"""Exit codes of the ``fstier`` command and the failures that carry them.

Every command ends in one of four codes (docs/cli.md, "Conventions"):
0 ok, 1 a runtime failure or something bad found and not fixed, 2 usage or
configuration error, 130 interrupted (Ctrl-C). A failure is one line on
stderr (and, under ``--json``, one JSON document on stdout), never a
traceback. No I/O here; importing it costs nothing (``fstier --help``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from fstier.errors import ConfigError, FstierError

F = TypeVar("F", bound=Callable[..., Any])

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
#: 128 + SIGINT, what shells report for a command stopped by Ctrl-C.
EXIT_INTERRUPTED = 130


class _Fail(Exception):
    """Internal: stop a command with an exit code and one line."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _handle_errors(func: F) -> F:
    """Map exceptions to exit codes with one clear line (and a JSON error
    document when the command was asked for ``--json``)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from fstier.cli.output import display, emit_json

        as_json = bool(kwargs.get("as_json"))
        try:
            return func(*args, **kwargs)
        except _Fail as exc:
            code, message = exc.code, exc.message
        except ConfigError as exc:
            code, message = EXIT_USAGE, f"config error: {exc}"
        except FstierError as exc:
            code, message = EXIT_FAILURE, f"error: {exc}"
        except OSError as exc:
            where = f" {exc.filename}" if exc.filename else ""
            code, message = EXIT_FAILURE, f"error:{where}: {exc.strerror or exc}"
        message = display(message)
        if as_json:
            emit_json({"ok": False, "exit_code": code, "error": message})
        click.echo(message, err=True)
        sys.exit(code)

    return wrapper  # type: ignore[return-value]
