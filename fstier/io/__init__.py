"""Block I/O: the on-disk format, atomic O_DIRECT stores, checked loads, the
dual-queue thread pool and its asyncio facade.

This is the storage side of fstier: it moves the bytes of host slots to and
from block files and knows nothing of GPUs, ranks or layouts (those are
``layout`` and ``gpu_copy``, the engine side). ``blockfile`` is the format,
``posix`` the store and load path, ``pool`` the threads that run them,
``aio`` the same for asyncio callers; ``FsTier`` (``manager``) drives them.

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
from fstier.io.pool import OP_CANCELLED, OP_TIMED_OUT, IOPool, PoolJob
from fstier.io.posix import (
    FS,
    BatchLoadResult,
    DirectIOSupport,
    FileCheck,
    IOOptions,
    LoadOutcome,
    LoadRequest,
    LoadStatus,
    StoreOutcome,
    StoreRequest,
    StoreStatus,
    aligned_buffer,
    load_block,
    load_blocks,
    probe_o_direct,
    read_header,
    store_block,
    store_blocks,
    verify_file,
)

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
