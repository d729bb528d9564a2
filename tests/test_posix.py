"""posix store/load on real files: O_DIRECT on and off, the corruption matrix,
injected faults through the ``fsops.FS`` seam, and real concurrent processes."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fstier.errors import DirectIOUnsupportedError
from fstier.io import _blockio, fsops
from fstier.io._blockio import load_block, store_block
from fstier.io.blockcheck import read_header, verify_file
from fstier.io.blockfile import HEADER_SIZE, header_for_payload, padded_len
from fstier.io.capabilities import RootCapabilities, probe_o_direct
from fstier.io.fsops import FS, aligned_buffer, buffer_address, is_temp_name
from fstier.io.iotypes import IOOptions, LoadRequest, LoadStatus, StoreRequest, StoreStatus
from fstier.keys import BlockKey

sys.path.insert(0, str(Path(__file__).parent))
import io_worker  # noqa: E402
from conftest import make_config  # noqa: E402

WORKER = Path(io_worker.__file__)
DIGEST = io_worker.DIGEST
N = io_worker.PAYLOAD  # deliberately not a multiple of 4096


def _direct_ok(path: Path) -> bool:
    return probe_o_direct(path, "auto").enabled


@pytest.fixture(params=["buffered", "direct"])
def opts(request: pytest.FixtureRequest, tmp_path: Path) -> IOOptions:
    if request.param == "direct":
        if not _direct_ok(tmp_path):
            pytest.skip("tmp_path refuses O_DIRECT")
        return IOOptions(o_direct=True, fsync="file+dir")
    return IOOptions(o_direct=False, fsync="none")


def temps(root: Path) -> list[str]:
    return [p.name for p in root.rglob("*") if is_temp_name(p.name)]


def store(
    root: Path, key: BlockKey, opts: IOOptions, version: int = 0, slot: memoryview | None = None
):
    data = io_worker.payload_of(key, version)
    if slot is None:
        slot = aligned_buffer(padded_len(N))
    slot[:N] = data
    header = header_for_payload(key, DIGEST, data, 1, N)
    return store_block(StoreRequest(io_worker.path_of(root, key), header, slot), opts)


def load(root: Path, key: BlockKey, opts: IOOptions, buf: memoryview | None = None, n: int = N):
    if buf is None:
        buf = aligned_buffer(padded_len(N))
    out = load_block(LoadRequest(io_worker.path_of(root, key), buf, key, DIGEST, n), opts)
    return out, buf


K1, K2 = io_worker.key_of(1), io_worker.key_of(2)


# ------------------------------------------------------------------ basics
def test_round_trip(tmp_path: Path, opts: IOOptions) -> None:
    out = store(tmp_path, K1, opts, version=3)
    assert out.status is StoreStatus.STORED and out.nbytes == HEADER_SIZE + padded_len(N)
    path = io_worker.path_of(tmp_path, K1)
    assert path.stat().st_size == HEADER_SIZE + padded_len(N)
    assert path.read_bytes()[HEADER_SIZE + N :] == bytes(padded_len(N) - N)  # zero padding
    assert path.stat().st_mode & 0o777 == 0o644 & ~_umask()
    res, buf = load(tmp_path, K1, opts)
    assert res.status is LoadStatus.LOADED and res.nbytes == N
    assert bytes(buf[:N]) == io_worker.payload_of(K1, 3)
    assert read_header(path).key == K1
    assert verify_file(path, True, key=K1, namespace_digest=DIGEST).ok
    assert temps(tmp_path) == []


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_existing_file_is_skipped(tmp_path: Path, opts: IOOptions) -> None:
    assert store(tmp_path, K1, opts, version=1).status is StoreStatus.STORED
    assert store(tmp_path, K1, opts, version=2).status is StoreStatus.SKIPPED
    res, buf = load(tmp_path, K1, opts)
    assert res.ok and bytes(buf[:N]) == io_worker.payload_of(K1, 1)


def test_unaligned_buffers_fall_back_to_buffered(tmp_path: Path) -> None:
    if not _direct_ok(tmp_path):
        pytest.skip("tmp_path refuses O_DIRECT")
    opts = IOOptions(o_direct=True)
    raw = bytearray(padded_len(N) + 1)
    view = memoryview(raw)[1:]  # odd address: O_DIRECT would EINVAL
    assert buffer_address(view) % 4096 != 0
    data = io_worker.payload_of(K1, 9)
    view[:N] = data
    out = store_block(
        StoreRequest(
            io_worker.path_of(tmp_path, K1), header_for_payload(K1, DIGEST, data, 1, N), view
        ),
        opts,
    )
    assert out.status is StoreStatus.STORED
    # Exact-length bytes (read-only, no room for padding) also store.
    out = store_block(
        StoreRequest(
            io_worker.path_of(tmp_path, K2),
            header_for_payload(K2, DIGEST, data, 1, N),
            memoryview(data),
        ),
        opts,
    )
    assert out.status is StoreStatus.STORED
    target = bytearray(N)  # exactly payload_len, unaligned: read via a tail scratch buffer
    res, _ = load(tmp_path, K1, opts, memoryview(target))
    assert res.ok and bytes(target) == data


def test_bad_requests_raise_value_error(tmp_path: Path) -> None:
    data = bytes(N)
    header = header_for_payload(K1, DIGEST, data, 1, N)
    with pytest.raises(ValueError, match="payload holds 10 bytes"):
        store_block(StoreRequest(tmp_path / "x.bin", header, memoryview(data[:10])), IOOptions())
    with pytest.raises(ValueError, match="must be writable"):
        load_block(LoadRequest(tmp_path / "x.bin", memoryview(data), K1, DIGEST, N), IOOptions())


# ------------------------------------------------------------------- probe
def test_probe_real_directory(tmp_path: Path) -> None:
    sup = probe_o_direct(tmp_path, "auto")
    assert sup.alignment in (512, 1024, 2048, 4096)
    caps = RootCapabilities.probe(tmp_path, "auto")  # kept with the root, not the process
    assert caps.o_direct == sup and caps.tmpfile
    assert probe_o_direct(tmp_path, "off").enabled is False
    assert os.listdir(tmp_path) == []  # the probe file is gone
    with pytest.raises(ValueError, match="o_direct mode"):
        probe_o_direct(tmp_path, "maybe")


def _refuse_direct_open(monkeypatch: pytest.MonkeyPatch) -> None:
    real = FS.open

    def fake(path: Any, flags: int, mode: int = 0o600) -> int:
        if flags & fsops.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(path, flags, mode)

    monkeypatch.setattr(FS, "open", fake)


def _refuse_direct_write(monkeypatch: pytest.MonkeyPatch) -> None:
    # The open succeeds, the first aligned write fails (some NFS / FUSE).
    def fake(fd: int, bufs: Any, offset: int) -> int:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(FS, "pwritev", fake)


@pytest.mark.parametrize("refuse", [_refuse_direct_open, _refuse_direct_write])
def test_probe_refusal_auto_warns_once_per_root_and_on_raises(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    refuse: Callable[[pytest.MonkeyPatch], None],
) -> None:
    refuse(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="fstier.io"):
        caps = RootCapabilities.probe(tmp_path, "auto")  # a root is probed once
        first = caps.o_direct
        assert IOOptions.from_tier(make_config(tmp_path).tier, caps).o_direct is False
    assert not first.enabled
    assert "EINVAL" in first.reason
    assert len([r for r in caplog.records if "O_DIRECT unavailable" in r.getMessage()]) == 1
    with pytest.raises(DirectIOUnsupportedError, match="o_direct: on, but .* refuses O_DIRECT"):
        probe_o_direct(tmp_path, "on")
    assert os.listdir(tmp_path) == []


def test_probe_on_succeeds_where_supported(tmp_path: Path) -> None:
    if not _direct_ok(tmp_path):
        pytest.skip("tmp_path refuses O_DIRECT")
    assert probe_o_direct(tmp_path, "on").enabled


def test_direct_write_einval_after_probe_retries_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not _direct_ok(tmp_path):
        pytest.skip("tmp_path refuses O_DIRECT")
    _refuse_direct_open(monkeypatch)
    out = store(tmp_path, K1, IOOptions(o_direct=True))
    assert out.status is StoreStatus.STORED
    res, _ = load(tmp_path, K1, IOOptions(o_direct=True))
    assert res.ok


# -------------------------------------------------------- corruption matrix
def _truncate(at: int) -> Callable[[Path, Path], None]:
    def f(path: Path, root: Path) -> None:
        os.truncate(path, at)

    f.__name__ = f"truncate_{at}"
    return f


def _flip(offset: int, bit: int) -> Callable[[Path, Path], None]:
    def f(path: Path, root: Path) -> None:
        with open(path, "r+b") as fh:
            fh.seek(offset)
            b = fh.read(1)[0]
            fh.seek(offset)
            fh.write(bytes([b ^ (1 << bit)]))

    f.__name__ = f"flip_{offset}_{bit}"
    return f


def _zeros(path: Path, root: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


def _other_key(path: Path, root: Path) -> None:
    shutil.copyfile(io_worker.path_of(root, K2), path)


def _grow(path: Path, root: Path) -> None:
    with open(path, "ab") as fh:
        fh.write(bytes(4096))


SIZE = HEADER_SIZE + padded_len(N)
CORRUPTIONS = [
    (_truncate(0), "bad_size"),
    (_truncate(100), "bad_size"),
    (_truncate(HEADER_SIZE), "bad_size"),  # header only
    (_truncate(HEADER_SIZE + 4096), "bad_size"),
    (_truncate(SIZE - 1), "bad_size"),
    (_grow, "bad_size"),
    (_flip(0, 0), "bad_magic"),
    (_flip(8, 1), "unsupported_version"),
    (_flip(33, 3), "header_checksum"),
    (_flip(80, 0), "header_checksum"),
    (_flip(HEADER_SIZE, 0), "payload_checksum"),
    (_flip(HEADER_SIZE + N - 1, 7), "payload_checksum"),
    (_zeros, "bad_magic"),
    (_other_key, "wrong_key"),
]


@pytest.mark.parametrize("damage, reason", CORRUPTIONS, ids=[c[0].__name__ for c in CORRUPTIONS])
def test_corruption_is_a_miss_and_removed(
    tmp_path: Path, opts: IOOptions, damage: Any, reason: str
) -> None:
    store(tmp_path, K1, opts)
    store(tmp_path, K2, opts)
    path = io_worker.path_of(tmp_path, K1)
    damage(path, tmp_path)
    res, _ = load(tmp_path, K1, opts)
    assert res.status is LoadStatus.CORRUPT
    assert res.cause == reason
    assert res.removed and not path.exists()
    assert load(tmp_path, K2, opts)[0].ok  # the neighbour is untouched
    # Fail closed, then recover: the next store rewrites the key.
    assert store(tmp_path, K1, opts).status is StoreStatus.STORED
    assert load(tmp_path, K1, opts)[0].ok


def test_padding_bytes_are_not_checked_but_size_is(tmp_path: Path, opts: IOOptions) -> None:
    store(tmp_path, K1, opts)
    # Garbage in the zero padding does not change the payload: still loads.
    _flip(HEADER_SIZE + N + 5, 0)(io_worker.path_of(tmp_path, K1), tmp_path)
    assert load(tmp_path, K1, opts)[0].ok


def test_wrong_namespace_and_wrong_expected_length(tmp_path: Path, opts: IOOptions) -> None:
    store(tmp_path, K1, opts)
    buf = aligned_buffer(padded_len(N))
    path = io_worker.path_of(tmp_path, K1)
    res = load_block(LoadRequest(path, buf, K1, b"\x00" * 8, N), opts)
    assert (res.status, res.cause, res.removed) == (LoadStatus.CORRUPT, "wrong_namespace", True)
    store(tmp_path, K1, opts)
    # A file written at another world size has another payload length: a miss.
    res = load_block(LoadRequest(path, aligned_buffer(2 * N), K1, DIGEST, 2 * N), opts)
    assert (res.status, res.cause) == (LoadStatus.CORRUPT, "bad_size")
    store(tmp_path, K1, opts)
    # Same padded size, different payload_len: caught by the length check.
    res = load_block(LoadRequest(path, buf, K1, DIGEST, N - 1), opts)
    assert (res.status, res.cause) == (LoadStatus.CORRUPT, "wrong_length")


def test_checksum_off_skips_payload_check(tmp_path: Path) -> None:
    opts = IOOptions(checksum=False)
    store(tmp_path, K1, opts)
    _flip(HEADER_SIZE + 10, 0)(io_worker.path_of(tmp_path, K1), tmp_path)
    assert load(tmp_path, K1, opts)[0].ok
    assert load(tmp_path, K1, IOOptions(checksum=True))[0].cause == "payload_checksum"


def test_missing_is_a_miss_not_corrupt(tmp_path: Path, opts: IOOptions) -> None:
    res, _ = load(tmp_path, K1, opts)
    assert (res.status, res.cause, res.removed) == (LoadStatus.MISSING, "ENOENT", False)


def test_corrupt_file_replaced_concurrently_is_not_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opts = IOOptions()
    store(tmp_path, K1, opts)
    path = io_worker.path_of(tmp_path, K1)
    good = tmp_path / "good"
    shutil.copyfile(path, good)
    _flip(HEADER_SIZE, 0)(path, tmp_path)
    real_stat_at = FS.stat_at

    def racing_stat_at(dir_fd: int, name: str) -> os.stat_result:
        if name == path.name and good.exists():
            os.replace(good, path)  # a concurrent writer publishes a good file
        return real_stat_at(dir_fd, name)

    monkeypatch.setattr(FS, "stat_at", racing_stat_at)
    res, _ = load(tmp_path, K1, opts)
    assert res.status is LoadStatus.CORRUPT and not res.removed
    monkeypatch.undo()
    assert load(tmp_path, K1, opts)[0].ok


def test_symlink_at_final_path(tmp_path: Path, opts: IOOptions) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    store(outside, K1, opts)
    target = io_worker.path_of(outside, K1)
    before = target.read_bytes()
    link = io_worker.path_of(root, K1)
    link.symlink_to(target)
    res, _ = load(root, K1, opts)
    assert (res.status, res.cause, res.removed) == (LoadStatus.CORRUPT, "symlink", True)
    link.symlink_to(target)
    assert store(root, K1, opts, version=5).status is StoreStatus.STORED
    assert not link.is_symlink() and target.read_bytes() == before  # never written through


# ------------------------------------------------------- injected faults
def _raise(code: int) -> Callable[..., Any]:
    def f(*args: Any, **kw: Any) -> Any:
        raise OSError(code, os.strerror(code))

    return f


@pytest.mark.parametrize(
    "method, code",
    [
        ("pwritev", errno.ENOSPC),
        ("pwritev", errno.EIO),
        ("fsync", errno.EIO),
        ("open", errno.EMFILE),
        ("open", errno.EACCES),
        ("link_at", errno.EXDEV),
        ("replace_at", errno.EXDEV),
        ("close", errno.EIO),
    ],
)
def test_store_faults_publish_nothing_and_recover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str, code: int
) -> None:
    # replace_at is the named-temp publication (filesystems without O_TMPFILE).
    caps = RootCapabilities(tmpfile=method != "replace_at", root=tmp_path)
    opts = IOOptions(fsync="file+dir", capabilities=caps)
    store(tmp_path, K2, opts)
    old = io_worker.path_of(tmp_path, K2).read_bytes()
    fds_before = len(os.listdir("/proc/self/fd"))
    real_close = FS.close
    if method == "close":

        def bad_close(fd: int) -> None:
            real_close(fd)
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(FS, "close", bad_close)
    else:
        monkeypatch.setattr(FS, method, _raise(code))
    out = store(tmp_path, K1, opts)
    assert out.status is StoreStatus.FAILED and out.cause == errno.errorcode[code]
    assert not io_worker.path_of(tmp_path, K1).exists()
    assert temps(tmp_path) == []
    monkeypatch.undo()
    assert len(os.listdir("/proc/self/fd")) == fds_before  # no leaked fd
    assert io_worker.path_of(tmp_path, K2).read_bytes() == old  # old blocks intact
    assert load(tmp_path, K2, opts)[0].ok
    assert store(tmp_path, K1, opts).status is StoreStatus.STORED  # recovery
    assert load(tmp_path, K1, opts)[0].ok


def test_failed_fsync_is_never_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def bad_fsync(fd: int) -> None:
        calls.append(fd)
        raise OSError(errno.EIO, "fsync failed")

    monkeypatch.setattr(FS, "fsync", bad_fsync)
    out = store(tmp_path, K1, IOOptions(fsync="file", o_direct=_direct_ok(tmp_path)))
    assert out.status is StoreStatus.FAILED and out.cause == "EIO" and "fsync" in out.detail
    assert len(calls) == 1 and temps(tmp_path) == []


def test_short_writes_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = FS.pwritev
    sizes: list[int] = []

    def short(fd: int, bufs: Any, offset: int) -> int:
        # Write at most 1000 bytes per call (buffered, so odd sizes are fine).
        first = memoryview(bufs[0])[:1000]
        n = real(fd, [first], offset)
        sizes.append(n)
        return n

    monkeypatch.setattr(FS, "pwritev", short)
    assert store(tmp_path, K1, IOOptions()).status is StoreStatus.STORED
    assert len(sizes) > 10
    monkeypatch.undo()
    assert load(tmp_path, K1, IOOptions())[0].ok


def test_zero_byte_write_fails_instead_of_spinning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FS, "pwritev", lambda fd, bufs, off: 0)
    out = store(tmp_path, K1, IOOptions())
    assert out.status is StoreStatus.FAILED and out.cause == "EIO" and temps(tmp_path) == []


@pytest.mark.parametrize("method", ["link_at", "replace_at"])
def test_rename_error_after_rename_happened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    real = getattr(FS, method)

    def publish_then_fail(*args: Any) -> None:
        real(*args)
        raise OSError(errno.EIO, "NFS reply lost")

    caps = RootCapabilities(tmpfile=method != "replace_at", root=tmp_path)
    monkeypatch.setattr(FS, method, publish_then_fail)
    out = store(tmp_path, K1, IOOptions(capabilities=caps))
    assert out.status is StoreStatus.FAILED and temps(tmp_path) == []
    monkeypatch.undo()
    assert load(tmp_path, K1, IOOptions())[0].ok  # complete file, never torn


@pytest.mark.parametrize(
    "method, code, status",
    [
        ("open", errno.EMFILE, LoadStatus.ERROR),
        ("open", errno.EACCES, LoadStatus.ERROR),
        ("open", errno.ESTALE, LoadStatus.ERROR),
        ("open", errno.ENOENT, LoadStatus.MISSING),
        ("preadv", errno.EIO, LoadStatus.ERROR),
        ("preadv", errno.EINTR, LoadStatus.ERROR),
        ("preadv", errno.ESTALE, LoadStatus.MISSING),  # replaced/evicted after open: a miss
    ],
)
def test_transient_load_errors_leave_the_file(
    tmp_path: Path,
    opts: IOOptions,
    monkeypatch: pytest.MonkeyPatch,
    method: str,
    code: int,
    status: LoadStatus,
) -> None:
    store(tmp_path, K1, opts)
    fds_before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(FS, method, _raise(code))
    res, _ = load(tmp_path, K1, opts)
    assert res.status is status and res.cause == errno.errorcode[code] and not res.removed
    monkeypatch.undo()
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert io_worker.path_of(tmp_path, K1).exists()
    assert load(tmp_path, K1, opts)[0].ok


def test_eacces_real_permissions(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root ignores permission bits; covered by injection above")
    store(tmp_path, K1, IOOptions())
    path = io_worker.path_of(tmp_path, K1)
    path.chmod(0)
    try:
        res, _ = load(tmp_path, K1, IOOptions())
        assert res.status is LoadStatus.ERROR and res.cause == "EACCES" and path.exists()
    finally:
        path.chmod(0o644)


# ----------------------------------------------------- real concurrency
def test_eight_processes_store_the_same_keys(tmp_path: Path) -> None:
    nkeys, rounds = 12, 15
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                "store",
                str(tmp_path),
                str(nkeys),
                str(rounds),
                str(seed),
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(8)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert temps(tmp_path) == []
    for i in range(nkeys):
        key = io_worker.key_of(i)
        path = io_worker.path_of(tmp_path, key)
        if path.exists():  # the last writer may have unlinked and lost no race
            assert verify_file(path, True, key=key, namespace_digest=DIGEST).ok
            res, buf = load(tmp_path, key, IOOptions())
            assert res.ok and bytes(buf[:8]) == key.block_hash[:8]
    assert any(io_worker.path_of(tmp_path, io_worker.key_of(i)).exists() for i in range(nkeys))


def test_reader_racing_replace_sees_complete_file_or_miss(tmp_path: Path, opts: IOOptions) -> None:
    key = io_worker.key_of(7)
    writer = subprocess.Popen(
        [sys.executable, str(WORKER), "replace", str(tmp_path), "2.0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    seen: dict[LoadStatus, int] = {}
    versions: set[int] = set()
    buf = aligned_buffer(padded_len(N))
    stop = threading.Event()
    try:
        while writer.poll() is None and not stop.is_set():
            res, _ = load(tmp_path, key, opts, buf)
            seen[res.status] = seen.get(res.status, 0) + 1
            assert res.status in (LoadStatus.LOADED, LoadStatus.MISSING), res
            if res.ok:
                version = int.from_bytes(bytes(buf[8:16]), "little")
                assert bytes(buf[:N]) == io_worker.payload_of(key, version)
                versions.add(version)
    finally:
        out, _ = writer.communicate(timeout=30)
    assert writer.returncode == 0
    assert seen.get(LoadStatus.LOADED, 0) > 0 and len(versions) > 1, (seen, out)
    assert temps(tmp_path) == []


def test_store_block_at_a_directory_fd(tmp_path: Path, opts: IOOptions) -> None:
    """store_block_at publishes into a directory fd the caller opened; fresh
    (the caller just made the directory) skips the existence check, so a
    second store without it still skips onto the file already there."""
    path = io_worker.path_of(tmp_path, K1)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = io_worker.payload_of(K1, 1)
    slot = aligned_buffer(padded_len(N))
    slot[:N] = data
    header = header_for_payload(K1, DIGEST, data, 1, N)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out = _blockio.store_block_at(dfd, path.name, header, slot, opts, fresh=True)
        assert out.status is StoreStatus.STORED
        assert _blockio.store_block_at(dfd, path.name, header, slot, opts).status is StoreStatus.SKIPPED
        with pytest.raises(ValueError, match="payload holds 10 bytes"):
            _blockio.store_block_at(dfd, path.name, header, slot[:10], opts)
    finally:
        os.close(dfd)
    res, buf = load(tmp_path, K1, opts)
    assert res.ok and bytes(buf[:N]) == data
    assert temps(tmp_path) == []


def test_o_tmpfile_refusal_is_per_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An NFS-like root that refuses O_TMPFILE switches itself to named temps
    and nothing else: a local root in the same process keeps O_TMPFILE (it
    used to be one process-wide switch)."""
    nfs, local = tmp_path / "nfs", tmp_path / "local"
    nfs.mkdir()
    local.mkdir()
    caps_nfs, caps_local = RootCapabilities(root=nfs), RootCapabilities(root=local)
    if not caps_local.tmpfile:
        pytest.skip("this platform has no O_TMPFILE")
    real_openat = FS.openat
    anonymous: list[str] = []

    def openat(dir_fd: int, name: str, flags: int, mode: int = 0o600) -> int:
        where = os.readlink(f"/proc/self/fd/{dir_fd}")
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            if where.startswith(str(nfs)):
                raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
            anonymous.append(where)
        return real_openat(dir_fd, name, flags, mode)

    monkeypatch.setattr(FS, "openat", openat)
    with caplog.at_level(logging.INFO, logger="fstier.io"):
        for i in range(2):
            k = BlockKey(bytes([i]) * 16, 0)
            assert store(nfs, k, IOOptions(capabilities=caps_nfs)).status is StoreStatus.STORED
            assert store(local, k, IOOptions(capabilities=caps_local)).status is StoreStatus.STORED
    assert not caps_nfs.tmpfile and caps_local.tmpfile
    assert len(anonymous) == 2 and all(w.startswith(str(local)) for w in anonymous)
    assert len([r for r in caplog.records if "O_TMPFILE unavailable" in r.getMessage()]) == 1
    assert temps(nfs) == [] and temps(local) == []


def test_enospc_probe_is_retried_not_final(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A probe that cannot write (a full CephFS pool: ENOSPC) found nothing
    about O_DIRECT; it left the root buffered for the tier's life. Now the
    root stays buffered only until a probe runs again from the store path
    (both I/O paths: the tier's stores go through BlockStore.store_many);
    with ``o_direct: on`` the configured O_DIRECT is used, not refused."""
    from manager_support import keys, load, open_tier, store

    import fstier.io.capabilities as capabilities

    if not _direct_ok(tmp_path):
        pytest.skip("tmp_path refuses O_DIRECT")
    monkeypatch.setattr(capabilities, "REPROBE_S", 0.2)
    real = FS.pwritev
    full = {"on": True}

    def fake(fd: int, bufs: Any, offset: int) -> int:
        if full["on"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, bufs, offset)

    monkeypatch.setattr(FS, "pwritev", fake)
    with caplog.at_level(logging.WARNING, logger="fstier.io"):
        found = probe_o_direct(tmp_path, "auto")
        assert (found.enabled, found.definitive) == (False, False) and "ENOSPC" in found.reason
        assert probe_o_direct(tmp_path, "on").enabled  # no refusal: nothing was refused
    assert any("could not be probed" in r.getMessage() for r in caplog.records)
    root = tmp_path / "root"
    with open_tier(root) as tier:
        caps = tier.blocks.options.capabilities
        assert caps is not None and tier.blocks.options.o_direct is False and caps.reprobe_at is not None
        full["on"] = False
        time.sleep(0.25)
        assert store(tier, "s", keys(0, 4)).success
        assert tier.blocks.options.o_direct is True and caps.reprobe_at is None
        assert caps.o_direct.definitive and caps.o_direct.enabled
        assert load(tier, "l", keys(0, 4)).success  # byte-exact (load checks every slot)
    assert not [p for p in root.rglob("*") if ".fstier-odirect-probe" in p.name]


def test_enospc_probe_keeps_retrying_while_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fstier.io.capabilities as capabilities

    monkeypatch.setattr(capabilities, "REPROBE_S", 0.0)

    def fake(fd: int, bufs: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(FS, "pwritev", fake)
    caps = RootCapabilities.probe(tmp_path, "auto")
    assert caps.reprobe_due()
    found = caps.reprobe()
    assert not found.enabled and caps.reprobe_at is not None  # still no finding: retried later
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("native_io", ["auto", "off"])
def test_a_full_filesystem_at_start_decides_nothing_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native_io: str
) -> None:
    """A real 1 MiB tmpfs, full when the tier starts: the O_DIRECT probe meets
    ENOSPC, the root runs buffered, and the probe runs again from the store
    path once ``REPROBE_S`` passed on the tier's clock (a ManualClock here:
    no sleep, no window), at most once per ``REPROBE_S`` while still full;
    once space is freed the root uses O_DIRECT and loads are byte-exact
    (both I/O paths). Before, with the system clock, a tier's clock never
    moved the re-probe."""
    from manager_support import keys, load, open_tier, store

    import fstier.io.capabilities as capabilities
    from fstier.clock import ManualClock

    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        if not _direct_ok(mnt):
            pytest.skip("this kernel's tmpfs refuses O_DIRECT (< 6.6)")
        root, clock = mnt / "root", ManualClock()
        with open_tier(root, clock=clock, native_io=native_io):
            pass  # the namespace is made while there is room
        filler = mnt / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while os.write(fd, b"\0" * 4096) > 0:
                pass
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)
        probes: list[str] = []
        real_probe = capabilities._probe

        def counted(directory: Path) -> Any:
            found = real_probe(directory)
            probes.append(found[0].reason)
            return found

        monkeypatch.setattr(capabilities, "_probe", counted)
        with open_tier(root, clock=clock, native_io=native_io) as tier:
            caps = tier.blocks.options.capabilities
            assert caps is not None and caps.reprobe_at is not None, probes
            assert tier.blocks.options.o_direct is False and "ENOSPC" in caps.o_direct.reason
            assert len(probes) == 1
            assert not store(tier, "full", keys(0, 2)).success  # still full: ENOSPC
            assert len(probes) == 1  # not due yet: no probe
            clock.advance(capabilities.REPROBE_S)
            store(tier, "full2", keys(0, 2))
            store(tier, "full3", keys(0, 2))
            assert len(probes) == 2 and "ENOSPC" in probes[1], probes  # once per REPROBE_S, still no finding
            assert tier.blocks.options.o_direct is False
            filler.unlink()
            assert store(tier, "s", keys(0, 4)).success  # room again, but not due: buffered
            assert len(probes) == 2 and tier.blocks.options.o_direct is False
            clock.advance(capabilities.REPROBE_S)
            assert store(tier, "s2", keys(4, 4)).success
            assert len(probes) == 3 and caps.reprobe_at is None
            assert tier.blocks.options.o_direct is True and caps.o_direct.definitive and caps.o_direct.enabled
            assert load(tier, "l", keys(0, 8)).success  # byte-exact (load checks every slot)
            clock.advance(capabilities.REPROBE_S)
            assert store(tier, "s3", keys(8, 2)).success
            assert len(probes) == 3  # found out: never probed again
        assert not [p for p in root.rglob("*") if ".fstier-odirect-probe" in p.name]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=20)
