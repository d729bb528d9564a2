"""Block keys and deterministic prefix hashes.

A :class:`BlockKey` names one block of one KV group: a hash of the token
prefix that produced it (8..64 bytes) and the group index. :func:`chain_hashes`
computes the hashes of the full blocks of a token sequence with xxh3-128,
chained so that a block's hash covers its whole prefix. The result depends
only on the token ids, the block size and the seed: never on Python's hash
seed, the process or the machine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from typing import TYPE_CHECKING

import xxhash

from fstier.errors import KeyFormatError

if TYPE_CHECKING:  # numpy is imported where hashing needs it: `fstier --help` stays light
    import numpy as np

__all__ = ["BlockKey", "block_keys", "chain_hashes", "prefix_keys"]

MIN_HASH_BYTES = 8
MAX_HASH_BYTES = 64
_MAX = MAX_HASH_BYTES


@dataclass(frozen=True, slots=True)
class BlockKey:
    """One block of one KV group. Frozen and hashable; validated on creation."""

    block_hash: bytes
    group_idx: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.block_hash, bytes):
            raise KeyFormatError(
                f"BlockKey.block_hash must be bytes, got {type(self.block_hash).__name__}"
            )
        n = len(self.block_hash)
        if not MIN_HASH_BYTES <= n <= MAX_HASH_BYTES:
            raise KeyFormatError(
                f"BlockKey.block_hash must be {MIN_HASH_BYTES}..{MAX_HASH_BYTES} bytes, got {n}"
            )
        if isinstance(self.group_idx, bool) or not isinstance(self.group_idx, int):
            raise KeyFormatError(
                f"BlockKey.group_idx must be an int, got {type(self.group_idx).__name__}"
            )
        if not 0 <= self.group_idx < 65536:
            raise KeyFormatError(f"BlockKey.group_idx must be in 0..65535, got {self.group_idx}")

    @property
    def hex(self) -> str:
        return self.block_hash.hex()

    def __repr__(self) -> str:
        return f"BlockKey({self.hex[:16]}…, group={self.group_idx})"


_NEW = object.__new__
#: the slots' own setters: they skip the frozen ``__setattr__`` (only
#: :func:`block_keys` uses them, after checking the whole batch)
_SET_HASH = vars(BlockKey)["block_hash"].__set__
_SET_GROUP = vars(BlockKey)["group_idx"].__set__


def block_keys(hashes: Sequence[bytes], groups: Sequence[int]) -> list[BlockKey]:
    """``[BlockKey(h, g) for h, g in zip(hashes, groups)]`` for a hot path's
    batch: the same checks, made once over the batch with C-level loops
    (``map``, ``min``, ``max``), and the keys built with no bytecode per key.
    An empty batch, a batch whose lengths differ and a batch with any key
    :class:`BlockKey` would refuse take :func:`_block_keys_one_by_one`, so
    the first bad key raises its own :class:`KeyFormatError`
    (test_batch_fast_paths.py::test_block_keys_match_the_validated_constructor)."""
    # Every test a C-level loop over the batch (bool is not int here, as in __post_init__).
    if not (len(hashes) == len(groups) > 0 and set(map(type, hashes)) == {bytes} and set(map(type, groups)) == {int}
            and min(groups) >= 0 and max(groups) < 65536 and min(map(len, hashes)) >= MIN_HASH_BYTES
            and max(map(len, hashes)) <= _MAX):
        return _block_keys_one_by_one(hashes, groups)
    keys = list(map(_NEW, repeat(BlockKey, len(hashes))))
    deque(chain(map(_SET_HASH, keys, hashes), map(_SET_GROUP, keys, groups)), maxlen=0)
    return keys


def _block_keys_one_by_one(hashes: Sequence[bytes], groups: Sequence[int]) -> list[BlockKey]:
    """:func:`block_keys` of a batch it does not build at once: each key by the validated constructor."""
    if len(hashes) != len(groups):
        raise ValueError(f"block_keys: {len(hashes)} hashes but {len(groups)} groups")
    return list(map(BlockKey, hashes, groups))


def chain_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int, seed: bytes = b"") -> list[bytes]:
    """Hash every full block of ``token_ids``; hash i covers tokens [0, (i+1)*block_size).

    ``h_i = xxh3_128(h_{i-1} || tokens_i as little-endian int64)`` with
    ``h_{-1} = xxh3_128(b"fstier-chain-v1" || seed)``. A trailing partial block
    is not hashed (it is never stored).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if not isinstance(seed, bytes):
        raise ValueError(f"seed must be bytes, got {type(seed).__name__}")
    import numpy as np

    tokens = np.asarray(token_ids, dtype="<i8").reshape(-1)
    num_full = len(tokens) // block_size
    prev = xxhash.xxh3_128(b"fstier-chain-v1" + seed).digest()
    out: list[bytes] = []
    raw = tokens[: num_full * block_size].tobytes()
    step = block_size * 8
    for i in range(num_full):
        prev = xxhash.xxh3_128(prev + raw[i * step : (i + 1) * step]).digest()
        out.append(prev)
    return out


def prefix_keys(
    token_ids: Sequence[int] | np.ndarray, block_size: int, group_idx: int = 0, seed: bytes = b""
) -> list[BlockKey]:
    """:func:`chain_hashes` wrapped as :class:`BlockKey` of one group."""
    return [BlockKey(h, group_idx) for h in chain_hashes(token_ids, block_size, seed)]
