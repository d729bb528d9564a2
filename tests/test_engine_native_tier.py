"""FsTier on the C job engine (``FSTIER_ENGINE=native``): the FsTier-level
timeout and fence tests of tests/test_fences.py and tests/test_manager_faults.py
run here unchanged with the native engine selected, and their native-I/O-path
counterparts (a hung mount made by the C fault seam's delays) run on both
engines: a timed-out job fences only the slots of keys that were running,
a slot stays busy until its late read returned, results of fenced jobs are
held back when asked, and a job queued behind hung calls fails by its
deadline."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import make_config
from manager_support import (
    FILE_BYTES,
    TINY_GROUP,
    keys,
    load,
    open_tier,
    payload_for,
    slot_bytes,
    store,
    tiny_config,
)
from test_fences import test_hundreds_of_timeouts_leave_no_slot_fenced  # noqa: F401
from test_manager_faults import (  # noqa: F401
    test_a_block_that_vanishes_between_open_and_read_is_a_miss,
    test_a_job_behind_hung_calls_fails_within_the_deadline_without_fencing_unrun_slots,
    test_backpressure_drops_stores_and_never_blocks_the_caller,
    test_breaker_half_open_failure_reopens,
    test_breaker_trips_on_eio_degrades_and_recovers,
    test_failed_store_reports_errno_and_leaves_no_temp,
    test_hold_fenced_results_publishes_a_timed_out_job_only_once_its_slot_is_released,
    test_load_errors_are_failed_jobs_not_exceptions,
    test_misses_and_corrupt_files_do_not_trip_the_breaker,
    test_one_refused_key_in_a_store_job_is_reported_alone,
    test_timeout_fences_slot_until_late_return_and_trips_breaker,
    test_wait_timeouts_accept_inf_and_refuse_nan,
)

from fstier.io import native
from fstier.io.capabilities import DirectIOSupport
from fstier.io.engine.native import available
from fstier.manager import FsTier
from fstier.slots.host_pool import HostBlockPool

pytestmark = pytest.mark.skipif(not available(), reason="the native extension is not built")


@pytest.fixture(autouse=True)
def _engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The native engine for every test here; the tests below also run on
    the Python engine (``engine`` parameter)."""
    name = request.node.callspec.params.get("engine", "native") if hasattr(request.node, "callspec") else "native"
    monkeypatch.setenv("FSTIER_ENGINE", name)
    yield name
    native.clear_faults()


def BOTH(test: Any) -> Any:  # noqa: N802 - a decorator named like pytest's marks
    """On both engines, on the native I/O path (skipped where FSTIER_NATIVE=0 forces the Python path)."""
    skip = pytest.mark.skipif(os.environ.get("FSTIER_NATIVE") == "0", reason="FSTIER_NATIVE=0: the Python I/O path")
    return skip(pytest.mark.parametrize("engine", ["python", "native"])(test))


@BOTH
def test_native_path_timeout_fences_only_until_the_late_read_returns(tmp_path: Path, engine: str) -> None:
    # 0.5 s: the other load below must finish inside it on a loaded CI machine (at 0.2 s it timed out
    # once in ~15 runs at load 2-5); the hung read outlasts it fourfold.
    with open_tier(tmp_path / "root", io_timeout_s=0.5, breaker_failures=100, native_io="on") as tier:
        assert type(tier._engine.engine).__name__ == ("NativeEngine" if engine == "native" else "PythonEngine")
        ks = keys(0, 3)
        assert store(tier, "s", ks).success
        native.fault("read", delay_s=2.0, times=1)  # one hung read
        tier.submit_load("hang", ks[:1], [5])
        assert tier.drain(10)
        (res,) = tier.get_finished()
        assert (res.success, res.keys_completed, res.cause) == (False, 0, "timeout")
        assert tier.fenced_slots == frozenset({5})
        tier.submit_load("reuse", ks[1:2], [5])
        (busy,) = tier.get_finished()
        assert busy.cause == "slot_busy" and not busy.success
        assert load(tier, "other", ks[1:3], first_slot=7).success
        assert tier.wait_fences_released(timeout=10)
        assert tier.fenced_slots == frozenset() and tier.pool.fenced == frozenset()  # type: ignore[attr-defined]
        assert load(tier, "again", ks[:1], first_slot=5).success


@BOTH
def test_native_path_held_results_wait_for_the_release(tmp_path: Path, engine: str) -> None:
    pool = HostBlockPool(16, FILE_BYTES)
    pool.alloc(16)
    tier = FsTier(tiny_config(tmp_path / "root", native_io="on", io_timeout_s=0.5), pool, hold_fenced_results=True)
    try:
        ks = keys(0, 2)
        assert store(tier, "s", ks).success
        native.fault("read", delay_s=2.0, times=1)  # outlasts the deadline fourfold (the "ok" load must not)
        tier.submit_load("hang", ks[:1], [5])
        tier.drain()
        assert tier.fenced_slots == frozenset({5})
        assert tier.get_finished() == []  # held back: slot 5 may still be written
        assert load(tier, "ok", ks[1:], first_slot=7).success
        assert tier.wait_fences_released(timeout=10)
        (res,) = tier.get_finished()
        assert (res.job_id, res.success, res.cause) == ("hang", False, "timeout")
    finally:
        tier.close()
        pool.close()


@BOTH
def test_native_path_keys_behind_hung_calls_fail_by_the_deadline(tmp_path: Path, engine: str) -> None:
    with open_tier(
        tmp_path / "root", io_timeout_s=0.3, read_threads=1, write_threads=1, breaker_failures=100,
        native_io="on",
    ) as tier:
        ks = keys(0, 8)
        assert store(tier, "s", ks).success
        native.fault("read", delay_s=1.5, times=-1)
        t0 = time.monotonic()
        tier.submit_load("hang", ks, list(range(10, 18)))
        assert tier.drain(timeout=20)
        elapsed = time.monotonic() - t0
        (res,) = tier.get_finished()
        assert (res.success, res.keys_completed, res.cause) == (False, 0, "timeout")
        assert elapsed < 1.2, elapsed
        # Keys were running at the deadline: the job's slots are fenced as a
        # batch call's (the Python engine runs a native job as one call).
        assert tier.fenced_slots == frozenset(range(10, 18))
        native.clear_faults()
        assert tier.wait_fences_released(timeout=10)


def test_namespaces_share_one_c_engine_and_start_no_python_io_thread(tmp_path: Path) -> None:
    """tests/test_engine.py's sharing on the C engine: 12 namespaces, one
    engine of 3 + 2 C workers, no fstier-io Python thread, every namespace's
    bytes stored and loaded; the last close stops the workers."""
    if os.environ.get("FSTIER_NATIVE") == "0":
        pytest.skip("FSTIER_NATIVE=0: the Python I/O path")
    before = {t.name for t in threading.enumerate()}
    tiers = []
    for i in range(12):
        cfg = make_config(tmp_path / "root", groups=[dict(TINY_GROUP)], model={"name": f"acme/m-{i}"},
                          tier={"read_threads": 3, "write_threads": 2, "native_io": "on"})
        tiers.append(FsTier.from_config(cfg))
        tiers[-1].pool.alloc(64)  # type: ignore[attr-defined]
    try:
        engine = tiers[0]._engine.engine
        assert {id(t._engine.engine) for t in tiers} == {id(engine)}
        assert type(engine).__name__ == "NativeEngine"
        assert engine.info()["live"] == 3 + 2  # type: ignore[attr-defined]
        for i, t in enumerate(tiers):
            assert store(t, f"s{i}", keys(100 * i, 6)).success
        for i, t in enumerate(tiers):
            ks = keys(100 * i, 6)
            assert load(t, f"l{i}", ks, first_slot=8).success
            assert [slot_bytes(t, k, 8 + j) for j, k in enumerate(ks)] == [
                payload_for(k, t.payload_bytes(k)) for k in ks
            ]
        new = {t.name for t in threading.enumerate()} - before
        assert not [n for n in new if n.startswith("fstier-io")], sorted(new)
    finally:
        for t in tiers:
            t.close()
    assert engine.info()["live"] == 0 and engine.closed  # type: ignore[attr-defined]


def test_a_store_while_an_o_direct_probe_is_pending_runs_on_the_c_engine(tmp_path: Path) -> None:
    """A root whose O_DIRECT probe is to run again later (it could not run at
    start), not due yet: its stores run on the C engine, each by the
    submit's checked way (its cached arguments do not cover such a root),
    never around it again (a submit that re-entered the fast path for them
    recursed until Python's limit)."""
    with open_tier(tmp_path / "root") as tier:
        caps = tier.blocks.options.capabilities
        if tier.io_path.backend != "native" or caps is None:
            pytest.skip("the native I/O path with root capabilities only")
        caps.reprobe_at = time.monotonic() + 3600.0  # the tier's clock is the system's
        assert not caps.reprobe_due()
        for i in range(3):
            assert store(tier, f"s{i}", keys(4 * i, 4)).success
        assert tier._engine.engine._python is None  # none went to the Python engine
        assert load(tier, "l", keys(0, 12)).success


def test_cached_submit_arguments_drop_when_tmpfile_or_the_options_change(tmp_path: Path) -> None:
    """The C engine caches a block store's fixed ``engine_submit`` arguments per kind; the root's
    capabilities drop them where those states change: after ``refuse_tmpfile`` the next store asks C for
    named temps (F_NO_TMPFILE), and after the O_DIRECT reprobe replaced the store's options the next
    load carries their alignment and flags (fails if a cached entry outlives either change)."""
    with open_tier(tmp_path / "root") as tier:
        caps, engine = tier.blocks.options.capabilities, tier._engine.engine
        if tier.io_path.backend != "native" or caps is None or type(engine).__name__ != "NativeEngine":
            pytest.skip("the C engine on the native I/O path with root capabilities only")
        real, seen = engine._ext, []  # type: ignore[attr-defined]

        class Recording:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            def engine_submit(self, *args: Any) -> Any:
                seen.append((args[2], args[11], args[14]))  # kind, flags, alignment
                return real.engine_submit(*args)

        engine._ext = Recording()  # type: ignore[attr-defined]
        try:
            assert store(tier, "s0", keys(0, 4)).success and load(tier, "l0", keys(0, 4), first_slot=8).success
            assert len(engine._fixed_args) == 2  # type: ignore[attr-defined]  # a store's and a load's
            if caps.tmpfile:
                caps.refuse_tmpfile()
                assert not engine._fixed_args  # type: ignore[attr-defined]
                assert store(tier, "s1", keys(4, 4)).success
                assert seen[-1][0] == 1 and seen[-1][1] & real.F_NO_TMPFILE
            assert load(tier, "l0b", keys(0, 4), first_slot=12).success  # the load's arguments cached again
            opts = tier.blocks.options
            caps.reprobe_at = 0.0  # a probe due, which finds O_DIRECT the other way and another alignment
            found = DirectIOSupport(not opts.o_direct, 512 if opts.alignment != 512 else 1024, "test", True)
            caps.reprobe = lambda: found  # type: ignore[method-assign]
            tier.blocks._reprobe(caps)
            caps.reprobe_at = None
            assert tier.blocks.options is not opts and not engine._fixed_args  # type: ignore[attr-defined]
            assert load(tier, "l1", keys(0, 4), first_slot=16).success
            new = native.flags(tier.blocks.options, mkdir=False)
            assert seen[-1] == (0, new, found.alignment), (seen[-1], new, found)
        finally:
            engine._ext = real  # type: ignore[attr-defined]
