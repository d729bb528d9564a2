"""Raw O_DIRECT baselines for bench_io.py: what the disk does without fstier.

Two shapes, both with the same thread count as the fstier run they are
compared with, both writing NEW blocks (docs/architecture.md, "Facts of the
machines": overwriting allocated blocks is ~3x faster than allocating, so an
overwrite baseline is the wrong limit):

- ``large``: one new large file; threads ``pwrite`` block-sized pieces at
  distinct offsets, then ``pread`` them back.
- ``files``: one new file per block (open O_CREAT|O_DIRECT, pwrite, close),
  then open/pread/close each: the floor for any file-per-block design.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

O_DIRECT = getattr(os, "O_DIRECT", 0)


def aligned(nbytes: int, fill: bytes | None = None) -> memoryview:
    """A prefaulted page-aligned buffer (optionally filled with ``fill``)."""
    m = mmap.mmap(-1, nbytes)
    view = memoryview(m)
    if fill is None:
        view[:] = bytes(nbytes)  # touch every page now, not during timing
    else:
        view[:] = (fill * (nbytes // len(fill) + 1))[:nbytes]
    return view


class _ThreadBuf(threading.local):
    def __init__(self) -> None:
        self.buf: memoryview | None = None


def run_threads(threads: int, count: int, op: Callable[[int], None]) -> float:
    """Run ``op(i)`` for i in range(count) on ``threads`` threads; seconds."""
    counter = itertools.count()
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            while True:
                i = next(counter)
                if i >= count:
                    return
                op(i)
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return seconds


class RawBaseline:
    """O_DIRECT pwrite/pread of ``count`` blocks of ``block`` bytes in ``directory``."""

    def __init__(self, directory: Path, block: int, count: int, pattern: bytes) -> None:
        self.directory = directory
        self.block = block
        self.count = count
        self.pattern = pattern
        self._local = _ThreadBuf()

    def _buf(self) -> memoryview:
        if self._local.buf is None:
            self._local.buf = aligned(self.block, self.pattern)
        return self._local.buf

    def warm(self, threads: int) -> None:
        """Allocate and prefault every thread's buffer before timing."""
        run_threads(threads, threads * 4, lambda i: self._buf() and None)

    # -- one large new file
    def store_large(self, threads: int) -> float:
        path = self.directory / "raw-large.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o644)
        try:
            return run_threads(threads, self.count, lambda i: self._pwrite(fd, i * self.block))
        finally:
            os.close(fd)

    def load_large(self, threads: int) -> float:
        fd = os.open(self.directory / "raw-large.bin", os.O_RDONLY | O_DIRECT)
        try:
            return run_threads(threads, self.count, lambda i: self._pread(fd, i * self.block))
        finally:
            os.close(fd)

    # -- one new file per block
    def _file(self, i: int) -> Path:
        return self.directory / f"raw-{i:07d}.bin"

    def store_files(self, threads: int) -> float:
        def op(i: int) -> None:
            fd = os.open(self._file(i), os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o644)
            try:
                self._pwrite(fd, 0)
            finally:
                os.close(fd)

        return run_threads(threads, self.count, op)

    def load_files(self, threads: int) -> float:
        def op(i: int) -> None:
            fd = os.open(self._file(i), os.O_RDONLY | O_DIRECT)
            try:
                self._pread(fd, 0)
            finally:
                os.close(fd)

        return run_threads(threads, self.count, op)

    def _pwrite(self, fd: int, offset: int) -> None:
        buf = self._buf()
        done = 0
        while done < self.block:
            done += os.pwrite(fd, buf[done:], offset + done)

    def _pread(self, fd: int, offset: int) -> None:
        buf = self._buf()
        done = 0
        while done < self.block:
            n = os.preadv(fd, [buf[done:]], offset + done)
            if n <= 0:
                raise OSError(f"short raw read at {offset + done}")
            done += n

    def cleanup(self) -> None:
        for p in self.directory.glob("raw-*.bin"):
            p.unlink()


def drop_caches(level: int = 3) -> bool:
    """Drop the kernel's caches when permitted (root) so a "cold" phase is
    cold: 1 = page cache, 2 = dentries and inodes, 3 = both. Returns whether
    it happened."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write(f"{level}\n")
        return True
    except OSError:
        return False
