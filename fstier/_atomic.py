"""Old import path of :mod:`fstier.io.fsops`, kept for one release: import from there."""

from __future__ import annotations

from fstier.io.fsops import (
    TEMP_MARKER,
    atomic_write,
    fsync_dir,
    is_temp_name,
    temp_path_for,
)

__all__ = ["TEMP_MARKER", "atomic_write", "fsync_dir", "is_temp_name", "temp_path_for"]
