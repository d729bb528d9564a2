"""``fstier inspect ROOT``: one row per namespace (model, parallel layout,
files, bytes, ages). The report is the library's
(:func:`fstier.tier.scan.inspect_root`, a streaming walk); this module
prints it as a table or one JSON document and maps it onto an exit code.

Parts of ROOT that cannot be read are listed, the rest is still reported,
the totals say they are partial, and the exit status is 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import click

from fstier.cli.exits import ReportFailed
from fstier.cli.options import json_option
from fstier.cli.output import (
    display,
    emit_report,
    fmt_size,
    fmt_time,
    make_console,
    print_unreadable,
)
from fstier.cli.progress import progress_bar, show_progress
from fstier.cli.roots import checked_root_argument, deadline_option, fstier_root
from fstier.cli.tables import Column, terminal_width

if TYPE_CHECKING:  # scan imports the I/O layer (numpy): not for `inspect --help`
    from fstier.tier.scan import NamespaceStats

#: inspect's columns: namespace, files and bytes always; the rest by
#: priority as the terminal's width allows (--wide: all).
INSPECT_COLUMNS = (
    Column("namespace", 0, name=True),
    Column("engine", 1),
    Column("row", 2, "right"),
    Column("blocks/chunk", 5, "right"),
    Column("model", 6),
    Column("revision", 10),
    Column("parallel", 4),
    Column("groups", 8, "right"),
    Column("files", 0, "right"),
    Column("bytes", 0, "right"),
    Column("oldest", 9),
    Column("newest", 3),
    Column("temp", 7, "right"),
)


def inspect_rows(namespaces: Sequence[NamespaceStats]) -> tuple[tuple[Column, ...], list[list[str]]]:
    """The table of ``fstier inspect``: one row of strings per namespace.
    ``row`` is a vLLM namespace's row size (one file's payload; a file is
    that plus a 4 KiB header) and ``blocks/chunk`` vLLM's GPU blocks per
    chunk; ``-`` for fstier's own namespaces."""
    rows = []
    for ns in namespaces:
        rows.append([
            display(ns.namespace),
            ns.engine or "?",
            fmt_size(ns.row_bytes) if ns.row_bytes is not None else "-",
            str(ns.blocks_per_chunk) if ns.blocks_per_chunk is not None else "-",
            display(ns.model) if ns.model is not None else "?",
            display(ns.revision or "-"),
            ns.parallel,
            "-" if ns.num_groups is None else str(ns.num_groups),
            f"{ns.files:,}",
            fmt_size(ns.bytes),
            fmt_time(ns.oldest),
            fmt_time(ns.newest),
            str(ns.temp_files),
        ])
    return INSPECT_COLUMNS, rows


@click.command("inspect")
# A plain string: click.Path would stat ROOT on this thread, past any deadline on a hung mount.
@click.argument("root")
@deadline_option
@click.option("--wide", is_flag=True, help="Show every column, however wide (default: what fits the terminal).")
@json_option
def inspect_cmd(root: str, deadline: float, wide: bool, as_json: bool) -> None:
    """One row per namespace under ROOT: model, parallel layout, files, bytes, ages.

    Namespace, files and bytes are always shown, whole; other columns as the
    terminal's width (COLUMNS) allows, all with --wide. Exit 1 when part of
    ROOT could not be read (the totals are then partial), or when ROOT did
    not answer within --deadline (a hung mount).
    """
    from fstier.tier.scan import inspect_root

    root_path = checked_root_argument(lambda: fstier_root(root), root, deadline)
    with progress_bar("inspect", show_progress(as_json)) as bar:
        report = inspect_root(root_path, on_file=bar.advance)
    verdict = (
        f"totals are partial: {report.unreadable.count:,} path(s) under ROOT could not be read "
        f"(listed above); fix their permissions or run as their owner"
        if report.partial
        else None
    )
    if as_json:
        emit_report(report.to_json(), verdict)
        if verdict is not None:
            raise ReportFailed(verdict)
        return
    from fstier.cli.tables import print_table

    columns, rows = inspect_rows(report.namespaces)
    print_table(columns, rows, title=display(f"fstier root {report.root}"), wide=wide)
    console = make_console()
    for ns in report.namespaces:
        if ns.manifest_error is not None:
            console.print(f"{display(ns.namespace)}: not counted: {display(ns.manifest_error)}", markup=False)
    print_unreadable(console, report.unreadable)
    import textwrap

    summary = (
        f"{len(report.namespaces)} namespace(s), {report.total_files:,} block file(s), "
        f"{fmt_size(report.total_bytes)}; {report.stray_entries} other top-level entries"
    )
    click.echo(textwrap.fill(summary, width=max(terminal_width(), 40)))
    if verdict is not None:
        raise ReportFailed(verdict)
