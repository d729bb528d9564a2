"""Fault-matrix rows seen through :class:`fstier.manager.FsTier`: hung I/O
(row 23: failed op, breaker trips, recovers), the corrupt counter (row 4),
EMFILE/ENOSPC as failed jobs with a log line and no leaked fd (rows 10, 16),
symlinked directories on the load path (row 18) and LRU eviction racing
loads (zero wrong bytes).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fstier.clock import SYSTEM_CLOCK, Clock, ManualClock
from fstier.io import blockcheck, fsops
from fstier.io.blockstore import NamespaceDirs
from fstier.manager import FsTier, JobResult
from fstier.slots.host_pool import HostBlockPool

from ._support import (
    FaultyOps,
    block_files,
    fd_count,
    key_for,
    payload_for,
    raise_errno,
    temp_files,
    tiny_config,
)


def _tier(root: Path, clock: Clock = SYSTEM_CLOCK, **tier: Any) -> FsTier:
    kw: dict[str, Any] = {"read_threads": 2, "write_threads": 2, "lookup_cache_ttl_s": 0, **tier}
    return FsTier.from_config(tiny_config(root, **kw), clock=clock)


@pytest.fixture
def ops(monkeypatch: pytest.MonkeyPatch) -> FaultyOps:
    """The Python path's syscall seam, faulty: a tier that takes it runs
    the Python backend (``native_io="off"``)."""
    faulty = FaultyOps()
    monkeypatch.setattr(fsops, "FS", faulty)
    return faulty


_job = iter(range(10**9))


def _run(
    tier: FsTier, kind: str, keys: list[Any], fill: bool = True, after_submit: Callable[[], None] | None = None
) -> tuple[JobResult, list[bytes]]:
    pool: HostBlockPool = tier.pool
    slots = pool.alloc(len(keys))
    n = tier.payload_bytes(keys[0])
    keep = False
    try:
        if kind == "store" and fill:
            for k, s in zip(keys, slots, strict=True):
                pool.slot_view(s)[:n] = payload_for(k, n)
        jid = next(_job)
        (tier.submit_store if kind == "store" else tier.submit_load)(jid, keys, slots)
        if after_submit is not None:
            after_submit()
        assert tier.drain(30)
        results = [r for r in tier.get_finished() if r.job_id == jid]
        assert len(results) == 1
        # A slot whose op timed out stays fenced: keep it out of the next job.
        keep = results[0].cause == "timeout"
        return results[0], [bytes(pool.slot_view(s)[:n]) for s in slots]
    finally:
        if not keep:
            pool.free(slots)


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[FsTier]:
    t = _tier(tmp_path / "root")
    yield t
    t.close()


@pytest.fixture
def py_tier(tmp_path: Path) -> Iterator[FsTier]:
    """A tier on the Python backend, whose system calls ``ops`` sees."""
    t = _tier(tmp_path / "root", native_io="off")
    yield t
    t.close()


# ------------------------------------------------------------------ row 23
def test_hung_io_fails_trips_breaker_and_recovers(
    tmp_path: Path, ops: FaultyOps, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock()
    t = _tier(tmp_path / "root", clock, native_io="off", io_timeout_s=0.2, breaker_failures=2, breaker_cooldown_s=0.5)
    release = threading.Event()
    try:
        def hang(real: Any, fd: int, bufs: Any, off: int) -> int:
            clock.advance(0.2)  # the call outlives its job's deadline
            release.wait(10)
            return int(real(fd, bufs, off))

        ops.hooks["pwritev"] = hang
        with caplog.at_level(logging.WARNING):
            r1, _ = _run(t, "store", [key_for(1)])
            r2, _ = _run(t, "store", [key_for(2)])
        assert (r1.success, r1.cause) == (False, "timeout")
        assert (r2.success, r2.cause) == (False, "timeout")
        assert t.degraded and t.breaker_state == "open"
        assert any("circuit breaker open" in r.getMessage() for r in caplog.records)
        assert t.metrics.breaker_trips.value == 1
        # While open: lookups miss, stores drop at once.
        assert t.lookup([key_for(1)]) == 0
        r3, _ = _run(t, "store", [key_for(3)])
        assert (r3.success, r3.cause) == (False, "degraded")
        # The hung calls return; their slots are released, nothing torn is visible.
        ops.hooks.clear()
        release.set()
        assert t.wait_fences_released(10)
        clock.advance(0.5)  # cool-down -> half-open
        r4, _ = _run(t, "store", [key_for(4)])
        assert r4.success and t.breaker_state == "closed"
        r5, got = _run(t, "load", [key_for(4)])
        assert r5.success and got[0] == payload_for(key_for(4), t.payload_bytes(key_for(4)))
        for f in block_files(t.mapper.root):
            assert blockcheck.verify_file(f).ok
    finally:
        release.set()
        t.close()


def test_hung_read_is_a_failed_load_not_wrong_bytes(tmp_path: Path, ops: FaultyOps) -> None:
    t = _tier(tmp_path / "root", io_timeout_s=0.2, breaker_failures=5, native_io="off")
    release = threading.Event()
    try:
        key = key_for(1)
        assert _run(t, "store", [key])[0].success

        def hang(real: Any, fd: int, bufs: Any, off: int) -> int:
            release.wait(10)
            return int(real(fd, bufs, off))

        ops.hooks["preadv"] = hang
        r, _ = _run(t, "load", [key])
        assert (r.success, r.keys_completed, r.cause) == (False, 0, "timeout")
        assert t.fenced_slots, "the slot the hung read may still fill must be fenced"
        ops.hooks.clear()
        release.set()
        assert t.wait_fences_released(10)
        r, got = _run(t, "load", [key])
        assert r.success and got[0] == payload_for(key, t.payload_bytes(key))
    finally:
        release.set()
        t.close()


# ------------------------------------------------------------------ row 4 (counter)
def test_corrupt_counter_and_event(tier: FsTier) -> None:
    key = key_for(1)
    assert _run(tier, "store", [key])[0].success
    path = tier.mapper.path_for(key)
    path.write_bytes(path.read_bytes()[:5000])
    r, _ = _run(tier, "load", [key])
    assert not r.success and r.cause is not None and r.cause.startswith("corrupt:")
    assert tier.metrics.corrupt.value == 1
    assert any(getattr(e, "reason", "") == "corrupt" for e in tier.take_events())
    assert not path.exists() and tier.lookup([key]) == 0


# ------------------------------------------------------------------ rows 10, 16
@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENOSPC, errno.EIO, errno.ESTALE])
def test_errno_faults_fail_jobs_cleanly(
    py_tier: FsTier, ops: FaultyOps, code: int, caplog: pytest.LogCaptureFixture
) -> None:
    tier = py_tier
    good = key_for(100)
    assert _run(tier, "store", [good])[0].success
    fds = fd_count()
    name = errno.errorcode[code]
    ops.hooks["open"] = raise_errno(code)
    with caplog.at_level(logging.WARNING, logger="fstier.manager"):
        rs, _ = _run(tier, "store", [key_for(1)])
        rl, _ = _run(tier, "load", [good])
    assert (rs.success, rs.cause) == (False, name)
    assert (rl.success, rl.cause) == (False, name)
    assert any(name in r.getMessage() for r in caplog.records), "no log line names the cause"
    assert fd_count() <= fds and temp_files(tier.mapper.root) == []
    assert tier.mapper.path_for(good).exists(), "a transient error removed a block"
    ops.hooks.clear()
    assert _run(tier, "store", [key_for(1)])[0].success
    r, got = _run(tier, "load", [good])
    assert r.success and got[0] == payload_for(good, tier.payload_bytes(good))


# ------------------------------------------------------------------ row 18 (load path)
def test_symlinked_fanout_dir_on_load_touches_nothing_outside(tmp_path: Path, tier: FsTier) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    key = key_for(1)
    path = tier.mapper.path_for(key)
    path.parent.parent.mkdir(parents=True, exist_ok=True)
    (outside / path.parent.name).mkdir()
    victim = outside / path.parent.name / path.name
    victim.write_bytes(b"someone else's file, not a block")
    path.parent.parent.rename(tmp_path / "moved")  # replace the fan-out dir by a link
    path.parent.parent.symlink_to(outside, target_is_directory=True)
    r, _ = _run(tier, "load", [key])
    assert not r.success
    assert victim.exists(), "fstier removed a file outside its root"


# ------------------------------------------------------------------ eviction concurrency
def test_eviction_races_loads_zero_wrong_bytes(tmp_path: Path) -> None:
    """A tier capped at ~24 files, stores of 64 keys and loads racing the
    capacity thread's LRU eviction: every load is right or a miss."""
    t = _tier(tmp_path / "root", max_bytes=24 * 8192, low_watermark=0.5, high_watermark=0.8)
    try:
        wrong = loaded = 0
        deadline = time.monotonic() + 1.0
        i = 0
        while time.monotonic() < deadline:
            keys = [key_for((i * 4 + j) % 64, "ev") for j in range(4)]
            rs, _ = _run(t, "store", keys)
            # A root at max_bytes drops stores ("capacity") until eviction
            # makes room: usage is bounded across instances (issue 15 item 6).
            assert rs.success or rs.cause in ("backpressure", "capacity"), rs
            rl, got = _run(t, "load", keys)
            for k, g in zip(keys[: rl.keys_completed], got, strict=False):
                loaded += 1
                wrong += g != payload_for(k, t.payload_bytes(k))
            assert rl.cause in (None, "miss"), rl
            i += 1
        t.run_capacity_pass()
        assert wrong == 0 and loaded > 0
        assert t.metrics.evicted_blocks.value > 0
        assert sum(f.stat().st_size for f in block_files(t.mapper.root)) <= 24 * 8192
    finally:
        t.close()


# ------------------------------------------------------------------ rows 14/18: foreign file types
def test_fifo_at_a_block_path_is_a_miss_not_a_hung_thread(tmp_path: Path) -> None:
    """open() of a FIFO blocks until a writer appears; a planted FIFO must be a
    quick miss, never a stuck read thread and a permanently fenced slot."""
    import os

    t = _tier(tmp_path / "root", io_timeout_s=5)
    try:
        key = key_for(1)
        path = t.mapper.path_for(key)
        NamespaceDirs(t.mapper).ensure(path)
        os.mkfifo(path)
        t0 = time.monotonic()
        r, _ = _run(t, "load", [key])
        assert not r.success and r.cause != "timeout", r
        assert time.monotonic() - t0 < 3
        assert t.fenced_slots == frozenset()
        assert t.lookup([key]) == 0, "a key whose load failed must not stay a hit"
        # The FIFO is not a block file fstier wrote: a store replaces nothing
        # outside the rules and the next load still never hangs.
        r2, _ = _run(t, "load", [key])
        assert not r2.success and r2.cause != "timeout"
    finally:
        t.close()


# ------------------------------------------------------------------ row 17: directories vanish
def test_store_recovers_when_fanout_dirs_are_removed(tmp_path: Path) -> None:
    """An operator's rm -rf (or another host) removes fan-out directories the
    tier had already created: the next stores re-create them, no breaker trip."""
    import shutil

    t = _tier(tmp_path / "root", breaker_failures=2)
    try:
        assert _run(t, "store", [key_for(i) for i in range(4)])[0].success
        for sub in t.mapper.blocks_dir.iterdir():
            if sub.is_dir():
                shutil.rmtree(sub)
        # The same keys again: their directories are in the mapper's
        # verified cache but gone from disk.
        for i in range(4):
            r, _ = _run(t, "store", [key_for(i)])
            assert r.success, r
        assert t.breaker_state == "closed"
        r, got = _run(t, "load", [key_for(3)])
        assert r.success and got[0] == payload_for(key_for(3), t.payload_bytes(key_for(3)))
    finally:
        t.close()


def test_store_recovers_when_the_namespace_dir_is_removed(tmp_path: Path) -> None:
    """rm -rf of the whole namespace directory (manifest included) under a
    running tier: the next store re-creates the directory and its manifest
    instead of failing every store until a restart."""
    import shutil

    t = _tier(tmp_path / "root", breaker_failures=2)
    try:
        assert _run(t, "store", [key_for(0)])[0].success
        shutil.rmtree(t.mapper.namespace_dir)
        for i in range(1, 4):
            r, _ = _run(t, "store", [key_for(i)])
            assert r.success, r
        assert (t.mapper.namespace_dir / "config.json").is_file()
        assert t.breaker_state == "closed"
        r, got = _run(t, "load", [key_for(3)])
        assert r.success and got[0] == payload_for(key_for(3), t.payload_bytes(key_for(3)))
    finally:
        t.close()


@pytest.mark.parametrize("native_io", ["off", "on"])
def test_a_root_removed_under_a_running_tier_is_never_made_again(tmp_path: Path, native_io: str) -> None:
    """rm -rf of the root itself (or its filesystem unmounted, leaving the
    directory above): stores fail ENOENT and nothing is created where the
    root was or above it, on either I/O path (the C engine makes nothing
    above the namespace and hands such a key to the batch path). Before, the
    batch path's namespace re-creation made the root and every missing
    directory above it (``mkdir -p``), outside the root."""
    above = tmp_path / "mnt"
    t = _tier(above / "root", breaker_failures=100, native_io=native_io)
    try:
        assert _run(t, "store", [key_for(0)])[0].success
        shutil.rmtree(above)
        for i in range(1, 3):
            r, _ = _run(t, "store", [key_for(i)])
            assert not r.success and r.cause == "ENOENT", r
        assert not above.exists(), sorted(str(p) for p in tmp_path.rglob("*"))
    finally:
        t.close()


# ------------------------------------------------------------------ row 24
def test_late_read_never_reaches_a_reallocated_slot(tmp_path: Path, ops: FaultyOps) -> None:
    """Issue 15 item 1, end to end with a real hanging read: the load of A
    times out, the engine frees its slot and allocates again, stages B's bytes,
    the stuck read returns (writing A's bytes into the slot it was given),
    and B is stored and loaded. Before the pool knew of the fence, alloc()
    handed the same slot back and B's file was published holding A's bytes
    with a valid checksum: a later load reported success with wrong bytes."""
    t = _tier(tmp_path / "root", io_timeout_s=0.2, breaker_failures=100, native_io="off")
    pool: HostBlockPool = t.pool
    release = threading.Event()
    returned = threading.Event()
    try:
        a, b = key_for(1), key_for(2)
        n = t.payload_bytes(a)
        assert _run(t, "store", [a])[0].success
        hung = threading.Event()

        def hang_first(real: Any, fd: int, bufs: Any, off: int) -> int:
            if hung.is_set():
                return int(real(fd, bufs, off))
            hung.set()
            release.wait(10)  # a read stuck in the kernel (hung NFS server)
            try:
                return int(real(fd, bufs, off))  # ... which then lands in its buffer
            finally:
                returned.set()

        ops.hooks["preadv"] = hang_first
        (slot,) = pool.alloc(1)
        t.submit_load("a", [a], [slot])
        assert t.drain(10)
        (res,) = t.get_finished()
        assert (res.success, res.cause) == (False, "timeout")
        assert pool.fenced == frozenset({slot})
        # The engine is done with the failed job: free, allocate, stage B.
        pool.free([slot])
        (again,) = pool.alloc(1)
        assert again != slot, "a fenced slot must not be handed out while its read may land"
        pool.slot_view(again)[:n] = payload_for(b, n)
        release.set()
        assert returned.wait(10) and t.wait_fences_released(10)
        t.submit_store("b", [b], [again])
        assert t.drain(10)
        assert t.get_finished()[0].success
        pool.free([again])
        r, got = _run(t, "load", [b])
        assert r.success and got[0] == payload_for(b, n), "B loaded with another block's bytes"
        # The late call returned: its slot is free again, nothing leaked.
        assert pool.fenced == frozenset() and pool.num_free == pool.num_slots
    finally:
        release.set()
        t.close()


def test_timed_out_store_keeps_its_slot_off_the_free_list(tmp_path: Path, ops: FaultyOps) -> None:
    """A timed-out store may still be reading its slot (and would publish
    whatever it reads under its key): the slot is fenced in the pool too."""
    t = _tier(tmp_path / "root", io_timeout_s=0.2, breaker_failures=100, native_io="off")
    pool: HostBlockPool = t.pool
    release = threading.Event()
    try:
        def hang(real: Any, fd: int, bufs: Any, off: int) -> int:
            release.wait(10)
            return int(real(fd, bufs, off))

        ops.hooks["pwritev"] = hang
        (slot,) = pool.alloc(1)
        pool.slot_view(slot)[: t.payload_bytes(key_for(5))] = payload_for(key_for(5), t.payload_bytes(key_for(5)))
        t.submit_store("s", [key_for(5)], [slot])
        assert t.drain(10)
        assert t.get_finished()[0].cause == "timeout"
        pool.free([slot])
        assert slot not in pool.alloc(pool.num_free)
        ops.hooks.clear()
        release.set()
        assert t.wait_fences_released(10)
        assert pool.fenced == frozenset() and pool.num_free == 1  # the fenced slot came back
        for f in block_files(t.mapper.root):
            assert blockcheck.verify_file(f).ok
    finally:
        release.set()
        t.close()


# ------------------------------------------------------------------ row 25
def _plant(path: Path, kind: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
        (path / "someone-elses.txt").write_bytes(b"not ours")
    elif kind == "socket":
        # AF_UNIX paths are capped at 108 bytes: bind short, then move it.
        short = Path(tempfile.mkdtemp(prefix="fs")) / "s"
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(short))
        s.close()
        os.replace(short, path)
        short.parent.rmdir()
    else:  # a regular file where the fan-out directory belongs: ENOTDIR
        shutil.rmtree(path.parent)
        path.parent.write_bytes(b"not a directory")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs and unix sockets")
def test_planted_non_regular_files_are_misses_not_breaker_failures(tmp_path: Path) -> None:
    """Issue 15 item 7: eight FIFOs, directories or sockets at block paths made
    every good load fail ``degraded`` for the cool-down. They are bad files:
    misses counted as ``bad_file``, never device failures, and left in place
    (fstier removes only what it wrote)."""
    t = _tier(tmp_path / "root", breaker_failures=2, breaker_cooldown_s=60)
    try:
        good = [key_for(i) for i in range(4)]
        assert _run(t, "store", good)[0].success
        kinds = ["fifo", "dir", "socket", "fifo", "dir", "socket", "fifo", "notdir"]
        planted = [key_for(100 + i) for i in range(len(kinds))]
        for k, kind in zip(planted, kinds, strict=True):
            _plant(t.mapper.path_for(k), kind)
        causes = []
        for k in planted:
            r, _ = _run(t, "load", [k])
            assert not r.success and r.keys_completed == 0
            causes.append(r.cause)
        assert t.breaker_state == "closed", causes
        assert sorted(set(causes)) == [
            "bad_file:ENOTDIR", "bad_file:ENXIO", "bad_file:not_regular",
        ]
        assert t.metrics.snapshot()["fstier_failures_total"] == {"bad_file": 8}
        assert t.metrics.breaker_trips.value == 0
        assert t.lookup(planted[:1]) == 0  # a bad key stays a miss
        # ... and a planted file that was never loaded is a miss at lookup.
        fresh = key_for(200)
        _plant(t.mapper.path_for(fresh), "fifo")
        assert t.lookup([fresh]) == 0
        # Every good key is still served, at once.
        assert t.lookup(good) == 4
        r, got = _run(t, "load", good)
        assert r.success and got == [payload_for(k, t.payload_bytes(k)) for k in good]
        # A store onto a planted directory fails (rename cannot replace it) and
        # does not count toward the breaker either; the directory stays.
        for _ in range(3):
            r, _ = _run(t, "store", [planted[1]])
            assert not r.success
        assert t.breaker_state == "closed"
        assert (t.mapper.path_for(planted[1]) / "someone-elses.txt").read_bytes() == b"not ours"
    finally:
        t.close()


def test_device_errors_still_trip_the_breaker(tmp_path: Path, ops: FaultyOps) -> None:
    """The other side of row 25: EIO and EROFS say the mount is failing."""
    for code in (errno.EIO, errno.EROFS):
        t = _tier(tmp_path / f"root{code}", breaker_failures=2, breaker_cooldown_s=60, native_io="off")
        try:
            ops.hooks["open"] = raise_errno(code)
            _run(t, "store", [key_for(1)])
            _run(t, "store", [key_for(2)])
            assert t.breaker_state == "open"
        finally:
            ops.hooks.clear()
            t.close()
