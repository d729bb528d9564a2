"""A tier's submit of a job (:class:`Submitter`) and what the tier hands the engine with it: each key's
payload bytes (:func:`payload_sizes`), where the bytes live (:class:`SlotBuffers`: the slot provider's payload
views) and the job's one record (:class:`JobMaker`: keys, slots, a store's replace flags, the deadline; paths
named on first use).

The job's one record is the engine's :class:`~fstier.io.engine.EngineJob`;
the tier keeps no table or per-batch record of its own.

Invariants
    A job moves exactly each key's payload bytes of its slot, never a byte
    past them (:func:`~fstier.slots.provider.payload_views`). A submit is taken by the engine or given back
    whole: out of flight, with exactly what it reserved (``EngineJob.reserved``).

Costs
    The common job (:meth:`Submitter.submit`): one C-level test of its keys and slots, the provider's
    ``check_plain``, one dict update for the record, one lock for the decision; no bytecode per key.
    :func:`payload_sizes`: a product for a one-group model (its file size
    cached per payload length), O(keys) otherwise. :meth:`SlotBuffers.views`: C-level loops where the provider
    has a batch ``slot_views``; no bytecode per key.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from functools import lru_cache, partial
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Literal

from fstier.io import BlockStore, EngineJob, block_file_size
from fstier.keys import BlockKey
from fstier.slots.provider import SlotProvider, payload_views
from fstier.tier.checks import check_job
from fstier.tier.lookup import LookupCache

if TYPE_CHECKING:  # pragma: no cover
    from fstier.manager import FsTier

__all__ = ["JobMaker", "SlotBuffers", "Submitter", "payload_sizes"]

_NEW = object.__new__
_PLAIN, _BK, _INT = (list, tuple), {BlockKey}, {int}
_GROUP = attrgetter("group_idx")

#: :func:`~fstier.io.block_file_size` of a tier's few payload lengths, cached (a hit runs no Python line)
_file_size = lru_cache(maxsize=256)(block_file_size)


def payload_sizes(payload_len: Sequence[int], keys: Sequence[BlockKey]) -> tuple[tuple[int, ...], int]:
    """Each key's payload bytes (``payload_len`` by group) and the bytes of
    their files in all. One group (the common model): a product, no loop
    over the keys."""
    if len(payload_len) == 1:
        return (payload_len[0],) * len(keys), _file_size(payload_len[0]) * len(keys)
    op_bytes = tuple(payload_len[k.group_idx] for k in keys)
    return op_bytes, sum(map(_file_size, op_bytes))


class SlotBuffers:
    """The engine's view of a tier's slots (:class:`fstier.io.engine.record.Buffers`):
    ``views`` is the provider's own ``payload_views_checked`` (a job's slots were
    checked by ``check_job`` before its record was made: the slicing alone) or
    ``payload_views`` where it has one (no call in between per job), else
    :func:`~fstier.slots.provider.payload_views`."""

    __slots__ = ("_pool", "views")

    def __init__(self, pool: SlotProvider) -> None:
        self._pool = pool
        own = getattr(pool, "payload_views_checked", None) or getattr(pool, "payload_views", None)
        self.views: Callable[[Sequence[int], Sequence[int]], list[memoryview]] = (
            own if own is not None else partial(payload_views, pool)
        )


class JobMaker:
    """Builds the one record of each job of a tier (``blocks``' files,
    ``pool``'s slots, deadline ``timeout_s`` after submission): the fields
    that do not change from job to job are one dict, set with the job's own
    in one update (no line per field)."""

    def __init__(self, blocks: BlockStore, pool: SlotProvider, cache: LookupCache, timeout_s: float | None) -> None:
        self._cache = cache
        self._fixed: dict[str, Any] = {
            "blocks": blocks, "buffers": SlotBuffers(pool), "_paths": None, "timeout_s": timeout_s, "call": None,
        }

    def job(
        self, job_id: Hashable, kind: Literal["store", "load"], keys: tuple[BlockKey, ...],
        slots: tuple[int, ...], nbytes: tuple[int, ...], context: Any = None,
    ) -> EngineJob:
        """The record (its paths named on first use, by ``EngineJob.paths``); a
        store replaces the files of keys whose last load failed (bad); the
        caller's ``context`` rides on it to the job's result."""
        replace = self._cache.bad_flags(keys) if kind == "store" else None
        return EngineJob.made(self._fixed, tag=job_id, kind=kind, keys=keys, slots=slots, nbytes=nbytes,
                              replace=replace, context=context)


class Submitter:
    """A tier's submit of one job (``FsTier.submit_store`` / ``submit_load``), taken by the engine or given
    back whole.

    The common job (lists or tuples of one length, BlockKeys of known groups of a one-payload-length model,
    distinct plain slot indices in range, the breaker closed with no failure counted, no slot fenced and, for
    a store, no ``max_bytes`` and room in the write budget) takes ONE straight-line path: one C-level test,
    the provider's own check of plain slots (``check_plain`` where it has one), the record built by one dict
    update, the budget's reservation and the in-flight entry under the tier's lock, the engine's submit.
    Anything else takes the general path (:meth:`_general`: :func:`~fstier.tier.checks.check_job`,
    :func:`payload_sizes`, :meth:`JobMaker.job`), and so does a common job its lock finds with a slot fenced
    or the budget full meanwhile: :meth:`_hand_over`, the full decision
    (:meth:`~fstier.tier.admission.Admission.refuse`).

    Atomicity: the record exists before anything is reserved; it enters ``inflight`` and its store bytes are
    reserved (``WriteBudget.admit`` marks ``job.reserved`` in the statement that reserves them) inside one
    ``try``; whatever is raised before the engine set ``job.accepted`` takes it out of flight and gives back
    exactly what it reserved (test_submit_atomic.py): with ``max_bytes``, the root's usage it counted too
    (``job.counted``, marked as ``SharedUsage.reserve`` counts them)."""

    def __init__(self, tier: FsTier) -> None:
        self._tier, self._lock, self._inflight = tier, tier._lock, tier._inflight
        self._maker, self._pool, self._fences = tier._maker, tier.pool, tier._fences
        #: the fenced slots (``Fences.held``): read without the lock, empty means no slot is fenced
        self._held = tier._fences.held
        #: the provider's slot count (fixed for its life)
        self._num_slots = tier.pool.num_slots
        self._fixed = tier._maker._fixed
        self._admission, self._breaker, self._budget = tier._admission, tier._breaker, tier._budget
        self._capacity, self._results, self._engine = tier.capacity, tier._results, tier._engine
        self._payload_len, self._groups = tier._job_payload_len, len(tier._payload_len)
        self._bad = tier._cache.bad_flags
        pool = tier.pool
        #: the provider's check of slots already known plain, distinct and in range (its fences, what it lent)
        self._check_plain: Callable[[Sequence[int]], None] = getattr(pool, "check_plain", None) or pool.check_slots
        #: one payload length for every group: ``(it,)``, else None (every job takes the general path)
        self._one = (self._payload_len[0],) if len(set(self._payload_len)) == 1 else None
        self._file_bytes = _file_size(self._payload_len[0])

    def submit(self, job_id: Hashable, kind: Literal["store", "load"], keys: Sequence[BlockKey],
               slots: Sequence[int], context: Any) -> None:
        """Check, admit and hand over one job (see the class docstring); a refused job's result is published
        at once. A closed tier refuses it (``TierClosedError``); finished jobs are judged first (they may fence
        a slot, open the breaker or free budget): none in flight or waiting, two attribute tests and no call."""
        if self._tier._closed:
            self._tier._check_open()
        if self._engine.finished or self._engine.active:  # else nothing to judge: no job in flight or waiting
            self._tier._reap()
        if not (self._one is not None and type(keys) in _PLAIN and type(slots) in _PLAIN and 0 < len(keys) == len(slots)
                and set(map(type, keys)) == _BK and max(map(_GROUP, keys)) < self._groups
                and set(map(type, slots)) == _INT and min(slots) >= 0 and max(slots) < self._num_slots
                and len(set(slots)) == len(slots) and not self._held and self._breaker.healthy
                and (kind == "load" or self._capacity.max_bytes is None)):
            self._general(job_id, kind, keys, slots, context)
            return
        try:  # the common job: plain slots in range; the provider checks what it alone knows
            self._check_plain(slots)
        except ValueError as exc:
            raise ValueError(f"job {job_id!r}: {exc}") from None
        n, job = len(keys), _NEW(EngineJob)
        job.__dict__.update(self._fixed, tag=job_id, kind=kind, keys=tuple(keys), slots=tuple(slots), context=context,
                            nbytes=self._one * n, replace=self._bad(keys) if kind == "store" else None, results=[])
        try:  # whatever is raised: given back (out of flight, its reservation) only if the engine never took it
            with self._lock:  # a new id, no slot fenced, room for a store's bytes (reserved, marked on the record)
                if taken := (job_id not in self._inflight and not self._held
                             and (kind == "load" or self._budget.admit(self._file_bytes * n, job))):
                    self._inflight[job_id] = job
            if not taken:  # an id in flight (refused there), a slot fenced or the budget full: the full decision
                self._hand_over(job, kind, n, self._file_bytes * n, False)
                return
            self._engine.engine.submit(self._engine, job)  # Registration.submit's one line, without its call
        except BaseException:  # taken (job.accepted): it completes and is published as any other job
            if not job.accepted:
                self._give_back(job)
            raise

    def _general(self, job_id: Hashable, kind: Literal["store", "load"], keys: Sequence[BlockKey],
                 slots: Sequence[int], context: Any) -> None:
        """:meth:`submit` of any other job: every check (:func:`~fstier.tier.checks.check_job`), each key's
        size (:func:`payload_sizes`), the record (:meth:`JobMaker.job`), the admission's fast check."""
        check_job(job_id, keys, slots, self._pool, self._groups)
        keys_t, slots_t = tuple(keys), tuple(slots)
        n = len(keys_t)
        op_bytes, file_bytes = payload_sizes(self._payload_len, keys_t)
        job = self._maker.job(job_id, kind, keys_t, slots_t, op_bytes, context)
        clear = not self._held and self._admission.clear(kind, file_bytes)
        self._hand_over(job, kind, n, file_bytes, clear)

    def _hand_over(self, job: EngineJob, kind: Literal["store", "load"], n: int, file_bytes: int, clear: bool) -> None:
        """Every outcome, even one decided at once (empty, degraded, slot busy, backpressure), is taken under
        one lock after the duplicate-id check: otherwise a second job "J" that finishes at once would report a
        result for a "J" still in flight (test_manager.py pins it)."""
        job_id = job.tag
        try:  # whatever is raised: given back (out of flight, admission back) only if the engine never took it
            with self._lock:
                if job_id in self._inflight:
                    raise ValueError(f"job id {job_id!r} is already in flight; job ids must be unique")
                self._inflight[job_id] = job
                if n == 0:
                    cause: str | None = ""  # no keys: a success at once
                elif clear and not self._held and self._admission.take(kind, file_bytes, job):
                    cause = None  # no slot fenced, breaker closed, room for a store's bytes: taken (reserved)
                else:
                    busy = self._fences.busy(job.slots)
                    cause = self._admission.refuse(kind, n, file_bytes, job, slot_busy=busy)
                if cause is not None:  # finished at once: its result published, the caller woken too
                    del self._inflight[job_id]
                    self._results.refused_locked(job_id, kind, n, cause, job.context)
                    (self._tier._on_finished or self._engine.notify)(kind)
                    return
            self._engine.submit(job)
        except BaseException:  # taken (job.accepted): it completes and is published as any other job
            if not job.accepted:
                self._give_back(job)
            raise

    def _give_back(self, job: EngineJob) -> None:
        """``job`` never reached the engine: out of flight, and what its submit reserved (``job.reserved``,
        marked by the write budget as it reserved them) given back, once."""
        with self._lock:
            if self._inflight.get(job.tag) is job:
                del self._inflight[job.tag]
            reserved, counted, job.reserved, job.counted = job.reserved, job.counted, 0, 0
        if reserved or counted:
            self._admission.give_back(job.kind, reserved, counted)
