"""Old import path of :mod:`fstier.canonical`, kept for one release: import from there."""

from __future__ import annotations

from fstier.canonical import (
    CANONICAL_LAYOUT_VERSION,
    canonical_format_id,
    canonical_page_bytes,
    cp_local_tokens,
    cp_rank,
    cp_world,
    head_ranks,
    is_certified,
    local_heads,
    local_layer_count,
    local_page_bytes,
    model_format_id,
    pp_layer_range,
    rank_private_slice_bytes,
)

__all__ = ["CANONICAL_LAYOUT_VERSION", "canonical_format_id", "canonical_page_bytes", "cp_local_tokens", "cp_rank", "cp_world", "head_ranks", "is_certified", "local_heads", "local_layer_count", "local_page_bytes", "model_format_id", "pp_layer_range", "rank_private_slice_bytes"]
