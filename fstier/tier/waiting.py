"""Waiting for one job: :meth:`FsTier.wait <fstier.manager.FsTier.wait>`.

One completion mechanism per kind of caller: a scheduler polls
``get_finished`` each step; an event loop is woken by ``on_finished(kind)``;
a caller that waits inside its own call (SGLang's storage calls) submits a
job under its tag (the job id) and waits for that job here. The engine's
completion wakes it: no polling, and no table of results in the caller.

:class:`Waiters` is a part of :class:`~fstier.manager.FsTier`: it reads the
tier's results (finished, held back for a fence) under the tier's lock and
takes the waited job's result out of them.

Invariants
    A waited job's result goes to its waiter alone (taken: ``get_finished``
    never returns it); with ``hold_fenced_results`` only once none of its
    slots is fenced (a fence's release notifies the tier's condition). No
    completion is missed: the waiter counts itself asleep, then looks at
    the engine's finished list under the tier's lock before it sleeps; the
    completion publishes, then reads that count and takes that lock to
    notify.

Costs
    Nothing for a tier nobody waits on: the wake-up is put in the
    registration's ``on_complete`` at the first wait. Per waited job: one
    thread wake-up and one scan of the results not yet taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from fstier.manager import FsTier
    from fstier.tier.records import JobResult

__all__ = ["Waiters"]


class Waiters:
    """The threads waiting in one tier's :meth:`~fstier.manager.FsTier.wait`."""

    def __init__(self, tier: FsTier) -> None:
        self._tier = tier
        #: threads asleep in wait (the completion takes the tier's lock only while any sleeps)
        self.asleep = 0
        #: the caller's own on_complete, called after the wake-up (set at the first wait)
        self._on_finished: Callable[[str], None] | None = None

    def wait(self, job_id: Hashable, timeout: float | None) -> JobResult | None:
        """``job_id``'s result once published, taken; None when ``timeout``
        expired first; ``ValueError`` for a job id neither in flight nor finished."""
        tier = self._tier
        reg = tier._engine
        if reg.on_complete != self.completed:
            with tier._lock:
                if reg.on_complete != self.completed:  # two first waits at once: one swap
                    self._on_finished, reg.on_complete = reg.on_complete, self.completed
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            tier._reap()
            with tier._idle:
                result = self._take_locked(job_id)
                if result is not None:
                    return result
                if job_id not in tier._inflight and not any(r.job_id == job_id for r, _ in tier._results.held):
                    raise ValueError(f"job id {job_id!r} is neither in flight nor finished here; nothing to wait for")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                # Counted asleep BEFORE the look: a completion that read no sleeper (no lock) published
                # before it, so the look finds its job (test_engine_wakeups.py: it slept to its timeout).
                self.asleep += 1
                try:
                    if reg.has_finished():
                        continue  # published since the reap above: judge it first
                    tier._idle.wait(left)  # the engine's completion, a reap or a fence's release notifies it
                finally:
                    self.asleep -= 1

    def _take_locked(self, job_id: Hashable) -> JobResult | None:
        """``job_id``'s result, out of the finished or released held ones (the tier's lock held)."""
        tier = self._tier
        results = tier._results
        for i, r in enumerate(results.finished):
            if r.job_id == job_id:
                return results.finished.pop(i)
        for i, (r, slots) in enumerate(results.held):
            if r.job_id == job_id and not tier._fences.busy(slots):
                del results.held[i]
                return r
        return None

    def completed(self, kind: str) -> None:
        """The registration's ``on_complete`` from the first wait on: wake the
        sleepers, then the caller's own ``on_finished``. Signals only (an engine thread runs it)."""
        if self.asleep:
            with self._tier._idle:
                self._tier._idle.notify_all()
        if self._on_finished is not None:
            self._on_finished(kind)
