"""A job in flight: its record (:class:`Job`), the table of jobs in flight
(:class:`JobTable`) and their ops on the I/O threads (:class:`JobOps`).

One :class:`Job` per submitted store or load job, created by
:meth:`fstier.manager.FsTier.submit_store` / ``submit_load``. The block store
cuts it into batches (:meth:`fstier.io.blockstore.BlockStore.batch_plan`:
one native call per job, with one C helper thread inside it per further
spare I/O thread (:meth:`fstier.io.pool.IOPool.spare_threads`: a job queued
behind busy I/O threads runs on one thread), or one key per op on the
Python path), and
each batch is one op on the :class:`~fstier.io.pool.IOPool`: it moves its
keys through ``BlockStore.store_many`` / ``load_many``, notes recency for
keys that were already present (store) or loaded, and closes its keys'
books.

Invariants
    - Mutable fields of a :class:`Job` change only under the tier's one lock
      (``FsTier._lock``, handed to :class:`JobOps`).
    - The bytes a store batch reserved in the :class:`~fstier.tier.admission.WriteBudget`
      leave it exactly once: when the batch ends, or when it times out
      (``op_reserved`` says which batches still hold a reservation).
    - An op writes exactly each key's payload bytes of its slot, never a
      byte past them (the I/O layer pads from its own bounce page).

Costs
    Per batch: its slots' views (:func:`~fstier.slots.provider.payload_views`:
    C-level loops where the provider has a batch ``slot_views``), one
    lookup-cache lock (the bad set), one recency lock, one job lock and one
    budget release; the batch's paths named once by ``map``
    (``BlockStore.paths``), for its I/O and its recency note alike. A batch
    runs no bytecode per key unless a key failed or its provider lacks
    ``slot_views``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import compress, repeat
from operator import attrgetter, is_
from typing import Literal

from fstier.io.blockfile import block_file_size
from fstier.io.blockstore import BlockStore
from fstier.io.iotypes import LoadOutcome, LoadStatus, StoreOutcome, StoreStatus
from fstier.keys import BlockKey
from fstier.slots.provider import SlotProvider, payload_views
from fstier.tier.admission import WriteBudget
from fstier.tier.lookup import LookupCache
from fstier.tier.recency import Recency

__all__ = ["Job", "JobOps", "JobTable", "payload_sizes"]

_STATUS = attrgetter("status")
_NBYTES = attrgetter("nbytes")


def payload_sizes(payload_len: Sequence[int], keys: Sequence[BlockKey]) -> tuple[tuple[int, ...], int]:
    """Each key's payload bytes (``payload_len`` by group) and the bytes of
    their files in all. One group (the common model): a product, no loop
    over the keys."""
    if len(payload_len) == 1:
        return (payload_len[0],) * len(keys), block_file_size(payload_len[0]) * len(keys)
    op_bytes = tuple(payload_len[k.group_idx] for k in keys)
    return op_bytes, sum(map(block_file_size, op_bytes))


@dataclass(slots=True)
class Job:
    """One in-flight job. Mutable fields change only under ``FsTier._lock``."""

    pool_id: int
    job_id: Hashable
    kind: Literal["store", "load"]
    keys: tuple[BlockKey, ...]
    slots: tuple[int, ...]
    op_bytes: tuple[int, ...]
    submitted: float
    last_end: float = 0.0
    #: pool op j moves keys[bounds[j]:bounds[j + 1]] in one block-store batch
    #: (BlockStore.batch_plan: one key per op on the Python path)
    bounds: tuple[int, ...] = ()
    #: C helper threads each batch's native call may start (BlockStore.batch_plan)
    helpers: int = 0
    #: per batch, the write-budget bytes its keys reserved (0 for a load;
    #: cleared when the batch ends or times out)
    op_reserved: list[int] = field(default_factory=list)

    def keys_of_op(self, op: int) -> range:
        """The key indices pool op ``op`` moves."""
        return range(self.bounds[op], self.bounds[op + 1])

    @property
    def num_ops(self) -> int:
        return len(self.bounds) - 1


class JobTable:
    """The jobs in flight, by pool job id, and the caller's job ids in flight
    (unique). Callers hold the tier's lock."""

    def __init__(self) -> None:
        self._by_pool: dict[Hashable, Job] = {}
        self._user_ids: set[Hashable] = set()
        self._next = 0

    def check_unique(self, job_id: Hashable) -> None:
        if job_id in self._user_ids:
            raise ValueError(f"job id {job_id!r} is already in flight; job ids must be unique")

    def open(
        self, job_id: Hashable, kind: Literal["store", "load"], keys: tuple[BlockKey, ...],
        slots: tuple[int, ...], op_bytes: tuple[int, ...],
    ) -> Job:
        """A new job in flight (a store's keys hold write-budget reservations)."""
        job = Job(self._next, job_id, kind, keys, slots, op_bytes, time.perf_counter())
        self._next += 1
        self._by_pool[job.pool_id] = job
        self._user_ids.add(job_id)
        return job

    def pop(self, pool_id: Hashable) -> Job | None:
        """The job of a finished pool job, out of the table (its caller's id
        stays in flight until :meth:`done`)."""
        return self._by_pool.pop(pool_id, None)

    def done(self, job: Job) -> None:
        """``job``'s result is published: its id may be used again."""
        self._user_ids.discard(job.job_id)

    def __bool__(self) -> bool:
        return bool(self._by_pool)


class JobOps:
    """Runs jobs' batches on the I/O threads (``blocks``, slots of ``pool``)
    and keeps their books (``budget``, under ``lock``)."""

    def __init__(
        self,
        blocks: BlockStore,
        pool: SlotProvider,
        cache: LookupCache,
        recency: Recency,
        budget: WriteBudget,
        lock: threading.Lock,
    ) -> None:
        self._blocks = blocks
        self._pool = pool
        self._cache = cache
        self._recency = recency
        self._budget = budget
        self._lock = lock

    def ops(self, job: Job, threads: int) -> list[Callable[[], object]]:
        """Cut ``job`` into batches for ``threads`` I/O threads (sets
        ``job.bounds`` and, for a store, each batch's reserved bytes) and
        return one pool op per batch."""
        job.bounds, job.helpers = self._blocks.batch_plan(len(job.keys), threads)
        bounds = job.bounds
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        if job.kind == "store" and job.op_bytes.count(job.op_bytes[0]) == len(job.op_bytes):  # one size: no sum
            size = block_file_size(job.op_bytes[0])
            job.op_reserved = [size * (b - a) for a, b in spans]
        elif job.kind == "store":
            sizes = [block_file_size(b) for b in job.op_bytes]
            job.op_reserved = [sum(sizes[a:b]) for a, b in spans]
        else:
            job.op_reserved = [0] * len(spans)
        run = self._store if job.kind == "store" else self._load
        return [partial(run, job, j, a, b) for j, (a, b) in enumerate(spans)]

    def _items(self, job: Job, lo: int, hi: int) -> list[tuple[BlockKey, memoryview]]:
        # Exactly the payload of each slot, never a byte past it (payload_views).
        views = payload_views(self._pool, job.slots[lo:hi], job.op_bytes[lo:hi])
        return list(zip(job.keys[lo:hi], views, strict=True))

    def _store(self, job: Job, op: int, lo: int, hi: int) -> list[StoreOutcome]:
        """Store keys ``lo..hi-1`` of ``job`` (batch ``op``). A key whose
        last load failed without proof of corruption (bad) replaces its file.
        The keys are named once: the store and the recency of its skipped
        keys share the paths."""
        written = 0
        try:
            keys = job.keys[lo:hi]
            paths = self._blocks.paths(keys)
            outs = self._blocks.store_many(
                self._items(job, lo, hi), replace=self._cache.bad_flags(keys), helpers=job.helpers, paths=paths
            )
            statuses = list(map(_STATUS, outs))  # C-level loops: no bytecode per key
            if StoreStatus.SKIPPED in statuses:
                self._recency.note_many(list(compress(paths, map(is_, statuses, repeat(StoreStatus.SKIPPED)))))
            written = sum(map(_NBYTES, outs))
            return outs
        finally:
            self.ended(job, op, written)

    def _load(self, job: Job, op: int, lo: int, hi: int) -> list[LoadOutcome]:
        """Load keys ``lo..hi-1`` of ``job`` (batch ``op``); every key is
        attempted. The keys are named once: the load and the recency of the
        loaded keys share the paths."""
        try:
            paths = self._blocks.paths(job.keys[lo:hi])
            outs = self._blocks.load_many(self._items(job, lo, hi), helpers=job.helpers, paths=paths)
            statuses = list(map(_STATUS, outs))
            if statuses.count(LoadStatus.LOADED) == len(statuses):  # the common batch
                self._recency.note_many(paths)
            else:
                self._recency.note_many(list(compress(paths, map(is_, statuses, repeat(LoadStatus.LOADED)))))
            return outs
        finally:
            self.ended(job, op, 0)

    def ended(self, job: Job, op: int, written: int, *, finished: bool = True) -> None:
        """Batch ``op`` of ``job`` is done with (it ended, or, ``finished=False``,
        timed out): the bytes it reserved leave the write budget, once;
        ``written`` count toward its speed sample."""
        with self._lock:
            if finished:
                job.last_end = time.perf_counter()
            reserved = job.op_reserved[op]
            job.op_reserved[op] = 0
        if reserved:
            self._budget.release(reserved, written)

    def seconds(self, job: Job) -> float:
        """Wall time from submission to the last op's end (or now)."""
        with self._lock:
            end = job.last_end or time.perf_counter()
        return max(0.0, end - job.submitted)
