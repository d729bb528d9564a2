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

This package exports the names below, each defined in one module: what
code outside ``io/`` needs of the storage layer (the tier, the command line,
the engines' adapters) comes from here, never from a module of ``io/``
(tests/test_layers.py::test_nothing_outside_io_imports_its_modules).
``fstier.io`` is torch-free: importing it never imports torch.
"""

from __future__ import annotations

from fstier.io.aio import AsyncBlockIO
from fstier.io.blockcheck import FileCheck, verify_file
from fstier.io.blockfile import FORMAT_VERSION, HEADER_SIZE, BlockHeader, Expected, block_file_size, padded_len
from fstier.io.blockstore import BlockStore
from fstier.io.capabilities import RootCapabilities, probe_o_direct
from fstier.io.engine import CANCELLED, EXPIRED, TIMED_OUT, EngineJob, Registration, shared_engine
from fstier.io.fsops import FS, aligned_buffer, touch_file, unlink_if_same
from fstier.io.heldtree import empty_held_dir, held_tree_size, open_held_dir, rmdir_if_same
from fstier.io.iotypes import IOOptions, LoadOutcome, LoadStatus, StoreOutcome, StoreStatus
from fstier.io.manifest import Manifest
from fstier.io.native import NativeStatus
from fstier.io.native import status as native_status
from fstier.io.tree import (
    FileKind,
    TreeFile,
    check_namespace,
    iter_namespace_dirs,
    iter_namespace_files,
    iter_root,
)

__all__ = [
    "CANCELLED",
    "EXPIRED",
    "FORMAT_VERSION",
    "FS",
    "HEADER_SIZE",
    "TIMED_OUT",
    "AsyncBlockIO",
    "BlockHeader",
    "BlockStore",
    "EngineJob",
    "Expected",
    "FileCheck",
    "FileKind",
    "IOOptions",
    "LoadOutcome",
    "LoadStatus",
    "Manifest",
    "NativeStatus",
    "Registration",
    "RootCapabilities",
    "StoreOutcome",
    "StoreStatus",
    "TreeFile",
    "aligned_buffer",
    "block_file_size",
    "check_namespace",
    "empty_held_dir",
    "held_tree_size",
    "iter_namespace_dirs",
    "iter_namespace_files",
    "iter_root",
    "native_status",
    "open_held_dir",
    "padded_len",
    "probe_o_direct",
    "rmdir_if_same",
    "shared_engine",
    "touch_file",
    "unlink_if_same",
    "verify_file",
]
