"""Races on the C engine's common-path shortcuts. Lost wake-ups: a caller
woken by its eventfd (``FsTier(notify_fds=...)``, LMCache's adapter) that
polls while another thread's collection is still handling its job must
find the job published, never an empty answer and no later wake-up. The
cache of fixed submit arguments: a registration leaving while others fill
the cache (tiers of one engine opening and closing) must leave cleanly."""

from __future__ import annotations

import os
import select
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from manager_support import keys, open_tier

from fstier.config import TierConfig
from fstier.integrations.lmcache_space import Layout, LentSlots, SpaceId, space_mapper
from fstier.io.engine.native import NativeEngine
from fstier.io.engine.native import available as native_engine_available
from fstier.io.engine.record import EngineJob
from fstier.keys import BlockKey
from fstier.manager import FsTier


def _readable(fd: int, timeout: float = 30.0) -> bool:
    """Whether ``fd`` turned readable within ``timeout`` (and drain it)."""
    if not select.select([fd], [], [], timeout)[0]:
        return False
    os.eventfd_read(fd)
    return True


def _lent_tier_with_fds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[FsTier, LentSlots, dict[str, int]]:
    """A C-engine tier over lent slots whose registration has notify eventfds (LMCache's way), its slots and
    fds; skips (tier closed, fds closed) where the native I/O path is not built."""
    monkeypatch.setenv("FSTIER_ENGINE", "native")
    cfg = TierConfig(root_dir=tmp_path)
    layout = Layout.of([(2, 2048)], ["float16"])
    assert layout is not None
    slots = LentSlots(layout.nbytes)
    fds = {k: os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for k in ("store", "load")}
    tier = FsTier(cfg, slots, space_mapper(SpaceId("m", 0x01000100, "", layout), cfg), notify_fds=fds)
    if tier.io_path.backend != "native":
        tier.close()
        for fd in fds.values():
            os.close(fd)
        pytest.skip("the C engine's jobs need the native I/O path")
    return tier, slots, fds


@pytest.mark.skipif(not native_engine_available(), reason="the C engine is not built here")
def test_a_caller_woken_by_its_fd_waits_for_a_collection_handling_its_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread (the completion thread, or a second caller's poll)
    collected the event of a load with misses and is still judging it (a
    mixed summary: outside the engine's lock, the job no longer in flight
    there). The caller, woken by the load's eventfd, must get the result
    from ``get_finished``: the pump's "no job in flight" shortcut returned
    at once before, so ``get_finished`` answered [] and, the fd drained, the
    result waited for an unrelated wake-up."""
    tier, slots, fds = _lent_tier_with_fds(tmp_path, monkeypatch)
    engine: Any = tier._engine.engine
    entered, go = threading.Event(), threading.Event()
    judge = engine._judge_summary

    def slow_judge(job: Any, per_key: Any, marks: Any) -> None:
        entered.set()
        go.wait(10)
        judge(job, per_key, marks)

    try:
        bufs = [np.full(8192, i + 1, dtype=np.uint8) for i in range(4)]
        keys = [BlockKey(bytes([i + 1]) * 32) for i in range(4)]
        ids = slots.lend([memoryview(b) for b in bufs[:2]])
        assert ids is not None
        tier.submit_store("s", keys[:2], ids)
        assert _readable(fds["store"])
        (res,) = tier.get_finished()
        assert res.success
        slots.release(ids)
        out = [np.zeros(8192, dtype=np.uint8) for _ in range(4)]
        ids = slots.lend([memoryview(b) for b in out])
        assert ids is not None
        monkeypatch.setattr(engine, "_judge_summary", slow_judge)
        with engine._collecting:  # nothing collects until the load is done and the other collector runs
            tier.submit_load("l", keys, ids)  # two present, two missing: a mixed summary
            assert _readable(fds["load"]), "the load's eventfd was not written"
            other = threading.Thread(target=engine.pump, name="other-collector")
            other.start()
        assert entered.wait(10), "no collection judged the load"
        threading.Timer(0.5, go.set).start()
        got = tier.get_finished()  # woken by the fd: the job must be here
        go.set()
        other.join(10)
        assert [r.job_id for r in got] == ["l"], "a caller woken by its fd found no result (a lost wake-up)"
        assert got[0].keys_completed == 2
        assert all((o == b).all() for o, b in zip(out[:2], bufs[:2], strict=True))
        slots.release(ids)
    finally:
        go.set()
        tier.close()
        for fd in fds.values():
            os.close(fd)


@pytest.mark.skipif(not native_engine_available(), reason="the C engine is not built here")
def test_unregister_while_other_registrations_fill_the_fixed_argument_cache(tmp_path: Path) -> None:
    """Two threads register, make their first job's fixed arguments (the
    cache insert of a registration's first submit) and unregister, at once.
    ``unregister`` walked the cache with a Python loop while the other
    thread inserted: "dictionary changed size during iteration" left the
    leaving registration half closed (its jobs not cancelled, the engine
    never stopped). A stress run: it failed before in 4 of 4
    runs, each stopped at the first error)."""
    errors: list[BaseException] = []
    with open_tier(tmp_path) as tier:
        engine = NativeEngine(1, 1, name="fixed-race")
        keep = engine.register()
        job = EngineJob("t", "load")
        stop = time.monotonic() + 4

        def churn() -> None:
            while time.monotonic() < stop and not errors:
                regs = [engine.register() for _ in range(100)]
                try:
                    for reg in regs:
                        engine._fixed(reg, tier.blocks, job)
                    for reg in regs:
                        engine.unregister(reg)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

        threads = [threading.Thread(target=churn) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        left = [key for key in list(engine._fixed_args) if key[0] is not keep]
        engine.unregister(keep)
    assert not errors, f"unregister failed while the cache grew: {errors[0]!r}"
    assert not left, "left registrations still hold cached submit arguments"


@pytest.mark.skipif(not native_engine_available(), reason="the C engine is not built here")
def test_a_waiter_is_woken_by_a_job_published_just_before_it_sleeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``FsTier.wait`` (SGLang's storage calls): the job is published, and
    the completion looks for sleepers, after the waiter looked at the
    engine's finished list and before it counted itself asleep. The
    completion saw no sleeper and woke nobody: the waiter slept until its
    timeout (SGLang waits with none: until another job finished)."""
    monkeypatch.setenv("FSTIER_ENGINE", "native")
    with open_tier(tmp_path) as tier:
        reg: Any = tier._engine
        engine: Any = reg.engine
        waiters: Any = tier._waiters
        if tier.io_path.backend != "native":
            pytest.skip("the C engine's jobs need the native I/O path")
        hold, woken = threading.Event(), threading.Event()
        looked = reg.has_finished
        completed = waiters.completed

        def has_finished() -> bool:
            found = looked()
            if not found and sys._getframe(1).f_code.co_name == "wait" and not hold.is_set():
                hold.set()  # the job is published and the completion runs now, in this window
                woken.wait(1)  # (a completion that saw a sleeper waits for this lock: not set then)
            return found

        def on_complete(kind: str) -> None:
            completed(kind)
            woken.set()

        monkeypatch.setattr(reg, "has_finished", has_finished)
        monkeypatch.setattr(waiters, "completed", on_complete)
        engine._collecting.acquire()  # nothing collects the job until the waiter looked
        try:
            tier.submit_store("s", keys(0, 2), [0, 1])
            waiting = threading.Thread(target=lambda: box.append(tier.wait("s", 10)), name="waiter")
            box: list[Any] = []
            t0 = time.monotonic()
            waiting.start()
            assert hold.wait(10), "the waiter never looked at the finished list"
        finally:
            engine._collecting.release()
        waiting.join(15)
        took = time.monotonic() - t0
        assert woken.is_set(), "the completion never ran"
        assert box and box[0] is not None and box[0].success
        assert took < 5, f"the waiter slept {took:.1f}s past its job's completion (a lost wake-up)"


@pytest.mark.skipif(not native_engine_available(), reason="the C engine is not built here")
def test_a_poll_of_a_tier_with_notify_fds_that_finds_nothing_collects_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LMCache's adapter polls ``get_finished`` whenever LMCache asks, mostly
    with nothing finished: its registration's ``has_finished`` collected the
    engine's completions already, so the answer is exact after that one
    collection (a second poll and look, as before, pumped twice more: ~20
    lines per empty poll, 11 now); a job finished before the call is still
    found by that collection."""
    tier, slots, fds = _lent_tier_with_fds(tmp_path, monkeypatch)
    engine: Any = tier._engine.engine
    pumps: list[int] = []
    pump = engine.pump
    tier._engine.pump = lambda: pumps.append(1) or pump()
    try:
        assert tier.get_finished() == []
        assert len(pumps) == 1, f"an empty poll collected {len(pumps)} times"
        bufs = [np.full(8192, i + 1, dtype=np.uint8) for i in range(2)]
        ids = slots.lend([memoryview(b) for b in bufs])
        assert ids is not None
        with engine._collecting:  # the job finishes in C before the poll (collected by it or the completion thread)
            tier.submit_store("s", [BlockKey(bytes([i + 1]) * 32) for i in range(2)], ids)
            assert _readable(fds["store"])
        pumps.clear()
        (res,) = tier.get_finished()
        assert res.job_id == "s" and res.success
        slots.release(ids)
    finally:
        tier.close()
        for fd in fds.values():
            os.close(fd)
