"""The on-disk block file format, version 2 (specified byte by byte in docs/format.md).

A block file is a 4096-byte little-endian header followed by the payload
(canonical pages), zero-padded to a multiple of 4096 so that the whole file can
be written and read with O_DIRECT::

    offset  size  field
         0     8  magic  b"FSTKVBLK"
         8     2  format_version (1)
        10     2  header_size (4096)
        12     2  checksum_kind (0 none, 1 xxh3-64)
        14     2  hash_len (8..64)
        16     4  group_idx (0..65535)
        20     4  flags (0)
        24     8  namespace_digest
        32     8  payload_len
        40     8  page_count
        48     8  page_bytes
        56     8  payload_checksum (xxh3-64 of the payload_len payload bytes)
        64     8  created_ns
        72    64  block_hash (hash_len bytes, zero-filled)
       136     8  header_checksum (xxh3-64 of the header with this field zeroed)
       144  3952  reserved, zero

:func:`decode_header` is the only parser and :func:`check_block` the only
validator (the load path, ``verify_file`` and ``fstier verify`` all call it,
each with what it expects). It never allocates based on a length
read from the file, rejects unknown versions before trusting any other field,
and raises :class:`~fstier.errors.BlockCorruptError` with a short ``reason``
for every header it does not accept.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum

import xxhash

from fstier.errors import BlockCorruptError
from fstier.keys import MAX_HASH_BYTES, MIN_HASH_BYTES, BlockKey

__all__ = [
    "ALIGNMENT",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_PAYLOAD_BYTES",
    "BlockHeader",
    "ChecksumKind",
    "Expected",
    "check_block",
    "check_payload",
    "decode_header",
    "encode_header",
    "encode_header_into",
    "block_file_size",
    "header_for_payload",
    "padded_len",
    "payload_checksum",
]

MAGIC = b"FSTKVBLK"
FORMAT_VERSION = 2
"""2: format v2 (the fan-out of docs/format.md section 1; the header layout
is v1's). A reader accepts only its own version."""
HEADER_SIZE = 4096
"""Bytes of a block file's header; the payload follows at this offset."""
ALIGNMENT = 4096
#: Largest payload a v1 reader accepts (64 GiB). A length above it is hostile
#: or corrupt; no real KV block file comes close.
MAX_PAYLOAD_BYTES = 1 << 36
MAX_GROUP_IDX = 65535

# Fixed part of the header, everything before the block hash.
_FIXED = struct.Struct("<8sHHHHII8sQQQQQ")
_HASH_OFFSET = _FIXED.size  # 72
_CHECKSUM_OFFSET = _HASH_OFFSET + MAX_HASH_BYTES  # 136
_CHECKSUM = struct.Struct("<Q")
_USED = _CHECKSUM_OFFSET + _CHECKSUM.size  # 144
_ZERO_CHECKSUM = bytes(_CHECKSUM.size)


class ChecksumKind(IntEnum):
    """How the payload is checksummed."""

    NONE = 0
    XXH3_64 = 1


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The decoded header of one block file."""

    key: BlockKey
    namespace_digest: bytes
    payload_len: int
    page_count: int
    page_bytes: int
    checksum_kind: int = ChecksumKind.XXH3_64
    payload_checksum: int = 0
    created_ns: int = field(default_factory=time.time_ns)


def padded_len(n: int) -> int:
    """``n`` rounded up to a multiple of 4096 (the on-disk payload length)."""
    return (n + ALIGNMENT - 1) & ~(ALIGNMENT - 1)


def block_file_size(payload_len: int) -> int:
    """Bytes a block file of ``payload_len`` occupies: THE payload -> file
    size rule (header + payload padded to 4096), for the validator, the
    write budget and the usage count alike."""
    return HEADER_SIZE + padded_len(payload_len)


def payload_checksum(buf: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of the payload (the unpadded ``payload_len`` bytes)."""
    return xxhash.xxh3_64_intdigest(buf)


def header_for_payload(
    key: BlockKey,
    namespace_digest: bytes,
    payload: bytes | bytearray | memoryview,
    page_count: int,
    page_bytes: int,
    *,
    checksum: bool = True,
) -> BlockHeader:
    """A header describing ``payload`` (its whole length), checksummed when asked."""
    n = len(payload)
    return BlockHeader(
        key=key,
        namespace_digest=namespace_digest,
        payload_len=n,
        page_count=page_count,
        page_bytes=page_bytes,
        checksum_kind=ChecksumKind.XXH3_64 if checksum else ChecksumKind.NONE,
        payload_checksum=payload_checksum(payload) if checksum else 0,
    )


def _check_encodable(h: BlockHeader) -> None:
    if not isinstance(h.key, BlockKey):
        raise ValueError(f"BlockHeader.key must be a BlockKey, got {type(h.key).__name__}")
    if not isinstance(h.namespace_digest, bytes) or len(h.namespace_digest) != 8:
        raise ValueError(
            "BlockHeader.namespace_digest must be 8 bytes (FileMapper.digest_bytes), "
            f"got {h.namespace_digest!r}"
        )
    if not 0 <= h.payload_len <= MAX_PAYLOAD_BYTES:
        raise ValueError(
            f"BlockHeader.payload_len must be in 0..{MAX_PAYLOAD_BYTES}, got {h.payload_len}"
        )
    if h.page_count < 0 or h.page_bytes < 0 or h.page_count * h.page_bytes != h.payload_len:
        raise ValueError(
            f"BlockHeader: page_count ({h.page_count}) x page_bytes ({h.page_bytes}) must equal "
            f"payload_len ({h.payload_len})"
        )
    if h.checksum_kind not in (ChecksumKind.NONE, ChecksumKind.XXH3_64):
        raise ValueError(f"BlockHeader.checksum_kind must be 0 or 1, got {h.checksum_kind}")
    if not 0 <= h.payload_checksum < 1 << 64 or not 0 <= h.created_ns < 1 << 64:
        raise ValueError("BlockHeader.payload_checksum and created_ns must fit in 64 bits")


def _header_checksum(buf: bytes | bytearray | memoryview) -> int:
    hasher = xxhash.xxh3_64()
    hasher.update(buf[:_CHECKSUM_OFFSET])
    hasher.update(_ZERO_CHECKSUM)
    hasher.update(buf[_USED:HEADER_SIZE])
    return hasher.intdigest()


def encode_header_into(h: BlockHeader, buf: bytearray | memoryview) -> None:
    """Encode ``h`` into the first 4096 bytes of a writable buffer (e.g. an
    aligned per-thread buffer for O_DIRECT), zeroing the reserved bytes."""
    _check_encodable(h)
    view = memoryview(buf)
    if len(view) < HEADER_SIZE or view.readonly:
        raise ValueError(f"header buffer must be writable and >= {HEADER_SIZE} bytes")
    view = view[:HEADER_SIZE]
    kh = h.key.block_hash
    _FIXED.pack_into(
        view,
        0,
        MAGIC,
        FORMAT_VERSION,
        HEADER_SIZE,
        int(h.checksum_kind),
        len(kh),
        h.key.group_idx,
        0,
        h.namespace_digest,
        h.payload_len,
        h.page_count,
        h.page_bytes,
        h.payload_checksum,
        h.created_ns,
    )
    view[_HASH_OFFSET:_CHECKSUM_OFFSET] = kh + bytes(MAX_HASH_BYTES - len(kh))
    view[_CHECKSUM_OFFSET:HEADER_SIZE] = bytes(HEADER_SIZE - _CHECKSUM_OFFSET)
    _CHECKSUM.pack_into(view, _CHECKSUM_OFFSET, _header_checksum(view))


def encode_header(h: BlockHeader) -> bytes:
    """The 4096 header bytes for ``h``."""
    buf = bytearray(HEADER_SIZE)
    encode_header_into(h, buf)
    return bytes(buf)


def decode_header(buf: bytes | bytearray | memoryview) -> BlockHeader:
    """Parse and validate a header. Raises :class:`BlockCorruptError` with
    ``reason`` one of ``short_header``, ``bad_magic``, ``unsupported_version``,
    ``header_checksum``, ``bad_key``, ``bad_checksum_kind``, ``bad_length``.
    Checks run in that order, so a reader never trusts a field before the
    version and the header checksum vouch for it."""
    view = memoryview(buf)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    if len(view) < HEADER_SIZE:
        raise BlockCorruptError("short_header", f"{len(view)} < {HEADER_SIZE} bytes")
    (
        magic,
        version,
        header_size,
        kind,
        hash_len,
        group_idx,
        flags,
        digest,
        payload_len,
        page_count,
        page_bytes,
        checksum,
        created_ns,
    ) = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise BlockCorruptError("bad_magic", f"{bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise BlockCorruptError(
            "unsupported_version", f"format version {version}, this reader knows {FORMAT_VERSION}"
        )
    (stored,) = _CHECKSUM.unpack_from(view, _CHECKSUM_OFFSET)
    if stored != _header_checksum(view):
        raise BlockCorruptError("header_checksum", "header bytes do not match their checksum")
    if header_size != HEADER_SIZE or flags != 0:
        raise BlockCorruptError("bad_header", f"header_size={header_size} flags={flags}")
    if not MIN_HASH_BYTES <= hash_len <= MAX_HASH_BYTES or group_idx > MAX_GROUP_IDX:
        raise BlockCorruptError("bad_key", f"hash_len={hash_len} group_idx={group_idx}")
    if kind not in (ChecksumKind.NONE, ChecksumKind.XXH3_64):
        raise BlockCorruptError("bad_checksum_kind", f"checksum kind {kind}")
    if payload_len > MAX_PAYLOAD_BYTES or page_count * page_bytes != payload_len:
        raise BlockCorruptError(
            "bad_length",
            f"payload_len={payload_len} page_count={page_count} page_bytes={page_bytes}",
        )
    key = BlockKey(bytes(view[_HASH_OFFSET : _HASH_OFFSET + hash_len]), group_idx)
    return BlockHeader(
        key=key,
        namespace_digest=bytes(digest),
        payload_len=payload_len,
        page_count=page_count,
        page_bytes=page_bytes,
        checksum_kind=ChecksumKind(kind),
        payload_checksum=checksum,
        created_ns=created_ns,
    )


# ------------------------------------------------------------- the validator
@dataclass(frozen=True, slots=True)
class Expected:
    """What a reader expects of a block file; a field left ``None`` is not
    checked. The load knows the key, namespace and exact payload length;
    ``fstier verify`` knows the key (from the name), the namespace and, from
    the manifest, each group's page size and ``blocks_per_file``."""

    key: BlockKey | None = None
    namespace_digest: bytes | None = None
    #: the exact payload length (the load's slot)
    payload_len: int | None = None
    #: group index -> bytes of one page in a file of that group (the manifest's)
    group_page_bytes: Mapping[int, int] | None = None
    #: pages a file may hold at most (``blocks_per_file``)
    max_pages: int | None = None


def check_block(h: BlockHeader, expect: Expected, *, file_size: int | None = None) -> None:
    """THE block validator: raise :class:`BlockCorruptError` at the first
    field of a decoded header that is not what the reader expects, with
    ``reason`` one of ``bad_size`` (the file's size is not header + padded
    payload), ``wrong_key``, ``wrong_namespace``, ``wrong_length``,
    ``unknown_group``, ``wrong_page_count``. Magic, version and the header
    checksum were checked by :func:`decode_header`; the payload checksum is
    :func:`check_payload`. O(1), no I/O."""
    if file_size is not None and file_size != block_file_size(h.payload_len):
        raise BlockCorruptError(
            "bad_size", f"file is {file_size} bytes, expected {block_file_size(h.payload_len)}"
        )
    if expect.key is not None and h.key != expect.key:
        raise BlockCorruptError("wrong_key", f"file holds {h.key!r}, expected {expect.key!r}")
    if expect.namespace_digest is not None and h.namespace_digest != expect.namespace_digest:
        raise BlockCorruptError(
            "wrong_namespace",
            f"file digest {h.namespace_digest.hex()}, expected {expect.namespace_digest.hex()}",
        )
    if expect.payload_len is not None and h.payload_len != expect.payload_len:
        raise BlockCorruptError("wrong_length", f"payload_len {h.payload_len}, expected {expect.payload_len}")
    if expect.group_page_bytes:
        want_page = expect.group_page_bytes.get(h.key.group_idx)
        if want_page is None:
            raise BlockCorruptError("unknown_group", f"group {h.key.group_idx} is not in the manifest")
        if h.page_bytes != want_page:
            raise BlockCorruptError("wrong_length", f"page_bytes {h.page_bytes}, expected {want_page}")
    if expect.max_pages is not None and not 1 <= h.page_count <= expect.max_pages:
        raise BlockCorruptError(
            "wrong_page_count", f"page_count {h.page_count}, expected 1..{expect.max_pages}"
        )


def check_payload(h: BlockHeader, checksum: int) -> None:
    """Raise :class:`BlockCorruptError` (``payload_checksum``) when the
    header records an xxh3-64 payload checksum other than ``checksum``."""
    if h.checksum_kind == ChecksumKind.XXH3_64 and checksum != h.payload_checksum:
        raise BlockCorruptError("payload_checksum", "payload bytes do not match checksum")
