"""The native engine: the :class:`~fstier.io.engine.Engine` protocol over the
C job engine of ``fstier/io/_native_engine.c`` (persistent C workers, a C
watchdog, a completion list and an eventfd).

- ``submit``: ONE C call per job (``engine_submit``) with its key hashes
  and groups (the C side formats each file's name by the path codec:
  no Python path string is made for the I/O), buffers, a store's replace flags, its flags and
  deadline, and an integer tag naming the record here. The C workers (read-
  and write-priority, sized like the Python engine's threads) take the job's
  keys one at a time: no Python runs on an I/O thread and no thread is
  started per call.
- Completion: one Python thread, ``<name>-complete``, waits on the engine's
  eventfd with the GIL released and turns each C summary into the record's
  results (one unit of every key when every key returned, one unit per key
  otherwise: a key the engine gave up on is :data:`TIMED_OUT`,
  :data:`EXPIRED` or :data:`CANCELLED`), then publishes it to its
  registration and runs ``on_complete`` (a uniform success seen before:
  ``_done_alike``, one lock, no other call); at a "released" event it sets
  ``job.released`` and runs ``on_released``. A mixed summary is judged by
  :mod:`fstier.io.engine.summary` (a byte per key, a tuple per failed key).
  It does no I/O: a corrupt file's removal and a store whose namespace
  directory was removed are done by the C worker; only a key C still
  failed ENOENT then (the root itself gone) is handed to the batch path.
- A registration with ``notify_fds`` (LMCache's eventfds): its jobs are
  submitted with their kind's fd, which C writes (not the engine's eventfd)
  once the event is queued, so no Python runs at their completion; the
  caller collects on its own thread (:meth:`NativeEngine.pump`, run by the
  registration's ``has_finished`` and ``wait_idle``). Collections, the
  completion thread's included, hold one lock, so a caller woken by its fd
  that finds the engine's list empty finds the job published already.
- A job runs on at most ``max(1, keys // MIN_KEYS_PER_THREAD)`` workers at
  once (``spread``; the Python engine's split of a native job), its keys
  taken in order: a small job's keys run one after another on one worker.
- Deadlines and fences live in C (see ``_native_engine.c``): a job past its
  deadline is published at once; when keys of it were still running, the
  slots of those and of its keys that never ran are in ``job.fenced`` (as a
  batch call's would be), released when the last late key returned.
- A ``"call"`` job naming a native block store's files (``blocks`` and
  ``paths``, no keys: the recency flush) is a C touch job
  (``engine_touch``, write queue, its deadline in C; :mod:`fstier.io.engine.touch`); its ``call`` never
  runs. Other ``"call"`` jobs (a Python-path store's flush) run on one Python
  thread, ``<name>-call``, started on the first, in order; one past its deadline is finished as
  timed out by the completion thread, which starts a new call thread for the
  calls behind it (the stuck one exits when its call returns); a job of a block store on the Python
  I/O path (``native_io: off``), a ``"probe"`` job (a presence probe of
  that path, waited for by its caller), and a store while its root's O_DIRECT
  probe is to run again (it could not run at start: ``BlockStore.store_many``
  probes first), run on a :class:`PythonEngine` made on the first such job.

The C watchdog reads the monotonic clock; :meth:`NativeEngine.set_clock`
makes it a manual clock a test moves (a :class:`~fstier.clock.Clock` other
than the system clock is not read by the C side).

Invariants
    Every record's engine fields change under :attr:`NativeEngine.lock`;
    a job is published exactly once; ``on_released`` runs after
    ``job.released`` is set and after the job was published.

Costs
    Per job: one C call at submit and a share of one ``engine_collect`` at
    completion; O(1) Python per uniform job, O(keys) only when keys
    differed or were given up on.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from functools import partial
from operator import attrgetter
from typing import Any

from fstier.clock import SYSTEM_CLOCK, Clock
from fstier.errors import IOPoolClosedError
from fstier.io import native as nat
from fstier.io.engine import summary, touch
from fstier.io.engine.python import PythonEngine, Registration, check_threads, write_fd
from fstier.io.engine.record import CANCELLED, MIN_KEYS_PER_THREAD, TIMED_OUT, EngineJob
from fstier.io.engine.summary import _ST_FAILED
from fstier.io.engine.summary import SHARED as _UNIFORM
from fstier.io.manifest import MANIFEST_NAME, manifest_bytes

__all__ = ["NativeEngine", "available"]

log = logging.getLogger("fstier.io")

#: (registration, block store, kind) whose fixed engine_submit arguments are cached at most (``NativeEngine._fixed``),
#: and uniform outcomes (``NativeEngine._judge_uniform``)
_FIXED_MAX = 256
_HASH, _GROUP = attrgetter("block_hash"), attrgetter("group_idx")
#: the engine fields of a job published whole (``NativeEngine._done_alike``)
_DONE = {"done": True, "remaining": 0, "started_units": 1}


def _reprobe_due(blocks: Any) -> bool:
    """Whether the root's O_DIRECT probe is to run again (it could not run at
    start): the store then goes through ``BlockStore.store_many`` on a Python
    I/O thread, which probes first, as on the Python engine (an attribute
    read while no probe is pending)."""
    caps = blocks.options.capabilities
    return caps is not None and caps.reprobe_due()


def available() -> bool:
    """Whether the extension with the engine is built."""
    return nat._ext is not None and hasattr(nat._ext, "engine_new")


class NativeEngine:
    """The C job engine behind the engine protocol (module docstring)."""

    backend = "native"

    def __init__(
        self, read_threads: int, write_threads: int, *, clock: Clock = SYSTEM_CLOCK, name: str = "fstier-engine",
    ) -> None:
        check_threads(read_threads, write_threads)
        if not available():
            raise RuntimeError("the native engine needs fstier's native extension; it is not built")
        ext: Any = nat._ext
        self._ext = ext
        self.read_threads = read_threads
        self.write_threads = write_threads
        self._clock = clock
        self._name = name
        self.lock = threading.Lock()
        self._cap = self._ext.engine_new(read_threads, write_threads)
        self._jobs: dict[int, EngineJob] = {}
        #: per registration, block store and kind: the engine_submit arguments that do not change per job (``_fixed``)
        self._fixed_args: dict[tuple[Registration, Any, str], tuple[Any, ...]] = {}
        self._tags = itertools.count(1)
        self._registrations: set[Registration] = set()
        self._calls: deque[EngineJob] = deque()
        self._call_ready = threading.Condition(self.lock)
        self._call_thread: threading.Thread | None = None
        #: the call job running now and its deadline (perf_counter seconds), or None
        self._call_running: tuple[EngineJob, float] | None = None
        self._python: PythonEngine | None = None
        self._inner: dict[Registration, Registration] = {}
        self._closed = False
        self._pid = os.getpid()
        #: held across each engine_collect and the handling of what it returned
        #: (reentrant: a callback run by a collection may collect again)
        self._collecting = threading.RLock()
        self._dispatcher = threading.Thread(target=self._dispatch, name=f"{name}-complete", daemon=True)
        self._dispatcher.start()

    # ------------------------------------------------------------ public
    def register(
        self, on_complete: Callable[[str], None] | None = None,
        on_released: Callable[[EngineJob], None] | None = None, notify_fds: Mapping[str, int] | None = None,
    ) -> Registration:
        """A new caller of this engine (see :class:`Registration`)."""
        reg = Registration(self, on_complete, on_released, notify_fds)  # type: ignore[arg-type]  # same protocol
        if reg.notify_fds:
            reg.pump = self.pump
        with self.lock:
            if self._closed:
                reg.close_fds()
                raise IOPoolClosedError("the native I/O engine is shut down; cannot register")
            self._registrations.add(reg)
        return reg

    def pump(self) -> int:
        """Collect the C engine's completions now, on the calling thread; how
        many events it handled. No job in flight (none submitted, none
        waiting for its late keys): no event can be due, so no C call; it
        still waits for a collection in progress (a job leaves ``_jobs``
        before it is published: a caller woken by its fd finds it published,
        test_engine_wakeups.py). The completion thread's step,
        :meth:`_pump_all`, always collects, so the engine's eventfd is always drained."""
        if self._jobs:
            return self._pump_all()
        with self._collecting:
            return 0

    def _pump_all(self) -> int:
        """:meth:`pump` with no shortcut (the completion thread's step)."""
        with self._collecting:
            events = self._ext.engine_collect(self._cap)
            for ev in events:
                try:
                    if not self._done_alike(ev):
                        self._event(ev)
                except Exception:
                    log.exception("native engine: completing job tag %r failed", ev[0])
        return len(events)

    def unregister(self, reg: Registration) -> None:
        """``reg`` leaves: its jobs' keys not started are cancelled; the last
        one to leave stops the engine."""
        with self.lock:
            if reg.closed:
                return
            reg.closed = True
            self._registrations.discard(reg)
            inner = self._inner.pop(reg, None)
            reg.close_fds()  # under the lock: a submit with a notify fd dups it under it too
            # they hold its closed fds' numbers; list(): one C call, as a submit's
            # insert (no lock) may come at any bytecode; pop: a full cache's clear may too
            for key in [key for key in list(self._fixed_args) if key[0] is reg]:
                self._fixed_args.pop(key, None)
            last = not self._registrations
            mine = [tag for tag, job in self._jobs.items() if job.owner is reg]
        for tag in mine:
            self._ext.engine_cancel(self._cap, tag)
        if inner is not None:
            inner.close()
        if last:
            self.shutdown()

    def spare_threads(self, queue: str) -> int:
        """Workers of ``queue``'s priority less the keys queued there (a hint)."""
        info = self._ext.engine_info(self._cap)
        threads = self.read_threads if queue == "read" else self.write_threads
        return max(0, threads - int(info["queued_" + queue]))

    def queue_depth(self, queue: str) -> int:
        """Keys of ``queue`` waiting for a worker."""
        return int(self._ext.engine_info(self._cap)["queued_" + queue])

    @property
    def stuck_threads(self) -> int:
        """C workers still blocked in a key that timed out."""
        return int(self._ext.engine_info(self._cap)["stuck"])

    @property
    def timeouts(self) -> int:
        """Keys reported timed out or expired since creation."""
        return int(self._ext.engine_info(self._cap)["timeouts"])

    def info(self) -> dict[str, int]:
        """The C engine's counters (live and stuck workers, queued keys, jobs held)."""
        return dict(self._ext.engine_info(self._cap))

    def set_clock(self, now_s: float) -> None:
        """Make the C watchdog's clock manual, at ``now_s`` (tests; a later
        call moves it and wakes the watchdog)."""
        self._ext.engine_clock(self._cap, float(now_s))

    def submit(self, reg: Registration, job: EngineJob, fixed: tuple[Any, ...] | None = None) -> None:
        """Queue ``job`` for ``reg``: one C call; never blocks. A store or load
        of a block store on the native path whose fixed arguments are cached
        (``_fixed``: its registration's earlier jobs of that kind; dropped
        when the root's O_TMPFILE state or the store's options change, never
        cached for a store while an O_DIRECT probe is pending), or given
        (``fixed``, by :meth:`_submit_checked`), is the record's engine
        fields and the C call alone; anything else goes by :meth:`_submit_checked`.
        A store's ``replace`` flags are as the tier made them: None, or a list
        naming at least one key to replace (C reads any list)."""
        if fixed is None and (fixed := self._fixed_args.get((reg, job.blocks, job.kind))) is None:
            self._submit_checked(reg, job)
            return
        job.owner, job.bounds, job.remaining = reg, (0, n := len(job.keys)), 1
        bufs = job.buffers.views(job.slots, job.nbytes)  # type: ignore[union-attr]  # fixed: a store/load job
        hashes, groups, tag = list(map(_HASH, job.keys)), list(map(_GROUP, job.keys)), next(self._tags)
        timeout, threads = -1.0 if job.timeout_s is None else job.timeout_s, max(1, n // MIN_KEYS_PER_THREAD)
        with self.lock:
            if self._closed or reg.closed:
                self._check_open(reg, job)
            # Under this lock: C dups the notify fd (-1: none) before unregister can close it. C marks
            # job.accepted as it takes the job (no bytecode between), so whatever is raised here (C refusing
            # it, an interrupt, a signal handler's Exception) rolls back only a job C does not have.
            try:
                reg.active += 1
                self._jobs[tag] = job
                # fixed: kind, base, digest, pages, flags, mode, alignment, notify fd (_fixed)
                self._ext.engine_submit(self._cap, tag, fixed[0], fixed[1], None, hashes, groups, bufs, job.replace,
                                        fixed[2], fixed[3], fixed[4], fixed[5], time.time_ns(), fixed[6], timeout,
                                        threads, fixed[7], job)
            except BaseException:
                if not job.accepted:
                    self._jobs.pop(tag, None)
                    reg.active -= 1
                raise

    def _submit_checked(self, reg: Registration, job: EngineJob) -> None:
        """:meth:`submit` with every check: a call job, a probe, a job of a
        Python-path block store or a store whose root's O_DIRECT probe is
        due go to :meth:`_submit_other`; a store or load caches its fixed
        arguments (``_fixed``) and is submitted by :meth:`submit`."""
        blocks = job.blocks
        if (job.call is not None or job.kind == "probe" or blocks is None or not blocks.batched
                or (job.kind == "store" and _reprobe_due(blocks))):
            self._submit_other(reg, job)
            return
        job.block_io()  # a store or load job: its block store and buffers, or one clear error
        self.submit(reg, job, self._fixed(reg, blocks, job))

    def _fixed(self, reg: Registration, blocks: Any, job: EngineJob) -> tuple[Any, ...]:
        """The ``engine_submit`` arguments of ``reg``'s ``job.kind`` jobs of
        ``blocks`` that do not change from job to job: kind, base directory,
        namespace digest, pages per file, flag bits, file mode, alignment and
        the kind's notify fd; cached (returned either way) unless a store's
        root has an O_DIRECT probe pending (each such store is checked
        again). The root's capabilities drop the whole cache when its
        O_TMPFILE state or the store's options change (``RootCapabilities.changed``),
        so a cached entry is always the current one. At most
        :data:`_FIXED_MAX` are kept (each holds its store and registration,
        so neither's id is reused while cached)."""
        opts = blocks.options
        caps = opts.capabilities
        store, tmpfile = job.kind == "store", caps is not None and caps.tmpfile
        fixed = (
            1 if store else 0, os.fsencode(blocks.mapper.blocks_dir), blocks.mapper.digest_bytes, blocks._bpf,
            nat.flags(opts, mkdir=store), opts.file_mode, opts.alignment, reg.notify_fds.get(job.kind, -1),
        )
        if caps is not None and self._fixed_args.clear not in caps.watchers:
            caps.watchers.append(self._fixed_args.clear)
        if store:
            self._namespace(blocks.mapper)
        if opts is not blocks.options or (caps is not None and (caps.tmpfile is not tmpfile or (
                store and caps.reprobe_at is not None))):
            return fixed  # changed meanwhile, or a store to check again: not cached
        if len(self._fixed_args) >= _FIXED_MAX:
            self._fixed_args.clear()
        self._fixed_args[(reg, blocks, job.kind)] = fixed
        return fixed

    def _namespace(self, mapper: Any) -> None:
        """Tell the C engine what a store of ``mapper``'s namespace makes
        again when its directories were removed under the running tier
        (``ce_store_again``: the chain below the root, the manifest)."""
        root, blocks_dir = os.fsencode(mapper.root), os.fsencode(mapper.blocks_dir)
        chain = os.path.relpath(blocks_dir, root).split(b"/")
        self._ext.engine_namespace(
            self._cap, blocks_dir, root, chain[0], b"/".join(chain[1:]), os.fsencode(MANIFEST_NAME),
            manifest_bytes(mapper),
        )

    def _submit_other(self, reg: Registration, job: EngineJob) -> None:
        """A call job (on the call thread); a job of a Python-path block store,
        a probe, or a store while its root's O_DIRECT probe is due (on the
        Python engine)."""
        if job.call is None or job.kind == "probe":
            self._submit_python(reg, job)
            return
        if job.blocks is not None and job.blocks.batched and not job.keys and job.paths:
            touch.submit(self, reg, job)
            return
        job.owner = reg
        job.t_submit = time.perf_counter()
        job.bounds, job.helpers = (0, 1), 0
        job.results = []
        job.remaining = 1
        with self.lock:
            self._check_open(reg, job)
            reg.active += 1
            self._calls.append(job)
            self._start_call_thread()
            self._call_ready.notify()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Cancel queued keys, let running ones finish, stop the workers
        (stuck ones are not waited for). Idempotent."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            self._call_ready.notify_all()
            calls = list(self._calls)
            self._calls.clear()
        for job in calls:
            job.results = [CANCELLED]
            self._finish(job)
        if os.getpid() != self._pid:
            return  # a forked child: the parent's engine is not ours to stop
        self._ext.engine_shutdown(self._cap, -1.0 if timeout is None else float(timeout))
        python = self._python
        if python is not None:
            python.shutdown(timeout)
        if threading.current_thread() is not self._dispatcher:  # a callback may close the last registration
            self._dispatcher.join(timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    # ----------------------------------------------------------- internals
    def _check_open(self, reg: Registration, job: EngineJob) -> None:
        if self._closed or reg.closed:
            raise IOPoolClosedError(f"the native I/O engine is shut down; cannot submit job {job.tag!r}")

    def _submit_python(self, reg: Registration, job: EngineJob) -> None:
        """A job of a Python-path block store: on a Python engine, published
        here; a probe (its caller waits on its own call) in that engine's
        probe queue, published nowhere."""
        with self.lock:
            self._check_open(reg, job)
            if self._python is None or self._python.closed:  # its last registration left: a new one
                self._python = PythonEngine(self.read_threads, self.write_threads, clock=self._clock)
            inner = self._inner.get(reg)
            if inner is None:
                inner = self._inner[reg] = self._python.register(
                    partial(self._forward, reg), reg.on_released
                )
            if job.call is None:
                reg.active += 1
        inner.submit(job)

    def _forward(self, reg: Registration, _kind: str = "") -> None:
        inner = self._inner.get(reg)
        if inner is not None:
            for job in inner.collect():
                job.owner = reg
                self._finish(job, notify=True)

    def _start_call_thread(self) -> None:
        if self._call_thread is None:
            self._call_thread = threading.Thread(target=self._run_calls, name=f"{self._name}-call", daemon=True)
            self._call_thread.start()

    def _run_calls(self) -> None:
        me = threading.current_thread()
        while True:
            with self.lock:
                while not self._calls and not self._closed and self._call_thread is me:
                    self._call_ready.wait()
                if not self._calls or self._call_thread is not me:
                    if self._call_thread is me:
                        self._call_thread = None
                    return
                job = self._calls.popleft()
                limit = math.inf if job.timeout_s is None else time.perf_counter() + job.timeout_s
                self._call_running = (job, limit)
            try:
                if job.call is None:
                    raise ValueError(f"engine call job {job.tag!r} has no call")
                job.call()
            except Exception:
                log.exception("engine call job %r raised", job.tag)
            with self.lock:
                late = self._call_running is None or self._call_running[0] is not job
                if not late:
                    self._call_running = None
            if late:  # given up on at its deadline; a new call thread took over
                log.warning("late call job %r returned after its deadline", job.tag)
                return
            job.results = [None]
            self._finish(job)

    def _expire_call(self) -> float:
        """A call job past its deadline (a touch on a hung mount) is given up
        on: finished as timed out, its thread left to return on its own, a new
        thread for the calls queued behind it. Returns seconds to the running
        call's deadline (0.5 at most: the completion thread's wait). No call
        running: no lock (one read; a call starting after it is seen at the
        next wake, within the 0.5 s wait it would get anyway)."""
        if self._call_running is None:
            return 0.5
        with self.lock:
            running = self._call_running
            if running is None:
                return 0.5
            job, limit = running
            left = limit - time.perf_counter()
            if left > 0:
                return min(0.5, left)
            self._call_running = None
            self._call_thread = None
            if self._calls and not self._closed:
                self._start_call_thread()
        job.results = [TIMED_OUT]
        self._finish(job)
        return 0.5

    def _finish(self, job: EngineJob, seconds: float | None = None, notify: bool = False) -> None:
        """Publish ``job`` to its registration and signal it; ``seconds``: its
        run time from the C summary (None: measured here, or by the Python
        engine); ``notify``: write its notify fd too (C wrote it for a job of
        the C engine)."""
        reg: Registration = job.owner
        with self.lock:
            job.done = True
            job.remaining = 0
            job.started_units = len(job.results)
            if seconds is not None:
                job.t_end = job.t_submit + seconds
            elif not job.t_end:
                job.t_end = time.perf_counter()
            if job.call is None:
                reg.finished.append(job)
            reg.active -= 1
            if reg.active == 0:
                reg.idle.notify_all()
            fd = reg.notify_fds.get(job.kind) if notify and job.call is None else None
            if fd is not None:
                write_fd(fd)
        if job.call is None:
            _completed(reg, job)

    def _dispatch(self) -> None:
        ext, cap = self._ext, self._cap
        wait = 0.5
        while True:
            ext.engine_wait(cap, wait)
            wait = self._expire_call()
            try:
                events = self._pump_all()
            except RuntimeError:  # a forked child's copy of this thread does not exist; defensive
                return
            with self.lock:
                if self._closed and not self._jobs and not events:
                    return

    def _event(self, ev: tuple[Any, ...]) -> None:
        if ev[0] >= touch.TAGS:
            return touch.finished(self, ev)
        if ev[1] == 1:  # released: every late key returned
            with self.lock:
                job = self._jobs.pop(ev[0])
                job.released = True
                job.late = 0
            reg: Registration = job.owner
            log.warning("late I/O returned for job %r after its deadline; results dropped, slots released", job.tag)
            if reg.on_released is not None:
                try:
                    reg.on_released(job)
                except Exception:
                    log.exception("on_released callback failed for job %r", job.tag)
            _completed(reg, job)
            return
        tag, _, seconds, uniform, per_key, marks = ev
        if uniform is not None:  # every key returned alike (C: no marks then); a success seen before: _done_alike
            with self.lock:
                job = self._jobs.pop(tag)  # a store or load: call jobs never reach C
            self._judge_uniform(job, uniform)
        else:
            with self.lock:
                job = self._jobs[tag] if marks is not None and 1 in marks else self._jobs.pop(tag)
            self._judge_summary(job, per_key, marks)
        self._finish(job, seconds)

    def _done_alike(self, ev: tuple[Any, ...]) -> bool:
        """The straight line, tried first for every event: a store or load whose every key returned one success
        seen before (:data:`_UNIFORM`) published under one lock, its record's fields set in one update, ``idle``
        notified only when a waiter is listed (a Condition lists them under its lock, held here); True when it
        was one (else :meth:`_event` takes it, nothing done here)."""
        with self.lock:
            job = self._jobs.get(ev[0]) if len(ev) == 6 and ev[0] < touch.TAGS else None
            one = None if job is None or ev[3] is None else _UNIFORM.get((job.kind, ev[3]))
            if job is None or one is None:
                return False
            del self._jobs[ev[0]]
            vars(job).update(_DONE, uniform=one, results=[[one] * len(job.keys)], t_end=job.t_submit + ev[2])
            (reg := job.owner).finished.append(job)
            reg.active -= 1
            if reg.active == 0 and reg.idle._waiters:  # (see the docstring)
                reg.idle.notify_all()
        if reg.on_complete is not None:
            _completed(reg, job)
        return True

    def _judge_uniform(self, job: EngineJob, raw: tuple[int, ...]) -> None:
        """The record's results from a uniform C summary: a success is one
        shared outcome (cached per kind and summary: outcomes are frozen),
        held ``len(keys)`` times in one unit and set as ``job.uniform`` (the
        caller judges the job with no loop over its keys); anything else is
        turned into per-key outcomes as a mixed job's are."""
        one = _UNIFORM.get((job.kind, raw))
        if one is None:
            outs = self._outcomes(job, [raw] * len(job.keys), range(len(job.keys)))
            # Shared only when loaded, or stored or skipped with no O_TMPFILE
            # refusal and no stage (SG_NSBACK: logged per job, never cached).
            failed = raw[0] != 0 if job.kind == "load" else (raw[0] == _ST_FAILED or raw[4] != 0 or raw[3] != 0)
            if failed:
                job.results = [outs]
                return
            if len(_UNIFORM) >= _FIXED_MAX:
                _UNIFORM.clear()
            one = _UNIFORM[(job.kind, raw)] = outs[0]
        job.uniform = one
        job.results = [[one] * len(job.keys)]

    #: a mixed C summary judged into the record's results; per-key tuples judged (``summary.py``)
    _judge_summary = staticmethod(summary.judge_mixed)
    _outcomes = staticmethod(summary.outcomes)


def _completed(reg: Registration, job: EngineJob) -> None:
    """Tell ``reg``'s ``on_complete`` callback, if any, that a ``job.kind`` job
    completed; a callback's exception is logged, never raised into the engine."""
    if reg.on_complete is not None:
        try:
            reg.on_complete(job.kind)
        except Exception:
            log.exception("on_complete callback failed for job %r", job.tag)
