"""What LMCache chunks an fstier root holds: lookup, ``list_l2_keys`` and
``delete`` for :class:`~fstier.integrations.lmcache.FstierL2Adapter`.

* :func:`present_positions`: a lookup's hits, one
  :meth:`~fstier.manager.FsTier.present` batch per namespace (each a
  native call), hits touched; no bytecode per key (``block_keys``,
  ``compress``). :func:`parts_by_owner` splits a lookup of several owners
  (model, rank, salt, group) by namespace, one namespace answer per owner.

* :func:`list_keys`: every block file of every valid LMCache namespace
  under the root (a namespace whose manifest says ``engine: lmcache``; the
  walk is fstier's own, :mod:`fstier.tier.scan`'s rules: no
  symlink followed, temp and foreign files skipped), as LMCache's
  ``KeyEntry`` (the encoded ``ObjectKey`` and the chunk's payload bytes),
  sorted, paged by an offset cursor. Costs one walk of the root per page:
  an operator's call, not a hot path.
* :func:`remove_keys`: LMCache's ``delete`` (its own eviction or an
  operator): each key's file in every open namespace of its model,
  ``kv_rank`` and salt, through :meth:`~fstier.manager.FsTier.remove`: one
  batch per namespace (native: one GIL-free call; no Python syscall per
  key). The shared usage count drops by the removed bytes at once and a
  presence answer cached before the delete is forgotten: the next lookup
  misses (test_lmcache_adapter.py::test_delete_lowers_usage_and_misses_at_once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import compress
from typing import TYPE_CHECKING, Any

from fstier.integrations.lmcache_space import block_keys_of
from fstier.keys import BlockKey
from fstier.tier import scan

if TYPE_CHECKING:  # pragma: no cover
    from fstier.config import TierConfig
    from fstier.integrations.lmcache_tasks import Space
    from fstier.manager import FsTier

__all__ = ["list_keys", "parts_by_owner", "present_positions", "remove_keys"]


def parts_by_owner(keys: Sequence[Any], space_of: Callable[[Any], Space | None]) -> dict[Space, list[int]]:
    """The positions of ``keys`` by namespace, ``space_of`` asked once per
    owner (model, rank, salt, group); keys of no namespace are left out."""
    parts: dict[Space, list[int]] = {}
    seen: dict[tuple[Any, ...], Space | None] = {}
    for i, k in enumerate(keys):
        owner = (k.model_name, k.kv_rank, k.cache_salt, k.object_group_id)
        try:
            space = seen[owner]
        except KeyError:
            space = seen[owner] = space_of(k)
        if space is not None:
            parts.setdefault(space, []).append(i)
    return parts


def present_positions(keys: Sequence[Any], parts: dict[Space, list[int]]) -> list[int]:
    """The positions of ``keys`` whose files are present in their namespace
    (``parts``: positions by namespace), one ``present`` batch per
    namespace; the hits are touched (a lookup's lock)."""
    hits: list[int] = []
    for space, positions in parts.items():
        pkeys = keys if len(positions) == len(keys) else list(map(keys.__getitem__, positions))
        bkeys = block_keys_of(pkeys)
        present = space.tier.present(bkeys)
        if len(present) != len(bkeys):
            raise ValueError(f"{len(present)} answers for {len(bkeys)} keys")
        hits += compress(positions, present)
        space.tier.touch(list(compress(bkeys, present)))
    return hits


def _lmcache_namespaces(tier: TierConfig, model_name: str | None) -> Iterable[tuple[Any, dict[str, Any]]]:
    try:
        entries = sorted(scan.iter_namespace_dirs(tier.root_dir))
    except OSError:
        return
    for path, is_dir in entries:
        if not is_dir:
            continue
        manifest = scan.check_namespace(path).manifest
        if manifest is None:
            continue
        f = manifest.fields
        if f.get("engine") != "lmcache" or f.get("namespace_salt") != tier.namespace_salt:
            continue
        if model_name is not None and f.get("model") != model_name:
            continue
        yield path, f


def list_keys(tier: TierConfig, model_name: str | None, page_size: int, cursor: str | None) -> Any:
    """One page of LMCache ``KeyEntry`` for the chunks under ``tier``'s root."""
    from lmcache.v1.distributed.api import EncodedObjectKey, KeyEntry, KeyListPage, ObjectKey

    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"list_l2_keys: page_size must be a positive int, got {page_size!r}")
    try:
        start = 0 if cursor is None else int(cursor)
    except ValueError:
        raise ValueError(f"list_l2_keys: malformed cursor {cursor!r}") from None
    if start < 0:
        raise ValueError(f"list_l2_keys: malformed cursor {cursor!r}")
    found: list[tuple[str, Any]] = []
    for path, f in _lmcache_namespaces(tier, model_name):
        size = int(f.get("payload_bytes", 0))
        for e in scan.iter_namespace_files(path):
            if e.kind != "block" or e.key is None or e.rank is None:
                continue
            kv_rank = ObjectKey.ComputeKVRank(
                int(f["kv_world_size"]), e.rank, int(f["kv_local_world_size"]), int(f["kv_local_rank"])
            )
            key = EncodedObjectKey(e.key.hex, str(f["model"]), kv_rank, e.key.group_idx, str(f["cache_salt"]))
            found.append((e.path, KeyEntry(key, size)))
    found.sort(key=lambda t: t[0])
    page = tuple(entry for _, entry in found[start : start + page_size])
    end = start + len(page)
    return KeyListPage(page, str(end) if end < len(found) else None)


def remove_keys(
    keys: Iterable[Any], spaces: Iterable[tuple[Any, FsTier]], make_key: Callable[..., Any]
) -> tuple[list[Any], list[int]]:
    """Remove each LMCache key's file from every ``(space_id, tier)`` of
    its model, rank and salt; ``(keys removed, their payload bytes)``. One
    :meth:`~fstier.manager.FsTier.remove` per namespace (native: one GIL-free
    call; usage count and lookup cache updated once per batch)."""
    by_owner: dict[tuple[str, int, str], list[tuple[Any, FsTier]]] = {}
    for sid, tier in spaces:
        by_owner.setdefault((sid.model_name, sid.kv_rank, sid.cache_salt), []).append((sid, tier))
    batches: dict[int, tuple[Any, FsTier, list[Any]]] = {}
    for k in keys:
        for sid, tier in by_owner.get((k.model_name, int(k.kv_rank), k.cache_salt), []):
            if 0 <= int(k.object_group_id) < tier.mapper.num_groups:
                batches.setdefault(id(tier), (sid, tier, []))[2].append(k)
    removed: list[Any] = []
    sizes: list[int] = []
    for sid, tier, ks in batches.values():
        bkeys = [BlockKey(k.chunk_hash, int(k.object_group_id)) for k in ks]
        for k, ok in zip(ks, tier.remove(bkeys), strict=True):
            if ok:
                removed.append(make_key(k.chunk_hash, k.model_name, k.kv_rank, k.object_group_id, k.cache_salt))
                sizes.append(sid.layout.nbytes)
    return removed, sizes
