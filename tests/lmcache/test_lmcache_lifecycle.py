"""What LMCache's StorageManager relies on, against its real classes, on both
I/O paths (``native_io`` on and off): exact keys (every ``kv_rank`` and chunk
hash length), lookups without layout hints, more namespaces than
``MAX_SPACES``, delete after a restart and of another server's files,
evictions heard as the files go, one usage figure, per-chunk load results,
and the root's chunks seeded into LMCache's usage and eviction state at start
(issues 45 and 42).

Without LMCache these tests skip, unless ``FSTIER_REQUIRE_LMCACHE=1``.
"""

from __future__ import annotations

import os
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
from lmcache.v1.distributed.config import EvictionConfig  # noqa: E402
from lmcache.v1.distributed.storage_controllers.eviction_controller import L2AdapterEvictionState  # noqa: E402
from test_lmcache_adapter import (  # noqa: E402
    Listener,
    build,
    free,
    keys,
    load,
    lookup,
    objects,
    raw,
    store,
)

import fstier.integrations.lmcache as lmc  # noqa: E402
from fstier.io.blockfile import block_file_size  # noqa: E402

FILE = block_file_size(2 * 4 * 256 * 64 * 2)  # one SHAPE chunk's file


@pytest.fixture
def adapters(io: str) -> Any:
    made: list[Any] = []

    def make(root: Path, **params: Any) -> Any:
        a = build(root, native_io=io, **params)
        a.listener = Listener()
        a.register_listener(a.listener)
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


def key(h: bytes, rank: int = 0x01000100, group: int = 0, salt: str = "") -> Any:
    return ObjectKey(h, "org/model", rank, group, salt)


def load_result(a: Any, tid: int) -> list[int]:
    """The result of load task ``tid`` once it is in."""
    deadline = time.monotonic() + 30
    while (bits := a.query_load_result(tid)) is None:
        assert time.monotonic() < deadline, "load task never completed"
        time.sleep(0.01)
    return list(bits.get_indices_list())


def looked_up(a: Any, ks: list[Any], hints: Any = None) -> list[int]:
    """A lookup with ``hints`` (None: LMCache's check passes ``{}``)."""
    tid = a.submit_lookup_and_lock_task(ks, {} if hints is None else hints)
    bits = a.query_lookup_and_lock_result(tid)
    return list(bits.get_indices_list())


# ------------------------------------------------------------ exact keys (42.1, 45.1)
def test_kv_ranks_that_differ_above_the_packed_bytes_never_alias(adapters: Any, tmp_path: Path) -> None:
    """Issue 42.1: kv_rank is an unbounded int; a rank that differs from a
    stored one only above the low 8 bits of a packed field is another key:
    a miss, never the other key's bytes."""
    a = adapters(tmp_path, lookup_cache_ttl_s=0)
    r = ObjectKey.ComputeKVRank(1, 0, 1, 0)
    pairs = [
        (r, r + 2**32), (0xFFFFFFFF, -1), (ObjectKey.ComputeKVRank(0, 0, 1, 0), ObjectKey.ComputeKVRank(256, 0, 1, 0)),
    ]
    for n, (stored, other) in enumerate(pairs):
        ks, src = keys(2, seed=70 + n, kv_rank=stored), objects(2, seed=70 + n)
        assert store(a, ks, src).is_successful()
        twins = [key(k.chunk_hash, other) for k in ks]
        assert lookup(a, ks) == [0, 1] and lookup(a, twins) == [], (stored, other)
        assert looked_up(a, twins) == []
        dst = objects(2, seed=None)
        assert load(a, twins, dst) == [] and not any(raw(o).strip(b"\0") for o in dst)
        assert load(a, ks, dst) == [0, 1] and [raw(o) for o in dst] == [raw(o) for o in src]
        free(src + dst)
    # Each listed key is the stored one, exactly.
    listed = {(e.key.kv_rank, e.key.chunk_hash_hex) for e in a.list_l2_keys(page_size=100).entries}
    assert {r for r, _ in listed} == {p[0] for p in pairs}


def test_every_chunk_hash_length_is_an_exact_key(adapters: Any, tmp_path: Path) -> None:
    """Issue 45.1: LMCache's check uses 4-byte hashes. Hashes of every length
    store and load as themselves; a short hash and its zero-padded 8-byte
    twin are different keys; a hash fstier cannot name (over 64 bytes) is a
    miss and is never stored."""
    a = adapters(tmp_path, lookup_cache_ttl_s=0)
    hashes = [b"", b"\x07", b"\x01\x02\x03\x04", b"\x05" * 7, b"\x01\x02\x03\x04\0\0\0\0", b"\x09" * 64]
    ks, src = [key(h) for h in hashes], objects(len(hashes), seed=80)
    for k, o in zip(ks, src, strict=True):  # one length per task here; mixed below
        assert store(a, [k], [o]).is_successful(), k.chunk_hash
    dst = objects(len(hashes), seed=None)
    assert load(a, ks, dst) == list(range(len(hashes)))
    assert [raw(o) for o in dst] == [raw(o) for o in src]
    # A task of mixed lengths: each key its own namespace, the same answers.
    dst2 = objects(len(hashes), seed=None)
    assert load(a, ks[::-1], dst2) == list(range(len(hashes)))
    assert [raw(o) for o in dst2] == [raw(o) for o in src[::-1]]
    assert lookup(a, ks) == looked_up(a, ks) == list(range(len(hashes)))
    # The 4-byte hash's padded twin was stored separately above; a 3-byte
    # hash whose padding equals the 4-byte one's is a miss.
    assert lookup(a, [key(b"\x01\x02\x03"), key(b"\x07\0")]) == []
    too_long = [key(b"\x01" * 65)]
    one = objects(1, seed=81)
    assert not store(a, too_long, one).is_successful()
    assert lookup(a, too_long) == looked_up(a, too_long) == [] and load(a, too_long, one) == []
    listed = sorted(bytes.fromhex(e.key.chunk_hash_hex) for e in a.list_l2_keys(page_size=100).entries)
    assert listed == sorted(hashes)
    free(src + dst + dst2 + one)


def test_a_lookup_without_layout_hints_finds_what_a_past_process_stored(adapters: Any, tmp_path: Path) -> None:
    """Issue 45.1: LMCache's check passes no layout hint, its benchmark a
    placeholder one: every namespace of the key's model, rank, salt and
    hash length is asked, open or only on disk (a restarted server)."""
    first = adapters(tmp_path)
    ks, src = keys(3, seed=82), objects(3, seed=82)
    assert store(first, ks, src).is_successful()
    first.close()
    again = adapters(tmp_path)
    placeholder = {0: MemoryLayoutDesc([], [])}
    assert looked_up(again, ks) == looked_up(again, ks, placeholder) == [0, 1, 2]
    assert looked_up(again, keys(3, seed=83)) == []
    assert looked_up(again, [key(k.chunk_hash, salt="other") for k in ks]) == []
    free(src)


# ------------------------------------------------------------ namespaces (45.2)
def test_more_namespaces_than_max_spaces_store_and_load(
    adapters: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 45.2: LMCache's benchmark gives each key its own kv_rank. Every
    key stores and loads; idle namespaces past MAX_SPACES are closed, least
    recently used first; a pinned one (a job in flight) never is."""
    monkeypatch.setattr(lmc, "MAX_SPACES", 4)
    a = adapters(tmp_path)
    ks = [key(bytes([i]) * 16, rank=i) for i in range(12)]
    src = objects(12, seed=84)
    assert store(a, ks, src).is_successful()
    dst = objects(12, seed=None)
    assert load(a, ks, dst) == list(range(12)) and [raw(o) for o in dst] == [raw(o) for o in src]
    assert len(a.report_status()["namespaces"]) <= 4 and a.report_status()["namespaces_closed_idle"] >= 8
    # A load in flight (submitted, its result not taken) pins its namespace:
    # lookups opening eight more namespaces past the bound close others only.
    inflight = objects(1, seed=None)
    tid = a.submit_load_task(ks[:1], inflight)
    hint = {0: MemoryLayoutDesc([torch.Size((2, 4, 256, 64))], [torch.float16])}
    for i in range(4, 12):
        assert looked_up(a, ks[i : i + 1], hint) == [0]
    assert a.report_status()["namespaces_closed_idle"] >= 16
    assert any(s.sid.kv_rank == 0 and not s.closed for s in a._reg.all())
    assert load_result(a, tid) == [0] and raw(inflight[0]) == raw(src[0])
    assert len(a._reg.all()) <= 4
    free(src + dst + inflight)


# ------------------------------------------------------------ delete (45.3, 42.4)
def test_delete_after_a_restart_and_of_another_servers_chunks(adapters: Any, tmp_path: Path) -> None:
    """Issue 45.3: LMCache's operator path lists the L2 keys and deletes
    them; namespaces this process never opened (a restart, another server
    on the root) are deleted from too."""
    writer = adapters(tmp_path, lookup_cache_ttl_s=0)
    ks, src = keys(4, seed=85, salt="s"), objects(4, seed=85)
    assert store(writer, ks, src).is_successful()
    other = adapters(tmp_path, lookup_cache_ttl_s=0)  # a second server on the root, nothing open
    listed = [e.key.to_object_key() for e in other.list_l2_keys(page_size=100).entries]
    assert sorted(k.chunk_hash for k in listed) == sorted(k.chunk_hash for k in ks)
    other.delete(listed[:2])
    assert sorted(k.chunk_hash for k in other.listener.deleted) == sorted(k.chunk_hash for k in listed[:2])
    assert len(list(tmp_path.rglob("*.bin"))) == 2
    writer.close()
    restarted = adapters(tmp_path, lookup_cache_ttl_s=0)
    restarted.delete([e.key.to_object_key() for e in restarted.list_l2_keys(page_size=100).entries])
    assert list(tmp_path.rglob("*.bin")) == [] and lookup(restarted, ks) == []
    assert len(restarted.listener.deleted) == 2
    free(src)


def test_a_delete_with_a_key_fstier_cannot_name_deletes_the_others(adapters: Any, tmp_path: Path) -> None:
    """Issue 42.4: one key fstier cannot name (a hash over 64 bytes, a
    group out of range) fails itself only."""
    a = adapters(tmp_path, lookup_cache_ttl_s=0)
    ks, src = keys(3, seed=86), objects(3, seed=86)
    assert store(a, ks, src).is_successful()
    bad = [key(b"\x01" * 65, rank=ks[0].kv_rank), ObjectKey(ks[0].chunk_hash, "org/model", ks[0].kv_rank, 10**6)]
    a.delete([ks[0], bad[0], ks[1], bad[1]])
    assert lookup(a, ks) == [2] and sorted(k.chunk_hash for k in a.listener.deleted) == sorted(
        k.chunk_hash for k in ks[:2]
    )
    free(src)


# ------------------------------------------------------------ evictions, usage (45.4)
def test_evictions_reach_lmcache_as_the_files_go_in_one_usage_figure(adapters: Any, tmp_path: Path) -> None:
    """Issue 45.4: a file fstier evicts is LMCache's deletion when it goes
    (no pop or query in between), whichever namespace's tier evicted it;
    LMCache's usage and fstier's count are one figure, in whole files."""
    a = adapters(tmp_path, max_bytes="64MiB")
    r0, r1 = ObjectKey.ComputeKVRank(2, 0, 2, 0), ObjectKey.ComputeKVRank(2, 1, 2, 1)
    k0, k1 = keys(3, seed=87, kv_rank=r0, salt="a"), keys(3, seed=88, kv_rank=r1, salt="b")
    src = objects(6, seed=87)
    assert store(a, k0 + k1, src).is_successful()
    on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*.bin"))
    assert on_disk == 6 * FILE
    usage = a.get_usage()
    assert usage.total_bytes_used == on_disk and dict(usage.bytes_by_cache_salt) == {"a": 3 * FILE, "b": 3 * FILE}
    # One namespace's tier evicts down to one file's room: every file of the
    # root goes, the other namespace's too, and LMCache hears at once.
    spaces = a._reg.all()
    assert len(spaces) == 2
    spaces[0].tier.run_capacity_pass(max_bytes=FILE)
    left = list(tmp_path.rglob("*.bin"))
    assert len(a.listener.deleted) == 6 - len(left) >= 5
    gone = {k.chunk_hash for k in a.listener.deleted}
    assert {k.chunk_hash for k in k0 + k1} - gone == {p.name.split("-")[0] for p in left} and gone & {
        k.chunk_hash for k in k1
    } and gone & {k.chunk_hash for k in k0}
    assert a.get_usage().total_bytes_used == len(left) * FILE
    free(src)


# ------------------------------------------------------------ per-chunk loads (45.5)
def test_a_missing_chunk_fails_itself_only(adapters: Any, tmp_path: Path) -> None:
    """Issue 45.5: loading [stored, missing, stored] gives [0, 2]; a task of
    two groups keeps group 1's chunks after a miss in group 0."""
    a = adapters(tmp_path, lookup_cache_ttl_s=0)
    ks, src = keys(3, seed=89), objects(3, seed=89)
    assert store(a, [ks[0], ks[2]], [src[0], src[2]]).is_successful()
    dst = objects(3, seed=None)
    assert load(a, ks, dst) == [0, 2]
    assert raw(dst[0]) == raw(src[0]) and raw(dst[2]) == raw(src[2]) and not raw(dst[1]).strip(b"\0")
    g0, g1 = keys(2, seed=90, group=0), keys(2, seed=91, group=1)
    gsrc = objects(4, seed=90)
    assert store(a, [g0[1], *g1], gsrc[1:]).is_successful()
    gdst = objects(4, seed=None)
    assert load(a, g0 + g1, gdst) == [1, 2, 3]
    assert [raw(o) for o in gdst[1:]] == [raw(o) for o in gsrc[1:]]
    assert sorted(k.chunk_hash for k in a.listener.accessed) == sorted(
        k.chunk_hash for k in [ks[0], ks[2], g0[1], *g1]
    )
    free(src + dst + gsrc + gdst)


# ------------------------------------------------------------ restart (45.6)
def test_a_restart_seeds_usage_per_salt_and_the_l2_eviction_state(adapters: Any, tmp_path: Path) -> None:
    """Issue 45.6: what the root holds at start is LMCache's usage (per
    cache_salt) and known to its L2 eviction policy, so the eviction
    controller can choose it."""
    first = adapters(tmp_path, max_bytes="64MiB")
    ka, kb = keys(2, seed=92, salt="a"), keys(3, seed=93, salt="b")
    src = objects(5, seed=92)
    assert store(first, ka + kb, src).is_successful()
    first.close()
    again = build(tmp_path, max_bytes="64MiB")
    try:
        usage = again.get_usage()
        assert dict(usage.bytes_by_cache_salt) == {"a": 2 * FILE, "b": 3 * FILE}
        assert usage.total_bytes_used == 5 * FILE
        state = L2AdapterEvictionState(0, again, EvictionConfig("LRU"))
        victims = [k for act in state.eviction_policy.get_eviction_actions(1.0) for k in act.keys]
        assert sorted(k.chunk_hash for k in victims) == sorted(k.chunk_hash for k in ka + kb)
        # Deleting what the policy chose leaves nothing counted, nothing on disk.
        again.delete(victims)
        assert again.get_usage().bytes_by_cache_salt == {} and list(tmp_path.rglob("*.bin")) == []
    finally:
        again.close()
    free(src)


def test_a_listener_registered_later_hears_the_seed(adapters: Any, tmp_path: Path) -> None:
    """Every listener hears of the root's chunks as it registers."""
    first = adapters(tmp_path)
    ks, src = keys(2, seed=94), objects(2, seed=94)
    assert store(first, ks, src).is_successful()
    again = adapters(tmp_path)
    late = Listener()
    again.register_listener(late)
    assert sorted(k.chunk_hash for k in late.stored) == sorted(k.chunk_hash for k in ks)
    assert sorted(k.chunk_hash for k in again.listener.stored) == sorted(k.chunk_hash for k in ks)
    free(src)
