"""The job-engine contract, run against BOTH engines (the Python engine and
the C engine behind :class:`fstier.io.engine.native.NativeEngine`), on the
native block I/O path: stores and loads round-trip their bytes, a corrupt,
short or foreign file is a miss (and removed), a job past its deadline is
published as timed out with its running keys' slots fenced until their late
I/O returned (then released), injected faults fail only their key. The C
engine alone: its watchdog's clock is injectable, a forked child never
inherits it, and no Python thread does I/O (no ``fstier-io-*`` thread)."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from manager_support import FILE_BYTES, keys, payload_for, tiny_config

from fstier.io import native
from fstier.io.engine import CANCELLED, EXPIRED, TIMED_OUT, EngineJob
from fstier.io.engine.native import NativeEngine, available
from fstier.io.engine.python import PythonEngine
from fstier.io.iotypes import LoadStatus, StoreStatus
from fstier.manager import FsTier
from fstier.slots.host_pool import HostBlockPool
from fstier.tier.jobs import SlotBuffers

pytestmark = pytest.mark.skipif(
    not available() or os.environ.get("FSTIER_NATIVE") == "0",
    reason="the native extension is not built, or FSTIER_NATIVE=0 forces the Python I/O path",
)

ENGINES = ["python", "native"]


class Rig:
    """A tier's block store and slots (native I/O path), and an engine of
    the kind under test with one registration that records its callbacks."""

    def __init__(self, root: Path, kind: str, read_threads: int = 2, write_threads: int = 2) -> None:
        self.pool = HostBlockPool(64, FILE_BYTES)
        self.pool.alloc(64)
        self.tier = FsTier(tiny_config(root, native_io="on"), self.pool)
        self.blocks = self.tier.blocks
        assert self.blocks.batched
        cls: Any = NativeEngine if kind == "native" else PythonEngine
        self.engine = cls(read_threads, write_threads)
        self.released: list[EngineJob] = []
        self.done = threading.Event()
        self.reg = self.engine.register(lambda _k: self.done.set(), self.released.append)

    def job(self, tag: object, kind: str, ks: list[Any], slots: list[int], timeout_s: float | None = None) -> EngineJob:
        nbytes = tuple(self.tier.payload_bytes(k) for k in ks)
        return EngineJob(
            tag, kind, tuple(ks), tuple(slots), nbytes, self.blocks, SlotBuffers(self.pool),  # type: ignore[arg-type]
            self.blocks.paths(ks), None, timeout_s,
        )

    def run(self, job: EngineJob, timeout: float = 20.0) -> EngineJob:
        self.reg.submit(job)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for got in self.reg.collect():
                assert got is job
                return got
            time.sleep(0.002)
        raise AssertionError(f"job {job.tag!r} not published within {timeout}s")

    def fill(self, ks: list[Any], slots: list[int]) -> None:
        for k, s in zip(ks, slots, strict=True):
            n = self.tier.payload_bytes(k)
            self.pool.slot_view(s)[:n] = payload_for(k, n)

    def slot(self, k: Any, s: int) -> bytes:
        return bytes(self.pool.slot_view(s)[: self.tier.payload_bytes(k)])

    def close(self) -> None:
        self.reg.close()
        self.tier.close()
        self.pool.close()


@pytest.fixture(params=ENGINES)
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path / "root", request.param)
    try:
        yield r
    finally:
        native.clear_faults()
        r.close()


def outcomes(job: EngineJob) -> list[Any]:
    """One entry per key: its outcome, or the marker standing for it."""
    out: list[Any] = []
    for u, r in enumerate(job.results):
        span = job.unit_keys(u)
        out.extend(r if isinstance(r, list) else [r] * len(span))
    return out


def test_store_load_round_trip(rig: Rig) -> None:
    ks = keys(0, 24)
    rig.fill(ks, list(range(24)))
    st = rig.run(rig.job("s", "store", ks, list(range(24))))
    assert [o.status for o in outcomes(st)] == [StoreStatus.STORED] * 24
    assert st.done and st.seconds > 0 and st.fenced == ()
    again = rig.run(rig.job("s2", "store", ks, list(range(24))))
    assert [o.status for o in outcomes(again)] == [StoreStatus.SKIPPED] * 24
    ld = rig.run(rig.job("l", "load", ks, list(range(30, 54))))
    assert [o.status for o in outcomes(ld)] == [LoadStatus.LOADED] * 24
    assert [rig.slot(k, 30 + i) for i, k in enumerate(ks)] == [payload_for(k, rig.tier.payload_bytes(k)) for k in ks]


def test_corrupt_short_and_foreign_files_are_misses_and_removed(rig: Rig) -> None:
    ks = keys(100, 6)
    rig.fill(ks, list(range(6)))
    assert all(o.status is StoreStatus.STORED for o in outcomes(rig.run(rig.job("s", "store", ks, list(range(6))))))
    paths = rig.blocks.paths(ks)
    with open(paths[1], "r+b") as f:  # a flipped payload byte
        f.seek(4096 + 3)
        b = f.read(1)
        f.seek(4096 + 3)
        f.write(bytes([b[0] ^ 0xFF]))
    os.truncate(paths[2], 4096 + 10)  # short
    with open(paths[0], "rb") as f:  # another key's file at this key's name
        foreign = f.read()
    with open(paths[3], "wb") as f:
        f.write(foreign)
    ld = rig.run(rig.job("l", "load", ks, list(range(10, 16))))
    got = outcomes(ld)
    assert [o.status for o in got] == [
        LoadStatus.LOADED, LoadStatus.CORRUPT, LoadStatus.CORRUPT, LoadStatus.CORRUPT,
        LoadStatus.LOADED, LoadStatus.LOADED,
    ]
    assert [got[i].cause for i in (1, 2, 3)] == ["payload_checksum", "bad_size", "wrong_key"]
    assert all(got[i].removed for i in (1, 2, 3))
    assert [os.path.exists(p) for p in paths] == [True, False, False, False, True, True]
    assert rig.slot(ks[4], 14) == payload_for(ks[4], rig.tier.payload_bytes(ks[4]))


def test_an_injected_write_error_fails_only_its_key(rig: Rig) -> None:
    ks = keys(200, 8)
    rig.fill(ks, list(range(8)))
    native.fault("write", errno.EIO, nth=3)
    got = outcomes(rig.run(rig.job("s", "store", ks, list(range(8)))))
    failed = [o for o in got if o.status is StoreStatus.FAILED]
    assert len(failed) == 1 and failed[0].cause == "EIO"
    assert sum(o.status is StoreStatus.STORED for o in got) == 7
    leftovers = [n for _, _, files in os.walk(rig.blocks.mapper.blocks_dir) for n in files if ".tmp" in n]
    assert leftovers == []


def test_a_job_past_its_deadline_is_timed_out_fenced_then_released(rig: Rig) -> None:
    ks = keys(300, 8)
    rig.fill(ks, list(range(8)))
    assert all(o.status is StoreStatus.STORED for o in outcomes(rig.run(rig.job("s", "store", ks, list(range(8))))))
    native.fault("open", delay_s=0.4, times=-1)  # a hung mount: every open takes 0.4 s
    slots = list(range(20, 28))
    t0 = time.monotonic()
    job = rig.run(rig.job("l", "load", ks, slots, timeout_s=0.05))
    took = time.monotonic() - t0
    assert took < 0.35, f"published {took:.2f}s after submit: the deadline was not kept"
    got = outcomes(job)
    assert all(o is TIMED_OUT or o is EXPIRED for o in got), got
    assert job.fenced and set(job.fenced) <= set(slots)
    assert not job.released and rig.released == []
    end = time.monotonic() + 10
    while not rig.released and time.monotonic() < end:
        time.sleep(0.01)
    assert rig.released == [job] and job.released
    assert rig.engine.stuck_threads == 0
    native.clear_faults()
    ok = rig.run(rig.job("l2", "load", ks, slots))  # the engine serves again, with its threads replaced
    assert [o.status for o in outcomes(ok)] == [LoadStatus.LOADED] * 8


def test_the_c_watchdog_clock_is_injectable(tmp_path: Path) -> None:
    r = Rig(tmp_path / "root", "native", read_threads=1, write_threads=1)
    try:
        ks = keys(400, 2)
        r.fill(ks, [0, 1])
        assert all(o.status is StoreStatus.STORED for o in outcomes(r.run(r.job("s", "store", ks, [0, 1]))))
        engine: NativeEngine = r.engine
        engine.set_clock(1000.0)
        native.fault("open", delay_s=1.0, times=1)
        job = r.job("l", "load", ks, [10, 11], timeout_s=5.0)
        r.reg.submit(job)
        time.sleep(0.2)  # real time passes, the engine's clock does not
        assert r.reg.collect() == []
        engine.set_clock(1006.0)  # past the deadline
        t0 = time.monotonic()
        while not r.reg.has_finished() and time.monotonic() - t0 < 1.0:
            time.sleep(0.002)
        (got,) = r.reg.collect()
        assert got is job and time.monotonic() - t0 < 0.5
        # a 2-key job runs on one worker, its keys in order: key 0 ran, key 1 never did
        assert outcomes(got) == [TIMED_OUT, EXPIRED]
        assert got.fenced == (10, 11)  # both, as a batch call's: released together
        end = time.monotonic() + 5
        while not r.released and time.monotonic() < end:
            time.sleep(0.01)
        assert r.released == [job]
    finally:
        native.clear_faults()
        r.close()


def test_no_python_io_thread_and_no_helper_thread_with_the_native_engine(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FSTIER_ENGINE", "native")
    before = {t.name for t in threading.enumerate()}
    pool = HostBlockPool(64, FILE_BYTES)
    pool.alloc(64)
    tier = FsTier(tiny_config(tmp_path / "root", native_io="on", read_threads=4, write_threads=4), pool)
    try:
        assert type(tier._engine.engine).__name__ == "NativeEngine"
        ks = keys(0, 32)
        for i, k in enumerate(ks):
            pool.slot_view(i)[: tier.payload_bytes(k)] = payload_for(k, tier.payload_bytes(k))
        fan = native._require().fan_started()
        tier.submit_store("s", ks, list(range(32)))
        tier.submit_load("l0", ks[:1], [40])
        assert tier.drain(30)
        tier.submit_load("l", ks, list(range(32, 64)))
        assert tier.drain(30)
        res = {r.job_id: r for r in tier.get_finished()}
        assert res["s"].success and res["l"].success and res["l"].keys_completed == 32
        assert native._require().fan_started() == fan, "a per-call C helper thread was started"
        new = {t.name for t in threading.enumerate()} - before
        assert not [n for n in new if n.startswith("fstier-io")], sorted(new)
    finally:
        tier.close()
        pool.close()


def test_a_forked_child_never_inherits_the_c_engine(tmp_path: Path) -> None:
    r = Rig(tmp_path / "root", "native")
    try:
        ks = keys(500, 4)
        r.fill(ks, list(range(4)))
        assert all(o.status is StoreStatus.STORED for o in outcomes(r.run(r.job("s", "store", ks, list(range(4))))))
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports by exit status
            code = 1
            try:
                try:
                    r.engine._ext.engine_info(r.engine._cap)
                    code = 3  # the parent's engine answered in the child
                except RuntimeError:
                    child = NativeEngine(1, 1)
                    reg = child.register()
                    job = r.job("cl", "load", ks, list(range(40, 44)))
                    reg.submit(job)
                    end = time.monotonic() + 10
                    got: list[EngineJob] = []
                    while not got and time.monotonic() < end:
                        got = reg.collect()
                        time.sleep(0.005)
                    ok = got == [job] and all(o.status is LoadStatus.LOADED for o in outcomes(job))
                    reg.close()
                    code = 0 if ok else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        ld = r.run(r.job("l", "load", ks, list(range(10, 14))))  # the parent's engine still serves
        assert [o.status for o in outcomes(ld)] == [LoadStatus.LOADED] * 4
    finally:
        r.close()


def test_closing_a_registration_cancels_its_keys_not_started_on_the_c_engine(tmp_path: Path) -> None:
    r = Rig(tmp_path / "root", "native", read_threads=1, write_threads=1)
    try:
        ks = keys(600, 6)
        r.fill(ks, list(range(6)))
        assert all(o.status is StoreStatus.STORED for o in outcomes(r.run(r.job("s", "store", ks, list(range(6))))))
        other = r.engine.register()
        native.fault("read", delay_s=0.4, times=-1)
        job = r.job("l", "load", ks, list(range(10, 16)))
        other.submit(job)
        time.sleep(0.15)  # one worker is in the read of key 0 (a 6-key job runs on one)
        other.close()
        end = time.monotonic() + 10
        while not other.has_finished() and time.monotonic() < end:
            time.sleep(0.01)
        (got,) = other.collect()
        assert got is job
        res = outcomes(got)
        assert res[0].status is LoadStatus.LOADED
        assert res[1:] == [CANCELLED] * 5
        assert got.fenced == ()
    finally:
        native.clear_faults()
        r.close()


def test_a_c_engine_that_stopped_leaves_no_fd_or_thread() -> None:
    """The eventfd and the struct are freed with the engine's last reference
    once its threads stopped (an fd per engine leaked before: a suite that
    starts thousands of tiers would run out of descriptors)."""
    import gc

    fds = len(os.listdir("/proc/self/fd"))
    threads = threading.active_count()
    for _ in range(30):
        engine = NativeEngine(2, 2)
        engine.register().close()  # the last registration stops it
        del engine
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= fds
    assert threading.active_count() <= threads


def test_a_hung_call_job_is_given_up_on_at_its_deadline_on_the_c_engine() -> None:
    """A recency flush on a hung mount: the call job finishes (as timed out)
    by its deadline so a drain does not wait for the mount, and the calls
    queued behind it run on a new thread."""
    engine = NativeEngine(1, 1)
    reg = engine.register()
    release = threading.Event()
    ran: list[str] = []
    try:
        reg.submit(EngineJob("hung", "call", call=lambda: release.wait(10), timeout_s=0.2))
        reg.submit(EngineJob("next", "call", call=lambda: ran.append("next"), timeout_s=5.0))
        t0 = time.monotonic()
        assert reg.wait_idle(5.0)
        assert time.monotonic() - t0 < 1.5
        assert ran == ["next"]
        assert reg.collect() == []  # a call job publishes nothing
    finally:
        release.set()
        reg.close()
