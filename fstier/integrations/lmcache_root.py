"""What :class:`~fstier.integrations.lmcache.FstierL2Adapter` answers
about its root, as a mixin of the adapter: lookups (with or without
LMCache's layout hints), ``delete``, ``list_l2_keys``, evictions heard as the
files go, and the root's chunks told to LMCache at start.

* A lookup asks the namespace of each key's layout hint or, without a
  usable hint (LMCache's check passes none, its benchmark a placeholder),
  every namespace of the key's model, rank, salt and hash form, open or on
  disk (:class:`~fstier.integrations.lmcache_spaces.DiskIndex`); a key
  present in any is a hit. Answered at once; hits are touched (the lock).
* ``delete`` removes from every namespace of a key's owner on the root, open
  or not (after a restart; another server's files on a shared root); a key
  fstier cannot name stays, the others go.
* An eviction (FsTier's ``on_evicted``, on a capacity thread) is LMCache's
  deletion at once, with the size it was told on store: the chunk's whole
  file (header and padded payload), the unit fstier counts against
  ``max_bytes``.
* At start, one walk of the root: every chunk file becomes LMCache's usage
  (per ``cache_salt``) and, as each listener registers (its L2 eviction
  policy), a stored key.

Every namespace used is pinned open for the call
(:meth:`~fstier.integrations.lmcache_spaces.Spaces.acquire`). Importing this
module imports LMCache (the adapter module imports it only once LMCache
did).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import ObjectKey

from fstier.integrations.lmcache_keys import (
    list_keys,
    parts_by_owner,
    present_positions,
    remove_keys,
)
from fstier.integrations.lmcache_space import MAX_GROUPS, Layout, hash_form, one_owner
from fstier.integrations.lmcache_spaces import DiskIndex, Spaces, key_of_path, walk_keys
from fstier.io import block_file_size

if TYPE_CHECKING:  # pragma: no cover
    from fstier.config import TierConfig
    from fstier.integrations.lmcache_tasks import Space

__all__ = ["RootOps"]

log = logging.getLogger("fstier.lmcache")


class RootOps:
    """The adapter's lookups, delete, listing, evictions and start-up seed
    (see the module docstring); the adapter sets the attributes below."""

    tier_config: TierConfig
    _reg: Spaces
    _index: DiskIndex
    _root: str
    _ids: Any
    _lock: threading.Lock
    _done_lookup: dict[int, Any]
    _seed: tuple[list[Any], list[int]]
    _seed_lock: threading.Lock
    _signal: Callable[[str], None]
    _space: Callable[[Any, Layout | None], Space | None]
    _notify_keys_stored: Callable[[list[Any], list[int]], None]
    _notify_keys_deleted: Callable[[list[Any], list[int]], None]

    def _evicted(self, path: str) -> None:
        """FsTier's ``on_evicted`` (a capacity thread): tell LMCache now
        that the chunk of ``path`` left the disk (whichever namespace of
        the root it was in)."""
        try:
            found = key_of_path(self._root, path, self._index, ObjectKey)
        except Exception:
            log.exception("fstier: cannot name the LMCache key of evicted %s", path)
            return
        if found is not None:
            self._notify_keys_deleted([found[0]], [found[1]])

    def _owner_spaces(self, key: Any, max_age: float | None = None) -> list[Space]:
        """Every namespace of ``key``'s model, rank, salt and hash form:
        those open and those on the root (opened), any layout."""
        owner = (key.model_name, int(key.kv_rank), key.cache_salt, hash_form(len(key.chunk_hash)))
        if owner[3] == -1 or not 0 <= int(key.object_group_id) < MAX_GROUPS:
            return []
        found = {s.sid: s for s in self._reg.of_owner(owner)}
        for sid in self._index.sids(owner, max_age):
            if sid not in found:
                space = self._reg.get(sid)
                if space is not None:
                    found[sid] = space
        return list(found.values())

    def _pinned(self, spaces: Any) -> list[Space]:
        """``spaces`` pinned open (:meth:`Spaces.acquire`); release each after."""
        out = []
        for s in spaces:
            p = self._reg.acquire(s)
            if p is not None:
                out.append(p)
        return out

    # -- lookup -------------------------------------------------------
    def _lookup_spaces(self, key: Any, layouts: dict[int, Layout | None]) -> list[Space]:
        """The namespaces a lookup asks for ``key``: the one of its group's
        layout hint, or without a usable hint (none, or LMCache's
        placeholder) every namespace of its owner (:meth:`_owner_spaces`)."""
        layout = layouts.get(int(key.object_group_id))
        if layout is None:
            return self._owner_spaces(key)
        space = self._space(key, layout)
        return [] if space is None else [space]

    def _lookup_space(self, keys: list[Any], layouts: dict[int, Layout | None]) -> list[Space] | None:
        """The namespaces of a lookup of one owner (:func:`one_owner`),
        found once; None: look each owner up on its own."""
        return self._lookup_spaces(keys[0], layouts) if keys and one_owner(keys) else None

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any) -> int:
        """Answered at once: one ``present`` batch per namespace; hits are
        touched (the lock; see the module docstring). Keys of one model,
        rank, salt, group and hash form (the common lookup) find their
        namespaces once; others one owner at a time. A key's namespace is
        its group's layout hint's, or, without a usable hint, any of its
        owner's on the root."""
        task_id = next(self._ids)
        bits = Bitmap(len(keys))
        pinned: list[Space] = []
        try:
            layouts: dict[int, Layout | None] = {}
            for gid, desc in dict(group_layout_descs or {}).items():
                layouts[int(gid)] = Layout.of(desc.shapes, desc.dtypes)
            raw: dict[Space, Any]
            one = self._lookup_space(keys, layouts)
            if one is not None:
                raw = dict.fromkeys(one, range(len(keys)))
            else:
                raw = parts_by_owner(keys, lambda k: self._lookup_spaces(k, layouts))
            parts: dict[Space, list[int]] = {}
            for space, positions in raw.items():
                p = self._reg.acquire(space)  # open until answered
                if p is not None:
                    pinned.append(p)
                    parts.setdefault(p, []).extend(positions)
            hits = present_positions(keys, parts)
            bits.batched_set(sorted(set(hits)) if len(parts) > 1 else hits)
        except Exception:
            log.exception("fstier: LMCache lookup of %d key(s) failed; they miss", len(keys))
            bits = Bitmap(len(keys))
        finally:
            for p in pinned:
                self._reg.release(p)
        with self._lock:
            self._done_lookup[task_id] = bits
        self._signal("lookup")
        return task_id

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        with self._lock:
            return self._done_lookup.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        """Nothing to release: a lookup's lock is a recency touch."""

    # -- delete, list, usage, status, close -------------------------------
    def delete(self, keys: list[Any]) -> None:
        """Remove ``keys``' files in every namespace of their model, rank,
        salt and hash form on the root (open or not: after a restart, or
        written by another server); LMCache is told of those removed. A
        key fstier cannot name stays; the others go."""
        pinned: list[Space] = []

        def spaces_of(k: Any) -> list[Space]:
            got = self._pinned(self._owner_spaces(k))
            pinned.extend(got)
            return got

        try:
            self._index.fields(max_age=0.0)  # the root's namespaces now, read once per delete
            removed, sizes = remove_keys(keys, spaces_of)
        except Exception:
            log.exception("fstier: LMCache delete of %d key(s) failed", len(keys))
            return
        finally:
            for p in pinned:
                self._reg.release(p)
        if removed:
            self._notify_keys_deleted(removed, sizes)

    def list_l2_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> Any:
        return list_keys(self.tier_config, model_name, page_size, cursor)

    def _seed_from_disk(self) -> None:
        """What the root holds when the adapter starts becomes LMCache's
        usage (per ``cache_salt``) and, as each listener registers (its L2
        eviction policy), stored keys: one walk of the root."""
        keys: list[Any] = []
        sizes: list[int] = []
        try:
            for _path, sid, h, group in walk_keys(self.tier_config, None):
                keys.append(ObjectKey(h, sid.model_name, sid.kv_rank, group, sid.cache_salt))
                sizes.append(block_file_size(sid.layout.nbytes))
        except Exception:
            log.exception("fstier: reading the chunks under %s failed; LMCache starts empty", self._root)
            return
        self._seed = (keys, sizes)
        if keys:
            self._notify_keys_stored(keys, sizes)

    def register_listener(self, listener: Any) -> None:
        """LMCache's ``register_listener``; the listener first hears of
        every chunk the root held at start (as stored)."""
        with self._seed_lock:
            keys, sizes = self._seed
            if keys:
                listener.on_l2_keys_stored(list(keys), list(sizes))
            super().register_listener(listener)  # type: ignore[misc]  # LMCache's, next in the MRO
