"""The block store contract (fstier.io.blockstore.BlockStore), one suite run
on both backends (native: one call per batch; Python: key by key) in every
mode a root can put it in: O_DIRECT on and off, O_TMPFILE publication and
named temps (what NFS and FUSE roots get). Every test runs on both backends;
the native one is skipped only where the extension is not built."""

from __future__ import annotations

import errno
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import make_config
from manager_support import TINY_GROUP, key, payload_for

from fstier.errors import ConfigError
from fstier.file_mapper import FileMapper, encode
from fstier.io import native
from fstier.io.blockstore import BlockStore
from fstier.io.capabilities import RootCapabilities, probe_o_direct
from fstier.io.fsops import aligned_buffer, is_temp_name
from fstier.io.iotypes import IOOptions, LoadStatus, StoreStatus
from fstier.io.manifest import ensure_manifest
from fstier.io.native import NativeStatus
from fstier.keys import BlockKey

N = 3 * 4096 + 100  # a payload that is not a multiple of 4096


def _backend(name: str) -> NativeStatus:
    if name == "python":
        return native.python_backend()
    try:
        return native.native_backend()
    except ConfigError as exc:
        pytest.skip(f"native extension not built: {exc}")


@pytest.fixture(params=["python", "native"])
def backend(request: pytest.FixtureRequest) -> Iterator[NativeStatus]:
    b = _backend(request.param)
    yield b
    native.clear_faults()


def _make_store(root: Path, backend: NativeStatus, direct: bool, tmpfile: bool) -> BlockStore:
    group = {**TINY_GROUP, "kind": "mamba", "page_size_bytes": N}
    mapper = FileMapper(make_config(root, groups=[group]))
    ensure_manifest(mapper)
    caps = RootCapabilities(
        probe_o_direct(mapper.namespace_dir, "auto" if direct else "off"), tmpfile=tmpfile, root=mapper.root
    )
    if direct and not caps.o_direct.enabled:
        pytest.skip(f"{root} refuses O_DIRECT")
    if tmpfile and not caps.tmpfile:
        pytest.skip("no O_TMPFILE on this platform")
    opts = IOOptions(
        o_direct=caps.o_direct.enabled, alignment=caps.o_direct.alignment, fsync="file+dir", capabilities=caps
    )
    bs = BlockStore(mapper, opts, backend)
    bs.ensure_namespace()
    return bs


@pytest.fixture(
    params=[(False, True), (False, False), (True, True), (True, False)],
    ids=["buffered-tmpfile", "buffered-named", "direct-tmpfile", "direct-named"],
)
def store(request: pytest.FixtureRequest, tmp_path: Path, backend: NativeStatus) -> Iterator[BlockStore]:
    direct, tmpfile = request.param
    (tmp_path / "root").mkdir()
    bs = _make_store(tmp_path / "root", backend, direct, tmpfile)
    yield bs
    assert [p.name for p in bs.mapper.root.rglob("*") if is_temp_name(p.name)] == []


def _spread(i: int) -> BlockKey:
    """Keys ``_spread(0..255)`` each in their own fan-out directory."""
    return BlockKey(bytes([i]) * 16, 0)


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


def test_remove_many(store: BlockStore, tmp_path: Path) -> None:
    """One answer per key, in order, across fan-out directories; a missing
    file is False; a symlink at a block's name is removed, its target kept."""
    keys = [_spread(i) for i in (1, 2, 3, 4)]
    for i, k in zip((1, 2, 3, 4), keys, strict=True):
        store.store(k, _payload(i))
    target = tmp_path / "target"
    target.write_bytes(b"not a block")
    link = _spread(5)
    Path(store.path(link)).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, store.path(link))
    got = store.remove_many([keys[0], _spread(9), keys[2], link, keys[1]])
    assert got == [True, False, True, True, True]
    assert [store.exists(k) for k in keys] == [False, False, False, True]
    assert not os.path.lexists(store.path(link)) and target.read_bytes() == b"not a block"
    assert store.remove_many([]) == []


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


def test_batch_bounds_follow_the_backend(store: BlockStore) -> None:
    if store.batched:  # native: at most `threads` calls, never smaller than batching.NATIVE_MIN_BATCH
        assert store.batch_bounds(64, 4) == (0, 16, 32, 48, 64)
        assert store.batch_bounds(3, 4) == (0, 3)
    else:  # Python: one key per batch (each key its own op, with its own deadline)
        assert store.batch_bounds(3, 4) == (0, 1, 2, 3)


def test_batch_plan_is_one_call_with_helpers_on_the_native_path(store: BlockStore) -> None:
    """Native: a job is one call; its other threads are C helpers inside it
    (never more threads than keys / batching.NATIVE_MIN_BATCH). Python: one key per
    call, no helpers."""
    if store.batched:
        assert store.batch_plan(64, 8) == ((0, 64), 7)
        assert store.batch_plan(64, 4) == ((0, 64), 3)
        assert store.batch_plan(12, 8) == ((0, 12), 2)  # 3 threads of 4 keys
        assert store.batch_plan(3, 8) == ((0, 3), 0)
        assert store.batch_plan(64, 1) == ((0, 64), 0)
    else:
        assert store.batch_plan(3, 8) == ((0, 1, 2, 3), 0)


def test_batches_hand_back_what_they_cannot_finish(store: BlockStore) -> None:
    """Keys a native batch hands to the per-key path (a file to replace, a
    namespace removed under the store) end as on the Python path; skipped
    stores write nothing; a file written by one backend is read by the other."""
    items = [(key(30 + i), _payload(30 + i)) for i in range(4)]
    assert [o.status for o in store.store_many(items)] == [StoreStatus.STORED] * 4
    again = store.store_many(items)
    assert [o.status for o in again] == [StoreStatus.SKIPPED] * 4 and [o.nbytes for o in again] == [0] * 4
    other = BlockStore(store.mapper, store.options, native.python_backend() if store.batched else _backend("native"))
    buf = aligned_buffer(N)[:N]
    assert other.load(key(31), buf).status is LoadStatus.LOADED and bytes(buf) == payload_for(key(31), N)
    assert [o.status for o in store.store_many(items[:1], replace=[True])] == [StoreStatus.STORED]
    shutil.rmtree(store.mapper.namespace_dir)
    assert [o.status for o in store.store_many(items[1:3])] == [StoreStatus.STORED] * 2
    assert (store.mapper.namespace_dir / "config.json").is_file()
    path = store.path(key(32))
    raw = bytearray(Path(path).read_bytes())
    raw[4096 + 5] ^= 0x01
    Path(path).write_bytes(bytes(raw))
    bufs = [aligned_buffer(N)[:N] for _ in range(3)]
    outs = store.load_many([(key(31), bufs[0]), (key(32), bufs[1]), (key(30), bufs[2])])
    assert [o.status for o in outs] == [LoadStatus.LOADED, LoadStatus.CORRUPT, LoadStatus.MISSING]
    assert outs[1].cause == "payload_checksum" and outs[1].removed and not store.exists(key(32))
    assert bytes(bufs[0]) == payload_for(key(31), N)
    assert store.store_many([]) == [] and store.load_many([]) == [] and store.present_many([]) == []


# ------------------------------------------------------------- presence
def test_present_many_answers_per_key_in_order(store: BlockStore) -> None:
    store.store_many([(key(i), _payload(i)) for i in (40, 42, 43)])
    ks = [key(i) for i in range(40, 45)]
    assert store.present_many(ks) == [True, False, True, True, False]
    assert store.present_many(ks, prefix=True) == [True, False, False, False, False]
    assert store.present_many(ks[2:], prefix=True) == [True, True, False]
    shutil.rmtree(store.mapper.namespace_dir)
    assert store.present_many(ks) == [False] * 5  # nothing to find, nothing raised


def test_present_many_is_false_for_every_hostile_file(
    store: BlockStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a regular file at the block's name, reached with no symlink on
    the way, is present: a FIFO, socket, directory or symlink there is not,
    nor a real block file reached through a symlinked fan-out directory. A
    foreign regular file at the name is present (its load then refuses it)."""
    real, fifo, sock, dirk, link, foreign, via, absent = (_spread(i) for i in range(0x50, 0x58))
    store.store(real, _payload(50))
    for k in (fifo, sock, dirk, link, foreign):
        Path(store.path(k)).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(store.path(fifo))
    s = socket.socket(socket.AF_UNIX)
    try:
        monkeypatch.chdir(Path(store.path(sock)).parent)  # AF_UNIX paths are short
        s.bind(Path(store.path(sock)).name)
        os.mkdir(store.path(dirk))
        os.symlink(store.path(real), store.path(link))
        Path(store.path(foreign)).write_bytes(b"not a block file")
        # `via`'s fan-out directory is a symlink to a directory holding a
        # real block file of that name
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        store.store(via, _payload(56))
        fan = Path(store.path(via)).parent
        shutil.copy(store.path(via), elsewhere / Path(store.path(via)).name)
        shutil.rmtree(fan)
        fan.symlink_to(elsewhere, target_is_directory=True)
        assert os.path.isfile(store.path(via))  # a per-path lstat would say present
        ks = [real, fifo, sock, dirk, link, foreign, via, absent]
        want = [True, False, False, False, False, True, False, False]
        assert store.present_many(ks) == want
        assert [store.exists(k) for k in ks] == want
    finally:
        s.close()


# ------------------------------------------------------ one key, one fate
def test_one_refused_key_fails_alone(store: BlockStore, tmp_path: Path) -> None:
    """A key the store refuses (its fan-out directory is a symlink: a
    PathSafetyError on the per-key path) is that key's FAILED outcome; the
    keys beside it in the batch are stored and say so. On the native backend
    every key is handed to the per-key path (an injected ENOENT on each
    directory open), which is where the refusal used to fail the whole batch
    (0 of 8 reported stored, 7 on disk)."""
    ks = [_spread(0x60 + i) for i in range(8)]
    victim = ks[3]
    outside = tmp_path / "outside"
    outside.mkdir()
    fan = Path(store.path(victim)).parent
    fan.parent.mkdir(parents=True, exist_ok=True)
    fan.symlink_to(outside, target_is_directory=True)
    if store.batched:
        native.fault("opendir", errno.ENOENT, times=-1)
        native.fault("mkdir", errno.ENOENT, times=-1)
    outs = store.store_many([(k, _payload(60 + i)) for i, k in enumerate(ks)])
    native.clear_faults()
    assert [o.status for o in outs] == [StoreStatus.STORED] * 3 + [StoreStatus.FAILED] + [StoreStatus.STORED] * 4
    assert outs[3].cause == "PathSafetyError" and "symlink" in outs[3].detail
    assert [os.path.isfile(store.path(k)) for k in ks if k != victim] == [True] * 7
    assert list(outside.iterdir()) == []


# ------------------------------------------------------ non-UTF-8 roots
@pytest.mark.parametrize("tmpfile", [True, False], ids=["tmpfile", "named"])
def test_a_root_path_that_is_not_utf8_works(tmp_path: Path, backend: NativeStatus, tmpfile: bool) -> None:
    """Paths are bytes end to end (os.fsencode): a root named b"r\\xff\\xfe"
    (legal on Linux) stores, finds and loads on both backends."""
    root = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/r\xff\xfe"))
    root.mkdir()
    bs = _make_store(root, backend, False, tmpfile)
    items = [(key(70 + i), _payload(70 + i)) for i in range(5)]
    outs = bs.store_many(items)
    assert [o.status for o in outs] == [StoreStatus.STORED] * 5, outs
    assert bs.present_many([k for k, _ in items] + [key(99)]) == [True] * 5 + [False]
    bufs = [aligned_buffer(N)[:N] for _ in items]
    outs = bs.load_many([(k, b) for (k, _), b in zip(items, bufs, strict=True)])
    assert [o.status for o in outs] == [LoadStatus.LOADED] * 5
    assert all(bytes(b) == payload_for(k, N) for (k, _), b in zip(items, bufs, strict=True))


def test_present_many_of_a_big_batch_needs_few_descriptors(tmp_path: Path, backend: NativeStatus) -> None:
    """256 keys in 256 fan-out directories answered under a descriptor
    limit of the process's open fds + 16: the Python backend holds one
    fan-out directory open at a time (it once held one per directory)."""
    import resource

    (tmp_path / "root").mkdir()
    bs = _make_store(tmp_path / "root", backend, False, True)
    ks = [_spread(i) for i in range(256)]
    assert [o.status for o in bs.store_many([(k, _payload(i)) for i, k in enumerate(ks)])] == [StoreStatus.STORED] * 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
    try:
        got = bs.present_many(ks)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert got == [True] * 256
