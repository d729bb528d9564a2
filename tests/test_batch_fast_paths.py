"""The store/load hot path's batch-level shortcuts give exactly the per-key answers.

Each shortcut (keys built with no bytecode per key, names made by ``map``,
one shared outcome for a uniform native batch, the vLLM adapter's key and
slot conversion) is checked against the per-key code it stands for, and
every refusal of the per-key code still happens, with its own message.
"""

from __future__ import annotations

import os
from pathlib import Path

import io_worker
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fstier.errors import KeyFormatError
from fstier.file_mapper import encode, encode_many
from fstier.io import native
from fstier.io.iotypes import IOOptions, LoadStatus, StoreStatus
from fstier.keys import BlockKey, block_keys

needs_native = pytest.mark.skipif(native._ext is None, reason="native extension not built")
DIGEST, N = io_worker.DIGEST, io_worker.PAYLOAD


# ------------------------------------------------------------------ block_keys
@given(st.lists(st.tuples(st.binary(min_size=8, max_size=64), st.integers(0, 65535)), max_size=20))
def test_block_keys_match_the_validated_constructor(pairs: list[tuple[bytes, int]]) -> None:
    got = block_keys([h for h, _ in pairs], [g for _, g in pairs])
    want = [BlockKey(h, g) for h, g in pairs]
    assert got == want and [hash(k) for k in got] == [hash(k) for k in want]
    assert all(type(k) is BlockKey for k in got)
    for k in got:
        with pytest.raises(AttributeError):
            k.group_idx = 1  # type: ignore[misc]  # still frozen


@pytest.mark.parametrize(
    ("hashes", "groups", "words"),
    [
        ([b"a" * 16, b"short"], [0, 0], "8..64 bytes, got 5"),
        ([b"a" * 16, b"x" * 65], [0, 0], "got 65"),
        ([b"a" * 16, bytearray(16)], [0, 0], "must be bytes, got bytearray"),
        ([b"a" * 16, b"b" * 16], [0, True], "must be an int, got bool"),
        ([b"a" * 16, b"b" * 16], [0, np.int64(1)], "must be an int, got int64"),
        ([b"a" * 16, b"b" * 16], [0, 65536], "0..65535, got 65536"),
        ([b"a" * 16, b"b" * 16], [-1, 0], "0..65535, got -1"),
    ],
)
def test_block_keys_refuse_what_the_constructor_refuses(hashes: list, groups: list, words: str) -> None:
    with pytest.raises(KeyFormatError, match=words):
        block_keys(hashes, groups)


def test_block_keys_need_one_group_per_hash() -> None:
    with pytest.raises(ValueError, match="2 hashes but 1 groups"):
        block_keys([b"a" * 16, b"b" * 16], [0])
    assert block_keys([], []) == []


@given(st.lists(st.tuples(st.binary(min_size=8, max_size=64), st.integers(0, 65535)), max_size=20))
def test_encode_many_is_encode(pairs: list[tuple[bytes, int]]) -> None:
    keys = [BlockKey(h, g) for h, g in pairs]
    assert encode_many(keys) == [encode(k) for k in keys]
    assert encode_many(keys, "/root/blocks/") == ["/root/blocks/" + encode(k) for k in keys]


# ------------------------------------------------------- native batch outcomes
def _bufs(keys: list[BlockKey]) -> list[memoryview]:
    return [memoryview(bytearray(io_worker.payload_of(k, 3))) for k in keys]


@needs_native
def test_a_uniform_native_batch_shares_one_outcome_and_a_mixed_one_does_not(tmp_path: Path) -> None:
    keys = [io_worker.key_of(i) for i in range(6)]
    paths = [str(tmp_path / encode(k)) for k in keys]
    opts = IOOptions()
    first = native.store_batch(str(tmp_path), paths[:3], keys[:3], _bufs(keys[:3]), DIGEST, 1, opts)
    size = os.path.getsize(paths[0])  # header + padded payload: what a store writes
    assert [(o.status, o.nbytes, o.cause) for o in first] == [(StoreStatus.STORED, size, "")] * 3
    # 3 present (skipped), 3 new (stored): one outcome each, in order.
    mixed = native.store_batch(str(tmp_path), paths, keys, _bufs(keys), DIGEST, 1, opts)
    assert [o.status for o in mixed] == [StoreStatus.SKIPPED] * 3 + [StoreStatus.STORED] * 3
    assert [o.nbytes for o in mixed] == [0] * 3 + [size] * 3
    bufs = [memoryview(bytearray(N)) for _ in keys]
    loaded = native.load_batch(str(tmp_path), paths, keys, bufs, DIGEST, opts)
    assert [(o.status, o.nbytes) for o in loaded] == [(LoadStatus.LOADED, N)] * 6
    assert [bytes(b) for b in bufs] == [io_worker.payload_of(k, 3) for k in keys]
    # One corrupt file among loaded ones: judged key by key, removed, cause named.
    with open(paths[4], "r+b") as f:
        f.seek(os.path.getsize(paths[4]) - 4096 - 1)
        f.write(b"\xff")
    bufs = [memoryview(bytearray(N)) for _ in keys]
    loaded = native.load_batch(str(tmp_path), paths, keys, bufs, DIGEST, opts)
    assert [o.status for o in loaded] == [LoadStatus.LOADED] * 4 + [LoadStatus.CORRUPT, LoadStatus.LOADED]
    assert loaded[4].cause == "payload_checksum" and loaded[4].removed and not os.path.exists(paths[4])
    # The missing file is a miss next time, beside loaded ones.
    loaded = native.load_batch(str(tmp_path), paths, keys, [memoryview(bytearray(N)) for _ in keys], DIGEST, opts)
    assert loaded[4].status is LoadStatus.MISSING and loaded[5].status is LoadStatus.LOADED


@needs_native
def test_native_paths_outside_the_base_are_refused_by_name(tmp_path: Path) -> None:
    k = io_worker.key_of(1)
    inside = str(tmp_path / encode(k))
    with pytest.raises(ValueError, match="/elsewhere/x.bin' is not below the base directory"):
        native.store_batch(str(tmp_path), [inside, "/elsewhere/x.bin"], [k, k], _bufs([k, k]), DIGEST, 1, IOOptions())


# ------------------------------------------------------------- vLLM adapter
def test_vllm_keys_convert_as_block_key_does_and_stop_at_an_unnameable_key() -> None:
    pytest.importorskip("vllm")
    from fstier.integrations import vllm as fv

    good = [os.urandom(32) + g.to_bytes(4, "big") for g in (0, 1, 70000 % 65536)]
    short = b"abc" + (0).to_bytes(4, "big")  # a 3-byte hash: no fstier name
    big_group = os.urandom(16) + (70000).to_bytes(4, "big")
    ba = bytearray(good[1])
    for convert in (fv._block_keys, fv._new_block_keys):  # a load's (a look among the lookups' first), a store's
        assert convert(good) == [fv._block_key(k) for k in good]
        assert convert([*good[:2], short, good[2]]) == [fv._block_key(k) for k in good[:2]]
        assert convert([good[0], big_group]) == [fv._block_key(good[0])]
        # A bytearray key is named as before (bytes() of its hash), on the per-key path.
        assert convert([good[0], ba]) == [fv._block_key(good[0]), BlockKey(bytes(ba[:-4]), 1)]
        assert convert([]) == []


def test_vllm_chunk_ids_become_python_ints_other_types_are_refused() -> None:
    pytest.importorskip("vllm")
    from fstier.integrations import vllm as fv

    for ids in (np.arange(5, dtype=np.int32), np.arange(5, dtype=np.uint64), [0, 1, 2, 3, 4], range(5)):
        got = fv._slot_ints(ids)
        assert got == (0, 1, 2, 3, 4) and all(type(s) is int for s in got)
    # An id of another type would name another row than vLLM's (int(1.9) is row 1): refused, naming the ids.
    for bad in (np.array([1.9, 2.0]), np.array([True, False]), [0, 1.0], [True], [np.True_]):
        with pytest.raises(ValueError, match=r"chunk ids .* are not all integers"):
            fv._slot_ints(bad)
    assert fv._slot_ints([np.int64(3), np.uint8(1)]) == (3, 1)
