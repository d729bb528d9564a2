"""What in a root belongs to fstier: the one definition inspect, verify, gc
and the capacity thread share.

A root holds namespace directories ``<safe_model_name>-<digest16>``. A
namespace is **valid** when its manifest is (:mod:`fstier.io.manifest`).

Only inside a valid namespace does fstier count or remove anything
(:func:`iter_root`), and only these (:func:`classify`):

- **block**: a regular file named ``<hex>-g<group>.bin`` exactly where
  ``FileMapper.path_for`` puts it: ``[r<rank>/]<hex[:3]>/``;
- **temp**: fstier's own temp names (:func:`fstier.io.fsops.is_temp_name`);
- **nfs**: NFS silly-renamed ``.nfs*`` files (deleted while open).

Everything else (other names, misplaced block names, files at the root's top
level, symlinks, FIFOs, whole directories without a valid manifest) is
**other**: listed by inspect, never checked by verify, never removed by gc.

The walk holds directory fds (``openat`` with ``O_NOFOLLOW|O_DIRECTORY``,
``os.scandir(fd)``), never descends a symlink, and streams: memory is the
pending entries of at most four directory levels.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fstier.errors import NamespaceMismatchError
from fstier.file_mapper import MANIFEST_NAME, NAMESPACE_VERSION, decode, is_namespace_name
from fstier.io.fsops import is_temp_name, open_nofollow
from fstier.io.manifest import Manifest, read_manifest
from fstier.keys import BlockKey

__all__ = [
    "FileKind",
    "NamespaceDir",
    "TreeFile",
    "check_namespace",
    "classify",
    "iter_namespace_dirs",
    "iter_namespace_files",
    "iter_root",
]

_RANK_DIR = re.compile(r"^r([0-9]{1,6})$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class FileKind:
    """What a file under a namespace is (see the module docstring)."""

    BLOCK = "block"
    TEMP = "temp"
    NFS = "nfs"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class TreeFile:
    """One entry met by the walk."""

    path: str
    name: str
    kind: str
    size: int
    mtime_ns: int
    ino: int
    rank: int | None
    #: the key a block file names (:func:`fstier.file_mapper.decode`, the
    #: one name -> key rule); None for any other kind
    key: BlockKey | None


def classify(rel_dirs: tuple[str, ...], name: str, is_regular: bool) -> tuple[str, BlockKey | None]:
    """``(kind, key)`` of a file ``name`` in the namespace subdirectory
    ``rel_dirs``: the one rule every reader of a root applies."""
    if not is_regular:
        return FileKind.OTHER, None
    if is_temp_name(name):
        return FileKind.TEMP, None
    if name.startswith(".nfs"):
        return FileKind.NFS, None
    dirs = rel_dirs[1:] if rel_dirs and _RANK_DIR.match(rel_dirs[0]) else rel_dirs
    # Exactly where FileMapper puts a block (the one codec decides).
    key = decode("/".join((*dirs, name))) if dirs else None
    if key is None:
        return FileKind.OTHER, None
    return FileKind.BLOCK, key


def iter_namespace_files(
    namespace_dir: Path, on_error: Callable[[OSError], None] | None = None
) -> Iterator[TreeFile]:
    """Every file below ``namespace_dir`` but the manifest, classified, one
    at a time. Directories are opened through fds without following links;
    one that vanishes mid-walk is skipped; other errors go to ``on_error``."""
    try:
        top = open_nofollow(namespace_dir, _DIR_FLAGS)
    except FileNotFoundError:
        return
    except OSError as exc:
        _report(on_error, exc, str(namespace_dir))
        return
    yield from _walk_fd(top, str(namespace_dir), (), on_error)


def _report(on_error: Callable[[OSError], None] | None, exc: OSError, path: str) -> None:
    """Hand ``exc`` to ``on_error`` with ``filename`` naming ``path`` (an error
    from an fd-based call names nothing by itself); raise it without one."""
    exc.filename = exc.filename or path
    if on_error is None:
        raise exc
    on_error(exc)


def _walk_fd(
    fd: int, path: str, rel: tuple[str, ...], on_error: Callable[[OSError], None] | None
) -> Iterator[TreeFile]:
    """Walk the directory ``fd`` (closed here). Blocks are at most two
    levels down (``r<rank>/<hex[:3]>``, format v2); the walk stops three
    levels down: deeper directories are not fstier's."""
    try:
        rank = None
        if rel:
            m = _RANK_DIR.match(rel[0])
            rank = int(m.group(1)) if m else None
        subdirs: list[str] = []
        try:
            it = os.scandir(fd)
        except OSError as exc:
            _report(on_error, exc, path)
            return
        with it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    _report(on_error, exc, f"{path}/{entry.name}")
                    continue
                if stat.S_ISDIR(st.st_mode):
                    if len(rel) < 3:
                        subdirs.append(entry.name)
                    continue
                name = entry.name
                if not rel and name == MANIFEST_NAME:
                    continue
                kind, key = classify(rel, name, stat.S_ISREG(st.st_mode))
                yield TreeFile(
                    f"{path}/{name}", name, kind, st.st_size, st.st_mtime_ns, st.st_ino, rank, key
                )
        for name in subdirs:
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except (FileNotFoundError, NotADirectoryError, OSError) as exc:
                # ENOENT: removed meanwhile; ELOOP/ENOTDIR: swapped for a link.
                if not isinstance(exc, FileNotFoundError):
                    _report(on_error, exc, f"{path}/{name}")
                continue
            yield from _walk_fd(sub, f"{path}/{name}", (*rel, name), on_error)
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class NamespaceDir:
    """A top-level directory of a root and its manifest verdict."""

    path: Path
    manifest: Manifest | None
    error: str | None
    #: the layout version of a namespace another fstier version wrote (its
    #: manifest verifies, its version is not this one's): foreign, never
    #: counted or evicted, removed only by ``fstier gc --remove-foreign``
    foreign_version: int | None = None

    @property
    def valid(self) -> bool:
        return self.manifest is not None


def iter_namespace_dirs(root: Path) -> Iterator[tuple[Path, bool]]:
    """``(path, is_directory)`` for every top-level entry of ``root``
    (symlinks are not directories here)."""
    with os.scandir(root) as it:
        for entry in it:
            yield Path(entry.path), entry.is_dir(follow_symlinks=False)


def check_namespace(path: Path) -> NamespaceDir:
    """Read and check ``path``'s manifest; never raises for a bad one."""
    try:
        manifest = read_manifest(path)
    except NamespaceMismatchError as exc:
        return NamespaceDir(path, None, str(exc))
    except OSError as exc:
        return NamespaceDir(path, None, f"{path / MANIFEST_NAME}: unreadable ({exc.strerror or exc})")
    if manifest is None:
        return NamespaceDir(path, None, f"{path / MANIFEST_NAME}: missing; not an fstier namespace")
    if manifest.fstier_manifest != NAMESPACE_VERSION:
        v = manifest.fstier_manifest
        return NamespaceDir(
            path, None,
            f"foreign: a format v{v} namespace (this fstier reads and writes v{NAMESPACE_VERSION}); "
            "its blocks are never loaded, counted or evicted; `fstier gc ROOT --remove-foreign` removes it",
            foreign_version=v,
        )
    return NamespaceDir(path, manifest, None)


def _chain(first: tuple[Path, bool], rest: Iterator[tuple[Path, bool]]) -> Iterator[tuple[Path, bool]]:
    yield first
    yield from rest


def iter_root(
    root: Path, on_error: Callable[[OSError], None] | None = None
) -> Iterator[TreeFile]:
    """Every file of every valid namespace under ``root``, classified: its
    block, temp and ``.nfs`` files are the candidates of gc and capacity and
    what inspect and verify count; ``other`` files are only counted. Nothing
    outside valid namespaces is ever yielded."""
    try:
        top = iter_namespace_dirs(root)
        first = next(top, None)
    except FileNotFoundError:
        return
    except OSError as exc:
        _report(on_error, exc, str(root))
        return
    if first is None:
        return
    for path, is_dir in _chain(first, top):
        if not is_dir or not is_namespace_name(path.name):
            continue
        ns = check_namespace(path)
        if not ns.valid:
            continue
        yield from iter_namespace_files(path, on_error)
