"""One native call, several threads: ``store_batch``/``load_batch`` with C
helper threads (``helpers``, ``eager``; see ``_native.c``, "fan-out").

A job is one Python call whose files are shared by the caller's thread and
helpers started inside the call and joined before it returns. These tests
pin what must not change with the number of threads: every key gets its own
outcome at its own index (loaded, missing, each corruption, a planted
symlink), loaded bytes are exact, stores publish every file and leave no
temp, injected faults reach every thread, and a call returns only once all
of its threads are done. They also pin that helpers really run: eager ones
at once, the others only when a read would block (``RWF_NOWAIT`` finds the
file outside the page cache).
"""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

import pytest

from fstier.io import native
from fstier.io.blockfile import padded_len
from fstier.io.fsops import aligned_buffer, is_temp_name
from fstier.io.iotypes import IOOptions, LoadStatus, StoreStatus
from fstier.keys import BlockKey

sys.path.insert(0, str(Path(__file__).parent))
import io_worker  # noqa: E402
from test_posix import CORRUPTIONS  # noqa: E402

pytestmark = pytest.mark.skipif(
    native._ext is None, reason=f"native extension not built: {native._import_error}"
)

DIGEST = io_worker.DIGEST
N = io_worker.PAYLOAD
OPTS = IOOptions(o_direct=False, fsync="none")


def _started() -> int:
    return int(native._require().fan_started())


def _store(root: Path, keys: list[BlockKey], helpers: int = 0, opts: IOOptions = OPTS) -> list[StoreStatus]:
    slots = []
    for k in keys:
        buf = aligned_buffer(padded_len(N))
        buf[:N] = io_worker.payload_of(k, 0)
        slots.append(buf[:N])
    paths = [str(io_worker.path_of(root, k)) for k in keys]
    outs = native.store_batch(str(root), paths, keys, slots, DIGEST, 1, opts, helpers=helpers)
    return [o.status for o in outs]


def _load(root: Path, keys: list[BlockKey], helpers: int, eager: int = -1,
          opts: IOOptions = OPTS) -> tuple[list, list[memoryview]]:
    bufs = [aligned_buffer(padded_len(N)) for _ in keys]
    paths = [str(io_worker.path_of(root, k)) for k in keys]
    outs = native.load_batch(str(root), paths, keys, [b[:N] for b in bufs], DIGEST, opts,
                             helpers=helpers, eager=eager)
    return outs, bufs


@pytest.fixture(autouse=True)
def _no_faults() -> object:
    yield
    native.clear_faults()


class Matrix:
    """A stored batch with every corruption of the matrix, a missing file and
    a planted symlink among good files; :meth:`check` asserts each key's
    outcome at its own index and the good keys' bytes."""

    def __init__(self, root: Path, first: int, spare: int) -> None:
        self.root = root
        self.keys = [io_worker.key_of(first + i) for i in range(len(CORRUPTIONS) + spare)]
        assert _store(root, self.keys) == [StoreStatus.STORED] * len(self.keys)
        assert _store(root, [io_worker.key_of(2)]) == [StoreStatus.STORED]  # the "other key"'s file
        self.damaged = {}
        for j, (damage, reason) in enumerate(CORRUPTIONS):
            k = self.keys[2 + j]
            damage(io_worker.path_of(root, k), root)
            self.damaged[k] = reason
        self.missing, self.planted = self.keys[-3], self.keys[-1]
        io_worker.path_of(root, self.missing).unlink()
        self.target = root / "elsewhere.bin"
        io_worker.path_of(root, self.planted).rename(self.target)
        io_worker.path_of(root, self.planted).symlink_to(self.target)

    def check(self, outs: list, bufs: list[memoryview]) -> None:
        assert len(outs) == len(self.keys)
        for k, out, buf in zip(self.keys, outs, bufs, strict=True):
            if k in self.damaged:
                assert (out.status, out.cause) == (LoadStatus.CORRUPT, self.damaged[k]), k
                assert out.removed and not io_worker.path_of(self.root, k).exists()
            elif k == self.missing:
                assert out.status is LoadStatus.MISSING
            elif k == self.planted:
                assert (out.status, out.cause) == (LoadStatus.CORRUPT, "symlink")
                assert self.target.exists()  # never followed, never removed
            else:
                assert out.status is LoadStatus.LOADED and out.nbytes == N
                assert bytes(buf[:N]) == io_worker.payload_of(k, 0)


@pytest.mark.parametrize("helpers, eager", [(0, 0), (3, 3), (7, 0), (7, 1), (40, 40)])
def test_every_key_keeps_its_own_outcome(tmp_path: Path, helpers: int, eager: int) -> None:
    """A batch mixing good files, missing ones, every corruption and a planted
    symlink loads to the same per-index outcomes with any thread count."""
    m = Matrix(tmp_path, 1000, 12)
    m.check(*_load(tmp_path, m.keys, helpers, eager))


def test_a_fanned_out_store_publishes_every_file_and_no_temp(tmp_path: Path) -> None:
    keys = [io_worker.key_of(100 + i) for i in range(30)]
    before = _started()
    assert _store(tmp_path, keys, helpers=5) == [StoreStatus.STORED] * 30
    assert _started() - before == 5  # eager: all at once
    assert not [p for p in tmp_path.rglob("*") if is_temp_name(p.name)]
    outs, bufs = _load(tmp_path, keys, 0)
    assert [o.status for o in outs] == [LoadStatus.LOADED] * 30
    assert all(bytes(b[:N]) == io_worker.payload_of(k, 0) for k, b in zip(keys, bufs, strict=True))
    # Again: every key is SKIPPED (present), on every thread.
    assert _store(tmp_path, keys, helpers=5) == [StoreStatus.SKIPPED] * 30


def test_helpers_never_outnumber_the_files(tmp_path: Path) -> None:
    keys = [io_worker.key_of(200 + i) for i in range(3)]
    before = _started()
    assert _store(tmp_path, keys, helpers=50) == [StoreStatus.STORED] * 3
    assert _started() - before == 2  # the caller takes a file too


def test_faults_reach_every_thread(tmp_path: Path) -> None:
    keys = [io_worker.key_of(300 + i) for i in range(16)]
    assert _store(tmp_path, keys) == [StoreStatus.STORED] * 16
    native.fault("open", errno.EIO, times=-1)
    outs, _ = _load(tmp_path, keys, 7)
    assert [(o.status, o.cause) for o in outs] == [(LoadStatus.ERROR, "EIO")] * 16
    assert all(io_worker.path_of(tmp_path, k).exists() for k in keys)  # a transient error removes nothing
    assert native.fault_count("open") == 16
    native.clear_faults()
    native.fault("write", errno.ENOSPC, times=-1)
    more = [io_worker.key_of(400 + i) for i in range(16)]
    assert _store(tmp_path, more, helpers=7) == [StoreStatus.FAILED] * 16
    assert not any(io_worker.path_of(tmp_path, k).exists() for k in more)
    assert not [p for p in tmp_path.rglob("*") if is_temp_name(p.name)]


def test_the_call_returns_only_when_every_thread_is_done(tmp_path: Path) -> None:
    """Each read sleeps 0.2 s: 24 files on 8 threads take about 0.6 s, not
    4.8 s (they run at once), and every buffer is filled before the call
    returns (no thread of it can touch one afterwards)."""
    keys = [io_worker.key_of(500 + i) for i in range(24)]
    assert _store(tmp_path, keys) == [StoreStatus.STORED] * 24
    native.fault("read", delay_s=0.2, times=-1)
    t0 = time.monotonic()
    outs, bufs = _load(tmp_path, keys, 7)
    elapsed = time.monotonic() - t0
    assert elapsed >= 0.2 * 3 - 0.05  # at least 3 rounds of 8
    assert elapsed < 0.2 * 24 / 2  # far from one thread's 4.8 s: they overlapped
    assert [o.status for o in outs] == [LoadStatus.LOADED] * 24
    assert all(bytes(b[:N]) == io_worker.payload_of(k, 0) for k, b in zip(keys, bufs, strict=True))


def _nowait_works(path: Path) -> bool:
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(4096)], 0, flag)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def test_helpers_start_only_when_reads_would_block(tmp_path: Path) -> None:
    """``eager=0``: files in the page cache are read by the caller alone (no
    helper: copying and hashing are CPU work); reads that would block (here
    the page-cache-only attempt is made to find nothing, ``nowait`` fault:
    whether a dropped file's read blocks depends on how fast the device
    answers) start one helper each, up to ``helpers``, and every file still
    loads exactly."""
    keys = [io_worker.key_of(600 + i) for i in range(16)]
    assert _store(tmp_path, keys) == [StoreStatus.STORED] * 16
    files = [io_worker.path_of(tmp_path, k) for k in keys]
    for f in files:
        f.read_bytes()  # in the page cache, and written back (the flusher
        fd = os.open(f, os.O_RDONLY)  # locking a page for write-back would
        try:  # make a read from the cache refuse)
            os.fsync(fd)
        finally:
            os.close(fd)
    if not _nowait_works(files[0]):
        pytest.skip(f"{tmp_path}: no RWF_NOWAIT reads (every read may start a helper)")
    before = _started()
    outs, _ = _load(tmp_path, keys, helpers=7, eager=0)
    assert [o.status for o in outs] == [LoadStatus.LOADED] * 16
    assert _started() == before
    native.fault("nowait", errno.EAGAIN, times=-1)
    before = _started()
    outs, bufs = _load(tmp_path, keys, helpers=7, eager=0)
    assert _started() - before == 7  # 16 reads would block: helpers up to the cap
    assert [o.status for o in outs] == [LoadStatus.LOADED] * 16
    assert all(bytes(b[:N]) == io_worker.payload_of(k, 0) for k, b in zip(keys, bufs, strict=True))
    native.clear_faults()
    native.fault("nowait", errno.EAGAIN, times=3)
    before = _started()
    outs, _ = _load(tmp_path, keys, helpers=7, eager=0)
    assert _started() - before == 3  # one helper per read that would block
    assert [o.status for o in outs] == [LoadStatus.LOADED] * 16
