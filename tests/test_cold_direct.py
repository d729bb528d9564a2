"""``o_direct: cold``: buffered I/O, except that a load whose file is at
least 1 MiB and has no page in the page cache (``cachestat(2)``, which
starts no readahead) reads it with O_DIRECT (native path; the Python path
reads it buffered).

Pinned here: every outcome of the corruption matrix is the same whether a
file is read direct or buffered (they are checked by the same code after
the read); the decision follows the real page cache (a file just stored is
read buffered, the same file dropped from the cache direct, a small one
always buffered); a filesystem refusing the direct read falls back to a
buffered one; a kernel without ``cachestat`` reads buffered; a direct read
grows the call's fan-out like a read that would block; and the mode's
config reaches the I/O options on both paths, with a refusal of O_DIRECT
leaving the root buffered and quiet (one info line, no warning).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fstier.io import native
from fstier.io.capabilities import RootCapabilities, probe_o_direct
from fstier.io.fsops import aligned_buffer
from fstier.io.iotypes import IOOptions, LoadStatus

sys.path.insert(0, str(Path(__file__).parent))
import io_worker  # noqa: E402
from conftest import make_config  # noqa: E402
from test_native_fanout import Matrix, _load, _store  # noqa: E402
from test_posix import _refuse_direct_open  # noqa: E402

COLD = IOOptions(o_direct_cold=True, fsync="none")
N = io_worker.PAYLOAD

needs_native = pytest.mark.skipif(
    native._ext is None, reason=f"native extension not built: {native._import_error}"
)


def _direct_ok(path: Path) -> bool:
    return probe_o_direct(path, "auto").enabled


def _cold_reads() -> int:
    return int(native._require().cold_direct_reads())


def _pages_cached(path: Path) -> int | None:
    """Pages of ``path`` in the page cache (cachestat(2)); None where the
    kernel lacks the call."""
    libc = ctypes.CDLL(None, use_errno=True)
    rng = (ctypes.c_uint64 * 2)(0, 0)
    stat = (ctypes.c_uint64 * 5)()
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syscall(ctypes.c_long(451), fd, rng, stat, 0) != 0:
            if ctypes.get_errno() == errno.ENOSYS:
                return None
            raise OSError(ctypes.get_errno(), "cachestat")
    finally:
        os.close(fd)
    return int(stat[0])


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture
def small_cold_min() -> Iterator[None]:
    """Read files of this module's size direct when cold (default 1 MiB)."""
    before = native.configure()["cold_direct_min"]
    native.configure(cold_direct_min=4096)
    yield
    native.configure(cold_direct_min=before)
    native.clear_faults()


@pytest.fixture
def direct_root(tmp_path: Path) -> Path:
    if not _direct_ok(tmp_path):
        pytest.skip("tmp_path refuses O_DIRECT")
    return tmp_path


@needs_native
@pytest.mark.parametrize("helpers", [0, 3])
def test_every_outcome_holds_when_cold_files_read_direct(
    direct_root: Path, small_cold_min: None, helpers: int
) -> None:
    """The corruption matrix, a missing file and a planted symlink, every
    regular file read with O_DIRECT (the page-cache test made to find
    nothing): the same per-index outcomes as buffered reads, bytes exact."""
    m = Matrix(direct_root, 3000, 6)
    native.fault("cachestat", errno.EAGAIN, times=-1)
    before = _cold_reads()
    outs, bufs = _load(direct_root, m.keys, helpers, 0, opts=COLD)
    assert _cold_reads() - before == len(m.keys) - 2  # every file that opened
    m.check(outs, bufs)


@needs_native
def test_the_decision_follows_the_page_cache(direct_root: Path, small_cold_min: None) -> None:
    """No injection: files just stored are in the page cache and read
    buffered; dropped from it, they read direct; below the size floor a
    dropped file still reads buffered."""
    keys = [io_worker.key_of(4000 + i) for i in range(3)]
    _store(direct_root, keys)
    paths = [io_worker.path_of(direct_root, k) for k in keys]
    if _pages_cached(paths[0]) is None:
        pytest.skip("this kernel has no cachestat(2)")
    before = _cold_reads()
    outs, bufs = _load(direct_root, keys, 0, 0, opts=COLD)
    assert [o.status for o in outs] == [LoadStatus.LOADED] * 3
    assert _cold_reads() == before  # cached: buffered
    for p in paths:
        _drop(p)
    if any(_pages_cached(p) for p in paths):
        pytest.skip("this filesystem keeps its pages in memory (tmpfs): nothing is ever cold")
    outs, bufs = _load(direct_root, keys, 0, 0, opts=COLD)
    assert [o.status for o in outs] == [LoadStatus.LOADED] * 3
    assert _cold_reads() - before == 3
    assert all(bytes(b[:N]) == io_worker.payload_of(k, 0) for k, b in zip(keys, bufs, strict=True))
    assert not any(_pages_cached(p) for p in paths)  # a direct read leaves the cache alone
    native.configure(cold_direct_min=N + 1)  # now every file is below the floor
    outs, _ = _load(direct_root, keys, 0, 0, opts=COLD)
    assert [o.status for o in outs] == [LoadStatus.LOADED] * 3
    assert _cold_reads() - before == 3


@needs_native
def test_a_refused_direct_read_is_read_buffered(direct_root: Path, small_cold_min: None) -> None:
    """A filesystem that accepts O_DIRECT at open but refuses the read
    (EINVAL): the file is read again buffered and loads."""
    key = io_worker.key_of(4100)
    _store(direct_root, [key])
    native.fault("cachestat", errno.EAGAIN, times=-1)
    native.fault("read", errno.EINVAL, times=1)
    before = _cold_reads()
    outs, bufs = _load(direct_root, [key], 0, 0, opts=COLD)
    assert outs[0].status is LoadStatus.LOADED, outs[0]
    assert bytes(bufs[0][:N]) == io_worker.payload_of(key, 0)
    assert _cold_reads() - before == 1
    assert native.fault_count("read") >= 2  # the refused direct read, then buffered


@needs_native
def test_a_kernel_without_cachestat_reads_buffered(direct_root: Path, small_cold_min: None) -> None:
    keys = [io_worker.key_of(4200 + i) for i in range(2)]
    _store(direct_root, keys)
    native.fault("cachestat", errno.ENOSYS, times=-1)
    before = _cold_reads()
    outs, bufs = _load(direct_root, keys, 0, 0, opts=COLD)
    assert [o.status for o in outs] == [LoadStatus.LOADED] * 2
    assert _cold_reads() == before
    assert native.fault_count("cachestat") == 2
    assert all(bytes(b[:N]) == io_worker.payload_of(k, 0) for k, b in zip(keys, bufs, strict=True))


@needs_native
def test_only_cold_mode_asks_the_page_cache(direct_root: Path, small_cold_min: None) -> None:
    """Buffered and all-direct loads make no cachestat call (no cost where
    the mode is off); an unaligned buffer is never read direct."""
    keys = [io_worker.key_of(4300 + i) for i in range(2)]
    _store(direct_root, keys)
    native.fault("cachestat", errno.EAGAIN, times=-1)
    for opts in (IOOptions(), IOOptions(o_direct=True)):
        outs, _ = _load(direct_root, keys, 0, 0, opts=opts)
        assert [o.status for o in outs] == [LoadStatus.LOADED] * 2
    assert native.fault_count("cachestat") == 0
    before = _cold_reads()
    raw = aligned_buffer(N + 4096 + 64)
    buf = raw[64 : 64 + N]  # 64 bytes past a page: refused by O_DIRECT
    out = native.load_batch(str(direct_root), [str(io_worker.path_of(direct_root, keys[0]))],
                            [keys[0]], [buf], io_worker.DIGEST, COLD)[0]
    assert out.status is LoadStatus.LOADED and bytes(buf) == io_worker.payload_of(keys[0], 0)
    assert _cold_reads() == before


@needs_native
def test_direct_reads_grow_the_fan_out(direct_root: Path, small_cold_min: None) -> None:
    """A cold file read direct always waits for the device: like a read that
    would block, it starts one more helper (here all 3 the call may have,
    none eagerly)."""
    keys = [io_worker.key_of(4400 + i) for i in range(8)]
    _store(direct_root, keys)
    native.fault("cachestat", errno.EAGAIN, times=-1)
    started = int(native._require().fan_started())
    outs, bufs = _load(direct_root, keys, 3, 0, opts=COLD)
    assert [o.status for o in outs] == [LoadStatus.LOADED] * 8
    assert int(native._require().fan_started()) - started == 3
    assert all(bytes(b[:N]) == io_worker.payload_of(k, 0) for k, b in zip(keys, bufs, strict=True))


# ------------------------------------------------------ config, both paths
def test_cold_mode_reaches_the_io_options(tmp_path: Path) -> None:
    if not _direct_ok(tmp_path):
        pytest.skip("tmp_path refuses O_DIRECT")
    cfg = make_config(tmp_path, tier={"o_direct": "cold"})
    caps = RootCapabilities.probe(tmp_path, "cold")
    opts = IOOptions.from_tier(cfg.tier, caps)
    assert (opts.o_direct, opts.o_direct_cold) == (False, True)
    assert caps.o_direct_mode == "cold"
    auto = IOOptions.from_tier(make_config(tmp_path, tier={"o_direct": "auto"}).tier, caps)
    assert (auto.o_direct, auto.o_direct_cold) == (True, False)


def test_a_refusal_leaves_cold_mode_buffered_without_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _refuse_direct_open(monkeypatch)
    with caplog.at_level(logging.INFO, logger="fstier.io"):
        caps = RootCapabilities.probe(tmp_path, "cold")
    opts = IOOptions.from_tier(make_config(tmp_path, tier={"o_direct": "cold"}).tier, caps)
    assert (opts.o_direct, opts.o_direct_cold) == (False, False)
    lines = [r for r in caplog.records if "O_DIRECT unavailable" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "cold loads read buffered" in lines[0].getMessage()


def test_a_cold_tier_round_trips_on_either_path(tmp_path: Path) -> None:
    """Through FsTier on the selected I/O path (FSTIER_NATIVE): stored,
    dropped from the page cache, loaded back byte-exact."""
    from manager_support import keys as make_keys
    from manager_support import load, open_tier, store

    root = tmp_path / "root"
    with open_tier(root, o_direct="cold") as tier:
        ks = make_keys(0, 4)
        assert store(tier, "s", ks).keys_completed == len(ks)
        for p in root.rglob("*.bin"):
            _drop(p)
        res: Any = load(tier, "l", ks, first_slot=8)  # checks every loaded byte
        assert res.keys_completed == len(ks)
