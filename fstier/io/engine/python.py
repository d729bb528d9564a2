"""The Python engine: read- and write-priority I/O threads and a watchdog
that move :class:`~fstier.io.engine.record.EngineJob` records, the fallback
backend of :mod:`fstier.io.engine` and the worked example of one.

- Two queues of jobs, ``read`` (loads) and ``write`` (stores, recency
  calls). Read-priority threads take from the read queue first and from the
  write queue only when it is empty; write-priority threads the reverse:
  loads (which an engine waits for) never wait behind a burst of stores, and
  stores never starve. Before either, every thread takes the ``probe``
  queue's jobs (presence probes a caller waits for, a few ``fstatat`` each):
  a probe never waits behind queued I/O, only for a thread to finish a
  unit. An idle thread takes the head job's next unit, so the units of one
  job run in parallel; the job leaves its queue when its last unit started.
- A unit's work is the block store's batch call (``store_many`` /
  ``load_many``: one GIL-free native call for a whole native job, one key on
  the Python backend) into the job's buffers.
- Deadlines: a job's deadline is its submission + its ``timeout_s``. At it
  the watchdog completes the job: units running then are :data:`TIMED_OUT`
  (their slots go into ``job.fenced``), units not started are
  :data:`EXPIRED` and never run. Each thread stuck in a timed-out call (a
  hung NFS syscall cannot be interrupted) is counted in
  :attr:`PythonEngine.stuck_threads` and replaced. When the last stuck call
  of a job returns, its result is dropped, ``job.released`` turns true and
  the registration's ``on_released(job)`` runs on that thread, so the owner
  unfences the slots: the late call can no longer write them.
- Completion: a finished job is appended to its registration's list and
  ``on_complete(kind)`` runs after the engine's lock is released (it must
  only signal: an eventfd write, a Condition's notify); ``collect`` takes
  the list. A registration with ``notify_fds`` (a caller's own eventfd per
  kind, e.g. LMCache's) runs no callback: the engine's thread writes the
  job's kind's fd under the lock, once the job is in the list (the
  registration holds a dup of each fd until it closes). One engine serves many registrations (namespaces): a
  registration costs a list and a counter, not threads.

Invariants
    Every job and queue field changes only under the engine's one lock. A
    job is published exactly once; a unit the engine gave up on never
    publishes. ``on_released`` runs after ``job.released`` is set and after
    the job was published.

Costs
    Per unit: one lock acquisition to take it and one to publish its result;
    one thread wake-up per unit queued. The watchdog wakes at the earliest
    deadline of a job in flight (a heap), never once per job; a finished
    job leaves the heap when it reaches its head (jobs of one deadline
    finish about in order, so the heap holds about the jobs in flight). With
    none in flight it sleeps the last job's timeout, so a job that finds the
    engine idle does not wake it either: no thread wake-up per serial job
    (test_engine_queues.py::test_watchdog_is_not_woken_for_each_job).
"""

from __future__ import annotations

import fcntl
import heapq
import itertools
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fstier.clock import SYSTEM_CLOCK, Clock
from fstier.errors import IOPoolClosedError
from fstier.io.engine.record import CANCELLED, EXPIRED, PENDING, TIMED_OUT, EngineJob, plan

__all__ = ["PythonEngine", "Registration", "check_threads"]

log = logging.getLogger("fstier.io")

_QUEUES = ("probe", "read", "write")


def without_traceback(exc: BaseException) -> BaseException:
    """``exc`` with no traceback on it or its causes: a kept traceback holds
    the unit's frames and every buffer view they held (an engine's rows,
    which it could not unmap at shutdown until a garbage collection)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return exc


def run_unit(job: EngineJob, unit: int) -> Any:
    """Unit ``unit`` of ``job``'s work: its keys' batch call into its
    buffers (or the job's ``call``). Raises what the call raised."""
    if job.call is not None:
        return job.call()
    lo, hi = job.bounds[unit], job.bounds[unit + 1]
    blocks, buffers = job.block_io()
    keys = job.keys[lo:hi]
    items = list(zip(keys, buffers.views(job.slots[lo:hi], job.nbytes[lo:hi]), strict=True))
    paths = job.paths[lo:hi]
    if job.kind == "store":
        replace = job.replace[lo:hi] if job.replace is not None else None
        return blocks.store_many(items, replace=replace, helpers=job.helpers, paths=paths)
    return blocks.load_many(items, helpers=job.helpers, paths=paths)


def write_fd(fd: int) -> None:
    """Add 1 to the eventfd ``fd`` (a counter already at its maximum wakes its reader anyway)."""
    try:
        os.eventfd_write(fd, 1)
    except OSError:
        log.debug("eventfd %d not written", fd, exc_info=True)


class Registration:
    """One caller of an engine (a tier, a namespace): where its finished
    jobs wait. Created by :meth:`PythonEngine.register`.

    ``notify_fds``: ``{"store": fd, "load": fd}``, eventfds the engine
    writes when a job of that kind is published (and released), instead of
    calling ``on_complete``; dup'ed here, closed with the registration
    (under the engine's lock, so no write can come after). ``pump``: set by
    an engine whose completions wait to be collected (the C engine's), run
    by :meth:`has_finished` and :meth:`wait_idle`, so a caller woken by its
    fd collects them on its own thread."""

    def __init__(
        self, engine: PythonEngine, on_complete: Callable[[str], None] | None,
        on_released: Callable[[EngineJob], None] | None, notify_fds: Mapping[str, int] | None = None,
    ) -> None:
        self.engine = engine
        self.on_complete = on_complete
        self.on_released = on_released
        self.finished: list[EngineJob] = []
        self.active = 0
        self.closed = False
        self.idle = threading.Condition(engine.lock)
        self.notify_fds: dict[str, int] = {}
        try:
            for kind, fd in (notify_fds or {}).items():
                self.notify_fds[kind] = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 0)
        except BaseException:
            self.close_fds()
            raise
        self.pump: Callable[[], object] | None = None

    def poll(self) -> bool:
        """With jobs of this registration in flight, collect the engine's
        completions on the calling thread now (the C engine's ``pump``: one C
        call; the Python engine publishes from its own threads: nothing to
        do). A caller that polls (vLLM's scheduler) so never waits for the
        engine's completion thread to get the GIL, which an engine holding it
        hands over only every switch interval (5 ms). Returns what
        :meth:`has_finished` would then (no second pump)."""
        if self.active and hasattr(self.engine, "pump"):
            self.engine.pump()
        return bool(self.finished)

    def notify(self, kind: str) -> None:
        """Write ``kind``'s notify fd, if any (takes the engine's lock)."""
        if self.notify_fds:
            with self.engine.lock:
                fd = self.notify_fds.get(kind)
                if fd is not None:
                    write_fd(fd)

    def close_fds(self) -> None:
        """Close the notify fds' dups (the engine's lock held, or before the registration is known)."""
        fds, self.notify_fds = self.notify_fds, {}
        for fd in fds.values():
            os.close(fd)

    def submit(self, job: EngineJob) -> None:
        """Queue ``job``; never blocks."""
        self.engine.submit(self, job)

    def has_finished(self) -> bool:
        """Whether :meth:`collect` has a job now (no lock: one atomic read,
        after :attr:`pump` collected the engine's completions, if set)."""
        if self.pump is not None:  # always: a job already here says nothing of one still in the engine
            self.pump()
        return bool(self.finished)

    def collect(self) -> list[EngineJob]:
        """Jobs finished since the last call, in the order they finished."""
        with self.engine.lock:
            out, self.finished = self.finished, []
        return out

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Until every job submitted here finished; False on timeout. With
        :attr:`pump` (nothing else may collect its completions), it pumps
        every 5 ms meanwhile."""
        pump = self.pump
        if pump is None:
            with self.engine.lock:
                return self.idle.wait_for(lambda: self.active == 0, timeout)
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            pump()
            with self.engine.lock:
                if self.active == 0:
                    return True
                left = 0.005 if end is None else min(0.005, end - time.monotonic())
                if left <= 0:
                    return False
                self.idle.wait(left)

    def close(self) -> None:
        """Cancel this registration's queued units; the engine stops once
        no registration is left. Idempotent."""
        self.engine.unregister(self)


class _Tick(threading.Condition):
    """The watchdog's wake-up, a condition of the engine's lock. A notify is
    kept until the watchdog's next wait sees it: a clock that waits in short
    polls (``ManualClock``) would otherwise lose one given between two
    polls, and the watchdog would sleep to its old wake-up (an hour when
    idle) past a new job's deadline."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__(lock)
        self._pending = False

    def notify(self, n: int = 1) -> None:
        self._pending = True
        super().notify(n)

    def notify_all(self) -> None:
        self._pending = True
        super().notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._pending:
            super().wait(timeout)
        woken, self._pending = self._pending, False
        return woken


@dataclass(slots=True, eq=False)
class _Worker:
    priority: str
    thread: threading.Thread | None = None
    retired: bool = False


def check_threads(read_threads: int, write_threads: int) -> None:
    """Every engine's thread counts: at least one of each priority, or one ValueError naming both."""
    if read_threads < 1 or write_threads < 1:
        raise ValueError(
            f"an engine needs at least one read and one write thread, got {read_threads} and {write_threads}"
        )


class PythonEngine:
    """Read- and write-priority I/O threads; see the module docstring."""

    backend = "python"

    def __init__(
        self, read_threads: int, write_threads: int, *, clock: Clock = SYSTEM_CLOCK, name: str = "fstier-io",
    ) -> None:
        check_threads(read_threads, write_threads)
        self.read_threads = read_threads
        self.write_threads = write_threads
        self._clock = clock
        self._name = name
        self.lock = threading.Lock()
        self._work = threading.Condition(self.lock)
        self._tick = _Tick(self.lock)
        self._queues: dict[str, deque[EngineJob]] = {k: deque() for k in _QUEUES}
        #: units waiting for a thread, per queue (a job's unstarted units)
        self._queued = dict.fromkeys(_QUEUES, 0)
        self._deadlines: list[tuple[float, int, EngineJob]] = []
        self._seq = itertools.count()
        self._registrations: set[Registration] = set()
        self._workers: list[_Worker] = []
        self._watch_at = -math.inf
        #: how long the watchdog sleeps with no deadline pending: the last job's timeout, so
        #: the next job of that timeout has its deadline after the wake-up and need not wake it
        self._idle_wait = 3600.0
        self._stuck = 0
        self._timeouts = 0
        self._closed = False
        self._thread_seq = 0
        with self.lock:
            for _ in range(read_threads):
                self._spawn("read")
            for _ in range(write_threads):
                self._spawn("write")
        self._watchdog = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)
        self._watchdog.start()

    # ------------------------------------------------------------ public
    def register(
        self, on_complete: Callable[[str], None] | None = None,
        on_released: Callable[[EngineJob], None] | None = None, notify_fds: Mapping[str, int] | None = None,
    ) -> Registration:
        """A new caller of this engine (see :class:`Registration`)."""
        reg = Registration(self, on_complete, on_released, notify_fds)
        with self.lock:
            if self._closed:
                reg.close_fds()
                raise IOPoolClosedError("the I/O engine is shut down; cannot register")
            self._registrations.add(reg)
        return reg

    def unregister(self, reg: Registration) -> None:
        """``reg`` leaves: its queued units are cancelled; the last one to
        leave stops the threads."""
        with self.lock:
            if reg.closed:
                return
            reg.closed = True
            self._registrations.discard(reg)
            for q in _QUEUES:
                for job in [j for j in self._queues[q] if j.owner is reg]:
                    self._cancel_locked(job)
            reg.close_fds()
            last = not self._registrations
        if last:
            self.shutdown()

    def spare_threads(self, queue: str) -> int:
        """Threads of ``queue``'s priority less the units already queued
        there (0 when the queue keeps them all busy). A hint read without
        the lock: a job is spread over at most this many threads."""
        threads = self.read_threads if queue == "read" else self.write_threads
        return max(0, threads - self._queued[queue])

    def queue_depth(self, queue: str) -> int:
        """Units of ``queue`` waiting for a thread."""
        with self.lock:
            return self._queued[queue]

    @property
    def stuck_threads(self) -> int:
        """Threads still blocked in a unit that timed out."""
        with self.lock:
            return self._stuck

    @property
    def timeouts(self) -> int:
        """Units reported timed out or expired since creation."""
        with self.lock:
            return self._timeouts

    def submit(self, reg: Registration, job: EngineJob) -> None:
        """Queue ``job`` for ``reg``: cut into units (:func:`plan`) by the
        threads free now; never blocks."""
        queue = job.kind_queue
        if job.call is not None:
            job.bounds, job.helpers = (0, 1), 0
        else:
            batched = job.blocks is not None and job.blocks.batched
            job.bounds, job.helpers = plan(len(job.keys), max(1, self.spare_threads(queue)), batched)
        units = len(job.bounds) - 1
        job.results = [PENDING] * units
        job.remaining = units
        job.owner = reg
        job.t_submit = time.perf_counter()
        job.submitted = now = self._clock.monotonic()
        job.deadline = math.inf if job.timeout_s is None else now + job.timeout_s
        with self.lock:
            if self._closed or reg.closed:
                raise IOPoolClosedError(f"the I/O engine is shut down; cannot submit job {job.tag!r}")
            try:  # the append last, the take: no thread sees the job before this lock is released
                reg.active += 1
                self._queued[queue] += units
                if job.timeout_s is not None:
                    self._idle_wait = job.timeout_s
                    heapq.heappush(self._deadlines, (job.deadline, next(self._seq), job))
                    if job.deadline < self._watch_at:
                        self._tick.notify()
                self._work.notify(units)
                self._queues[queue].append(job)
                job.accepted = True
            except BaseException:  # an interrupt: taken or not by whether the job is queued (no thread took it)
                self._interrupted_locked(reg, job, queue, units)
                raise

    def _interrupted_locked(self, reg: Registration, job: EngineJob, queue: str, units: int) -> None:
        """A submit of ``job`` interrupted under the lock: taken (``accepted``) when it is in its queue, else
        its counts given back and the job marked done (the watchdog drops its deadline)."""
        if job.accepted or any(q is job for q in self._queues[queue]):
            job.accepted = True
            return
        reg.active -= 1
        self._queued[queue] -= units
        job.done = True

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Cancel queued units, let running ones finish, join the threads
        (stuck ones are not waited for). Idempotent."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            for q in _QUEUES:
                for job in list(self._queues[q]):
                    self._cancel_locked(job)
            self._work.notify_all()
            self._tick.notify_all()
            threads = [w.thread for w in self._workers if w.thread is not None and not w.retired]
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in threads:
            if t is not threading.current_thread():
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._watchdog is not threading.current_thread():
            self._watchdog.join(1.0)

    @property
    def closed(self) -> bool:
        return self._closed

    # ----------------------------------------------------------- internals
    def _spawn(self, priority: str) -> None:
        """Start a worker (lock held)."""
        self._thread_seq += 1
        worker = _Worker(priority)
        worker.thread = threading.Thread(
            target=self._run, args=(worker,), name=f"{self._name}-{priority}-{self._thread_seq}",
            daemon=True,  # a thread stuck in a hung syscall must not block exit
        )
        self._workers.append(worker)
        worker.thread.start()

    def _cancel_locked(self, job: EngineJob) -> None:
        """Units of ``job`` not started are cancelled (lock held)."""
        units = len(job.results)
        for u in range(job.started_units, units):
            job.results[u] = CANCELLED
        self._queued[job.kind_queue] -= units - job.started_units
        job.remaining -= units - job.started_units
        job.started_units = units
        self._queues[job.kind_queue].remove(job)
        if job.remaining == 0:
            self._complete_locked(job)

    def _complete_locked(self, job: EngineJob) -> None:
        """Publish ``job`` (lock held); the caller signals after releasing it."""
        job.done = True
        if not job.t_end:
            job.t_end = time.perf_counter()
        reg: Registration = job.owner
        if job.call is None:
            reg.finished.append(job)
            fd = reg.notify_fds.get(job.kind)
            if fd is not None:  # published: a caller woken by it finds the job
                write_fd(fd)
        reg.active -= 1
        if reg.active == 0:
            reg.idle.notify_all()
        heap = self._deadlines
        while heap and heap[0][2].done:  # finished jobs leave the watchdog's heap now, not at their deadline
            heapq.heappop(heap)

    @staticmethod
    def _signal(job: EngineJob) -> None:
        cb = job.owner.on_complete
        if cb is not None and job.call is None:
            try:
                cb(job.kind)
            except Exception:
                log.exception("on_complete callback failed for job %r", job.tag)

    def _take(self, worker: _Worker) -> tuple[EngineJob, int] | None:
        """The next unit for ``worker`` (lock held)."""
        own = worker.priority
        for q in ("probe", own, "write" if own == "read" else "read"):
            queue = self._queues[q]
            if queue:
                job = queue[0]
                unit = job.started_units
                job.started_units += 1
                self._queued[q] -= 1
                if job.started_units == len(job.results):
                    queue.popleft()
                return job, unit
        return None

    def _run(self, worker: _Worker) -> None:
        while True:
            with self.lock:
                item = None
                while not worker.retired:
                    item = self._take(worker)
                    if item is not None or self._closed:
                        break
                    self._work.wait()
                if item is None:
                    self._workers.remove(worker)
                    return
            job, unit = item
            try:
                result: Any = run_unit(job, unit)
            except Exception as exc:  # the unit's failure is its result
                log.debug("unit %d of job %r raised", unit, job.tag, exc_info=exc)
                result = without_traceback(exc)
            del item
            released = done = False
            with self.lock:
                if job.results[unit] is TIMED_OUT:
                    # Replaced already: drop the result; the last late unit releases the job.
                    self._stuck -= 1
                    job.late -= 1
                    released = job.released = job.late == 0
                    worker.retired = True
                    self._workers.remove(worker)
                else:
                    job.results[unit] = result
                    job.remaining -= 1
                    if job.remaining == 0:
                        job.t_end = time.perf_counter()
                        self._complete_locked(job)
                        done = True
            del result
            if done:
                self._signal(job)
            if worker.retired:
                log.warning("late I/O returned for job %r unit %d after its deadline; result dropped", job.tag, unit)
                if released and job.owner.on_released is not None and job.call is None:
                    try:
                        job.owner.on_released(job)
                    except Exception:
                        log.exception("on_released callback failed for job %r", job.tag)
                    job.owner.notify(job.kind)
                    self._signal(job)
                return  # a replacement thread already serves the queues

    def _expire_locked(self, job: EngineJob) -> None:
        """``job`` is past its deadline (lock held): running units time out
        (their slots fenced), queued ones expire; the job completes."""
        fenced: list[int] = []
        for u in range(len(job.results)):
            if job.results[u] is not PENDING:
                continue
            self._timeouts += 1
            if u < job.started_units:
                job.results[u] = TIMED_OUT
                job.late += 1
                self._stuck += 1
                fenced.extend(job.slots[job.bounds[u]:job.bounds[u + 1]])
                if not self._closed:
                    self._spawn("write" if job.kind_queue == "write" else "read")
            else:
                job.results[u] = EXPIRED
        unstarted = len(job.results) - job.started_units
        if unstarted:
            self._queued[job.kind_queue] -= unstarted
            self._queues[job.kind_queue].remove(job)
            job.started_units = len(job.results)
        job.fenced = tuple(fenced)
        job.remaining = 0
        job.t_end = time.perf_counter()
        self._complete_locked(job)
        log.warning(
            "I/O job %r exceeded its deadline (%ss): %d unit(s) still running counted stuck",
            job.tag, job.timeout_s, job.late,
        )

    def _watch(self) -> None:
        while True:
            expired: list[EngineJob] = []
            with self.lock:
                if self._closed and not self._deadlines:
                    return
                now = self._clock.monotonic()
                heap = self._deadlines
                while heap and (heap[0][2].done or heap[0][0] <= now):
                    _, _, job = heapq.heappop(heap)
                    if not job.done:
                        self._expire_locked(job)
                        expired.append(job)
                if not expired:
                    if self._closed and not heap:
                        return
                    wait = heap[0][0] - now if heap else self._idle_wait
                    self._watch_at = now + wait
                    self._clock.wait(self._tick, max(0.001, wait))
                    self._watch_at = -math.inf
            for job in expired:
                self._signal(job)
