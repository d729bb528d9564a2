"""Streaming walks of an fstier root for ``fstier inspect`` and ``fstier verify``.

A root holds one directory per namespace (``<model>-<digest16>``) with a
``config.json`` manifest and, below it, block files two hex levels deep
(``[r<rank>/]abc/de/<hash>-g<group>.bin``). Roots on shared storage can hold
millions of files, so nothing here lists a whole directory into memory: the
walk is an explicit stack of directory *paths* fed by ``os.scandir``
iterators, yielding one file at a time. The stack holds at most the pending
siblings along one path (a few thousand names at the fan-out fstier uses),
and per-namespace statistics are counters, never file lists.

Symlinks are never followed (fstier never touches anything outside its
root, docs/reliability.md): a link is reported as an "other" entry and left
alone. A directory or file that cannot be read (permissions, I/O errors) is
recorded in :class:`Unreadable` and the walk goes on with the rest, so a
report over a partly unreadable root is complete except for what it names.
This module does not import torch.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fstier._atomic import is_temp_name
from fstier._usage import ROOT_FILES
from fstier.file_mapper import BLOCK_NAME_RE, BLOCK_SUFFIX, MANIFEST_NAME

__all__ = [
    "FileEntry",
    "NamespaceStats",
    "ScanReport",
    "Unreadable",
    "iter_namespace_dirs",
    "iter_namespace_files",
    "read_manifest",
    "scan_root",
]

_BLOCK_NAME = BLOCK_NAME_RE
_RANK_DIR = re.compile(r"^r([0-9]+)$")


class FileKind:
    """What a file under a namespace is, judged by its name alone."""

    BLOCK = "block"
    TEMP = "temp"
    NFS = "nfs"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file met by the walk: where it is and what its name says."""

    path: str
    kind: str
    size: int
    mtime: float
    rank: int | None
    block_hex: str | None
    group_idx: int | None


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

    def add(self, entry: FileEntry) -> None:
        if entry.kind == FileKind.BLOCK:
            self.files += 1
            self.bytes += entry.size
            g = entry.group_idx if entry.group_idx is not None else 0
            self.files_per_group[g] = self.files_per_group.get(g, 0) + 1
            if entry.rank is not None:
                self.ranks.add(entry.rank)
            self.oldest = entry.mtime if self.oldest is None else min(self.oldest, entry.mtime)
            self.newest = entry.mtime if self.newest is None else max(self.newest, entry.mtime)
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


def read_manifest(namespace_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The parsed ``config.json`` of a namespace, or ``(None, reason)``."""
    path = namespace_dir / MANIFEST_NAME
    try:
        # O_NOFOLLOW: a manifest that is a symlink is not ours to read.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, "no config.json"
    except OSError as exc:
        return None, f"config.json unreadable: {exc.strerror or exc}"
    try:
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(1 << 20)
        data = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError) as exc:
        return None, f"config.json is not valid JSON: {exc}"
    if not isinstance(data, dict) or not isinstance(data.get("fields"), dict):
        return None, "config.json has no 'fields' mapping"
    return data, None


def _stats_from_manifest(stats: NamespaceStats, manifest: dict[str, Any]) -> None:
    fields = manifest["fields"]
    stats.model = fields.get("model")
    stats.revision = fields.get("revision")
    stats.digest = manifest.get("digest")
    stats.parallel_agnostic = bool(manifest.get("parallel_agnostic"))
    stats.tp_size = fields.get("tp_size")
    stats.pp_size = fields.get("pp_size")
    stats.format_id = fields.get("format_id")
    groups = fields.get("groups")
    stats.num_groups = len(groups) if isinstance(groups, list) else None
    stats.blocks_per_file = fields.get("blocks_per_file")


def _classify(name: str) -> tuple[str, str | None, int | None]:
    if is_temp_name(name):
        return FileKind.TEMP, None, None
    if name.startswith(".nfs"):
        return FileKind.NFS, None, None
    if name.endswith(BLOCK_SUFFIX):
        m = _BLOCK_NAME.match(name)
        if m:
            return FileKind.BLOCK, m.group(1), int(m.group(2))
    return FileKind.OTHER, None, None


def iter_namespace_files(
    namespace_dir: Path, on_error: Callable[[OSError], None] | None = None
) -> Iterator[FileEntry]:
    """Every file below ``namespace_dir`` except the manifest, one at a time.

    Directories vanishing mid-walk (gc or another host) are skipped; symlinks
    and other non-regular entries are yielded as ``other`` without following.
    A directory or entry that cannot be read is passed to ``on_error`` (its
    ``filename`` names it) and skipped; without ``on_error`` the error is
    raised.
    """
    top = str(namespace_dir)
    stack: list[tuple[str, int | None, int]] = [(top, None, 0)]
    while stack:
        directory, rank, depth = stack.pop()
        try:
            it = os.scandir(directory)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            if on_error is None:
                raise
            on_error(exc)
            continue
        with it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    if on_error is None:
                        raise
                    exc.filename = exc.filename or entry.path
                    on_error(exc)
                    continue
                if stat.S_ISDIR(st.st_mode):
                    sub_rank = rank
                    if depth == 0:
                        m = _RANK_DIR.match(entry.name)
                        if m:
                            sub_rank = int(m.group(1))
                    stack.append((entry.path, sub_rank, depth + 1))
                    continue
                if depth == 0 and entry.name == MANIFEST_NAME:
                    continue
                if stat.S_ISREG(st.st_mode):
                    kind, block_hex, group = _classify(entry.name)
                else:
                    kind, block_hex, group = FileKind.OTHER, None, None
                yield FileEntry(entry.path, kind, st.st_size, st.st_mtime, rank, block_hex, group)


def iter_namespace_dirs(root: Path) -> Iterator[tuple[Path, bool]]:
    """``(path, is_namespace)`` for every top-level entry of ``root``: a
    directory (not a symlink) is a namespace; anything else is a stray."""
    with os.scandir(root) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False):
                yield Path(entry.path), True
            else:
                yield Path(entry.path), False


def scan_namespace(
    namespace_dir: Path,
    unreadable: Unreadable | None = None,
    on_file: Callable[[], None] | None = None,
) -> NamespaceStats:
    """Counters for one namespace; unreadable parts go to ``unreadable`` (raised
    when it is None); ``on_file()`` is called per file met (progress)."""
    stats = NamespaceStats(namespace=namespace_dir.name, path=str(namespace_dir))
    manifest, error = read_manifest(namespace_dir)
    if manifest is not None:
        _stats_from_manifest(stats, manifest)
    stats.manifest_error = error
    on_error = unreadable.add if unreadable is not None else None
    for entry in iter_namespace_files(namespace_dir, on_error):
        stats.add(entry)
        if on_file is not None:
            on_file()
    return stats


def scan_root(root: Path, on_file: Callable[[], None] | None = None) -> ScanReport:
    """Statistics of every namespace under ``root``, sorted by name; a part
    that cannot be read is named in ``report.unreadable`` and skipped."""
    namespaces: list[NamespaceStats] = []
    unreadable = Unreadable()
    stray = 0
    for path, is_ns in iter_namespace_dirs(root):
        if is_ns:
            namespaces.append(scan_namespace(path, unreadable, on_file))
        elif path.name not in ROOT_FILES:  # the shared usage count is fstier's own
            stray += 1
    namespaces.sort(key=lambda s: s.namespace)
    return ScanReport(root=str(root), namespaces=namespaces, stray_entries=stray, unreadable=unreadable)
