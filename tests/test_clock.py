"""fstier.clock: the real clock reads the system's, a manual clock moves
only when advanced and wakes the waits whose time has come."""

from __future__ import annotations

import threading
import time

import pytest

from fstier.clock import SYSTEM_CLOCK, Clock, ManualClock, MonotonicClock


def test_the_system_clock_reads_the_real_clocks() -> None:
    before_m, before_w = time.monotonic(), time.time()
    assert before_m <= SYSTEM_CLOCK.monotonic() <= time.monotonic()
    assert before_w <= SYSTEM_CLOCK.time() <= time.time()
    ev = threading.Event()
    assert SYSTEM_CLOCK.wait(ev, 0.0) is False
    ev.set()
    assert SYSTEM_CLOCK.wait(ev, None) is True
    assert isinstance(SYSTEM_CLOCK, MonotonicClock)


def test_a_manual_clock_moves_only_when_advanced() -> None:
    clock: Clock = ManualClock(start=5.0, wall=100.0)
    assert (clock.monotonic(), clock.time()) == (5.0, 100.0)
    time.sleep(0.01)
    assert (clock.monotonic(), clock.time()) == (5.0, 100.0)
    assert isinstance(clock, ManualClock)
    clock.advance(2.5)
    assert (clock.monotonic(), clock.time()) == (7.5, 102.5)
    with pytest.raises(ValueError, match="only moves forward"):
        clock.advance(-1)


def test_a_manual_wait_ends_on_advance_or_on_the_event() -> None:
    clock = ManualClock()
    ev = threading.Event()
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(clock.wait(ev, 10.0)))
    t.start()
    clock.advance(9.0)
    t.join(0.2)
    assert t.is_alive()  # 9 of its 10 seconds passed
    clock.advance(1.0)
    t.join(5)
    assert got == [False]

    t = threading.Thread(target=lambda: got.append(clock.wait(ev, None)))
    t.start()
    ev.set()
    t.join(5)
    assert got == [False, True]
    assert clock.wait(ev, 0.0) is True  # a set event wins over an expired timeout


def test_a_manual_wait_on_a_condition_ends_on_notify_or_advance() -> None:
    clock = ManualClock()
    cond = threading.Condition()
    got: list[bool] = []

    def waiter() -> None:
        with cond:
            got.append(clock.wait(cond, 3.0))

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)  # real time passes; the manual clock does not
    assert t.is_alive()
    deadline = time.monotonic() + 5
    while t.is_alive() and time.monotonic() < deadline:
        with cond:
            cond.notify_all()
        t.join(0.01)
    t = threading.Thread(target=waiter)
    t.start()
    clock.advance(3.0)
    t.join(5)
    assert got == [True, False]


def test_the_engine_watchdog_runs_on_the_injected_clock() -> None:
    """A unit hung past its job's deadline times out when the engine's clock
    says so, not when real time passes: none of this test's waits is a sleep."""
    from fstier.io.engine import TIMED_OUT, EngineJob, PythonEngine

    clock = ManualClock()
    release, running = threading.Event(), threading.Event()

    def hung() -> int:
        running.set()
        release.wait(10)
        return 1

    engine = PythonEngine(1, 1, clock=clock)
    reg = engine.register()
    try:
        job = EngineJob("hung", "load", call=hung, timeout_s=30.0)
        reg.submit(job)
        assert running.wait(5)
        assert reg.wait_idle(0.2) is False and engine.timeouts == 0  # 0.2 real s: no timeout
        clock.advance(29.9)
        assert reg.wait_idle(0.1) is False and engine.timeouts == 0
        clock.advance(0.1)
        assert reg.wait_idle(5)
        assert job.results == [TIMED_OUT] and engine.stuck_threads == 1
    finally:
        release.set()
        engine.shutdown()


def test_the_breaker_cools_down_on_the_injected_clock() -> None:
    from fstier.tier.admission import Breaker
    from fstier.tier.metrics import TierMetrics

    clock = ManualClock()
    breaker = Breaker(1, 5.0, TierMetrics(), clock=clock)
    breaker.failure("EIO")
    assert breaker.state == "open" and not breaker.allow()
    clock.advance(4.99)
    assert breaker.state == "open"
    clock.advance(0.01)
    assert breaker.state == "half_open" and breaker.allow()
