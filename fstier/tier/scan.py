"""What is in an fstier root, namespace by namespace: the report ``fstier
inspect`` prints (:func:`inspect_root`, a :class:`ScanReport`), and the walk
:mod:`fstier.tier.verify` shares.

A root holds one directory per namespace (``<model>-<digest16>``) with a
``config.json`` manifest and, below it, block files at format v2's one
fan-out level (``[r<rank>/]<hex[:3]>/<hex>-g<group>.bin``,
:func:`fstier.file_mapper.encode`). Roots on shared storage can hold
millions of files, so nothing here lists a whole directory into memory: the
walk (:func:`fstier.io.tree.iter_namespace_files`) goes through directory
fds and yields one file at a time; it holds only the names of the pending
subdirectories of the directories it is in (at most the 4096 fan-out
directories of a namespace or rank, plus the rank directories), and
per-namespace statistics are counters, never file lists.

What counts is decided in one place, :mod:`fstier.io.tree`, shared with
``fstier verify``, ``fstier gc`` and FsTier's capacity thread: block files
are counted only where fstier puts them and only in namespaces whose
manifest is valid; a namespace with a bad or missing manifest is listed with
its ``manifest_error`` and zero files. Symlinks are never followed (fstier
never touches anything outside its root, docs/reliability.md): a link is
reported as an "other" entry and left alone. A directory or file that cannot
be read (permissions, I/O errors) is recorded in :class:`Unreadable` and the
walk goes on with the rest, so a report over a partly unreadable root is
complete except for what it names (``report.partial``).

Costs: one ``stat`` per entry (from ``scandir``) and one manifest read per
namespace; nothing is opened but directories and manifests. No click, rich
or torch here: the CLI prints what this returns.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fstier.file_mapper import MANIFEST_NAME, is_namespace_name
from fstier.io import (
    FileKind,
    Manifest,
    TreeFile,
    check_namespace,
    iter_namespace_dirs,
    iter_namespace_files,
)
from fstier.tier.usage import ROOT_FILES

__all__ = [
    "NamespaceStats",
    "ScanReport",
    "Unreadable",
    "inspect_root",
    "is_namespace_dir",
    "checked_root",
    "iter_namespace_dirs",
    "scan_root",
]

def is_namespace_dir(path: Path) -> bool:
    """The one rule ``inspect``, ``verify`` and the ROOT check share: a
    directory (not a symlink) named like a namespace or holding a
    ``config.json``. Such a directory is listed as a namespace even when its
    manifest is bad (with the reason); any other directory (``lost+found``,
    a stray ``junk/``) is an "other top-level entry" and never a namespace."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    return is_namespace_name(path.name) or os.path.lexists(path / "config.json")


@dataclass(slots=True)
class NamespaceStats:
    """Counters for one namespace directory (bounded: no per-file state)."""

    namespace: str
    path: str
    model: str | None = None
    revision: str | None = None
    digest: str | None = None
    parallel_agnostic: bool | None = None
    tp_size: int | None = None
    pp_size: int | None = None
    format_id: str | None = None
    num_groups: int | None = None
    blocks_per_file: int | None = None
    #: ``vllm`` for FstierTier's namespaces (the manifest's ``engine``), else ``fstier``
    engine: str | None = None
    #: vLLM namespaces: bytes of one row (a file's payload) and GPU blocks per chunk
    row_bytes: int | None = None
    blocks_per_chunk: int | None = None
    manifest_error: str | None = None
    ranks: set[int] = field(default_factory=set)
    files: int = 0
    bytes: int = 0
    files_per_group: dict[int, int] = field(default_factory=dict)
    oldest: float | None = None
    newest: float | None = None
    temp_files: int = 0
    temp_bytes: int = 0
    nfs_files: int = 0
    other_files: int = 0

    def add(self, entry: TreeFile) -> None:
        if entry.kind == FileKind.BLOCK:
            self.files += 1
            self.bytes += entry.size
            g = entry.key.group_idx if entry.key is not None else 0
            self.files_per_group[g] = self.files_per_group.get(g, 0) + 1
            if entry.rank is not None:
                self.ranks.add(entry.rank)
            mtime = entry.mtime_ns / 1e9
            self.oldest = mtime if self.oldest is None else min(self.oldest, mtime)
            self.newest = mtime if self.newest is None else max(self.newest, mtime)
        elif entry.kind == FileKind.TEMP:
            self.temp_files += 1
            self.temp_bytes += entry.size
        elif entry.kind == FileKind.NFS:
            self.nfs_files += 1
        else:
            self.other_files += 1

    @property
    def parallel(self) -> str:
        """``agnostic`` or ``tp=<n> ranks=<list>`` for the table."""
        if self.parallel_agnostic:
            return "agnostic"
        if self.parallel_agnostic is None:
            return "unknown"
        ranks = ",".join(str(r) for r in sorted(self.ranks)) or "-"
        pp = f" pp={self.pp_size}" if self.pp_size and self.pp_size > 1 else ""
        return f"tp={self.tp_size}{pp} ranks={ranks}"

    def to_json(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "path": self.path,
            "model": self.model,
            "revision": self.revision,
            "digest": self.digest,
            "parallel_agnostic": self.parallel_agnostic,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "ranks": sorted(self.ranks),
            "format_id": self.format_id,
            "groups": self.num_groups,
            "blocks_per_file": self.blocks_per_file,
            "engine": self.engine,
            "row_bytes": self.row_bytes,
            "blocks_per_chunk": self.blocks_per_chunk,
            "files": self.files,
            "bytes": self.bytes,
            "files_per_group": {str(k): v for k, v in sorted(self.files_per_group.items())},
            "oldest": self.oldest,
            "newest": self.newest,
            "temp_files": self.temp_files,
            "temp_bytes": self.temp_bytes,
            "nfs_files": self.nfs_files,
            "other_files": self.other_files,
            "manifest_error": self.manifest_error,
        }


@dataclass(slots=True)
class Unreadable:
    """Paths a walk could not read, with why; totals that skipped them are partial.

    Every path is counted; the first :attr:`KEEP` are kept for the report (a
    permission mistake at the fan-out level can make thousands unreadable,
    and the first few say what to fix).
    """

    KEEP = 1000

    count: int = 0
    paths: list[tuple[str, str]] = field(default_factory=list)

    def add(self, exc: OSError, path: str | None = None) -> None:
        self.count += 1
        if len(self.paths) < self.KEEP:
            where = path if path is not None else str(exc.filename or "?")
            self.paths.append((where, exc.strerror or str(exc)))

    def __bool__(self) -> bool:
        return self.count > 0

    def to_json(self) -> list[dict[str, str]]:
        return [{"path": p, "error": e} for p, e in self.paths]


@dataclass(slots=True)
class ScanReport:
    """The whole root: one :class:`NamespaceStats` per namespace directory,
    plus entries at the top level that are not namespaces, and what could not
    be read (when anything, the totals are partial)."""

    root: str
    namespaces: list[NamespaceStats]
    stray_entries: int = 0
    unreadable: Unreadable = field(default_factory=Unreadable)

    @property
    def total_files(self) -> int:
        """Block files counted in every namespace."""
        return sum(ns.files for ns in self.namespaces)

    @property
    def total_bytes(self) -> int:
        """Bytes of the block files counted in every namespace."""
        return sum(ns.bytes for ns in self.namespaces)

    @property
    def partial(self) -> bool:
        """Something under the root could not be read: the totals miss it."""
        return bool(self.unreadable)

    def to_json(self) -> dict[str, Any]:
        """The report as ``fstier inspect --json`` prints it."""
        return {
            "root": self.root,
            "namespaces": [ns.to_json() for ns in self.namespaces],
            "stray_entries": self.stray_entries,
            "total_files": self.total_files,
            "total_bytes": self.total_bytes,
            "partial": self.partial,
            "unreadable_count": self.unreadable.count,
            "unreadable": self.unreadable.to_json(),
        }


def _stats_from_manifest(stats: NamespaceStats, manifest: Manifest) -> None:
    fields = manifest.typed_fields
    stats.model = fields.model
    stats.revision = fields.revision
    stats.digest = manifest.digest
    stats.parallel_agnostic = manifest.parallel_agnostic
    stats.tp_size = fields.tp_size
    stats.pp_size = fields.pp_size
    stats.format_id = fields.format_id
    stats.num_groups = len(fields.groups) if fields.groups is not None else None
    stats.blocks_per_file = fields.blocks_per_file
    raw = manifest.fields
    engine = raw.get("engine")
    stats.engine = engine if isinstance(engine, str) else "fstier"
    for name in ("row_bytes", "blocks_per_chunk"):
        value = raw.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(stats, name, value)


def scan_namespace(
    namespace_dir: Path,
    unreadable: Unreadable | None = None,
    on_file: Callable[[], None] | None = None,
) -> NamespaceStats:
    """Counters for one namespace; unreadable parts go to ``unreadable`` (raised
    when it is None); ``on_file()`` is called per file met (progress)."""
    stats = NamespaceStats(namespace=namespace_dir.name, path=str(namespace_dir))
    ns = check_namespace(namespace_dir)
    manifest, stats.manifest_error = ns.manifest, ns.error
    if manifest is None:
        return stats  # not fstier's: nothing in it is counted, checked or removed
    _stats_from_manifest(stats, manifest)
    on_error = unreadable.add if unreadable is not None else None
    for entry in iter_namespace_files(namespace_dir, on_error):
        stats.add(entry)
        if on_file is not None:
            on_file()
    return stats


def checked_root(root: str | os.PathLike[str]) -> Path:
    """``root`` as a :class:`~pathlib.Path`, refused with one ``ValueError``
    when it is a namespace directory (named like one and holding the
    manifest): a root one level too deep would report no namespaces at all,
    which reads as a healthy empty tier. Only one name is looked up."""
    path = Path(root)
    if os.path.lexists(path / MANIFEST_NAME) and is_namespace_name(os.path.basename(os.path.realpath(path))):
        raise ValueError(
            f"{os.fspath(root)!r} is a namespace directory (it holds {MANIFEST_NAME}), one level too deep: "
            f"the root is its parent {os.fspath(path.parent)!r}"
        )
    return path


def inspect_root(root: str | os.PathLike[str], *, on_file: Callable[[], None] | None = None) -> ScanReport:
    """What ``fstier inspect`` reports: statistics of every namespace under
    ``root``, sorted by name; a part that cannot be read is named in
    ``report.unreadable`` and skipped (``report.partial``). ``on_file()`` is
    called per file met (progress). Raises ``ValueError`` for a namespace
    directory given as the root (:func:`checked_root`) and ``OSError`` when
    ``root`` itself cannot be listed."""
    return scan_root(checked_root(root), on_file)


def scan_root(root: Path, on_file: Callable[[], None] | None = None) -> ScanReport:
    """Statistics of every namespace under ``root``, sorted by name; a part
    that cannot be read is named in ``report.unreadable`` and skipped
    (:func:`inspect_root`, the public call, takes any path)."""
    namespaces: list[NamespaceStats] = []
    unreadable = Unreadable()
    stray = 0
    for path, is_dir in iter_namespace_dirs(root):
        if path.name in ROOT_FILES:  # the shared usage count is fstier's own
            continue
        if is_dir and is_namespace_dir(path):
            namespaces.append(scan_namespace(path, unreadable, on_file))
        else:
            stray += 1
    namespaces.sort(key=lambda s: s.namespace)
    return ScanReport(root=str(root), namespaces=namespaces, stray_entries=stray, unreadable=unreadable)
