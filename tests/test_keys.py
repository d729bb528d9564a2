"""Block keys: validation, hashing, and determinism across processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fstier.errors import KeyFormatError
from fstier.keys import BlockKey, chain_hashes, prefix_keys


def test_blockkey_is_frozen_and_hashable() -> None:
    a = BlockKey(b"\x01" * 16, 0)
    b = BlockKey(b"\x01" * 16, 0)
    assert a == b and hash(a) == hash(b)
    assert BlockKey(b"\x01" * 16, 1) != a
    with pytest.raises(AttributeError):
        a.group_idx = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("hash_", "group", "words"),
    [
        (b"short", 0, "8..64 bytes, got 5"),
        (b"x" * 65, 0, "got 65"),
        ("0123456789abcdef", 0, "must be bytes"),
        (b"x" * 16, -1, "0..65535, got -1"),
        (b"x" * 16, True, "must be an int"),
        (b"x" * 16, 1.0, "must be an int"),
    ],
)
def test_blockkey_validation(hash_: object, group: object, words: str) -> None:
    with pytest.raises(KeyFormatError, match=words):
        BlockKey(hash_, group)  # type: ignore[arg-type]


def test_chain_hashes_only_full_blocks_and_chained() -> None:
    toks = list(range(50))
    hs = chain_hashes(toks, 16)
    assert len(hs) == 3 and all(len(h) == 16 for h in hs)
    # A change in block 0 changes every later hash (the chain covers the prefix).
    toks2 = [999] + toks[1:]
    hs2 = chain_hashes(toks2, 16)
    assert all(a != b for a, b in zip(hs, hs2, strict=True))
    # A change in block 2 leaves blocks 0 and 1 alone.
    toks3 = toks[:40] + [7] + toks[41:]
    assert chain_hashes(toks3, 16)[:2] == hs[:2] and chain_hashes(toks3, 16)[2] != hs[2]
    # The seed separates caches.
    assert chain_hashes(toks, 16, seed=b"tenant-a") != hs


def test_chain_hashes_golden() -> None:
    # Pins the hash function: changing it silently would orphan every cache.
    assert chain_hashes(list(range(32)), 16)[1].hex() == GOLDEN_HASH





def test_chain_hashes_same_in_other_processes_with_other_hash_seeds() -> None:
    code = "from fstier.keys import chain_hashes; print(chain_hashes(list(range(64)), 16)[-1].hex())"
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.check_output([sys.executable, "-c", code], env=env, text=True).strip())
    assert outs == {chain_hashes(list(range(64)), 16)[-1].hex()}


@given(st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=200),
       st.integers(min_value=1, max_value=32))
def test_chain_hashes_prefix_property(tokens: list[int], bs: int) -> None:
    full = chain_hashes(tokens, bs)
    assert len(full) == len(tokens) // bs
    cut = (len(tokens) // 2 // bs) * bs
    assert chain_hashes(tokens[:cut], bs) == full[: cut // bs]


def test_prefix_keys_and_bad_block_size() -> None:
    keys = prefix_keys(range(32), 16, group_idx=2)
    assert [k.group_idx for k in keys] == [2, 2]
    with pytest.raises(ValueError, match="block_size"):
        chain_hashes([1, 2], 0)
GOLDEN_HASH = "2b84e67b3791bd89d09ecacbb10cb464"
