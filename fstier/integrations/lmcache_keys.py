"""What LMCache chunks an fstier root holds: lookup, ``list_l2_keys`` and
``delete`` for :class:`~fstier.integrations.lmcache.FstierL2Adapter`.

* :func:`present_positions`: a lookup's hits, one
  :meth:`~fstier.manager.FsTier.present` batch per namespace (each a
  native call), hits touched; no bytecode per key (``block_keys``,
  ``compress``). :func:`parts_by_owner` splits a lookup of several owners
  (model, rank, salt, group, hash length) by namespace: one namespace per
  owner under a layout hint, every namespace of the owner without one.

* :func:`list_keys`: every block file of every valid LMCache namespace
  under the root (:func:`~fstier.integrations.lmcache_spaces.walk_keys`:
  fstier's own walk, :mod:`fstier.tier.scan`'s rules: no symlink followed,
  temp and foreign files skipped), as LMCache's ``KeyEntry`` (the encoded
  ``ObjectKey`` and the chunk file's bytes), sorted, paged by an offset
  cursor. Costs one walk of the root per page: an operator's call, not a
  hot path.
* :func:`remove_keys`: LMCache's ``delete`` (its own eviction or an
  operator): each key's file in every namespace of its model, ``kv_rank``,
  salt and hash form on the root (open in this process or not, written by
  it or by another server), through :meth:`~fstier.manager.FsTier.remove`:
  one batch per namespace (native: one GIL-free call; no Python syscall
  per key). The shared usage count drops by the removed bytes at once and
  a presence answer cached before the delete is forgotten: the next lookup
  misses (test_lmcache_adapter.py::test_delete_lowers_usage_and_misses_at_once).
  A key fstier cannot name is not removed; the others are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import compress
from typing import TYPE_CHECKING, Any

from fstier.integrations.lmcache_space import MAX_GROUPS, block_keys_of, hash_form
from fstier.integrations.lmcache_spaces import walk_keys
from fstier.io import block_file_size

if TYPE_CHECKING:  # pragma: no cover
    from fstier.config import TierConfig
    from fstier.integrations.lmcache_tasks import Space

__all__ = ["list_keys", "parts_by_owner", "present_positions", "remove_keys"]


def parts_by_owner(
    keys: Sequence[Any], spaces_of: Callable[[Any], Sequence[Space]]
) -> dict[Space, list[int]]:
    """The positions of ``keys`` by namespace, ``spaces_of`` asked once per
    owner (model, rank, salt, group, hash length): every namespace a key may
    be in (one under a layout hint, each of its owner's without one); keys
    of no namespace are left out."""
    parts: dict[Space, list[int]] = {}
    seen: dict[tuple[Any, ...], Sequence[Space]] = {}
    for i, k in enumerate(keys):
        owner = (k.model_name, k.kv_rank, k.cache_salt, k.object_group_id, len(k.chunk_hash))
        try:
            spaces = seen[owner]
        except KeyError:
            spaces = seen[owner] = spaces_of(k)
        for space in spaces:
            parts.setdefault(space, []).append(i)
    return parts


def present_positions(keys: Sequence[Any], parts: dict[Space, list[int]]) -> list[int]:
    """The positions of ``keys`` whose files are present in their namespace
    (``parts``: positions by namespace), one ``present`` batch per
    namespace; the hits are touched (a lookup's lock)."""
    hits: list[int] = []
    for space, positions in parts.items():
        pkeys = keys if len(positions) == len(keys) else list(map(keys.__getitem__, positions))
        bkeys = space.keys.block_keys(pkeys)  # a load of the hits finds them built
        present = space.tier.present(bkeys)
        if len(present) != len(bkeys):
            raise ValueError(f"{len(present)} answers for {len(bkeys)} keys")
        hits += compress(positions, present)
        space.tier.touch(list(compress(bkeys, present)))
    return hits


def list_keys(tier: TierConfig, model_name: str | None, page_size: int, cursor: str | None) -> Any:
    """One page of LMCache ``KeyEntry`` for the chunks under ``tier``'s root
    (each with its file's bytes, the size LMCache's usage is told)."""
    from lmcache.v1.distributed.api import EncodedObjectKey, KeyEntry, KeyListPage

    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"list_l2_keys: page_size must be a positive int, got {page_size!r}")
    try:
        start = 0 if cursor is None else int(cursor)
    except ValueError:
        raise ValueError(f"list_l2_keys: malformed cursor {cursor!r}") from None
    if start < 0:
        raise ValueError(f"list_l2_keys: malformed cursor {cursor!r}")
    found = [
        (path, KeyEntry(
            EncodedObjectKey(h.hex(), sid.model_name, sid.kv_rank, group, sid.cache_salt),
            block_file_size(sid.layout.nbytes),
        ))
        for path, sid, h, group in walk_keys(tier, model_name)
    ]
    found.sort(key=lambda t: t[0])
    page = tuple(entry for _, entry in found[start : start + page_size])
    end = start + len(page)
    return KeyListPage(page, str(end) if end < len(found) else None)


def remove_keys(
    keys: Sequence[Any], spaces_of: Callable[[Any], Sequence[Space]]
) -> tuple[list[Any], list[int]]:
    """Remove each LMCache key's file from every namespace ``spaces_of`` gives
    for its owner (open; the caller keeps them open until this returns);
    ``(keys removed, their file bytes)``. One
    :meth:`~fstier.manager.FsTier.remove` per namespace (native: one GIL-free
    call; usage count and lookup cache updated once per batch). A key fstier
    cannot name (a hash over 64 bytes, a group out of range, a malformed
    key) is not removed; the others are (one bad key fails itself only)."""
    by_owner: dict[tuple[Any, ...], list[Any]] = {}
    for k in keys:
        try:
            owner = (k.model_name, int(k.kv_rank), k.cache_salt, hash_form(len(k.chunk_hash)))
            if isinstance(k.chunk_hash, bytes) and 0 <= int(k.object_group_id) < MAX_GROUPS and owner[3] != -1:
                by_owner.setdefault(owner, []).append(k)
        except Exception:
            continue
    removed: list[Any] = []
    sizes: list[int] = []
    for ks in by_owner.values():
        bkeys = block_keys_of(ks)
        gone = [False] * len(ks)
        for space in spaces_of(ks[0]):
            for i, ok in enumerate(space.tier.remove(bkeys)):
                if ok and not gone[i]:
                    gone[i] = True
                    removed.append(ks[i])
                    sizes.append(space.file_bytes)
    return removed, sizes
