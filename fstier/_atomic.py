"""The one atomic-write helper and the temp-file naming every writer shares.

Every file fstier publishes (block files and the namespace manifest) is
written to a unique temp name in the destination directory and then renamed
over the final name, so an observer sees the old file, the new file or
nothing, never a torn one. Temp names start with ``.`` and contain
``.tmp.``; gc recognises them by :func:`is_temp_name`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import socket
import threading
from pathlib import Path

from fstier._resolve import open_nofollow

__all__ = ["TEMP_MARKER", "atomic_write", "fsync_dir", "is_temp_name", "temp_path_for"]

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
