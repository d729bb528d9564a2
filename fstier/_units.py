"""Old import path of :mod:`fstier.units`, kept for one release: import from there."""

from __future__ import annotations

from fstier.units import (
    MAX_SIZE,
    format_size,
    parse_size,
)

__all__ = ["MAX_SIZE", "format_size", "parse_size"]
