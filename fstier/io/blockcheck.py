"""A stored block file checked where it lies, without a caller's buffer and
without loading it: :func:`read_header` (the header alone) and
:func:`verify_file` (header, size, what the caller expects and, with
``full``, the payload checksum), the check behind ``fstier verify``, gc's
tests and the reliability suite.

Invariants
    One validator: every verdict comes from
    :func:`fstier.io.blockfile.check_block` / :func:`~fstier.io.blockfile.check_payload`,
    the functions the load path calls, so a file ``verify_file`` passes is a
    file a load accepts. No symlink is followed (``O_NOFOLLOW``), nothing is
    written or removed, and a hostile ``payload_len`` never causes a large
    allocation (the payload is streamed in 1 MiB chunks).

Costs
    ``read_header``: open, one ``pread`` of 4096 bytes, close.
    ``verify_file``: open, ``fstat``, the header read and, with ``full``, one
    ``pread`` per MiB of payload plus its XXH3-64.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import xxhash

from fstier.errors import BlockCorruptError
from fstier.io import fsops
from fstier.io.blockfile import (
    HEADER_SIZE,
    BlockHeader,
    ChecksumKind,
    Expected,
    check_block,
    check_payload,
    decode_header,
)
from fstier.io.fsops import O_CLOEXEC, O_NOFOLLOW, preadv_all
from fstier.keys import BlockKey

__all__ = ["FileCheck", "read_header", "verify_file"]


# ------------------------------------------------------------- CLI helpers
@dataclass(frozen=True, slots=True)
class FileCheck:
    """The verdict on one block file: ``ok``, the ``reason`` when not, the
    decoded header when it parsed, and the file size."""

    ok: bool
    reason: str
    header: BlockHeader | None
    size: int


def read_header(path: str | Path) -> BlockHeader:
    """Decode a block file's header (no payload read). Raises
    :class:`BlockCorruptError` for a bad header and ``OSError`` for I/O."""
    fd = fsops.FS.open(path, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC | os.O_NONBLOCK)
    try:
        buf = bytearray(HEADER_SIZE)
        got = preadv_all(fd, [memoryview(buf)], 0)
        if got < HEADER_SIZE:
            raise BlockCorruptError("short_header", f"{got} < {HEADER_SIZE} bytes")
        return decode_header(buf)
    finally:
        fsops.FS.close(fd)


def verify_file(
    path: str | Path,
    full: bool = True,
    *,
    key: BlockKey | None = None,
    namespace_digest: bytes | None = None,
    expect: Expected | None = None,
) -> FileCheck:
    """Check a block file without a caller buffer: header, size, what the
    caller expects (``expect``, or just ``key`` and ``namespace_digest``;
    :func:`fstier.io.blockfile.check_block`, the load's validator) and, with
    ``full``, the payload checksum (streamed in 1 MiB chunks, so a hostile
    length never causes a large allocation). Raises ``OSError`` for I/O."""
    if expect is None:
        expect = Expected(key=key, namespace_digest=namespace_digest)
    fd = fsops.FS.open(path, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = fsops.FS.fstat(fd)
        size = st.st_size
        if not stat.S_ISREG(st.st_mode):
            return FileCheck(False, "not_regular", None, size)
        buf = bytearray(HEADER_SIZE)
        if preadv_all(fd, [memoryview(buf)], 0) < HEADER_SIZE:
            return FileCheck(False, "short_header", None, size)
        try:
            h = decode_header(buf)
        except BlockCorruptError as exc:
            return FileCheck(False, exc.reason, None, size)
        try:
            check_block(h, expect, file_size=size)
            if full and h.checksum_kind == ChecksumKind.XXH3_64:
                hasher = xxhash.xxh3_64()
                chunk = bytearray(1 << 20)
                view = memoryview(chunk)
                left, off = h.payload_len, HEADER_SIZE
                while left:
                    want = min(left, len(chunk))
                    got = fsops.FS.preadv(fd, [view[:want]], off)
                    if got <= 0:
                        raise BlockCorruptError("short_read", f"payload ends {left} bytes early")
                    hasher.update(view[:got])
                    left -= got
                    off += got
                check_payload(h, hasher.intdigest())
        except BlockCorruptError as exc:
            return FileCheck(False, exc.reason, h, size)
        return FileCheck(True, "", h, size)
    finally:
        fsops.FS.close(fd)
