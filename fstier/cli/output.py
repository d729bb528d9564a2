"""What the ``fstier`` commands print: rich consoles bound to the current
streams, one JSON document per ``--json`` run, sizes and times for people,
and names printed safely.

File names are data: they may hold rich markup such as ``[red]`` or bytes
that are not UTF-8 (decoded by ``os.fsdecode`` into lone surrogates), and
neither may crash or alter the output. :func:`display` escapes such bytes as
``\\xff``, :func:`cell` keeps rich from reading markup, and every JSON
document goes through :func:`json_safe`. Pure formatting: no I/O but the
print, and rich is imported only when a console or a cell is made.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import click

from fstier.cli.exits import EXIT_FAILURE, EXIT_OK

__all__ = [
    "MAX_LISTED",
    "cell",
    "display",
    "emit_json",
    "emit_report",
    "fmt_size",
    "fmt_time",
    "json_safe",
    "make_console",
    "print_unreadable",
]


def make_console(stderr: bool = False) -> Any:
    """A rich console bound to the *current* stdout/stderr (CliRunner swaps them).

    Off a terminal rich would wrap tables at 80 columns; 200 keeps the rows of
    ``inspect`` on one line in logs and in docs/cli.md.
    """
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 200
    return Console(file=stream, width=width, soft_wrap=False, highlight=False)


#: Paths a text report lists before "... and N more" (JSON lists them all).
MAX_LISTED = 50


def print_unreadable(console: Any, unreadable: Any) -> None:
    """List the paths a walk could not read (a :class:`~fstier.tier.scan.Unreadable`),
    the first :data:`MAX_LISTED` of them, then how many more."""
    for path, error in unreadable.paths[:MAX_LISTED]:
        console.print(f"unreadable: {display(path)}: {error}", markup=False)
    if unreadable.count > MAX_LISTED:
        more = unreadable.count - MAX_LISTED
        console.print(f"... and {more:,} more unreadable (use --json for the list)", markup=False)


def display(text: str) -> str:
    """``text`` as it can be printed anywhere: a name that was not valid UTF-8
    (decoded by ``os.fsdecode`` into lone surrogates) shows its raw bytes as
    backslash escapes (``\\xff``) instead of crashing a strict UTF-8 stdout."""
    if not any("\udc80" <= ch <= "\udcff" for ch in text):
        return text
    return os.fsencode(text).decode("utf-8", "backslashreplace")


def cell(text: object) -> Any:
    """A table cell or title that rich prints literally: no markup is
    interpreted (a model called ``team/llama[/]-ft`` would otherwise crash
    rich, and ``[red]`` would vanish) and undecodable bytes are escaped."""
    from rich.text import Text

    return Text(display(str(text)))


def json_safe(obj: Any) -> Any:
    if isinstance(obj, str):
        return display(obj)
    if isinstance(obj, dict):
        return {json_safe(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def emit_report(doc: dict[str, Any], error: str | None = None) -> None:
    """A command's JSON result with ``ok`` and ``exit_code`` first; a result
    that fails the command (exit 1) carries ``error``, the one line the text
    output ends with, like every other failure document."""
    ok = error is None
    head: dict[str, Any] = {"ok": ok, "exit_code": EXIT_OK if ok else EXIT_FAILURE}
    if error is not None:
        head["error"] = display(error)
    emit_json({**head, **{k: v for k, v in doc.items() if k not in head}})


def emit_json(obj: Any) -> None:
    # Lone surrogates are legal in Python strings but not in UTF-8 JSON that
    # other languages' parsers accept: print undecodable names escaped.
    click.echo(json.dumps(json_safe(obj), indent=2, sort_keys=False, default=str))


def fmt_time(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%m-%d %H:%M:%S", time.localtime(ts))


def fmt_size(n: float) -> str:
    from fstier.units import format_size

    return format_size(n)
