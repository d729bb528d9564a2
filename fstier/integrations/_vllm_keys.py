r"""vLLM's keys and chunk ids as fstier's :class:`~fstier.keys.BlockKey`\ s and slot indices
(the :mod:`fstier.integrations.vllm` adapter's submit and lookups).

Invariants
    A vLLM ``OffloadKey`` is its block hash then its group as 4 big-endian
    bytes; its BlockKey is a function of those bytes alone, so the BlockKeys
    a lookup built (:func:`remember_keys`) are the ones a later load of the
    same keys takes (:func:`_block_keys`), shared by every tier of the
    process; a key with no fstier name (a hash outside 8..64 bytes) is None
    there and ends a job's submitted keys.

Costs
    A lookup: one BlockKey per key, kept in a dict of at most ``_SEEN_MAX``
    keys (~3 MiB; cleared whole past it). A load of looked-up keys: one
    ``map`` of ``dict.get``; a store (new keys): :func:`fstier.keys.block_keys`,
    no bytecode per key.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from operator import index, itemgetter
from typing import Any

import numpy as np

from fstier.errors import KeyFormatError
from fstier.keys import BlockKey, block_keys


def _block_key(key: bytes) -> BlockKey | None:
    """vLLM's OffloadKey (hash + 4-byte big-endian group) as a BlockKey, or None (a hash outside 8..64 bytes)."""
    try:
        return BlockKey(bytes(key[:-4]), int.from_bytes(key[-4:], "big"))
    except KeyFormatError:
        return None


#: numpy's array type and its integer kinds (vLLM's chunk ids): numpy is imported by vLLM already
_NDARRAY, _INT_KINDS = type(np.empty(0)), ("i", "u")
_IS_BOOL = (bool, np.bool_).__contains__
#: vLLM's OffloadKey: the block hash, then the group as 4 big-endian bytes
_HASH_PART, _GROUP_PART = itemgetter(slice(None, -4)), itemgetter(slice(-4, None))
_GROUP_INT = partial(int.from_bytes, byteorder="big")
#: vLLM keys' BlockKeys (None: no fstier name) as lookups built them, for the loads that follow; at most _SEEN_MAX
_SEEN: dict[bytes, BlockKey | None] = {}
_SEEN_MAX = 16384


def _block_keys(keys: Sequence[bytes]) -> list[BlockKey]:
    """:func:`_block_key` of each of a load's keys, up to the first that has no fstier name (the job's keys from
    there on are not submitted). A job whose every key a lookup built lately: those, one ``map`` of ``dict.get``;
    else :func:`_new_block_keys`."""
    try:
        found = list(map(_SEEN.get, keys))
        if all(found):  # a BlockKey is truthy; a key not seen, or with no fstier name, is None
            return found  # type: ignore[return-value]
    except TypeError:  # a key that is not hashable (a bytearray)
        return _keys_one_by_one(keys)
    return _new_block_keys(keys)


def _new_block_keys(keys: Sequence[bytes]) -> list[BlockKey]:
    """:func:`_block_key` of each of a store's keys (new keys: no look among the lookups' BlockKeys), up to the
    first that has no fstier name: no bytecode per key (:func:`fstier.keys.block_keys`: :class:`BlockKey`'s
    checks once over the batch)."""
    try:  # (a key that is not bytes or has a bad hash: TypeError or KeyFormatError, key by key below)
        return block_keys(list(map(_HASH_PART, keys)), list(map(_GROUP_INT, map(_GROUP_PART, keys))))
    except (KeyFormatError, TypeError):
        return _keys_one_by_one(keys)


def _keys_one_by_one(keys: Sequence[bytes]) -> list[BlockKey]:
    """:func:`_block_key` of each key, up to the first that has none."""
    out: list[BlockKey] = []
    for k in keys:
        b = _block_key(k)
        if b is None:
            break
        out.append(b)
    return out


def remember_keys(keys: Sequence[bytes]) -> list[BlockKey | None]:
    """:func:`_block_key` of each of a lookup's keys, kept for the loads that follow (at most ``_SEEN_MAX``)."""
    bkeys = [_block_key(k) for k in keys]
    if len(_SEEN) + len(bkeys) > _SEEN_MAX:  # bounded: ~3 MiB of keys, BlockKeys and entries
        _SEEN.clear()
    _SEEN.update(zip(keys, bkeys, strict=True))
    return bkeys


def _slot_ints(chunk_ids: Any) -> tuple[int, ...]:
    """vLLM's chunk ids (a numpy array, or any sequence of ints) as Python ints: a 1-D int array by ``tolist``,
    anything else by ``operator.index`` (an integer type); a float or bool id is a ValueError naming the ids (it
    would name another row than vLLM's: ``int(1.9)`` is row 1), which fails the job as a refusal."""
    if type(chunk_ids) is _NDARRAY and chunk_ids.ndim == 1 and chunk_ids.dtype.kind in _INT_KINDS:
        return tuple(chunk_ids.tolist())
    ids = list(chunk_ids)
    try:
        if not any(map(_IS_BOOL, map(type, ids))):
            return tuple(map(index, ids))
    except TypeError:
        pass
    raise ValueError(f"vLLM's chunk ids {ids!r} are not all integers: each is a row of the primary tier (a float "
                     "or bool id would name another row); the job fails and its keys are recomputed")
