"""Fan-out directories of one namespace (:class:`NamespaceDirs`), made
without following a symlink: one ``mkdirat`` per level inside directory fds
opened with no symlink on their path, so nothing lands outside the root even
if a directory is swapped for a symlink meanwhile (refused with
:class:`~fstier.errors.PathSafetyError`).

Invariants
    A directory is remembered as made only after the walk that made (or
    found) it opened it with no symlink on its path; the memory only skips
    ``mkdir`` calls and grants nothing (every store resolves its directory
    again); a directory removed under it (gc of empty directories, an
    operator's ``rm -rf``) is forgotten and made again.

Costs
    A known directory: one set lookup. A new one: one ``mkdirat`` and one
    ``openat`` per level below the deepest one known, through the syscall
    seam (``fsops.FS``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from pathlib import Path

from fstier.errors import PathSafetyError
from fstier.file_mapper import FileMapper
from fstier.io import fsops

__all__ = ["DIR_FLAGS", "NamespaceDirs"]

#: how a directory of the walk is opened
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class NamespaceDirs:
    """Fan-out directories of one namespace, made one ``mkdirat`` per level
    inside directory fds opened with no symlink on their path, so nothing
    lands outside the root even if a directory is swapped for a symlink
    meanwhile (that is refused with :class:`PathSafetyError`)."""

    def __init__(self, mapper: FileMapper) -> None:
        self._ns = os.fspath(mapper.namespace_dir)
        self._made: set[str] = set()
        self._lock = threading.Lock()

    def ensure(self, path: str | Path) -> None:
        """Create ``path``'s directory (and the levels above it, under the namespace)."""
        made = self.open_parent(path)
        if made is not None:
            fsops.close_quietly(made[0])

    def forget(self, path: str | Path) -> None:
        """``path``'s directory was removed: make it again next time."""
        with self._lock:
            self._made.discard(os.fspath(path).rpartition("/")[0])

    def open_parent(self, path: str | Path) -> tuple[int, bool] | None:
        """:meth:`ensure`, keeping what the walk opened: ``None`` when the
        directory was already known, else an fd of ``path``'s directory
        (opened with no symlink on its path; the caller closes it) and
        whether this call created it. The walk starts at the deepest
        directory already made and goes through the syscall seam."""
        # Strings, not pathlib: Path parsing cost more than the mkdirs
        # (docs/performance.md, "No pathlib on the store and load paths").
        key = os.fspath(path).rpartition("/")[0]
        if key in self._made:
            return None
        ns = self._ns
        if key != ns and not key.startswith(ns + "/"):
            raise ValueError(f"{path!r} is not under the namespace directory {ns}")
        parts = key[len(ns) + 1 :].split("/") if key != ns else []
        start, base = 0, ns
        for i in range(len(parts) - 1, 0, -1):
            ancestor = f"{ns}/{'/'.join(parts[:i])}"
            if ancestor in self._made:
                start, base = i, ancestor
                break
        try:
            fd = fsops.FS.open(base, DIR_FLAGS)
        except FileNotFoundError:
            if base == ns:
                raise
            # That ancestor was removed too (gc of empty directories, an
            # operator's rm -rf): forget it and walk from the namespace.
            with self._lock:
                self._made.discard(base)
            start, base = 0, ns
            try:
                fd = fsops.FS.open(base, DIR_FLAGS)
            except OSError as exc:
                raise _unsafe(Path(base), exc) from None
        except OSError as exc:
            raise _unsafe(Path(base), exc) from None
        made: list[str] = []
        fresh = False
        try:
            current = base
            for part in parts[start:]:
                current = f"{current}/{part}"
                try:
                    fsops.FS.mkdir_at(fd, part, 0o755)
                    fresh = True
                except FileExistsError:
                    fresh = False
                try:
                    nfd = fsops.FS.openat(fd, part, DIR_FLAGS)
                except OSError as exc:
                    raise _unsafe(Path(current), exc) from None
                # Linux releases an fd even when close reports an error: a
                # failing close of the parent must not leak the child.
                parent, fd = fd, nfd
                fsops.close_quietly(parent)
                made.append(current)
        except BaseException:
            with contextlib.suppress(OSError):
                fsops.FS.close(fd)
            raise
        with self._lock:
            self._made.update(made)
        return fd, fresh


def _unsafe(path: Path, exc: OSError) -> Exception:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return PathSafetyError(
            f"{path} (or a directory above it, below the root) is a symlink or not a "
            "directory; fstier refuses to follow it. Remove it."
        )
    return exc
