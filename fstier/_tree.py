"""Old import path of :mod:`fstier.io.tree` and :mod:`fstier.io.manifest` (and of
the naming constants now in :mod:`fstier.file_mapper`), kept for one release."""

from __future__ import annotations

from fstier.file_mapper import BLOCK_NAME_RE, MANIFEST_NAME, canonical_json
from fstier.io.manifest import (
    MANIFEST_MAX_BYTES,
    Manifest,
    ManifestFields,
    parse_json_object,
    parse_manifest,
    read_manifest,
    read_manifest_bytes,
)
from fstier.io.tree import (
    FileKind,
    NamespaceDir,
    TreeFile,
    check_namespace,
    classify,
    iter_namespace_dirs,
    iter_namespace_files,
    iter_root,
)

__all__ = [
    "BLOCK_NAME_RE",
    "MANIFEST_MAX_BYTES",
    "MANIFEST_NAME",
    "Manifest",
    "ManifestFields",
    "canonical_json",
    "parse_json_object",
    "parse_manifest",
    "read_manifest",
    "read_manifest_bytes",
    "check_namespace", "classify", "FileKind", "iter_namespace_dirs", "iter_namespace_files", "iter_root", "NamespaceDir", "TreeFile"]
