"""FsTier: the engine-facing filesystem tier, its face (jobs, results,
fencing, events); its parts live in :mod:`fstier.tier`, its files in
:mod:`fstier.io`.

One key <-> one host slot <-> one file (:class:`~fstier.io.blockstore.BlockStore`
names it). The engine's scheduler owns one :class:`FsTier`; it never blocks in it:

- **lookup(keys) -> int** counts the leading keys whose files exist (a prefix
  hit; :mod:`fstier.tier.lookup`: a short-lived cache, ``stat`` in parallel
  chunks). A key whose load failed is *bad*: never a hit again until it is
  stored again, so a stale hit cannot livelock a request.
- **submit_store / submit_load** queue one pool job per call on the
  dual-queue :class:`~fstier.io.pool.IOPool`, cut into batches by the block
  store (:mod:`fstier.tier.jobs`); ``get_finished()`` returns
  :class:`JobResult` records without blocking (:mod:`fstier.tier.outcomes`
  judges them). A load keeps its loaded *prefix*; from the first key that
  did not load on, keys are misses to recompute. Stores of keys already
  present are skipped and counted.
- **Admission** (:mod:`fstier.tier.admission`): a job that cannot run now
  finishes at once with its cause: ``degraded`` (the circuit breaker is open
  after consecutive device or mount failures), ``slot_busy`` (a fenced slot),
  ``capacity`` (the root is over ``max_bytes``), ``backpressure`` (queued
  store bytes over ``max_write_queue_seconds`` of measured write speed): a
  future miss, never a blocked caller.
- **Fencing.** An op past ``io_timeout_s`` is reported failed, but its thread
  may still write into the slot later (or, for a store, read it and publish
  what it reads); that slot is fenced until the pool's ``on_late`` callback
  says the stuck call returned: jobs naming it fail with ``slot_busy``, and
  the slot provider (:mod:`fstier.slots`) is told to ``fence`` it, so a slot
  the engine frees is not handed out again before the late call is over.
  No byte written by an op after its job was reported reaches a later job.
  A provider that cannot stop the engine from reusing a slot it freed (an
  engine's own rows) asks for ``hold_fenced_results=True``: the result of a
  job holding a fenced slot is then held back by :meth:`get_finished` until
  the slot is released, so the engine cannot reuse it too early.
- **Slots** must be currently handed out by the provider (``check_slots``):
  a job naming a slot the caller does not hold is a ``ValueError``, as are
  malformed keys in any call, ``lookup`` included (:mod:`fstier.tier.checks`).
- **Capacity** (:mod:`fstier.tier.capacity`): with ``max_bytes``, a capacity
  thread keeps the root under its high watermark, evicting LRU files (file
  mtimes, bumped on every load and every store of a present key).
- **Events and metrics.** ``take_events()`` returns :class:`BlockStored` /
  :class:`BlockRemoved`; ``metrics`` is a :class:`~fstier.tier.metrics.TierMetrics`.

All job bookkeeping lives in one :class:`~fstier.tier.jobs.Job` record per
in-flight job under ``FsTier._lock``; results, events and fences too.
"""


from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from fstier.config import FstierConfig, TierConfig, load_config
from fstier.errors import ConfigError, PoolError, StorageError, TierClosedError
from fstier.file_mapper import FileMapper
from fstier.io import blockstore
from fstier.io.blockfile import padded_len
from fstier.io.pool import IOPool
from fstier.keys import BlockKey
from fstier.slots.provider import SlotProvider
from fstier.tier.admission import Admission, Breaker, WriteBudget
from fstier.tier.capacity import Capacity
from fstier.tier.checks import check_job, check_keys, wait_timeout
from fstier.tier.fences import Fences
from fstier.tier.gc import GcReport
from fstier.tier.jobs import Job, JobOps, file_bytes
from fstier.tier.lookup import Lookup, LookupCache
from fstier.tier.metrics import TierMetrics
from fstier.tier.outcomes import Judge
from fstier.tier.recency import Recency

if TYPE_CHECKING:  # pragma: no cover
    from fstier.slots.host_pool import HostBlockPool

__all__ = ["BlockRemoved", "BlockStored", "FsTier", "JobResult", "TierEvent"]

log = logging.getLogger("fstier.manager")

#: Default private pool budget when ``from_config`` creates the pool itself.
_DEFAULT_POOL_BYTES = 256 << 20


# ---------------------------------------------------------------- public records
@dataclass(frozen=True, slots=True)
class JobResult:
    """The outcome of one store or load job.

    ``keys_completed`` is always a leading prefix: ``keys[:keys_completed]``
    loaded (load) or are on disk (store: stored, or skipped as already
    present), up to the first failure. ``keys_failed = len(keys) -
    keys_completed`` are misses to recompute (load) or blocks not
    acknowledged (store; a later key of a failed store job may still have
    been written, and :class:`BlockStored` events list exactly which were).
    ``cause`` names the first failure (an errno name such as ``ENOSPC``,
    ``timeout``, ``backpressure``, ``capacity``, ``degraded``, ``slot_busy``,
    ``bad_file:<why>``,
    ``corrupt:<reason>``, or ``miss``). ``skipped`` counts stores of keys
    already present.
    """

    job_id: Hashable
    kind: Literal["store", "load"]
    success: bool
    keys_completed: int
    keys_failed: int
    nbytes: int
    seconds: float
    cause: str | None = None
    skipped: int = 0


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Keys whose block files this tier wrote (not the skipped ones)."""

    keys: tuple[BlockKey, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Keys whose files were removed: ``reason`` is ``evicted``, ``corrupt``
    or ``cleared`` (:meth:`FsTier.clear`)."""

    keys: tuple[BlockKey, ...]
    reason: str = "evicted"


TierEvent = BlockStored | BlockRemoved


# --------------------------------------------------------------------- FsTier
class FsTier:
    """The filesystem tier for one (model, parallel layout, root) config.

    ``pool`` is the :class:`~fstier.slots.SlotProvider` whose slots jobs name
    (a :class:`~fstier.slots.host_pool.HostBlockPool`, or an engine's own rows);
    each slot must hold the largest file payload. A slot at least the payload
    padded to 4096 is used as the I/O buffer whole (its tail is zeroed on
    store); a shorter or unaligned one is moved with exactly the payload's
    bytes (the I/O layer pads from its own buffer), so nothing outside the
    payload is ever written.

    ``config`` is an :class:`FstierConfig` (the namespace comes from its
    model and parallel layout), or a :class:`TierConfig` together with a
    ``mapper`` whose namespace an engine defined
    (:meth:`FileMapper.for_engine`); :attr:`config` is then ``None``.
    """

    def __init__(
        self,
        config: FstierConfig | TierConfig,
        pool: SlotProvider,
        mapper: FileMapper | None = None,
        *,
        hold_fenced_results: bool = False,
    ) -> None:
        if isinstance(config, FstierConfig) and mapper is None:
            self.config: FstierConfig | None = config
            tier = config.tier
            self.mapper = FileMapper(config)
        elif isinstance(config, TierConfig) and isinstance(mapper, FileMapper):
            self.config = None
            tier = config
            self.mapper = mapper
        else:
            raise ConfigError(
                f"FsTier(config=..., mapper=...): expected an FstierConfig, or a TierConfig "
                f"with a FileMapper, got {type(config).__name__} and {type(mapper).__name__}; "
                "use FsTier.from_config(path) for a YAML file"
            )
        self.tier_config: TierConfig = tier
        self._pool = pool
        self._owns_pool = False
        self._own_pool: HostBlockPool | None = None  # closed by close() (from_config)
        self._payload_len = [
            self.mapper.expected_payload_bytes(g) for g in range(self.mapper.num_groups)
        ]
        need = max(self._payload_len)
        if pool.slot_bytes < need:
            raise PoolError(
                f"{type(pool).__name__} slot_bytes is {pool.slot_bytes} but the largest file "
                f"payload is {need} bytes; provide slots with slot_bytes >= {need} "
                f"({padded_len(need)} lets I/O run on the slot in place)"
            )
        #: key -> file end to end (namespace, directories, recovery, headers, I/O)
        self.blocks = blockstore.BlockStore.for_tier(self.mapper, tier)
        self.io_options = self.blocks.options
        #: which block I/O path runs (fstier.io.native): "native" or "python"
        self.io_path = self.blocks.io_path
        self.metrics = TierMetrics()
        self.metrics.native_io.set(1 if self.io_path.backend == "native" else 0)
        self._cache = LookupCache(tier.lookup_cache_ttl_s)
        self._breaker = Breaker(tier.breaker_failures, tier.breaker_cooldown_s, self.metrics)
        self._budget = WriteBudget(tier.max_write_queue_seconds, self.metrics)

        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._jobs: dict[Hashable, Job] = {}
        self._user_ids: set[Hashable] = set()
        self._next_pool_id = 0
        self._finished: list[JobResult] = []
        self._hold_fenced = hold_fenced_results
        #: results held back while a slot of their job is fenced (hold_fenced_results)
        self._held: list[tuple[JobResult, tuple[int, ...]]] = []
        self._events: list[TierEvent] = []
        self._fences = Fences(pool, self._idle)
        self._closed = False

        self._io = IOPool(tier.read_threads, tier.write_threads, tier.io_timeout_s)
        self._io.on_late(self._fences.on_late)
        self._lookup = Lookup(
            self._cache, self.blocks.path, self.mapper.num_groups, max(2, min(tier.read_threads, 16)),
            breaker=self._breaker, metrics=self.metrics,
        )

        self._recency = Recency(self._io)
        # Capacity: root-wide usage shared with every instance on this root
        # and the capacity thread (fstier.tier.capacity).
        self.capacity = Capacity(
            self.mapper.root,
            tier,
            self.metrics,
            on_evicted=self._on_evicted,
            before_pass=self._recency.flush,
        )
        self._admission = Admission(self._breaker, self._budget, self.capacity, self.metrics)
        self._ops = JobOps(self.blocks, pool, self._cache, self._recency, self._budget, self._lock)
        self._judge = Judge(
            blocks=self.blocks, ops=self._ops, cache=self._cache, breaker=self._breaker,
            capacity=self.capacity, metrics=self.metrics, payload_len=self._payload_len,
            on_timed_out=lambda job, i: self._fences.fence(job, i, tier.io_timeout_s),
        )

    # ---------------------------------------------------------------- creation
    @classmethod
    def from_config(
        cls, config: str | os.PathLike[str] | FstierConfig, pool: SlotProvider | None = None
    ) -> FsTier:
        """Build from a YAML path or an :class:`FstierConfig`. Without ``pool``
        a private :class:`HostBlockPool` is created (slots sized to the largest
        payload, about 256 MiB in all, at least 2 x the I/O threads) and closed
        by :meth:`close`."""
        cfg = config if isinstance(config, FstierConfig) else load_config(config)
        if pool is not None:
            return cls(cfg, pool)
        from fstier.slots.host_pool import HostBlockPool

        mapper = FileMapper(cfg)
        slot_bytes = max(
            padded_len(mapper.expected_payload_bytes(g)) for g in range(len(cfg.model.groups))
        )
        threads = cfg.tier.read_threads + cfg.tier.write_threads
        num_slots = max(2 * threads, min(1024, _DEFAULT_POOL_BYTES // slot_bytes))
        own = HostBlockPool(num_slots, slot_bytes)
        try:
            tier = cls(cfg, own)
        except BaseException:
            own.close()
            raise
        tier._owns_pool = True
        tier._own_pool = own
        return tier

    @property
    def pool(self) -> SlotProvider:
        return self._pool

    def payload_bytes(self, key: BlockKey) -> int:
        """Payload length of ``key``'s file (the slot bytes a job moves)."""
        return self._payload_len[key.group_idx]

    def __enter__(self) -> FsTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading ``keys`` whose blocks are present (0 while degraded)."""
        self._check_open()
        if not keys:
            return 0
        check_keys(keys, len(self._payload_len), "lookup")
        return self._lookup.lookup(keys)

    def present(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether its block is present (no prefix stop, unlike
        :meth:`lookup`): for engines that ask about keys out of order (vLLM's
        sliding-window scan). Bad keys are absent; cached answers are used and
        the rest are ``stat``-ed, in parallel chunks on the lookup threads for
        big batches. It blocks on the filesystem: call it off the engine's
        scheduler thread."""
        self._check_open()
        if not keys:
            return []
        check_keys(keys, len(self._payload_len), "present")
        return self._lookup.present_counted(keys)

    # -------------------------------------------------------------------- jobs
    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError("FsTier is closed; create a new one with FsTier.from_config(...)")

    def _finish_now_locked(
        self, job_id: Hashable, kind: Literal["store", "load"], n: int, cause: str
    ) -> None:
        self._finished.append(
            JobResult(job_id, kind, n == 0, 0, n, 0, 0.0, None if n == 0 else cause)
        )

    def submit_store(
        self, job_id: Hashable, keys: Sequence[BlockKey], slots: Sequence[int]
    ) -> None:
        """Queue the store of ``slots[i]`` as ``keys[i]``'s file. Never blocks;
        a job that cannot run (degraded, backpressure, fenced slot) finishes at
        once with ``success=False`` and that cause."""
        self._submit(job_id, "store", keys, slots)

    def submit_load(
        self, job_id: Hashable, keys: Sequence[BlockKey], slots: Sequence[int]
    ) -> None:
        """Queue the load of ``keys[i]``'s file into ``slots[i]``. Never blocks."""
        self._submit(job_id, "load", keys, slots)

    def _submit(
        self,
        job_id: Hashable,
        kind: Literal["store", "load"],
        keys: Sequence[BlockKey],
        slots: Sequence[int],
    ) -> None:
        self._check_open()
        check_job(job_id, keys, slots, self._pool, len(self._payload_len))
        self._reap()
        n = len(keys)
        keys_t, slots_t = tuple(keys), tuple(slots)
        op_bytes = tuple(self._payload_len[k.group_idx] for k in keys_t)
        # Every outcome, even one decided at once (empty, degraded, slot busy,
        # backpressure), is taken under one lock after the duplicate-id check:
        # otherwise a second job "J" that finishes at once would report a
        # result for a "J" still in flight (issue 15 item 9).
        with self._lock:
            if job_id in self._user_ids:
                raise ValueError(f"job id {job_id!r} is already in flight; job ids must be unique")
            if n == 0:
                self._finish_now_locked(job_id, kind, 0, "")
                return
            busy = self._fences.busy(slots_t)
            cause = self._admission.refuse(kind, n, sum(map(file_bytes, op_bytes)), slot_busy=busy)
            if cause is not None:
                self._finish_now_locked(job_id, kind, n, cause)
                return
            pool_id = self._next_pool_id
            self._next_pool_id += 1
            job = Job(
                pool_id, job_id, kind, keys_t, slots_t, op_bytes, time.perf_counter(),
                op_open=[kind == "store"] * n,
            )
            self._jobs[pool_id] = job
            self._user_ids.add(job_id)
        # The block store cuts the job into batches: one native call per I/O
        # thread (GIL released), or one key per op on the Python path.
        threads = self.tier_config.write_threads if kind == "store" else self.tier_config.read_threads
        self._io.submit(pool_id, "write" if kind == "store" else "read", self._ops.ops(job, threads))

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark ``keys`` recently used (LRU recency) without a system call
        here: their mtimes are bumped by the batched recency writes. Keys
        without a file are ignored."""
        self._check_open()
        ngroups = len(self._payload_len)
        for k in keys:
            if k.group_idx < ngroups:
                self._recency.note(self.blocks.path(k))

    def flush_recency(self) -> None:
        """Write pending hit recency to the files' mtimes now (it is otherwise
        written every few seconds and before each capacity pass), e.g. before
        running ``fstier gc`` from another process."""
        self._check_open()
        self._recency.flush()

    # -- completion --------------------------------------------------------------
    def _reap(self) -> None:
        """Turn finished pool jobs into JobResults (never blocks)."""
        for pj in self._io.get_finished():
            with self._lock:
                job = self._jobs.pop(pj.job_id, None)
            if job is None:
                continue
            v = self._judge.finish(job, job.per_key(pj.results))
            result = JobResult(
                job.job_id, job.kind, v.success, v.completed, v.failed, v.nbytes, v.seconds,
                v.cause, v.skipped,
            )
            with self._idle:
                if v.stored:
                    self._events.append(BlockStored(v.stored))
                if v.removed:
                    self._events.append(BlockRemoved(v.removed, "corrupt"))
                self._fences.reaped(job)
                self._user_ids.discard(job.job_id)
                if self._hold_fenced and self._fences.busy(job.slots):
                    self._held.append((result, job.slots))
                else:
                    self._finished.append(result)
                self._idle.notify_all()

    def get_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call (never blocks); with
        ``hold_fenced_results``, a job's result comes once none of its slots
        is fenced (held results first, in the order they finished)."""
        self._reap()
        with self._lock:
            out, self._finished = self._finished, []
            if self._held:
                ready = [r for r, slots in self._held if not self._fences.busy(slots)]
                self._held = [(r, slots) for r, slots in self._held if self._fences.busy(slots)]
                out = ready + out
        return out

    def take_events(self) -> list[TierEvent]:
        """Stored/removed events since the last call, in order."""
        self._reap()
        with self._lock:
            out, self._events = self._events, []
        return out

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has finished (results stay queued
        for :meth:`get_finished`). Returns False if ``timeout`` expired."""
        timeout = wait_timeout("drain", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._io.wait_idle(left)
            self._reap()
            with self._lock:
                if not self._jobs:
                    return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    @property
    def degraded(self) -> bool:
        """True while the circuit breaker is open."""
        return not self._breaker.allow()

    @property
    def breaker_state(self) -> str:
        """``closed``, ``open`` or ``half_open``."""
        return self._breaker.state

    @property
    def fenced_slots(self) -> frozenset[int]:
        """Slots held by a timed-out op that has not returned yet."""
        return self._fences.slots

    def wait_fences_released(self, timeout: float | None = None) -> bool:
        """Wait until no slot is fenced by a timed-out op (every stuck call
        returned). Returns False if ``timeout`` expired first."""
        timeout = wait_timeout("wait_fences_released", timeout)
        self._reap()
        return self._fences.wait_released(timeout)

    # ---------------------------------------------------------------- capacity
    @property
    def usage_bytes(self) -> int | None:
        """Bytes of block files under the root, counted by every instance
        storing into it (None before this instance's first scan or without
        ``max_bytes``)."""
        return self.capacity.usage_bytes

    def _on_evicted(self, path: str) -> None:
        key = self.blocks.key_of(path)
        if key is None:
            return  # another namespace sharing the root
        self._cache.forget([key])
        with self._lock:
            # Coalesce a burst of evictions into one event.
            last = self._events[-1] if self._events else None
            if isinstance(last, BlockRemoved) and last.reason == "evicted":
                self._events[-1] = BlockRemoved((*last.keys, key), "evicted")
            else:
                self._events.append(BlockRemoved((key,), "evicted"))

    def run_capacity_pass(
        self, max_bytes: int | None = None, timeout: float | None = 60.0
    ) -> GcReport:
        """One synchronous capacity pass over the root: sweep stale temp and
        ``.nfs*`` files and, above the high watermark of ``max_bytes``
        (default: ``tier.max_bytes``), evict LRU files down to the low
        watermark. Resynchronises the shared usage count.

        Waits for a pass another instance on the root is running, at most
        ``timeout`` seconds (None: no limit), then raises
        :class:`TimeoutError`; a pass still walking at the deadline stops
        there and reports ``complete=False``. An instance that died or hangs
        holding the root's eviction lease loses it within 30 s."""
        self._check_open()
        timeout = wait_timeout("run_capacity_pass", timeout)
        return self.capacity.run_pass(max_bytes, timeout)

    def clear(self) -> int:
        """Remove every block file of this tier's namespace (this rank's
        subtree, or the whole parallel-agnostic namespace; other ranks' and
        other namespaces' files stay), after waiting for in-flight jobs.
        Forgets cached lookup answers, takes the bytes off the shared usage
        count and publishes one ``BlockRemoved(keys, "cleared")`` event.
        Returns how many files it removed; a file it could not remove raises
        :class:`~fstier.errors.StorageError` naming it (after the others were
        removed)."""
        self._check_open()
        self.drain()
        errors: list[OSError] = []
        removed = self.blocks.clear(errors.append)
        self._cache.clear()
        self.capacity.add(-sum(size for _, size in removed))
        if removed:
            with self._lock:
                self._events.append(BlockRemoved(tuple(k for k, _ in removed), "cleared"))
        log.info("fstier: cleared %d block file(s) under %s", len(removed), self.mapper.blocks_dir)
        if errors:
            raise StorageError(
                f"clear: {len(errors)} file(s) under {self.mapper.blocks_dir} not removed, "
                f"first: {errors[0]}",
                errors[0].errno,
            )
        return len(removed)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Finish in-flight jobs, stop every thread, release a private pool.
        Idempotent. Results of finished jobs remain readable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.drain(timeout=self.tier_config.io_timeout_s + 5.0)
        finally:
            self.capacity.stop()
            self._io.shutdown()
            self._recency.flush()
            self._lookup.close()
            if self._own_pool is not None:
                self._own_pool.close()
            self.capacity.close()

    def __del__(self) -> None:
        # Threads are daemons; this only avoids leaking a private pool when
        # a caller forgets close(). Never raise from a finalizer.
        try:
            if not getattr(self, "_closed", True):
                log.warning("fstier: FsTier garbage-collected without close()")
        except Exception:
            pass

    def __repr__(self) -> str:
        return (
            f"FsTier(root={str(self.mapper.root)!r}, namespace={self.mapper.namespace!r}, "
            f"breaker={self._breaker.state})"
        )
