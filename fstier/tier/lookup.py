"""Lookup's parts: the short-lived answer cache and the existence probe.

A lookup answers from :class:`LookupCache` (present/absent answers that
live ``tier.lookup_cache_ttl_s``, and the *bad* set: keys whose load failed,
never a hit again until stored again) or from ``lstat`` calls
(:func:`exist_many`; a FIFO, socket or directory at a block path is a miss).
Costs: a cached answer is one dict lookup under one lock per batch; an
uncached one is one ``lstat`` (~3 us warm, ~80 us cold). Memory is bounded:
at most 2**20 answers and 2**18 bad keys.
"""

from __future__ import annotations

import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Sequence

from fstier.keys import BlockKey

__all__ = ["LookupCache", "exist_many", "is_block_file"]

_CACHE_MAX_ENTRIES = 1 << 20
_BAD_MAX_ENTRIES = 1 << 18


class LookupCache:
    """Short-lived present/absent answers plus the *bad* set (keys whose load
    failed; never a hit until stored again). One lock; batch methods take it
    once per batch."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl = ttl_s
        self._entries: dict[BlockKey, tuple[bool, float]] = {}
        self._bad: OrderedDict[BlockKey, None] = OrderedDict()
        self._lock = threading.Lock()

    def get_many(self, keys: Sequence[BlockKey], now: float) -> list[bool | None]:
        out: list[bool | None] = []
        with self._lock:
            entries, bad = self._entries, self._bad
            for k in keys:
                if k in bad:
                    out.append(False)
                    continue
                e = entries.get(k)
                out.append(e[0] if e is not None and e[1] > now else None)
        return out

    def put_many(self, keys: Sequence[BlockKey], present: bool, now: float) -> None:
        if self.ttl <= 0 or not keys:
            return
        expiry = now + self.ttl
        with self._lock:
            if len(self._entries) + len(keys) > _CACHE_MAX_ENTRIES:
                self._entries = {k: v for k, v in self._entries.items() if v[1] > now}
                if len(self._entries) + len(keys) > _CACHE_MAX_ENTRIES:
                    self._entries.clear()
            for k in keys:
                self._entries[k] = (present, expiry)

    def stored(self, keys: Sequence[BlockKey], now: float) -> None:
        """Keys now present on disk (stored, or found present by a store)."""
        with self._lock:
            for k in keys:
                self._bad.pop(k, None)
        self.put_many(keys, True, now)

    def mark_bad(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            for k in keys:
                self._entries.pop(k, None)
                self._bad[k] = None
                self._bad.move_to_end(k)
            while len(self._bad) > _BAD_MAX_ENTRIES:
                self._bad.popitem(last=False)

    def is_bad(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._bad

    def forget(self, keys: Sequence[BlockKey]) -> None:
        """Keys whose files were removed: drop any cached answer."""
        with self._lock:
            for k in keys:
                self._entries.pop(k, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def is_block_file(path: str) -> bool:
    """True when ``path`` is a regular file (not followed if a symlink). A
    FIFO, socket or directory planted at a block path is a miss here, not a
    hit whose load then fails; lstat costs what ``os.path.exists`` does."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return False


def exist_many(paths: Sequence[str]) -> list[bool]:
    return [is_block_file(p) for p in paths]
