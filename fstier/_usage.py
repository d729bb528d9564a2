"""Old import path of :mod:`fstier.tier.usage`, kept for one release: import from there."""

from __future__ import annotations

from fstier.tier.usage import (
    EVICT_LOCK_NAME,
    ROOT_FILES,
    USAGE_FILE_NAME,
    SharedUsage,
)

__all__ = ["EVICT_LOCK_NAME", "ROOT_FILES", "USAGE_FILE_NAME", "SharedUsage"]
