"""The Python job engine's queues and deadlines (fstier.io.engine.python),
ported from the thread pool it replaced (io/pool.py): units in order with
exceptions as results, the units of one job in parallel, a non-blocking
submit and collect, read- and write-priority threads and the probe queue
before both, a unit past its deadline timed out and its thread replaced (the
late return releasing the job), units queued behind hung calls expiring at
the job's deadline, shutdown cancelling queued units, the watchdog not woken
per job and still on time after an idle spell.

Jobs whose work the test controls are ``EngineJob`` records with a ``call``
(one unit: what a recency flush or a probe is), queued as the record's kind
says (``"load"``: the read queue, ``"call"``: the write queue, ``"probe"``:
the probe queue); jobs of many units are real Python-path stores and loads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from manager_support import FILE_BYTES, keys, payload_for, tiny_config

from fstier.errors import IOPoolClosedError
from fstier.io.engine import CANCELLED, EXPIRED, TIMED_OUT, EngineJob, PythonEngine
from fstier.io.fsops import FS
from fstier.manager import FsTier
from fstier.slots.host_pool import HostBlockPool
from fstier.tier.jobs import SlotBuffers


def _call(tag: Any, fn: Callable[[], Any], queue: str = "write", timeout_s: float | None = 5.0) -> EngineJob:
    kind = {"read": "load", "write": "call", "probe": "probe"}[queue]
    return EngineJob(tag, kind, call=fn, timeout_s=timeout_s)  # type: ignore[arg-type]


class _Files:
    """A real Python-path block store and slots: jobs of one unit per key."""

    def __init__(self, root: Path) -> None:
        self.pool = HostBlockPool(32, FILE_BYTES)
        self.pool.alloc(32)
        self.tier = FsTier(tiny_config(root, native_io="off"), self.pool)
        assert not self.tier.blocks.batched

    def job(self, tag: Any, kind: str, n: int, timeout_s: float | None = 5.0) -> EngineJob:
        ks = keys(0, n)
        blocks = self.tier.blocks
        nbytes = tuple(self.tier.payload_bytes(k) for k in ks)
        if kind == "store":
            for s, k in enumerate(ks):
                self.pool.slot_view(s)[: nbytes[s]] = payload_for(k, nbytes[s])
        return EngineJob(
            tag, kind, tuple(ks), tuple(range(n)), nbytes, blocks, SlotBuffers(self.pool),  # type: ignore[arg-type]
            blocks.paths(ks), None, timeout_s,
        )

    def close(self) -> None:
        self.tier.close()
        self.pool.close()


@pytest.fixture
def files(tmp_path: Path) -> Iterator[_Files]:
    f = _Files(tmp_path / "root")
    yield f
    f.close()


def _done(job: EngineJob, timeout: float = 10.0) -> EngineJob:
    end = time.monotonic() + timeout
    while not job.done and time.monotonic() < end:
        time.sleep(0.002)
    assert job.done, f"job {job.tag!r} not done within {timeout}s"
    return job


def test_a_units_exception_is_its_result_without_its_traceback() -> None:
    engine = PythonEngine(1, 1)
    reg = engine.register()
    try:
        def boom() -> None:
            raise OSError(5, "EIO")

        job = _call("boom", boom)
        reg.submit(job)
        (r,) = _done(job).results
        assert isinstance(r, OSError) and r.errno == 5 and r.__traceback__ is None
        ok = _call("ok", lambda: 7)
        reg.submit(ok)
        assert _done(ok).results == [7]
    finally:
        engine.shutdown()


def test_units_of_one_job_run_in_parallel(files: _Files, monkeypatch: pytest.MonkeyPatch) -> None:
    """4 keys on 4 write threads: each key's write waits until all 4 are writing."""
    barrier = threading.Barrier(4, timeout=10)
    real = FS.pwritev

    def together(fd: int, bufs: Any, off: int) -> int:
        barrier.wait()
        return real(fd, bufs, off)

    engine = PythonEngine(1, 4)
    reg = engine.register()
    try:
        monkeypatch.setattr(FS, "pwritev", together)
        job = files.job("par", "store", 4)
        reg.submit(job)
        outs = [o for r in _done(job, 20).results for o in r]
        assert len(outs) == 4 and all(o.status.name == "STORED" for o in outs), outs
    finally:
        engine.shutdown()


def test_submit_and_collect_do_not_block() -> None:
    engine = PythonEngine(1, 1)
    reg = engine.register()
    gate = threading.Event()
    started = threading.Semaphore(0)

    def hold() -> None:
        started.release()
        gate.wait()

    try:
        reg.submit(_call("h1", hold, "read"))
        reg.submit(_call("h2", hold, "write"))
        assert started.acquire(timeout=5) and started.acquire(timeout=5)
        t0 = time.monotonic()
        jobs = [_call(i, lambda: None) for i in range(100)]
        for j in jobs:
            reg.submit(j)
        assert reg.collect() == []
        assert time.monotonic() - t0 < 0.5
        gate.set()
        assert reg.wait_idle(10) and all(j.done for j in jobs)
    finally:
        gate.set()
        engine.shutdown()


def _priority_order(first: str) -> list[str]:
    """One read- and one write-priority thread, both held; 5 reads, 5 writes
    and 2 probes queue; the thread of ``first`` priority is let go alone."""
    order: list[str] = []
    lock = threading.Lock()

    def rec(tag: str) -> Callable[[], None]:
        def f() -> None:
            with lock:
                order.append(tag)

        return f

    engine = PythonEngine(1, 1)
    reg = engine.register()
    gates = {"read": threading.Event(), "write": threading.Event()}
    started = threading.Barrier(3, timeout=5)

    def hold() -> None:
        # which thread takes which hold is a race: gate on the priority of the one running it
        priority = "read" if "-read-" in threading.current_thread().name else "write"
        started.wait()
        gates[priority].wait()

    try:
        reg.submit(_call("h1", hold, "read"))
        reg.submit(_call("h2", hold, "write"))
        started.wait()
        for i in range(5):
            reg.submit(_call(f"w{i}", rec("w"), "write"))
            reg.submit(_call(f"r{i}", rec("r"), "read"))
        for i in range(2):
            reg.submit(_call(f"p{i}", rec("p"), "probe"))
        gates[first].set()
        deadline = time.monotonic() + 5
        while len(order) < 12 and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        gates["read"].set()
        gates["write"].set()
        reg.wait_idle(5)
        engine.shutdown()
    return order


def test_read_thread_takes_probes_then_reads_then_writes() -> None:
    # Only the read-priority thread is free: probes, all reads, then (idle of reads) the writes.
    assert _priority_order("read") == ["p"] * 2 + ["r"] * 5 + ["w"] * 5


def test_write_thread_takes_probes_then_writes_then_reads() -> None:
    assert _priority_order("write") == ["p"] * 2 + ["w"] * 5 + ["r"] * 5


def test_a_unit_past_its_deadline_times_out_its_thread_replaced_then_released(
    files: _Files, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load's second key hangs: at the deadline the job is published with
    that unit TIMED_OUT (its slot fenced), the others loaded; the stuck
    thread is counted and replaced (the next job runs); when the hung call
    returns the job is released once (on_released), never published twice."""
    release = threading.Event()
    released: list[EngineJob] = []
    got = threading.Event()
    engine = PythonEngine(1, 1)
    reg = engine.register(on_complete=lambda _k: got.set(), on_released=released.append)
    try:
        store = files.job("s", "store", 3)
        reg.submit(store)
        assert all(o.status.name == "STORED" for r in _done(store).results for o in r)
        reg.collect()
        real, calls = FS.preadv, []

        def second_hangs(fd: int, bufs: Any, off: int) -> int:
            calls.append(fd)
            if len(calls) == 2:
                release.wait(20)
            return real(fd, bufs, off)

        monkeypatch.setattr(FS, "preadv", second_hangs)
        job = files.job("hung", "load", 3, timeout_s=0.3)
        t0 = time.monotonic()
        reg.submit(job)
        (pub,) = _wait_collect(reg, 1)
        assert pub is job and time.monotonic() - t0 < 2.0
        assert TIMED_OUT in job.results and job.results.count(TIMED_OUT) == 1
        assert [r[0].status.name for r in job.results if r is not TIMED_OUT] == ["LOADED", "LOADED"]
        assert len(job.fenced) == 1 and not job.released
        assert engine.stuck_threads == 1 and engine.timeouts == 1
        nxt = _call("next", lambda: "ok", "read")
        reg.submit(nxt)
        assert _done(nxt).results == ["ok"]  # the replacement thread serves
        assert released == []
        release.set()
        deadline = time.monotonic() + 10
        while not released and time.monotonic() < deadline:
            time.sleep(0.01)
        assert released == [job] and job.released
        assert engine.stuck_threads == 0
        assert reg.collect() == []  # the late result is not published twice
    finally:
        release.set()
        engine.shutdown()


def _wait_collect(reg: Any, n: int, timeout: float = 10.0) -> list[EngineJob]:
    out: list[EngineJob] = []
    end = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        out += reg.collect()
        time.sleep(0.002)
    assert len(out) == n, out
    return out


def test_units_queued_behind_hung_calls_expire_at_the_jobs_deadline(
    files: _Files, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every thread stuck on a hung mount, and each replacement thread stuck
    on the next queued unit: a job of 8 units took 8 x io_timeout_s to end
    (seen on GlusterFS and MooseFS with the client's link down). Queued units
    expire unrun at the job's deadline; only the units that started hold a
    stuck thread."""
    release = threading.Event()
    engine = PythonEngine(1, 1)
    reg = engine.register()
    try:
        store = files.job("s", "store", 8)
        reg.submit(store)
        _done(store)
        reg.collect()
        real = FS.preadv

        def hang(fd: int, bufs: Any, off: int) -> int:
            release.wait(30)
            return real(fd, bufs, off)

        monkeypatch.setattr(FS, "preadv", hang)
        t0 = time.monotonic()
        job = files.job("hung", "load", 8, timeout_s=1.0)
        reg.submit(job)
        _wait_collect(reg, 1, timeout=30)
        elapsed = time.monotonic() - t0
        assert TIMED_OUT in job.results and EXPIRED in job.results, job.results
        assert set(map(id, job.results)) <= {id(TIMED_OUT), id(EXPIRED)}
        # The two threads took one unit each; nothing else ever started.
        assert job.results.count(TIMED_OUT) <= 2 and engine.stuck_threads <= 2
        assert elapsed < 4.0, elapsed  # was ~8 s: one io_timeout_s per queued unit
        nxt = _call("next", lambda: "ok", "read")
        reg.submit(nxt)
        assert _done(nxt).results == ["ok"]  # replacements serve
    finally:
        release.set()
        engine.shutdown()


def test_shutdown_cancels_queued_and_joins() -> None:
    engine = PythonEngine(1, 1, name="shutdown-test")
    reg = engine.register()
    gate = threading.Event()
    started = threading.Barrier(3, timeout=5)

    def hold() -> str:
        started.wait()
        gate.wait()
        return "ran"

    a, b = _call("a", hold, "read", None), _call("b", hold, "write", None)
    reg.submit(a)
    reg.submit(b)
    started.wait()
    c = [_call(f"c{i}", lambda: "never", "read", None) for i in range(3)]
    for j in c:
        reg.submit(j)
    threading.Timer(0.1, gate.set).start()
    engine.shutdown()
    assert a.results == ["ran"] and b.results == ["ran"]
    assert all(j.results == [CANCELLED] for j in c)
    assert engine.closed
    with pytest.raises(IOPoolClosedError, match="shut down"):
        reg.submit(_call("d", lambda: None))
    engine.shutdown()  # idempotent
    assert [t.name for t in threading.enumerate() if t.name.startswith("shutdown-test")] == []


def test_bad_thread_counts() -> None:
    with pytest.raises(ValueError, match="at least one read and one write thread"):
        PythonEngine(0, 1)


def test_many_jobs_many_threads_every_job_completes_once() -> None:
    engine = PythonEngine(4, 3)
    reg = engine.register()
    runs: dict[int, int] = {}
    lock = threading.Lock()

    def run(j: int) -> int:
        with lock:
            runs[j] = runs.get(j, 0) + 1
        return j

    try:
        jobs = [_call(j, lambda j=j: run(j), ("read", "write", "probe")[j % 3]) for j in range(200)]
        for job in jobs:
            reg.submit(job)
        assert reg.wait_idle(20)
        assert all(job.done and job.results == [job.tag] for job in jobs)
        assert runs == dict.fromkeys(range(200), 1)
        assert engine.queue_depth("read") == 0 and engine.stuck_threads == 0
    finally:
        engine.shutdown()


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
    engine = PythonEngine(2, 1, clock=clock)  # type: ignore[arg-type]
    reg = engine.register()
    try:
        reg.submit(_call("first", lambda: 1, "read", 30.0))  # sets the watchdog's wake-up
        assert reg.wait_idle(5)
        time.sleep(0.05)
        before = clock.waits
        for i in range(20):
            reg.submit(_call(i, lambda: 1, "read", 30.0))
            assert reg.wait_idle(5)
        assert clock.waits - before <= 1
    finally:
        engine.shutdown()


def test_a_job_after_an_idle_spell_still_times_out_at_its_deadline() -> None:
    """The watchdog sleeping through a job's start (above) still ends that
    job by its deadline."""
    release = threading.Event()
    engine = PythonEngine(1, 1)
    reg = engine.register()
    try:
        time.sleep(0.3)  # idle: the watchdog sleeps
        t0 = time.monotonic()
        job = _call("hung", release.wait, "read", 0.5)
        reg.submit(job)
        assert _done(job, 5).results == [TIMED_OUT]
        took = time.monotonic() - t0
        assert 0.45 <= took < 2.0, took
    finally:
        release.set()
        engine.shutdown()


def test_spare_threads_counts_the_queue() -> None:
    engine = PythonEngine(3, 2)
    reg = engine.register()
    gate = threading.Event()
    started = threading.Semaphore(0)

    def hold() -> None:
        started.release()
        gate.wait()

    try:
        assert engine.spare_threads("read") == 3 and engine.spare_threads("write") == 2
        for i in range(5):  # 5 threads take 5 units: none queued
            reg.submit(_call(f"busy{i}", hold, "read"))
        for _ in range(5):
            assert started.acquire(timeout=5)
        assert engine.spare_threads("read") == 3
        for i in range(2):
            reg.submit(_call(f"q{i}", lambda: None, "read"))
        assert engine.spare_threads("read") == 1
        for i in range(4):
            reg.submit(_call(f"m{i}", lambda: None, "read"))
        assert engine.spare_threads("read") == 0 and engine.spare_threads("write") == 2
        gate.set()
        assert reg.wait_idle(5)
        assert engine.spare_threads("read") == 3
    finally:
        gate.set()
        engine.shutdown()
