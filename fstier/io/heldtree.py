"""A directory held by its fd: sized, emptied and removed without a path
looked up again.

A deletion acts on the directory that was checked, never on whatever a
path names a moment later (a user's directory renamed into the checked
name in between must survive):

- the directory is opened once (:func:`open_held_dir`: relative to its
  parent's fd, ``O_DIRECTORY|O_NOFOLLOW``), checked through that fd, and
  everything below it is reached through fds (``openat``/``unlinkat``/
  ``fstatat`` relative to the held fd, never following a symlink: a link
  inside is unlinked, not followed);
- the directory's own entry is removed last (:func:`rmdir_if_same`) only
  while its name still resolves, without following a link, to the same
  ``st_dev``/``st_ino`` as the held fd. ``rmdir`` removes only an empty
  directory, so the instant between that comparison and the ``rmdir``
  can at worst remove an *empty* directory swapped in at that instant,
  never a file or a directory's contents.

Bounded: the walk descends at most :data:`MAX_DEPTH` levels (fstier's
layouts are at most four deep) and holds one fd per level. Costs: one
``fstatat`` and one ``unlinkat`` per file. Pinned by
tests/test_held_removal.py.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable

__all__ = ["MAX_DEPTH", "empty_held_dir", "held_tree_size", "open_held_dir", "rmdir_if_same", "same_file"]

#: Deepest directory level below a held directory that is walked.
MAX_DEPTH = 16

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

OnError = Callable[[OSError], None] | None


def open_held_dir(parent_fd: int, name: str) -> int:
    """An fd of the directory ``name`` in ``parent_fd``; ``ELOOP`` or
    ``ENOTDIR`` when ``name`` is a symlink or not a directory."""
    if not name or "/" in name or name in (".", ".."):
        raise OSError(errno.EINVAL, "not a single directory entry name", name)
    return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _report(on_error: OnError, exc: OSError, where: str) -> None:
    if on_error is not None:
        exc.filename = where
        on_error(exc)


def _walk(fd: int, where: str, depth: int, on_error: OnError, remove: bool) -> tuple[int, int, int]:
    """(files, bytes, errors) below ``fd``; with ``remove``, each file is
    unlinked and each emptied subdirectory removed as the walk leaves it."""
    files = size = errors = 0
    try:
        with os.scandir(fd) as it:
            names = [e.name for e in it]
    except OSError as exc:
        _report(on_error, exc, where)
        return 0, 0, 1
    for name in names:
        path = f"{where}/{name}"
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                if remove:
                    os.unlink(name, dir_fd=fd)
                files += 1
                size += st.st_size
                continue
            if depth >= MAX_DEPTH:
                raise OSError(errno.ELOOP, f"deeper than {MAX_DEPTH} levels; not fstier's layout")
            sub = open_held_dir(fd, name)
            try:
                if not same_file(os.fstat(sub), st):
                    raise OSError(errno.ESTALE, "replaced while it was walked")
                f, s, e = _walk(sub, path, depth + 1, on_error, remove)
            finally:
                os.close(sub)
            files, size, errors = files + f, size + s, errors + e
            if remove and not e:
                os.rmdir(name, dir_fd=fd)
        except FileNotFoundError:
            continue
        except OSError as exc:
            errors += 1
            _report(on_error, exc, path)
    return files, size, errors


def held_tree_size(fd: int, where: str, on_error: OnError = None) -> tuple[int, int]:
    """``(files, bytes)`` below the held directory ``fd`` (``where`` names
    it in errors)."""
    files, size, _ = _walk(fd, where, 0, on_error, remove=False)
    return files, size


def empty_held_dir(fd: int, where: str, on_error: OnError = None) -> int:
    """Remove everything below the held directory ``fd``; returns the
    number of errors (each also handed to ``on_error``)."""
    return _walk(fd, where, 0, on_error, remove=True)[2]


def rmdir_if_same(parent_fd: int, name: str, held_fd: int) -> str:
    """Remove the entry ``name`` of ``parent_fd`` if it is still the
    directory ``held_fd`` holds: ``removed``, ``replaced`` (it names another
    file now: left alone) or ``gone``. Other errors raise ``OSError``
    (``ENOTEMPTY`` included)."""
    try:
        now = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return "gone"
    if not stat.S_ISDIR(now.st_mode) or not same_file(now, os.fstat(held_fd)):
        return "replaced"
    try:
        os.rmdir(name, dir_fd=parent_fd)
    except FileNotFoundError:
        return "gone"
    return "removed"
