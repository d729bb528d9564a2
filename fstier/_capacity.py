"""Old import path of :mod:`fstier.tier.gc`, kept for one release: import from there."""

from __future__ import annotations

from fstier.tier.gc import (
    DEFAULT_MAX_CANDIDATES,
    UNLINK_THREADS,
    GcReport,
    UsageScan,
    collect_garbage,
    is_block_name,
    key_from_block_name,
    scan_usage,
)

__all__ = ["DEFAULT_MAX_CANDIDATES", "UNLINK_THREADS", "collect_garbage", "GcReport", "is_block_name", "key_from_block_name", "scan_usage", "UsageScan"]
