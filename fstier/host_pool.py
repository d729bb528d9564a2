"""Old import path of :mod:`fstier.slots.host_pool`, kept for one release: import from there."""

from __future__ import annotations

from fstier.slots.host_pool import (
    ALIGN,
    HostBlockPool,
)

__all__ = ["ALIGN", "HostBlockPool"]
