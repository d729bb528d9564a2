"""Fences: slots held by timed-out ops that may still write them.

An op past ``io_timeout_s`` is reported failed, but its thread may still
write into its slot later (a load), or read it and publish what it reads (a
store). :meth:`Fences.fence` fences the slot and tells the slot provider to
``fence`` it too, so a slot the engine frees is not handed out again; when
the pool says the stuck call returned (:meth:`Fences.on_late`), every slot
that call held is unfenced, here and at the provider. A call that returned
before its timeout was reaped leaves a *late mark* instead, so its slots are
never fenced; the marks of a job are dropped when the job is reaped
(:meth:`Fences.reaped`). :class:`fstier.manager.FsTier` uses these to fail
jobs naming a fenced slot (``slot_busy``) and, with
``hold_fenced_results``, to hold back results of jobs holding one.

Invariants
    Every field changes only under the tier's one lock (the condition
    ``idle`` wraps it; it is notified when slots are released). A slot is
    fenced at the provider before the job's result is published, so the
    engine cannot have freed it yet; it is unfenced only once the late call
    can no longer write it.

Costs
    ``fence``: O(1). ``on_late``: O(fenced slots). ``busy``: O(slots of a job).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Iterable

from fstier.slots.provider import SlotProvider
from fstier.tier.jobs import Job

__all__ = ["Fences"]

log = logging.getLogger("fstier.manager")


class Fences:
    """The fenced slots of one tier (see the module docstring)."""

    def __init__(self, pool: SlotProvider, idle: threading.Condition) -> None:
        self._pool = pool
        self._idle = idle
        #: slot -> (pool job id, op index) of the timed-out op holding it
        self._fenced: dict[int, tuple[Hashable, int]] = {}
        #: ops that returned late before their timeout was reaped
        self._late: set[tuple[Hashable, int]] = set()

    def fence(self, job: Job, i: int, timeout_s: float) -> None:
        """Key ``i`` of ``job`` timed out: fence its slot until the stuck
        call returns (unless it already did: a late mark)."""
        with self._idle:
            owner = (job.pool_id, job.op_of(i))
            # A late mark stays until the job is reaped: every key of a
            # batch consults it.
            if owner not in self._late:
                slot = job.slots[i]
                self._fenced[slot] = owner
                # The provider's fence outlives the engine's free(): without
                # it, alloc() hands the slot out again, new bytes are staged
                # into it, and the stuck read overwrites them
                # (test_late_read_never_reaches_a_reallocated_slot).
                self._pool.fence(slot)
        log.warning(
            "fstier: %s of %r timed out after %.1fs; slot %d fenced until the call returns",
            job.kind, job.keys[i], timeout_s, job.slots[i],
        )

    def on_late(self, pool_id: Hashable, op_index: int) -> None:
        """The pool says a timed-out op finally returned: unfence its slots
        (one on the Python path; every slot of the batch on the native path,
        whose late call held them all)."""
        with self._idle:
            released = False
            for slot, owner in list(self._fenced.items()):
                if owner == (pool_id, op_index):
                    del self._fenced[slot]
                    # Only now may the provider hand the slot out again: the
                    # late call can no longer write it.
                    self._pool.unfence(slot)
                    log.info("fstier: slot %d released; its timed-out I/O returned", slot)
                    released = True
            if released:
                self._idle.notify_all()
            else:
                self._late.add((pool_id, op_index))

    def reaped(self, job: Job) -> None:
        """``job`` was reaped: its ops' late marks served all their keys.
        The caller holds the lock."""
        self._late.difference_update((job.pool_id, j) for j in range(job.num_ops))

    def busy(self, slots: Iterable[int]) -> bool:
        """Whether any of ``slots`` is fenced. The caller holds the lock."""
        return not self._fenced.keys().isdisjoint(slots)

    @property
    def slots(self) -> frozenset[int]:
        """Slots held by a timed-out op that has not returned yet."""
        with self._idle:
            return frozenset(self._fenced)

    def wait_released(self, timeout: float | None) -> bool:
        """Wait until no slot is fenced; False if ``timeout`` expired first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._fenced, timeout)
