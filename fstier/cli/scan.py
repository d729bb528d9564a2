"""Old import path of the streaming root walk: it lives in
:mod:`fstier.tier.scan` (a library result, printed by ``fstier inspect`` and
``fstier verify``). Kept as a thin re-export for one release."""

from __future__ import annotations

from fstier.io.tree import FileKind
from fstier.tier.scan import (
    NAMESPACE_NAME,
    FileEntry,
    NamespaceStats,
    ScanReport,
    Unreadable,
    inspect_root,
    is_namespace_dir,
    iter_namespace_dirs,
    iter_namespace_files,
    read_manifest,
    scan_namespace,
    scan_root,
)

__all__ = [
    "FileEntry",
    "FileKind",
    "NamespaceStats",
    "ScanReport",
    "Unreadable",
    "NAMESPACE_NAME",
    "inspect_root",
    "is_namespace_dir",
    "iter_namespace_dirs",
    "iter_namespace_files",
    "read_manifest",
    "scan_namespace",
    "scan_root",
]
