"""fstier: a filesystem tier for LLM KV-cache offloading.

Public names are re-exported here. Names whose modules need torch
(layout, gpu_copy, manager) are imported lazily on first attribute access, so
``import fstier`` and ``fstier --help`` stay cheap and torch-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fstier.config import (
    FstierConfig,
    KVGroupSpec,
    ModelSpec,
    ParallelSpec,
    TierConfig,
    load_config,
    parse_config,
)
from fstier.errors import (
    BlockCorruptError,
    ConfigError,
    DirectIOUnsupportedError,
    FstierError,
    KeyFormatError,
    LayoutError,
    NamespaceMismatchError,
    PartialLoadError,
    PathSafetyError,
    PoolError,
    PoolExhaustedError,
    StorageError,
)
from fstier.file_mapper import FileMapper, is_parallel_agnostic
from fstier.keys import BlockKey, chain_hashes, prefix_keys

__version__ = "0.1.0"

_LAZY = {
    "PageRun": "fstier.layout",
    "PageMapping": "fstier.layout",
    "rank_page_mapping": "fstier.layout",
    "CanonicalKVCaches": "fstier.layout",
    "LoadStoreSpec": "fstier.layout",
    "allocate_cross_layer_kv_caches": "fstier.layout",
    "HostBlockPool": "fstier.host_pool",
    "RankStager": "fstier.gpu_copy",
    "FsTier": "fstier.manager",
    "JobResult": "fstier.manager",
    "BlockStored": "fstier.manager",
    "BlockRemoved": "fstier.manager",
}

__all__ = [
    "BlockCorruptError",
    "BlockKey",
    "BlockRemoved",
    "BlockStored",
    "CanonicalKVCaches",
    "ConfigError",
    "DirectIOUnsupportedError",
    "FileMapper",
    "FsTier",
    "FstierConfig",
    "FstierError",
    "HostBlockPool",
    "JobResult",
    "KVGroupSpec",
    "KeyFormatError",
    "LayoutError",
    "LoadStoreSpec",
    "ModelSpec",
    "NamespaceMismatchError",
    "PageMapping",
    "PageRun",
    "ParallelSpec",
    "PartialLoadError",
    "PathSafetyError",
    "PoolError",
    "PoolExhaustedError",
    "RankStager",
    "StorageError",
    "TierConfig",
    "__version__",
    "allocate_cross_layer_kv_caches",
    "chain_hashes",
    "is_parallel_agnostic",
    "load_config",
    "parse_config",
    "prefix_keys",
    "rank_page_mapping",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fstier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:  # pragma: no cover
    from fstier.gpu_copy import RankStager
    from fstier.host_pool import HostBlockPool
    from fstier.layout import (
        CanonicalKVCaches,
        LoadStoreSpec,
        PageMapping,
        PageRun,
        allocate_cross_layer_kv_caches,
        rank_page_mapping,
    )
    from fstier.manager import BlockRemoved, BlockStored, FsTier, JobResult
