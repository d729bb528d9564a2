"""``fstier inspect ROOT``: one row per namespace (model, parallel layout,
files, bytes, ages), from a streaming walk (:mod:`fstier.cli.scan`).

Parts of ROOT that cannot be read are listed, the rest is still reported,
the totals say they are partial, and the exit status is 1.
"""

from __future__ import annotations

import sys

import click

from fstier.cli._common import (
    EXIT_FAILURE,
    _cell,
    _console,
    _emit_report,
    _fmt_size,
    _fmt_time,
    _fstier_root,
    _handle_errors,
    _json_option,
    _print_unreadable,
    _progress,
    _show_progress,
)


@click.command("inspect")
@click.argument("root", type=click.Path(file_okay=False))
@_json_option
@_handle_errors
def inspect_cmd(root: str, as_json: bool) -> None:
    """One row per namespace under ROOT: model, parallel layout, files, bytes, ages.

    Exit 1 when part of ROOT could not be read (the totals are then partial).
    """
    from fstier.cli.scan import scan_root

    root_path = _fstier_root(root)
    with _progress("inspect", _show_progress(as_json)) as bar:
        report = scan_root(root_path, on_file=bar.advance)
    total_files = sum(ns.files for ns in report.namespaces)
    total_bytes = sum(ns.bytes for ns in report.namespaces)
    partial = bool(report.unreadable)
    verdict = (
        f"totals are partial: {report.unreadable.count:,} path(s) under ROOT could not be read "
        f"(listed above); fix their permissions or run as their owner"
        if partial
        else None
    )
    if as_json:
        _emit_report(
            {
                "root": report.root,
                "namespaces": [ns.to_json() for ns in report.namespaces],
                "stray_entries": report.stray_entries,
                "total_files": total_files,
                "total_bytes": total_bytes,
                "partial": partial,
                "unreadable_count": report.unreadable.count,
                "unreadable": report.unreadable.to_json(),
            },
            verdict,
        )
        if partial:
            sys.exit(EXIT_FAILURE)
        return
    from rich.table import Table

    table = Table(title=_cell(f"fstier root {report.root}"))
    for col in ("namespace", "model", "revision", "parallel", "groups", "files", "bytes", "oldest", "newest", "temp"):
        # Names are what people copy into --namespace: never fold them.
        table.add_column(col, no_wrap=col in ("namespace", "parallel"), min_width=24 if col == "model" else None, overflow="fold")
    for ns in report.namespaces:
        groups = "-" if ns.num_groups is None else str(ns.num_groups)
        model = ns.model if ns.model is not None else f"? ({ns.manifest_error})"
        table.add_row(
            *(
                _cell(v)
                for v in (
                    ns.namespace,
                    model,
                    ns.revision or "-",
                    ns.parallel,
                    groups,
                    f"{ns.files:,}",
                    _fmt_size(ns.bytes),
                    _fmt_time(ns.oldest),
                    _fmt_time(ns.newest),
                    str(ns.temp_files),
                )
            )
        )
    console = _console()
    console.print(table)
    _print_unreadable(console, report.unreadable)
    console.print(
        f"{len(report.namespaces)} namespace(s), {total_files:,} block file(s), "
        f"{_fmt_size(total_bytes)}; {report.stray_entries} other top-level entries",
        markup=False,
    )
    if verdict is not None:
        click.echo(verdict, err=True)
        sys.exit(EXIT_FAILURE)
