"""Checked buffered I/O in pieces (``_native.c``: ``hash_piece``).

A checked buffered load reads a payload larger than the piece (default
128 KiB) a piece at a time and hashes each piece as it lands; a checked
buffered store hashes each piece right before writing it and writes the
header, which carries the checksum, last. Both keep the piece in the CPU's
cache between the copy and the hash. These tests pin that cutting changes
nothing a reader or writer can see: the same files, the same per-index
outcomes for every corruption (a longer file included: the last read still
reaches past the end), a flipped byte in any piece caught, short reads and
writes completed, and a failed write in the middle of a file publishing
nothing.
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fstier.io import native
from fstier.io.blockfile import HEADER_SIZE
from fstier.io.fsops import is_temp_name
from fstier.io.iotypes import LoadStatus, StoreStatus

sys.path.insert(0, str(Path(__file__).parent))
import io_worker  # noqa: E402
from test_native_fanout import Matrix, N, _load, _store  # noqa: E402

pytestmark = pytest.mark.skipif(
    native._ext is None, reason=f"native extension not built: {native._import_error}"
)


@pytest.fixture
def piece() -> Iterator[None]:
    """Cut this module's payloads (3 pages + 100 bytes) into pieces."""
    before = native.configure()["hash_piece"]
    native.configure(hash_piece=4096)
    yield
    native.configure(hash_piece=before)
    native.clear_faults()


def _payload_checksum(path: Path) -> bytes:
    return path.read_bytes()[56:64]  # docs/format.md: the payload checksum field


def test_the_default_piece_is_128_kib() -> None:
    assert native.configure()["hash_piece"] == 128 << 10


@pytest.mark.parametrize("size", [4096, 1000, 5000])
def test_files_stored_in_pieces_are_the_files_stored_whole(tmp_path: Path, size: int) -> None:
    keys = [io_worker.key_of(300 + i) for i in range(6)]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir()
    cut.mkdir()
    before = native.configure()["hash_piece"]
    try:
        native.configure(hash_piece=0)
        assert _store(whole, keys) == [StoreStatus.STORED] * 6
        native.configure(hash_piece=size)
        assert _store(cut, keys) == [StoreStatus.STORED] * 6
        for k in keys:
            a, b = io_worker.path_of(whole, k).read_bytes(), io_worker.path_of(cut, k).read_bytes()
            assert len(a) == len(b)
            assert a[56:64] == b[56:64]  # the payload checksum
            assert a[HEADER_SIZE:] == b[HEADER_SIZE:]  # the payload and its zero padding
        # each reads back whole and in pieces
        for root in (whole, cut):
            for p in (0, size):
                native.configure(hash_piece=p)
                outs, bufs = _load(root, keys, 0)
                assert [o.status for o in outs] == [LoadStatus.LOADED] * 6
                assert all(bytes(b[:N]) == io_worker.payload_of(k, 0)
                           for k, b in zip(keys, bufs, strict=True))
    finally:
        native.configure(hash_piece=before)


@pytest.mark.parametrize("helpers", [0, 3])
def test_every_outcome_holds_when_loads_hash_in_pieces(tmp_path: Path, piece: None, helpers: int) -> None:
    m = Matrix(tmp_path, 2000, 12)
    m.check(*_load(tmp_path, m.keys, helpers, helpers))


@pytest.mark.parametrize("at", [0, 4095, 4096, 9000, 3 * 4096 - 1, 3 * 4096, N - 1])
def test_a_flipped_byte_in_any_piece_is_caught(tmp_path: Path, piece: None, at: int) -> None:
    k = io_worker.key_of(400)
    assert _store(tmp_path, [k]) == [StoreStatus.STORED]
    path = io_worker.path_of(tmp_path, k)
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + at] ^= 0x10
    path.write_bytes(raw)
    (out,), _ = _load(tmp_path, [k], 0)
    assert (out.status, out.cause) == (LoadStatus.CORRUPT, "payload_checksum")


def test_short_reads_and_writes_complete_every_piece(tmp_path: Path, piece: None) -> None:
    keys = [io_worker.key_of(500 + i) for i in range(4)]
    native.fault("write", short=1000, times=-1)
    assert _store(tmp_path, keys) == [StoreStatus.STORED] * 4
    native.clear_faults()
    native.fault("read", short=1500, times=-1)
    outs, bufs = _load(tmp_path, keys, 0)
    assert [o.status for o in outs] == [LoadStatus.LOADED] * 4
    assert all(bytes(b[:N]) == io_worker.payload_of(k, 0) for k, b in zip(keys, bufs, strict=True))
    assert native.fault_count("read") > 4 * (N // 1500)


@pytest.mark.parametrize("nth", [1, 2, 3, 4])
def test_a_write_failing_at_any_piece_publishes_nothing(tmp_path: Path, piece: None, nth: int) -> None:
    # Writes of one file in pieces: 3 payload pieces, then the header, then
    # the tail page; the 4th is the header (the checksum known only now).
    k = io_worker.key_of(600)
    native.fault("write", errno.ENOSPC, nth=nth)
    assert _store(tmp_path, [k]) == [StoreStatus.FAILED]
    assert native.fault_count("write") == nth
    native.clear_faults()
    assert not io_worker.path_of(tmp_path, k).exists()
    assert not [p for p in tmp_path.rglob("*") if is_temp_name(p.name)]
    native.fault("write", nth=10**6)  # counts the writes, injects nothing
    assert _store(tmp_path, [k]) == [StoreStatus.STORED]
    assert native.fault_count("write") == 5
    (out,), bufs = _load(tmp_path, [k], 0)
    assert out.status is LoadStatus.LOADED and bytes(bufs[0][:N]) == io_worker.payload_of(k, 0)
