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
import logging
import mmap
import os
import secrets
import socket
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fstier.io.blockfile import ALIGNMENT, padded_len

__all__ = [
    "FS",
    "HAVE_OPENAT2",
    "O_CLOEXEC",
    "O_DIRECT",
    "O_DIRECTORY",
    "O_DIR_FLAGS",
    "O_NOFOLLOW",
    "O_TMPFILE",
    "OsOps",
    "TEMP_MARKER",
    "advance",
    "aligned_buffer",
    "atomic_write",
    "atomic_write_at",
    "buffer_address",
    "byte_view",
    "close_quietly",
    "discard_at",
    "errno_name",
    "fsync_dir",
    "is_aligned",
    "is_temp_name",
    "open_nofollow",
    "preadv_all",
    "pwritev_all",
    "split_parent",
    "temp_path_for",
    "touch_file",
    "unlink_if",
    "unlink_if_same",
]

log = logging.getLogger("fstier.io")

_O_PATH: int = getattr(os, "O_PATH", 0)
_O_DIRECTORY: int = getattr(os, "O_DIRECTORY", 0)
_O_NOFOLLOW: int = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC: int = getattr(os, "O_CLOEXEC", 0)
_O_CREAT: int = os.O_CREAT
_O_TMPFILE: int = getattr(os, "O_TMPFILE", 0)
O_DIRECT: int = getattr(os, "O_DIRECT", 0)
O_NOFOLLOW: int = _O_NOFOLLOW
O_CLOEXEC: int = _O_CLOEXEC
O_DIRECTORY: int = _O_DIRECTORY
O_TMPFILE: int = _O_TMPFILE
#: A directory fd used as ``dir_fd`` (and fsync-able, unlike O_PATH).
O_DIR_FLAGS = os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC
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
    ``path``, also goes to ``on_error``). Every call goes through :data:`FS`."""

    def error(exc: OSError) -> str:
        if on_error is not None:
            exc.filename = os.fspath(path)
            on_error(exc)
        return "error"

    parent, name = split_parent(path)
    try:
        dfd = FS.open(parent, os.O_RDONLY | _O_DIRECTORY)
    except FileNotFoundError:
        return "gone"
    except OSError as exc:
        return error(exc)  # ELOOP/ENOTDIR: a symlink on the path; nothing is touched
    try:
        try:
            st = FS.stat_at(dfd, name)
        except FileNotFoundError:
            return "gone"
        if keep(st):
            return "kept"
        FS.unlink_at(dfd, name)
        return "removed"
    except FileNotFoundError:
        return "gone"
    except OSError as exc:
        return error(exc)
    finally:
        close_quietly(dfd)


def unlink_if_same(
    path: str | os.PathLike[str],
    *,
    ino: int,
    dev: int | None = None,
    mtime_ns: int | None = None,
    on_error: Callable[[OSError], None] | None = None,
) -> str:
    """THE "remove it only if it is still the file that was judged" rule:
    unlink ``path`` only while it names a regular file with inode ``ino``
    (and device ``dev``, and mtime ``mtime_ns``, where given), so a file a
    concurrent writer has just published, or a block loaded (its mtime
    bumped) since it was judged, is never removed. Used by the load path
    (a corrupt file), eviction (a victim) and ``fstier verify --fix``.
    Returns what :func:`unlink_if` returns."""

    def changed(now: os.stat_result) -> bool:
        return (
            not stat.S_ISREG(now.st_mode)
            or now.st_ino != ino
            or (dev is not None and now.st_dev != dev)
            or (mtime_ns is not None and now.st_mtime_ns != mtime_ns)
        )

    return unlink_if(path, changed, on_error)


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
    """Write ``data`` to ``path`` atomically (:func:`atomic_write_at` in
    ``path``'s directory, opened once without following a symlink in any
    component, so a directory swapped for a symlink meanwhile cannot send
    the file outside the root)."""
    dfd = open_nofollow(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        atomic_write_at(dfd, path.name, data, mode=mode, fsync=fsync)
    finally:
        os.close(dfd)


def atomic_write_at(dir_fd: int, name: str, data: bytes, *, mode: int = 0o644, fsync: str = "file") -> None:
    """THE atomic small-file write: ``data`` as ``name`` in the directory
    ``dir_fd``, through a temp file named by :func:`temp_path_for` (so
    :func:`is_temp_name` knows it and gc sweeps one a crash left behind),
    full write loop, optional fsync (``none``, ``file``, ``file+dir``),
    rename over ``name``. The temp file is removed on any exception. Every
    small file fstier writes (manifests, usage counts, leases) goes
    through here."""
    tmp = temp_path_for(Path(name)).name
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
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
            os.close(fd)  # a deferred write error surfaces here: nothing is renamed then
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    if fsync == "file+dir":
        os.fsync(dir_fd)


# ---------------------------------------------------------------- the FS seam
class OsOps:
    """Every system call the io layer makes. Tests replace methods on the
    module-level :data:`FS` instance (``monkeypatch.setattr(posix.FS, "fsync", f)``)
    to inject ENOSPC, EIO, short writes, hangs...

    Path arguments are resolved with no symlink in any component
    (:func:`open_nofollow`); ``*_at`` methods act on one
    name inside a directory fd opened that way, so a directory swapped for a
    symlink after it was opened cannot redirect them."""

    def open(self, path: str | Path, flags: int, mode: int = 0o600) -> int:
        return open_nofollow(path, flags, mode)

    def openat(self, dir_fd: int, name: str, flags: int, mode: int = 0o600) -> int:
        return os.open(name, flags | O_NOFOLLOW | O_CLOEXEC, mode, dir_fd=dir_fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def stat_at(self, dir_fd: int, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)

    def unlink_at(self, dir_fd: int, name: str) -> None:
        os.unlink(name, dir_fd=dir_fd)

    def replace_at(self, dir_fd: int, src: str, dst: str) -> None:
        os.replace(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

    def link_at(self, fd: int, dir_fd: int, name: str) -> None:
        """Give the anonymous (``O_TMPFILE``) file ``fd`` the name ``name`` in
        ``dir_fd``. ``EEXIST`` if the name exists (linkat never replaces)."""
        # /proc/self/fd/N with AT_SYMLINK_FOLLOW needs no privilege, unlike
        # AT_EMPTY_PATH (CAP_DAC_READ_SEARCH).
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd, follow_symlinks=True)

    def mkdir_at(self, dir_fd: int, name: str, mode: int = 0o755) -> None:
        os.mkdir(name, mode, dir_fd=dir_fd)

    def utime(self, fd: int) -> None:
        os.utime(fd)

    # Path-level conveniences: one name resolved in its parent, no symlinks.
    def lstat(self, path: str | Path) -> os.stat_result:
        parent, name = split_parent(path)
        dfd = self.open(parent, O_DIR_FLAGS)
        try:
            return self.stat_at(dfd, name)
        finally:
            self.close(dfd)

    def unlink(self, path: str | Path) -> None:
        parent, name = split_parent(path)
        dfd = self.open(parent, O_DIR_FLAGS)
        try:
            self.unlink_at(dfd, name)
        finally:
            self.close(dfd)


FS = OsOps()


def errno_name(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, type(exc).__name__)


# ------------------------------------------------------------ aligned buffers
def aligned_buffer(nbytes: int) -> memoryview:
    """A page-aligned, writable, zeroed buffer (anonymous mmap) of at least
    ``nbytes`` rounded up to 4096. The memory is prefaulted."""
    size = max(ALIGNMENT, padded_len(nbytes))
    # MAP_PRIVATE: Python's default for anonymous maps is MAP_SHARED, which a
    # forked child would share with its parent (tests/reliability/
    # test_concurrency.py::test_io_buffers_private_after_fork).
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(m)
    # Touch every page now: first-touch faults are slow on these VMs
    # (docs/architecture.md, "Facts of the machines").
    view[:: mmap.PAGESIZE] = bytes(len(range(0, size, mmap.PAGESIZE)))
    return view


def buffer_address(view: memoryview) -> int:
    """The address of the first byte of a contiguous buffer."""
    if len(view) == 0:
        return 0
    if not view.readonly:
        # ~10x cheaper than a buffer request; it runs on every op.
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    # A read-only buffer (bytes): ask CPython for it (the storage layer
    # imports no numpy).
    pybuf = _PyBuffer()
    _get_buffer(ctypes.py_object(view), ctypes.byref(pybuf), 0)
    try:
        return int(pybuf.buf or 0)
    finally:
        _release_buffer(ctypes.byref(pybuf))


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (only ``buf`` is read)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def byte_view(buf: Any) -> memoryview:
    """``buf`` as a flat memoryview of bytes."""
    view = memoryview(buf)
    if view.ndim != 1 or view.itemsize != 1 or view.format not in ("B", "b", "c"):
        view = view.cast("B")
    return view


def is_aligned(view: memoryview, alignment: int) -> bool:
    return buffer_address(view) % alignment == 0 and len(view) % alignment == 0



# ------------------------------------------------------------ robust calls
def advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first ``n`` bytes from a list of buffers (short-write resume)."""
    out: list[memoryview] = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(b[n:] if n else b)
        n = 0
    return out


def pwritev_all(fd: int, bufs: list[memoryview], offset: int) -> int:
    total = 0
    while bufs:
        n = FS.pwritev(fd, bufs, offset + total)
        if n <= 0:
            raise OSError(errno.EIO, f"pwritev wrote {n} bytes")
        total += n
        bufs = advance(bufs, n)
    return total


def close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        FS.close(fd)


def discard_at(dir_fd: int, name: str) -> None:
    try:
        FS.unlink_at(dir_fd, name)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove temp file %s: %s", name, exc)



def preadv_all(fd: int, bufs: list[memoryview], offset: int) -> int:
    total = 0
    while bufs:
        n = FS.preadv(fd, bufs, offset + total)
        if n <= 0:
            break  # EOF: the file shrank under us; the caller sees a short read
        total += n
        bufs = advance(bufs, n)
    return total


def touch_file(path: str | Path) -> bool:
    """Set a block file's mtime to now (its LRU recency) without following a
    symlink anywhere on its path. False when it is gone or refused.

    Only a regular file with one link is touched: fstier publishes every
    block with exactly one name, so a second link is someone else's path to
    the same inode (a ``cp -al`` backup outside the root), whose metadata
    fstier must not change. The check and the update go through one fd."""
    parent, name = split_parent(path)
    try:
        dir_fd = FS.open(parent, O_DIR_FLAGS)
    except OSError:
        return False
    try:
        fd = os.open(name, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        close_quietly(dir_fd)
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return False
        os.utime(fd)
        return True
    except OSError:
        return False
    finally:
        close_quietly(fd)
        close_quietly(dir_fd)
