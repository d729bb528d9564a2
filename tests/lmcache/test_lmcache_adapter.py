"""FstierL2Adapter in process, built by LMCache's own ``plugin`` loader and
fed LMCache's real memory objects, keys and bitmaps: options, the whole
interface (event fds, each result once), namespaces (layout, rank, MLA),
delete, list, capacity.

Without LMCache these tests skip, unless ``FSTIER_REQUIRE_LMCACHE=1`` (set by
``make test-lmcache``), where a missing LMCache fails them.
"""

from __future__ import annotations

import os
import select
import time
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("DO_NOT_TRACK", "1")
if os.environ.get("FSTIER_REQUIRE_LMCACHE") == "1":
    import lmcache.v1.distributed.l2_adapters.base  # noqa: F401  (fail loudly in CI)
else:
    pytest.importorskip(
        "lmcache.v1.distributed.l2_adapters.base",
        reason="LMCache not installed (make test-lmcache builds .venv-lmcache with it)",
    )

import torch  # noqa: E402
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.distributed.internal_api import L1MemoryDesc  # noqa: E402
from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import (  # noqa: E402
    PluginL2AdapterConfig,
    _create_plugin_adapter,
)
from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator  # noqa: E402

from fstier.errors import ConfigError  # noqa: E402
from fstier.integrations.lmcache import (  # noqa: E402
    DEFAULT_O_DIRECT,
    FstierL2Adapter,
    FstierL2AdapterConfig,
)
from fstier.io import fsops  # noqa: E402
from fstier.io.blockfile import block_file_size  # noqa: E402
from fstier.tier.outcomes import Judge  # noqa: E402

SHAPE = (2, 4, 256, 64)  # [kv, layers, tokens, hidden]: 256 KiB in float16
MLA_SHAPE = (4, 256, 128)  # [layers, tokens, latent]
ARENA = torch.empty(64 << 20, dtype=torch.uint8)
ALLOC = TensorMemoryAllocator(ARENA)


def build(root: Path, l1: Any = None, **params: Any) -> Any:
    """The adapter as LMCache's plugin loader builds it (``l1``: the L1
    arena's ``L1MemoryDesc``, as LMCache's server passes it)."""
    spec = {
        "type": "plugin", "module_path": "fstier.integrations.lmcache",
        "class_name": "FstierL2Adapter", "adapter_params": {"root_dir": str(root), **params},
    }
    return _create_plugin_adapter(PluginL2AdapterConfig.from_dict(spec), l1_memory_desc=l1)


class Listener:
    def __init__(self) -> None:
        self.stored: list[Any] = []
        self.accessed: list[Any] = []
        self.deleted: list[Any] = []

    def on_l2_keys_stored(self, keys: list[Any], sizes: list[int]) -> None:
        self.stored += keys

    def on_l2_keys_accessed(self, keys: list[Any]) -> None:
        self.accessed += keys

    def on_l2_keys_deleted(self, keys: list[Any]) -> None:
        self.deleted += keys


@pytest.fixture
def adapters() -> Any:
    made: list[Any] = []

    def make(root: Path, l1: Any = None, **params: Any) -> Any:
        a = build(root, l1, **params)
        a.listener = Listener()
        a.register_listener(a.listener)
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


def keys(n: int, seed: int = 0, kv_rank: int | None = None, salt: str = "", group: int = 0) -> list[Any]:
    rank = ObjectKey.ComputeKVRank(1, 0, 1, 0) if kv_rank is None else kv_rank
    return [
        ObjectKey(bytes([seed, i]) * 16, "org/model", rank, group, salt) for i in range(n)
    ]


def objects(n: int, shape: tuple[int, ...] = SHAPE, seed: int | None = 0) -> list[Any]:
    out = []
    for i in range(n):
        o = ALLOC.allocate(torch.Size(shape), torch.float16)
        assert o is not None
        if seed is None:
            o.tensor.zero_()
        else:
            g = torch.Generator().manual_seed(seed * 1000 + i)
            o.tensor.copy_(torch.randn(shape, generator=g).half())
        out.append(o)
    return out


def free(objs: list[Any]) -> None:
    for o in objs:
        o.ref_count_down()


def wait_fd(fd: int, timeout: float = 30.0) -> None:
    p = select.poll()
    p.register(fd, select.POLLIN)
    assert p.poll(int(timeout * 1000)), "event fd was not signalled"
    os.eventfd_read(fd)


def store(a: Any, ks: list[Any], objs: list[Any]) -> Any:
    tid = a.submit_store_task(ks, objs)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        wait_fd(a.get_store_event_fd())
        done = a.pop_completed_store_tasks()
        if tid in done:
            return done[tid]
    raise AssertionError("store task never completed")


def lookup(a: Any, ks: list[Any], shape: tuple[int, ...] = SHAPE) -> list[int]:
    desc = MemoryLayoutDesc([torch.Size(shape)], [torch.float16])
    tid = a.submit_lookup_and_lock_task(ks, {0: desc})
    wait_fd(a.get_lookup_and_lock_event_fd())
    bits = a.query_lookup_and_lock_result(tid)
    assert bits is not None
    assert a.query_lookup_and_lock_result(tid) is None, "a lookup result came twice"
    a.submit_unlock(ks)
    return list(bits.get_indices_list())


def load(a: Any, ks: list[Any], objs: list[Any]) -> list[int]:
    tid = a.submit_load_task(ks, objs)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        wait_fd(a.get_load_event_fd())
        bits = a.query_load_result(tid)
        if bits is not None:
            assert a.query_load_result(tid) is None, "a load result came twice"
            return list(bits.get_indices_list())
    raise AssertionError("load task never completed")


def raw(o: Any) -> bytes:
    return bytes(o.byte_array)


# ------------------------------------------------------------------ options
def test_options_are_checked_like_every_fstier_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'root_dir': required"):
        build(tmp_path, root_dir=None)
    with pytest.raises(ConfigError, match=r"tier\.read_threads"):
        build(tmp_path, read_threads=0)
    with pytest.raises(ConfigError, match="option 'blocksize': unknown.*docs/lmcache.md"):
        build(tmp_path, blocksize=4096)
    with pytest.raises(ConfigError, match=r"tier\.max_bytes"):
        build(tmp_path, max_bytes="lots")


def test_o_direct_defaults_to_cold_unless_set(adapters: Any, tmp_path: Path) -> None:
    """The adapter's default is buffered I/O with cold large chunks read
    direct (``cold``: DEFAULT_O_DIRECT, docs/lmcache.md); an o_direct given
    inline or in the config YAML wins."""
    def tier(**params: Any) -> Any:
        return FstierL2AdapterConfig.from_dict(params).tier

    assert DEFAULT_O_DIRECT == "cold"
    adapter = adapters(tmp_path / "a")
    assert adapter.tier_config.o_direct == "cold"
    assert tier(root_dir=str(tmp_path), read_threads=3).o_direct == "cold"
    assert tier(root_dir=str(tmp_path), o_direct="off").o_direct == "off"
    assert tier(root_dir=str(tmp_path), o_direct="auto").o_direct == "auto"
    yaml = tmp_path / "fstier.yaml"
    yaml.write_text(f"tier:\n  root_dir: {tmp_path / 'c'}\n  o_direct: 'on'\n")
    assert tier(config=str(yaml)).o_direct == "on"
    assert tier(config=str(yaml), o_direct="off").o_direct == "off"


def test_cold_large_chunks_are_read_direct_and_checked(adapters: Any, tmp_path: Path) -> None:
    """Under the default ``cold``, 1 MiB chunks dropped from the page cache
    are read with O_DIRECT (native path), byte-exact, and a flipped byte in
    one of them still shortens the loaded prefix."""
    from fstier.io import native
    from fstier.io.capabilities import probe_o_direct

    if native._ext is None or not probe_o_direct(tmp_path, "auto").enabled:
        pytest.skip("needs the native path and a root that allows O_DIRECT")
    big = (2, 4, 1024, 64)  # 1 MiB in float16
    a = adapters(tmp_path, lookup_cache_ttl_s=0)
    # LMCache's server aligns its L1 to 4096 bytes (align_bytes); so does
    # this arena (torch's own allocation is not page-aligned)
    raw_arena = torch.empty(9 << 20, dtype=torch.uint8)
    aligned = TensorMemoryAllocator(raw_arena[(-raw_arena.data_ptr()) % 4096:][: 8 << 20])

    def objects(n: int, shape: tuple[int, ...], seed: int | None) -> list[Any]:
        out = [aligned.allocate(torch.Size(shape), torch.float16) for _ in range(n)]
        for i, o in enumerate(out):
            assert o is not None and o.tensor.data_ptr() % 4096 == 0
            if seed is None:
                o.tensor.zero_()
            else:
                o.tensor.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed + i)))
        return out

    ks, src = keys(4, seed=7), objects(4, shape=big, seed=7)
    assert store(a, ks, src).is_successful()
    files = [next(tmp_path.glob(f"*/r0/*/{k.chunk_hash.hex()}-g0.bin")) for k in ks]
    data = bytearray(files[3].read_bytes())
    data[-1] ^= 0x01
    files[3].write_bytes(bytes(data))
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    before = native._require().cold_direct_reads()
    dst = objects(4, shape=big, seed=None)
    assert load(a, ks, dst) == [0, 1, 2]
    assert [raw(o) for o in dst[:3]] == [raw(o) for o in src[:3]]
    if native._require().cold_direct_reads() == before:
        pytest.skip("the page cache kept these files (or no cachestat(2)): nothing was cold")
    assert native._require().cold_direct_reads() - before == 4
    assert not files[3].exists()
    free(src + dst)


def test_plugin_loader_builds_the_adapter_with_its_config_class(adapters: Any, tmp_path: Path) -> None:
    a = adapters(tmp_path, max_bytes="1GiB", checksum="xxh3")
    assert isinstance(a, FstierL2Adapter)
    assert a.tier_config.max_bytes == 1 << 30
    # max_bytes is LMCache's max_capacity_bytes: usage-driven eviction on.
    assert a.supports_global_eviction and a.get_usage().total_capacity_bytes == 1 << 30
    fds = {a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()}
    assert len(fds) == 3
    st = a.report_status()
    assert st["is_healthy"] is True and st["type"] == "FstierL2Adapter"


# ---------------------------------------------------------------- round trip
def test_store_lookup_load_round_trip_each_result_once(adapters: Any, tmp_path: Path) -> None:
    a = adapters(tmp_path)
    ks, src = keys(6), objects(6)
    res = store(a, ks, src)
    assert res.is_successful() and res.bytes_transferred() == 6 * src[0].get_size()
    assert a.pop_completed_store_tasks() == {}, "a store result came twice"
    assert sorted(k.chunk_hash for k in a.listener.stored) == sorted(k.chunk_hash for k in ks)

    b = adapters(tmp_path)  # another adapter on the same root: a restart
    assert lookup(b, ks) == list(range(6))
    dst = objects(6, seed=None)
    assert load(b, ks, dst) == list(range(6))
    assert [raw(o) for o in dst] == [raw(o) for o in src]
    assert len(b.listener.accessed) == 6
    # Storing what is there already skips (no bytes written, still success).
    again = store(b, ks, src)
    assert again.is_successful() and again.bytes_transferred() == 0
    free(src + dst)


def test_a_corrupt_chunk_fails_itself_only(adapters: Any, tmp_path: Path) -> None:
    a = adapters(tmp_path, lookup_cache_ttl_s=0)
    ks, src = keys(4, seed=1), objects(4, seed=1)
    assert store(a, ks, src).is_successful()
    victim = next(tmp_path.glob(f"*/r0/*/{ks[2].chunk_hash.hex()}-g0.bin"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    dst = objects(4, seed=None)
    # Each chunk its own result (issue 45.5): the corrupt one fails, the one
    # after it loads, and no byte of the corrupt file counts as loaded.
    assert load(a, ks, dst) == [0, 1, 3]
    assert [raw(o) for o in (dst[0], dst[1], dst[3])] == [raw(o) for o in (src[0], src[1], src[3])]
    # The corrupt file was proven bad and removed; LMCache is told.
    assert not victim.exists()
    assert lookup(a, ks) == [0, 1, 3]
    a.pop_completed_store_tasks()  # collects the tier's events
    assert [k.chunk_hash for k in a.listener.deleted] == [ks[2].chunk_hash]
    free(src + dst)


def test_another_layout_salt_or_rank_is_a_miss(adapters: Any, tmp_path: Path) -> None:
    a = adapters(tmp_path)
    ks, src = keys(3, seed=2), objects(3, seed=2)
    assert store(a, ks, src).is_successful()
    # The same bytes per chunk under another shape: another namespace.
    assert lookup(a, ks, shape=(2, 4, 128, 128)) == []
    other = objects(3, shape=(2, 4, 128, 128), seed=None)
    assert load(a, ks, other) == []
    assert all(not any(raw(o)) for o in other)
    assert lookup(a, keys(3, seed=2, salt="tenant-b")) == []
    assert lookup(a, keys(3, seed=2, kv_rank=ObjectKey.ComputeKVRank(2, 1, 2, 1))) == []
    free(src + other)


def test_mha_ranks_are_private_and_mla_is_shared_where_lmcache_keys_are(
    adapters: Any, tmp_path: Path
) -> None:
    a = adapters(tmp_path)
    r0, r1 = ObjectKey.ComputeKVRank(2, 0, 2, 0), ObjectKey.ComputeKVRank(2, 1, 2, 1)
    src = objects(2, seed=3)
    assert store(a, keys(2, seed=3, kv_rank=r0), src).is_successful()
    assert store(a, keys(2, seed=3, kv_rank=r1), src).is_successful()
    # Each rank's chunk is its own file, under its rank's subtree (the
    # namespace digests kv_rank's sizes and local rank, exactly LMCache's key).
    ranks = sorted(p.parent.parent.name for p in tmp_path.rglob("*.bin"))
    assert ranks == ["r0", "r0", "r1", "r1"]
    # MLA: LMCache's kv_rank leaves TP out, so every TP rank names the same
    # chunk, and fstier serves it from the same file.
    mla_rank = ObjectKey.ComputeKVRank(1, 0, 1, 0)
    mla = objects(2, shape=MLA_SHAPE, seed=4)
    assert store(a, keys(2, seed=4, kv_rank=mla_rank), mla).is_successful()
    b = adapters(tmp_path)
    dst = objects(2, shape=MLA_SHAPE, seed=None)
    assert load(b, keys(2, seed=4, kv_rank=mla_rank), dst) == [0, 1]
    assert [raw(o) for o in dst] == [raw(o) for o in mla]
    manifests = [p.read_text() for p in tmp_path.glob("*/config.json")]
    assert sum('"mla":true' in m.replace(" ", "") for m in manifests) == 1
    free(src + mla + dst)


def test_a_task_of_mixed_layouts_and_ranks_splits_by_namespace(adapters: Any, tmp_path: Path) -> None:
    """One task's keys resolve per key (memoised by rank and layout, never
    by the task's first key): each chunk is in its own namespace."""
    a = adapters(tmp_path)
    r0, r1 = ObjectKey.ComputeKVRank(2, 0, 2, 0), ObjectKey.ComputeKVRank(2, 1, 2, 1)
    ks = keys(2, seed=7, kv_rank=r0) + keys(2, seed=8, kv_rank=r1) + keys(2, seed=9, kv_rank=r0)
    src = objects(4, seed=7) + objects(2, shape=MLA_SHAPE, seed=9)
    for _ in range(2):  # the second task is answered from the memo
        assert store(a, ks, src).is_successful()
    assert len(a.report_status()["namespaces"]) == 3
    assert sorted(p.parent.parent.name for p in tmp_path.rglob("*.bin")) == ["r0"] * 4 + ["r1"] * 2
    dst = objects(4, seed=None) + objects(2, shape=MLA_SHAPE, seed=None)
    assert load(adapters(tmp_path), ks, dst) == list(range(6))
    assert [raw(o) for o in dst] == [raw(o) for o in src]
    # A chunk offered under another layout of its size is another namespace: a miss.
    other = objects(1, shape=(2, 4, 128, 128), seed=None)
    dst2 = objects(5, seed=None)[:3] + objects(2, shape=MLA_SHAPE, seed=None)
    assert load(a, ks[:1] + ks[1:], other + dst2) == [1, 2, 3, 4, 5]
    free(src + dst + other + dst2)


def test_a_jobs_tag_is_its_task_and_the_adapter_keeps_no_job_table(
    adapters: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 41: the tag FsTier carries is the adapter's record. A task of
    one namespace is ONE Task, its job's id; a task over three namespaces
    tags its other jobs with Parts naming that Task; each result finds its
    task through the tag, and nothing is left in flight after."""
    from fstier.integrations.lmcache_tasks import Part, Task
    from fstier.manager import FsTier

    seen: list[Any] = []
    real = FsTier._submit

    def spy(self: FsTier, job_id: Any, *args: Any) -> None:
        seen.append(job_id)
        real(self, job_id, *args)

    monkeypatch.setattr(FsTier, "_submit", spy)
    a = adapters(tmp_path)
    ks, src = keys(4, seed=21), objects(4, seed=21)
    assert store(a, ks, src).is_successful()
    (tag,) = seen
    assert type(tag) is Task and tag.task is tag and tag.kind == "store" and list(tag.positions) == [0, 1, 2, 3]
    seen.clear()
    r0, r1 = ObjectKey.ComputeKVRank(2, 0, 2, 0), ObjectKey.ComputeKVRank(2, 1, 2, 1)
    mixed = keys(2, seed=22, kv_rank=r0) + keys(2, seed=23, kv_rank=r1) + keys(2, seed=24, kv_rank=r0)
    msrc = objects(4, seed=22) + objects(2, shape=MLA_SHAPE, seed=24)
    assert store(a, mixed, msrc).is_successful()
    assert len(seen) == 3 and type(seen[0]) is Task and all(type(p) is Part for p in seen[1:])
    assert all(p.task is seen[0] for p in seen) and seen[0].pending == 0
    assert sorted(i for p in seen for i in p.positions) == list(range(6))
    assert a.report_status()["tasks_in_flight"] == 0
    assert not hasattr(a, "_tasks") and not hasattr(a, "_parts")
    free(src + msrc)


def test_results_reaped_by_a_submit_are_found(
    adapters: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FsTier reaps finished jobs on submit: a load result taken by another
    thread's store submit, and still being judged when LMCache (woken by the
    load's eventfd) asks, is found, not lost with its wake-up. Before the
    tiers were submitted to under the adapter's collect lock, the query
    returned None and no further signal came."""
    import threading

    a = adapters(tmp_path)
    ks, src = keys(4, seed=10), objects(4, seed=10)
    assert store(a, ks, src).is_successful()
    entered, go = threading.Event(), threading.Event()
    real = Judge.finish_all  # every reap judges what it collected here (a lone uniform success too)

    def slow_finish_all(self: Judge, jobs: Any) -> Any:
        if any(job.kind == "load" for job in jobs) and threading.current_thread().name == "store-submitter":
            entered.set()
            go.wait(10)
        return real(self, jobs)

    monkeypatch.setattr(Judge, "finish_all", slow_finish_all)
    dst = objects(4, seed=None)
    tid = a.submit_load_task(ks, dst)
    wait_fd(a.get_load_event_fd())  # the job is done: LMCache would query now
    more, more_src = keys(2, seed=11), objects(2, seed=11)
    submitter = threading.Thread(target=a.submit_store_task, args=(more, more_src), name="store-submitter")
    submitter.start()
    assert entered.wait(10), "the store's submit did not reap the finished load"
    got: list[Any] = []
    query = threading.Thread(target=lambda: got.append(a.query_load_result(tid)))
    query.start()
    time.sleep(0.3)  # the query runs while the reaped result is being judged
    go.set()
    query.join(10)
    submitter.join(10)
    assert got and got[0] is not None, "the load's result was lost"
    assert list(got[0].get_indices_list()) == [0, 1, 2, 3]
    assert [raw(o) for o in dst] == [raw(o) for o in src]
    free(src + dst + more_src)


def test_objects_in_and_outside_the_l1_arena_round_trip(adapters: Any, tmp_path: Path) -> None:
    """With LMCache's L1MemoryDesc, an object's bytes are sliced from the
    arena's view; an object outside it takes its own byte_array."""
    l1 = L1MemoryDesc(ARENA.data_ptr(), ARENA.numel(), 1)
    a = adapters(tmp_path, l1)
    outside = TensorMemoryAllocator(torch.empty(2 << 20, dtype=torch.uint8))
    ks = keys(3, seed=12)
    src = objects(2, seed=12)
    extra = outside.allocate(torch.Size(SHAPE), torch.float16)
    assert extra is not None
    extra.tensor.copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(5)).half())
    assert store(a, ks, [*src, extra]).is_successful()
    dst = [outside.allocate(torch.Size(SHAPE), torch.float16), *objects(2, seed=None)]
    assert load(a, [ks[2], ks[0], ks[1]], dst) == [0, 1, 2]
    assert [raw(o) for o in dst] == [raw(extra), raw(src[0]), raw(src[1])]
    free(src + dst[1:])


# -------------------------------------------------------- delete, list, capacity
def test_list_and_delete_keys(adapters: Any, tmp_path: Path) -> None:
    a = adapters(tmp_path)
    ks, src = keys(5, seed=5, salt="s1"), objects(5, seed=5)
    assert store(a, ks, src).is_successful()
    page = a.list_l2_keys(page_size=3)
    assert len(page.entries) == 3 and page.next_page_token is not None
    rest = a.list_l2_keys(page_size=3, cursor=page.next_page_token)
    assert rest.next_page_token is None
    listed = [e.key.to_object_key() for e in (*page.entries, *rest.entries)]
    assert sorted(listed, key=lambda k: k.chunk_hash) == sorted(ks, key=lambda k: k.chunk_hash)
    # Each chunk's size is its file's (header and padded payload): what fstier
    # counts against max_bytes and what LMCache's usage is told.
    assert {e.size_bytes for e in page.entries} == {block_file_size(src[0].get_size())}
    assert a.list_l2_keys(model_name="other/model").entries == ()
    a.delete(ks[:2])
    assert sorted(k.chunk_hash for k in a.listener.deleted) == sorted(k.chunk_hash for k in ks[:2])
    assert len(a.list_l2_keys().entries) == 3
    free(src)


def test_delete_is_one_batch_per_namespace(
    adapters: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LMCache's eviction thread deletes through one remove batch per
    namespace: native, one GIL-free call and no Python unlink per key
    (before, one ``unlink`` per key on every path)."""
    a = adapters(tmp_path)
    ks, src = keys(4, seed=13), objects(4, seed=13)
    assert store(a, ks, src).is_successful()
    unlinks: list[str] = []
    real = fsops.FS.unlink
    monkeypatch.setattr(fsops.FS, "unlink", lambda p: (unlinks.append(str(p)), real(p))[1])
    a.delete([*ks[:3], keys(1, seed=14)[0]])  # the last one was never stored
    assert sorted(k.chunk_hash for k in a.listener.deleted) == sorted(k.chunk_hash for k in ks[:3])
    assert [p.name for p in tmp_path.rglob("*.bin")] == [f"{ks[3].chunk_hash.hex()}-g0.bin"]
    native = a.report_status()["io_path"] == "native"
    assert unlinks == [] if native else len(unlinks) == 4
    free(src)


def test_delete_lowers_usage_and_misses_at_once(adapters: Any, tmp_path: Path) -> None:
    """LMCache's delete goes through FsTier.remove: fstier's usage count drops
    by the removed files at once and a presence answer cached before the
    delete is not served after it (before, delete went beside FsTier: usage
    stayed high until the next capacity pass and lookups hit for
    ``lookup_cache_ttl_s``)."""
    a = adapters(tmp_path, max_bytes="1GiB", lookup_cache_ttl_s=600)
    ks, src = keys(4, seed=15), objects(4, seed=15)
    assert store(a, ks, src).is_successful()
    # The namespace's tier (and its capacity thread) opened with the store:
    # a first scan that raced the store counts those files twice by design
    # (high, never low) and is redone once quiet (Capacity.settled). CI
    # caught the raced count here (1863680 == 1064960: 7 files for 4).
    deadline = time.monotonic() + 60
    while not all(s.tier.capacity.settled for s in a._open_spaces()):
        assert time.monotonic() < deadline, "fstier's usage count never settled"
        time.sleep(0.05)
    files = sorted(tmp_path.rglob("*.bin"))
    assert a.report_status()["usage_bytes"] == sum(f.stat().st_size for f in files)
    assert lookup(a, ks) == [0, 1, 2, 3]  # cached as present for 600 s
    a.delete(ks[1:3])
    assert a.report_status()["usage_bytes"] == sum(f.stat().st_size for f in tmp_path.rglob("*.bin"))
    assert len(list(tmp_path.rglob("*.bin"))) == 2
    assert lookup(a, ks) == [0, 3]
    dst = objects(4, seed=None)
    assert load(a, [ks[0], ks[3]], dst[:2]) == [0, 1]
    assert raw(dst[0]) == raw(src[0]) and raw(dst[1]) == raw(src[3])
    free(src + dst)


def test_fstier_eviction_under_max_bytes_is_reported_to_lmcache(adapters: Any, tmp_path: Path) -> None:
    a = adapters(tmp_path, max_bytes="1MiB")
    assert a.get_usage().total_capacity_bytes == 1 << 20
    ks, src = keys(8, seed=6), objects(8, seed=6)  # 8 x 256 KiB: twice the cap
    # A store the root cannot take now fails at once (cause "capacity", no
    # blocking) and wakes the capacity thread; the chunk is offered again
    # here, as LMCache would on its next write of it.
    deadline = time.monotonic() + 60
    for i in range(8):
        while not store(a, ks[i : i + 1], src[i : i + 1]).is_successful():
            assert time.monotonic() < deadline, f"chunk {i} never stored"
            time.sleep(0.1)
    # The capacity thread brings the root back under max_bytes; every file
    # it removed is a deletion LMCache heard of.
    def settled() -> bool:
        a.pop_completed_store_tasks()  # collects the tiers' events
        files = list(tmp_path.rglob("*.bin"))
        try:
            on_disk = sum(f.stat().st_size for f in files)
        except FileNotFoundError:  # evicted between the listing and its stat: not settled yet
            return False
        return on_disk <= 1 << 20 and len(files) == 8 - len(a.listener.deleted)

    while not settled():
        assert time.monotonic() < deadline, "the root never settled under max_bytes"
        time.sleep(0.05)
    assert a.listener.deleted
    left = len(list(tmp_path.rglob("*.bin")))
    assert a.get_usage().total_bytes_used == left * block_file_size(src[0].get_size())
    free(src)
