"""The syscall seam of the storage layer: opening paths without following
any symlink, name operations through directory fds, and the one atomic-write
helper with the temp-file naming every writer shares.

Opening paths without following any symlink, at the time of the call
--------------------------------------------------------------------

fstier's promise "nothing outside root is ever created, written or removed"
cannot rest on checks made earlier (a directory verified once can be swapped
for a symlink afterwards), nor on ``O_NOFOLLOW`` (it guards only the last
component). Every path fstier resolves under its root is therefore resolved
by the kernel with *no* symlink allowed in *any* component:

- ``openat2(AT_FDCWD, path, how={flags, mode, RESOLVE_NO_SYMLINKS})`` where
  the kernel has it (Linux >= 5.6): one system call, the same path walk as a
  plain ``open``. Callers hand it real paths (``FileMapper`` resolves the
  configured root with ``realpath`` once), so the only symlinks it can meet
  are planted ones, and it refuses them with ``ELOOP``.
- Elsewhere (old kernels, seccomp filters that answer ``ENOSYS``/``EPERM``), a
  walk one component at a time from ``/`` with
  ``openat(dir_fd, part, O_PATH|O_DIRECTORY|O_NOFOLLOW)``: same guarantee,
  two system calls per component.

Operations on a name (create, rename, link, unlink, stat) take a directory
fd opened this way and the last component, so a swap after the directory was
opened cannot redirect them either: the fd names the directory inode, not a
path. Nothing is cached: a directory fd lives for one operation.

Atomic writes and temp names
----------------------------
Every file fstier publishes by name (the namespace manifest, block files on
filesystems without ``O_TMPFILE``) is written to a unique temp name in the
destination directory and then renamed over the final name, so an observer
sees the old file, the new file or nothing, never a torn one. Temp names
start with ``.`` and contain ``.tmp.``; gc recognises them by
:func:`is_temp_name`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import socket
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "HAVE_OPENAT2",
    "TEMP_MARKER",
    "atomic_write",
    "fsync_dir",
    "is_temp_name",
    "open_nofollow",
    "split_parent",
    "temp_path_for",
    "unlink_if",
]

_O_PATH: int = getattr(os, "O_PATH", 0)
_O_DIRECTORY: int = getattr(os, "O_DIRECTORY", 0)
_O_NOFOLLOW: int = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC: int = getattr(os, "O_CLOEXEC", 0)
_O_CREAT: int = os.O_CREAT
_O_TMPFILE: int = getattr(os, "O_TMPFILE", 0)
_AT_FDCWD = -100
_RESOLVE_NO_SYMLINKS = 0x04
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(os.uname().machine, 0)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _load_syscall() -> object | None:
    if not _SYS_OPENAT2:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_syscall = _load_syscall()


class _How(threading.local):
    """One ``open_how`` per thread, reused: building a ctypes struct per call
    costs about as much as the system call itself."""

    def __init__(self) -> None:
        self.how = _OpenHow()
        self.ptr = ctypes.addressof(self.how)


_HOW = _How()


def _openat2(path: str, flags: int, mode: int) -> int:
    how = _HOW.how
    how.flags = flags | _O_CLOEXEC
    # openat2 refuses a mode without O_CREAT/O_TMPFILE (EINVAL), unlike open.
    # O_TMPFILE includes the O_DIRECTORY bit: test it whole.
    creates = flags & _O_CREAT or (_O_TMPFILE and flags & _O_TMPFILE == _O_TMPFILE)
    how.mode = mode if creates else 0
    how.resolve = _RESOLVE_NO_SYMLINKS
    fn = _syscall
    if fn is None:
        raise OSError(errno.ENOSYS, "openat2 is not available", path)
    fd = int(fn(_SYS_OPENAT2, _AT_FDCWD, os.fsencode(path), _HOW.ptr, 24))  # type: ignore[operator]
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)
    return fd


def _walk_open(path: str, flags: int, mode: int) -> int:
    """Fallback: open ``path`` one component at a time, never following a link."""
    absolute = os.path.abspath(path)
    parts = [p for p in absolute.split("/") if p]
    dfd = os.open("/", os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        for part in parts[:-1]:
            nfd = os.open(part, _O_PATH | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dfd)
            os.close(dfd)
            dfd = nfd
        if not parts:
            return os.open("/", flags | _O_CLOEXEC, mode)
        return os.open(parts[-1], flags | _O_NOFOLLOW | _O_CLOEXEC, mode, dir_fd=dfd)
    finally:
        os.close(dfd)


def _probe() -> bool:
    if _syscall is None:
        return False
    try:
        os.close(_openat2("/", os.O_RDONLY | _O_DIRECTORY, 0))
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EPERM, errno.EINVAL):
            return False
        raise
    return True


#: Whether this kernel (and seccomp profile) lets us use openat2.
HAVE_OPENAT2: bool = _probe()


def open_nofollow(path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
    """``os.open(path, flags | O_CLOEXEC, mode)``, except that no component of
    ``path`` (the last one included) may be a symlink: ``ELOOP`` if one is
    (``ENOTDIR`` from the fallback walk when a directory component is one)."""
    p = os.fspath(path)
    if HAVE_OPENAT2:
        return _openat2(p, flags, mode)
    return _walk_open(p, flags, mode)


def split_parent(path: str | os.PathLike[str]) -> tuple[str, str]:
    """``(directory, name)`` of ``path`` (``.`` when it has no directory)."""
    p = os.fspath(path)
    head, _, tail = p.rpartition("/")
    if not _:
        return ".", p
    return head or "/", tail


def unlink_if(
    path: str | os.PathLike[str],
    keep: Callable[[os.stat_result], bool],
    on_error: Callable[[OSError], None] | None = None,
) -> str:
    """Unlink ``path`` unless ``keep(lstat)`` says otherwise, resolving its
    directory once, without symlinks, and acting on that directory fd (a
    swap between the check and the unlink cannot redirect it). Returns
    ``removed``, ``kept``, ``gone`` or ``error`` (the error, naming
    ``path``, also goes to ``on_error``)."""

    def error(exc: OSError) -> str:
        if on_error is not None:
            exc.filename = os.fspath(path)
            on_error(exc)
        return "error"

    parent, name = split_parent(path)
    try:
        dfd = open_nofollow(parent, os.O_RDONLY | _O_DIRECTORY)
    except FileNotFoundError:
        return "gone"
    except OSError as exc:
        return error(exc)  # ELOOP/ENOTDIR: a symlink on the path; nothing is touched
    try:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return "gone"
        if keep(st):
            return "kept"
        os.unlink(name, dir_fd=dfd)
        return "removed"
    except FileNotFoundError:
        return "gone"
    except OSError as exc:
        return error(exc)
    finally:
        os.close(dfd)


# ------------------------------------------------------- atomic writes, temp names
TEMP_MARKER = ".tmp."
_HOST = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())[:32] or "host"


def temp_path_for(final: Path) -> Path:
    """A unique temp path beside ``final``: host, pid, thread id and randomness."""
    name = (
        f".{final.name}{TEMP_MARKER}{_HOST}.{os.getpid()}."
        f"{threading.get_native_id()}.{secrets.token_hex(4)}"
    )
    return final.with_name(name)


def is_temp_name(name: str) -> bool:
    """True for names produced by :func:`temp_path_for`."""
    return name.startswith(".") and TEMP_MARKER in name


def fsync_dir(directory: Path) -> None:
    """fsync a directory so a rename inside it is durable."""
    fd = open_nofollow(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, *, mode: int = 0o644, fsync: str = "file") -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same directory,
    full write loop, optional fsync (``none``, ``file``, ``file+dir``),
    rename. The temp file is removed on any exception.

    The directory is opened once without following a symlink in any
    component, and the temp file is created, renamed and fsynced through
    that fd, so a directory swapped for a symlink meanwhile cannot send the
    file outside the root."""
    tmp = temp_path_for(path).name
    dfd = open_nofollow(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd
        )
        try:
            try:
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    if n <= 0:
                        raise OSError(errno.EIO, f"write returned {n} for {tmp}")
                    view = view[n:]
                if fsync in ("file", "file+dir"):
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        if fsync == "file+dir":
            os.fsync(dfd)
    finally:
        os.close(dfd)
