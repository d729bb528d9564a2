"""Fences: slots held by timed-out units that may still write them.

A job past its deadline is reported failed, but a unit of it still running
may write its slots later (a load), or read them and publish what it reads
(a store). The engine names those slots in the job's record
(``EngineJob.fenced``: every key of a native unit, one key per unit on the
Python path) and, when the last of them returned, sets ``job.released``
and calls :meth:`Fences.on_released`. The record is the fence's owner:
:meth:`Fences.fence_job` (at reap, before the job's result is published)
tells the slot provider to ``fence`` each slot, so a slot the engine frees
is not handed out again; :meth:`Fences.on_released` releases them, here and
at the provider. A job released before it was reaped is never fenced (the
tier reads ``job.released`` under its lock, the engine sets it before the
call that takes that lock). A slot two timed-out jobs hold stays fenced
until both returned (a count per slot). :class:`fstier.manager.FsTier`
fails jobs naming a fenced slot (``slot_busy``) and, with
``hold_fenced_results``, holds back results of jobs holding one.

Invariants
    Every field changes only under the tier's one lock (the condition
    ``idle`` wraps it; it is notified when slots are released). A slot is
    fenced at the provider before the job's result is published, so the
    engine cannot have freed it yet; it is unfenced only once the late call
    can no longer write it.

Costs
    ``fence_job`` and ``on_released``: O(fenced slots of the job), one lock
    acquisition, one log line; ``busy``: O(slots of a job)
    (test_fences.py pins the release of every slot after hundreds of
    timeouts on both I/O paths).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from fstier.io import EngineJob
from fstier.slots.provider import SlotProvider
from fstier.tier.metrics import Gauge

__all__ = ["Fences"]

log = logging.getLogger("fstier.manager")


class Fences:
    """The fenced slots of one tier (see the module docstring)."""

    def __init__(self, pool: SlotProvider, idle: threading.Condition, gauge: Gauge | None = None) -> None:
        self._pool = pool
        self._idle = idle
        #: fenced slots right now, exported (``fstier_fenced_slots``)
        self._gauge = gauge
        #: timed-out jobs whose late units have not all returned
        self._jobs: set[EngineJob] = set()
        #: slot -> how many such jobs hold it (one dict for the tier's life: a submit reads it without the
        #: lock, empty meaning no slot is fenced, as :meth:`__bool__` does)
        self.held: dict[int, int] = {}

    def fence_job(self, job: EngineJob) -> None:
        """``job`` timed out with units still running: fence their slots
        until they return (unless they already did). The caller holds the lock."""
        if not job.fenced or job.released or job in self._jobs:
            return
        self._jobs.add(job)
        held = self.held
        for slot in job.fenced:
            n = held.get(slot, 0)
            if n == 0:
                # The provider's fence outlives the engine's free(): without
                # it, alloc() hands the slot out again, new bytes are staged
                # into it, and the stuck read overwrites them
                # (test_late_read_never_reaches_a_reallocated_slot).
                self._pool.fence(slot)
            held[slot] = n + 1
        if self._gauge is not None:
            self._gauge.set(len(held))
        log.warning(
            "fstier: %s job %r timed out after %.1fs; slots %s of its %d key(s) fenced until the calls return",
            job.kind, job.tag, job.timeout_s or 0.0, _slots_text(job.fenced), len(job.keys),
        )

    def on_released(self, job: EngineJob) -> None:
        """The engine says every late unit of ``job`` returned: its slots are
        released (a slot another stuck job holds stays fenced)."""
        with self._idle:
            if job not in self._jobs:
                return  # released before it was reaped: never fenced
            self._jobs.discard(job)
            held = self.held
            for slot in job.fenced:
                n = held[slot] - 1
                if n:
                    held[slot] = n
                    continue
                del held[slot]
                # Only now may the provider hand the slot out again: no late
                # call can still write it.
                self._pool.unfence(slot)
            if self._gauge is not None:
                self._gauge.set(len(held))
            self._idle.notify_all()
        log.info("fstier: slots %s released; their timed-out I/O returned", _slots_text(job.fenced))

    def __bool__(self) -> bool:
        """Whether any slot is fenced (no lock: one read)."""
        return bool(self.held)

    def busy(self, slots: Iterable[int]) -> bool:
        """Whether any of ``slots`` is fenced. The caller holds the lock."""
        return bool(self.held) and not self.held.keys().isdisjoint(slots)

    @property
    def slots(self) -> frozenset[int]:
        """Slots held by a timed-out op that has not returned yet."""
        with self._idle:
            return frozenset(self.held)

    def wait_released(self, timeout: float | None) -> bool:
        """Wait until no slot is fenced; False if ``timeout`` expired first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self.held, timeout)


def _slots_text(slots: tuple[int, ...]) -> str:
    if len(slots) <= 8:
        return ", ".join(map(str, slots))
    return f"{', '.join(map(str, slots[:8]))} and {len(slots) - 8} more"
