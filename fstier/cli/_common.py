"""Shared plumbing of the ``fstier`` commands: exit codes, one-line errors,
``--json`` documents, rich consoles, progress on stderr, sizes and times for
people, the ROOT checks every root-walking command makes, and safe printing of
names (file names are data: they may hold rich markup such as ``[red]`` or
bytes that are not UTF-8, and neither may crash or alter the output)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from fstier.cli.exits import EXIT_USAGE, _Fail

F = TypeVar("F", bound=Callable[..., Any])



def _json_option(func: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON document for scripts.")(
        func
    )


def _parse_size_option(value: str, option: str) -> int:
    from fstier.units import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise _Fail(EXIT_USAGE, f"{option}: {exc}") from None


