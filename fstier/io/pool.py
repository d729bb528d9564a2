"""A dual-queue I/O thread pool with per-operation deadlines.

A job is a list of operations (zero-argument callables; FsTier's are one
batch of :meth:`~fstier.io.blockstore.BlockStore.store_many` /
``load_many`` each: a range of keys in one GIL-free call on the native
backend, one key on the Python backend). Each operation is queued separately, so
the operations of one job are spread across threads and run in parallel.

- Two queues, ``read`` and ``write``. Read-priority threads take from the
  read queue first and from the write queue only when it is empty;
  write-priority threads do the reverse. Loads (which an engine waits for)
  are never stuck behind a burst of stores, and stores never starve.
- One :class:`_Job` record per job, and every piece of shared state, lives
  under one lock. ``submit`` and ``get_finished`` never block on I/O.
- Deadlines: a job's deadline is its submission + ``io_timeout_s``. A
  watchdog marks an operation still running at its job's deadline as
  :data:`OP_TIMED_OUT`; its job completes without it. An operation still
  *queued* then (every thread stuck on a hung mount, and each replacement
  thread stuck too) is taken off the queue unrun as :data:`OP_EXPIRED`. So
  every job ends within ``io_timeout_s`` of its submission plus the
  watchdog's wake-up, however many operations queue behind hung ones
  (measured from each op's own start, a job queued behind hung calls took
  up to twice the timeout, or one timeout per queued op). The
  thread stuck in the call (a hung NFS syscall cannot be interrupted) is
  counted in :attr:`IOPool.stuck_threads` and a replacement thread is started.
  When the stuck call finally returns, its result is dropped and the
  ``on_late(job_id, op_index)`` callbacks fire, so the owner can release the
  buffer that the late call may still have been writing into.
- ``on_complete(kind)`` (optional) is called once each job is published, so
  that a caller woken by it finds the job in :meth:`IOPool.get_finished`
  (unless another caller took it first); from a worker, after the pool's
  lock is released, so the woken caller's ``get_finished`` never waits for
  the lock of a worker that is still signalling
  (test_lmcache_seam.py::test_iopool_on_complete_runs_once_the_job_is_published),
  and again (no lock held) after a timed-out
  op's late return and its ``on_late`` callbacks, when an owner may release
  a result it held back. It must only signal (an eventfd write, a
  Condition's notify), never block or call back into the pool.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fstier.clock import SYSTEM_CLOCK, Clock
from fstier.errors import IOPoolClosedError

__all__ = ["OP_CANCELLED", "OP_EXPIRED", "OP_TIMED_OUT", "IOPool", "LateCallback", "PoolJob"]

log = logging.getLogger("fstier.io")

LateCallback = Callable[[Hashable, int], None]


def _without_traceback(exc: BaseException) -> BaseException:
    """``exc`` with no traceback on it or on its causes. A kept traceback
    holds the op's frames, and with them every buffer view they held (an
    engine's rows): the engine could not unmap its memory at shutdown
    ("buffers are still exported") until a garbage collection, because
    the traceback also reaches the frame that stored ``exc`` (a cycle)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return exc


class _Marker:
    """A named sentinel placed in ``PoolJob.results``."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name

    def __reduce__(self) -> str:
        return self._name


#: The operation ran past ``io_timeout_s``; its late result is dropped.
OP_TIMED_OUT = _Marker("OP_TIMED_OUT")
#: The operation was still queued when the pool shut down.
OP_CANCELLED = _Marker("OP_CANCELLED")
#: The operation was still queued ``io_timeout_s`` after its job's
#: submission; it never ran (no buffer is touched by it, now or later).
OP_EXPIRED = _Marker("OP_EXPIRED")
_PENDING = _Marker("_PENDING")

_KINDS = ("read", "write")


@dataclass(frozen=True, slots=True)
class PoolJob:
    """A finished job: ``results[i]`` is operation i's return value, the
    exception it raised, :data:`OP_TIMED_OUT`, :data:`OP_EXPIRED` or :data:`OP_CANCELLED`."""

    job_id: Hashable
    kind: str
    results: list[Any]
    seconds: float

    @property
    def ok(self) -> bool:
        """True when every operation ran and returned: none raised, timed out, expired unrun or was cancelled."""
        return not any(isinstance(r, _Marker | BaseException) for r in self.results)


@dataclass(slots=True)
class _Job:
    """The one record of an in-flight job (guarded by ``IOPool._lock``)."""

    job_id: Hashable
    kind: str
    ops: list[Callable[[], Any]]
    results: list[Any]
    remaining: int
    started: float
    on_done: Callable[[PoolJob], None] | None


@dataclass(slots=True)
class _Running:
    """One operation currently executing on a worker thread."""

    job: _Job
    index: int
    deadline: float
    worker: _Worker
    timed_out: bool = False


@dataclass(slots=True, eq=False)
class _Worker:
    priority: str
    thread: threading.Thread | None = None
    retired: bool = False
    running: _Running | None = field(default=None, repr=False)


class IOPool:
    """Read- and write-priority I/O threads; see the module docstring."""

    def __init__(
        self,
        read_threads: int,
        write_threads: int,
        io_timeout_s: float | None = 30.0,
        *,
        on_late: LateCallback | None = None,
        on_complete: Callable[[str], None] | None = None,
        name: str = "fstier-io",
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if read_threads < 1 or write_threads < 1:
            raise ValueError(
                f"IOPool needs read_threads >= 1 and write_threads >= 1, got "
                f"{read_threads} and {write_threads}"
            )
        # inf or nan would make the watchdog's wait raise and the thread die,
        # silently disabling every deadline (test_pool.py::test_io_timeout_must_be_finite).
        if io_timeout_s is not None and not (0 < io_timeout_s <= threading.TIMEOUT_MAX):
            raise ValueError(
                f"IOPool io_timeout_s must be > 0 and finite (or None for no deadline), "
                f"got {io_timeout_s}"
            )
        self.io_timeout_s = io_timeout_s
        #: threads per queue (callers cut jobs into this many batches)
        self.read_threads = read_threads
        self.write_threads = write_threads
        self._clock = clock  # deadlines and the watchdog's waits (tests: a ManualClock)
        self._name = name
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # workers wait here
        self._idle = threading.Condition(self._lock)  # wait_idle waits here
        self._tick = threading.Condition(self._lock)  # the watchdog waits here
        #: when the waiting watchdog wakes by itself (this clock; -inf: it is
        #: not waiting, so it scans again before it does)
        self._watch_at = -math.inf
        self._queues: dict[str, deque[tuple[_Job, int]]] = {k: deque() for k in _KINDS}
        self._workers: list[_Worker] = []
        self._finished: list[PoolJob] = []
        self._late_callbacks: list[LateCallback] = [on_late] if on_late else []
        self._on_complete = on_complete
        self._active_jobs = 0
        self._stuck = 0
        self._timeouts = 0
        self._closed = False
        self._seq = 0
        with self._lock:
            for _ in range(read_threads):
                self._spawn("read")
            for _ in range(write_threads):
                self._spawn("write")
        self._watchdog: threading.Thread | None = None
        if io_timeout_s is not None:
            self._watchdog = threading.Thread(
                target=self._watch, name=f"{name}-watchdog", daemon=True
            )
            self._watchdog.start()

    # ------------------------------------------------------------ public
    def on_late(self, callback: LateCallback) -> LateCallback:
        """Register ``callback(job_id, op_index)``, called (from the returning
        thread) when a timed-out operation finally returns. Returns it."""
        with self._lock:
            self._late_callbacks.append(callback)
        return callback

    def submit(
        self,
        job_id: Hashable,
        kind: str,
        ops: Sequence[Callable[[], Any]],
        *,
        on_done: Callable[[PoolJob], None] | None = None,
    ) -> None:
        """Queue a job; never blocks. The finished job is returned by
        :meth:`get_finished`, or passed to ``on_done`` instead when given
        (called from a pool thread; it must not block)."""
        if kind not in _KINDS:
            raise ValueError(f"IOPool.submit kind must be 'read' or 'write', got {kind!r}")
        ops = list(ops)
        job = _Job(job_id, kind, ops, [_PENDING] * len(ops), len(ops), self._clock.monotonic(), on_done)
        done: PoolJob | None = None
        with self._lock:
            if self._closed:
                raise IOPoolClosedError(f"IOPool is shut down; cannot submit job {job_id!r}")
            self._active_jobs += 1
            if not ops:
                done = self._complete(job)
            else:
                queue = self._queues[kind]
                for i in range(len(ops)):
                    queue.append((job, i))
                self._work.notify(len(ops))
        if done is not None and on_done is not None:
            on_done(done)

    def has_finished(self) -> bool:
        """Whether :meth:`get_finished` has a job to return now. Read without
        the lock (one atomic read of a list's length): an engine polling an
        idle pool every scheduler step pays no lock; a job published after
        the read is returned by the next poll, and ``on_complete`` fires only
        after the job is in the list."""
        return bool(self._finished)

    def get_finished(self) -> list[PoolJob]:
        """Jobs finished since the last call (never blocks)."""
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every submitted job has finished; False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._active_jobs == 0, timeout)

    def spare_threads(self, kind: str) -> int:
        """Threads of ``kind``'s priority less the ops of ``kind`` already
        queued (0 when the queue is at least that deep). A hint, read without
        the lock (a deque's length is one atomic read): a caller cutting a
        job into batches cuts it into at most this many when threads are
        free, and into one batch when the queue already keeps every thread
        busy, so each op's fixed Python cost is paid once per whole job
        (test_pool.py::test_spare_threads_counts_the_queue)."""
        threads = self.read_threads if kind == "read" else self.write_threads
        return max(0, threads - len(self._queues[kind]))

    def queue_depth(self, kind: str) -> int:
        """Operations of ``kind`` waiting for a thread."""
        with self._lock:
            return len(self._queues[kind])

    @property
    def stuck_threads(self) -> int:
        """Threads still blocked in an operation that timed out."""
        with self._lock:
            return self._stuck

    @property
    def timeouts(self) -> int:
        """Operations reported :data:`OP_TIMED_OUT` since creation."""
        with self._lock:
            return self._timeouts

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Cancel queued operations (reported :data:`OP_CANCELLED`), let running
        ones finish, and join the threads (stuck ones are not waited for).
        Idempotent."""
        callbacks: list[tuple[Callable[[PoolJob], None], PoolJob]] = []
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for queue in self._queues.values():
                while queue:
                    job, i = queue.popleft()
                    job.results[i] = OP_CANCELLED
                    job.remaining -= 1
                    if job.remaining == 0:
                        done = self._complete(job)
                        if job.on_done is not None:
                            callbacks.append((job.on_done, done))
            self._work.notify_all()
            self._tick.notify_all()
            threads = [w.thread for w in self._workers if w.thread is not None and not w.retired]
        for cb, done in callbacks:
            self._call_done(cb, done)
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._watchdog is not None:
            self._watchdog.join(1.0)

    close = shutdown

    def __enter__(self) -> IOPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ----------------------------------------------------------- internals
    def _spawn(self, priority: str) -> None:
        """Start a worker (lock held)."""
        self._seq += 1
        worker = _Worker(priority)
        worker.thread = threading.Thread(
            target=self._run,
            args=(worker,),
            name=f"{self._name}-{priority}-{self._seq}",
            daemon=True,  # a thread stuck in a hung syscall must not block exit
        )
        self._workers.append(worker)
        worker.thread.start()

    def _complete(self, job: _Job, *, signal: bool = True) -> PoolJob:
        """Publish a finished job (lock held); ``signal=False``: the caller
        calls :meth:`_signal` once it has released the lock."""
        done = PoolJob(job.job_id, job.kind, list(job.results), self._clock.monotonic() - job.started)
        if job.on_done is None:
            self._finished.append(done)
        self._active_jobs -= 1
        if self._active_jobs == 0:
            self._idle.notify_all()
        if signal:
            self._signal(job)
        return done

    def _signal(self, job: _Job) -> None:
        if self._on_complete is not None:
            try:
                self._on_complete(job.kind)
            except Exception:
                log.exception("on_complete callback failed for job %r", job.job_id)

    def _next(self, worker: _Worker) -> tuple[_Job, int] | None:
        """Pop the next operation for ``worker`` (lock held)."""
        own = self._queues[worker.priority]
        other = self._queues["write" if worker.priority == "read" else "read"]
        if own:
            return own.popleft()
        if other:
            return other.popleft()
        return None

    def _run(self, worker: _Worker) -> None:
        while True:
            with self._lock:
                item = None
                while not worker.retired:
                    item = self._next(worker)
                    if item is not None or self._closed:
                        break
                    self._work.wait()
                if item is None:
                    self._workers.remove(worker)
                    return
                job, index = item
                # The job's deadline, not this op's: an op that waited in the
                # queue gets what is left, so every job ends by
                # submission + io_timeout_s (plus the watchdog's wake-up).
                deadline = (
                    job.started + self.io_timeout_s if self.io_timeout_s is not None else 0.0
                )
                run = _Running(job, index, deadline, worker)
                worker.running = run
                # Wake the watchdog only for a deadline before its own wake-up:
                # an idle pool's watchdog wakes io_timeout_s after its last scan,
                # never after a deadline of a job submitted since (a job queued
                # at that scan set the wake-up). Not one thread wake-up per job
                # (test_pool.py::test_watchdog_is_not_woken_for_each_job).
                if deadline < self._watch_at:
                    self._tick.notify()
            try:
                result: Any = job.ops[index]()
            except Exception as exc:  # the op's failure is its result
                log.debug("I/O op %d of job %r raised", index, job.job_id, exc_info=exc)
                result = _without_traceback(exc)
            late: list[LateCallback] = []
            done: PoolJob | None = None
            with self._lock:
                worker.running = None
                if run.timed_out:
                    # Replaced already: drop the result, report, and exit.
                    self._stuck -= 1
                    late = list(self._late_callbacks)
                    worker.retired = True
                    self._workers.remove(worker)
                else:
                    job.results[index] = result
                    job.remaining -= 1
                    if job.remaining == 0:
                        done = self._complete(job, signal=False)
            if done is not None:
                self._signal(job)
                if job.on_done is not None:
                    self._call_done(job.on_done, done)
            if run.timed_out:
                log.warning(
                    "late I/O returned for job %r op %d after timeout; result dropped",
                    job.job_id,
                    index,
                )
                for cb in late:
                    try:
                        cb(job.job_id, index)
                    except Exception:
                        log.exception("on_late callback failed for job %r", job.job_id)
                self._signal(job)
                return  # a replacement thread already serves the queues

    @staticmethod
    def _call_done(cb: Callable[[PoolJob], None], done: PoolJob) -> None:
        try:
            cb(done)
        except Exception:
            log.exception("on_done callback failed for job %r", done.job_id)

    def _expire_queued(
        self, now: float, timeout: float, callbacks: list[tuple[Callable[[PoolJob], None], PoolJob]]
    ) -> float | None:
        """Take operations queued past their job's deadline off the queues as
        :data:`OP_EXPIRED` (lock held). Queues are FIFO by submission, so
        only heads are looked at. Returns the next head's deadline."""
        earliest: float | None = None
        for queue in self._queues.values():
            while queue:
                job, i = queue[0]
                deadline = job.started + timeout
                if deadline > now:
                    if earliest is None or deadline < earliest:
                        earliest = deadline
                    break
                queue.popleft()
                self._timeouts += 1
                job.results[i] = OP_EXPIRED
                job.remaining -= 1
                if job.remaining == 0:
                    done = self._complete(job)
                    if job.on_done is not None:
                        callbacks.append((job.on_done, done))
        return earliest

    def _watch(self) -> None:
        timeout = self.io_timeout_s
        if timeout is None:
            return
        while True:
            callbacks: list[tuple[Callable[[PoolJob], None], PoolJob]] = []
            with self._lock:
                if self._closed and not any(
                    w.running and not w.running.timed_out for w in self._workers
                ):
                    return
                now = self._clock.monotonic()
                earliest: float | None = None
                for w in list(self._workers):
                    run = w.running
                    if run is None or run.timed_out:
                        continue
                    if run.deadline <= now:
                        run.timed_out = True
                        self._stuck += 1
                        self._timeouts += 1
                        job = run.job
                        job.results[run.index] = OP_TIMED_OUT
                        job.remaining -= 1
                        if job.remaining == 0:
                            done = self._complete(job)
                            if job.on_done is not None:
                                callbacks.append((job.on_done, done))
                        log.warning(
                            "I/O op %d of job %r exceeded io_timeout_s=%s; thread %s counted stuck",
                            run.index,
                            job.job_id,
                            timeout,
                            w.thread.name if w.thread else "?",
                        )
                        if not self._closed:
                            self._spawn(w.priority)
                    elif earliest is None or run.deadline < earliest:
                        earliest = run.deadline
                head = self._expire_queued(now, timeout, callbacks)
                if head is not None and (earliest is None or head < earliest):
                    earliest = head
                wait = timeout if earliest is None else max(0.001, earliest - now)
                if not callbacks:
                    self._watch_at = now + wait
                    self._clock.wait(self._tick, wait)
                    self._watch_at = -math.inf
            for cb, done in callbacks:
                self._call_done(cb, done)
