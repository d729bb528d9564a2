"""Old import path of :mod:`fstier.io.fsops`, kept for one release: import from there."""

from __future__ import annotations

from fstier.io.fsops import (
    HAVE_OPENAT2,
    open_nofollow,
    split_parent,
    unlink_if,
)

__all__ = ["HAVE_OPENAT2", "open_nofollow", "split_parent", "unlink_if"]
