"""``fstier gc``: LRU eviction down to a size and a stale temp-file sweep.

A thin wrapper over :func:`fstier._capacity.collect_garbage`, the very code
FsTier's background capacity manager runs, applied to a whole root (every
namespace in it) with both watermarks at 1.0: the operator asked for
``--max-bytes`` and gets at most that, no hysteresis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fstier._capacity import collect_garbage

__all__ = ["run_gc"]


def run_gc(root: Path, max_bytes: int, *, dry_run: bool, temp_max_age_s: float) -> dict[str, Any]:
    """Run one gc over ``root``; returns the JSON-ready result."""
    rep = collect_garbage(
        root,
        max_bytes,
        low_watermark=1.0,
        high_watermark=1.0,
        temp_max_age_s=temp_max_age_s,
        dry_run=dry_run,
    )
    return {
        "root": str(root),
        "dry_run": dry_run,
        "max_bytes": max_bytes,
        "files_before": rep.scanned_files,
        "bytes_before": rep.scanned_bytes,
        "evicted_files": rep.removed_files,
        "evicted_bytes": rep.removed_bytes,
        "kept_recently_used": rep.kept_recently_used,
        "temp_removed": rep.temp_removed,
        "temp_removed_bytes": rep.temp_removed_bytes,
        "bytes_after": rep.final_bytes,
        "errors": rep.errors,
        "passes": rep.passes,
        "seconds": round(rep.seconds, 3),
    }
