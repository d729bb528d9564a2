"""Judging a finished job: every key's outcome, stores and loads alike, in
one pass driven by two tables.

- :data:`DONE`: the statuses that are a success (``STORED``, ``SKIPPED``,
  ``LOADED``) and what each counts as. A success closes the breaker.
- :data:`fstier.tier.admission.POLICY`: every other result is judged into a
  :class:`~fstier.tier.admission.Failure` family (``cancelled``, ``timeout``,
  ``miss``, ``corrupt``, ``bad_file``, ``error``), and the table says what
  follows: breaker or not, bad file or not, the failures metric's label,
  the log level.

The :class:`Verdict` of a job: its leading prefix of successes (a load keeps
its loaded prefix, the keys from the first failure on are misses to
recompute), the first failure's cause, bytes moved, the keys it wrote and
the corrupt files it removed. :meth:`Judge.finish` also does what follows
for the tier's parts: the lookup cache (stored keys present, failed loads
bad), the metrics, the shared usage count (bytes written, bytes of corrupt
files removed). The face (:mod:`fstier.manager`) turns the verdict into the
public ``JobResult`` and events.

The job is the engine's one record (:class:`~fstier.io.engine.EngineJob`):
one result per unit (a unit's list of outcomes, what it raised, or the
marker of a unit the engine gave up on). :meth:`Judge.finish` also notes
the recency of the keys loaded, or stored already (skipped), by key
(:meth:`~fstier.tier.recency.Recency.note_keys`: their paths are named at the flush).

Invariants
    A key is a success only with an outcome that says so, never by default;
    a unit the engine gave up on is judged once for all its keys.

Costs
    O(1) Python lines for a job whose engine summarised every key as one
    success (``EngineJob.uniform``: the native engine's uniform summary),
    and for a collect of several such jobs their effects once for the batch
    (:meth:`Judge.finish_all`: C-level loops over the jobs, one verdict each);
    else O(keys) per job (one status lookup per key) unless every unit
    succeeded alike (then C-level loops); a unit the engine gave up on costs O(1) plus
    its keys' slice; one breaker call per run of successes or failures; one
    recency lock; one log line per failed key whose family logs.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Sequence
from itertools import chain, compress, repeat
from operator import attrgetter, eq, mul, ne, not_, sub
from typing import NamedTuple

from fstier.io import (
    CANCELLED,
    EXPIRED,
    TIMED_OUT,
    BlockStore,
    EngineJob,
    LoadOutcome,
    LoadStatus,
    StoreOutcome,
    StoreStatus,
    block_file_size,
)
from fstier.keys import BlockKey
from fstier.tier.admission import BAD_FILE_CAUSES, Breaker, Failure, WriteBudget
from fstier.tier.capacity import Capacity
from fstier.tier.lookup import LookupCache
from fstier.tier.metrics import TierMetrics
from fstier.tier.recency import Recency

__all__ = ["DONE", "Judge", "Verdict"]

log = logging.getLogger("fstier.manager")

#: THE success table: an outcome status that is a success -> what it counts as.
DONE: dict[object, str] = {
    StoreStatus.STORED: "stored",
    StoreStatus.SKIPPED: "skipped",
    LoadStatus.LOADED: "loaded",
}


class Verdict(NamedTuple):
    """A finished job, judged: ``completed`` leading keys succeeded,
    ``failed`` did not (``cause``: the first failure's), ``nbytes`` payload
    bytes stored (every stored key) or loaded (the prefix), ``skipped``
    stores of keys already present, the keys the job wrote (``stored``),
    the corrupt files it removed (``removed``) and, for a load, the
    positions past the first failure that loaded and checked anyway
    (``loaded_after``). A named tuple: one per job,
    built without a frozen dataclass's ``__setattr__`` per field."""

    completed: int
    failed: int
    nbytes: int
    seconds: float
    cause: str | None
    skipped: int
    stored: tuple[BlockKey, ...]
    removed: tuple[BlockKey, ...]
    loaded_after: tuple[int, ...] = ()

    @property
    def success(self) -> bool:
        return self.failed == 0


_STATUS = attrgetter("status")
_UNIFORM_OF, _KEYS, _KIND = attrgetter("uniform"), attrgetter("keys"), attrgetter("kind")
_T_END, _T_SUBMIT = attrgetter("t_end"), attrgetter("t_submit")
_OUTCOME_TYPES = frozenset((StoreOutcome, LoadOutcome))


def _all_one_success(outcomes: list[object]) -> str | None:
    """What every outcome of a batch counts as (:data:`DONE`) when they are
    all outcomes of one success status, decided with C-level loops; else
    None (the caller judges key by key)."""
    if not outcomes or not _OUTCOME_TYPES.issuperset(map(type, outcomes)):
        return None
    statuses = set(map(_STATUS, outcomes))
    return DONE.get(statuses.pop()) if len(statuses) == 1 else None


def _cause_of(result: object) -> str:
    if isinstance(result, OSError):
        return errno.errorcode.get(result.errno or 0, type(result).__name__)
    return type(result).__name__


class Judge:
    """Judges finished jobs for one tier (see the module docstring)."""

    def __init__(
        self,
        *,
        blocks: BlockStore,
        recency: Recency,
        cache: LookupCache,
        breaker: Breaker,
        budget: WriteBudget,
        capacity: Capacity,
        metrics: TierMetrics,
        payload_len: Sequence[int],
    ) -> None:
        self._blocks = blocks
        self._recency = recency
        self._cache = cache
        self._breaker = breaker
        self._budget = budget
        self._capacity = capacity
        self._metrics = metrics
        self._payload_len = payload_len
        #: (payload, file) bytes of a key when every group has one payload size, else None
        self._one = (payload_len[0], block_file_size(payload_len[0])) if len(set(payload_len)) == 1 else None

    def judge(self, r: object, kind: str) -> Failure:
        """What a failed result ``r`` (one key's outcome, or what a whole
        batch raised) was: one family of the policy table."""
        if isinstance(r, LoadOutcome):
            if r.status is LoadStatus.MISSING:
                return Failure("miss", "miss", "")
            if r.status is LoadStatus.CORRUPT:
                return Failure("corrupt", f"corrupt:{r.cause}", r.detail)
            if r.cause in BAD_FILE_CAUSES:
                return Failure("bad_file", f"bad_file:{r.cause}", r.detail or r.cause)
            return Failure("error", r.cause or "load_error", r.detail)
        if isinstance(r, StoreOutcome):
            return Failure("error", r.cause or f"{kind}_failed", r.detail)
        return Failure("error", _cause_of(r), str(r))

    @staticmethod
    def _unrun(r: object) -> Failure | None:
        """A unit that never returned outcomes because the engine gave up on
        it (timed out: its slots are in ``job.fenced``; expired in the
        queue; cancelled). None when ``r`` is not such a marker."""
        if r is CANCELLED:
            return Failure("cancelled", "cancelled", "")
        if r is TIMED_OUT or r is EXPIRED:  # EXPIRED: queued past the deadline behind hung calls; never ran
            return Failure("timeout", "timeout", "")
        return None

    def _failed(self, kind: str, keys: Sequence[BlockKey], f: Failure) -> None:
        """Everything that follows from ``keys`` failing alike, as the table
        says: counted per key, the breaker told once with the count."""
        n = len(keys)
        self._metrics.failures.inc(f.label, n)
        if f.family == "corrupt":
            self._metrics.corrupt.inc(n)
        if f.counts_for_breaker:
            self._breaker.failure(f.cause, n)
        level = f.policy.log_level
        if level is None:
            return
        for key in keys:
            path = self._blocks.path(key)
            if f.family == "corrupt":
                # Warnings name the file, so an operator can go and look at it.
                log.log(level, "fstier: corrupt block file %s removed: %s %s", path, f.cause, f.detail)
            elif f.policy.bad_file:
                log.log(
                    level, "fstier: %s holds no block file (%s); a miss. Remove whatever was placed there",
                    path, f.detail,
                )
            else:
                log.log(level, "fstier: %s of %s failed: %s (%s)", kind, path, f.cause, f.detail)

    def _finish_alike(self, job: EngineJob, what: str) -> Verdict:
        """:meth:`finish` for a job whose every key succeeded alike (``what``:
        stored, skipped or loaded): the same effects, straight through, with
        no loop over its keys in Python (byte counts are products for a
        model of one payload size)."""
        self._breaker.success()
        keys, n = job.keys, len(job.keys)
        seconds = job.seconds
        if self._one is not None:  # one payload size (one KV group): products
            nbytes, files = self._one[0] * n, self._one[1] * n
        else:
            nbytes, files = sum(job.nbytes), sum(map(block_file_size, job.nbytes))
        if what == "loaded":
            self._recency.note_keys(job.keys)
            self._metrics.job_loaded(n, nbytes, 0, seconds)
            return Verdict(n, 0, nbytes, seconds, None, 0, (), ())
        self._cache.stored(keys, time.monotonic())
        if what == "skipped":  # every key was on disk already: nothing written, each one used
            self._recency.note_keys(job.keys)
            self._metrics.job_stored(0, 0, n, seconds)
            self._capacity.settle(files, 0)
            self._budget.release(files, 0)
            return Verdict(n, 0, 0, seconds, None, n, (), ())
        self._metrics.job_stored(n, nbytes, 0, seconds)
        self._capacity.settle(files, files)
        self._budget.release(files, files)
        return Verdict(n, 0, nbytes, seconds, None, 0, keys, ())

    def finish_all(self, jobs: list[EngineJob]) -> list[tuple[EngineJob, Verdict]]:
        """:meth:`finish` of each of ``jobs`` (one collect's, in the order they
        finished), with its verdict. When each is a success the engine
        summarised for every key alike (``EngineJob.uniform``) on a tier of
        one payload size, the common collect, their effects are made once
        for the batch (:meth:`_finish_batch`); else job by job, in order."""
        if len(jobs) == 1:  # the common collect of a polling caller: no comprehension, a uniform success straight
            job, what = jobs[0], None if jobs[0].uniform is None else DONE.get(jobs[0].uniform.status)
            return [(job, self.finish(job) if what is None else self._finish_alike(job, what))]
        if not jobs or self._one is None or not all(map(_UNIFORM_OF, jobs)):
            return [(job, self.finish(job)) for job in jobs]
        return self._finish_batch(jobs)

    def _finish_batch(self, jobs: list[EngineJob]) -> list[tuple[EngineJob, Verdict]]:
        """:meth:`_finish_alike` of every job of a batch with its effects made
        once: the breaker told one success, the lookup cache one insert of
        every stored or skipped key, one recency note of the keys used
        (loaded, or skipped as present), the metrics one list extend (each
        job's counts and seconds: ``TierMetrics.jobs_noted``), capacity and the write budget one settle of the
        stores' bytes. C-level loops over the jobs, and one verdict each."""
        payload, file = self._one  # type: ignore[misc]  # finish_all: a tier of one payload size
        whats = list(map(DONE.__getitem__, map(_STATUS, map(_UNIFORM_OF, jobs))))
        counts = list(map(len, map(_KEYS, jobs)))
        seconds = list(map(max, repeat(0.0), map(sub, map(_T_END, jobs), map(_T_SUBMIT, jobs))))
        stores = list(map(eq, map(_KIND, jobs), repeat("store")))
        stored = sum(compress(counts, map(eq, whats, repeat("stored"))))
        skipped = sum(compress(counts, map(eq, whats, repeat("skipped"))))
        self._breaker.success()
        used = list(chain.from_iterable(map(_KEYS, compress(jobs, map(ne, whats, repeat("stored"))))))
        if used:
            self._recency.note_keys(used)
        if any(stores):
            self._cache.stored(list(chain.from_iterable(map(_KEYS, compress(jobs, stores)))), time.monotonic())
            self._capacity.settle(file * (stored + skipped), file * stored)
            self._budget.release(file * (stored + skipped), file * stored)
        skips = list(map(eq, whats, repeat("skipped")))
        blocks = list(map(mul, counts, map(not_, skips)))  # a skipped store moved no file, no byte
        moved, skipped_each = list(map(mul, repeat(payload), blocks)), list(map(mul, counts, skips))
        self._metrics.jobs_noted(list(zip(stores, blocks, moved, skipped_each, seconds, strict=True)))
        wrote = [job.keys if w == "stored" else () for job, w in zip(jobs, whats, strict=True)]
        verdicts = map(Verdict, counts, repeat(0), moved, seconds, repeat(None), skipped_each, wrote, repeat(()))
        return list(zip(jobs, verdicts, strict=True))

    def _note_recency(self, job: EngineJob, hits: list[int]) -> None:
        """Keys a load loaded, or a store found present already, were used:
        their files' recency (one lock; all of a job's keys when all hit)."""
        if not hits:
            return
        keys = job.keys
        self._recency.note_keys(keys if len(hits) == len(keys) else [keys[i] for i in hits])

    def finish(self, job: EngineJob) -> Verdict:
        """Judge ``job.results`` (one per unit: the unit's list of outcomes,
        or what stands for all its keys) and do what follows. A unit the
        engine gave up on is judged once; the breaker hears each run of
        successes once, failures with their count, in key order. A job the
        engine summarised as one success for every key (``job.uniform``), or
        whose one unit's outcomes are all one success, is judged in O(1)
        lines (:meth:`_finish_alike`)."""
        if job.uniform is not None and (what := DONE.get(job.uniform.status)) is not None:
            return self._finish_alike(job, what)  # the engine's uniform success: the straight line
        if len(job.results) == 1 and isinstance(job.results[0], list):
            # One unit of every key (a batched job on the Python engine): alike when its outcomes are.
            what = _all_one_success(job.results[0]) if len(job.results[0]) == len(job.keys) else None
            if what is not None:
                return self._finish_alike(job, what)
        now = time.monotonic()
        done: dict[str, list[int]] = {"stored": [], "skipped": [], "loaded": []}
        failed: list[int] = []
        removed: list[BlockKey] = []
        cause: str | None = None
        keys_all, kind = job.keys, job.kind
        ok_run = False
        for j, r in enumerate(job.results):
            span = job.unit_keys(j)
            if isinstance(r, list) and len(r) == len(span):
                what = _all_one_success(r)
                if what is not None:  # the common batch: judged without a loop over its keys
                    done[what].extend(span)
                    ok_run = True
                    continue
                for i, o in zip(span, r, strict=True):
                    what = DONE.get(o.status) if isinstance(o, StoreOutcome | LoadOutcome) else None
                    if what is not None:
                        done[what].append(i)
                        ok_run = True
                        continue
                    if ok_run:
                        self._breaker.success()
                        ok_run = False
                    f = self.judge(o, kind)
                    failed.append(i)
                    if cause is None:
                        cause = f.cause
                    if f.family == "corrupt" and isinstance(o, LoadOutcome) and o.removed:
                        removed.append(keys_all[i])
                    self._failed(kind, (keys_all[i],), f)
                continue
            if ok_run:
                self._breaker.success()
                ok_run = False
            f = self._unrun(r) or self.judge(r, kind)
            failed.extend(span)
            if cause is None:
                cause = f.cause
            self._failed(kind, keys_all[span.start : span.stop], f)
        if ok_run:
            self._breaker.success()
        n = len(keys_all)
        prefix = failed[0] if failed else n
        keys, m = job.keys, self._metrics
        seconds = job.seconds
        op_bytes = job.nbytes
        # One payload size for the whole job (one KV group): byte counts are
        # products, not sums over keys.
        each = op_bytes[0] if op_bytes.count(op_bytes[0]) == len(op_bytes) else None
        self._note_recency(job, done["skipped"] if job.kind == "store" else done["loaded"])
        if job.kind == "store":
            ok = done["stored"]
            stored = tuple(keys[i] for i in ok) if len(ok) < n else keys
            if each is not None:
                nbytes = each * len(ok)
                reserved, written = block_file_size(each) * n, block_file_size(each) * len(ok)
            else:
                nbytes = sum(op_bytes[i] for i in ok)
                reserved = sum(block_file_size(b) for b in op_bytes)
                written = sum(block_file_size(op_bytes[i]) for i in ok)
            self._cache.stored([*stored, *(keys[i] for i in done["skipped"])], now)
            m.job_stored(len(stored), nbytes, len(done["skipped"]), seconds)
            # Admission counted the whole job (Admission.refuse): give back
            # what was not stored (skipped, failed); its reservation leaves the write budget.
            self._capacity.settle(reserved, written)
            self._budget.release(reserved, written)
        else:
            stored = ()
            nbytes = each * prefix if each is not None else sum(op_bytes[:prefix])
            if failed:
                self._cache.mark_bad([keys[i] for i in failed])
            if removed:
                self._capacity.add(-sum(block_file_size(self._payload_len[k.group_idx]) for k in removed))
            m.job_loaded(prefix, nbytes, n - prefix, seconds)
        # A load's keys past the first failure that loaded and checked anyway
        # (their bytes are in their slots): only built when a key failed.
        after = tuple(i for i in done["loaded"] if i > prefix) if failed and job.kind == "load" else ()
        return Verdict(
            prefix, n - prefix, nbytes, seconds, cause, len(done["skipped"]), stored, tuple(removed), after
        )
