"""The job engine (fstier.io.engine): one engine per process and thread
configuration serves every namespace (a namespace costs a registration, not
threads), closing one namespace leaves the others' jobs alone, and a forked
child never inherits the parent's engine. On both I/O paths; what differs
between the engines (their threads, what they hold) is asserted per engine,
and the native path's default is the C engine."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import make_config
from manager_support import TINY_GROUP, keys, load, payload_for, slot_bytes, store

from fstier.io import native
from fstier.manager import FsTier


def _io_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("fstier-io")}


def _lookup_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("fstier-lookup")}


def _tier(root: Path, model: str, native_io: str) -> FsTier:
    cfg = make_config(
        root, groups=[dict(TINY_GROUP)], model={"name": model},
        tier={"read_threads": 3, "write_threads": 2, "native_io": native_io},
    )
    tier = FsTier.from_config(cfg)
    tier.pool.alloc(64)  # type: ignore[attr-defined]  # its private HostBlockPool
    return tier


def _engine_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("fstier-engine")}


def _on_engine(monkeypatch: pytest.MonkeyPatch, engine: str, native_io: str) -> None:
    """Tiers made next run on ``engine``; the C engine's cases need the native path."""
    monkeypatch.setenv("FSTIER_ENGINE", engine)
    if engine == "native" and native.status(native_io).backend != "native":
        pytest.skip("the C engine moves jobs of the native I/O path; this run has the Python path")


@pytest.mark.parametrize(("engine", "native_io"), [("python", "auto"), ("python", "off"), ("native", "auto")])
def test_namespaces_share_one_engine_and_its_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str, native_io: str,
) -> None:
    """12 namespaces share one engine (each FsTier had its own 3 + 2 + 1
    threads before: 72). The Python engine: 3 read + 2 write I/O threads and
    one watchdog in all, and no lookup thread on either path (the Python
    path's probes are jobs of the engine; there was a lookup pool of the root,
    2 threads and a watchdog, and 36 before it). The C engine: 3 + 2 C workers and no
    Python I/O thread, one Python completion thread. Every namespace's bytes
    stored and loaded, no thread started per job; the last close stops the
    threads."""
    _on_engine(monkeypatch, engine, native_io)
    before, lookups_before, engines_before = _io_threads(), _lookup_threads(), _engine_threads()
    tiers = [_tier(tmp_path / "root", f"acme/model-{i}", native_io) for i in range(12)]
    try:
        assert len({t.mapper.namespace for t in tiers}) == 12
        assert len({id(t._engine.engine) for t in tiers}) == 1
        assert tiers[0]._engine.engine.backend == engine
        started = _io_threads() - before
        if engine == "python":
            assert len(started) == 3 + 2 + 1, sorted(t.name for t in started)
        else:
            assert started == set(), sorted(t.name for t in started)  # no Python thread does I/O
            completion = _engine_threads() - engines_before
            assert [t.name for t in completion] == ["fstier-engine-complete"]
            info = tiers[0]._engine.engine.info()
            assert (info["live"], info["stuck"], info["watchdog"]) == (3 + 2, 0, 1)
            started |= completion
        lookups = _lookup_threads() - lookups_before
        assert not lookups, sorted(t.name for t in lookups)
        started |= lookups
        for i, t in enumerate(tiers):
            ks = keys(100 * i, 6)
            assert store(t, f"s{i}", ks).success
        for i, t in enumerate(tiers):
            ks = keys(100 * i, 6)
            res = load(t, f"l{i}", ks, first_slot=8)
            assert res.success and res.keys_completed == 6
            assert [slot_bytes(t, k, 8 + j) for j, k in enumerate(ks)] == [
                payload_for(k, t.payload_bytes(k)) for k in ks
            ]
        now = (_io_threads() - before) | (_lookup_threads() - lookups_before)
        if engine == "native":
            now |= {t for t in _engine_threads() - engines_before if t.name != "fstier-engine-call"}
            assert tiers[0]._engine.engine.info()["live"] == 3 + 2
        assert now == started  # none per job (the C engine's call thread runs the recency flushes)
    finally:
        for t in tiers[:-1]:
            t.close()
        assert all(th.is_alive() for th in started), "an engine in use was stopped"
        tiers[-1].close()
    for th in started:
        th.join(5)
        assert not th.is_alive(), f"{th.name} still runs after the last namespace closed"


def test_the_native_path_runs_no_python_io_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no ``FSTIER_ENGINE``, a tier on the native I/O path moves its
    jobs on the C engine: stores and loads run and no Python thread named
    ``fstier-io-*`` exists (issue 41); a tier on the Python path keeps the
    Python engine."""
    monkeypatch.delenv("FSTIER_ENGINE", raising=False)
    if native.status("auto").backend != "native":
        pytest.skip("the native extension is not in use in this run (FSTIER_NATIVE=0 or not built)")
    t = _tier(tmp_path / "root", "acme/default", "auto")
    p = _tier(tmp_path / "root", "acme/python-path", "off")
    try:
        assert t._engine.engine.backend == "native"
        assert p._engine.engine.backend == "python"
        p.close()
        ks = keys(0, 8)
        assert store(t, "s", ks).success
        assert load(t, "l", ks, first_slot=8).success
        assert [slot_bytes(t, k, 8 + j) for j, k in enumerate(ks)] == [payload_for(k, t.payload_bytes(k)) for k in ks]
        assert sorted(th.name for th in threading.enumerate() if th.name.startswith("fstier-io")) == []
    finally:
        p.close()
        t.close()


@pytest.mark.parametrize("native_io", ["auto", "off"])
def test_closing_one_namespace_leaves_the_others_jobs(tmp_path: Path, native_io: str) -> None:
    a = _tier(tmp_path / "root", "acme/a", native_io)
    b = _tier(tmp_path / "root", "acme/b", native_io)
    try:
        ks = keys(0, 32)
        assert store(a, "warm", ks[:1]).success
        b_slots = list(range(32))
        for k, s in zip(ks, b_slots, strict=True):
            b.pool.slot_view(s)[: b.payload_bytes(k)] = payload_for(k, b.payload_bytes(k))
        b.submit_store("b", ks, b_slots)  # in flight while a closes
        a.close()
        assert b.drain(30)
        (res,) = b.get_finished()
        assert res.success and res.keys_completed == 32
        assert load(b, "l", ks, first_slot=32).success
        # a new namespace joins the engine b still holds
        c = _tier(tmp_path / "root", "acme/c", native_io)
        assert c._engine.engine is b._engine.engine
        c.close()
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_builds_its_own_engine(tmp_path: Path) -> None:
    """The child of a process whose engine runs gets no engine (its threads
    do not exist in the child): its tier starts one of its own and moves
    its bytes; the parent's engine keeps serving the parent."""
    parent = _tier(tmp_path / "root", "acme/parent", "auto")
    try:
        assert store(parent, "s", keys(0, 4)).success
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports by exit status
            code = 1
            try:
                child = _tier(tmp_path / "root", "acme/child", "auto")
                ok = child._engine.engine is not parent._engine.engine
                ok = ok and store(child, "cs", keys(50, 4)).success
                ok = ok and load(child, "cl", keys(50, 4), first_slot=8).success
                child.close()
                code = 0 if ok else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert load(parent, "l", keys(0, 4), first_slot=8).success
    finally:
        parent.close()


def test_the_record_of_a_job_past_its_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's contract on its record, driven directly (what any backend
    must keep): a load of 3 keys, one unit per key (Python backend), 2
    threads, the first key's read hung. At the deadline the job is published
    once: the hung unit TIMED_OUT with its slot in ``job.fenced``, the one
    never started EXPIRED (not fenced); when the hung read
    returns, ``job.released`` is set before ``on_released(job)`` runs, and
    the late result is dropped."""
    from fstier.io import fsops
    from fstier.io.engine import EXPIRED, TIMED_OUT, EngineJob, PythonEngine
    from fstier.tier.jobs import SlotBuffers

    t = _tier(tmp_path / "root", "acme/record", "off")
    engine = PythonEngine(1, 1, name="fstier-io-record-test")
    release, started, hold = threading.Event(), threading.Event(), threading.Event()
    released: list[bool] = []
    try:
        ks = keys(0, 3)
        assert store(t, "s", ks).success
        hung = str(t.mapper.path_for(ks[0]))
        real_open, real_preadv = fsops.FS.open, fsops.FS.preadv
        hung_fds: set[int] = set()

        def tracking_open(path, flags, mode=0o600):
            fd = real_open(path, flags, mode)
            if str(path) == hung:
                hung_fds.add(fd)
            return fd

        def hanging_preadv(fd, bufs, offset):
            if fd in hung_fds:
                started.set()
                release.wait(10)
            return real_preadv(fd, bufs, offset)

        monkeypatch.setattr(fsops.FS, "open", tracking_open)
        monkeypatch.setattr(fsops.FS, "preadv", hanging_preadv)
        reg = engine.register(on_released=lambda job: released.append(job.released))
        nbytes = tuple(t.payload_bytes(k) for k in ks)
        job = EngineJob(
            "j", "load", tuple(ks), (10, 11, 12), nbytes, t.blocks, SlotBuffers(t.pool),
            t.blocks.paths(ks), None, 0.5,
        )
        # the write-priority thread is held, so the read thread alone serves the job
        reg.submit(EngineJob("hold", "call", call=lambda: hold.wait(10)))
        reg.submit(job)
        assert started.wait(10)
        for _ in range(1000):  # the deadline is 0.5 s of the real clock
            if job.done:
                break
            threading.Event().wait(0.01)
        (got,) = reg.collect()
        assert got is job and job.done and not job.released
        # one thread held by the call, one stuck in the first key: the others never ran
        assert job.results == [TIMED_OUT, EXPIRED, EXPIRED] and job.fenced == (10,)
        assert released == []
        release.set()
        for _ in range(1000):
            if released:
                break
            threading.Event().wait(0.01)
        assert released == [True] and job.results[0] is TIMED_OUT  # the late result was dropped
        assert reg.collect() == []  # published once
    finally:
        release.set()
        hold.set()
        engine.shutdown()
        t.close()


@pytest.mark.parametrize(("engine", "native_io"), [("python", "auto"), ("python", "off"), ("native", "auto")])
def test_finished_jobs_leave_the_watchdogs_heap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str, native_io: str,
) -> None:
    """A finished record is not kept until its deadline: 200 jobs done
    well inside their 30 s deadline leave at most the one in flight in the
    Python engine's watchdog heap (each held its keys, paths and outcomes
    for 30 s); the C engine holds none of them (its jobs are freed at
    collect, its tag table empty)."""
    _on_engine(monkeypatch, engine, native_io)
    t = _tier(tmp_path / "root", "acme/heap", native_io)
    try:
        for i in range(100):
            ks = keys(4 * i, 4)
            assert store(t, f"s{i}", ks).success
            assert load(t, f"l{i}", ks, first_slot=8).success
        eng = t._engine.engine
        if engine == "python":
            assert len(eng._deadlines) <= 1
        else:
            assert eng.info()["jobs"] == 0 and eng._jobs == {}
    finally:
        t.close()


def test_a_watchdog_wake_up_given_between_two_polls_is_kept() -> None:
    """With a ManualClock the watchdog waits in 2 ms polls; a new job's
    wake-up given between two polls (no waiter at that instant) was lost, so
    the watchdog slept to its idle wake-up, an hour of the manual clock, past
    the job's deadline (reliability/test_tier.py::
    test_hung_io_fails_trips_breaker_and_recovers then saw a hung store
    succeed after 10 s, about 1 run in 25). The wake-up is now kept until
    the next wait."""
    from fstier.io.engine.python import _Tick

    lock = threading.Lock()
    tick = _Tick(lock)
    with lock:
        tick.notify()  # nobody waits now
        assert tick.wait(0.0) is True  # the next poll sees it
        assert tick.wait(0.0) is False  # once


def test_a_job_without_a_block_store_is_one_clear_error_not_an_assert() -> None:
    """``EngineJob.block_io`` is what both engines read a store or load job's
    block store and buffers through: a job built without them is one
    ValueError naming the job (an ``assert`` vanished under ``python -O``)."""
    from fstier.io.engine import EngineJob

    with pytest.raises(ValueError, match=r"engine job 'j7' \(load\) has no block store or buffers"):
        EngineJob("j7", "load").block_io()


def test_a_polling_caller_collects_on_its_own_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """C engine: a caller that polls (vLLM's scheduler: ``has_news``, then
    ``get_finished``) collects the engine's completions on its own thread,
    so a finished job reaches it while the engine's completion thread cannot
    run (as in an engine whose scheduler holds the GIL: that thread would
    get it only every switch interval, ~5 ms per job)."""
    monkeypatch.setenv("FSTIER_ENGINE", "native")
    if native.status("auto").backend != "native":
        pytest.skip("the C engine moves jobs of the native I/O path; this run has the Python path")
    t = _tier(tmp_path / "root", "acme/polled", "auto")
    engine = t._engine.engine
    gate, held = threading.Event(), threading.Event()
    real = engine._expire_call

    def stalled() -> float:  # the completion thread stops here before it collects anything
        if threading.current_thread() is engine._dispatcher:
            held.set()
            gate.wait(30)
        return real()

    monkeypatch.setattr(engine, "_expire_call", stalled)
    try:
        assert held.wait(5), "the completion thread did not come round"
        ks = keys(0, 8)
        for j, k in enumerate(ks):
            t.pool.slot_view(j)[: t.payload_bytes(k)] = payload_for(k, t.payload_bytes(k))
        t.submit_store("polled", ks, list(range(8)))
        got = []
        for _ in range(500):  # up to ~5 s of scheduler steps
            if t.has_news():
                got = t.get_finished()
                if got:
                    break
            threading.Event().wait(0.01)
        assert [(r.job_id, r.success, r.keys_completed) for r in got] == [("polled", True, 8)]
        assert held.is_set() and not gate.is_set()  # the completion thread never collected it
    finally:
        gate.set()
        t.close()


@pytest.mark.parametrize("native_io", ["auto", "off"])
def test_a_tier_that_fails_to_start_leaves_no_registration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native_io: str
) -> None:
    """FsTier's constructor failing after it registered with the engine (its
    capacity part touches the root: a full or unwritable one raises there)
    closes that registration, so an engine no tier uses stops its threads."""
    import fstier.manager as manager

    def _engine_or_io() -> set[str]:
        return {t.name for t in threading.enumerate() if t.name.startswith(("fstier-io", "fstier-engine"))}

    before = _engine_or_io()
    made: list[Any] = []
    real = manager.shared_engine

    def recording(*args: Any, **kwargs: Any) -> Any:
        made.append(real(*args, **kwargs))
        return made[-1]

    class Broken:
        def __init__(self, *_args: object, **_kwargs: object) -> None:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(manager, "shared_engine", recording)
    monkeypatch.setattr(manager, "Capacity", Broken)
    cfg = make_config(
        tmp_path / "root", groups=[dict(TINY_GROUP)],
        tier={"read_threads": 5, "write_threads": 3, "native_io": native_io},  # an engine of its own
    )
    with pytest.raises(OSError, match="No space left"):
        FsTier.from_config(cfg)
    assert len(made) == 1 and made[0].closed, "the failed tier's registration is still open"
    for _ in range(100):  # the threads end a moment after the last registration closed
        if _engine_or_io() <= before:
            break
        threading.Event().wait(0.05)
    assert _engine_or_io() <= before, sorted(_engine_or_io() - before)
