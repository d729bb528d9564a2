"""The clock the tier's timers read: one seam, so a test moves time instead
of sleeping.

The tier's timers that tests move (the circuit breaker's cool-down, the
write budget's speed sample, the eviction lease, the recency flush
interval, the job engine's watchdog, the O_DIRECT re-probe) read a
:class:`Clock` handed to them, never :func:`time.monotonic` directly. The
rest read the system clock: the lookup cache's answer lifetime, the
capacity resync and eviction waits, ``drain``'s, ``wait``'s and the engine's shutdown
deadlines, the durations reported, the wall-clock stamps written into block
headers and lease files, ``fstier status``'s report time, and the C job
engine's watchdog (``CLOCK_MONOTONIC``, or a test's ``engine_clock``)
(tests/test_doc_claims.py lists them). Production uses
:data:`SYSTEM_CLOCK` (a :class:`MonotonicClock`); a test builds a
:class:`ManualClock` and calls :meth:`ManualClock.advance`.

- ``monotonic()``: seconds on a clock that never goes back (deadlines,
  cool-downs, intervals).
- ``time()``: wall-clock seconds since the epoch (what is compared with file
  mtimes written by other processes and hosts).
- ``wait(waitable, timeout)``: ``waitable.wait`` (a
  :class:`threading.Event`, or a :class:`threading.Condition` whose lock
  the caller holds) until it is set or notified (True) or ``timeout``
  seconds of *this clock* passed (False); a background thread that waits
  for a deadline waits here, so a manual clock moves it too.

This module lives at the package's top level (beside :mod:`fstier.errors`)
because both the tier and the storage layer's pool read it, and ``io/``
imports nothing of the tier. It imports only the standard library. Every
call is O(1).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "ManualClock", "MonotonicClock", "Waitable"]

#: What a timer waits on: an event, or a condition whose lock the caller holds.
Waitable = threading.Event | threading.Condition


class Clock(Protocol):
    """What fstier's timers read (see the module docstring)."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back."""

    def time(self) -> float:
        """Wall-clock seconds since the epoch."""

    def wait(self, waitable: Waitable, timeout: float | None) -> bool:
        """``waitable.wait`` until set or notified (True) or until ``timeout``
        seconds of this clock passed (False); ``None`` waits for it alone."""


class MonotonicClock:
    """The real clock: :func:`time.monotonic`, :func:`time.time`, and the
    waitable's own timed ``wait``."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def wait(self, waitable: Waitable, timeout: float | None) -> bool:
        return waitable.wait(timeout)

    def __repr__(self) -> str:
        return "MonotonicClock()"


#: The clock every part uses unless it is handed another one.
SYSTEM_CLOCK: Clock = MonotonicClock()

#: How often (real seconds) :meth:`ManualClock.wait` looks at this clock
#: while its waitable is neither set nor notified.
_POLL_S = 0.002


class ManualClock:
    """A clock that moves only when told to (tests): :meth:`advance` moves
    both ``monotonic()`` and ``time()``; a :meth:`wait` whose timeout has
    now passed returns False within a few real milliseconds. Thread-safe.

    ``time()`` starts at the real wall time of construction (``wall``
    overrides it), so files the test writes meanwhile have comparable
    mtimes; ``monotonic()`` starts at ``start``.
    """

    def __init__(self, start: float = 1000.0, wall: float | None = None) -> None:
        self._mono = float(start)
        self._wall = time.time() if wall is None else float(wall)
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def time(self) -> float:
        with self._lock:
            return self._wall

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` (>= 0) pass on this clock."""
        if not seconds >= 0:
            raise ValueError(f"ManualClock.advance({seconds!r}): time only moves forward")
        with self._lock:
            self._mono += seconds
            self._wall += seconds

    def wait(self, waitable: Waitable, timeout: float | None) -> bool:
        deadline = None if timeout is None else self.monotonic() + max(0.0, timeout)
        # A set or notify ends the real wait at once; an advance() is seen
        # within _POLL_S. (A held Condition's lock is released while waiting.)
        while not waitable.wait(_POLL_S):
            if deadline is not None and self.monotonic() >= deadline:
                return False
        return True

    def __repr__(self) -> str:
        return f"ManualClock(monotonic={self._mono!r}, time={self._wall!r})"
