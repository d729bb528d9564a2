"""FstierL2Adapter's task-level shortcuts give exactly the per-key answers.

A task whose keys share one namespace and whose objects share one layout and
size is resolved with one memo check and C-level loops (``_task_space``);
its objects' bytes are sliced from the L1 arena's view in one pass
(``L1Arena.views_of``), lent to the next free run of slot indices
(``LentSlots.lend``), and its result is a slice per part and one
``Bitmap.batched_set``. Each scenario here runs twice on LMCache's real
classes, once as it is and once with the shortcut turned off (every key
resolved on its own), and both must store, load, refuse and tell LMCache
the same; the slot provider's shortcuts are checked against its per-buffer
code. A last test counts the adapter's Python calls per task: the same for
4 keys as for 32 (before the shortcuts, ``_resolve`` alone ran once per key).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("DO_NOT_TRACK", "1")
# test_lmcache_adapter skips this module without LMCache (and fails it with
# FSTIER_REQUIRE_LMCACHE=1) before anything of LMCache is imported here.
from test_lmcache_adapter import (
    ALLOC,
    ARENA,
    SHAPE,
    Listener,
    build,
    free,
    keys,
    load,
    lookup,
    objects,
    raw,
    store,
    wait_fd,
)

# isort: split
import torch  # noqa: E402
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.distributed.internal_api import L1MemoryDesc  # noqa: E402
from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator  # noqa: E402

import fstier.integrations.lmcache as lmc  # noqa: E402
from fstier.errors import KeyFormatError  # noqa: E402
from fstier.integrations.lmcache import FstierL2Adapter  # noqa: E402
from fstier.integrations.lmcache_space import KeyMemo, L1Arena, LentSlots, block_keys_of  # noqa: E402


@pytest.fixture
def adapters() -> Any:
    """Adapters as LMCache's plugin loader builds them, each with a
    listener, closed after the test."""
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


R0, R1 = ObjectKey.ComputeKVRank(2, 0, 2, 0), ObjectKey.ComputeKVRank(2, 1, 2, 1)


def per_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn the task-level shortcuts off: every key resolved on its own."""
    monkeypatch.setattr(FstierL2Adapter, "_task_space", lambda self, ks, objs: None)
    monkeypatch.setattr(FstierL2Adapter, "_lookup_space", lambda self, ks, layouts: None)


def outcome(a: Any, root: Path, ks: list[Any], src: list[Any]) -> dict[str, Any]:
    """Store ``ks``/``src``, load them back, and say what happened: results,
    bytes, files, what LMCache was told."""
    res = store(a, ks, src)
    dst = [ALLOC.allocate(o.meta.shape, o.meta.dtype) for o in src]
    loaded = load(a, ks, dst)
    out = {
        "store": (res.is_successful(), res.bytes_transferred() if res.is_successful() else None),
        "loaded": loaded,
        "bytes": [raw(dst[i]) == raw(src[i]) for i in loaded],
        "files": sorted(str(p.relative_to(root)).split("/", 1)[1] for p in root.rglob("*.bin")),
        "stored_notes": sorted((k.chunk_hash, k.object_group_id, k.kv_rank) for k in a.listener.stored),
        "accessed_notes": sorted((k.chunk_hash, k.object_group_id) for k in a.listener.accessed),
        "namespaces": len(a.report_status()["namespaces"]),
    }
    free(dst)
    return out


def both(
    adapters: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scenario: Callable[[Any, Path], dict[str, Any]]
) -> dict[str, Any]:
    """``scenario`` with the shortcut and without it (adapters over LMCache's
    L1 arena, as its server builds them): the same outcome."""
    l1 = L1MemoryDesc(ARENA.data_ptr(), ARENA.numel(), 1)
    fast = scenario(adapters(tmp_path / "fast", l1), tmp_path / "fast")
    with monkeypatch.context() as m:
        per_key(m)
        slow = scenario(adapters(tmp_path / "slow", l1), tmp_path / "slow")
    assert fast == slow
    return fast


def narrowed(objs: list[Any], nbytes: int) -> list[Any]:
    for o in objs:
        o.set_used_size(nbytes)
    return objs


# ------------------------------------------------- the adapter: fast == per key
def test_a_uniform_task_is_answered_like_key_by_key(
    adapters: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ks, src = keys(8, seed=40), objects(8, seed=40)
    got = both(adapters, tmp_path, monkeypatch, lambda a, root: outcome(a, root, ks, src))
    assert got["store"] == (True, 8 * src[0].get_size()) and got["loaded"] == list(range(8))
    assert all(got["bytes"]) and len(got["files"]) == 8 and len(got["accessed_notes"]) == 8
    free(src)


def test_a_task_of_many_groups_and_one_namespace(
    adapters: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ks = [ObjectKey(bytes([41, i]) * 16, "org/model", R0, i % 3, "") for i in range(6)]
    src = objects(6, seed=41)
    got = both(adapters, tmp_path, monkeypatch, lambda a, root: outcome(a, root, ks, src))
    assert got["loaded"] == list(range(6)) and all(got["bytes"]) and got["namespaces"] == 1
    assert sorted(f.rsplit("-", 1)[1] for f in got["files"]) == ["g0.bin"] * 2 + ["g1.bin"] * 2 + ["g2.bin"] * 2
    free(src)


@pytest.mark.parametrize("mix", ["ranks", "salts", "models"])
def test_a_task_of_mixed_namespaces_splits_as_key_by_key(
    adapters: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mix: str
) -> None:
    first = keys(3, seed=42, kv_rank=R0)
    second = {
        "ranks": keys(3, seed=43, kv_rank=R1),
        "salts": keys(3, seed=43, kv_rank=R0, salt="tenant-b"),
        "models": [ObjectKey(k.chunk_hash, "org/other", R0, 0, "") for k in keys(3, seed=43)],
    }[mix]
    ks, src = first + second, objects(6, seed=42)
    got = both(adapters, tmp_path, monkeypatch, lambda a, root: outcome(a, root, ks, src))
    assert got["loaded"] == list(range(6)) and all(got["bytes"]) and got["namespaces"] == 2
    free(src)


def test_a_task_of_mixed_layouts_splits_as_key_by_key(
    adapters: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ks = keys(4, seed=44)
    src = objects(2, seed=44) + objects(2, shape=(2, 4, 128, 128), seed=45)  # same size, other shape
    got = both(adapters, tmp_path, monkeypatch, lambda a, root: outcome(a, root, ks, src))
    assert got["loaded"] == [0, 1, 2, 3] and all(got["bytes"]) and got["namespaces"] == 2
    free(src)


@pytest.mark.parametrize("which", ["one", "all"])
def test_a_group_out_of_range_is_refused_as_key_by_key(
    adapters: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    ks = keys(4, seed=46)
    bad = range(4) if which == "all" else [2]
    ks = [ObjectKey(k.chunk_hash, k.model_name, k.kv_rank, lmc.MAX_GROUPS, "") if i in bad else k
          for i, k in enumerate(ks)]
    src = objects(4, seed=46)
    got = both(adapters, tmp_path, monkeypatch, lambda a, root: outcome(a, root, ks, src))
    assert got["store"] == (False, None)
    assert got["loaded"] == ([] if which == "all" else [0, 1, 3])
    assert len(got["files"]) == (0 if which == "all" else 3)
    free(src)


@pytest.mark.parametrize("which", ["one", "all"])
def test_a_wrong_size_object_is_refused_as_key_by_key(
    adapters: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    ks, src = keys(4, seed=47), objects(4, seed=47)
    size = src[0].get_size()
    narrowed(src if which == "all" else src[1:2], size - 4096)

    def scenario(a: Any, root: Path) -> dict[str, Any]:
        res = store(a, ks, src)
        return {
            "store": res.is_successful(),
            "files": sorted(p.name for p in root.rglob("*.bin")),
            "namespaces": len(a.report_status()["namespaces"]),
        }

    got = both(adapters, tmp_path, monkeypatch, scenario)
    assert got["store"] is False
    want = [] if which == "all" else sorted(f"{ks[i].chunk_hash.hex()}-g0.bin" for i in (0, 2, 3))
    assert got["files"] == want
    free(src)


def test_a_wrong_size_load_target_is_refused_as_key_by_key(
    adapters: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ks, src = keys(3, seed=48), objects(3, seed=48)

    def scenario(a: Any, root: Path) -> dict[str, Any]:
        assert store(a, ks, src).is_successful()
        uniform = narrowed(objects(3, seed=None), src[0].get_size() - 4096)
        one = objects(3, seed=None)
        narrowed(one[:1], src[0].get_size() - 4096)
        got = {"all": load(a, ks, uniform), "first": load(a, ks, one),
               "untouched": [not any(raw(o)) for o in uniform]}
        free(uniform + one)
        return got

    got = both(adapters, tmp_path, monkeypatch, scenario)
    assert got == {"all": [], "first": [1, 2], "untouched": [True] * 3}


def test_more_keys_than_objects_is_refused(
    adapters: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ks, src = keys(3, seed=49), objects(2, seed=49)

    def scenario(a: Any, root: Path) -> dict[str, Any]:
        return {"store": store(a, ks, src).is_successful(), "files": list(root.rglob("*.bin"))}

    assert both(adapters, tmp_path, monkeypatch, scenario) == {"store": False, "files": []}
    free(src)


def test_namespaces_past_max_spaces_close_idle_ones_as_key_by_key(
    adapters: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past MAX_SPACES the least recently used idle namespace is closed, not
    the new one refused (issue 45.2); one found again through the memo is
    reopened; the same on the task shortcut and key by key."""
    monkeypatch.setattr(lmc, "MAX_SPACES", 1)
    first, second = keys(2, seed=50, kv_rank=R0), keys(2, seed=51, kv_rank=R1)
    src = objects(2, seed=50)

    def scenario(a: Any, root: Path) -> dict[str, Any]:
        ok = store(a, first, src).is_successful()
        stored = [store(a, second, src).is_successful() for _ in range(2)]  # the memo answers the second
        dst = objects(4, seed=None)
        got = {"first": ok, "second": stored, "loaded": [load(a, second, dst[:2]), load(a, first, dst[2:])],
               "bytes": [raw(o) for o in dst] == [raw(o) for o in src + src],
               "namespaces": len(a.report_status()["namespaces"])}
        free(dst)
        return got

    got = both(adapters, tmp_path, monkeypatch, scenario)
    assert got == {"first": True, "second": [True, True], "loaded": [[0, 1], [0, 1]], "bytes": True, "namespaces": 1}
    free(src)


def test_a_closed_adapter_fails_every_task(
    adapters: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ks, src = keys(3, seed=52), objects(3, seed=52)

    def scenario(a: Any, root: Path) -> dict[str, Any]:
        assert store(a, ks, src).is_successful()
        a.close()
        tid = a.submit_store_task(keys(3, seed=53), src)
        res = a.pop_completed_store_tasks()
        dst = objects(3, seed=None)
        lid = a.submit_load_task(ks, dst)
        bits = a.query_load_result(lid)
        free(dst)
        return {"store": {k: v.is_successful() for k, v in res.items()} == {tid: False},
                "load": list(bits.get_indices_list()), "files": len(list(root.rglob("*.bin")))}

    assert both(adapters, tmp_path, monkeypatch, scenario) == {"store": True, "load": [], "files": 3}
    free(src)


def test_lookups_answer_as_key_by_key(
    adapters: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lookups of one owner and group (the shortcut) and of mixed ones, with
    hits, misses, a group without a layout hint and one out of range."""
    stored = keys(4, seed=57, kv_rank=R0)
    other = keys(2, seed=58, kv_rank=R1)
    grouped = [ObjectKey(k.chunk_hash, k.model_name, R0, 1, "") for k in keys(2, seed=59)]
    src = objects(8, seed=57)
    mla = MemoryLayoutDesc([torch.Size((4, 256, 128))], [torch.float16])
    desc = MemoryLayoutDesc([torch.Size(SHAPE)], [torch.float16])
    far = [ObjectKey(k.chunk_hash, k.model_name, R0, lmc.MAX_GROUPS, "") for k in stored[:2]]
    missing = keys(2, seed=60, kv_rank=R0)
    salted = keys(4, seed=57, kv_rank=R0, salt="tenant-b")
    asks = {
        "all": (stored, {0: desc}),
        "some": (stored[:2] + missing + stored[3:], {0: desc}),
        "ranks": (stored + other, {0: desc}),
        "groups": (stored + grouped, {0: desc, 1: desc}),
        "no hint for group 1": (stored + grouped, {0: desc}),
        "another layout": (stored, {0: mla}),
        "salt": (salted, {0: desc}),
        "group out of range": (far + stored, {0: desc}),
        "all out of range": (far, {0: desc}),
        "empty": ([], {0: desc}),
        "no hints": (stored, {}),
    }

    def scenario(a: Any, root: Path) -> dict[str, Any]:
        assert store(a, stored + other + grouped, src).is_successful()
        out = {}
        for name, (ks, hints) in asks.items():
            tid = a.submit_lookup_and_lock_task(ks, hints)
            wait_fd(a.get_lookup_and_lock_event_fd())
            out[name] = list(a.query_lookup_and_lock_result(tid).get_indices_list())
        return out

    got = both(adapters, tmp_path, monkeypatch, scenario)
    assert got["all"] == [0, 1, 2, 3] and got["some"] == [0, 1, 4]
    assert got["ranks"] == list(range(6)) and got["groups"] == list(range(6))
    assert got["group out of range"] == [2, 3, 4, 5]
    assert got["another layout"] == got["salt"] == got["all out of range"] == got["empty"] == []
    # Without a usable layout hint a key is looked up in every namespace of
    # its model, rank, salt and hash length (issue 45.1: LMCache's own check
    # and benchmark pass none, or a placeholder).
    assert got["no hint for group 1"] == list(range(6)) and got["no hints"] == [0, 1, 2, 3]
    free(src)


def test_lmcache_is_told_of_stores_with_the_tasks_own_keys(adapters: Any, tmp_path: Path) -> None:
    """A store's BlockStored event names its job's own block keys, so the
    keys LMCache is told of are the task's ObjectKeys (no key built per
    chunk); a partly skipped store tells only the written ones; nothing is
    left behind once the results are in."""
    a = adapters(tmp_path, L1MemoryDesc(ARENA.data_ptr(), ARENA.numel(), 1))
    ks, src = keys(6, seed=61), objects(6, seed=61)
    assert store(a, ks, src).is_successful()
    assert sorted(map(id, a.listener.stored)) == sorted(map(id, ks))
    assert len(a._store_keys) == 0
    more = keys(3, seed=62)
    res = store(a, ks[:3] + more, src)
    assert res.is_successful() and res.bytes_transferred() == 3 * src[0].get_size()
    assert sorted(map(id, a.listener.stored[6:])) == sorted(map(id, more))
    assert len(a._store_keys) == 0
    free(src)


def test_key_memo_answers_as_block_keys_of() -> None:
    """A namespace's memo of block keys gives exactly ``block_keys_of``'s
    answer (short hashes padded, mixed groups, refusals) and, for a batch of
    one group it built before, the very same objects; past its bound it
    starts again."""
    memo = KeyMemo()
    ks = keys(8, seed=71)
    first = memo.block_keys(ks)
    assert first == block_keys_of(ks) and len(memo) == 8
    again = memo.block_keys(ks[2:6])
    assert again == block_keys_of(ks[2:6]) and all(x is y for x, y in zip(again, first[2:6], strict=True))
    part = memo.block_keys(ks[:2] + keys(2, seed=72))  # some remembered, some new: built, then remembered
    assert part == block_keys_of(ks[:2] + keys(2, seed=72)) and len(memo) == 10
    mixed = keys(2, seed=73) + keys(2, seed=73, group=1)
    assert memo.block_keys(mixed) == block_keys_of(mixed) and len(memo) == 10  # several groups: not kept
    short = [ObjectKey(bytes([74, i]) * 2, "org/model", R0) for i in range(3)]
    assert memo.block_keys(short) == block_keys_of(short) and memo.block_keys(short)[0].block_hash == b"J\0J\0\0\0\0\0"
    assert memo.block_keys([]) == []
    bad = [ObjectKey(b"\1" * 65, "org/model", R0)]
    with pytest.raises(KeyFormatError):
        block_keys_of(bad)
    with pytest.raises(KeyFormatError):
        memo.block_keys(bad)
    memo.BOUND = 12  # type: ignore[misc]
    memo.block_keys(keys(4, seed=75))
    assert len(memo) == 4, "past its bound the memo starts again"


def test_key_memo_stays_bounded_by_a_batch_past_its_bound() -> None:
    """One lookup or load of more chunks than :attr:`KeyMemo.BOUND` (a long
    prompt's prefetch) is answered as ``block_keys_of`` answers it, and the
    memo still holds at most ``BOUND`` keys (it kept such a batch whole: a
    namespace's memo grew with the longest batch, not to its bound)."""
    memo = KeyMemo()
    many = [ObjectKey(i.to_bytes(4, "big") * 4, "org/model", R0) for i in range(KeyMemo.BOUND + 100)]
    assert memo.block_keys(many) == block_keys_of(many)
    assert len(memo) <= KeyMemo.BOUND
    few = many[:8]
    assert memo.block_keys(few) == block_keys_of(few) and len(memo) <= KeyMemo.BOUND
    assert memo.block_keys(many) == block_keys_of(many) and len(memo) <= KeyMemo.BOUND


def test_a_load_of_looked_up_chunks_reuses_their_block_keys(adapters: Any, tmp_path: Path) -> None:
    """LMCache's prefetch: a lookup, then a load of its hits. The load's job
    names the block keys the lookup built (no second build), each namespace
    its own (two ranks with the same chunk hashes share none: a store's
    LMCache keys are found by its block keys' ``id()``); the bytes loaded
    are the bytes stored, and stores leave the memo alone."""
    a = adapters(tmp_path, L1MemoryDesc(ARENA.data_ptr(), ARENA.numel(), 1))
    ks0, ks1 = keys(4, seed=76, kv_rank=R0), keys(4, seed=76, kv_rank=R1)
    src0, src1 = objects(4, seed=76), objects(4, seed=77)
    assert store(a, ks0, src0).is_successful() and store(a, ks1, src1).is_successful()
    assert [len(s.keys) for s in a._open_spaces()] == [0, 0]
    assert lookup(a, ks0) == lookup(a, ks1) == [0, 1, 2, 3]
    s0, s1 = sorted(a._open_spaces(), key=lambda s: s.sid.kv_rank)
    built0, built1 = s0.keys.block_keys(ks0), s1.keys.block_keys(ks1)
    assert built0 == built1 and not any(x is y for x, y in zip(built0, built1, strict=True))
    named: list[Any] = []
    real = s0.tier.submit_load

    def submit_load(tag: Any, bkeys: Any, slots: Any) -> Any:
        named.extend(bkeys)
        return real(tag, bkeys, slots)

    s0.tier.submit_load = submit_load  # type: ignore[method-assign]
    dst = objects(4, seed=None)
    assert load(a, ks0, dst) == [0, 1, 2, 3] and [raw(o) for o in dst] == [raw(o) for o in src0]
    assert len(named) == 4 and all(x is y for x, y in zip(named, built0, strict=True))
    free(src0 + src1 + dst)


def test_remembered_keys_never_load_another_layouts_or_a_stale_chunk(adapters: Any, tmp_path: Path) -> None:
    """What a lookup remembered names its own namespace's chunks only: a load
    of the same chunk hashes into objects of another layout of the same size
    misses (their bytes untouched); a load of chunks some of which were
    looked up loads each its own bytes; a chunk deleted after its lookup misses,
    and stored again with other bytes loads those; a namespace closed (least
    recently used) between a lookup and its load is reopened with an empty
    memo and loads the bytes stored."""
    a = adapters(tmp_path, L1MemoryDesc(ARENA.data_ptr(), ARENA.numel(), 1))
    ks, src = keys(4, seed=81), objects(4, seed=81)
    assert store(a, ks, src).is_successful()
    assert lookup(a, ks[:2]) == [0, 1]
    (space,) = a._open_spaces()
    assert len(space.keys) == 2
    other = objects(4, shape=(2, 4, 128, 128), seed=None)
    assert load(a, ks, other) == [] and not any(map(any, map(raw, other)))
    dst0 = objects(4, seed=None)  # two chunks remembered, two not
    assert load(a, ks, dst0) == [0, 1, 2, 3] and [raw(o) for o in dst0] == [raw(o) for o in src]
    assert lookup(a, ks) == [0, 1, 2, 3]
    a.delete(ks[:2])
    dst = objects(4, seed=None)
    assert load(a, ks, dst) == [2, 3]
    assert not any(raw(dst[0])) and not any(raw(dst[1])) and [raw(o) for o in dst[2:]] == [raw(o) for o in src[2:]]
    new = objects(2, seed=82)
    assert store(a, ks[:2], new).is_successful()
    assert lookup(a, ks) == [0, 1, 2, 3]
    dst2 = objects(4, seed=None)
    assert load(a, ks, dst2) == [0, 1, 2, 3]
    assert [raw(o) for o in dst2] == [raw(o) for o in new + src[2:]]
    a._reg.max_idle = 0  # every namespace closes once no job or lookup pins it
    assert lookup(a, ks) == [0, 1, 2, 3] and a._reg.evicted >= 1 and space.closed
    dst3 = objects(4, seed=None)
    assert load(a, ks, dst3) == [0, 1, 2, 3]
    assert [raw(o) for o in dst3] == [raw(o) for o in new + src[2:]]
    free(src + other + dst0 + dst + new + dst2 + dst3)


def test_store_keys_find_all_or_none() -> None:
    from fstier.integrations.lmcache_tasks import StoreKeys
    from fstier.keys import BlockKey

    known, bkeys = StoreKeys(), [BlockKey(bytes([63, i]) * 8) for i in range(4)]
    okeys = keys(4, seed=63)
    known.add(bkeys, okeys)
    assert known.of(bkeys[1:3]) == okeys[1:3] and known.of([]) == []
    assert known.of([*bkeys[:2], BlockKey(bkeys[2].block_hash)]) is None  # equal, not the same key
    known.forget(bkeys[:2])
    assert known.of(bkeys) is None and known.of(bkeys[2:]) == okeys[2:] and len(known) == 2
    known.forget(bkeys)
    assert len(known) == 0


# ------------------------------------------------------------ arena and slots
def test_views_of_are_the_objects_bytes_in_and_outside_the_arena() -> None:
    arena = L1Arena.of(L1MemoryDesc(ARENA.data_ptr(), ARENA.numel(), 1))
    inside = objects(3, seed=54)
    outside = TensorMemoryAllocator(torch.empty(1 << 20, dtype=torch.uint8)).allocate(torch.Size(SHAPE), torch.float16)
    outside.tensor.copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(54)).half())
    size = inside[0].get_size()
    for objs in (inside, [inside[0], outside, inside[2]], [outside], []):
        views = arena.views_of(objs, size)
        assert [bytes(v) for v in views] == [raw(o) for o in objs] == [bytes(arena.bytes_of(o)) for o in objs]
        assert all(not v.readonly and len(v) == size for v in views)
    none = L1Arena.of(None)
    assert [bytes(v) for v in none.views_of(inside, size)] == [raw(o) for o in inside]
    free(inside)


def test_kept_slices_are_the_objects_bytes_of_their_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The arena keeps the slices it cut (by size and offset): a task of
    objects where earlier ones lay gets the same slice objects back, an
    object allocated anew at a kept offset its own bytes, another size its
    own slices, and past the bound (:attr:`L1Arena.KEPT`) slices are cut
    again, never a wrong one."""
    arena = L1Arena.of(L1MemoryDesc(ARENA.data_ptr(), ARENA.numel(), 1))
    objs = objects(4, seed=60)
    size = objs[0].get_size()
    first = arena.views_of(objs, size)
    again = arena.views_of(objs, size)
    assert all(a is b for a, b in zip(first, again, strict=True))  # kept, not cut again
    half = arena.views_of(objs, size // 2)  # the same offsets, another size: its own slices
    assert [len(v) for v in half] == [size // 2] * 4 and [bytes(v) for v in half] == [raw(o)[: size // 2] for o in objs]
    free(objs)
    anew = objects(4, seed=61)  # LMCache's allocator hands the same blocks out again
    assert [bytes(v) for v in arena.views_of(anew, size)] == [raw(o) for o in anew]
    monkeypatch.setattr(L1Arena, "KEPT", 2)
    more = objects(3, seed=62)
    for batch in (more, more[:2], more, anew[:1], more):
        assert [bytes(v) for v in arena.views_of(batch, size)] == [raw(o) for o in batch]
        assert len(arena._kept[size]) <= 2
    for n in range(1, 12):  # more sizes than are kept
        assert [bytes(v) for v in arena.views_of(more[:1], n)] == [raw(more[0])[:n]]
    assert len(arena._kept) <= 8
    free(anew)
    free(more)


def test_arena_lend_is_lend_of_views_of() -> None:
    """``L1Arena.lend`` (arena slices lent without a per-view form check)
    lends what ``LentSlots.lend(views_of(...))`` lends, in and outside the
    arena; an arena over a view that is not plain bytes is checked per view."""
    arena = L1Arena.of(L1MemoryDesc(ARENA.data_ptr(), ARENA.numel(), 1))
    inside = objects(3, seed=57)
    outside = TensorMemoryAllocator(torch.empty(1 << 20, dtype=torch.uint8)).allocate(torch.Size(SHAPE), torch.float16)
    size = inside[0].get_size()
    for objs in (inside, [inside[0], outside], [outside], []):
        fast, slow = LentSlots(size, num_slots=8), LentSlots(size, num_slots=8)
        got, want = arena.lend(fast, objs), slow.lend(arena.views_of(objs, size))
        assert got == want and got is not None
        fast_bytes = [bytes(fast.slot_view(i)) for i in got]
        assert fast_bytes == [bytes(slow.slot_view(i)) for i in want] == [raw(o) for o in objs]
        assert [fast.slot_view(i).format for i in got] == ["B"] * len(objs)
    view = memoryview(bytes(ARENA.numel()))  # read-only: its slices must not be lent
    ro = L1Arena(ARENA.data_ptr(), view)
    assert not ro._plain and ro.lend(LentSlots(size, num_slots=8), inside) is None
    assert LentSlots(size, num_slots=8).lend(ro.views_of(inside, size)) is None
    free(inside)


def test_lend_gives_the_next_free_run_or_skips_lent_slots() -> None:
    slots = LentSlots(16, num_slots=8)
    bufs = [memoryview(bytearray([i]) * 16) for i in range(8)]
    assert slots.lend(bufs[:5]) == [0, 1, 2, 3, 4]
    slots.release([1, 3])
    assert slots.lend(bufs[5:7]) == [5, 6]  # the next run is free
    assert slots.lend(bufs[:3]) == [7, 1, 3]  # wraps, skipping lent slots
    assert slots.lend(bufs[:1]) is None and slots.lent == 8  # all lent
    for i in (0, 1, 3, 7):
        assert bytes(slots.slot_view(i)) == bytes(bufs[{0: 0, 1: 1, 3: 2, 7: 0}[i]])
    slots.release(range(8))
    assert slots.lent == 0 and slots.lend([]) == []


@pytest.mark.parametrize(
    "nbytes",
    [[16, 16, 16], [16, 3, 16], [16, 16], [], [16, 17, 16], [0, 16, 16]],
)
def test_payload_views_of_whole_slots_are_the_lent_views(nbytes: list[int]) -> None:
    """A job of whole slots gets the lent views themselves (no second slice
    of each); any other payload lengths, the generic cut: the same memory,
    lengths and refusals as ``slot_view(s)[:n]`` either way."""
    slots = LentSlots(16, num_slots=8)
    bufs = [memoryview(bytearray([i]) * 16) for i in range(3)]
    lent = slots.lend(bufs)
    assert lent == [0, 1, 2]
    which = lent[: len(nbytes)]
    got = slots.payload_views(which, nbytes)
    want = [slots.slot_view(s)[:n] for s, n in zip(which, nbytes, strict=True)]
    assert [(bytes(v), len(v), v.readonly, v.format) for v in got] == [
        (bytes(v), len(v), v.readonly, v.format) for v in want]
    whole = bool(nbytes) and min(nbytes) == max(nbytes) == 16
    assert all(v is slots.slot_view(s) for v, s in zip(got, which, strict=True)) is (whole or not nbytes)
    with pytest.raises(KeyError):
        slots.payload_views([0, 5], [16, 16])  # not lent: slot_view's refusal
    with pytest.raises(ValueError, match="3 slots but 2 payload lengths"):
        slots.payload_views(lent, [16, 16])


@pytest.mark.parametrize(
    ("buf", "ok"),
    [
        (memoryview(bytearray(16)), True),
        (memoryview(bytearray(16)).cast("I"), True),  # another format: cast to bytes
        (memoryview(bytearray(16)).cast("B", (4, 4)), True),  # 2-D: cast to 1-D bytes
        (memoryview(bytes(16)), False),  # read-only
        (memoryview(bytearray(32))[::2], False),  # not contiguous
        (memoryview(bytearray(15)), False),  # short
        (memoryview(bytearray(17)), False),  # long
    ],
)
def test_lend_refuses_what_the_per_buffer_check_refuses(buf: memoryview, ok: bool) -> None:
    for batch in ([buf], [memoryview(bytearray(16)), buf]):
        slots = LentSlots(16, num_slots=8)
        got = slots.lend(batch)
        assert (got is not None) is ok and slots.lent == (len(batch) if ok else 0)
        if len(buf) != 16:  # plain (the caller vouches for the form): lengths still checked
            assert LentSlots(16, num_slots=8).lend(batch, plain=True) is None
        if ok:
            assert all(len(slots.slot_view(i)) == 16 and slots.slot_view(i).format == "B" for i in got)


def test_check_slots_and_release_honour_fences() -> None:
    slots = LentSlots(16, num_slots=8)
    got = slots.lend([memoryview(bytearray(16)) for _ in range(3)])
    assert got == [0, 1, 2]
    slots.check_slots(got)
    with pytest.raises(ValueError, match="slot 5 is not lent"):
        slots.check_slots([0, 5])
    slots.fence(1)
    with pytest.raises(ValueError, match="slot 1 is fenced"):
        slots.check_slots([0, 1])
    slots.release(got)  # the fenced slot keeps its buffer until unfenced
    assert slots.lent == 1
    with pytest.raises(ValueError, match="slot 0 is not lent"):
        slots.check_slots([0])
    slots.unfence(1)
    assert slots.lent == 0


def test_check_plain_refuses_what_check_slots_refuses() -> None:
    """The tier's common job checks lent slots by ``check_plain``: a slot never lent, released (now free
    or lent again to another task's buffers) or fenced is refused with check_slots' error, naming it."""
    slots = LentSlots(16, num_slots=8)
    got = slots.lend([memoryview(bytearray(16)) for _ in range(3)])
    slots.check_plain(got)
    with pytest.raises(ValueError, match="slot 5 is not lent"):
        slots.check_plain([0, 5])
    slots.fence(2)
    with pytest.raises(ValueError, match="slot 2 is fenced"):
        slots.check_plain([0, 2])
    slots.check_plain([0, 1])  # another slot is fenced: these are not
    slots.release([0])
    with pytest.raises(ValueError, match="slot 0 is not lent"):
        slots.check_plain([0, 1])


# ---------------------------------------------------------- Python per task
def _calls_per_task(a: Any, ks: list[Any], src: list[Any], dst: list[Any]) -> int:
    """Python calls of the adapter's own modules (and fstier.keys) in one
    warm load task's submit and query and one lookup (a generator's
    resumption counts)."""
    count = 0

    def prof(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        name = frame.f_code.co_filename
        if event == "call" and ("fstier/integrations/" in name or name.endswith("fstier/keys.py")):
            count += 1

    def profiled(call: Callable[[], Any]) -> Any:
        sys.setprofile(prof)
        try:
            return call()
        finally:
            sys.setprofile(None)

    assert store(a, ks, src).is_successful()
    assert load(a, ks, dst) == list(range(len(ks)))  # warm: namespace open, memo set
    tid = profiled(lambda: a.submit_load_task(ks, dst))
    submitted = count
    wait_fd(a.get_load_event_fd())  # the job is done: one query finds it
    bits = profiled(lambda: a.query_load_result(tid))
    assert bits is not None and list(bits.get_indices_list()) == list(range(len(ks)))
    assert 0 < submitted < count
    hint = {0: MemoryLayoutDesc([torch.Size(SHAPE)], [torch.float16])}
    lid = profiled(lambda: a.submit_lookup_and_lock_task(ks, hint))
    wait_fd(a.get_lookup_and_lock_event_fd())
    assert list(a.query_lookup_and_lock_result(lid).get_indices_list()) == list(range(len(ks)))
    return count


def test_a_tasks_python_calls_do_not_grow_with_its_keys(adapters: Any, tmp_path: Path) -> None:
    """The adapter's Python calls per load task (submit and query) and per
    lookup are the same for 4 keys as for 32: no per-key bytecode in the
    common task (before the shortcuts: 32 ``_resolve``, 32 ``bytes_of``, 32
    ``BlockKey.__post_init__`` calls more for 32 keys)."""
    a = adapters(tmp_path, L1MemoryDesc(ARENA.data_ptr(), ARENA.numel(), 1))
    counts = []
    for n, seed in ((4, 55), (32, 56)):
        src, dst = objects(n, seed=seed), objects(n, seed=None)
        counts.append(_calls_per_task(a, keys(n, seed=seed), src, dst))
        free(src + dst)
    assert counts[0] == counts[1], counts


def test_concurrent_stores_tell_lmcache_each_chunk_under_its_own_key(adapters: Any, tmp_path: Path) -> None:
    """Stores of two ranks with the same chunk hashes, submitted from three
    threads while a fourth collects, their keys and block keys dropped as
    soon as their results are in (so ``id()`` values are reused): every key
    LMCache is told was stored is a key of that chunk and rank (the adapter
    finds a store's keys by its block keys' ``id()``), each exactly once,
    and nothing is left behind."""
    import threading
    import time
    from collections import Counter

    a = adapters(tmp_path, L1MemoryDesc(ARENA.data_ptr(), ARENA.numel(), 1))
    src = objects(4, seed=91)
    want: Counter[tuple[bytes, int]] = Counter()
    ids: list[int] = []
    lock = threading.Lock()

    def submit(t: int) -> None:
        for r in range(12):
            rank = (R0, R1)[r % 2]
            ks = [ObjectKey(bytes([t, r // 2, i]) * 8, "org/model", rank) for i in range(4)]
            tid = a.submit_store_task(ks, src)
            with lock:
                want.update((k.chunk_hash, k.kv_rank) for k in ks)
                ids.append(tid)
            del ks

    threads = [threading.Thread(target=submit, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + 60
    while (any(th.is_alive() for th in threads) or len(done) < len(ids)) and time.monotonic() < deadline:
        done.update(a.pop_completed_store_tasks())
        time.sleep(0.002)
    for th in threads:
        th.join()
    assert sorted(done) == sorted(ids) and all(r.is_successful() for r in done.values())
    told = Counter((k.chunk_hash, k.kv_rank) for k in a.listener.stored)
    assert told == want and sum(want.values()) == 3 * 12 * 4
    assert len(a._store_keys) == 0
    free(src)
