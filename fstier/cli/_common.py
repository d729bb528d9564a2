"""Shared plumbing of the ``fstier`` commands: exit codes, one-line errors,
``--json`` documents, rich consoles, sizes and times for people."""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from fstier.errors import ConfigError, FstierError

F = TypeVar("F", bound=Callable[..., Any])

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


# -- output helpers ----------------------------------------------------------
def _console(stderr: bool = False) -> Any:
    """A rich console bound to the *current* stdout/stderr (CliRunner swaps them).

    Off a terminal rich would wrap tables at 80 columns; 200 keeps the rows of
    ``inspect`` on one line in logs and in docs/cli.md.
    """
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 200
    return Console(file=stream, width=width, soft_wrap=False, highlight=False)


def _emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


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
        if as_json:
            _emit_json({"ok": False, "exit_code": code, "error": message})
        click.echo(message, err=True)
        sys.exit(code)

    return wrapper  # type: ignore[return-value]


def _json_option(func: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON document for scripts.")(
        func
    )


def _existing_root(root: str) -> Path:
    p = Path(root)
    if not p.exists():
        raise _Fail(EXIT_USAGE, f"ROOT {root!r}: no such directory")
    if not p.is_dir():
        raise _Fail(EXIT_USAGE, f"ROOT {root!r}: not a directory")
    return p


def _fmt_time(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%m-%d %H:%M:%S", time.localtime(ts))


def _fmt_size(n: float) -> str:
    from fstier._units import format_size

    return format_size(n)


def _parse_size_option(value: str, option: str) -> int:
    from fstier._units import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise _Fail(EXIT_USAGE, f"{option}: {exc}") from None


