"""The block header (format v2; the header layout is v1's): golden bytes, round trips, rejections,
hostile-input fuzz."""

from __future__ import annotations

import struct
import tracemalloc

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fstier.errors import BlockCorruptError
from fstier.io.blockfile import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAX_PAYLOAD_BYTES,
    BlockHeader,
    ChecksumKind,
    decode_header,
    encode_header,
    header_for_payload,
    padded_len,
    payload_checksum,
)
from fstier.keys import BlockKey

GOLDEN_KEY = BlockKey(bytes(range(1, 17)), 3)
GOLDEN = BlockHeader(
    key=GOLDEN_KEY,
    namespace_digest=bytes.fromhex("0123456789abcdef"),
    payload_len=8192,
    page_count=2,
    page_bytes=4096,
    checksum_kind=ChecksumKind.XXH3_64,
    payload_checksum=0x1122334455667788,
    created_ns=1700000000123456789,
)
# The first 144 bytes of GOLDEN's encoding, field by field (docs/format.md).
GOLDEN_HEX = (
    "4653544b56424c4b"  # 0   magic "FSTKVBLK"
    "0200"  # 8   format_version 2
    "0010"  # 10  header_size 4096
    "0100"  # 12  checksum_kind xxh3-64
    "1000"  # 14  hash_len 16
    "03000000"  # 16  group_idx 3
    "00000000"  # 20  flags
    "0123456789abcdef"  # 24  namespace digest
    "0020000000000000"  # 32  payload_len 8192
    "0200000000000000"  # 40  page_count 2
    "0010000000000000"  # 48  page_bytes 4096
    "8877665544332211"  # 56  payload checksum
    "15cd853dfe9c9717"  # 64  created_ns
    "0102030405060708090a0b0c0d0e0f10"
    + "00" * 48  # 72 block hash, zero-filled to 64
    + "92ce7e3c1a7e531f"  # 136 header checksum
)


def _header(**over: object) -> BlockHeader:
    fields: dict[str, object] = {
        "key": BlockKey(b"\xab" * 16, 0),
        "namespace_digest": b"\x01" * 8,
        "payload_len": 3 * 4096,
        "page_count": 3,
        "page_bytes": 4096,
        "payload_checksum": 42,
        "created_ns": 5,
    }
    fields.update(over)
    return BlockHeader(**fields)  # type: ignore[arg-type]


def _refresh_checksum(buf: bytearray) -> None:
    """Recompute the header checksum after a deliberate field edit."""
    tmp = bytearray(buf)
    tmp[136:144] = bytes(8)
    struct.pack_into("<Q", buf, 136, xxhash.xxh3_64_intdigest(bytes(tmp)))


def test_golden_bytes() -> None:
    raw = encode_header(GOLDEN)
    assert len(raw) == HEADER_SIZE
    assert raw[:144].hex() == GOLDEN_HEX
    assert raw[144:] == bytes(HEADER_SIZE - 144)
    # The header checksum is xxh3-64 of the header with its own field zeroed.
    zeroed = raw[:136] + bytes(8) + raw[144:]
    assert struct.unpack_from("<Q", raw, 136)[0] == xxhash.xxh3_64_intdigest(zeroed)
    assert decode_header(raw) == GOLDEN


def test_round_trip_all_hash_lengths_and_kinds() -> None:
    for n in (8, 16, 32, 64):
        for kind in ChecksumKind:
            h = _header(key=BlockKey(bytes([n]) * n, 65535), checksum_kind=kind)
            assert decode_header(encode_header(h)) == h
            assert decode_header(memoryview(encode_header(h))) == h


def test_header_for_payload_and_padding() -> None:
    payload = bytes(range(256)) * 20
    h = header_for_payload(GOLDEN_KEY, b"\x02" * 8, payload, 5, 1024)
    assert h.payload_len == 5120 and h.payload_checksum == payload_checksum(payload)
    assert h.payload_checksum == xxhash.xxh3_64_intdigest(payload)
    assert (
        header_for_payload(GOLDEN_KEY, b"\x02" * 8, payload, 5, 1024, checksum=False).checksum_kind
        == 0
    )
    assert [padded_len(n) for n in (0, 1, 4096, 4097, 8192)] == [0, 4096, 4096, 8192, 8192]


@pytest.mark.parametrize(
    "over, words",
    [
        ({"namespace_digest": b"short"}, "namespace_digest must be 8 bytes"),
        ({"payload_len": 100}, "page_count (3) x page_bytes (4096) must equal payload_len (100)"),
        ({"payload_len": MAX_PAYLOAD_BYTES + 1}, "payload_len must be in"),
        ({"checksum_kind": 7}, "checksum_kind must be 0 or 1"),
    ],
)
def test_encode_rejects_bad_headers(over: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError) as err:
        encode_header(_header(**over))
    assert words in str(err.value)


def _mutated(offset: int, fmt: str, value: int, *, fix_checksum: bool = True) -> bytes:
    buf = bytearray(encode_header(_header()))
    struct.pack_into(fmt, buf, offset, value)
    if fix_checksum:
        _refresh_checksum(buf)
    return bytes(buf)


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"", "short_header"),
        (encode_header(GOLDEN)[:4095], "short_header"),
        (bytes(HEADER_SIZE), "bad_magic"),
        (b"NOTMAGIC" + encode_header(GOLDEN)[8:], "bad_magic"),
        (_mutated(8, "<H", 1), "unsupported_version"),  # a format v1 file
        (_mutated(8, "<H", 3), "unsupported_version"),
        (_mutated(8, "<H", 0xFFFF, fix_checksum=False), "unsupported_version"),
        (_mutated(32, "<Q", 1 << 63, fix_checksum=False), "header_checksum"),
        (_mutated(32, "<Q", 1 << 63), "bad_length"),
        (_mutated(40, "<Q", 1 << 62), "bad_length"),
        (_mutated(14, "<H", 65), "bad_key"),
        (_mutated(14, "<H", 0), "bad_key"),
        (_mutated(16, "<I", 70000), "bad_key"),
        (_mutated(12, "<H", 9), "bad_checksum_kind"),
        (_mutated(10, "<H", 512), "bad_header"),
        (_mutated(20, "<I", 1), "bad_header"),
        (_mutated(3000, "<B", 1, fix_checksum=False), "header_checksum"),
    ],
)
def test_decode_rejects(raw: bytes, reason: str) -> None:
    with pytest.raises(BlockCorruptError) as err:
        decode_header(raw)
    assert err.value.reason == reason


def test_version_is_checked_before_anything_else() -> None:
    # A future version may lay the header out differently: its checksum and
    # lengths must not be interpreted.
    buf = bytearray(HEADER_SIZE)
    buf[:8] = b"FSTKVBLK"
    struct.pack_into("<H", buf, 8, FORMAT_VERSION + 1)
    with pytest.raises(BlockCorruptError, match="unsupported_version"):
        decode_header(bytes(buf))


def test_every_single_bit_flip_in_used_bytes_is_rejected() -> None:
    raw = encode_header(GOLDEN)
    for byte in range(144):
        for bit in (0, 7):
            buf = bytearray(raw)
            buf[byte] ^= 1 << bit
            with pytest.raises(BlockCorruptError):
                decode_header(bytes(buf))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=0, max_size=HEADER_SIZE + 16))
def test_fuzz_random_bytes_never_crash(raw: bytes) -> None:
    try:
        h = decode_header(raw)
    except BlockCorruptError:
        return
    assert isinstance(h, BlockHeader)


_FIELDS = st.fixed_dictionaries(
    {
        "version": st.sampled_from([0, 1, 2, 0xFFFF]),
        "kind": st.integers(0, 0xFFFF),
        "hash_len": st.integers(0, 0xFFFF),
        "group": st.integers(0, 2**32 - 1),
        "payload_len": st.sampled_from([0, 4096, 2**31, 2**36, 2**36 + 1, 2**63, 2**64 - 1]),
        "page_count": st.sampled_from([0, 1, 2**32, 2**64 - 1]),
        "page_bytes": st.sampled_from([0, 4096, 2**32, 2**64 - 1]),
        "fix": st.booleans(),
    }
)


@settings(max_examples=400, deadline=None)
@given(_FIELDS)
def test_fuzz_hostile_fields_no_big_allocation(f: dict[str, int]) -> None:
    """Hostile lengths (2^63, 2^64-1), unknown versions and hash lengths give
    BlockCorruptError or a sane header, and never a large allocation."""
    buf = bytearray(encode_header(GOLDEN))
    struct.pack_into("<H", buf, 8, f["version"])
    struct.pack_into("<HH", buf, 12, f["kind"], f["hash_len"])
    struct.pack_into("<I", buf, 16, f["group"])
    struct.pack_into("<QQQ", buf, 32, f["payload_len"], f["page_count"], f["page_bytes"])
    if f["fix"]:
        _refresh_checksum(buf)
    raw = bytes(buf)
    tracemalloc.start()
    try:
        h = decode_header(raw)
    except BlockCorruptError:
        h = None
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 64 * 1024
    if h is not None:
        assert h.payload_len <= MAX_PAYLOAD_BYTES
        assert 8 <= len(h.key.block_hash) <= 64
        assert h.page_count * h.page_bytes == h.payload_len


# -- the one validator: every reader (load, verify_file, fstier verify) ------
def _validator_header() -> object:
    from fstier.io.blockfile import header_for_payload

    return header_for_payload(BlockKey(b"\x07" * 16, 1), b"\x01" * 8, bytes(8192), 2, 4096)


@pytest.mark.parametrize(
    ("expect_kw", "file_size", "reason"),
    [
        ({}, 4096 + 8192 + 1, "bad_size"),
        ({"key": BlockKey(b"\x08" * 16, 1)}, None, "wrong_key"),
        ({"namespace_digest": b"\x02" * 8}, None, "wrong_namespace"),
        ({"payload_len": 4096}, None, "wrong_length"),
        ({"group_page_bytes": {0: 4096}}, None, "unknown_group"),
        ({"group_page_bytes": {1: 2048}}, None, "wrong_length"),
        ({"max_pages": 1}, None, "wrong_page_count"),
    ],
)
def test_check_block_names_the_first_unexpected_field(expect_kw: dict, file_size: int | None, reason: str) -> None:
    from fstier.io.blockfile import Expected, check_block

    with pytest.raises(BlockCorruptError) as exc:
        check_block(_validator_header(), Expected(**expect_kw), file_size=file_size)  # type: ignore[arg-type]
    assert exc.value.reason == reason


def test_check_block_accepts_what_was_written() -> None:
    from fstier.io.blockfile import Expected, check_block, check_payload, payload_checksum

    h = _validator_header()
    check_block(
        h,  # type: ignore[arg-type]
        Expected(BlockKey(b"\x07" * 16, 1), b"\x01" * 8, 8192, {1: 4096}, 2),
        file_size=4096 + 8192,
    )
    check_payload(h, payload_checksum(bytes(8192)))  # type: ignore[arg-type]
    with pytest.raises(BlockCorruptError, match="checksum"):
        check_payload(h, payload_checksum(b"\x01" + bytes(8191)))  # type: ignore[arg-type]
