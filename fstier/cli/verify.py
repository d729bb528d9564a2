"""``fstier verify``: check every block file under a root, optionally removing bad ones.

Each block file is checked the way a load would check it, without a caller
buffer (:func:`fstier.io.blockstore.verify_file`): header magic/version/checksum,
file size against the header's payload length, the key embedded in the
header against the key its file name claims (a valid file copied under
another key's name is bad), the namespace digest against the directory's
manifest, the page size against the manifest's groups, and, unless
``headers_only``, the xxh3 payload checksum streamed in 1 MiB chunks.

``fix`` removes a bad file only if it is still the file that was checked
(same inode and mtime): a writer may have replaced it with a good one since.
A file that vanished meanwhile (gc, another host) is skipped, not bad; an
I/O error is reported as ``unreadable`` and never removes anything (a
transient error is not proof of corruption, so the file is left alone). A
directory that cannot be listed is reported as unreadable too, and the walk
goes on with the rest; the report then says its counts are partial.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from fstier.cli.exits import ReportFailed, UsageFailure
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
from fstier.cli.roots import check_root_shape, existing_root
from fstier.cli.scan import (
    FileKind,
    Unreadable,
    is_namespace_dir,
    iter_namespace_dirs,
    iter_namespace_files,
    read_manifest,
)
from fstier.file_mapper import decode
from fstier.io.fsops import unlink_if_same
from fstier.tier.usage import ROOT_FILES

__all__ = ["BadFile", "NamespaceVerify", "VerifyReport", "run_verify"]



@dataclass(frozen=True, slots=True)
class BadFile:
    """One file that failed a check."""

    path: str
    reason: str
    removed: bool


@dataclass(slots=True)
class NamespaceVerify:
    namespace: str
    checked: int = 0
    good: int = 0
    bad: int = 0
    removed: int = 0
    unreadable: int = 0
    bytes: int = 0
    temp_files: int = 0
    manifest_error: str | None = None


@dataclass(slots=True)
class VerifyReport:
    root: str
    full: bool
    fix: bool
    namespaces: list[NamespaceVerify] = field(default_factory=list)
    bad: list[BadFile] = field(default_factory=list)
    seconds: float = 0.0
    #: directories (and entries) that could not be listed: counts are partial
    unreadable_dirs: Unreadable = field(default_factory=Unreadable)

    @property
    def checked(self) -> int:
        return sum(ns.checked for ns in self.namespaces)

    @property
    def removed(self) -> int:
        return sum(ns.removed for ns in self.namespaces)

    @property
    def unreadable_files(self) -> int:
        return sum(ns.unreadable for ns in self.namespaces)

    @property
    def partial(self) -> bool:
        """Something could not be read, so not every block was checked."""
        return bool(self.unreadable_dirs) or self.unreadable_files > 0

    @property
    def bad_remaining(self) -> int:
        """Bad files (not unreadable ones) that are still on disk."""
        return sum(1 for b in self.bad if not b.removed and not b.reason.startswith("unreadable"))

    @property
    def ok(self) -> bool:
        """Nothing bad remains (everything bad was removed) and nothing was unreadable."""
        return self.bad_remaining == 0 and not self.partial

    def to_json(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "full": self.full,
            "fix": self.fix,
            "checked": self.checked,
            "bad": [{"path": b.path, "reason": b.reason, "removed": b.removed} for b in self.bad],
            "removed": self.removed,
            "partial": self.partial,
            "unreadable_count": self.unreadable_dirs.count,
            "unreadable": self.unreadable_dirs.to_json(),
            "seconds": round(self.seconds, 3),
            "namespaces": [
                {
                    "namespace": ns.namespace,
                    "checked": ns.checked,
                    "good": ns.good,
                    "bad": ns.bad,
                    "removed": ns.removed,
                    "unreadable": ns.unreadable,
                    "bytes": ns.bytes,
                    "temp_files": ns.temp_files,
                    "manifest_error": ns.manifest_error,
                }
                for ns in self.namespaces
            ],
        }


@dataclass(frozen=True, slots=True)
class _Expect:
    """What the manifest says a file of each group must look like."""

    digest: bytes | None
    file_page_bytes: dict[int, int]
    blocks_per_file: int | None


def _expectations(namespace_dir: Path) -> tuple[_Expect | None, str | None]:
    """What the manifest says, or ``(None, reason)`` when the namespace is not
    fstier's: then nothing in it is checked or removed."""
    manifest, error = read_manifest(namespace_dir)
    if manifest is None:
        return None, error
    fields = manifest.typed_fields
    return _Expect(bytes.fromhex(manifest.digest), fields.file_page_bytes(), fields.blocks_per_file), None


def _namespaces(root: Path, only: str | None) -> Iterator[Path]:
    if only is not None:
        yield root / only
        return
    # The same rule as inspect: only namespace directories (scan.is_namespace_dir).
    dirs = sorted(
        p for p, is_dir in iter_namespace_dirs(root)
        if is_dir and p.name not in ROOT_FILES and is_namespace_dir(p)
    )
    yield from dirs


def _check_one(path: str, full: bool, expect: _Expect) -> tuple[str, int, os.stat_result | None]:
    """``(reason or '', size, stat)``; reason ``gone`` when the file vanished."""
    from fstier.io.blockfile import Expected
    from fstier.io.blockstore import verify_file
    from fstier.io.fsops import FS

    try:
        before = FS.lstat(path)  # no symlink followed anywhere on the path
    except FileNotFoundError:
        return "gone", 0, None
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}", 0, None
    key = decode(os.path.basename(path))
    if key is None:
        return "bad_name", before.st_size, before
    expected = Expected(
        key=key,
        namespace_digest=expect.digest,
        group_page_bytes=expect.file_page_bytes,
        max_pages=expect.blocks_per_file,
    )
    try:
        check = verify_file(path, full, expect=expected)
    except FileNotFoundError:
        return "gone", 0, None
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}", before.st_size, None
    return check.reason, check.size, before


def _remove_if_same(path: str, before: os.stat_result) -> bool:
    """Unlink ``path`` if it is still the file that was judged (same inode
    and mtime), through a directory fd resolved without symlinks."""
    result = unlink_if_same(path, ino=before.st_ino, dev=before.st_dev, mtime_ns=before.st_mtime_ns)
    return result in ("removed", "gone")  # gone: nothing bad remains


def _count_blocks(root: Path, only: str | None) -> int:
    n = 0
    for ns_dir in _namespaces(root, only):
        if read_manifest(ns_dir)[0] is None:
            continue
        # Errors are ignored here: the checking walk meets and reports them.
        for entry in iter_namespace_files(ns_dir, on_error=lambda _exc: None):
            n += entry.kind == FileKind.BLOCK
    return n


def run_verify(
    root: Path, *, namespace: str | None = None, fix: bool = False, full: bool = True, progress: bool = False
) -> VerifyReport:
    """Check every block file under ``root`` (or one namespace)."""
    t0 = time.perf_counter()
    report = VerifyReport(root=str(root), full=full, fix=fix)
    total = _count_blocks(root, namespace) if progress else None
    with progress_bar("verify", progress, total) as bar:
        for ns_dir in _namespaces(root, namespace):
            expect, error = _expectations(ns_dir)
            ns = NamespaceVerify(namespace=ns_dir.name, manifest_error=error)
            report.namespaces.append(ns)
            if expect is None:
                continue
            for entry in iter_namespace_files(ns_dir, report.unreadable_dirs.add):
                if entry.kind == FileKind.TEMP:
                    ns.temp_files += 1
                if entry.kind != FileKind.BLOCK:
                    continue
                reason, size, before = _check_one(entry.path, full, expect)
                bar.advance()
                if reason == "gone":
                    continue
                ns.checked += 1
                ns.bytes += size
                if not reason:
                    ns.good += 1
                    continue
                if reason.startswith("unreadable"):
                    ns.unreadable += 1
                    report.bad.append(BadFile(entry.path, reason, False))
                    continue
                ns.bad += 1
                removed = bool(fix and before is not None and _remove_if_same(entry.path, before))
                ns.removed += removed
                report.bad.append(BadFile(entry.path, reason, removed))
    report.seconds = time.perf_counter() - t0
    return report


# -- the command -----------------------------------------------------------
@click.command("verify")
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--namespace", "namespace", default=None, help="Only this namespace directory name.")
@click.option("--wide", is_flag=True, help="Show every column, however wide (default: what fits the terminal).")
@click.option("--fix", is_flag=True, help="Remove every bad block file (and stale temp files).")
@click.option(
    "--headers-only",
    is_flag=True,
    help="Check headers, keys and lengths but skip reading payloads (fast).",
)
@json_option
def verify_cmd(root: str, namespace: str | None, wide: bool, fix: bool, headers_only: bool, as_json: bool) -> None:
    """Read and check every block under ROOT (header, key, length, checksum).

    Exit 1 when a bad file was found and not removed.
    """
    from fstier.cli.verify import run_verify

    root_path = existing_root(root)
    if namespace is not None:
        # One directory name, never a path: --fix must not reach outside ROOT.
        ns_path = root_path / namespace
        if namespace in ("", ".", "..") or "/" in namespace or "\0" in namespace:
            raise UsageFailure(f"--namespace {namespace!r}: must be one directory name under ROOT (see fstier inspect)")
        if ns_path.is_symlink() or not ns_path.is_dir():
            raise UsageFailure(f"--namespace {namespace!r}: no such namespace directory under {root}")
    else:
        check_root_shape(root_path, root)
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
                console.print(f"unreadable: {display(bad.path)}: {bad.reason.removeprefix('unreadable: ')} (kept)", markup=False)
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
