"""Options several ``fstier`` commands share, and how their values are read.

``--json`` (:func:`json_option`) is the same flag on every command;
:func:`parse_size_option` reads a size such as ``500GiB`` and names the
option in its one-line error. No I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from fstier.cli.exits import UsageFailure

__all__ = ["json_option", "parse_size_option"]

F = TypeVar("F", bound=Callable[..., Any])


def json_option(func: F) -> F:
    """``--json``, passed to the command as ``as_json``."""
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON document for scripts.")(
        func
    )


def parse_size_option(value: str, option: str) -> int:
    """Bytes in ``value`` (``500GiB``, ``2TB``, ``4096``); a bad one is a
    :class:`~fstier.cli.exits.UsageFailure` that names ``option``."""
    from fstier.units import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise UsageFailure(f"{option}: {exc}") from None
