"""``fstier status ROOT``: a live view of a root, from what the tiers running
on it publish (:func:`fstier.tier.status.read_status`): usage as the shared
count holds it and as a walk finds it, against ``--max-bytes``; every
instance (and host) publishing a count there and how fresh it is; the
eviction lease's holder; each namespace's bytes and last use.

Reads only; every read runs under ``--deadline`` (a hung mount makes a
report that says so, exit 1). ``--watch SECONDS`` prints a new report every
SECONDS until Ctrl-C (or ``--count`` reports); with ``--json`` each report
is one line (JSON lines). Exit 1 when the report shows a problem (listed
under the tables), 2 for a bad ROOT or option.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

import click

from fstier.cli.exits import ReportFailed, UsageFailure
from fstier.cli.options import json_option, parse_size_option
from fstier.cli.output import display, emit_report, fmt_size, fmt_time
from fstier.cli.roots import fstier_root, within_deadline
from fstier.cli.tables import Column, print_table

if TYPE_CHECKING:
    from fstier.tier.status import RootStatus

__all__ = ["status_cmd", "status_lines"]

INSTANCE_COLUMNS = (
    Column("host", 0),
    Column("pid", 0, "right"),
    Column("stored", 1, "right"),
    Column("removed", 2, "right"),
    Column("in flight", 3, "right"),
    Column("updated", 0, "right"),
    Column("state", 0),
)
NAMESPACE_COLUMNS = (
    Column("namespace", 0, name=True),
    Column("files", 1, "right"),
    Column("bytes", 0, "right"),
    Column("last use", 0),
)


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.0f} h ago"


def _of_max(nbytes: int | None, max_bytes: int | None) -> str:
    if nbytes is None:
        return "unknown"
    text = fmt_size(nbytes)
    if max_bytes:
        text += f" ({100 * nbytes / max_bytes:.0f}% of {fmt_size(max_bytes)})"
    return text


def status_lines(st: RootStatus) -> list[str]:
    """The summary lines above the tables (each within 80 columns but for
    names that are longer)."""
    lines = [f"fstier root {display(st.root)}", f"read at {fmt_time(st.read_at)}, deadline {st.deadline_s:g} s"]
    lines.append(f"usage, shared count: {_of_max(st.counts_bytes, st.max_bytes)}")
    if st.counts_note:
        lines.append(f"  ({display(st.counts_note)})")
    if st.scan_bytes is not None:
        walked = f"{_of_max(st.scan_bytes, st.max_bytes)}, {st.scan_files:,} file(s)"
        lines.append(f"usage, walk of ROOT: {walked} in {st.scan_seconds or 0:.2f} s")
    agree = {True: "agree", False: "DISAGREE", None: "not comparable"}[st.agree]
    if st.raced:
        agree += " (counts moved during the walk)"
    lines.append(f"count vs disk: {agree}")
    if st.max_bytes is None:
        lines.append("max_bytes: not given (--max-bytes SIZE: the tiers' limit)")
    if st.lease is None:
        lines.append("eviction lease: free")
    else:
        holder = display(st.lease.holder or "an unreadable lease")
        lines.append(f"eviction lease: {holder}, renewed {_ago(st.lease.age_s)}")
    hosts = st.hosts
    lines.append(f"instances: {len(st.instances)} on {len(hosts)} host(s)")
    return lines


def _print(st: RootStatus) -> None:
    for line in status_lines(st):
        click.echo(line)
    if st.instances:
        rows = [
            [display(i.host or i.instance), "-" if i.pid is None else str(i.pid), fmt_size(i.stored_bytes),
             fmt_size(i.removed_bytes), fmt_size(i.inflight_bytes), _ago(i.age_s), i.state]
            for i in sorted(st.instances, key=lambda i: (i.host or "", i.pid or 0))
        ]
        print_table(INSTANCE_COLUMNS, rows)
    if st.namespaces:
        rows = [
            [display(n.namespace), f"{n.files:,}", fmt_size(n.bytes), fmt_time(n.last_use)]
            for n in sorted(st.namespaces, key=lambda n: -(n.last_use or 0))
        ]
        print_table(NAMESPACE_COLUMNS, rows)
    for problem in st.problems:
        click.echo(f"problem: {display(problem)}")


def _verdict(st: RootStatus) -> str | None:
    if not st.problems:
        return None
    return f"{len(st.problems)} problem(s) on this root: {st.problems[0]}"


@click.command("status")
# A plain string: click.Path would stat ROOT on this thread, past any deadline on a hung mount.
@click.argument("root")
@click.option("--max-bytes", "max_bytes_text", default=None, metavar="SIZE",
              help="The tiers' max_bytes (500GiB), to show usage against it; the root does not record it.")
@click.option("--deadline", type=float, default=10.0, show_default=True, metavar="SECONDS",
              help="Give up on reads (a hung mount) after this long.")
@click.option("--no-scan", is_flag=True, help="Read only what the tiers publish; do not walk ROOT.")
@click.option("--watch", type=float, default=None, metavar="SECONDS", help="Print a new report every SECONDS.")
@click.option("--count", type=int, default=None, help="With --watch: stop after this many reports.")
@json_option
def status_cmd(
    root: str, max_bytes_text: str | None, deadline: float, no_scan: bool, watch: float | None,
    count: int | None, as_json: bool,
) -> None:
    """A live view of ROOT: usage against max_bytes, the instances and hosts sharing it, the lease, namespaces.

    Usage is shown as the tiers' shared count holds it (a settled scan no
    count moved since) and as a walk of ROOT finds it. Reads only; every
    read gives up after --deadline. Exit 1 when a problem is shown (the
    count and the disk disagree, usage over --max-bytes, an instance that
    stopped publishing, an expired lease, a walk that did not finish).
    """
    from fstier.tier.status import read_status

    if deadline <= 0:
        raise UsageFailure(f"--deadline: must be > 0 seconds, got {deadline:g}")
    if watch is not None and watch <= 0:
        raise UsageFailure(f"--watch: must be > 0 seconds, got {watch:g}")
    if count is not None and (count < 1 or watch is None):
        raise UsageFailure("--count: must be >= 1, and only with --watch")
    max_bytes = None if max_bytes_text is None else parse_size_option(max_bytes_text, "--max-bytes")
    root_path = within_deadline(lambda: fstier_root(root), root, deadline)
    shown = 0
    while True:
        st = read_status(root_path, deadline_s=deadline, scan=not no_scan, max_bytes=max_bytes)
        verdict = _verdict(st)
        shown += 1
        if watch is None:
            break
        if as_json:
            import json

            from fstier.cli.output import json_safe

            click.echo(json.dumps(json_safe({"ok": verdict is None, **st.to_json()})))
        else:
            if sys.stdout.isatty():
                click.clear()
            _print(st)
            click.echo("")
        if count is not None and shown >= count:
            return
        time.sleep(watch)
    if as_json:
        emit_report(st.to_json(), verdict)
    else:
        _print(st)
    if verdict is not None:
        raise ReportFailed(verdict, shown=False)
