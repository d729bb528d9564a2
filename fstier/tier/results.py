"""The tier's finished results, from a job's completion until the caller
takes them (:meth:`fstier.manager.FsTier.get_finished`).

A result waits in :attr:`Results.finished`, or, with ``hold_fenced``
(a slot provider that cannot stop the engine from reusing a slot it freed:
an engine's own rows), in :attr:`Results.held` while a slot of its job is
fenced (:class:`~fstier.tier.fences.Fences`), so the caller never gets a
slot back that a timed-out call may still write.

Invariants
    Every method runs under the tier's lock (``*_locked``), except the
    lock-free truth test a poll makes. Held results come out in the order
    their jobs finished, before the fresh ones.

Costs
    O(1) per result published (:meth:`Results.publish_jobs_locked`: one
    collect's jobs, their events and results, under the tier's lock once);
    a take is O(held) only while some are held.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any, Literal

from fstier.tier.fences import Fences
from fstier.tier.records import _NEW, _RESULT_FIELDS, _SET, BlockRemoved, BlockStored, JobResult, TierEvent

if TYPE_CHECKING:  # pragma: no cover
    from fstier.io import EngineJob
    from fstier.tier.outcomes import Verdict

__all__ = ["Results"]

_FIELDS = _RESULT_FIELDS  # a result's fields, in order


class Results:
    """Finished results of one tier, until taken (see the module docstring)."""

    __slots__ = ("_fences", "_hold", "finished", "held")

    def __init__(self, fences: Fences, hold_fenced: bool) -> None:
        self._fences = fences
        self._hold = hold_fenced
        self.finished: list[JobResult] = []
        #: results held back while a slot of their job is fenced (hold_fenced)
        self.held: list[tuple[JobResult, Sequence[int]]] = []

    def __bool__(self) -> bool:
        """Whether a result waits (no lock: one poll's test)."""
        return bool(self.finished or self.held)

    def publish_locked(self, result: JobResult, slots: Sequence[int]) -> None:
        """``result`` of a job that moved ``slots``: held while one is fenced."""
        if self._hold and self._fences.busy(slots):
            self.held.append((result, slots))
        else:
            self.finished.append(result)

    def publish_jobs_locked(
        self, done: Sequence[tuple[EngineJob, Verdict]], inflight: dict[Hashable, EngineJob], events: list[TierEvent],
        take: bool = False,
    ) -> list[JobResult]:
        """Each finished job of one collect with its verdict, in order: its
        events (the keys it wrote, the corrupt files it removed), its fence
        (before its result is published), out of ``inflight``, its result
        (built with no bytecode per field) published as :meth:`publish_locked`
        does; ``take``: then returns :meth:`take_locked`'s list (else [])."""
        for job, v in done:
            if v.stored:
                events.append(BlockStored(v.stored))
            if v.removed or job.fenced:  # rare: a corrupt file removed, a job past its deadline
                if v.removed:
                    events.append(BlockRemoved(v.removed, "corrupt"))
                self._fences.fence_job(job)  # (no slot of a job that did not time out)
            del inflight[job.tag]
            values = (job.tag, job.kind, not v.failed, *v[:6], v.loaded_after, job.context)
            deque(map(_SET, repeat(r := _NEW(JobResult)), _FIELDS, values), 0)
            if self._hold and self._fences and self._fences.busy(job.slots):
                self.held.append((r, job.slots))
            else:
                self.finished.append(r)
        if not take:
            return []
        out, self.finished = self.finished, []
        return self._ready_locked() + out if self.held else out

    def refused_locked(
        self, job_id: Hashable, kind: Literal["store", "load"], n: int, cause: str, context: Any
    ) -> None:
        """A job of ``n`` keys that finished at submission: with no keys, a
        success; else failed with ``cause`` (degraded, slot_busy, capacity, backpressure)."""
        self.finished.append(JobResult(job_id, kind, n == 0, 0, n, 0, 0.0, None if n == 0 else cause, 0, (), context))

    def take_locked(self) -> list[JobResult]:
        """Every result ready now: held ones whose slots were released first."""
        out, self.finished = self.finished, []
        return self._ready_locked() + out if self.held else out

    def _ready_locked(self) -> list[JobResult]:
        """The held results whose slots were released, taken out of :attr:`held` (in order)."""
        busy = self._fences.busy
        ready = [r for r, slots in self.held if not busy(slots)]
        self.held = [(r, slots) for r, slots in self.held if busy(slots)]
        return ready
