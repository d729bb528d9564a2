"""FsTier core behaviour on real files: round trips, prefix lookups, partial
loads without livelock, events, metrics, validation, close()."""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

import pytest
from conftest import make_config
from manager_support import (
    FILE_BYTES,
    TINY_GROUP,
    fill,
    fstier_threads,
    key,
    keys,
    load,
    open_tier,
    payload_for,
    store,
    temp_files,
    tiny_config,
)

from fstier.errors import MetricsUnavailableError, PoolError, TierClosedError
from fstier.io import fsops
from fstier.manager import BlockRemoved, BlockStored, FsTier, JobResult
from fstier.slots.host_pool import HostBlockPool


def test_round_trip_bytes_and_paths(tmp_path: Path) -> None:
    with open_tier(tmp_path / "root") as tier:
        ks = keys(0, 8)
        res = store(tier, "s", ks)
        assert res == JobResult("s", "store", True, 8, 0, 8 * 128, res.seconds, None, 0)
        for k in ks:
            # the files are where the mapper names them, and lookup finds them there
            assert tier.mapper.path_for(k).stat().st_size == FILE_BYTES
        assert tier.lookup(ks) == 8
        res = load(tier, "l", ks, first_slot=16)
        assert res.success and res.keys_completed == 8 and res.nbytes == 8 * 128
        assert res.cause is None


def test_a_jobs_context_comes_back_on_its_result_and_pending_counts_until_taken(tmp_path: Path) -> None:
    """What the caller passes with a job rides on the job's record to its
    result (an adapter keeps no job table), for a job that ran, one refused
    at once and an empty one; has_pending() holds until get_finished() took it."""
    with open_tier(tmp_path / "root") as tier:
        ks = keys(0, 4)
        fill(tier, ks, [0, 1, 2, 3])
        assert not tier.has_pending()
        ctx = ("vllm keys", object())
        tier.submit_store("s", ks, [0, 1, 2, 3], context=ctx)
        tier.submit_load("empty", [], [], context=["e"])
        assert tier.has_pending()
        tier.drain()
        assert tier.has_pending()  # finished, not yet taken
        got = {r.job_id: r for r in tier.get_finished()}
        assert not tier.has_pending()
        assert got["s"].success and got["s"].context is ctx
        assert got["empty"].context == ["e"]
        assert got["s"] == JobResult("s", "store", True, 4, 0, 4 * 128, got["s"].seconds, None, 0)  # not compared
        tier.submit_load("l", ks, [8, 9, 10, 11], context="mine")
        tier.drain()
        (res,) = tier.get_finished()
        assert res.success and res.context == "mine" and "mine" not in repr(res)


def test_lookup_is_a_prefix_and_stops_at_first_miss(tmp_path: Path) -> None:
    with open_tier(tmp_path / "root") as tier:
        ks = keys(0, 6)
        store(tier, "s", ks[:3] + ks[4:])
        assert tier.lookup(ks) == 3
        assert tier.lookup(ks[:3]) == 3
        assert tier.lookup([]) == 0
        assert tier.lookup([ks[3], *ks[:3]]) == 0
        snap = tier.metrics.snapshot()
        assert snap["fstier_lookup_hits_total"] == 6
        assert snap["fstier_lookup_misses_total"] == 2


def test_large_lookup_parallel_path_matches_sequential(tmp_path: Path) -> None:
    with open_tier(tmp_path / "root", lookup_cache_ttl_s=0) as tier:
        ks = keys(0, 1500)
        for i in range(0, 1500, 50):
            store(tier, f"s{i}", ks[i : i + 50], list(range(50)))
        assert tier.lookup(ks) == 1500
        os.unlink(tier.mapper.path_for(ks[1100]))
        assert tier.lookup(ks) == 1100
        os.unlink(tier.mapper.path_for(ks[300]))
        assert tier.lookup(ks) == 300
        assert tier.lookup(ks[301:]) == 1100 - 301


def test_store_of_present_keys_is_skipped_and_counted(tmp_path: Path) -> None:
    with open_tier(tmp_path / "root") as tier:
        ks = keys(0, 4)
        store(tier, "a", ks[:2])
        res = store(tier, "b", ks)
        assert res.success and res.skipped == 2 and res.keys_completed == 4
        assert res.nbytes == 2 * 128
        assert tier.metrics.snapshot()["fstier_store_skipped_blocks_total"] == 2
        events = tier.take_events()
        assert events == [BlockStored(tuple(ks[:2])), BlockStored(tuple(ks[2:]))]
        assert tier.take_events() == []


def test_take_events_without_reap_leaves_a_finished_job_to_get_finished(tmp_path: Path) -> None:
    with open_tier(tmp_path / "root") as tier:
        ks = keys(0, 3)
        fill(tier, ks, [0, 1, 2])
        tier.submit_store("a", ks, [0, 1, 2])
        deadline = time.monotonic() + 10
        while not tier.has_news():  # finished in the engine, not reaped by the tier yet
            assert time.monotonic() < deadline, "the store never finished"
            time.sleep(0.001)
        assert tier.take_events(reap=False) == []  # nothing collected here
        (res,) = tier.get_finished()
        assert res.success and res.keys_completed == 3
        assert tier.take_events(reap=False) == [BlockStored(tuple(ks))]  # reaped by get_finished
        assert tier.take_events() == []


def test_partial_load_keeps_prefix_and_lookup_stops_reporting_corrupt_key(tmp_path: Path) -> None:
    with open_tier(tmp_path / "root") as tier:
        ks = keys(0, 6)
        store(tier, "s", ks)
        assert tier.lookup(ks) == 6  # now cached as present
        path = tier.mapper.path_for(ks[3])
        raw = bytearray(path.read_bytes())
        raw[4096 + 7] ^= 0xFF  # one payload bit: only the checksum can tell
        path.write_bytes(bytes(raw))
        res = load(tier, "l", ks)
        assert not res.success
        assert (res.keys_completed, res.keys_failed) == (3, 3)
        assert res.cause == "corrupt:payload_checksum"
        assert not path.exists()  # proven corruption removes the file
        assert tier.lookup(ks) == 3  # the cached "present" was invalidated: no livelock
        assert BlockRemoved((ks[3],), "corrupt") in tier.take_events()
        assert tier.metrics.snapshot()["fstier_corrupt_blocks_total"] == 1
        store(tier, "again", [ks[3]])
        assert tier.lookup(ks) == 6


def test_transient_load_error_is_not_a_hit_again_until_stored(tmp_path: Path, monkeypatch) -> None:
    with open_tier(tmp_path / "root", native_io="off") as tier:  # faults through the Python seam
        ks = keys(0, 4)
        store(tier, "s", ks)
        bad_path = str(tier.mapper.path_for(ks[1]))
        real_open = fsops.FS.open

        def flaky_open(path, flags, mode=0o600):
            if str(path) == bad_path:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real_open(path, flags, mode)

        monkeypatch.setattr(fsops.FS, "open", flaky_open)
        res = load(tier, "l", ks)
        assert (res.keys_completed, res.cause) == (1, "EIO")
        monkeypatch.undo()
        assert os.path.exists(bad_path)  # a transient error never removes a block
        # The file is still there, but the key failed: never a hit until re-stored.
        assert tier.lookup(ks) == 1
        res = store(tier, "s2", [ks[1]])
        assert res.success and res.skipped == 0  # replaced, not skipped onto
        assert tier.lookup(ks) == 4
        assert load(tier, "l2", ks).success


def test_validation_errors_name_the_problem(tmp_path: Path) -> None:
    with open_tier(tmp_path / "root", num_slots=4) as tier:
        with pytest.raises(ValueError, match="2 keys but 1 slots"):
            tier.submit_store("x", keys(0, 2), [0])
        with pytest.raises(ValueError, match="slot 4 is not a slot index"):
            tier.submit_load("x", keys(0, 1), [4])
        with pytest.raises(ValueError, match="appears twice"):
            tier.submit_load("x", keys(0, 2), [1, 1])
        with pytest.raises(ValueError, match="group 3 does not exist"):
            tier.submit_load("x", [key(1, group=3)], [0])
        tier.submit_store("dup", keys(0, 1), [0])
        with pytest.raises(ValueError, match="already in flight"):
            tier.submit_store("dup", keys(1, 1), [1])
        tier.submit_load("empty", [], [])
        tier.drain()
        assert {r.job_id: r.success for r in tier.get_finished()} == {"dup": True, "empty": True}


def test_lookup_validates_keys_like_submit(tmp_path: Path) -> None:
    """Issue 15 item 8: a non-key element was an AttributeError deep in the
    probe; it is a ValueError naming the element, as submit_store raises."""
    with open_tier(tmp_path / "root", num_slots=4) as tier:
        with pytest.raises(ValueError, match=r"lookup: keys\[0\] is 'x' \(str\); keys must be BlockKey"):
            tier.lookup(["x"])  # type: ignore[list-item]
        with pytest.raises(ValueError, match=r"keys\[1\] is None"):
            tier.lookup([key(1), None])  # type: ignore[list-item]
        with pytest.raises(ValueError, match=r"lookup: keys\[0\]: group 3 does not exist"):
            tier.lookup([key(1, group=3)])
        assert tier.lookup([key(1)]) == 0
        with pytest.raises(ValueError, match=r"present: keys\[0\] is 'x' \(str\)"):
            tier.present(["x"])  # type: ignore[list-item]


def test_empty_job_does_not_bypass_the_duplicate_id_check(tmp_path: Path) -> None:
    """Issue 15 item 9: an empty (or degraded, or slot-busy) job finished at
    once without looking at the ids in flight, so one job id got two results."""
    with open_tier(tmp_path / "root", num_slots=4) as tier:
        fill(tier, keys(0, 2), [0, 1])
        tier.submit_store("J", keys(0, 2), [0, 1])
        with pytest.raises(ValueError, match="job id 'J' is already in flight"):
            tier.submit_store("J", [], [])
        with pytest.raises(ValueError, match="job id 'J' is already in flight"):
            tier.submit_load("J", [], [])
        tier.drain()
        results = tier.get_finished()
        assert [r.job_id for r in results] == ["J"] and results[0].success
        tier.submit_store("J", [], [])  # reported: the id is free again
        assert [r.job_id for r in tier.get_finished()] == ["J"]


def test_slots_not_currently_allocated_are_refused(tmp_path: Path) -> None:
    """Issue 15 item 10: a slot the caller does not hold (never allocated, or
    freed) may be handed to someone else at any time: refuse it."""
    cfg = tiny_config(tmp_path / "root")
    with HostBlockPool(4, FILE_BYTES) as pool, FsTier(cfg, pool) as tier:
        with pytest.raises(ValueError, match="job 's': .*slot 0 is not allocated; take slots with alloc"):
            tier.submit_store("s", keys(0, 1), [0])
        held = pool.alloc(2)
        fill(tier, keys(0, 2), held)
        tier.submit_store("s", keys(0, 2), held)
        tier.drain()
        assert tier.get_finished()[0].success
        pool.free([held[1]])
        with pytest.raises(ValueError, match=f"slot {held[1]} is not allocated"):
            tier.submit_load("l", keys(0, 2), held)
        tier.submit_load("l", keys(0, 1), held[:1])
        tier.drain()
        assert tier.get_finished()[0].success


def test_pool_too_small_is_a_clear_error(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path / "root", blocks_per_file=64)  # 64 x 128 B = 8 KiB payload
    with HostBlockPool(2, 4096) as pool, pytest.raises(PoolError, match="slot_bytes >= 8192"):
        FsTier(cfg, pool)


def test_from_config_yaml_with_private_pool(tmp_path: Path) -> None:
    root = tmp_path / "root"
    cfg_file = tmp_path / "fstier.yaml"
    cfg_file.write_text(
        f"tier:\n  root_dir: {root}\n  read_threads: 2\n  write_threads: 1\n"
        "model:\n  name: m\n  dtype: float16\n  groups:\n"
        "    - {block_size: 4, num_layers: 1, num_kv_heads: 1, head_size: 8}\n"
    )
    with FsTier.from_config(cfg_file) as tier:
        assert tier.pool.slot_bytes == 4096 and tier.pool.num_slots >= 6
        pool_name = tier.pool.name
        assert tier.pool.alloc(6) == list(range(6))  # jobs name slots the caller holds
        assert store(tier, "s", keys(0, 3)).success
        assert load(tier, "l", keys(0, 3), first_slot=3).success
    assert not os.path.exists(f"/dev/shm/{pool_name}")  # the private pool was closed


def test_close_is_idempotent_joins_threads_and_leaves_no_temp_files(tmp_path: Path) -> None:
    root = tmp_path / "root"
    before = set(fstier_threads())
    with open_tier(root, max_bytes="1MiB") as tier:
        ks = keys(0, 32)
        fill(tier, ks, list(range(32)))
        tier.submit_store("s", ks, list(range(32)))  # closed while in flight
        tier.lookup(keys(0, 2000))  # starts the lookup threads
        assert set(fstier_threads()) - before
        tier.close()
        tier.close()
        with pytest.raises(TierClosedError, match="closed"):
            tier.lookup(ks)
        with pytest.raises(TierClosedError):
            tier.submit_load("l", ks[:1], [0])
        assert [r.job_id for r in tier.get_finished()] == ["s"]
    assert set(fstier_threads()) <= before
    assert temp_files(root) == []


def test_metrics_snapshot_and_prometheus_collector(tmp_path: Path) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    with open_tier(tmp_path / "root") as tier:
        store(tier, "s", keys(0, 3))
        load(tier, "l", keys(0, 4))
        snap = tier.metrics.snapshot()
        assert snap["fstier_stored_blocks_total"] == 3
        assert snap["fstier_loaded_blocks_total"] == 3
        assert snap["fstier_load_missed_blocks_total"] == 1
        assert snap["fstier_failures_total"] == {"miss": 1}
        assert snap["fstier_store_job_seconds"]["count"] == 1
        registry = prometheus_client.CollectorRegistry()
        registry.register(tier.metrics.prometheus_collector())
        text = prometheus_client.generate_latest(registry).decode()
        assert "fstier_stored_blocks_total 3.0" in text
        assert 'fstier_failures_total{cause="miss"} 1.0' in text
        assert "fstier_load_job_seconds_count 1.0" in text


def test_prometheus_missing_extra_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with open_tier(tmp_path / "root") as tier, pytest.raises(
        MetricsUnavailableError, match=r"metrics extra.*pip install prometheus-client"
    ):
        tier.metrics.start_prometheus_exporter(0)


def test_payload_bytes_are_key_specific(tmp_path: Path) -> None:
    # guards the helpers: distinct keys must give distinct payloads
    assert payload_for(key(1), 128) != payload_for(key(2), 128)


def test_store_keys_completed_is_a_prefix_of_keys_on_disk(tmp_path: Path, monkeypatch) -> None:
    """keys[:keys_completed] must all be on disk: an engine advertises them."""
    with open_tier(tmp_path / "root", native_io="off") as tier:  # faults through the Python seam
        ks = keys(0, 4)
        bad_name = str(tier.mapper.path_for(ks[1]).name)
        real_link = fsops.FS.link_at

        # Publication is where a full directory refuses a new name.
        def link_at(fd, dir_fd, name):
            if name == bad_name:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_link(fd, dir_fd, name)

        monkeypatch.setattr(fsops.FS, "link_at", link_at)
        res = store(tier, "s", ks)
        monkeypatch.undo()
        assert not res.success and res.cause == "ENOSPC"
        assert res.keys_completed == 1 and res.keys_failed == 3
        on_disk = [tier.mapper.path_for(k).exists() for k in ks]
        assert all(on_disk[: res.keys_completed])
        assert on_disk == [True, False, True, True]  # later keys were written all the same
        stored = [e for e in tier.take_events() if isinstance(e, BlockStored)]
        assert {k for e in stored for k in e.keys} == {ks[0], ks[2], ks[3]}


def test_hits_bump_recency_once_per_file_per_flush(tmp_path: Path, monkeypatch) -> None:
    """LRU recency costs one metadata write per file per flush, not one per
    hit (a SETATTR round trip on NFS), and is written before eviction."""

    with open_tier(tmp_path / "root") as tier:
        ks = keys(0, 2)
        store(tier, "s", ks)
        paths = [tier.mapper.path_for(k) for k in ks]
        old = paths[0].stat().st_mtime_ns - 3600 * 10**9
        for p in paths:
            os.utime(p, ns=(old, old))
        calls: list[str] = []
        # The flush's batch of paths, on both I/O paths (the native one touches
        # the batch in one call, with no per-file Python to spy on).
        from fstier.tier import recency

        real_bump = recency._bump_mtimes
        monkeypatch.setattr(
            recency, "_bump_mtimes", lambda ps, blocks=None: (calls.extend(ps), real_bump(ps, blocks))[1]
        )
        for j in range(20):
            assert load(tier, f"l{j}", ks).success
        tier.run_capacity_pass()  # flushes pending recency first
        assert sorted(calls) == sorted(map(str, paths))
        assert all(p.stat().st_mtime_ns > old + 3000 * 10**9 for p in paths)


def test_recency_flush_runs_as_background_write_job(tmp_path: Path) -> None:
    """When a flush is due, the mtime writes go to the write queue as their own
    job: no load waits for them and the engine never sees that job."""
    from fstier.clock import ManualClock
    from fstier.tier.recency import FLUSH_S

    clock = ManualClock()
    with open_tier(tmp_path / "root", clock=clock) as tier:
        ks = keys(0, 3)
        store(tier, "s", ks)
        old = tier.mapper.path_for(ks[0]).stat().st_mtime_ns - 3600 * 10**9
        for k in ks:
            os.utime(tier.mapper.path_for(k), ns=(old, old))
        clock.advance(FLUSH_S)  # the next hit finds a flush due
        tier.submit_load("l", ks, [0, 1, 2])
        assert tier.drain(30)
        results = tier.get_finished()
        assert [r.job_id for r in results] == ["l"] and results[0].success
        # The job's hits, noted at once when it was reaped (on both paths:
        # one record per job), found the flush due and its job wrote those files.
        bumped = [tier.mapper.path_for(k).stat().st_mtime_ns > old + 3000 * 10**9 for k in ks]
        assert sum(bumped) == 3, bumped
        tier.flush_recency()
        assert all(tier.mapper.path_for(k).stat().st_mtime_ns > old + 3000 * 10**9 for k in ks)


def test_clear_removes_this_ranks_blocks_only_and_accounts_for_them(tmp_path: Path) -> None:
    root = tmp_path / "root"
    tiers, pools = [], []
    try:
        for rank in (0, 1):  # a v2 runner keeps tp in the namespace: one subtree per rank
            # Only rank 0 counts usage: its count is then exactly its own files.
            limit = {"max_bytes": "1GiB"} if rank == 0 else {}
            cfg = make_config(
                root, groups=[dict(TINY_GROUP)], parallel={"tp_size": 2, "rank": rank, "model_runner": "v2"},
                tier={"read_threads": 1, "write_threads": 1, **limit},
            )
            pool = HostBlockPool(8, FILE_BYTES)
            pool.alloc(8)
            pools.append(pool)
            tiers.append(FsTier(cfg, pool))
        mine, other = tiers
        mine.run_capacity_pass()
        ks = keys(0, 4)
        assert store(mine, "a", ks).success and store(other, "b", ks).success
        stray = mine.mapper.blocks_dir / "stray.txt"
        stray.write_bytes(b"not a block")
        mine.take_events()
        assert mine.usage_bytes == 4 * FILE_BYTES
        assert mine.lookup(ks) == 4  # cached as present

        assert mine.clear() == 4
        assert mine.lookup(ks) == 0  # the cached answers are forgotten
        assert not any(mine.mapper.path_for(k).exists() for k in ks)
        assert other.lookup(ks) == 4 and stray.exists() and mine.mapper.namespace_dir.joinpath("config.json").exists()
        (event,) = mine.take_events()
        assert isinstance(event, BlockRemoved) and event.reason == "cleared"
        assert sorted(event.keys, key=lambda k: k.block_hash) == ks
        assert mine.usage_bytes == 0
        assert mine.clear() == 0
        # and the tier stores again afterwards
        assert store(mine, "c", ks).success and mine.lookup(ks) == 4
    finally:
        for t in tiers:
            t.close()
        for p in pools:
            p.close()
