"""Removing block files on the caller's word: :meth:`FsTier.remove
<fstier.manager.FsTier.remove>` (named keys) and :meth:`FsTier.clear
<fstier.manager.FsTier.clear>` (the whole namespace).

Both keep the tier's own books in step with the disk, once per batch: the
lookup cache forgets every key asked about (a presence answer cached before
the removal is never served after it: the next lookup probes the file), and
the shared usage count drops by the removed files' bytes at once (it does
not wait for the capacity thread's next pass to re-count them).

Costs
    :func:`remove_blocks`: ONE
    :meth:`~fstier.io.blockstore.BlockStore.remove_many` call (native: one
    GIL-free ``remove_batch``; Python: one unlink per key), one cache lock,
    one usage update. :func:`clear_blocks`: one walk of the namespace and
    one unlink per file (an operator's call, not a hot path).

Invariant: a removed file's bytes are the size fstier writes for its key
(:func:`~fstier.io.blockfile.block_file_size` of its group's payload), the
rule every other usage update follows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from fstier.errors import StorageError
from fstier.io import BlockStore, block_file_size
from fstier.keys import BlockKey
from fstier.tier.capacity import Capacity
from fstier.tier.lookup import LookupCache

__all__ = ["clear_blocks", "clear_namespace", "remove_blocks"]

log = logging.getLogger("fstier.manager")


def remove_blocks(
    blocks: BlockStore, cache: LookupCache, capacity: Capacity, payload_len: Sequence[int],
    keys: Sequence[BlockKey],
) -> list[bool]:
    """Remove each key's file in one batch; per key, whether a file was
    removed. The cache forgets every key; the usage count drops by the
    removed files' bytes."""
    if not keys:
        return []
    removed = blocks.remove_many(keys)
    cache.forget(keys)
    freed = sum(block_file_size(payload_len[k.group_idx]) for k, ok in zip(keys, removed, strict=True) if ok)
    capacity.add(-freed)
    return removed


def clear_blocks(
    blocks: BlockStore, cache: LookupCache, capacity: Capacity, on_error: Callable[[OSError], None]
) -> list[BlockKey]:
    """Remove every block file of ``blocks``' namespace (see
    :meth:`~fstier.io.blockstore.BlockStore.clear`); the keys removed. The
    cache is cleared; the usage count drops by the bytes removed."""
    removed = blocks.clear(on_error)
    cache.clear()
    capacity.add(-sum(size for _, size in removed))
    return [k for k, _ in removed]


def clear_namespace(
    blocks: BlockStore, cache: LookupCache, capacity: Capacity, publish: Callable[[tuple[BlockKey, ...]], None]
) -> int:
    """:func:`clear_blocks`, then ``publish`` the keys removed (the tier's
    one ``BlockRemoved(keys, "cleared")`` event) and log how many; a file it
    could not remove raises :class:`~fstier.errors.StorageError` naming the
    first. How many files it removed."""
    errors: list[OSError] = []
    removed = clear_blocks(blocks, cache, capacity, errors.append)
    if removed:
        publish(tuple(removed))
    log.info("fstier: cleared %d block file(s) under %s", len(removed), blocks.mapper.blocks_dir)
    if errors:
        where = f"{len(errors)} file(s) under {blocks.mapper.blocks_dir}"
        raise StorageError(f"clear: {where} not removed, first: {errors[0]}", errors[0].errno)
    return len(removed)
