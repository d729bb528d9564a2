"""Rows 3-7 and 21 of the fault matrix: damaged, foreign and hostile block
files are misses (CORRUPT, file removed) and never load wrong bytes.

Every case writes the damaged bytes at the key's real path and loads through
:func:`fstier.io._blockio.load_block` with checksums on. ``TALLY`` accumulates
the published figures: corruptions tried, detected, and wrong bytes loaded.
The default run cuts a strided subset of truncation lengths and bit
positions; ``-m slow`` tries every one.
"""

from __future__ import annotations

import os
import random
import struct
import tracemalloc
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fstier.errors import BlockCorruptError
from fstier.io import blockfile
from fstier.io.blockcheck import verify_file
from fstier.io.blockfile import HEADER_SIZE, decode_header
from fstier.io.blockstore import NamespaceDirs
from fstier.io.manifest import ensure_manifest

from ._support import Tally, Tier, key_for, payload_for

TALLY = Tally()


@pytest.fixture
def tier(tmp_path: Path) -> Tier:
    return Tier.open(tmp_path / "root")


def _valid(tier: Tier, i: int = 0) -> tuple[Path, bytes, bytes]:
    key = key_for(i)
    assert tier.store(key).status == "STORED"
    path = tier.path(key)
    return path, path.read_bytes(), payload_for(key, tier.payload_len)


def _try(tier: Tier, i: int, path: Path, bad: bytes, want: bytes, tally: Tally) -> None:
    path.write_bytes(bad)
    out, got = tier.load(key_for(i))
    tally.check_load(out, got, want)
    TALLY.check_load(out, got, want)
    if out.status != "LOADED":
        assert out.status == "CORRUPT", out
        assert out.removed and not path.exists(), "a proven-corrupt block must be removed"


# -------------------------------------------------------------- row 4
@pytest.mark.parametrize("every", [pytest.param(False), pytest.param(True, marks=pytest.mark.slow)])
def test_truncation_at_every_length(tier: Tier, every: bool) -> None:
    path, good, want = _valid(tier)
    size = len(good)
    assert size == HEADER_SIZE + 4096
    lengths = (
        range(size)
        if every
        else sorted({*range(0, size, 101), 1, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1, size - 1})
    )
    tally = Tally()
    for n in lengths:
        _try(tier, 0, path, good[:n], want, tally)
    assert tally.detected == tally.tried == len(lengths)
    assert tally.wrong_bytes == 0


# -------------------------------------------------------------- row 5
@pytest.mark.parametrize("every", [pytest.param(False), pytest.param(True, marks=pytest.mark.slow)])
def test_bit_flips_header_and_payload(tier: Tier, every: bool) -> None:
    """Every bit of the used header (144 bytes), reserved header bytes and the
    512 payload bytes. A flip in the zero padding after the payload changes
    no payload byte: it may load, but only with the right bytes."""
    path, good, want = _valid(tier)
    n = tier.payload_len
    rng = random.Random(5)
    header_bits = range(144 * 8) if every else range(0, 144 * 8, 11)
    reserved = range(144, HEADER_SIZE) if every else rng.sample(range(144, HEADER_SIZE), 40)
    payload_bits = range(n * 8) if every else range(0, n * 8, 23)
    positions = [*header_bits, *(b * 8 + rng.randrange(8) for b in reserved)]
    positions += [(HEADER_SIZE * 8) + b for b in payload_bits]
    tally = Tally()
    for bit in positions:
        bad = bytearray(good)
        bad[bit // 8] ^= 1 << (bit % 8)
        _try(tier, 0, path, bytes(bad), want, tally)
    assert tally.detected == tally.tried == len(positions)
    padding = Tally()
    for byte in range(HEADER_SIZE + n, len(good), 97):
        bad = bytearray(good)
        bad[byte] ^= 0xFF
        _try(tier, 0, path, bytes(bad), want, padding)
    assert padding.wrong_bytes == 0 and tally.wrong_bytes == 0


# -------------------------------------------------------------- rows 3, 5
def test_power_loss_like_garbage(tier: Tier) -> None:
    """What a file can hold after a power loss without fsync: zeros or random
    bytes of the right size, size-right with a zeroed payload or header, a
    header-only file, an empty file, a stale half of another version."""
    tally = Tally()
    rng = random.Random(3)
    for i in range(8):
        _valid(tier, i)
    for i in range(8):
        path = tier.path(key_for(i))
        good = path.read_bytes() if path.exists() else None
        if good is None:
            assert tier.store(key_for(i)).status == "STORED"
            good = path.read_bytes()
        want = payload_for(key_for(i), tier.payload_len)
        size = len(good)
        cases = [
            bytes(size),
            rng.randbytes(size),
            good[:HEADER_SIZE] + bytes(size - HEADER_SIZE),
            bytes(HEADER_SIZE) + good[HEADER_SIZE:],
            good[:HEADER_SIZE],
            b"",
            good[: size // 2] + bytes(size - size // 2),
            rng.randbytes(HEADER_SIZE) + good[HEADER_SIZE:],
        ]
        for bad in cases:
            _try(tier, i, path, bad, want, tally)
    assert tally.detected == tally.tried == 64 and tally.wrong_bytes == 0


# -------------------------------------------------------------- row 6
def test_valid_file_under_another_keys_name(tier: Tier) -> None:
    tally = Tally()
    for i in range(1, 9):
        _, a_bytes, _ = _valid(tier, 1000 + i)
        b = key_for(i)
        want = payload_for(b, tier.payload_len)
        b_path = tier.path(b)
        NamespaceDirs(tier.mapper).ensure(b_path)
        _try(tier, i, b_path, a_bytes, want, tally)
        assert verify_file(tier.path(key_for(1000 + i))).ok, "the source file is untouched"
    assert tally.detected == tally.tried == 8 and tally.wrong_bytes == 0


# -------------------------------------------------------------- row 21
NAMESPACE_VARIANTS = {
    "model": {"model": {"name": "acme/other"}},
    "revision": {"model": {"revision": "r2"}},
    "dtype": {"model": {"dtype": "bfloat16"}},
    "layout": {
        "model": {
            "groups": [
                {
                    "kind": "full_attention",
                    "block_size": 16,
                    "num_layers": 1,
                    "num_kv_heads": 1,
                    "head_size": 8,
                    "kv_layout": "HND",
                }
            ]
        }
    },
    "salt": {"tier": {"namespace_salt": "tenant-b"}},
    "blocks_per_file": {"tier": {"blocks_per_file": 2}},
}


@pytest.mark.parametrize("variant", sorted(NAMESPACE_VARIANTS))
def test_namespace_mismatch_is_a_miss(tmp_path: Path, variant: str) -> None:
    """Same key hash, another namespace: other directory; the file copied
    across is refused by the embedded namespace digest (or length)."""
    from fstier.file_mapper import FileMapper
    from fstier.io.iotypes import IOOptions

    from ._support import tiny_config

    a = Tier.open(tmp_path / "root")
    over = NAMESPACE_VARIANTS[variant]
    cfg = tiny_config(tmp_path / "root", model=over.get("model"), **over.get("tier", {}))
    b = Tier(FileMapper(cfg), IOOptions())
    ensure_manifest(b.mapper)
    assert b.mapper.digest != a.mapper.digest
    key = key_for(7)
    assert a.store(key).status == "STORED"
    out, _ = b.load(key)
    assert out.status == "MISSING"
    b_path = b.path(key)
    NamespaceDirs(b.mapper).ensure(b_path)
    b_path.write_bytes(a.path(key).read_bytes())
    out, got = b.load(key)
    TALLY.check_load(out, got, b"\x00" * len(got))
    assert out.status == "CORRUPT" and out.cause in ("wrong_namespace", "bad_size", "wrong_length")
    out, got = a.load(key)
    assert out.status == "LOADED" and got == payload_for(key, a.payload_len)


def test_unknown_format_version_is_a_miss(tier: Tier) -> None:
    path, good, want = _valid(tier)
    tally = Tally()
    for version in (1, blockfile.FORMAT_VERSION + 1):  # a format v1 file, a future one
        bad = bytearray(good)
        struct.pack_into("<H", bad, 8, version)
        _reseal(bad)
        _try(tier, 0, path, bytes(bad), want, tally)
    assert tally.detected == 2


# -------------------------------------------------------------- row 7
def _reseal(buf: bytearray) -> None:
    """Recompute the header checksum so a hostile field passes it and reaches
    the field checks (the worst case: a deliberately crafted header)."""
    struct.pack_into("<Q", buf, 136, 0)
    h = xxhash.xxh3_64()
    h.update(bytes(buf[:136]))
    h.update(bytes(8))
    h.update(bytes(buf[144:HEADER_SIZE]))
    struct.pack_into("<Q", buf, 136, h.intdigest())


FIELDS = {  # offset, struct format
    "version": (8, "<H"),
    "header_size": (10, "<H"),
    "checksum_kind": (12, "<H"),
    "hash_len": (14, "<H"),
    "group_idx": (16, "<I"),
    "flags": (20, "<I"),
    "payload_len": (32, "<Q"),
    "page_count": (40, "<Q"),
    "page_bytes": (48, "<Q"),
    "payload_checksum": (56, "<Q"),
}


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    field=st.sampled_from(sorted(FIELDS)),
    value=st.one_of(st.integers(0, 2**16 - 1), st.sampled_from([2**32 - 1, 2**36 + 1, 2**63, 2**64 - 1])),
    reseal=st.booleans(),
)
def test_hostile_header_fields(tmp_path_factory: pytest.TempPathFactory, field: str, value: int, reseal: bool) -> None:
    """Huge lengths, unknown versions, absurd hash lengths, resealed or not:
    a miss or (for a harmless value) a correct load; never a big allocation."""
    tier = Tier.open(tmp_path_factory.mktemp("fuzz"))
    path, good, want = _valid(tier)
    off, fmt = FIELDS[field]
    bad = bytearray(good)
    size = struct.calcsize(fmt)
    struct.pack_into(fmt, bad, off, value % (1 << (8 * size)))
    if reseal:
        _reseal(bad)
    tally = Tally()
    tracemalloc.start()
    try:
        _try(tier, 0, path, bytes(bad), want, tally)
        path.write_bytes(bytes(bad))
        check = verify_file(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes allocated for a hostile header"
    assert tally.wrong_bytes == 0
    if bytes(bad) != good and not reseal:
        assert tally.detected == 1 and not check.ok


@settings(max_examples=150, deadline=None)
@given(st.binary(min_size=0, max_size=HEADER_SIZE + 64))
def test_decode_header_fuzz(data: bytes) -> None:
    """Any bytes: a BlockHeader or BlockCorruptError, nothing else."""
    buf = (data + bytes(HEADER_SIZE))[:HEADER_SIZE] if len(data) >= 8 else data
    try:
        h = decode_header(buf)
    except BlockCorruptError:
        return
    assert h.payload_len <= blockfile.MAX_PAYLOAD_BYTES


@settings(max_examples=150, deadline=None)
@given(st.binary(min_size=0, max_size=200))
def test_decode_header_fuzz_after_valid_magic(tail: bytes) -> None:
    """Random fields behind a valid magic and version, resealed."""
    buf = bytearray(HEADER_SIZE)
    buf[:8] = blockfile.MAGIC
    struct.pack_into("<H", buf, 8, blockfile.FORMAT_VERSION)
    buf[10 : 10 + len(tail[:126])] = tail[:126]
    _reseal(buf)
    try:
        h = decode_header(bytes(buf))
    except BlockCorruptError:
        return
    assert h.payload_len == h.page_count * h.page_bytes <= blockfile.MAX_PAYLOAD_BYTES


def test_zero_wrong_bytes_overall() -> None:
    """Runs last in this module: the suite-wide wrong-bytes figure is zero."""
    assert TALLY.wrong_bytes == 0
    print(f"\nRELIABILITY-FIGURES corruption tried={TALLY.tried} detected={TALLY.detected} "
          f"loaded_ok={TALLY.loaded_ok} wrong_bytes={TALLY.wrong_bytes}")
    os.environ.setdefault("FSTIER_CORRUPTIONS", str(TALLY.tried))
