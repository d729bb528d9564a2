"""Old import path of the block store, kept for one release.

What was here now lives in three modules: :mod:`fstier.io.blockstore` (store,
load, verify one block file), :mod:`fstier.io.capabilities` (the O_DIRECT
probe and the O_TMPFILE switch) and :mod:`fstier.io.fsops` (the syscall seam
:data:`~fstier.io.fsops.FS` and aligned buffers). Import from there.
"""

from __future__ import annotations

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
    store_block_at,
    store_blocks,
    touch_file,
    verify_file,
)
from fstier.io.capabilities import DirectIOSupport, probe_o_direct
from fstier.io.fsops import FS, O_DIRECT, aligned_buffer, buffer_address

__all__ = [
    "FS",
    "O_DIRECT",
    "BatchLoadResult",
    "DirectIOSupport",
    "FileCheck",
    "IOOptions",
    "LoadOutcome",
    "LoadRequest",
    "LoadStatus",
    "StoreOutcome",
    "StoreRequest",
    "StoreStatus",
    "aligned_buffer",
    "buffer_address",
    "load_block",
    "load_blocks",
    "probe_o_direct",
    "read_header",
    "store_block",
    "store_block_at",
    "store_blocks",
    "touch_file",
    "verify_file",
]
