"""Row 27 of the fault matrix: the rows FsTier's tests inject through
``fsops.FS`` (10-14, 16, 23), injected through the native path's own seam
(``fstier.io.native.fault``) with the same expectations: failed jobs with a
clear cause and log line, no leaked fd or temp file, old blocks intact,
recovery; a hung native batch is a timed-out job whose slots stay fenced
until the late call returns, so its bytes never reach a reallocated slot.

(A tier whose ``fsops.FS`` is patched takes the Python path, so the tests
beside this file cover that path; ``make test`` also runs the whole suite
with ``FSTIER_NATIVE=0``.)
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fstier.clock import SYSTEM_CLOCK, Clock, ManualClock
from fstier.io import blockcheck, native
from fstier.manager import FsTier
from fstier.slots.host_pool import HostBlockPool

from ._support import block_files, fd_count, key_for, payload_for, temp_files
from .test_tier import _run, _tier

pytestmark = pytest.mark.skipif(
    native._ext is None, reason=f"native extension not built: {native._import_error}"
)


@pytest.fixture(autouse=True)
def _native_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("FSTIER_NATIVE", raising=False)
    native.clear_faults()
    yield
    native.clear_faults()


def _native_tier(root: Path, clock: Clock = SYSTEM_CLOCK, **kw: object) -> FsTier:
    t = _tier(root, clock, **kw)
    assert t.io_path.backend == "native"
    return t


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENOSPC, errno.EIO, errno.ESTALE])
def test_errno_faults_fail_jobs_cleanly(tmp_path: Path, code: int, caplog: pytest.LogCaptureFixture) -> None:
    t = _native_tier(tmp_path / "root")
    try:
        good = key_for(100)
        assert _run(t, "store", [good])[0].success
        fds = fd_count()
        name = errno.errorcode[code]
        native.fault("open", code, times=-1)
        with caplog.at_level(logging.WARNING, logger="fstier.manager"):
            rs, _ = _run(t, "store", [key_for(1)])
            rl, _ = _run(t, "load", [good])
        assert (rs.success, rs.cause) == (False, name)
        assert (rl.success, rl.cause) == (False, name)
        assert any(name in r.getMessage() for r in caplog.records), "no log line names the cause"
        assert fd_count() <= fds and temp_files(t.mapper.root) == []
        assert t.mapper.path_for(good).exists(), "a transient error removed a block"
        native.clear_faults()
        assert _run(t, "store", [key_for(1)])[0].success
        r, got = _run(t, "load", [good])
        assert r.success and got[0] == payload_for(good, t.payload_bytes(good))
    finally:
        t.close()


@pytest.mark.parametrize("op, code", [("write", errno.ENOSPC), ("fsync", errno.EIO),
                                      ("link", errno.EIO), ("close", errno.EIO)])
def test_store_faults_in_a_batch_publish_nothing(tmp_path: Path, op: str, code: int) -> None:
    """Rows 10 and 12 inside one batch: the second of four keys fails, the
    others are stored, nothing partial is visible, the job reports the cause."""
    t = _native_tier(tmp_path / "root", fsync="file")
    try:
        keys = [key_for(i) for i in range(4)]
        native.fault(op, code, nth=2, times=1, after=op == "close")
        r, _ = _run(t, "store", keys)
        assert (r.success, r.cause) == (False, errno.errorcode[code])
        assert r.keys_completed == 1  # the prefix before the failed key
        native.clear_faults()
        assert not t.mapper.path_for(keys[1]).exists() and temp_files(t.mapper.root) == []
        for k in (keys[0], keys[2], keys[3]):
            assert blockcheck.verify_file(t.mapper.path_for(k)).ok
        assert _run(t, "store", keys)[0].success
        r, got = _run(t, "load", keys)
        assert r.success and got == [payload_for(k, t.payload_bytes(k)) for k in keys]
    finally:
        t.close()


def test_short_writes_and_reads_complete(tmp_path: Path) -> None:
    t = _native_tier(tmp_path / "root")
    try:
        keys = [key_for(i) for i in range(3)]
        native.fault("write", short=1000, times=-1)
        assert _run(t, "store", keys)[0].success
        native.clear_faults()
        native.fault("read", short=777, times=-1)
        r, got = _run(t, "load", keys)
        assert r.success and got == [payload_for(k, t.payload_bytes(k)) for k in keys]
    finally:
        t.close()


def test_failed_fsync_is_never_retried(tmp_path: Path) -> None:
    t = _native_tier(tmp_path / "root", fsync="file")
    try:
        native.fault("fsync", errno.EIO, times=-1)
        r, _ = _run(t, "store", [key_for(1)])
        assert (r.success, r.cause) == (False, "EIO")
        assert native.fault_count("fsync") == 1
        assert temp_files(t.mapper.root) == [] and not t.mapper.path_for(key_for(1)).exists()
    finally:
        t.close()


def test_publication_error_after_it_happened_is_never_wrong_bytes(tmp_path: Path) -> None:
    t = _native_tier(tmp_path / "root")
    try:
        key = key_for(1)
        native.fault("link", errno.EIO, after=True)
        r, _ = _run(t, "store", [key])
        assert not r.success and temp_files(t.mapper.root) == []
        native.clear_faults()
        r, got = _run(t, "load", [key])  # the link happened: a complete file
        assert r.success and got[0] == payload_for(key, t.payload_bytes(key))
    finally:
        t.close()


def test_estale_mid_read_is_a_miss_and_keeps_the_file(tmp_path: Path) -> None:
    t = _native_tier(tmp_path / "root")
    try:
        key = key_for(1)
        assert _run(t, "store", [key])[0].success
        native.fault("read", errno.ESTALE)
        r, _ = _run(t, "load", [key])
        # a miss, as on the Python path (test_manager_faults): not a device error
        assert (r.success, r.cause, r.keys_completed) == (False, "miss", 0)
        assert t.breaker_state == "closed"
        assert t.mapper.path_for(key).exists()
    finally:
        t.close()


def test_hung_native_store_times_out_fences_and_recovers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Row 23: a batch stuck in a system call is a timed-out job; the breaker
    trips; every slot of the stuck batch stays fenced until it returns."""
    clock = ManualClock()
    t = _native_tier(tmp_path / "root", clock, io_timeout_s=0.2, breaker_failures=2, breaker_cooldown_s=0.5)
    pool: HostBlockPool = t.pool

    def outlive_the_deadline() -> None:
        # The batch is taken off the queue (running, stuck in the delayed
        # write), then its job's 0.2 s deadline passes on the tier's clock.
        deadline = time.monotonic() + 10
        while t._engine.engine.queue_depth("write") and time.monotonic() < deadline:
            time.sleep(0.001)  # a worker thread picking the op up: real time
        clock.advance(0.2)

    try:
        native.fault("write", delay_s=1.5, times=2)
        with caplog.at_level(logging.WARNING):
            r1, _ = _run(t, "store", [key_for(1)], after_submit=outlive_the_deadline)
            r2, _ = _run(t, "store", [key_for(2)], after_submit=outlive_the_deadline)
        assert (r1.success, r1.cause) == (False, "timeout")
        assert (r2.success, r2.cause) == (False, "timeout")
        assert t.degraded and len(pool.fenced) == 2
        assert t.wait_fences_released(10) and pool.fenced == frozenset()
        clock.advance(0.5)  # cool-down -> half-open
        native.clear_faults()
        r4, _ = _run(t, "store", [key_for(4)])
        assert r4.success and t.breaker_state == "closed"
        for f in block_files(t.mapper.root):
            assert blockcheck.verify_file(f).ok
    finally:
        t.close()


def test_late_native_read_never_reaches_a_reallocated_slot(tmp_path: Path) -> None:
    """Issue 15 item 1 on the native path: a load batch of two keys hangs in
    its first read; both slots are fenced (the late call holds them both),
    the engine frees and reallocates, B is staged and stored, the late call
    returns, and B loads with B's bytes."""
    t = _native_tier(tmp_path / "root", io_timeout_s=0.2, breaker_failures=100)
    pool: HostBlockPool = t.pool
    try:
        a1, a2, b = key_for(1), key_for(2), key_for(3)
        n = t.payload_bytes(a1)
        assert _run(t, "store", [a1, a2])[0].success
        native.fault("read", delay_s=1.0, times=1)
        slots = pool.alloc(2)
        t.submit_load("a", [a1, a2], slots)
        assert t.drain(10)
        (res,) = t.get_finished()
        assert (res.success, res.cause) == (False, "timeout")
        assert pool.fenced == frozenset(slots)
        pool.free(slots)
        again = pool.alloc(pool.num_free)
        assert not set(again) & set(slots), "a fenced slot was handed out while its read may land"
        pool.slot_view(again[0])[:n] = payload_for(b, n)
        t.submit_store("b", [b], [again[0]])
        assert t.drain(10) and t.get_finished()[0].success
        pool.free(again)
        assert t.wait_fences_released(10)
        r, got = _run(t, "load", [b])
        assert r.success and got[0] == payload_for(b, n), "B loaded with another block's bytes"
        assert pool.fenced == frozenset() and pool.num_free == pool.num_slots
    finally:
        t.close()


def test_device_errors_trip_the_breaker(tmp_path: Path) -> None:
    for code in (errno.EIO, errno.EROFS):
        t = _native_tier(tmp_path / f"root{code}", breaker_failures=2, breaker_cooldown_s=60)
        try:
            native.fault("open", code, times=-1)
            _run(t, "store", [key_for(1)])
            _run(t, "store", [key_for(2)])
            assert t.breaker_state == "open"
        finally:
            native.clear_faults()
            t.close()
