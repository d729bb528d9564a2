"""The block store contract (fstier.io.blockstore.BlockStore), one suite run
in every mode a root can put it in: O_DIRECT on and off, O_TMPFILE publication
and named temps (what NFS and FUSE roots get). A native backend behind
BlockStore must pass the same suite."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import make_config
from manager_support import TINY_GROUP, key, payload_for

from fstier.file_mapper import FileMapper, encode
from fstier.io.blockstore import BlockStore, IOOptions, LoadStatus, StoreStatus
from fstier.io.capabilities import RootCapabilities, probe_o_direct
from fstier.io.fsops import aligned_buffer, is_temp_name

N = 3 * 4096 + 100  # a payload that is not a multiple of 4096


@pytest.fixture(params=[(False, True), (False, False), (True, True), (True, False)], ids=["buffered-tmpfile", "buffered-named", "direct-tmpfile", "direct-named"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlockStore]:
    direct, tmpfile = request.param
    group = {**TINY_GROUP, "kind": "mamba", "page_size_bytes": N}
    mapper = FileMapper(make_config(tmp_path / "root", groups=[group]))
    mapper.ensure_manifest()
    caps = RootCapabilities(probe_o_direct(mapper.namespace_dir, "auto" if direct else "off"), tmpfile=tmpfile, root=mapper.root)
    if direct and not caps.o_direct.enabled:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    if tmpfile and not caps.tmpfile:
        pytest.skip("no O_TMPFILE on this platform")
    opts = IOOptions(o_direct=caps.o_direct.enabled, alignment=caps.o_direct.alignment, fsync="file+dir", capabilities=caps)
    bs = BlockStore(mapper, opts)
    bs.ensure_namespace()
    yield bs
    assert [p.name for p in mapper.root.rglob("*") if is_temp_name(p.name)] == []


def _payload(i: int) -> memoryview:
    buf = aligned_buffer(N + 4096)
    buf[:N] = payload_for(key(i), N)
    return buf[:N]


def test_store_then_load_round_trips_exactly_the_payload(store: BlockStore) -> None:
    assert store.store(key(1), _payload(1)).status is StoreStatus.STORED
    assert store.exists(key(1)) and not store.exists(key(2))
    out = aligned_buffer(N + 4096)
    out[:] = b"\xee" * len(out)
    res = store.load(key(1), out[:N])
    assert res.status is LoadStatus.LOADED and res.nbytes == N
    assert bytes(out[:N]) == payload_for(key(1), N)
    assert bytes(out[N:]) == b"\xee" * (len(out) - N)  # nothing past the payload is written


def test_the_file_is_where_the_codec_says(store: BlockStore) -> None:
    store.store(key(3), _payload(3))
    assert store.path(key(3)) == f"{store.mapper.blocks_dir}/{encode(key(3))}"
    assert os.path.getsize(store.path(key(3))) == 4096 + 4 * 4096


def test_a_present_key_is_skipped_unless_replaced(store: BlockStore) -> None:
    assert store.store(key(4), _payload(4)).status is StoreStatus.STORED
    assert store.store(key(4), _payload(4)).status is StoreStatus.SKIPPED
    assert store.store(key(4), _payload(4), replace=True).status is StoreStatus.STORED


def test_a_missing_key_is_a_miss(store: BlockStore) -> None:
    assert store.load(key(5), aligned_buffer(N)[:N]).status is LoadStatus.MISSING


def test_a_corrupt_file_is_never_loaded_and_is_removed(store: BlockStore) -> None:
    store.store(key(6), _payload(6))
    path = store.path(key(6))
    raw = bytearray(Path(path).read_bytes())
    raw[4096 + 17] ^= 0x01
    Path(path).write_bytes(bytes(raw))
    res = store.load(key(6), aligned_buffer(N)[:N])
    assert res.status is LoadStatus.CORRUPT and res.cause == "payload_checksum" and res.removed
    assert not store.exists(key(6))


def test_a_file_of_another_key_is_corrupt(store: BlockStore) -> None:
    store.store(key(7), _payload(7))
    store.store(key(8), _payload(8))
    Path(store.path(key(8))).write_bytes(Path(store.path(key(7))).read_bytes())
    res = store.load(key(8), aligned_buffer(N)[:N])
    assert res.status is LoadStatus.CORRUPT and res.cause == "wrong_key" and res.removed


def test_remove(store: BlockStore) -> None:
    store.store(key(9), _payload(9))
    assert store.remove(key(9)) and not store.exists(key(9))
    assert not store.remove(key(9))


def test_directories_removed_under_the_store_are_made_again(store: BlockStore) -> None:
    import shutil

    store.store(key(10), _payload(10))
    shutil.rmtree(store.mapper.namespace_dir)
    assert store.store(key(11), _payload(11)).status is StoreStatus.STORED
    assert (store.mapper.namespace_dir / "config.json").is_file()


def test_batches_give_one_outcome_per_item_in_order(store: BlockStore) -> None:
    items = [(key(20 + i), _payload(20 + i)) for i in range(4)]
    assert [o.status for o in store.store_many(items)] == [StoreStatus.STORED] * 4
    bufs = [aligned_buffer(N)[:N] for _ in range(5)]
    outs = store.load_many([(key(20 + i), bufs[i]) for i in range(4)] + [(key(99), bufs[4])])
    assert [o.status for o in outs] == [LoadStatus.LOADED] * 4 + [LoadStatus.MISSING]
    assert all(bytes(bufs[i]) == payload_for(key(20 + i), N) for i in range(4))


def test_native_batches_keep_the_contract(store: BlockStore) -> None:
    """The batch methods on the native backend (one call per batch): the same
    outcomes, files and promises as the Python path, including the keys a
    batch hands back to the per-key path (a fan-out directory removed under
    the store, a file to replace)."""
    fast = BlockStore(store.mapper, store.options, native_io="auto")
    if not fast.batched:
        pytest.skip(f"native path not selected: {fast.io_path.reason}")
    assert fast.batch_bounds(64, 4) == (0, 16, 32, 48, 64)
    assert fast.batch_bounds(3, 4) == (0, 3)  # never calls smaller than NATIVE_MIN_BATCH
    assert store.batch_bounds(3, 4) == (0, 1, 2, 3)  # the Python path: one key per batch
    items = [(key(30 + i), _payload(30 + i)) for i in range(4)]
    assert [o.status for o in fast.store_many(items)] == [StoreStatus.STORED] * 4
    assert [o.nbytes for o in fast.store_many(items)] == [0] * 4  # all SKIPPED
    assert [o.status for o in fast.store_many(items)] == [StoreStatus.SKIPPED] * 4
    # written by the native path, read back by the Python path (same bytes, same files)
    buf = aligned_buffer(N)[:N]
    assert store.load(key(31), buf).status is LoadStatus.LOADED and bytes(buf) == payload_for(key(31), N)
    # a key to replace, and a namespace removed under the store (the batch
    # fails ENOENT): both handed to the per-key path
    assert [o.status for o in fast.store_many(items[:1], replace=[True])] == [StoreStatus.STORED]
    import shutil

    shutil.rmtree(store.mapper.namespace_dir)
    assert [o.status for o in fast.store_many(items[1:3])] == [StoreStatus.STORED] * 2
    assert (store.mapper.namespace_dir / "config.json").is_file()
    # a corrupt file is never loaded and is removed; a missing key is a miss
    path = store.path(key(32))
    raw = bytearray(Path(path).read_bytes())
    raw[4096 + 5] ^= 0x01
    Path(path).write_bytes(bytes(raw))
    bufs = [aligned_buffer(N)[:N] for _ in range(3)]
    outs = fast.load_many([(key(31), bufs[0]), (key(32), bufs[1]), (key(30), bufs[2])])
    assert [o.status for o in outs] == [LoadStatus.LOADED, LoadStatus.CORRUPT, LoadStatus.MISSING]
    assert outs[1].cause == "payload_checksum" and outs[1].removed and not store.exists(key(32))
    assert bytes(bufs[0]) == payload_for(key(31), N)
    assert fast.store_many([]) == [] and fast.load_many([]) == []
