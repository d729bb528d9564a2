"""Rows 10-15 of the fault matrix, injected through the ``fsops.FS`` seam and,
where this machine allows mounting, on real filesystems: ENOSPC on a small
tmpfs, O_DIRECT refused by a ramfs mount.

Every injected fault must give a failed store (or an ERROR/MISSING load)
with the errno as cause, no temp file, no leaked fd, nothing short or wrong
published, and a normal store/load once the fault clears.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fstier.errors import DirectIOUnsupportedError
from fstier.io import _blockio, capabilities, fsops, iotypes
from fstier.io.blockcheck import verify_file
from fstier.io.blockstore import NamespaceDirs
from fstier.io.capabilities import RootCapabilities
from fstier.io.iotypes import IOOptions

from ._support import (
    FaultyOps,
    Tier,
    block_files,
    fd_count,
    key_for,
    oserror,
    payload_for,
    raise_errno,
    temp_files,
)

FAULTS_INJECTED = {"count": 0}


@pytest.fixture
def ops(monkeypatch: pytest.MonkeyPatch) -> FaultyOps:
    faulty = FaultyOps()
    monkeypatch.setattr(fsops, "FS", faulty)
    return faulty


@pytest.fixture
def tier(tmp_path: Path) -> Tier:
    return Tier.open(tmp_path / "root")


def _assert_clean_failure(tier: Tier, key: Any, out: Any, cause: str, fds: int) -> None:
    FAULTS_INJECTED["count"] += 1
    assert out.status == "FAILED", out
    assert out.cause == cause, out
    assert not tier.path(key).exists(), "a failed store published a file"
    assert temp_files(tier.mapper.root) == [], "a failed store left its temp file"
    assert fd_count() <= fds, "a failed store leaked a file descriptor"


def _assert_recovers(tier: Tier, ops: FaultyOps, i: int) -> None:
    ops.hooks.clear()
    key = key_for(i)
    assert tier.store(key).ok
    out, got = tier.load(key)
    assert out.status == "LOADED" and got == payload_for(key, tier.payload_len)


# ------------------------------------------------------------------ mounts
@contextlib.contextmanager
def _mounted(fstype: str, where: Path, options: str = "") -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", fstype, *(["-o", options] if options else []), fstype, str(where)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount ({exc}); the real-filesystem variant needs root and mount(8)")
    if res.returncode != 0:
        pytest.skip(f"mount -t {fstype} not permitted here: {res.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=20)


# ------------------------------------------------------------------ row 10
def test_enospc_injected(tier: Tier, ops: FaultyOps) -> None:
    old = key_for(1)
    assert tier.store(old).status == "STORED"
    fds = fd_count()
    def close_then_fail(real: Any, fd: int) -> None:
        real(fd)  # Linux releases the fd even when close reports an error
        raise oserror(errno.ENOSPC)

    for step in ("pwritev", "fsync", "close"):
        ops.hooks = {step: close_then_fail if step == "close" else raise_errno(errno.ENOSPC)}
        store_tier = Tier(tier.mapper, IOOptions(fsync="file"))
        out = store_tier.store(key_for(2))
        _assert_clean_failure(tier, key_for(2), out, "ENOSPC", fds)
    ops.hooks.clear()
    out, got = tier.load(old)
    assert out.status == "LOADED" and got == payload_for(old, tier.payload_len)
    _assert_recovers(tier, ops, 2)


def test_enospc_real_small_tmpfs(tmp_path: Path) -> None:
    with _mounted("tmpfs", tmp_path / "small", "size=256k") as mnt:
        tier = Tier.open(mnt / "root")
        stored, failed = [], None
        fds = fd_count()
        for i in range(64):  # 64 x 8 KiB > 256 KiB
            out = tier.store(key_for(i))
            if out.status == "FAILED":
                failed = (i, out)
                break
            stored.append(key_for(i))
        assert failed is not None, "a 256 KiB tmpfs took 512 KiB of blocks"
        i, out = failed
        _assert_clean_failure(tier, key_for(i), out, "ENOSPC", fds)
        for k in stored:
            got_out, got = tier.load(k)
            assert got_out.status == "LOADED" and got == payload_for(k, tier.payload_len)
        # Recovery once space is freed (as eviction would).
        for k in stored[:4]:
            tier.path(k).unlink()
        assert tier.store(key_for(i)).status == "STORED"
        assert verify_file(tier.path(key_for(i))).ok


# ------------------------------------------------------------------ row 11
def test_short_writes_complete(tier: Tier, ops: FaultyOps) -> None:
    sizes = iter([1, 7, 100, 4095, 1, 513, 3000] * 100)

    def short(real: Any, fd: int, bufs: Any, offset: int) -> int:
        FAULTS_INJECTED["count"] += 1
        first = memoryview(bufs[0])[: next(sizes)]
        return int(real(fd, [first], offset))

    ops.hooks["pwritev"] = short
    for i in range(5):
        key = key_for(i)
        assert tier.store(key).status == "STORED"
        assert verify_file(tier.path(key)).ok
        out, got = tier.load(key)
        assert out.status == "LOADED" and got == payload_for(key, tier.payload_len)
    assert ops.calls["pwritev"] > 10


def test_zero_byte_write_fails_cleanly(tier: Tier, ops: FaultyOps) -> None:
    fds = fd_count()
    ops.hooks["pwritev"] = lambda real, fd, bufs, off: 0
    _assert_clean_failure(tier, key_for(0), tier.store(key_for(0)), "EIO", fds)
    _assert_recovers(tier, ops, 0)


# ------------------------------------------------------------------ row 12
@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC, errno.EDQUOT])
def test_failed_fsync_is_never_retried(tier: Tier, ops: FaultyOps, code: int) -> None:
    fds = fd_count()
    ops.hooks["fsync"] = raise_errno(code)
    t = Tier(tier.mapper, IOOptions(fsync="file+dir"))
    out = t.store(key_for(0))
    _assert_clean_failure(tier, key_for(0), out, errno.errorcode[code], fds)
    assert ops.calls["fsync"] == 1, "fsync was retried after a failure"
    _assert_recovers(tier, ops, 0)


@pytest.mark.parametrize("named", [False, True], ids=["tmpfile", "named"])
@pytest.mark.parametrize("code", [errno.EXDEV, errno.EIO, errno.EACCES])
def test_rename_error_publishes_nothing(
    tier: Tier, ops: FaultyOps, code: int, named: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Publication is linkat (O_TMPFILE) or renameat (named temps): fail both.
    if named:
        tier.opts.capabilities.refuse_tmpfile()
    fds = fd_count()
    ops.hooks["link_at"] = ops.hooks["replace_at"] = raise_errno(code)
    _assert_clean_failure(tier, key_for(0), tier.store(key_for(0)), errno.errorcode[code], fds)
    _assert_recovers(tier, ops, 0)


def test_directory_fsync_failure_is_not_acknowledged(tier: Tier, ops: FaultyOps) -> None:
    """After the rename the file is complete but not durable: the store is
    FAILED (never acknowledged); what is visible still verifies."""
    calls = {"n": 0}

    def fsync(real: Any, fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the directory fsync
            raise oserror(errno.EIO)
        real(fd)

    ops.hooks["fsync"] = fsync
    FAULTS_INJECTED["count"] += 1
    out = Tier(tier.mapper, IOOptions(fsync="file+dir")).store(key_for(0))
    assert out.status == "FAILED" and out.cause == "EIO"
    assert temp_files(tier.mapper.root) == []
    if tier.path(key_for(0)).exists():
        assert verify_file(tier.path(key_for(0))).ok


# ------------------------------------------------------------------ row 13
@pytest.mark.parametrize("named", [False, True], ids=["tmpfile", "named"])
def test_rename_reports_error_but_happened(
    tier: Tier, ops: FaultyOps, named: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def publish(real: Any, *args: Any) -> None:
        real(*args)
        raise oserror(errno.EIO)

    if named:
        tier.opts.capabilities.refuse_tmpfile()
    ops.hooks["link_at"] = ops.hooks["replace_at"] = publish
    fds = fd_count()
    key = key_for(0)
    FAULTS_INJECTED["count"] += 1
    out = tier.store(key)
    assert out.status == "FAILED" and out.cause == "EIO"
    assert fd_count() <= fds and temp_files(tier.mapper.root) == []
    # The file did land: it is complete, loads right, and a retry is a no-op.
    assert verify_file(tier.path(key)).ok
    got_out, got = tier.load(key)
    assert got_out.status == "LOADED" and got == payload_for(key, tier.payload_len)
    assert tier.store(key).status == "SKIPPED"


# ------------------------------------------------------------------ row 14
@pytest.mark.parametrize("code", [errno.ESTALE, errno.EIO, errno.EINTR])
def test_transient_read_errors_leave_the_file(tier: Tier, ops: FaultyOps, code: int) -> None:
    key = key_for(0)
    assert tier.store(key).status == "STORED"
    fds = fd_count()
    ops.hooks["preadv"] = raise_errno(code)
    FAULTS_INJECTED["count"] += 1
    out, _ = tier.load(key)
    # ESTALE at read: the file another host replaced or evicted after our
    # open; a miss, not a device error (issue 25). The file is left either way.
    expected = "MISSING" if code == errno.ESTALE else "ERROR"
    assert out.status == expected and out.cause == errno.errorcode[code]
    assert tier.path(key).exists() and fd_count() <= fds
    ops.hooks.clear()
    out, got = tier.load(key)
    assert out.status == "LOADED" and got == payload_for(key, tier.payload_len)


def test_enoent_and_estale_on_open_are_misses_or_errors(tier: Tier, ops: FaultyOps) -> None:
    key = key_for(0)
    assert tier.store(key).status == "STORED"
    ops.hooks["open"] = raise_errno(errno.ENOENT)
    assert tier.load(key)[0].status == "MISSING"
    ops.hooks["open"] = raise_errno(errno.ESTALE)
    assert tier.load(key)[0].status == "ERROR"
    FAULTS_INJECTED["count"] += 2
    assert tier.path(key).exists()


def test_file_replaced_between_open_and_read(tier: Tier, ops: FaultyOps) -> None:
    """Validation goes through the open fd: the old inode is read whole. A
    corrupt old file is reported CORRUPT, but the good file renamed over it
    meanwhile is not removed (inode check before unlink)."""
    key = key_for(0)
    assert tier.store(key).status == "STORED"
    path = tier.path(key)
    good = path.read_bytes()
    path.write_bytes(bytes(len(good)))  # same size, all zeros: corrupt

    def fstat(real: Any, fd: int) -> os.stat_result:
        st = real(fd)
        tmp = path.with_name(".swap")
        tmp.write_bytes(good)
        os.replace(tmp, path)
        return st

    ops.hooks["fstat"] = fstat
    FAULTS_INJECTED["count"] += 1
    out, _ = tier.load(key)
    assert out.status == "CORRUPT" and not out.removed
    ops.hooks.clear()
    out, got = tier.load(key)
    assert out.status == "LOADED" and got == payload_for(key, tier.payload_len)

    # Unlinked (evicted) between open and read: the open fd still reads it.
    def fstat_then_unlink(real: Any, fd: int) -> os.stat_result:
        st = real(fd)
        path.unlink()
        return st

    ops.hooks["fstat"] = fstat_then_unlink
    out, got = tier.load(key)
    assert out.status == "LOADED" and got == payload_for(key, tier.payload_len)


# ------------------------------------------------------------------ row 15
def test_o_direct_refused_by_real_ramfs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with _mounted("ramfs", tmp_path / "ram") as mnt:
        root = mnt / "root"
        root.mkdir()
        try:
            probe = os.open(root / "p", os.O_CREAT | os.O_RDWR | fsops.O_DIRECT, 0o600)
        except OSError as exc:
            assert exc.errno == errno.EINVAL
        else:
            os.close(probe)
            pytest.skip("this kernel's ramfs accepts O_DIRECT; no refusing filesystem to test")
        with caplog.at_level(logging.WARNING, logger="fstier.io"):
            caps = RootCapabilities.probe(root, "auto")  # once per root
            first = caps.o_direct
        assert not first.enabled
        assert "refused" in first.reason
        warnings = [r for r in caplog.records if "O_DIRECT unavailable" in r.getMessage()]
        assert len(warnings) == 1, "the fallback must warn exactly once"
        with pytest.raises(DirectIOUnsupportedError, match="o_direct: on"):
            capabilities.probe_o_direct(root, "on")
        tier = Tier.open(root, o_direct=first.enabled)
        for i in range(4):
            key = key_for(i)
            assert tier.store(key).status == "STORED"
            out, got = tier.load(key)
            assert out.status == "LOADED" and got == payload_for(key, tier.payload_len)
        # A tier that claims O_DIRECT on this fs still stores: EINVAL -> one buffered retry.
        forced = Tier(tier.mapper, IOOptions(o_direct=True))
        assert forced.store(key_for(9)).status == "STORED"
        assert forced.load(key_for(9))[0].status == "LOADED"


def test_o_direct_refusal_leaves_no_temp_file(tmp_path: Path) -> None:
    with _mounted("ramfs", tmp_path / "ram") as mnt:
        root = mnt / "root"
        root.mkdir()
        assert not capabilities.probe_o_direct(root, "auto").enabled
        tier = Tier.open(root)
        forced = Tier(tier.mapper, IOOptions(o_direct=True))
        assert forced.store(key_for(9)).status == "STORED"
        assert temp_files(root) == []


def test_tmpfs_o_direct_probe_agrees_with_kernel(tmp_path: Path) -> None:
    """/dev/shm-like tmpfs accepts O_DIRECT on kernels >= 6.6 and refuses it
    before; the probe must agree with what the kernel does either way."""
    with _mounted("tmpfs", tmp_path / "tmpfs", "size=4m") as mnt:
        try:
            fd = os.open(mnt / "p", os.O_CREAT | os.O_RDWR | fsops.O_DIRECT, 0o600)
            os.close(fd)
            accepts = True
        except OSError:
            accepts = False
        assert capabilities.probe_o_direct(mnt, "auto").enabled == accepts


def test_o_direct_write_refused_after_open_falls_back(tier: Tier, ops: FaultyOps) -> None:
    """Some filesystems accept the O_DIRECT open and refuse the write."""
    direct_fds: set[int] = set()

    def open_(real: Any, path: Any, flags: int, mode: int = 0o600) -> int:
        fd = int(real(path, flags & ~fsops.O_DIRECT, mode))
        if flags & fsops.O_DIRECT:
            direct_fds.add(fd)
        else:
            direct_fds.discard(fd)
        return fd

    def pwritev(real: Any, fd: int, bufs: Any, off: int) -> int:
        if fd in direct_fds:
            FAULTS_INJECTED["count"] += 1
            raise oserror(errno.EINVAL)
        return int(real(fd, bufs, off))

    ops.hooks.update(open=open_, pwritev=pwritev)
    t = Tier(tier.mapper, IOOptions(o_direct=True))
    key = key_for(0)
    assert t.store(key).status == "STORED"
    assert temp_files(tier.mapper.root) == [] and verify_file(t.path(key)).ok


def test_unaligned_buffers_use_buffered_io(tier: Tier, ops: FaultyOps) -> None:
    """An unaligned payload never reaches an O_DIRECT fd (EINVAL otherwise)."""
    seen: list[int] = []

    def open_(real: Any, path: Any, flags: int, mode: int = 0o600) -> int:
        seen.append(flags & fsops.O_DIRECT)
        return int(real(path, flags & ~fsops.O_DIRECT, mode))

    ops.hooks["open"] = open_
    t = Tier(tier.mapper, IOOptions(o_direct=True))
    key = key_for(0)
    data = payload_for(key, t.payload_len)
    from fstier.io.blockfile import header_for_payload

    path = t.path(key)
    NamespaceDirs(t.mapper).ensure(path)
    unaligned = memoryview(bytearray(b"x" + data))[1:]
    header = header_for_payload(key, t.mapper.digest_bytes, data, 1, len(data))
    assert _blockio.store_block(iotypes.StoreRequest(path, header, unaligned), t.opts).status == "STORED"
    assert seen and not any(seen)
    assert verify_file(path).ok and len(block_files(tier.mapper.root)) == 1
