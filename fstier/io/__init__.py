"""Block I/O: the on-disk format, atomic O_DIRECT stores, checked loads, the
job engine's asyncio facade.

This is the storage side of fstier: it moves the bytes of host slots to and
from block files and knows nothing of GPUs, ranks or layouts (those are
``layout`` and ``gpu_copy``, the engine side). The face for a namespace's
block I/O is :class:`BlockStore` (``blockstore``): every store, load,
presence check, named removal and clear of a namespace's blocks goes through
it, on the backend it is given (native: ``native``, one GIL-free call per
batch; Python: ``_blockio``, key by key). Walking a root is ``tree``'s (scan,
verify and eviction walk it), and eviction and ``verify --fix`` unlink the
files they walked themselves, each only if it is still the file that was
judged (``fsops.unlink_if_same``). ``blockfile`` is the format, ``blockcheck`` the
check of a stored file, ``iotypes`` the options and outcomes, ``capabilities``
what a root's filesystem can do (O_DIRECT, O_TMPFILE), ``fsops`` the
syscall seam every Python-path file operation goes through and the atomic
small-file write, ``tree`` and ``manifest`` what in a root is fstier's,
``engine`` the job engine whose threads run the block store's jobs (one per
process, every namespace a registration), ``aio`` its face for asyncio
callers; ``FsTier`` (``manager``) drives them.

This package exports the names below, each defined in one module.
``fstier.io`` is torch-free: importing it never imports torch.
"""

from __future__ import annotations

from fstier.io.aio import AsyncBlockIO
from fstier.io.blockcheck import FileCheck, verify_file
from fstier.io.blockfile import FORMAT_VERSION, HEADER_SIZE, BlockHeader
from fstier.io.blockstore import BlockStore
from fstier.io.capabilities import RootCapabilities, probe_o_direct
from fstier.io.fsops import aligned_buffer
from fstier.io.iotypes import IOOptions, LoadOutcome, LoadStatus, StoreOutcome, StoreStatus

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "AsyncBlockIO",
    "BlockHeader",
    "BlockStore",
    "FileCheck",
    "IOOptions",
    "LoadOutcome",
    "LoadStatus",
    "RootCapabilities",
    "StoreOutcome",
    "StoreStatus",
    "aligned_buffer",
    "probe_o_direct",
    "verify_file",
]
