"""``verify_root``: check every block file under a root, optionally removing bad ones.

The library call behind ``fstier verify`` (which parses options, prints the
:class:`VerifyReport` and maps it onto an exit code). Each block file is
checked the way a load would check it, without a caller buffer
(:func:`fstier.io.blockcheck.verify_file`, the one validator): header
magic/version/checksum, file size against the header's payload length, the
key embedded in the header against the key its file name claims (a valid
file copied under another key's name is bad), the namespace digest against
the directory's manifest, the page size against the manifest's groups, and,
unless ``headers_only``, the xxh3 payload checksum streamed in 1 MiB chunks.

What is checked is what :mod:`fstier.io.tree` says is fstier's: block files
where fstier puts them, only in namespace directories whose manifest is valid
(the same namespaces ``inspect`` lists, :mod:`fstier.tier.scan`). A
directory fstier did not write is never judged, and ``fix`` never removes
anything from it; symlinks are never followed.

``fix`` removes a bad file only if it is still the file that was checked
(same inode and mtime, :func:`fstier.io.fsops.unlink_if_same`): a writer may
have replaced it with a good one since. A file that vanished meanwhile (gc,
another host) is skipped, not bad; an I/O error is reported as
``unreadable`` and never removes anything (a transient error is not proof of
corruption, so the file is left alone). A directory that cannot be listed is
reported as unreadable too, and the walk goes on with the rest; the report
then says its counts are partial.

Costs: one streaming walk (memory flat in the number of files; the report
keeps counters per namespace and one record per *bad* file), one header read
per file and, unless ``headers_only``, one sequential read of each payload.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fstier.file_mapper import decode
from fstier.io import FileKind, check_namespace, iter_namespace_dirs, iter_namespace_files, unlink_if_same
from fstier.tier.scan import Unreadable, checked_root, is_namespace_dir
from fstier.tier.usage import ROOT_FILES

__all__ = ["BadFile", "NamespaceVerify", "VerifyReport", "count_blocks", "namespace_dir", "verify_root"]


def namespace_dir(root: str | os.PathLike[str], namespace: str) -> Path:
    """``root / namespace``, where ``namespace`` must be one directory name
    (never a path: ``fix`` must not reach outside the root) naming a real
    directory (not a symlink) under ``root``; else one ``ValueError`` that
    says which."""
    if namespace in ("", ".", "..") or "/" in namespace or "\0" in namespace:
        raise ValueError(f"namespace {namespace!r}: must be one directory name under ROOT (see fstier inspect)")
    path = Path(root) / namespace
    if path.is_symlink() or not path.is_dir():
        raise ValueError(f"namespace {namespace!r}: no such namespace directory under {os.fspath(root)}")
    return path


@dataclass(frozen=True, slots=True)
class BadFile:
    """One file that failed a check."""

    path: str
    reason: str
    removed: bool


@dataclass(slots=True)
class NamespaceVerify:
    """One namespace's tally: block files checked (and their bytes), good, bad, removed (``fix``), unreadable;
    temp files seen; why its manifest was refused (None: valid; a refused namespace's files are not checked)."""

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
    """What :func:`verify_root` found under ``root``: per namespace, every bad file, the time it took, and the
    directories it could not list (then the counts are partial)."""

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
    ns = check_namespace(namespace_dir)
    manifest = ns.manifest
    if manifest is None:
        return None, ns.error
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
    from fstier.io import FS, Expected, verify_file

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


def count_blocks(root: str | os.PathLike[str], namespace: str | None = None) -> int:
    """How many block files :func:`verify_root` will check (a walk of names
    only, for a progress bar's total)."""
    n = 0
    for ns_dir in _namespaces(Path(root), namespace):
        if check_namespace(ns_dir).manifest is None:
            continue
        # Errors are ignored here: the checking walk meets and reports them.
        for entry in iter_namespace_files(ns_dir, on_error=lambda _exc: None):
            n += entry.kind == FileKind.BLOCK
    return n


def verify_root(
    root: str | os.PathLike[str],
    *,
    fix: bool = False,
    headers_only: bool = False,
    namespace: str | None = None,
    on_file: Callable[[], None] | None = None,
) -> VerifyReport:
    """Check every block file under ``root`` (or one namespace).

    ``headers_only`` skips reading payloads (header, key, length, manifest
    checks only). ``fix`` removes a bad file only if it is still the file
    that was checked. ``namespace`` is one directory name under ``root``
    (:func:`namespace_dir`); ``on_file()`` is called once per block file
    checked (progress; :func:`count_blocks` says how many to expect).

    Raises ``ValueError`` for a bad ``namespace`` or a namespace directory
    given as ``root`` (:func:`fstier.tier.scan.checked_root`), ``OSError`` when
    ``root`` itself cannot be listed; never for a bad or unreadable file
    (those are in the report).
    """
    root = checked_root(root)
    if namespace is not None:
        namespace_dir(root, namespace)
    full = not headers_only
    t0 = time.perf_counter()
    report = VerifyReport(root=str(root), full=full, fix=fix)
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
            if on_file is not None:
                on_file()
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
