"""Disk usage of a root, shared by every FsTier instance that stores into it.

Capacity is root-wide (one disk, one budget), so every instance on a root
must see the bytes the others store. Each instance tracking only its own
stores let five writers on one root reach several times ``max_bytes``
between their rescans (``benchmarks/bench_multi_instance.py``).

Two files at the top of the root, both created by fstier:

- ``.fstier-usage``: an 8-byte little-endian count of block-file bytes under
  the root. Every instance adds what it stores and subtracts what it removes
  (``add``) under an exclusive ``flock`` of the file, so concurrent updates
  from processes of one host (and NFS clients, whose kernels map ``flock``
  to byte-range locks) never lose one. A reader (``read``) needs no lock.
- ``.fstier-evict.lock``: held (``flock``, non-blocking) by the one instance
  running a capacity pass, so five instances over the high watermark do not
  all walk the tree and evict at once (each would remove a share of what
  is needed: five times too much).

A full scan (the capacity pass) is the truth: after one, the counter is set
to the scanned total plus whatever the others added while it ran. Drift
(a writer killed between its rename and its ``add``, ``fstier gc`` run by
hand, another host's kernel without ``flock``) lasts until the next pass.

Every file here is opened without following symlinks, checked to be a
regular file, and read at a fixed size: a file planted in its place turns
sharing off for this instance with one warning, and it falls back to its own
count (the behaviour before sharing existed).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["EVICT_LOCK_NAME", "ROOT_FILES", "USAGE_FILE_NAME", "SharedUsage"]

log = logging.getLogger("fstier.manager")

USAGE_FILE_NAME = ".fstier-usage"
EVICT_LOCK_NAME = ".fstier-evict.lock"
#: fstier's own files at the top of a root (not strays for ``fstier inspect``)
ROOT_FILES = frozenset({USAGE_FILE_NAME, EVICT_LOCK_NAME})
_COUNT = struct.Struct("<q")
_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _open_regular(path: Path, mode: int) -> int:
    """Open (creating) ``path`` read-write, refusing anything but a regular file."""
    fd = os.open(path, _FLAGS, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


class SharedUsage:
    """The shared usage counter and eviction lock of one root."""

    def __init__(self, root: str | os.PathLike[str], file_mode: int = 0o644) -> None:
        self.root = Path(root)
        self._lock = threading.Lock()  # flock is per open file, not per thread
        self._fd: int | None = None
        self._lock_fd: int | None = None
        #: this instance's own count when sharing is off
        self._local = 0
        try:
            self._fd = _open_regular(self.root / USAGE_FILE_NAME, file_mode)
            self._lock_fd = _open_regular(self.root / EVICT_LOCK_NAME, file_mode)
        except OSError as exc:
            self.close()
            log.warning(
                "fstier: usage of %s is not shared with other instances (%s); each instance "
                "counts its own stores until its next capacity pass. Remove whatever is at "
                "%s / %s to share it again", self.root, exc, USAGE_FILE_NAME, EVICT_LOCK_NAME,
            )

    @property
    def shared(self) -> bool:
        return self._fd is not None

    def _read_fd(self, fd: int) -> int:
        data = os.pread(fd, _COUNT.size, 0)
        # A new (empty) or foreign short file counts as zero; the next full
        # scan writes the real total.
        return max(0, _COUNT.unpack(data)[0]) if len(data) == _COUNT.size else 0

    def read(self) -> int:
        """The current count (no lock: an 8-byte pread of one page)."""
        with self._lock:
            fd = self._fd
            if fd is None:
                return self._local
            try:
                return self._read_fd(fd)
            except OSError:
                return self._local

    def add(self, delta: int) -> int:
        """Add ``delta`` bytes (negative for removals); returns the new count."""
        with self._lock:
            fd = self._fd
            if fd is None:
                self._local = max(0, self._local + delta)
                return self._local
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    value = max(0, self._read_fd(fd) + delta)
                    os.pwrite(fd, _COUNT.pack(value), 0)
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError as exc:
                log.warning("fstier: cannot update %s: %s", self.root / USAGE_FILE_NAME, exc)
                self._local = max(0, self._local + delta)
                return self._local
            self._local = value
            return value

    def resync(self, scanned: int, before: int) -> int:
        """A full scan found ``scanned`` bytes; the count read just before the
        scan was ``before``. Keep what others added meanwhile (it may also be
        in ``scanned``: counting it twice only evicts a little early, never
        lets usage run over). Returns the new count."""
        with self._lock:
            fd = self._fd
            if fd is None:
                self._local = scanned
                return scanned
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    now = self._read_fd(fd)
                    value = scanned + max(0, now - before)
                    os.pwrite(fd, _COUNT.pack(value), 0)
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                self._local = scanned
                return scanned
            self._local = value
            return value

    @contextlib.contextmanager
    def evicting(self) -> Iterator[bool]:
        """Try to become the one instance running a capacity pass on this
        root: yields True when this instance holds the eviction lock, False
        when another does (the caller skips its pass)."""
        fd = self._lock_fd
        if fd is None:
            yield True
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        except OSError:
            yield True  # no locking on this mount: run the pass anyway
            return
        try:
            yield True
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with self._lock:
            for name in ("_fd", "_lock_fd"):
                fd = getattr(self, name)
                setattr(self, name, None)
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
