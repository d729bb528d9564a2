"""``fstier inspect ROOT``: one row per namespace (model, parallel layout,
files, bytes, ages), from a streaming walk (:mod:`fstier.cli.scan`)."""

from __future__ import annotations

import click

from fstier.cli._common import (
    _console,
    _emit_json,
    _existing_root,
    _fmt_size,
    _fmt_time,
    _handle_errors,
    _json_option,
)


@click.command("inspect")
@click.argument("root", type=click.Path(file_okay=False))
@_json_option
@_handle_errors
def inspect_cmd(root: str, as_json: bool) -> None:
    """One row per namespace under ROOT: model, parallel layout, files, bytes, ages."""
    from fstier.cli.scan import scan_root

    report = scan_root(_existing_root(root))
    if as_json:
        _emit_json(
            {
                "ok": True,
                "root": report.root,
                "namespaces": [ns.to_json() for ns in report.namespaces],
                "stray_entries": report.stray_entries,
                "total_files": sum(ns.files for ns in report.namespaces),
                "total_bytes": sum(ns.bytes for ns in report.namespaces),
            }
        )
        return
    from rich.table import Table

    table = Table(title=f"fstier root {report.root}")
    for col in ("namespace", "model", "revision", "parallel", "groups", "files", "bytes", "oldest", "newest", "temp"):
        # Names are what people copy into --namespace: never fold them.
        table.add_column(col, no_wrap=col in ("namespace", "parallel"), min_width=24 if col == "model" else None, overflow="fold")
    for ns in report.namespaces:
        groups = "-" if ns.num_groups is None else str(ns.num_groups)
        model = ns.model if ns.model is not None else f"? ({ns.manifest_error})"
        table.add_row(
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
    console = _console()
    console.print(table)
    total_files = sum(ns.files for ns in report.namespaces)
    total_bytes = sum(ns.bytes for ns in report.namespaces)
    console.print(
        f"{len(report.namespaces)} namespace(s), {total_files:,} block file(s), "
        f"{_fmt_size(total_bytes)}; {report.stray_entries} other top-level entries",
        markup=False,
    )

