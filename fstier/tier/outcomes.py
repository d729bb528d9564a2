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

Invariants
    A timed-out op's slot is handed to ``on_timed_out`` (the face fences it)
    before the job's result can be published; a key is a success only with
    an outcome that says so, never by default.

Costs
    O(keys) per job, one breaker call per key, one log line per failed key
    whose family logs.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fstier.io.blockfile import block_file_size
from fstier.io.blockstore import BlockStore
from fstier.io.iotypes import LoadOutcome, LoadStatus, StoreOutcome, StoreStatus
from fstier.io.pool import OP_CANCELLED, OP_EXPIRED, OP_TIMED_OUT
from fstier.keys import BlockKey
from fstier.tier.admission import BAD_FILE_CAUSES, Breaker, Failure
from fstier.tier.capacity import Capacity
from fstier.tier.jobs import Job, JobOps
from fstier.tier.lookup import LookupCache
from fstier.tier.metrics import TierMetrics

__all__ = ["DONE", "Judge", "Verdict"]

log = logging.getLogger("fstier.manager")

#: THE success table: an outcome status that is a success -> what it counts as.
DONE: dict[object, str] = {
    StoreStatus.STORED: "stored",
    StoreStatus.SKIPPED: "skipped",
    LoadStatus.LOADED: "loaded",
}


@dataclass(frozen=True, slots=True)
class Verdict:
    """A finished job, judged: ``completed`` leading keys succeeded,
    ``failed`` did not (``cause``: the first failure's), ``nbytes`` payload
    bytes stored (every stored key) or loaded (the prefix), ``skipped``
    stores of keys already present, the keys the job wrote (``stored``) and
    the corrupt files it removed (``removed``)."""

    completed: int
    failed: int
    nbytes: int
    seconds: float
    cause: str | None
    skipped: int
    stored: tuple[BlockKey, ...]
    removed: tuple[BlockKey, ...]

    @property
    def success(self) -> bool:
        return self.failed == 0


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
        ops: JobOps,
        cache: LookupCache,
        breaker: Breaker,
        capacity: Capacity,
        metrics: TierMetrics,
        payload_len: Sequence[int],
        on_timed_out: Callable[[Job, int], None],
    ) -> None:
        self._blocks = blocks
        self._ops = ops
        self._cache = cache
        self._breaker = breaker
        self._capacity = capacity
        self._metrics = metrics
        self._payload_len = payload_len
        self._on_timed_out = on_timed_out

    def judge(self, job: Job, i: int, r: object) -> Failure:
        """What a failed result ``r`` of key ``i`` of ``job`` was: one family
        of the policy table."""
        if r is OP_CANCELLED:
            return Failure("cancelled", "cancelled", "")
        if r is OP_TIMED_OUT:
            self._ops.ended(job, i, [0], finished=False)
            self._on_timed_out(job, i)
            return Failure("timeout", "timeout", "")
        if r is OP_EXPIRED:  # queued past the job's deadline behind hung calls; never ran
            self._ops.ended(job, i, [0])
            return Failure("timeout", "timeout", "")
        if isinstance(r, LoadOutcome):
            if r.status is LoadStatus.MISSING:
                return Failure("miss", "miss", "")
            if r.status is LoadStatus.CORRUPT:
                return Failure("corrupt", f"corrupt:{r.cause}", r.detail)
            if r.cause in BAD_FILE_CAUSES:
                return Failure("bad_file", f"bad_file:{r.cause}", r.detail or r.cause)
            return Failure("error", r.cause or "load_error", r.detail)
        if isinstance(r, StoreOutcome):
            return Failure("error", r.cause or f"{job.kind}_failed", r.detail)
        return Failure("error", _cause_of(r), str(r))

    def _failed(self, kind: str, key: BlockKey, f: Failure) -> None:
        """Everything that follows from one failed key, as the table says."""
        self._metrics.failures.inc(f.label)
        if f.family == "corrupt":
            self._metrics.corrupt.inc()
        if f.counts_for_breaker:
            self._breaker.failure(f.cause)
        level = f.policy.log_level
        if level is None:
            return
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

    def finish(self, job: Job, results: Sequence[object]) -> Verdict:
        """Judge ``results`` (one per key of ``job``) and do what follows."""
        now = time.monotonic()
        done: dict[str, list[int]] = {"stored": [], "skipped": [], "loaded": []}
        failed: list[int] = []
        removed: list[BlockKey] = []
        cause: str | None = None
        for i, r in enumerate(results):
            what = DONE.get(r.status) if isinstance(r, StoreOutcome | LoadOutcome) else None
            if what is not None:
                done[what].append(i)
                self._breaker.success()
                continue
            f = self.judge(job, i, r)
            failed.append(i)
            if cause is None:
                cause = f.cause
            if f.family == "corrupt" and isinstance(r, LoadOutcome) and r.removed:
                removed.append(job.keys[i])
            self._failed(job.kind, job.keys[i], f)
        n = len(results)
        prefix = failed[0] if failed else n
        keys, m = job.keys, self._metrics
        seconds = self._ops.seconds(job)
        if job.kind == "store":
            stored = tuple(keys[i] for i in done["stored"])
            nbytes = sum(job.op_bytes[i] for i in done["stored"])
            self._cache.stored([*stored, *(keys[i] for i in done["skipped"])], now)
            m.stored_blocks.inc(len(stored))
            m.stored_bytes.inc(nbytes)
            m.skipped_blocks.inc(len(done["skipped"]))
            m.store_seconds.observe(seconds)
            # Admission counted the whole job (Admission.refuse): give back
            # what was not stored (skipped, failed).
            self._capacity.settle(
                sum(block_file_size(b) for b in job.op_bytes),
                sum(block_file_size(job.op_bytes[i]) for i in done["stored"]),
            )
        else:
            stored = ()
            nbytes = sum(job.op_bytes[:prefix])
            if failed:
                self._cache.mark_bad([keys[i] for i in failed])
            if removed:
                self._capacity.add(-sum(block_file_size(self._payload_len[k.group_idx]) for k in removed))
            m.loaded_blocks.inc(prefix)
            m.loaded_bytes.inc(nbytes)
            m.load_misses.inc(n - prefix)
            m.load_seconds.observe(seconds)
        return Verdict(prefix, n - prefix, nbytes, seconds, cause, len(done["skipped"]), stored, tuple(removed))
