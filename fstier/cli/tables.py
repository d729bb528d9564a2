"""Tables that fit the terminal without cutting what people type back.

A command describes its columns with a priority (0: always shown) and hands
over its rows as plain strings; :func:`print_table` keeps, in priority
order, the columns whose full width still fits the terminal (``COLUMNS``,
else the terminal's size, else 200 columns off a terminal) and prints them
in their declared order. A kept column is never folded, squeezed or
shortened with an ellipsis: a namespace name (with the digest ``--namespace``
needs) is printed whole, and when even the always-shown columns are wider
than the terminal the line is longer rather than cut. ``wide=True``
(``--wide``) keeps every column. Dropped columns are named under the table
so people know ``--wide`` shows them. Pure formatting: no I/O but the print.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Column", "fit_columns", "print_table", "terminal_width"]

#: Width assumed off a terminal (logs, pipes) when COLUMNS is not set.
OFF_TERMINAL_WIDTH = 200
#: Characters between two columns: one space of padding each side and the
#: (blank) column divider of rich's SIMPLE_HEAD box.
GAP = 3


@dataclass(frozen=True)
class Column:
    """One column: its header, priority (0 = always shown, then 1, 2, ...)
    and alignment."""

    header: str
    priority: int = 0
    justify: str = "left"
    #: a name column: moved to the end of the line when even the always-shown
    #: columns are wider than the terminal, so short names keep short lines
    #: and only a name too long for the terminal makes its own line longer
    name: bool = False


def terminal_width(stream: Any = None) -> int:
    """``COLUMNS`` when set to a positive number, else the terminal's width
    when ``stream`` (stdout) is a terminal, else :data:`OFF_TERMINAL_WIDTH`."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    stream = sys.stdout if stream is None else stream
    try:
        if stream.isatty():
            return shutil.get_terminal_size().columns
    except (AttributeError, ValueError, OSError):
        pass
    return OFF_TERMINAL_WIDTH


def _cell_width(text: str) -> int:
    from rich.cells import cell_len

    return max((cell_len(line) for line in text.splitlines()), default=0)


def fit_columns(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int, wide: bool = False) -> list[int]:
    """Indices (in declared order) of the columns to show within ``width``."""
    widths = [
        max([_cell_width(c.header), *(_cell_width(r[i]) for r in rows)]) for i, c in enumerate(columns)
    ]
    if wide:
        return list(range(len(columns)))
    keep = {i for i, c in enumerate(columns) if c.priority == 0}
    used = sum(widths[i] for i in keep) + GAP * max(0, len(keep) - 1)
    for i in sorted((i for i, c in enumerate(columns) if c.priority > 0), key=lambda i: columns[i].priority):
        extra = widths[i] + GAP
        if used + extra <= width:
            keep.add(i)
            used += extra
    return sorted(keep)


def _build(columns: Sequence[Column], rows: Sequence[Sequence[str]], shown: Sequence[int]) -> Any:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for i in shown:
        c = columns[i]
        table.add_column(c.header, justify=c.justify, no_wrap=True, overflow="fold")  # type: ignore[arg-type]
    for r in rows:
        table.add_row(*(Text(r[i], justify=columns[i].justify) for i in shown))  # type: ignore[arg-type]
    return table


def print_table(
    columns: Sequence[Column],
    rows: Sequence[Sequence[str]],
    *,
    title: str | None = None,
    wide: bool = False,
    stream: Any = None,
) -> list[str]:
    """Print ``title``, then the rows with the columns that fit, then which
    columns were left out (if any); returns their headers (none with ``wide``)."""
    from rich.console import Console

    stream = sys.stdout if stream is None else stream
    width = terminal_width(stream)
    shown = fit_columns(columns, rows, width, wide)
    table = _build(columns, rows, shown)
    needed = sum(
        max([_cell_width(columns[i].header), *(_cell_width(r[i]) for r in rows)]) for i in shown
    ) + GAP * max(0, len(shown) - 1)
    if needed > width and not wide:
        shown = [i for i in shown if not columns[i].name] + [i for i in shown if columns[i].name]
        table = _build(columns, rows, shown)
    # Rendered no narrower than the table (rich would fold or crop cells),
    # then every line's padding is stripped: a line is as long as its text.
    import io

    buf = io.StringIO()
    console = Console(file=buf, width=max(width, needed), soft_wrap=False, highlight=False, color_system=None)
    console.print(table)
    if title:
        import textwrap

        # Wrapped at spaces only: a path in a title is never broken.
        stream.write(textwrap.fill(title, width=max(width, 40), break_long_words=False, break_on_hyphens=False) + "\n")
    out = []
    for line in buf.getvalue().splitlines():
        line = line.rstrip()
        if line and set(line) <= {"─", " "}:
            line = line[: min(len(line), width)]  # the header rule never wraps
        out.append(line + "\n")
    stream.write("".join(out))
    dropped = [columns[i].header for i in range(len(columns)) if i not in shown]
    if dropped:
        import textwrap

        note = f"(not shown at {width} columns: {', '.join(dropped)}; --wide shows every column)"
        stream.write(textwrap.fill(note, width=max(width, 40)) + "\n")
    return dropped
