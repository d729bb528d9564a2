"""fstier: a filesystem tier for LLM KV-cache offloading.

Public names are re-exported here: everything an engine needs to wire
fstier end to end (docs/integration.md) is importable from ``fstier``,
including the types that the public functions take and return. Names whose
modules need torch or numpy (layout, gpu_copy) or start the tier (manager,
slots) are imported lazily on first attribute access, so ``import fstier`` and
``fstier --help`` stay cheap and torch-free.

The package, by folder: ``config``, ``keys``, ``file_mapper`` (what a block
is called and where its file lives); ``layout`` (canonical pages: how a
rank's KV cache maps onto tp-independent file bytes; ``PoolTensors``, a
pool's slots as tensors); ``slots`` (the shared host memory where ranks and
the tier meet, torch-free); ``clock`` (what the tier's timers read);
``gpu_copy`` (``RankStager``: device <-> host slots, per rank); ``io/`` (the
block-file format and the POSIX store/load path); ``manager`` (``FsTier``:
lookup, jobs, capacity, events, metrics); ``integrations/`` (engine
adapters); ``cli/`` (the ``fstier`` command).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fstier.clock import Clock
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
    MetricsUnavailableError,
    NamespaceMismatchError,
    PartialLoadError,
    PathSafetyError,
    PoolError,
    PoolExhaustedError,
    StorageError,
    TierClosedError,
)
from fstier.file_mapper import FileMapper, is_parallel_agnostic
from fstier.keys import BlockKey, chain_hashes, prefix_keys

__version__ = "0.1.0"

_LAZY = {
    "CrossLayerKVCaches": "fstier.cross_layer",
    "KVPacking": "fstier.layout",
    "KVRef": "fstier.layout",
    "LayerKVSpec": "fstier.cross_layer",
    "StateSpec": "fstier.cross_layer",
    "PoolTensors": "fstier.layout",
    "CopyStats": "fstier.gpu_copy",
    "TierEvent": "fstier.manager",
    "TierMetrics": "fstier.tier.metrics",
    "GcReport": "fstier.tier.gc",
    "VerifyReport": "fstier.tier.verify",
    "NamespaceVerify": "fstier.tier.verify",
    "BadFile": "fstier.tier.verify",
    "Unreadable": "fstier.tier.scan",
    "verify_root": "fstier.tier.verify",
    "SlotProvider": "fstier.slots.provider",
    "PageRun": "fstier.layout",
    "PageMapping": "fstier.layout",
    "rank_page_mapping": "fstier.layout",
    "CanonicalKVCaches": "fstier.layout",
    "LoadStoreSpec": "fstier.layout",
    "allocate_cross_layer_kv_caches": "fstier.cross_layer",
    "HostBlockPool": "fstier.slots.host_pool",
    "RankStager": "fstier.gpu_copy",
    "FsTier": "fstier.manager",
    "JobResult": "fstier.manager",
    "BlockStored": "fstier.manager",
    "BlockRemoved": "fstier.manager",
}

__all__ = [
    "BadFile",
    "BlockCorruptError",
    "BlockKey",
    "BlockRemoved",
    "BlockStored",
    "CanonicalKVCaches",
    "Clock",
    "ConfigError",
    "CopyStats",
    "CrossLayerKVCaches",
    "DirectIOUnsupportedError",
    "FileMapper",
    "FsTier",
    "FstierConfig",
    "FstierError",
    "GcReport",
    "HostBlockPool",
    "JobResult",
    "KVGroupSpec",
    "KVPacking",
    "KVRef",
    "KeyFormatError",
    "LayerKVSpec",
    "LayoutError",
    "LoadStoreSpec",
    "MetricsUnavailableError",
    "ModelSpec",
    "NamespaceMismatchError",
    "NamespaceVerify",
    "PageMapping",
    "PageRun",
    "ParallelSpec",
    "PartialLoadError",
    "PathSafetyError",
    "PoolError",
    "PoolExhaustedError",
    "PoolTensors",
    "RankStager",
    "SlotProvider",
    "StateSpec",
    "StorageError",
    "TierClosedError",
    "TierConfig",
    "TierEvent",
    "TierMetrics",
    "Unreadable",
    "VerifyReport",
    "__version__",
    "allocate_cross_layer_kv_caches",
    "chain_hashes",
    "is_parallel_agnostic",
    "load_config",
    "parse_config",
    "prefix_keys",
    "rank_page_mapping",
    "verify_root",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fstier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:  # pragma: no cover
    from fstier.cross_layer import (
        CrossLayerKVCaches,
        LayerKVSpec,
        StateSpec,
        allocate_cross_layer_kv_caches,
    )
    from fstier.gpu_copy import CopyStats, RankStager
    from fstier.layout import (
        CanonicalKVCaches,
        KVPacking,
        KVRef,
        LoadStoreSpec,
        PageMapping,
        PageRun,
        PoolTensors,
        rank_page_mapping,
    )
    from fstier.manager import BlockRemoved, BlockStored, FsTier, JobResult, TierEvent
    from fstier.slots.host_pool import HostBlockPool
    from fstier.slots.provider import SlotProvider
    from fstier.tier.gc import GcReport
    from fstier.tier.metrics import TierMetrics
    from fstier.tier.scan import Unreadable
    from fstier.tier.verify import BadFile, NamespaceVerify, VerifyReport, verify_root
