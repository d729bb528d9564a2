"""Block I/O: the on-disk format, atomic O_DIRECT stores, checked loads, the
dual-queue thread pool and its asyncio facade.

This is the storage side of fstier: it moves the bytes of host slots to and
from block files and knows nothing of GPUs, ranks or layouts (those are
``layout`` and ``gpu_copy``, the engine side). ``blockfile`` is the format,
``blockstore`` the store and load path, ``capabilities`` what a root's
filesystem can do (O_DIRECT, O_TMPFILE), ``fsops`` the syscall seam every
file operation goes through, ``tree`` and ``manifest`` what in a root is
fstier's, ``pool`` the threads that run the block store, ``aio`` the same
for asyncio callers; ``FsTier`` (``manager``) drives them. ``posix`` is the
old import path of the block store, kept for one release.

``fstier.io`` is torch-free: importing it never imports torch.
"""

from __future__ import annotations

from fstier.io.aio import AsyncBlockIO
from fstier.io.blockfile import (
    FORMAT_VERSION,
    HEADER_SIZE,
    BlockHeader,
    ChecksumKind,
    decode_header,
    encode_header,
    header_for_payload,
    padded_len,
    payload_checksum,
)
from fstier.io.blockstore import (
    BatchLoadResult,
    FileCheck,
    IOOptions,
    LoadOutcome,
    LoadRequest,
    LoadStatus,
    StoreOutcome,
    StoreRequest,
    StoreStatus,
    load_block,
    load_blocks,
    read_header,
    store_block,
    store_blocks,
    verify_file,
)
from fstier.io.capabilities import DirectIOSupport, RootCapabilities, probe_o_direct
from fstier.io.fsops import FS, aligned_buffer
from fstier.io.pool import OP_CANCELLED, OP_TIMED_OUT, IOPool, PoolJob

__all__ = [
    "FORMAT_VERSION",
    "FS",
    "HEADER_SIZE",
    "OP_CANCELLED",
    "OP_TIMED_OUT",
    "AsyncBlockIO",
    "BatchLoadResult",
    "BlockHeader",
    "ChecksumKind",
    "DirectIOSupport",
    "FileCheck",
    "IOOptions",
    "IOPool",
    "LoadOutcome",
    "LoadRequest",
    "LoadStatus",
    "PoolJob",
    "RootCapabilities",
    "StoreOutcome",
    "StoreRequest",
    "StoreStatus",
    "aligned_buffer",
    "decode_header",
    "encode_header",
    "header_for_payload",
    "load_block",
    "load_blocks",
    "padded_len",
    "payload_checksum",
    "probe_o_direct",
    "read_header",
    "store_block",
    "store_blocks",
    "verify_file",
]
