"""``fstier verify``: options in, :func:`fstier.tier.verify.verify_root` called,
its :class:`~fstier.tier.verify.VerifyReport` printed (a table, or one JSON
document with ``--json``), and the outcome mapped onto an exit code (the
typed failures of :mod:`fstier.cli.exits`): 0 when nothing bad remains and
everything could be read, 1 otherwise, 2 for a bad ROOT or ``--namespace``.

What is checked, what ``--fix`` removes and what it never touches is the
library's (see :mod:`fstier.tier.verify`); this module only presents it.
The report types are re-exported here (their old import path).
"""

from __future__ import annotations

from pathlib import Path

import click

from fstier.cli.exits import ReportFailed, RootRefused, UsageFailure
from fstier.cli.options import json_option
from fstier.cli.output import (
    MAX_LISTED,
    display,
    emit_report,
    fmt_size,
    make_console,
    print_unreadable,
)
from fstier.cli.progress import progress_bar, show_progress
from fstier.cli.roots import check_root_shape, checked_root_argument, deadline_option, existing_root
from fstier.tier.scan import checked_root
from fstier.tier.verify import (
    BadFile,
    NamespaceVerify,
    VerifyReport,
    count_blocks,
    namespace_dir,
    verify_root,
)

__all__ = ["BadFile", "NamespaceVerify", "VerifyReport", "run_verify"]


def run_verify(
    root: Path, *, namespace: str | None = None, fix: bool = False, full: bool = True, progress: bool = False
) -> VerifyReport:
    """:func:`~fstier.tier.verify.verify_root` with a progress bar on stderr
    (``progress``: a terminal only; the blocks are counted first for its total)."""
    total = count_blocks(root, namespace) if progress else None
    with progress_bar("verify", progress, total) as bar:
        return verify_root(root, namespace=namespace, fix=fix, headers_only=not full, on_file=bar.advance)


def _checked_root(root: str, namespace: str | None) -> Path:
    """ROOT as :func:`~fstier.cli.roots.existing_root` has it, refused when it
    is not an fstier root or ``--namespace`` is not one directory name in it."""
    root_path = existing_root(root)
    if namespace is not None:
        try:
            checked_root(root_path)  # not a namespace directory itself
        except ValueError as exc:
            raise RootRefused(f"ROOT {exc} (and --namespace NAME one of its namespaces)") from None
        # One directory name, never a path: --fix must not reach outside ROOT.
        try:
            namespace_dir(root, namespace)  # the name as given, in the message
        except ValueError as exc:
            raise UsageFailure(f"--{exc}") from None
    else:
        check_root_shape(root_path, root)
    return root_path


# -- the command -----------------------------------------------------------
@click.command("verify")
# A plain string: click.Path would stat ROOT on this thread, past any deadline on a hung mount.
@click.argument("root")
@click.option("--namespace", "namespace", default=None, help="Only this namespace directory name.")
@click.option("--wide", is_flag=True, help="Show every column, however wide (default: what fits the terminal).")
@click.option("--fix", is_flag=True, help="Remove every bad block file (temp files are left to `fstier gc`).")
@click.option(
    "--headers-only",
    is_flag=True,
    help="Check headers, keys and lengths but skip reading payloads (fast).",
)
@deadline_option
@json_option
def verify_cmd(
    root: str, namespace: str | None, wide: bool, fix: bool, headers_only: bool, deadline: float, as_json: bool,
) -> None:
    """Read and check every block under ROOT (header, key, length, checksum).

    Exit 1 when a bad file was found and not removed, or when ROOT did not
    answer within --deadline (a hung mount).
    """
    root_path = checked_root_argument(lambda: _checked_root(root, namespace), root, deadline)
    report = run_verify(root_path, namespace=namespace, fix=fix, full=not headers_only, progress=show_progress(as_json))
    if as_json:
        emit_report(report.to_json(), None if report.ok else _verdict(report))
    else:
        from fstier.cli.tables import Column, print_table

        # Namespace names are what --namespace takes back: printed whole, never
        # shortened; the other columns as the terminal's width allows.
        columns = (Column("namespace", 0, name=True), Column("checked", 0, "right"), Column("ok", 1, "right"),
                   Column("bad", 0, "right"), Column("removed", 0, "right"), Column("bytes", 2, "right"))
        rows = [
            [display(ns.namespace), f"{ns.checked:,}", f"{ns.good:,}", f"{ns.bad:,}", f"{ns.removed:,}",
             fmt_size(ns.bytes)]
            for ns in report.namespaces
        ]
        print_table(columns, rows, title=display(f"verify {root}" + (" (headers only)" if headers_only else "")),
                    wide=wide)
        console = make_console()
        for bad in report.bad[:MAX_LISTED]:
            if bad.reason.startswith("unreadable"):
                console.print(
                    f"unreadable: {display(bad.path)}: {bad.reason.removeprefix('unreadable: ')} (kept)", markup=False
                )
                continue
            state = "removed" if bad.removed else "kept"
            console.print(f"bad: {display(bad.path)}: {bad.reason} ({state})", markup=False)
        if len(report.bad) > MAX_LISTED:
            console.print(f"... and {len(report.bad) - MAX_LISTED} more (use --json for all)", markup=False)
        print_unreadable(console, report.unreadable_dirs)
        console.print(
            f"{report.checked:,} file(s) checked in {report.seconds:.2f} s: {len(report.bad)} bad, "
            f"{report.removed} removed; {_verdict(report)}",
            markup=False,
        )
    if not report.ok:
        # The table's last line (or the JSON document's ``error``) says it.
        raise ReportFailed(_verdict(report), shown=True)


def _verdict(report: VerifyReport) -> str:
    """What the run found, and the one thing that fixes it. ``--fix`` never
    helps with an unreadable file (fstier does not remove what it could not
    read), so it is only suggested for bad files that remain."""
    parts = []
    if report.bad_remaining:
        parts.append("BAD FILES REMAIN (rerun with --fix to remove them)")
    if report.partial:
        parts.append(
            f"PARTIAL: {report.unreadable_files + report.unreadable_dirs.count:,} path(s) could not be read "
            "(fix their permissions or run as their owner, then rerun)"
        )
    return "; ".join(parts) or "ok"
