"""The native block I/O path (fstier.io._native) against the Python path.

Every behaviour test here runs on BOTH paths through one adapter (``io``
fixture): the same stores, loads, corruptions and injected faults, with the
Python path's faults injected through ``fsops.FS`` and the native path's
through its own seam (``native.fault``). The expectations are written once,
so the paths cannot drift apart. Golden tests pin the checksum (XXH3-64
written from its specification) to the ``xxhash`` package, and the header
the extension writes to ``blockfile.encode_header``.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import xxhash

from fstier.errors import ConfigError
from fstier.io import _blockio, blockcheck, fsops, native
from fstier.io.blockfile import (
    HEADER_SIZE,
    BlockHeader,
    ChecksumKind,
    encode_header,
    header_for_payload,
    padded_len,
)
from fstier.io.capabilities import RootCapabilities, probe_o_direct
from fstier.io.fsops import aligned_buffer, is_temp_name
from fstier.io.iotypes import (
    IOOptions,
    LoadOutcome,
    LoadRequest,
    LoadStatus,
    StoreOutcome,
    StoreRequest,
    StoreStatus,
)
from fstier.keys import BlockKey

sys.path.insert(0, str(Path(__file__).parent))
import io_worker  # noqa: E402
from test_posix import CORRUPTIONS  # noqa: E402

DIGEST = io_worker.DIGEST
N = io_worker.PAYLOAD  # not a multiple of 4096: the bounce page is exercised
K1, K2 = io_worker.key_of(1), io_worker.key_of(2)

needs_native = pytest.mark.skipif(
    native._ext is None, reason=f"native extension not built: {native._import_error}"
)


# ------------------------------------------------------------ checksum golden
LENGTHS = [0, 1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 31, 32, 33, 64, 65, 96, 97, 127, 128, 129,
           200, 239, 240, 241, 255, 256, 511, 1023, 1024, 1025, 2048, 4095, 4096, 4097,
           65536, 65536 + 100, 1 << 20, (1 << 20) + 4160]


@needs_native
@pytest.mark.parametrize("impl", [0, 1, 2], ids=["scalar", "sse2", "avx2"])
def test_xxh3_matches_the_xxhash_package_at_every_length_class(impl: int) -> None:
    if impl > {"scalar": 0, "sse2": 1, "avx2": 2}[native._settings["xxh3_impl"]]:
        pytest.skip("this CPU lacks the instruction set")
    for n in LENGTHS:
        data = bytes((i * 131 + n) & 0xFF for i in range(n))
        assert native._ext.xxh3_64_impl(data, impl) == xxhash.xxh3_64_intdigest(data), n
    rnd = os.urandom(300_000)
    for n in (241, 1000, 4096 + 7, 70_000, 300_000):
        assert native._ext.xxh3_64_impl(rnd[:n], impl) == xxhash.xxh3_64_intdigest(rnd[:n]), n


@needs_native
def test_xxh3_golden_values() -> None:
    # Fixed values of XXH3-64, seed 0 (the format's checksum kind 1).
    assert native.xxh3_64(b"") == 0x2D06800538D394C2
    assert native.xxh3_64(b"a") == xxhash.xxh3_64_intdigest(b"a")
    assert native.xxh3_64(bytes(range(256)) * 16) == xxhash.xxh3_64_intdigest(bytes(range(256)) * 16)


@needs_native
def test_crc32c_known_answer() -> None:
    # The CRC32C check value (RFC 3720 appendix B.4): "123456789" -> 0xE3069283.
    assert native._ext.crc32c(b"123456789", True) == 0xE3069283
    assert native._ext.crc32c(b"123456789", False) == 0xE3069283
    assert native._ext.crc32c(bytes(32), True) == 0x8A9136AA  # RFC 3720 B.4, 32 zero bytes


@needs_native
def test_native_header_is_the_encoders_header(tmp_path: Path) -> None:
    data = io_worker.payload_of(K1, 7)
    buf = memoryview(bytearray(data))
    out = native.store_batch(
        str(tmp_path), [str(tmp_path / "d" / "f.bin")], [K1], [buf], DIGEST, 1, IOOptions(),
        created_ns=1_700_000_000_123_456_789,
    )
    assert out[0].status is StoreStatus.STORED
    want = encode_header(BlockHeader(
        key=K1, namespace_digest=DIGEST, payload_len=N, page_count=1, page_bytes=N,
        checksum_kind=ChecksumKind.XXH3_64, payload_checksum=xxhash.xxh3_64_intdigest(data),
        created_ns=1_700_000_000_123_456_789,
    ))
    raw = (tmp_path / "d" / "f.bin").read_bytes()
    assert raw[:HEADER_SIZE] == want
    assert raw[HEADER_SIZE:HEADER_SIZE + N] == data and raw[HEADER_SIZE + N:] == bytes(padded_len(N) - N)


# --------------------------------------------------------- the two-path adapter
_PY_METHODS = {
    "write": "pwritev", "read": "preadv", "fsync": "fsync", "link": "link_at",
    "rename": "replace_at", "stat": "stat_at", "unlink": "unlink_at", "mkdir": "mkdir_at",
}


@dataclass
class IOPath:
    """store/load/fault on one path; ``root`` is the base directory."""

    name: str
    root: Path
    mp: pytest.MonkeyPatch

    def path(self, key: BlockKey) -> Path:
        return self.root / "sub" / f"{key.hex}-g{key.group_idx}.bin"

    def store(self, key: BlockKey, opts: IOOptions, version: int = 0,
              slot: memoryview | None = None) -> StoreOutcome:
        data = io_worker.payload_of(key, version)
        if slot is None:
            slot = aligned_buffer(padded_len(N))
        slot[:N] = data
        path = self.path(key)
        if self.name == "native":
            return native.store_batch(str(self.root), [str(path)], [key], [slot[:N]], DIGEST, 1, opts)[0]
        path.parent.mkdir(exist_ok=True)
        header = header_for_payload(key, DIGEST, data, 1, N, checksum=opts.checksum)
        return _blockio.store_block(StoreRequest(path, header, slot), opts)

    def load(self, key: BlockKey, opts: IOOptions, buf: memoryview | None = None
             ) -> tuple[LoadOutcome, memoryview]:
        if buf is None:
            buf = aligned_buffer(padded_len(N))
        path = self.path(key)
        if self.name == "native":
            return native.load_batch(str(self.root), [str(path)], [key], [buf[:N]], DIGEST, opts)[0], buf
        return _blockio.load_block(LoadRequest(path, buf, key, DIGEST, N), opts), buf

    def fail(self, op: str, code: int = 0, *, times: int = -1, after: bool = False,
             short: int = 0, delay_s: float = 0.0) -> list[int]:
        """Inject on ``op`` (native op names); returns a list that counts
        the Python path's calls (the native path counts in the extension)."""
        calls: list[int] = []
        if self.name == "native":
            native.fault(op, code, times=times, after=after, short=short, delay_s=delay_s)
            return calls
        if op in ("open", "opendir"):
            self._fail_open(op, code, calls)
            return calls
        method = _PY_METHODS[op]
        real = getattr(fsops.FS, method)

        def wrapped(*args: Any) -> Any:
            calls.append(1)
            if short and op in ("write", "read"):
                fd, bufs, off = args
                return real(fd, [memoryview(bufs[0])[:short]], off)
            if after:
                real(*args)
            if code:
                raise OSError(code, os.strerror(code))
            return real(*args)

        self.mp.setattr(fsops.FS, method, wrapped)
        return calls

    def _fail_open(self, op: str, code: int, calls: list[int]) -> None:
        """``opendir``: directory opens; ``open``: file opens (a temp file to
        write, or a block to read). O_TMPFILE contains the O_DIRECTORY bit,
        so a directory open is one with O_DIRECTORY and no write access."""
        for method, flag_at in (("open", 1), ("openat", 2)):
            real = getattr(fsops.FS, method)

            def wrapped(*args: Any, _real: Any = real, _at: int = flag_at) -> int:
                flags = args[_at]
                is_dir = bool(flags & os.O_DIRECTORY) and not flags & (os.O_WRONLY | os.O_RDWR)
                if is_dir == (op == "opendir"):
                    calls.append(1)
                    raise OSError(code, os.strerror(code))
                return _real(*args)

            self.mp.setattr(fsops.FS, method, wrapped)

    def clear(self) -> None:
        """Remove every injected fault (both seams)."""
        native.clear_faults()
        self.mp.undo()

    def count(self, op: str, calls: list[int]) -> int:
        return native.fault_count(op) if self.name == "native" else len(calls)


PATHS = ["python", pytest.param("native", marks=needs_native)]


@pytest.fixture(params=PATHS)
def io(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[IOPath]:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    yield IOPath(request.param, root, monkeypatch)
    native.clear_faults()
    if native._ext is not None:
        native.configure(openat2=True, tmpfile=True)


def temps(root: Path) -> list[str]:
    return [p.name for p in root.rglob("*") if is_temp_name(p.name)]


def fds_under(root: Path) -> list[str]:
    """This process's open descriptors naming something under ``root`` (a store's or a load's directory and file
    descriptors): a leak check that other threads' descriptors, opened or closed meanwhile, do not disturb."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (listdir's own descriptor among them)
            continue
        if target == str(root) or target.startswith(f"{root}/"):
            out.append(target)
    return out


def _direct(root: Path) -> bool:
    return probe_o_direct(root, "auto").enabled


@pytest.fixture(params=["buffered", "direct"])
def opts(request: pytest.FixtureRequest, tmp_path: Path) -> IOOptions:
    if request.param == "direct":
        if not _direct(tmp_path):
            pytest.skip("tmp_path refuses O_DIRECT")
        return IOOptions(o_direct=True, fsync="file+dir")
    return IOOptions(o_direct=False, fsync="none")


# ----------------------------------------------------------------- behaviour
def test_round_trip_and_skip(io: IOPath, opts: IOOptions) -> None:
    out = io.store(K1, opts, version=3)
    assert out.status is StoreStatus.STORED and out.nbytes == HEADER_SIZE + padded_len(N)
    assert io.store(K1, opts, version=4).status is StoreStatus.SKIPPED
    res, buf = io.load(K1, opts)
    assert res.status is LoadStatus.LOADED and res.nbytes == N
    assert bytes(buf[:N]) == io_worker.payload_of(K1, 3)
    assert blockcheck.verify_file(io.path(K1), True, key=K1, namespace_digest=DIGEST).ok
    assert temps(io.root) == []


@needs_native
def test_files_cross_between_paths(tmp_path: Path, opts: IOOptions, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sub").mkdir()
    py, nat = IOPath("python", tmp_path, monkeypatch), IOPath("native", tmp_path, monkeypatch)
    assert py.store(K1, opts, version=1).ok and nat.store(K2, opts, version=2).ok
    r1, b1 = nat.load(K1, opts)
    r2, b2 = py.load(K2, opts)
    assert r1.ok and bytes(b1[:N]) == io_worker.payload_of(K1, 1)
    assert r2.ok and bytes(b2[:N]) == io_worker.payload_of(K2, 2)


def test_unaligned_buffers(io: IOPath) -> None:
    opts = IOOptions(o_direct=_direct(io.root))
    raw = bytearray(padded_len(N) + 1)
    view = memoryview(raw)[1:]
    assert io.store(K1, opts, version=9, slot=view).ok
    res, buf = io.load(K1, opts, buf=memoryview(bytearray(padded_len(N) + 3))[3:])
    assert res.ok and bytes(buf[:N]) == io_worker.payload_of(K1, 9)


def test_missing_directory_is_created_below_the_base(tmp_path: Path) -> None:
    if native._ext is None:
        pytest.skip("native extension not built")
    base = tmp_path / "b"
    base.mkdir()
    buf = memoryview(bytearray(io_worker.payload_of(K1, 0)))
    path = base / "x" / "y" / "f.bin"
    assert native.store_batch(str(base), [str(path)], [K1], [buf], DIGEST, 1, IOOptions())[0].ok
    assert path.is_file()


@pytest.mark.parametrize("damage, reason", CORRUPTIONS, ids=[c[0].__name__ for c in CORRUPTIONS])
def test_corruption_is_a_miss_and_removed(io: IOPath, opts: IOOptions, damage: Any, reason: str) -> None:
    io.store(K1, opts)
    io.store(K2, opts)
    damage(io.path(K1), io.root / "sub")
    res, _ = io.load(K1, opts)
    assert (res.status, res.cause, res.removed) == (LoadStatus.CORRUPT, reason, True)
    assert not io.path(K1).exists()
    assert io.load(K2, opts)[0].ok
    assert io.store(K1, opts).status is StoreStatus.STORED and io.load(K1, opts)[0].ok


def test_wrong_namespace_is_corrupt(io: IOPath) -> None:
    opts = IOOptions()
    io.store(K1, opts)
    path = io.path(K1)
    raw = bytearray(path.read_bytes())
    h = blockcheck.read_header(path)
    other = BlockHeader(h.key, b"\x01" * 8, h.payload_len, h.page_count, h.page_bytes,
                        h.checksum_kind, h.payload_checksum, h.created_ns)
    raw[:HEADER_SIZE] = encode_header(other)
    path.write_bytes(bytes(raw))
    res, _ = io.load(K1, opts)
    assert (res.status, res.cause) == (LoadStatus.CORRUPT, "wrong_namespace")


def test_checksum_off_skips_payload_check(io: IOPath) -> None:
    opts = IOOptions(checksum=False)
    io.store(K1, opts)
    assert blockcheck.read_header(io.path(K1)).checksum_kind == ChecksumKind.NONE
    with open(io.path(K1), "r+b") as fh:
        fh.seek(HEADER_SIZE + 5)
        fh.write(b"\xff")
    assert io.load(K1, opts)[0].ok


@pytest.mark.parametrize("walk", [False, True], ids=["openat2", "walk"])
def test_symlinks_are_never_followed(io: IOPath, tmp_path: Path, walk: bool) -> None:
    if walk and io.name == "native":
        native.configure(openat2=False)
    opts = IOOptions()
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / f"{K1.hex}-g0.bin"
    secret.write_bytes(b"do not touch")
    # a symlink at the final name: a load removes the link, a store replaces it
    io.path(K1).symlink_to(secret)
    res, _ = io.load(K1, opts)
    assert (res.status, res.cause, res.removed) == (LoadStatus.CORRUPT, "symlink", True)
    io.path(K1).symlink_to(secret)
    assert io.store(K1, opts).status is StoreStatus.STORED
    assert not io.path(K1).is_symlink() and secret.read_bytes() == b"do not touch"
    # a symlinked directory: refused, nothing written through it
    (io.root / "sub").rename(io.root / "real")
    (io.root / "sub").symlink_to(outside)
    out = io.store(K2, opts)
    assert out.status is StoreStatus.FAILED and out.cause in ("ELOOP", "ENOTDIR")
    res, _ = io.load(K1, opts)
    assert res.status is LoadStatus.CORRUPT and res.cause == "symlink"
    assert sorted(p.name for p in outside.iterdir()) == [secret.name]
    assert secret.read_bytes() == b"do not touch"


def test_named_temp_publication(io: IOPath) -> None:
    caps = RootCapabilities(tmpfile=False, root=io.root)
    assert io.store(K1, IOOptions(fsync="file+dir", capabilities=caps)).ok
    assert io.load(K1, IOOptions())[0].ok and temps(io.root) == []


# ----------------------------------------------------- fault matrix, rows 10-14
@pytest.mark.parametrize(
    "op, code",
    [("write", errno.ENOSPC), ("write", errno.EIO), ("fsync", errno.EIO), ("open", errno.EMFILE),
     ("open", errno.EACCES), ("link", errno.EXDEV), ("rename", errno.EXDEV), ("close", errno.EIO),
     ("opendir", errno.ESTALE)],
)
def test_store_faults_publish_nothing_and_recover(
    io: IOPath, monkeypatch: pytest.MonkeyPatch, op: str, code: int
) -> None:
    named = op == "rename"  # the named-temp publication (no O_TMPFILE)
    opts = IOOptions(fsync="file+dir", capabilities=RootCapabilities(tmpfile=not named, root=io.root))
    io.store(K2, opts)
    old = io.path(K2).read_bytes()
    fds = len(os.listdir("/proc/self/fd"))
    if op == "close" and io.name == "python":
        real = fsops.FS.close

        def bad_close(fd: int) -> None:
            real(fd)
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(fsops.FS, "close", bad_close)
    else:
        io.fail(op, code, after=op == "close")
    out = io.store(K1, opts)
    assert out.status is StoreStatus.FAILED and out.cause == errno.errorcode[code]
    native.clear_faults()
    monkeypatch.undo()
    assert not io.path(K1).exists() and temps(io.root) == []
    assert fds_under(io.root) == [] and len(os.listdir("/proc/self/fd")) <= fds
    assert io.path(K2).read_bytes() == old and io.load(K2, opts)[0].ok
    assert io.store(K1, opts).status is StoreStatus.STORED and io.load(K1, opts)[0].ok


def test_failed_fsync_is_never_retried(io: IOPath) -> None:
    calls = io.fail("fsync", errno.EIO)
    out = io.store(K1, IOOptions(fsync="file", o_direct=_direct(io.root)))
    assert out.status is StoreStatus.FAILED and out.cause == "EIO" and "fsync" in out.detail
    assert io.count("fsync", calls) == 1 and temps(io.root) == []


def test_short_writes_complete(io: IOPath) -> None:
    calls = io.fail("write", short=1000)
    assert io.store(K1, IOOptions()).status is StoreStatus.STORED
    assert io.count("write", calls) > 10
    io.clear()
    assert io.load(K1, IOOptions())[0].ok


def test_short_reads_complete(io: IOPath) -> None:
    io.store(K1, IOOptions(), version=4)
    io.fail("read", short=1000)
    res, buf = io.load(K1, IOOptions())
    assert res.ok and bytes(buf[:N]) == io_worker.payload_of(K1, 4)


@pytest.mark.parametrize("op", ["link", "rename"])
def test_publication_error_after_it_happened(io: IOPath, monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    opts = IOOptions(capabilities=RootCapabilities(tmpfile=op != "rename", root=io.root))
    io.fail(op, errno.EIO, after=True)
    out = io.store(K1, opts)
    assert out.status is StoreStatus.FAILED and temps(io.root) == []
    native.clear_faults()
    monkeypatch.undo()
    assert io.load(K1, IOOptions())[0].ok  # complete file, never torn


@pytest.mark.parametrize(
    "op, code, status",
    [("open", errno.EMFILE, LoadStatus.ERROR), ("open", errno.EACCES, LoadStatus.ERROR),
     ("open", errno.ESTALE, LoadStatus.ERROR), ("open", errno.ENOENT, LoadStatus.MISSING),
     ("read", errno.EIO, LoadStatus.ERROR),
     # a block removed between open and read (another host's eviction) is a miss
     ("read", errno.ESTALE, LoadStatus.MISSING), ("read", errno.ENOENT, LoadStatus.MISSING)],
)
def test_transient_load_errors_leave_the_file(
    io: IOPath, opts: IOOptions, op: str, code: int, status: LoadStatus
) -> None:
    io.store(K1, opts)
    fds = len(os.listdir("/proc/self/fd"))
    io.fail(op, code)
    res, _ = io.load(K1, opts)
    assert res.status is status and res.cause == errno.errorcode[code] and not res.removed
    io.clear()
    assert fds_under(io.root) == [] and len(os.listdir("/proc/self/fd")) <= fds
    assert io.path(K1).exists() and io.load(K1, opts)[0].ok


@needs_native
def test_nth_call_and_delay_rules(tmp_path: Path) -> None:
    keys = [io_worker.key_of(i) for i in range(4)]
    bufs = [memoryview(bytearray(io_worker.payload_of(k, 0))) for k in keys]
    paths = [str(tmp_path / "d" / f"{k.hex}.bin") for k in keys]
    native.fault("write", errno.ENOSPC, nth=3, times=1)
    try:
        outs = native.store_batch(str(tmp_path), paths, keys, bufs, DIGEST, 1, IOOptions())
        assert [o.status for o in outs] == [StoreStatus.STORED, StoreStatus.STORED,
                                            StoreStatus.FAILED, StoreStatus.STORED]
        assert outs[2].cause == "ENOSPC" and native.fault_count("write") == 4
    finally:
        native.clear_faults()
    assert temps(tmp_path) == []
    with pytest.raises(ValueError, match="unknown op"):
        native.fault("chmod", errno.EIO)


# ------------------------------------------------------------- lookup, status
@needs_native
def test_lookup_batch(tmp_path: Path) -> None:
    base = tmp_path
    (base / "d").mkdir()
    (base / "d" / "a").write_bytes(b"x")
    os.mkfifo(base / "d" / "fifo")
    (base / "d" / "link").symlink_to(base / "d" / "a")
    paths = [str(base / "d" / n) for n in ("a", "fifo", "link", "missing", "a")]
    assert native.lookup_batch(str(base), paths) == [True, False, False, False, True]
    assert native.lookup_batch(str(base), paths, prefix=True) == [True, False]
    with pytest.raises(ValueError, match="not below"):
        native.lookup_batch(str(base), ["/etc/passwd"])


def test_env_forces_the_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSTIER_NATIVE", "0")
    st = native.status()
    assert st.backend == "python" and "FSTIER_NATIVE=0" in st.reason


def test_missing_extension_falls_back_or_fails_when_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_ext", None)
    monkeypatch.setattr(native, "_import_error", "No module named 'fstier.io._native'")
    monkeypatch.delenv("FSTIER_NATIVE", raising=False)
    st = native.status()
    assert st.backend == "python" and "unavailable" in st.reason
    assert native.status("off").backend == "python"
    with pytest.raises(ConfigError, match="native_io: on.*C compiler"):
        native.status("on")
    monkeypatch.setenv("FSTIER_NATIVE", "1")
    with pytest.raises(ConfigError, match="FSTIER_NATIVE=1.*C compiler"):
        native.status()


def test_bad_batches_raise_value_errors(tmp_path: Path) -> None:
    if native._ext is None:
        pytest.skip("native extension not built")
    buf = memoryview(bytearray(8))
    base = os.fsencode(tmp_path)
    with pytest.raises(TypeError, match="lists or tuples"):
        native._ext.lookup_batch(base, iter([b"a"]), False)
    with pytest.raises(TypeError, match="must be bytes"):  # paths are bytes end to end
        native._ext.lookup_batch(base, ["a"], False)
    with pytest.raises(TypeError):
        native._ext.lookup_batch(str(tmp_path), [b"a"], False)
    with pytest.raises(ValueError, match="differ in length"):
        native._ext.store_batch(base, [b"a"], [], [0], [buf], DIGEST, 1, 0, 0o644, 0, 4096)
    with pytest.raises(ValueError, match="8..64 bytes"):
        native._ext.store_batch(base, [b"a"], [b"x"], [0], [buf], DIGEST, 1, 0, 0o644, 0, 4096)
    with pytest.raises(ValueError, match="relative path"):
        native._ext.lookup_batch(base, [b"/abs"], False)
    with pytest.raises(BufferError):  # a load needs writable buffers
        native._ext.load_batch(base, [b"a"], [K1.block_hash], [0], [b"readonly"], DIGEST, 0, 4096)



@needs_native
def test_engine_info_holds_no_lock_while_it_builds_python_objects(tmp_path: Path) -> None:
    """engine_info built its dict with the engine's mutex held: an allocation
    there can run the collector, and a finalizer that calls into the same
    engine (engine_info, a submit) then waited forever on the mutex its own
    thread held. Run in a child (a hang is its timeout), with the collector
    made to run at engine_info's dict: cycles whose finalizer calls engine_info,
    the dict free list emptied, threshold 1. Before: the child hung."""
    child = tmp_path / "child.py"
    child.write_text(
        "import gc\n"
        "from fstier.io import native as nat\n"
        "ext = nat._ext\n"
        "cap = ext.engine_new(1, 1)\n"
        "class Probe:\n"
        "    def __del__(self):\n"
        "        ext.engine_info(cap)\n"
        "for _ in range(50):\n"
        "    a, b = Probe(), Probe()\n"
        "    a.o, b.o = b, a\n"
        "    del a, b\n"
        "    keep = [{} for _ in range(200)]\n"
        "    gc.set_threshold(1)\n"
        "    ext.engine_info(cap)\n"
        "    gc.set_threshold(700)\n"
        "ext.engine_shutdown(cap, 5.0)\n"
        "print('done')\n"
    )
    try:
        out = subprocess.run([sys.executable, str(child)], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("engine_info deadlocked on its own mutex (a finalizer called into the engine)")
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr
