"""A root's usage directory, ``<root>/.fstier-usage.d``
(:mod:`fstier.tier.usage`), held by fd and re-resolved under the root on
every use.

- Opened ``O_NOFOLLOW|O_DIRECTORY`` (made 0755 when missing): a symlink, a
  FIFO or a file at that name is refused with ``OSError`` at start.
- :meth:`UsageDir.fd` returns the held fd only while
  ``<root>/.fstier-usage.d`` still names it (``st_dev``/``st_ino``); moved
  away or replaced, the old one is closed and never written again,
  ``on_replaced()`` runs (the caller's names and lease were in it) and a new
  one is opened, or made, under the root
  (test_usage_dir_moved_out_of_the_root_is_never_written_again).

Costs: an ``lstat`` and an ``fstat`` per call. The caller serialises calls.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

__all__ = ["USAGE_DIR_NAME", "UsageDir"]

USAGE_DIR_NAME = ".fstier-usage.d"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open(path: Path) -> int:
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o755)
    fd = os.open(path, _DIR_FLAGS)
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.ENOTDIR, "not a directory")
    except BaseException:
        os.close(fd)
        raise
    return fd


class UsageDir:
    """``root``'s usage directory (see the module docstring); the
    constructor raises ``OSError`` when none is usable there.
    ``warn(key, message, *args)`` logs once per key."""

    def __init__(
        self, root: Path, warn: Callable[..., None], on_replaced: Callable[[], None]
    ) -> None:
        self.path = root / USAGE_DIR_NAME
        self._warn = warn
        self._on_replaced = on_replaced
        self._fd: int | None = _open(self.path)
        self._closed = False

    def fd(self) -> int | None:
        """The directory's fd while the root still names it, else a new one
        opened there (None when none is usable now, or after :meth:`close`)."""
        if self._closed:
            return None
        fd = self._fd
        try:
            now = os.stat(self.path, follow_symlinks=False)
            if fd is not None:
                held = os.fstat(fd)
                if stat.S_ISDIR(now.st_mode) and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                    return fd
        except OSError:
            pass
        if fd is not None:
            self._fd = None
            with contextlib.suppress(OSError):
                os.close(fd)
            self._warn("moved", "fstier: %s was moved or replaced; using a new one under the root", self.path)
            self._on_replaced()
        try:
            self._fd = _open(self.path)
        except OSError as exc:
            self._warn(f"open:{exc.errno}", "fstier: cannot use %s (%s); retrying", self.path, exc)
            return None
        return self._fd

    def close(self) -> None:
        fd, self._fd = self._fd, None
        self._closed = True
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
