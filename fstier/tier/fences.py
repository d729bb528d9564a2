"""Fences: slots held by timed-out ops that may still write them.

An op past ``io_timeout_s`` is reported failed, but its thread may still
write into its slots later (a load), or read them and publish what it reads
(a store). An op is one batch (every key of it on the native path, one key
on the Python path), and the batch is the unit here: :meth:`Fences.fence_op`
records the batch's slots once (one record per timed-out batch, keyed by
pool job id and op index) and tells the slot provider to ``fence`` each, so
a slot the engine frees is not handed out again; when the pool says the
stuck call returned (:meth:`Fences.on_late`), that record, and only it,
releases its slots, here and at the provider. A call that returned before
its timeout was reaped leaves a *late mark* instead, so its batch is never
fenced; the marks of a job are dropped when the job is reaped
(:meth:`Fences.reaped`). A slot two timed-out batches hold stays fenced
until both returned (a count per slot). :class:`fstier.manager.FsTier` uses these to fail
jobs naming a fenced slot (``slot_busy``) and, with
``hold_fenced_results``, to hold back results of jobs holding one.

Invariants
    Every field changes only under the tier's one lock (the condition
    ``idle`` wraps it; it is notified when slots are released). A slot is
    fenced at the provider before the job's result is published, so the
    engine cannot have freed it yet; it is unfenced only once the late call
    can no longer write it.

Costs
    ``fence_op``: O(slots of the batch). ``on_late``: O(slots of the batch).
    ``busy``: O(slots of a job). One lock acquisition each; one log line per
    timed-out batch (test_fences.py pins the release of every slot after
    hundreds of timeouts on both I/O paths).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Iterable

from fstier.slots.provider import SlotProvider
from fstier.tier.jobs import Job
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
        #: (pool job id, op index) of a timed-out batch still running -> its slots
        self._ops: dict[tuple[Hashable, int], tuple[int, ...]] = {}
        #: slot -> how many timed-out batches still running hold it
        self._held: dict[int, int] = {}
        #: batches that returned late before their timeout was reaped
        self._late: set[tuple[Hashable, int]] = set()

    def fence_op(self, job: Job, op: int, timeout_s: float) -> None:
        """Batch ``op`` of ``job`` timed out: fence all its slots, in one
        record, until the stuck call returns (unless it already did: a late
        mark)."""
        owner = (job.pool_id, op)
        keys = job.keys_of_op(op)
        with self._idle:
            if owner in self._late or owner in self._ops:
                return
            slots = tuple(job.slots[i] for i in keys)
            self._ops[owner] = slots
            held = self._held
            for slot in slots:
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
            "fstier: %s batch of %d key(s) (first %r) timed out after %.1fs; its slots %s fenced "
            "until the call returns",
            job.kind, len(keys), job.keys[keys.start], timeout_s, _slots_text(slots),
        )

    def on_late(self, pool_id: Hashable, op_index: int) -> None:
        """The pool says a timed-out batch finally returned: its record
        releases its slots (a slot another stuck batch holds stays fenced)."""
        owner = (pool_id, op_index)
        with self._idle:
            slots = self._ops.pop(owner, None)
            if slots is None:
                self._late.add(owner)
                return
            held = self._held
            for slot in slots:
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
        log.info("fstier: slots %s released; their timed-out I/O returned", _slots_text(slots))

    def reaped(self, job: Job) -> None:
        """``job`` was reaped: its batches' late marks served their purpose.
        The caller holds the lock."""
        if self._late:
            self._late.difference_update((job.pool_id, j) for j in range(job.num_ops))

    def busy(self, slots: Iterable[int]) -> bool:
        """Whether any of ``slots`` is fenced. The caller holds the lock."""
        return bool(self._held) and not self._held.keys().isdisjoint(slots)

    @property
    def slots(self) -> frozenset[int]:
        """Slots held by a timed-out op that has not returned yet."""
        with self._idle:
            return frozenset(self._held)

    def wait_released(self, timeout: float | None) -> bool:
        """Wait until no slot is fenced; False if ``timeout`` expired first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._held, timeout)


def _slots_text(slots: tuple[int, ...]) -> str:
    if len(slots) <= 8:
        return ", ".join(map(str, slots))
    return f"{', '.join(map(str, slots[:8]))} and {len(slots) - 8} more"
