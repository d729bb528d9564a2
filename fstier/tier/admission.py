"""Admission: whether the tier takes a job now, and what a failure means.

- :class:`Breaker`: ``breaker_failures`` consecutive failures that say the
  device or mount is failing (:data:`DEVICE_CAUSES`) open it for
  ``breaker_cooldown_s`` (lookups miss, stores drop, loads fail fast); then
  half-open: a success closes it, a failure reopens it. Each transition is
  logged once.
- :class:`WriteBudget`: backpressure. Queued store bytes are bounded by
  ``max_write_queue_seconds`` of work at an EMA of the measured write speed;
  beyond it, stores drop (a future miss, never a blocked caller).
- :data:`BAD_FILE_CAUSES`: what at a block path is not a block file (a miss
  with cause ``bad_file:<why>``, never a breaker failure).
- :data:`POLICY`: the one table from a failure's family to what follows
  (breaker? bad file? metric label, log level); FsTier judges every failed
  op through it (:class:`Failure`).
- :class:`Admission`: whether a job runs now; the refusals, in order:
  ``degraded`` (breaker open), ``slot_busy`` (a slot is fenced),
  ``capacity`` (a store while the root is over ``max_bytes``, or above the
  high watermark with the job's own bytes taking it over:
  :meth:`~fstier.tier.capacity.Capacity.root_full`),
  ``backpressure`` (a store over the write budget). Each is counted (stores
  as drops, loads as failures) and the job finishes at once with that cause.
  A job first meets one fast check (:meth:`Admission.clear`, then
  :meth:`Admission.take`: breaker closed with no failure counted, no
  ``max_bytes``, room in the budget); only a job failing it takes the full
  :meth:`Admission.refuse`. The write budget keeps the queued-bytes gauge's
  value itself (read on demand: no gauge call per job).

Every call takes one lock and does O(1) work.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fstier.clock import SYSTEM_CLOCK, Clock
from fstier.tier.metrics import TierMetrics

if TYPE_CHECKING:  # pragma: no cover
    from fstier.io import EngineJob
    from fstier.tier.capacity import Capacity

__all__ = [
    "BAD_FILE_CAUSES", "DEVICE_CAUSES", "POLICY", "Admission", "Breaker", "Failure", "Policy", "WriteBudget",
]

log = logging.getLogger("fstier.manager")

#: Prior write speed before the first measurement (bytes/s). Conservative for
#: NVMe (docs/architecture.md, "Facts of the machines": ~1.6 GB/s for new
#: files) so an initial flood is
#: bounded before any store has completed.
_PRIOR_WRITE_BPS = 512e6
_EMA_ALPHA = 0.2
#: A busy period shorter than this is folded into the next sample (timer noise).
_MIN_SAMPLE_S = 0.005


class Breaker:
    """Consecutive-failure circuit breaker: closed -> open (cool-down) ->
    half-open -> closed on a success, open again on a failure."""

    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

    def __init__(
        self, threshold: int, cooldown_s: float, metrics: TierMetrics, *, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._metrics = metrics
        self._clock = clock
        self._state = self.CLOSED
        self._failures = 0
        self._open_until = 0.0
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        with self._lock:
            self._tick(self._clock.monotonic())
            return self._state

    def _tick(self, now: float) -> None:
        if self._state == self.OPEN and now >= self._open_until:
            self._state = self.HALF_OPEN
            log.warning("fstier: circuit breaker half-open; probing the tier again")

    def allow(self) -> bool:
        """False while open (degraded)."""
        if self._state == self.CLOSED:
            return True  # a healthy tier takes no lock (a failure racing this admits as if it came after)
        with self._lock:
            self._tick(self._clock.monotonic())
            return self._state != self.OPEN

    @property
    def healthy(self) -> bool:
        """Closed with no failure counted (no lock: a read a submit makes to
        know no finished job can change the breaker's answer)."""
        return self._state == self.CLOSED and self._failures == 0

    def success(self) -> None:
        if self._failures == 0 and self._state == self.CLOSED:
            return  # nothing to reset (a job's success on a healthy tier takes no lock)
        with self._lock:
            self._failures = 0
            if self._state != self.CLOSED:
                self._state = self.CLOSED
                self._metrics.degraded.set(0)
                log.warning("fstier: circuit breaker closed; the tier recovered")

    def failure(self, cause: str, count: int = 1) -> None:
        """``count`` consecutive failures (the keys of one batch), as that
        many calls would record them."""
        with self._lock:
            now = self._clock.monotonic()
            self._tick(now)
            self._failures += count
            if self._state == self.HALF_OPEN or (
                self._state == self.CLOSED and self._failures >= self.threshold
            ):
                self._state = self.OPEN
                self._open_until = now + self.cooldown_s
                self._metrics.breaker_trips.inc()
                self._metrics.degraded.set(1)
                log.error(
                    "fstier: circuit breaker open after %d consecutive I/O failure(s) (last: %s); "
                    "tier degraded for %.1fs (lookups miss, stores drop, loads fail fast)",
                    self._failures, cause, self.cooldown_s,
                )


class WriteBudget:
    """Backpressure: queued store bytes versus an EMA of the write speed.

    The speed sample is bytes completed over the wall time during which the
    write queue was non-empty, so it measures the pool's aggregate throughput
    whatever the number of writer threads and jobs in flight."""

    def __init__(self, max_queue_s: float, metrics: TierMetrics, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.max_queue_s = max_queue_s
        self._metrics = metrics
        self._clock = clock
        self.speed = _PRIOR_WRITE_BPS
        self._measured = False
        self.queued = 0
        self._busy_since = 0.0
        self._busy_bytes = 0
        self._lock = threading.Lock()
        #: changes of ``queued`` (the queued-bytes gauge reads both on demand: no gauge call per job)
        self._changes = 0
        #: changes of ``speed`` (its gauge reads both on demand: no gauge call per sample); 1: the prior's
        self._speed_changes = 1
        metrics.write_speed.bind(self._speed_gauge)
        metrics.queued_store_bytes.bind(self._queued_gauge)

    def _speed_gauge(self) -> tuple[float, int]:
        """``(speed, changes)`` for the ``fstier_write_bytes_per_second`` gauge."""
        return self.speed, self._speed_changes

    def _queued_gauge(self) -> tuple[float, int]:
        """``(queued bytes, changes)`` for the ``fstier_queued_store_bytes`` gauge."""
        return float(self.queued), self._changes

    def fits(self, nbytes: int) -> bool:
        """Whether :meth:`admit` would take ``nbytes`` now (no lock: a hint)."""
        return self.queued == 0 or self.queued + nbytes <= self.max_queue_s * self.speed

    def admit(self, nbytes: int, job: EngineJob) -> bool:
        """Reserve ``nbytes`` if they fit; an idle queue always admits (a job
        bigger than the budget must still be storable). ``job.reserved`` is
        set to ``nbytes`` by the statement that reserves them (no call, no
        backward jump between the two stores: no signal handler runs there),
        so a submit interrupted anywhere gives back exactly what it reserved."""
        with self._lock:
            if self.queued > 0 and self.queued + nbytes > self.max_queue_s * self.speed:
                return False
            if self.queued == 0:
                self._busy_since, self._busy_bytes = self._clock.monotonic(), 0
            # ONE statement: the reservation, its mark on the record, the gauge's change count
            self.queued, job.reserved, self._changes = self.queued + nbytes, nbytes, self._changes + (nbytes > 0)
            return True

    def release(self, reserved: int, written: int) -> None:
        """An op ended: ``reserved`` bytes leave the queue, ``written`` count
        toward the speed sample."""
        with self._lock:
            queued = self.queued = max(0, self.queued - reserved)
            busy = self._busy_bytes = self._busy_bytes + written
            now = self._clock.monotonic()
            elapsed = now - self._busy_since
            if busy > 0 and elapsed >= _MIN_SAMPLE_S and (queued == 0 or elapsed >= 0.25):
                # The first measurement replaces the prior outright: a slow
                # mount must not hide behind an optimistic guess for long.
                sample = busy / elapsed
                speed = (1 - _EMA_ALPHA) * self.speed + _EMA_ALPHA * sample if self._measured else sample
                self._speed_changes += speed != self.speed  # the speed gauge reads both on demand
                self.speed, self._measured, self._busy_since, self._busy_bytes = speed, True, now, 0
            elif queued == 0 and busy == 0:
                self._busy_since = now
            self._changes += reserved > 0


#: Causes that say the device or mount is failing: only these count toward
#: the circuit breaker. Anything about one file (a FIFO, socket or directory
#: planted at a block path, a permission, a name) is that file's problem: the
#: key is a miss, and the tier keeps serving every other key (eight planted
#: FIFOs used to degrade the whole tier:
#: test_planted_non_regular_files_are_misses_not_breaker_failures). A full disk (ENOSPC,
#: EDQUOT) is not failing either: loads still work and eviction frees space.
DEVICE_CAUSES = frozenset({
    "timeout", "EIO", "EROFS", "ESTALE", "ENOTCONN", "ENODEV", "ENOMEDIUM", "ESHUTDOWN",
    "ETIMEDOUT", "EHOSTDOWN", "EHOSTUNREACH", "ENETDOWN", "ENETUNREACH", "ENETRESET",
    "ECONNREFUSED", "ECONNRESET", "ECONNABORTED", "ENOLINK", "EREMOTEIO", "EUCLEAN",
})
#: Load errors that mean "what is at the block path is not a block file":
#: ``not_regular`` (a FIFO or directory: fstat says so), ENXIO (a socket
#: refuses open), EISDIR, ENOTDIR (a file planted where a fan-out directory
#: belongs). They are bad files: a miss with cause ``bad_file:<why>``.
BAD_FILE_CAUSES = frozenset({"not_regular", "ENXIO", "EISDIR", "ENOTDIR"})


# ------------------------------------------------------- what a failure means
@dataclass(frozen=True, slots=True)
class Policy:
    """What follows from one family of failed ops: whether its raw cause
    may count toward the breaker (only causes in :data:`DEVICE_CAUSES` do),
    whether what is at the block path is not a block file, the metric label
    and the log level (``None``: not logged per op)."""

    breaker: bool
    bad_file: bool
    label: str
    log_level: int | None


#: THE table, failure family -> what follows. A job result's cause is the
#: family (``timeout``, ``miss``, ``cancelled``) or ``family:why`` (``corrupt:
#: payload_checksum``, ``bad_file:ENXIO``) or, for ``error``, the errno name.
POLICY: dict[str, Policy] = {
    "cancelled": Policy(breaker=False, bad_file=False, label="cancelled", log_level=None),
    "timeout": Policy(breaker=True, bad_file=False, label="timeout", log_level=None),
    "miss": Policy(breaker=False, bad_file=False, label="miss", log_level=None),
    "corrupt": Policy(breaker=False, bad_file=False, label="corrupt", log_level=logging.WARNING),
    "bad_file": Policy(breaker=False, bad_file=True, label="bad_file", log_level=logging.WARNING),
    "error": Policy(breaker=True, bad_file=False, label="", log_level=logging.WARNING),
}


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed op, judged: its family's :class:`Policy`, the cause a job
    result reports, whether the breaker counts it, and a detail for the log."""

    family: str
    cause: str
    detail: str

    @property
    def policy(self) -> Policy:
        return POLICY[self.family]

    @property
    def label(self) -> str:
        """The failures metric's label."""
        return self.policy.label or self.cause

    @property
    def counts_for_breaker(self) -> bool:
        raw = self.cause.rpartition(":")[2]
        return self.policy.breaker and raw in DEVICE_CAUSES


# ------------------------------------------------------------- whether a job runs
class Admission:
    """Whether the tier takes a job now (see the module docstring)."""

    def __init__(self, breaker: Breaker, budget: WriteBudget, capacity: Capacity, metrics: TierMetrics) -> None:
        self._breaker = breaker
        self._budget = budget
        self._capacity = capacity
        self._metrics = metrics

    def clear(self, kind: str, nbytes: int) -> bool:
        """Whether a job is admitted by the fast check (no lock, no count):
        the breaker closed with no failure counted and, for a store of
        ``nbytes``, no ``max_bytes`` and room in the write budget. True: the
        tier takes it with :meth:`take` (no slot fenced either); False: the
        full decision, :meth:`refuse`."""
        return self._breaker.healthy and (
            kind != "store" or (self._capacity.max_bytes is None and self._budget.fits(nbytes))
        )

    def take(self, kind: str, nbytes: int, job: EngineJob) -> bool:
        """After :meth:`clear` said True, under the tier's lock: take the job
        (a store's ``nbytes`` reserved in the write budget, as :meth:`refuse`
        would, and marked on ``job.reserved`` (:meth:`WriteBudget.admit`); no
        ``max_bytes``, so nothing to count in the root's usage).
        False (nothing reserved) when the budget filled meanwhile: the
        caller then asks :meth:`refuse`."""
        return kind != "store" or self._budget.admit(nbytes, job)

    def give_back(self, kind: str, reserved: int, counted: int) -> None:
        """A job :meth:`take` or :meth:`refuse` admitted, or began to, never
        reached the engine (its submit raised): a store's ``reserved`` bytes
        leave the write budget and its ``counted`` ones the root's count
        (nothing of them was written)."""
        if kind == "store":
            self._capacity.settle(counted, 0)
            self._budget.release(reserved, 0)

    def refuse(self, kind: str, n: int, nbytes: int, job: EngineJob, *, slot_busy: bool) -> str | None:
        """None when a job of ``n`` keys runs (a store's ``nbytes`` of files
        are then reserved in the write budget, marked on ``job.reserved``),
        else the cause it fails with at once, counted."""
        if not self._breaker.allow():
            cause = "degraded"
        elif slot_busy:
            self._metrics.failures.inc("slot_busy", n)
            return "slot_busy"
        elif kind != "store":
            return None
        elif not self._capacity.try_reserve(nbytes, job):  # counted: marked on job.counted
            # The job would take the root over max_bytes (counted across
            # every instance on it) and eviction has not caught up: drop, as
            # backpressure does. A future miss, never data loss, never a
            # blocked caller. Admitted, it is counted in the root's shared
            # usage from then on, before a byte is written, so every
            # instance sees stores in flight (five writers on one root
            # peaked at 1.23x max_bytes before; what is not stored is given
            # back when the job ends).
            self._capacity.wake()
            cause = "capacity"
        elif not self._budget.admit(nbytes, job):
            counted, job.counted = job.counted, 0
            self._capacity.settle(counted, 0)  # counted above: given back
            cause = "backpressure"
        else:
            return None
        (self._metrics.drops if kind == "store" else self._metrics.failures).inc(cause, n)
        return cause

