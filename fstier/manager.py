"""FsTier: the engine-facing filesystem tier. This module is its face: jobs, results,
fencing, events; its parts live in :mod:`fstier.tier` (one concept each), its files in
:mod:`fstier.io` (:class:`~fstier.io.blockstore.BlockStore`: one key <-> one file). The
engine's scheduler owns one :class:`FsTier` and never blocks in it:

- ``lookup(keys)`` counts the leading keys whose files exist (:mod:`~fstier.tier.lookup`); a key whose
  load failed is never a hit again until stored again, so a stale hit cannot livelock a request.
- ``submit_store`` / ``submit_load`` build ONE :class:`~fstier.io.engine.EngineJob` and
  submit it to this process's job engine (:mod:`fstier.io.engine`, shared by every
  namespace: a tier is a registration, not threads); ``get_finished()`` returns :class:`JobResult` records
  (:mod:`~fstier.tier.outcomes` judges them; an idle poll takes no lock). A load keeps
  its loaded *prefix*: from the first key that did not load on, keys are misses to
  recompute. A job that cannot run now (:mod:`~fstier.tier.admission`: ``degraded``,
  ``slot_busy``, ``capacity``, ``backpressure``) finishes at once with that cause.
- Fencing (:mod:`~fstier.tier.fences`): the slots of a unit running past ``io_timeout_s``
  stay fenced, here and at the slot provider, until the stuck call returns; jobs naming one
  fail ``slot_busy``. With ``hold_fenced_results=True`` (a provider that cannot stop the
  engine from reusing a slot it freed: an engine's own rows) :meth:`get_finished` holds
  back the result of a job holding a fenced slot until the slot is released.
- ``on_finished(kind)`` signals a "store"/"load" result waits in ``get_finished()``, or the engine writes
  ``notify_fds[kind]`` (a caller's eventfd; C: no Python); a caller inside its own call (SGLang) :meth:`wait` s.
- Capacity (:mod:`~fstier.tier.capacity`): with ``max_bytes``, a thread keeps the root under its high
  watermark by evicting LRU files, each told to ``on_evicted(path)`` as it goes (any namespace's).
- ``take_events()``: :class:`BlockStored` / :class:`BlockRemoved`;
  ``metrics``: a :class:`~fstier.tier.metrics.TierMetrics`.

Invariants: one :class:`~fstier.io.engine.EngineJob` record per in-flight job (``_inflight`` maps its id
to it); jobs, results, events and fences under ``FsTier._lock``; no byte a unit writes after its job was
reported reaches a later job; malformed keys and slots the caller does not hold are a ``ValueError``
(:mod:`~fstier.tier.checks`)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from fstier.clock import SYSTEM_CLOCK, Clock
from fstier.config import FstierConfig, TierConfig, load_config
from fstier.errors import ConfigError, TierClosedError
from fstier.file_mapper import FileMapper
from fstier.io import BlockStore, EngineJob, shared_engine
from fstier.keys import BlockKey
from fstier.slots.provider import SlotProvider
from fstier.tier.admission import Admission, Breaker, WriteBudget
from fstier.tier.capacity import Capacity
from fstier.tier.checks import check_keys, check_pool, known_groups, wait_timeout
from fstier.tier.fences import Fences
from fstier.tier.gc import GcReport
from fstier.tier.jobs import JobMaker, Submitter
from fstier.tier.lookup import Lookup, LookupCache
from fstier.tier.metrics import TierMetrics
from fstier.tier.outcomes import Judge
from fstier.tier.private_pool import private_pool
from fstier.tier.recency import Recency
from fstier.tier.records import BlockRemoved, BlockStored, JobResult, TierEvent, note_evicted
from fstier.tier.removal import clear_namespace, remove_blocks
from fstier.tier.results import Results
from fstier.tier.waiting import Waiters

if TYPE_CHECKING:  # pragma: no cover
    from fstier.slots.host_pool import HostBlockPool

__all__ = ["BlockRemoved", "BlockStored", "FsTier", "JobResult", "TierEvent"]

log = logging.getLogger("fstier.manager")


# --------------------------------------------------------------------- FsTier
class FsTier:
    """The filesystem tier for one (model, parallel layout, root) config.

    ``pool`` is the :class:`~fstier.slots.SlotProvider` whose slots jobs name
    (a :class:`~fstier.slots.host_pool.HostBlockPool`, or an engine's own rows);
    each slot must hold the largest file payload. A job moves exactly the
    payload's bytes of a slot, never one beyond (test_path_safety.py pins it).
    ``clock`` (:mod:`fstier.clock`) times the breaker, write budget, recency
    and I/O deadlines (tests pass a ``ManualClock``).

    ``config`` is an :class:`FstierConfig` (the namespace comes from its
    model and parallel layout), or a :class:`TierConfig` together with a
    ``mapper`` whose namespace an engine defined
    (:meth:`FileMapper.for_engine`); :attr:`config` is then ``None``."""

    def __init__(
        self,
        config: FstierConfig | TierConfig,
        pool: SlotProvider,
        mapper: FileMapper | None = None,
        *, hold_fenced_results: bool = False, clock: Clock = SYSTEM_CLOCK,
        on_finished: Callable[[str], None] | None = None,
        on_evicted: Callable[[str], None] | None = None,
        notify_fds: Mapping[str, int] | None = None,
    ) -> None:
        if isinstance(config, FstierConfig) and mapper is None:
            self.config: FstierConfig | None = config
            self.mapper, tier = FileMapper(config), config.tier
        elif isinstance(config, TierConfig) and isinstance(mapper, FileMapper):
            self.config, self.mapper, tier = None, mapper, config
        else:
            raise ConfigError(
                f"FsTier(config=..., mapper=...): expected an FstierConfig, or a TierConfig "
                f"with a FileMapper, got {type(config).__name__} and {type(mapper).__name__}; "
                "use FsTier.from_config(path) for a YAML file"
            )
        self.tier_config: TierConfig = tier
        self._pool = pool
        self._own_pool: HostBlockPool | None = None  # closed by close() (from_config)
        self._payload_len = [self.mapper.expected_payload_bytes(g) for g in range(self.mapper.num_groups)]
        check_pool(pool, max(self._payload_len))
        # One size for all groups: a job's payload sizes are a product, no loop over its keys.
        self._job_payload_len = self._payload_len[:1] if len(set(self._payload_len)) == 1 else self._payload_len
        #: key -> file end to end (namespace, directories, recovery, headers, I/O)
        self.blocks = BlockStore.for_tier(self.mapper, tier, clock)
        self.io_options = self.blocks.options
        #: which block I/O path runs (fstier.io.native): "native" or "python"
        self.io_path = self.blocks.io_path
        self.metrics = metrics = TierMetrics()
        metrics.native_io.set(1 if self.io_path.backend == "native" else 0)

        # One lock for jobs, results, events and fences (`_idle` wraps it).
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        #: job id -> its one record, from submit until its result is published
        self._inflight: dict[Hashable, EngineJob] = {}
        self._events: list[TierEvent] = []
        self._fences = Fences(pool, self._idle, metrics.fenced_slots)
        self._results = Results(self._fences, hold_fenced_results)
        self._closed = False
        self._on_finished = on_finished
        self._on_evicted_hook = on_evicted or (lambda path: None)  # capacity thread; must not raise

        # The parts (fstier.tier), each owning one concept.
        self._cache = LookupCache(tier.lookup_cache_ttl_s)
        self._breaker = Breaker(tier.breaker_failures, tier.breaker_cooldown_s, metrics, clock=clock)
        self._budget = WriteBudget(tier.max_write_queue_seconds, metrics, clock=clock)
        #: this tier's registration with the process's engine (its threads are shared)
        self._engine = shared_engine(
            tier.read_threads, tier.write_threads, clock=clock, on_complete=None if notify_fds else on_finished,
            on_released=self._fences.on_released, native_io=self.blocks.batched, notify_fds=notify_fds,
        )
        self._lookup = Lookup(self._cache, self.blocks, self.mapper.num_groups, tier.io_timeout_s,
                              breaker=self._breaker, metrics=metrics, engine=self._engine)
        self._recency = Recency(self._engine, self.blocks, clock=clock, timeout_s=tier.io_timeout_s)
        try:  # the one part here that touches the root (the shared usage count's files), so can fail
            self.capacity = Capacity(self.mapper.root, tier, metrics, on_evicted=self._on_evicted,
                                     before_pass=self._recency.flush, clock=clock)
        except BaseException:
            self._engine.close()  # else the registration, and the engine's threads, outlive the failed tier
            raise
        self._maker = JobMaker(self.blocks, pool, self._cache, tier.io_timeout_s)
        self._admission = Admission(self._breaker, self._budget, self.capacity, metrics)
        self._judge = Judge(
            blocks=self.blocks, recency=self._recency, cache=self._cache, breaker=self._breaker,
            budget=self._budget, capacity=self.capacity, metrics=metrics, payload_len=self._payload_len,
        )
        self._waiters = Waiters(self)  # FsTier.wait: woken by the engine's completion
        self._submitter = Submitter(self)  # submit_store / submit_load: checks, admission, the record, hand-over

    @classmethod
    def from_config(
        cls, config: str | os.PathLike[str] | FstierConfig, pool: SlotProvider | None = None,
        *, clock: Clock = SYSTEM_CLOCK,
    ) -> FsTier:
        """Build from a YAML path or an :class:`FstierConfig`. Without ``pool`` a private :class:`HostBlockPool`
        is created (slots of the largest payload, about 256 MiB in all) and closed by :meth:`close`."""
        cfg = config if isinstance(config, FstierConfig) else load_config(config)
        if pool is not None:
            return cls(cfg, pool, clock=clock)
        own = private_pool(cfg)  # fstier.tier.private_pool: sized from the config
        try:
            tier = cls(cfg, own, clock=clock)
        except BaseException:
            own.close()
            raise
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
        """Number of leading ``keys`` whose blocks are present (0 while
        degraded); probed as :meth:`present` does."""
        self._check_open()
        check_keys(keys, len(self._payload_len), "lookup")
        if not keys:
            return 0
        return self._lookup.lookup(keys)

    def present(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether its block is present (no prefix stop, unlike :meth:`lookup`): for engines that
        ask about keys out of order (vLLM's sliding-window scan). Bad keys are absent; cached answers are
        used and the rest probed in one call waited for at most ``io_timeout_s`` (then absent)."""
        self._check_open()
        check_keys(keys, len(self._payload_len), "present")
        if not keys:
            return []
        return self._lookup.present_counted(keys)

    # -------------------------------------------------------------------- jobs
    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError("FsTier is closed; create a new one with FsTier.from_config(...)")

    def submit_store(
        self, job_id: Hashable, keys: Sequence[BlockKey], slots: Sequence[int], *, context: Any = None
    ) -> None:
        """Queue the store of ``slots[i]`` as ``keys[i]``'s file. Never blocks;
        a job that cannot run (degraded, backpressure, fenced slot) finishes at
        once with ``success=False`` and that cause. ``context`` comes back
        untouched as the result's ``context`` (the caller keeps no job table)."""
        self._submit(job_id, "store", keys, slots, context)

    def submit_load(
        self, job_id: Hashable, keys: Sequence[BlockKey], slots: Sequence[int], *, context: Any = None
    ) -> None:
        """Queue the load of ``keys[i]``'s file into ``slots[i]``. Never blocks
        (``context`` as for :meth:`submit_store`)."""
        self._submit(job_id, "load", keys, slots, context)

    def _submit(
        self, job_id: Hashable, kind: Literal["store", "load"], keys: Sequence[BlockKey], slots: Sequence[int],
        context: Any,
    ) -> None:
        """Every job's one way in (tier/jobs.py, :class:`~fstier.tier.jobs.Submitter`: one straight line for
        the common job)."""
        self._submitter.submit(job_id, kind, keys, slots, context)

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark ``keys`` recently used (LRU recency) without a system call
        here: their mtimes are bumped by the batched recency writes. Keys
        without a file are ignored (one lock, no bytecode per key)."""
        self._check_open()
        self._recency.note_many(self.blocks.paths(known_groups(keys, len(self._payload_len))))

    def flush_recency(self) -> None:
        """Write pending hit recency to the files' mtimes now (it is otherwise
        written every few seconds and before each capacity pass), e.g. before
        running ``fstier gc`` from another process."""
        self._check_open()
        self._recency.flush()

    # -- completion --------------------------------------------------------------
    def _reap(self) -> None:
        """Turn finished engine jobs into JobResults (never blocks; no lock taken while none finished; one lock for
        all the jobs one collect returned). Fence waiters are woken by the release, not here."""
        if not self._engine.has_finished():
            return
        done = self._judge.finish_all(self._engine.collect())
        with self._lock:
            self._results.publish_jobs_locked(done, self._inflight, self._events)
            if self._waiters.asleep:  # a waiter's job may be among them
                self._idle.notify_all()

    def wait(self, job_id: Hashable, timeout: float | None = None) -> JobResult | None:
        """Job ``job_id``'s result once it finished, taken from :meth:`get_finished`; None on timeout."""
        return self._waiters.wait(job_id, wait_timeout("wait", timeout))

    def has_news(self) -> bool:
        """Whether :meth:`get_finished` or :meth:`take_events` may return something now (no lock; collects)."""
        return self._engine.poll() or bool(self._results.finished or self._results.held or self._events)

    def has_pending(self) -> bool:
        """Whether a submitted job's result was not returned yet (in flight, finished, held)."""
        with self._lock:
            return bool(self._inflight or self._results)

    def get_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call (never blocks); with ``hold_fenced_results``, a job's
        result comes once none of its slots is fenced (held results first, in the order they finished). Polled only
        when nothing is known finished (not again after has_news); :meth:`_reap` and the take under one lock."""
        known = self._engine.has_finished()  # (a registration with notify fds collects here: looked at once)
        if not (known or self._results.finished or self._results.held) and (  # nothing: the cheapest exact answer
                self._engine.pump is not None or not (known := self._engine.poll())):  # pump: has_finished collected
            return []
        done = self._judge.finish_all(self._engine.collect()) if known else ()
        with self._lock:
            if done and self._waiters.asleep:  # (notified before the publish: the waiter runs once it is released)
                self._idle.notify_all()
            return self._results.publish_jobs_locked(done, self._inflight, self._events, take=True)

    def take_events(self, reap: bool = True) -> list[TierEvent]:
        """Stored/removed events since the last call, in order (``reap=False``: of jobs reaped already only)."""
        if reap:
            self._reap()
        if not self._events:
            return []  # no lock (one read): an event added meanwhile is taken by the next call
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
            self._engine.wait_idle(left)
            self._reap()
            with self._lock:  # a recency flush the reap submitted is waited for too
                if not self._inflight and not self._engine.active:
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
        """Wait until no slot is fenced by a timed-out op (every stuck call returned); False on timeout."""
        timeout = wait_timeout("wait_fences_released", timeout)
        self._reap()
        return self._fences.wait_released(timeout)

    # ---------------------------------------------------------------- capacity
    @property
    def usage_bytes(self) -> int | None:
        """Bytes of block files under the root, counted by every instance storing into it (None before
        this instance's first scan or without ``max_bytes``)."""
        return self.capacity.usage_bytes

    def _on_evicted(self, path: str) -> None:
        self._on_evicted_hook(path)
        key = self.blocks.key_of(path)
        if key is None:
            return  # another namespace sharing the root
        self._cache.forget([key])
        with self._lock:
            note_evicted(self._events, key)  # a burst of evictions is one event

    def run_capacity_pass(self, max_bytes: int | None = None, timeout: float | None = 60.0) -> GcReport:
        """One synchronous capacity pass over the root: sweep stale temp and ``.nfs*`` files and, above the
        high watermark of ``max_bytes`` (default: ``tier.max_bytes``), evict LRU files down to the low watermark;
        resynchronise the shared usage count. Waits at most ``timeout`` s (None: no limit) for another
        instance's pass, then raises :class:`TimeoutError` (a dead or hung lease holder loses the lease within
        30 s); a pass walking at the deadline stops there (``complete=False``)."""
        self._check_open()
        timeout = wait_timeout("run_capacity_pass", timeout)
        return self.capacity.run_pass(max_bytes, timeout)

    def clear(self) -> int:
        """Remove every block file of this tier's namespace (this rank's subtree, or the
        whole parallel-agnostic namespace; other ranks' and namespaces' files stay) once
        in-flight jobs finish, keeping cache and usage in step (:mod:`~fstier.tier.removal`);
        publishes one ``BlockRemoved(keys, "cleared")`` event; how many files it removed. A
        file it could not remove raises :class:`~fstier.errors.StorageError` naming it."""
        self._check_open()
        self.drain()
        return clear_namespace(self.blocks, self._cache, self.capacity, self._cleared)

    def _cleared(self, keys: tuple[BlockKey, ...]) -> None:
        with self._lock:
            self._events.append(BlockRemoved(keys, "cleared"))

    def remove(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Remove ``keys``' files in ONE batch (:mod:`~fstier.tier.removal`: cached answers
        forgotten, usage count lowered at once); per key, whether a file went. No event."""
        self._check_open()
        check_keys(keys, len(self._payload_len), "remove")
        return remove_blocks(self.blocks, self._cache, self.capacity, self._payload_len, keys)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Finish in-flight jobs, stop every thread, release a private pool (idempotent; results stay readable)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.drain(timeout=self.tier_config.io_timeout_s + 5.0)
        finally:
            self.capacity.stop()
            self._engine.close()
            self._recency.flush()
            self._lookup.close()
            if self._own_pool is not None:
                self._own_pool.close()
            self.capacity.close()

    def __del__(self) -> None:
        # Threads are daemons: this only names a forgotten close(). Never raise here.
        try:
            if not getattr(self, "_closed", True):
                log.warning("fstier: FsTier garbage-collected without close()")
        except Exception:
            pass

    def __repr__(self) -> str:
        m = self.mapper
        return f"FsTier(root={str(m.root)!r}, namespace={m.namespace!r}, breaker={self._breaker.state})"
