"""IOPool: priorities, parallel ops, non-blocking API, deadlines and stuck threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from fstier.errors import IOPoolClosedError
from fstier.io.pool import OP_CANCELLED, OP_EXPIRED, OP_TIMED_OUT, IOPool, PoolJob


def _collect(pool: IOPool, n: int, timeout: float = 10.0) -> dict[Any, PoolJob]:
    assert pool.wait_idle(timeout)
    jobs = {j.job_id: j for j in pool.get_finished()}
    assert len(jobs) == n
    return jobs


def test_results_in_op_order_and_exceptions_are_results() -> None:
    with IOPool(2, 2, io_timeout_s=5) as pool:

        def boom() -> None:
            raise ValueError("op failed")

        pool.submit("a", "read", [lambda i=i: i * i for i in range(20)])
        pool.submit("b", "write", [lambda: 1, boom, lambda: 3])
        pool.submit("c", "write", [])
        jobs = _collect(pool, 3)
        assert jobs["a"].results == [i * i for i in range(20)] and jobs["a"].ok
        assert jobs["b"].results[0] == 1 and isinstance(jobs["b"].results[1], ValueError)
        assert not jobs["b"].ok and jobs["b"].kind == "write"
        assert jobs["c"].results == [] and jobs["c"].seconds >= 0
        assert pool.get_finished() == []


def test_ops_of_one_job_run_in_parallel() -> None:
    with IOPool(4, 1, io_timeout_s=5) as pool:
        barrier = threading.Barrier(4, timeout=5)
        pool.submit("j", "read", [barrier.wait for _ in range(4)])  # deadlocks if serial
        jobs = _collect(pool, 1)
        assert jobs["j"].ok


def test_submit_and_get_finished_do_not_block() -> None:
    with IOPool(1, 1, io_timeout_s=5) as pool:
        gate = threading.Event()
        started = threading.Semaphore(0)

        def hold() -> None:
            started.release()
            gate.wait()

        # Both threads (the idle writer steals the read job's second op) must
        # be held before the writes go in, or a fast writer finishes some of
        # them first (seen on a loaded 2-core CI machine).
        pool.submit("slow", "read", [hold, hold])
        assert started.acquire(timeout=5) and started.acquire(timeout=5)
        t0 = time.monotonic()
        for i in range(100):
            pool.submit(i, "write", [lambda: None])
        assert pool.get_finished() == []
        assert time.monotonic() - t0 < 0.5
        gate.set()
        _collect(pool, 101)


def _priority_order(first_kind: str) -> list[str]:
    """With one read and one write thread both blocked, queue 5 reads and 5
    writes, release one thread of ``first_kind`` priority and record order."""
    order: list[str] = []
    lock = threading.Lock()

    def rec(tag: str) -> Callable[[], None]:
        def f() -> None:
            with lock:
                order.append(tag)

        return f

    pool = IOPool(1, 1, io_timeout_s=5)
    gates = {"read": threading.Event(), "write": threading.Event()}
    started = threading.Barrier(3, timeout=5)

    def hold() -> None:
        # Which thread picks up which hold job is a race (an idle thread takes
        # the other queue's work), so gate on the priority of the thread that
        # actually runs it.
        priority = "read" if "-read-" in threading.current_thread().name else "write"
        started.wait()
        gates[priority].wait()

    # Occupy both threads.
    pool.submit("h1", "read", [hold])
    pool.submit("h2", "write", [hold])
    started.wait()
    for i in range(5):
        pool.submit(f"w{i}", "write", [rec("w")])
        pool.submit(f"r{i}", "read", [rec("r")])
    gates[first_kind].set()
    deadline = time.monotonic() + 5
    while len(order) < 10 and time.monotonic() < deadline:
        time.sleep(0.005)
    gates["read"].set()
    gates["write"].set()
    pool.wait_idle(5)
    pool.shutdown()
    return order


def test_read_thread_drains_reads_first_then_writes() -> None:
    # Only the read-priority thread is free: it does all reads, then (idle
    # of reads) the writes, so writes do not starve.
    assert _priority_order("read") == ["r"] * 5 + ["w"] * 5


def test_write_thread_drains_writes_first_then_reads() -> None:
    assert _priority_order("write") == ["w"] * 5 + ["r"] * 5


def test_timeout_reports_op_and_replaces_thread() -> None:
    late: list[tuple[Any, int]] = []
    late_done = threading.Event()
    release = threading.Event()

    def on_late(job_id: Any, index: int) -> None:
        late.append((job_id, index))
        late_done.set()

    pool = IOPool(1, 1, io_timeout_s=0.2, on_late=on_late)
    try:
        pool.submit("hung", "read", [lambda: 1, release.wait, lambda: 3])
        t0 = time.monotonic()
        jobs = _collect(pool, 1, timeout=5)
        assert time.monotonic() - t0 < 2.0  # completes without waiting for the hung op
        assert jobs["hung"].results[0] == 1 and jobs["hung"].results[2] == 3
        assert jobs["hung"].results[1] is OP_TIMED_OUT and not jobs["hung"].ok
        assert pool.stuck_threads == 1 and pool.timeouts == 1
        # The replacement thread keeps the pool serving.
        pool.submit("next", "read", [lambda: "ok"])
        assert _collect(pool, 1)["next"].results == ["ok"]
        assert late == []
        release.set()  # the hung call returns: result dropped, callback fires
        assert late_done.wait(5)
        assert late == [("hung", 1)]
        deadline = time.monotonic() + 5
        while pool.stuck_threads and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.stuck_threads == 0
        assert pool.get_finished() == []  # the late result is not reported twice
    finally:
        release.set()
        pool.shutdown()


def test_on_late_registration_method() -> None:
    release = threading.Event()
    fired = threading.Event()
    pool = IOPool(1, 1, io_timeout_s=0.1)
    pool.on_late(lambda job_id, idx: fired.set())
    try:
        pool.submit("x", "write", [release.wait])
        assert _collect(pool, 1, timeout=5)["x"].results == [OP_TIMED_OUT]
        release.set()
        assert fired.wait(5)
    finally:
        release.set()
        pool.shutdown()


def test_shutdown_cancels_queued_and_joins() -> None:
    pool = IOPool(1, 1, io_timeout_s=None, name="shutdown-test")
    gate = threading.Event()
    started = threading.Barrier(3, timeout=5)

    def hold() -> str:
        started.wait()
        gate.wait()
        return "ran"

    pool.submit("a", "read", [hold])
    pool.submit("b", "write", [hold])
    started.wait()
    pool.submit("c", "read", [lambda: "never"] * 3)
    threading.Timer(0.1, gate.set).start()
    pool.shutdown()
    jobs = {j.job_id: j for j in pool.get_finished()}
    assert jobs["a"].results == ["ran"] and jobs["b"].results == ["ran"]
    assert jobs["c"].results == [OP_CANCELLED] * 3
    assert pool.closed
    with pytest.raises(IOPoolClosedError, match="shut down"):
        pool.submit("d", "read", [lambda: None])
    pool.shutdown()  # idempotent
    assert [t.name for t in threading.enumerate() if t.name.startswith("shutdown-test")] == []


def test_on_done_callback_receives_job_instead_of_queue() -> None:
    got: list[PoolJob] = []
    done = threading.Event()
    with IOPool(1, 1) as pool:
        pool.submit("cb", "read", [lambda: 5], on_done=lambda j: (got.append(j), done.set()))
        assert done.wait(5)
        assert got[0].results == [5] and pool.get_finished() == []


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="read_threads >= 1"):
        IOPool(0, 1)
    with pytest.raises(ValueError, match="io_timeout_s must be > 0"):
        IOPool(1, 1, io_timeout_s=0)
    with IOPool(1, 1) as pool, pytest.raises(ValueError, match="'read' or 'write'"):
        pool.submit("x", "rw", [])


def test_many_jobs_many_threads_every_job_completes_once() -> None:
    with IOPool(4, 3, io_timeout_s=5) as pool:
        for j in range(200):
            pool.submit(
                j, "read" if j % 3 else "write", [lambda j=j, i=i: (j, i) for i in range(j % 7)]
            )
        jobs = _collect(pool, 200)
        for j, job in jobs.items():
            assert job.results == [(j, i) for i in range(j % 7)]
        assert pool.queue_depth("read") == 0 and pool.stuck_threads == 0


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 1e300, 0.0])
def test_io_timeout_must_be_finite(timeout: float) -> None:
    """io_timeout_s=inf made the watchdog's wait raise and the thread die:
    every later deadline silently stopped firing (issue 15 item 5)."""
    with pytest.raises(ValueError, match=r"io_timeout_s must be > 0 and finite \(or None"):
        IOPool(1, 1, io_timeout_s=timeout)


def test_ops_queued_behind_hung_calls_expire_at_the_jobs_deadline() -> None:
    """Every thread stuck on a hung mount, and each replacement thread stuck
    on the next queued op: a job of 8 ops took 8 x io_timeout_s to end (seen
    on GlusterFS and MooseFS with the client's link down). Queued ops now
    expire unrun at io_timeout_s after submission; only the ops that started
    hold a stuck thread."""
    release = threading.Event()
    pool = IOPool(1, 1, io_timeout_s=1.0)
    try:
        t0 = time.monotonic()
        pool.submit("hung", "read", [release.wait] * 8)
        jobs = _collect(pool, 1, timeout=30)
        elapsed = time.monotonic() - t0
        results = jobs["hung"].results
        assert OP_TIMED_OUT in results and OP_EXPIRED in results, results
        assert set(results) <= {OP_TIMED_OUT, OP_EXPIRED}
        # The two threads took one op each; nothing else ever started.
        assert results.count(OP_TIMED_OUT) <= 2 and pool.stuck_threads <= 2
        assert elapsed < 4.0, elapsed  # was ~8 s: one io_timeout_s per queued op
        pool.submit("next", "read", [lambda: "ok"])  # replacements serve
        assert _collect(pool, 1)["next"].results == ["ok"]
    finally:
        release.set()
        pool.shutdown()


class _CountingClock:
    """The system clock, counting the watchdog's waits (each is one wake-up)."""

    def __init__(self) -> None:
        self.waits = 0

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def wait(self, waitable: Any, timeout: float | None) -> bool:
        self.waits += 1
        return bool(waitable.wait(timeout))


def test_watchdog_is_not_woken_for_each_job() -> None:
    """An idle pool's watchdog used to be notified by every job that found
    the pool idle: one Python thread wake-up (and GIL hand-off) per job, on
    the path of every serial load. It wakes by itself before any such job's
    deadline, so it is left asleep."""
    clock = _CountingClock()
    pool = IOPool(2, 1, io_timeout_s=30.0, clock=clock)
    try:
        time.sleep(0.05)
        before = clock.waits
        for i in range(20):
            pool.submit(i, "read", [lambda: 1])
            assert pool.wait_idle(5)
        assert len(pool.get_finished()) == 20
        assert clock.waits - before <= 1
    finally:
        pool.shutdown()


def test_a_job_after_an_idle_spell_still_times_out_at_its_deadline() -> None:
    """The watchdog sleeping through a job's start (above) still ends that
    job by its deadline: its own wake-up comes first, then it waits for the
    job's deadline."""
    release = threading.Event()
    pool = IOPool(1, 1, io_timeout_s=0.5)
    try:
        time.sleep(0.3)  # idle: the watchdog sleeps until about 0.5 s
        t0 = time.monotonic()
        pool.submit("hung", "read", [release.wait])
        jobs = _collect(pool, 1, timeout=5)
        took = time.monotonic() - t0
        assert jobs["hung"].results == [OP_TIMED_OUT]
        assert 0.45 <= took < 2.0, took
    finally:
        release.set()
        pool.shutdown()
