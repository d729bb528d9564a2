"""The batch fast paths of the hot path keep every refusal and answer of the
per-key loops they skip: job and slot checks decided with C-level loops,
a batch of one success status judged without a loop over its keys, jobs
cut into fewer batches when the I/O queue already keeps every thread
busy, and an idle poll that takes no lock."""

from __future__ import annotations

import enum
import threading
import time
from pathlib import Path

import pytest
from manager_support import FILE_BYTES, fill, key, keys, load, open_tier, payload_for, slot_bytes, store

from fstier.io import native
from fstier.io.engine import EngineJob
from fstier.io.iotypes import LoadOutcome, LoadStatus, StoreOutcome, StoreStatus
from fstier.slots.host_pool import HostBlockPool
from fstier.slots.provider import plain_indices
from fstier.slots.rows import RowSlots
from fstier.tier.outcomes import Judge, _all_one_success


class _Idx(enum.IntEnum):
    ONE = 1


def test_plain_indices_only_for_plain_ints_in_range() -> None:
    assert plain_indices([], 4) and plain_indices((0, 3, 1), 4)
    assert not plain_indices([0, 4], 4)
    assert not plain_indices([-1], 4)
    assert not plain_indices([True], 4)  # a bool is never a slot
    assert not plain_indices([1.0], 4)
    assert not plain_indices([_Idx.ONE], 4)  # an int subclass goes to the per-slot loop


def test_job_checks_name_the_same_offender(tmp_path: Path) -> None:
    with open_tier(tmp_path, num_slots=8) as tier:
        ks = keys(0, 3)
        for slots, match in (
            ([0, 1, 8], "slot 8 is not a slot index in 0..7"),
            ([0, True, 2], "slot True is not a slot index"),
            ([0, 1.0, 2], r"slot 1\.0 is not a slot index"),
            ([0, 1, 1], "a slot appears twice"),
        ):
            with pytest.raises(ValueError, match=match):
                tier.submit_store(("j", str(slots)), ks, slots)
        with pytest.raises(ValueError, match=r"keys\[1\] is 'x' \(str\)"):
            tier.submit_store("k", [ks[0], "x", ks[2]], [0, 1, 2])  # type: ignore[list-item]
        with pytest.raises(ValueError, match=r"keys\[2\]: group 3 does not exist"):
            tier.submit_store("g", [ks[0], ks[1], key(9, group=3)], [0, 1, 2])
        # An int subclass is still accepted as a slot (the per-slot loop's rule).
        res = store(tier, "ok", [key(7)], [_Idx.ONE])  # type: ignore[list-item]
        assert res.success


def test_host_pool_fast_check_still_refuses_unallocated_slots() -> None:
    pool = HostBlockPool(4, FILE_BYTES)
    try:
        pool.alloc(2)  # slots 0 and 1
        pool.check_slots([0, 1])
        with pytest.raises(ValueError, match="slot 2 is not allocated"):
            pool.check_slots([0, 2])
        with pytest.raises(ValueError, match="slot 4 is not a slot index"):
            pool.check_slots([4])
    finally:
        pool.close()


def test_row_slots_fast_check_still_refuses_fenced_and_foreign_slots() -> None:
    rows = RowSlots.from_primary_view(memoryview(bytearray(4 * 64)).cast("B", (4, 64)))
    rows.check_slots([0, 3])
    rows.fence(2)
    with pytest.raises(ValueError, match="slot 2 is fenced"):
        rows.check_slots([0, 2])
    with pytest.raises(ValueError, match="slot 4 is not a row index"):
        rows.check_slots([4])
    with pytest.raises(ValueError, match="slot False is not a row index"):
        rows.check_slots([False])
    rows.unfence(2)
    rows.check_slots([2])
    rows.release()


def test_a_batch_of_one_success_status_is_judged_whole() -> None:
    stored = StoreOutcome(StoreStatus.STORED, nbytes=1)
    skipped = StoreOutcome(StoreStatus.SKIPPED)
    assert _all_one_success([stored, stored]) == "stored"
    assert _all_one_success([skipped]) == "skipped"
    assert _all_one_success([LoadOutcome(LoadStatus.LOADED, nbytes=1)] * 3) == "loaded"
    # Anything else goes key by key: mixed successes, a failure, a foreign object.
    assert _all_one_success([stored, skipped]) is None
    assert _all_one_success([stored, StoreOutcome(StoreStatus.FAILED, "EIO", "x")]) is None
    assert _all_one_success([LoadOutcome(LoadStatus.MISSING, "ENOENT")] * 2) is None
    assert _all_one_success([stored, OSError(5, "x")]) is None
    assert _all_one_success([]) is None


def test_mixed_batches_are_still_judged_key_by_key(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        ks = keys(0, 8)
        assert store(tier, "s1", ks[:4]).success
        res = store(tier, "s2", ks)  # 4 present (skipped), 4 new (stored)
        assert res.success and res.skipped == 4 and res.keys_completed == 8
        # A load whose 6th key is missing keeps its 5-key prefix.
        res = load(tier, "l1", [*ks[:5], key(99), *ks[5:]])
        assert not res.success and res.keys_completed == 5 and res.cause == "miss"


def test_a_job_queued_behind_busy_threads_is_one_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Native path, Python engine: a job cut while every write thread has
    queued work is one call on one thread, so its fixed Python is paid once;
    an idle tier still spreads a job over its threads, as C helpers inside
    one call (one Python call and GIL hand-off per job, not per thread)."""
    monkeypatch.setenv("FSTIER_ENGINE", "python")  # its plan; the C engine's case is the next test
    with open_tier(tmp_path, write_threads=2) as tier:
        if not tier.blocks.batched:
            pytest.skip("one key per op on the Python path")
        gate = threading.Event()
        started = threading.Semaphore(0)

        def hold() -> None:
            started.release()
            gate.wait()

        # All 4 threads (2 read threads steal writes when idle) held, 2 more queued.
        for j in range(6):  # calls queue as writes
            tier._engine.submit(EngineJob(("hold", j), "call", call=hold))
        for _ in range(4):
            assert started.acquire(timeout=10)
        assert tier._engine.engine.spare_threads("write") == 0
        ks = keys(0, 16)
        tier.submit_store("big", ks, list(range(16)))
        job = tier._inflight["big"]
        assert job.bounds == (0, 16) and job.helpers == 0
        gate.set()
        tier.drain()
        (res,) = [r for r in tier.get_finished() if r.job_id == "big"]
        assert res.success and res.keys_completed == 16
        tier.submit_store("idle", keys(16, 16), list(range(16)))
        job = tier._inflight["idle"]
        assert job.bounds == (0, 16) and job.helpers == 1  # 2 write threads: the caller + 1
        tier.drain()
        (res,) = [r for r in tier.get_finished() if r.job_id == "idle"]
        assert res.success and res.keys_completed == 16


def test_a_job_on_the_c_engine_is_one_call_busy_or_idle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Native path, C engine: a job is ONE ``engine_submit`` call with all
    its keys whether the workers are busy or idle (its workers take the keys
    in C), so its fixed Python is paid once either way."""
    monkeypatch.setenv("FSTIER_ENGINE", "native")
    with open_tier(tmp_path, write_threads=2) as tier:
        if not tier.blocks.batched:
            pytest.skip("the C engine moves jobs of the native I/O path")
        engine = tier._engine.engine
        calls: list[int] = []
        real = engine._ext

        class Counting:
            def __getattr__(self, name: str) -> object:
                return getattr(real, name)

            def engine_submit(self, *args: object) -> None:
                calls.append(len(args[5]))  # type: ignore[arg-type]  # the job's key hashes (names: made in C)
                real.engine_submit(*args)

        monkeypatch.setattr(engine, "_ext", Counting())
        native.fault("write", delay_s=0.3, times=8)  # every worker held in its first key's write
        try:
            for i in range(3):
                tier.submit_store(f"busy{i}", keys(16 * i, 16), list(range(16 * i, 16 * i + 16)))
            assert engine.queue_depth("write") > 0  # keys wait: the workers are busy
            assert calls == [16, 16, 16]
            assert tier._inflight["busy0"].bounds == (0, 16) and tier._inflight["busy0"].helpers == 0
            tier.drain()
        finally:
            native.clear_faults()
        tier.submit_store("idle", keys(48, 16), list(range(48, 64)))
        assert calls == [16, 16, 16, 16] and tier._inflight["idle"].bounds == (0, 16)
        tier.drain()
        res = {r.job_id: r for r in tier.get_finished() if isinstance(r.job_id, str)}
        assert all(res[j].success and res[j].keys_completed == 16 for j in ("busy0", "busy1", "busy2", "idle"))


def test_idle_poll_takes_no_lock_and_misses_nothing(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        assert not tier.has_news()
        with tier._lock:  # a poll while the tier's lock is held returns at once
            got: list[object] = []
            t = threading.Thread(target=lambda: got.append(tier.get_finished()))
            t.start()
            t.join(5)
            assert got == [[]]
        ks = keys(0, 2)
        tier.submit_store("s", ks, [0, 1])
        assert tier._engine.wait_idle(5)
        assert tier.has_news()
        (res,) = tier.get_finished()
        assert res.job_id == "s" and res.success
        assert tier.has_news()  # the BlockStored event waits
        (ev,) = tier.take_events()
        assert ev.keys == tuple(ks)
        assert not tier.has_news()


@pytest.mark.parametrize(
    "seq",
    [[], (), [1, 2], (1,), range(3), bytearray(2), "ab", b"ab", None, iter([1]), {1: 2}, type("L", (list,), {})()],
)
def test_a_plain_list_or_tuple_skips_only_checks_it_would_pass(seq: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_check_sequence``'s one type check for a list or tuple answers as
    the general check does, for those and for everything else."""
    from fstier.tier import checks

    def answer() -> str | None:
        try:
            checks._check_sequence(seq, "keys", "job 'j'")
        except ValueError as exc:
            return str(exc)
        return None

    fast = answer()
    monkeypatch.setattr(checks, "_PLAIN_SEQUENCES", ())
    assert answer() == fast


def test_a_job_touches_only_the_counters_it_changes(tmp_path: Path) -> None:
    """A store with nothing skipped and a load with no miss leave those
    counters (and their change counts, what ``TierMetrics.changes`` sums)
    alone; a store that skips and a load that misses count them."""
    with open_tier(tmp_path) as tier:
        m = tier.metrics
        assert store(tier, "s", keys(0, 4)).success
        assert load(tier, "l", keys(0, 4)).success
        assert (m.skipped_blocks.changes, m.load_misses.changes) == (0, 0)
        assert store(tier, "s2", keys(2, 4)).skipped == 2
        assert load(tier, "l2", keys(4, 2)).keys_completed == 2 and load(tier, "l3", keys(6, 3)).keys_failed == 3
        assert (m.skipped_blocks.value, m.load_misses.value) == (2, 3)
        assert (m.skipped_blocks.changes, m.load_misses.changes) == (1, 1)


def test_a_reap_with_nothing_finished_takes_no_pool_lock(tmp_path: Path) -> None:
    """``_reap`` (on every submit, ``get_finished`` and ``take_events``) asks
    the pool for finished jobs only when it has some: with the pool's lock
    held elsewhere, a take of events returns at once, and a job finished
    meanwhile is still reaped by the next call."""
    with open_tier(tmp_path) as tier:
        with tier._engine.engine.lock:
            got: list[object] = []
            t = threading.Thread(target=lambda: got.append(tier.take_events()))
            t.start()
            t.join(5)
            assert got == [[]]
        assert store(tier, "s", keys(0, 2)).success
        (ev,) = tier.take_events()
        assert ev.keys == tuple(keys(0, 2))


@pytest.mark.parametrize("groups", [[], [0, 0, 0], [0, 1, 0], [1, 1], [0, 3, 0, 2]])
def test_known_groups_is_the_per_key_filter(groups: list[int]) -> None:
    from fstier.tier.checks import known_groups

    ks = [key(i, g) for i, g in enumerate(groups)]
    want = [k for k in ks if k.group_idx < 1]
    for given in (ks, tuple(ks), iter(ks)):
        assert list(known_groups(given, 1)) == want


def test_touch_notes_the_files_of_keys_of_known_groups(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        tier.flush_recency()
        ks = keys(0, 3)
        tier.touch([*ks, key(9, 5)])  # a key of no group is ignored
        assert sorted(tier._recency.pending()) == sorted(tier.blocks.path(k) for k in ks)
        tier.touch(k for k in keys(3, 2))  # any iterable of keys, as before
        assert len(tier._recency.pending()) == 5


def test_a_collect_of_many_alike_jobs_has_each_jobs_effects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs collected together whose every key succeeded alike are judged as
    one batch on the C engine (``Judge._finish_batch``: one breaker, cache,
    recency, metrics and budget call for them all); each job's result,
    event, counters, histogram observation and budget bytes are what it
    alone would have given, and a mix of stores, skips and loads keeps its
    order. On the Python engine the same jobs are judged one by one."""
    batches: list[int] = []
    real = Judge._finish_batch
    monkeypatch.setattr(Judge, "_finish_batch", lambda self, jobs: batches.append(len(jobs)) or real(self, jobs))
    with open_tier(tmp_path) as tier:
        m, payload = tier.metrics, tier.payload_bytes(keys(0, 1)[0])
        assert store(tier, "first", keys(0, 4)).success and tier.take_events()
        fill(tier, keys(0, 12), list(range(12)))
        for name, start in (("new1", 4), ("again", 0), ("new2", 8)):  # "again": keys on disk, skipped
            tier.submit_store(name, keys(start, 4), list(range(start, start + 4)))
        tier.submit_load("got", keys(0, 4), list(range(20, 24)))
        tier.drain()  # every job finished before one collect takes them
        got = {r.job_id: r for r in tier.get_finished()}
        assert set(got) == {"new1", "again", "new2", "got"} and all(r.success for r in got.values())
        assert [(got[j].keys_completed, got[j].nbytes, got[j].skipped) for j in ("new1", "again", "new2", "got")] \
            == [(4, 4 * payload, 0), (4, 0, 4), (4, 4 * payload, 0), (4, 4 * payload, 0)]
        assert {k for ev in tier.take_events() for k in ev.keys} == {*keys(4, 8)}  # written, not skipped
        assert (m.stored_blocks.value, m.stored_bytes.value, m.skipped_blocks.value) == (12, 12 * payload, 4)
        assert (m.loaded_blocks.value, m.loaded_bytes.value, m.load_misses.value) == (4, 4 * payload, 0)
        assert (m.store_seconds.snapshot().count, m.load_seconds.snapshot().count) == (4, 1)
        assert m.queued_store_bytes.value == 0 and tier._budget.queued == 0
        assert tier.lookup(keys(0, 12)) == 12
        for s in range(20, 24):
            assert slot_bytes(tier, keys(0, 4)[s - 20], s) == payload_for(keys(0, 4)[s - 20], payload)
        if tier._engine.engine.backend == "native":
            assert batches and max(batches) >= 2


def test_payload_sizes_answer_each_length_whatever_its_cache_holds(tmp_path: Path) -> None:
    # payload_sizes caches the file size of each payload length (lru_cache of 256): every length, far more
    # of them than the cache holds, in any order, one group or several, gets the file size rule's answer,
    # and a tier's stores count exactly the bytes of the files they wrote.
    from fstier.io import block_file_size
    from fstier.keys import BlockKey
    from fstier.tier.jobs import payload_sizes

    lengths = [1, 4095, 4096, 4097, 65536, *range(7000, 7300)]
    ks = [BlockKey(bytes([i + 1]) * 16) for i in range(3)]
    for n in [*lengths, *reversed(lengths), *lengths[::7]]:
        assert payload_sizes([n], ks) == ((n,) * 3, 3 * block_file_size(n)), n
        assert block_file_size(n) % 4096 == 0 and block_file_size(n) >= n + 4096
    mixed = [BlockKey(b"\7" * 16, 1), BlockKey(b"\7" * 16, 0), BlockKey(b"\10" * 16, 1)]
    assert payload_sizes([100, 9000], mixed) == ((9000, 100, 9000), 2 * block_file_size(9000) + block_file_size(100))
    assert payload_sizes([100, 9000], []) == ((), 0)
    with open_tier(tmp_path / "root", max_bytes=64 << 20) as tier:
        assert store(tier, "s", keys(0, 5)).success
        files = sorted((tmp_path / "root").rglob("*.bin"))
        assert len(files) == 5 and {f.stat().st_size for f in files} == {block_file_size(tier.payload_bytes(key(0)))}
        deadline = time.monotonic() + 10
        while tier.usage_bytes is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tier.usage_bytes == sum(f.stat().st_size for f in files)
        assert tier.metrics.snapshot()["fstier_queued_store_bytes"] == 0


def test_a_common_job_takes_the_straight_line_and_any_other_the_general_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The common job never reaches the general path's checks or record maker; a job that is not common (an
    # int subclass slot) does; both move the right bytes.
    from fstier.tier import jobs

    general: list[str] = []
    real_check, real_job = jobs.check_job, jobs.JobMaker.job

    def check_job(*a: object, **k: object) -> None:
        general.append("check_job")
        real_check(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(jobs, "check_job", check_job)
    with open_tier(tmp_path, num_slots=8) as tier:
        maker = tier._maker

        def job(*a: object, **k: object) -> EngineJob:
            general.append("job")
            return real_job(maker, *a, **k)  # type: ignore[arg-type]

        monkeypatch.setattr(maker, "job", job)
        ks = keys(0, 3)
        assert store(tier, "s", ks, [0, 1, 2]).success and load(tier, "l", ks, 3).keys_completed == 3
        assert general == []  # load() checked the loaded bytes
        assert store(tier, "s2", [key(7)], [_Idx.ONE]).success  # type: ignore[list-item]
        assert general == ["check_job", "job"]
        # The provider's own refusal (HostBlockPool: a slot not allocated) still names the job and the slot.
        tier.pool.free([6])
        with pytest.raises(ValueError, match=r"job 'f': .*slot 6 is not allocated"):
            tier.submit_store("f", ks[:1], [6])
    rows = RowSlots.from_primary_view(memoryview(bytearray(4 * 64)).cast("B", (4, 64)))
    rows.check_plain([0, 3])
    rows.fence(2)
    with pytest.raises(ValueError, match="slot 2 is fenced"):
        rows.check_plain([0, 2])
    rows.check_plain([0, 3])  # another row is fenced: these are not
    rows.unfence(2)
    rows.release()
