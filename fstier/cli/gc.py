"""``fstier gc``: LRU eviction down to a size and a stale temp-file sweep.

A thin wrapper over :func:`fstier.tier.gc.collect_garbage`, the very code
FsTier's background capacity manager runs, applied to a whole root (every
namespace in it) with both watermarks at 1.0: the operator asked for
``--max-bytes`` and gets at most that, no hysteresis.

A path that cannot be read or removed does not stop the run: each one is
listed (text and ``--json``), the sizes say they are partial, exit 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from fstier.cli.exits import ReportFailed, UsageFailure
from fstier.cli.options import json_option, parse_size_option
from fstier.cli.output import MAX_LISTED, display, emit_report, fmt_size
from fstier.cli.progress import progress_bar, show_progress
from fstier.cli.roots import checked_root_argument, deadline_option, fstier_root
from fstier.config import MAX_TEMP_AGE_SECONDS

__all__ = ["run_gc"]


def run_gc(
    root: Path, max_bytes: int, *, dry_run: bool, temp_max_age_s: float, progress: bool = False,
    remove_foreign: bool = False,
) -> dict[str, Any]:
    """Run one gc over ``root``; returns the JSON-ready result. With
    ``remove_foreign``, namespaces of another fstier format version (v1
    after the upgrade to v2) are removed first, whole."""
    from fstier.tier.gc import collect_garbage, remove_foreign_namespaces
    from fstier.tier.scan import Unreadable

    failed = Unreadable()
    foreign = (
        remove_foreign_namespaces(root, dry_run=dry_run, on_error=failed.add) if remove_foreign else []
    )
    with progress_bar("gc", progress) as bar:
        rep = collect_garbage(
            root,
            max_bytes,
            low_watermark=1.0,
            high_watermark=1.0,
            temp_max_age_s=temp_max_age_s,
            dry_run=dry_run,
            on_error=failed.add,
            on_file=bar.advance,
        )
    return {
        "root": str(root),
        "dry_run": dry_run,
        "max_bytes": max_bytes,
        "files_before": rep.scanned_files,
        "bytes_before": rep.scanned_bytes,
        "evicted_files": rep.removed_files,
        "evicted_bytes": rep.removed_bytes,
        "kept_recently_used": rep.kept_recently_used,
        "temp_removed": rep.temp_removed,
        "temp_removed_bytes": rep.temp_removed_bytes,
        "bytes_after": rep.final_bytes,
        "errors": rep.errors,
        "partial": rep.errors > 0,
        "failed": failed.to_json(),
        "passes": rep.passes,
        "seconds": round(rep.seconds, 3),
        "foreign_namespaces": [
            {"path": f.path, "format_version": f.version, "files": f.files, "bytes": f.bytes,
             "removed": f.removed}
            for f in foreign
        ],
    }


# -- the command -----------------------------------------------------------
@click.command("gc")
# A plain string: click.Path would stat ROOT on this thread, past any deadline on a hung mount.
@click.argument("root")
@click.option("--max-bytes", "max_bytes", required=True, help="Target size, e.g. 500GiB or 2TB.")
@click.option("--dry-run", is_flag=True, help="Report what would be removed; remove nothing.")
@click.option(
    "--temp-max-age",
    "temp_max_age",
    type=float,
    default=3600.0,
    show_default=True,
    help="Seconds after which an orphan temp file is swept.",
)
@click.option(
    "--remove-foreign",
    is_flag=True,
    help="Also remove whole namespaces of another fstier format version (e.g. v1 after an upgrade).",
)
@deadline_option
@json_option
def gc_cmd(
    root: str, max_bytes: str, dry_run: bool, temp_max_age: float, remove_foreign: bool, deadline: float,
    as_json: bool,
) -> None:
    """Evict least-recently-used blocks under ROOT down to --max-bytes and sweep
    stale temp files, with the same code as FsTier's capacity manager."""
    limit = parse_size_option(max_bytes, "--max-bytes")
    # Checked before ROOT: nan/inf used to pass "<= 0" and crash the pass with
    # OverflowError (test_gc_temp_max_age_must_be_finite_and_in_range). Same
    # bounds as tier.temp_max_age_s.
    if not 0 < temp_max_age <= MAX_TEMP_AGE_SECONDS:
        raise UsageFailure(
            f"--temp-max-age: must be a finite number of seconds in (0, {MAX_TEMP_AGE_SECONDS:.0f}], "
            f"got {temp_max_age}",
        )
    root_path = checked_root_argument(lambda: fstier_root(root), root, deadline)
    result = run_gc(
        root_path, limit, dry_run=dry_run, temp_max_age_s=temp_max_age,
        progress=show_progress(as_json), remove_foreign=remove_foreign,
    )
    ok = result["errors"] == 0
    verdict = (
        None
        if ok
        else f"sizes are partial: {result['errors']:,} path(s) could not be read or removed (listed above); "
        "fix their permissions or run as their owner, then rerun"
    )
    if as_json:
        emit_report(result, verdict)
        if verdict is not None:
            raise ReportFailed(verdict)
        return
    verb = "would remove" if dry_run else "removed"
    for f in result["foreign_namespaces"]:
        click.echo(
            f"{verb} foreign namespace {display(f['path'])} (format v{f['format_version']}, "
            f"{f['files']:,} file(s), {fmt_size(f['bytes'])})"
        )
    click.echo(
        f"{display(root)}: {fmt_size(result['bytes_before'])} in {result['files_before']:,} block file(s); "
        f"target {fmt_size(limit)}"
    )
    click.echo(
        f"{verb} {result['evicted_files']:,} block file(s) ({fmt_size(result['evicted_bytes'])}) "
        f"and {result['temp_removed']} stale temp file(s); "
        f"{fmt_size(result['bytes_after'])} remain"
    )
    if verdict is not None:
        for item in result["failed"][:MAX_LISTED]:
            click.echo(f"unreadable: {display(item['path'])}: {item['error']}", err=True)
        if result["errors"] > MAX_LISTED:
            click.echo(f"... and {result['errors'] - MAX_LISTED:,} more (use --json for the list)", err=True)
        raise ReportFailed(verdict)
