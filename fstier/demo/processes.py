"""The demo's rank processes from the parent's side, and its Ctrl-C rules.

:class:`RankProcesses` starts the four rank processes
(:func:`fstier.demo.ranks.rank_main`) from a forkserver that imported torch
once, sends each a message and collects the replies (the processes work
concurrently); a rank that fails, exits or does not answer within
:data:`REPLY_TIMEOUT_S` is a :class:`DemoError` naming it.

Ctrl-C: a terminal signals the whole process group, and only the parent
handles it (one line, cleanup, exit 130). The rule: **a Ctrl-C that arrives
at any instant after the demo starts ends it with exit 130**, with nothing
left behind. Three mechanisms keep it:

- :class:`CtrlC` (:func:`ctrl_c_recorded`, around the whole command) counts
  every SIGINT before it raises ``KeyboardInterrupt`` where it lands. A raise
  can be swallowed (inside a finalizer, ``__del__`` or weakref callback, Python
  prints "Exception ignored" and goes on), so the count is checked again when
  the demo ends: the demo still exits 130.
- Sections that must complete run *held* (:func:`sigint_deferred`): a
  Ctrl-C there is counted, not raised, and raised when the section ends: a
  tier built but not yet registered for ``close()``, and the cleanup (ranks,
  pool, temporary root), which a second Ctrl-C cannot cut half-way. (The
  cleanup used to run with SIGINT *ignored*: a Ctrl-C then was discarded
  and the demo exited 0.)
- The forkserver is spawned with SIGINT ignored and blocked
  (:func:`start_forkserver`: it and its ranks never see the signal; a
  Ctrl-C meanwhile stays pending here and is raised right after), including
  the resource tracker that multiprocessing starts first, whose own
  ``SIG_UNBLOCK`` used to deliver a pending Ctrl-C into ``SIG_IGN``.

The rule's one boundary: a Ctrl-C that arrives after the last count check
(the report printed, the cleanup done, Python shutting down) can be lost;
the demo then exits 0 with nothing left behind, as if the Ctrl-C had come a
moment after it ended.

Each helper acts on the main thread only (signals cannot be set elsewhere)
and does nothing on another thread. Pinned by test_demo.py's
test_ctrl_c_* and test_cli_ux.py's test_ctrl_c_during_demo_*.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from fstier.demo.ranks import Quit, Reply, rank_main
from fstier.errors import FstierError

__all__ = [
    "PRELOAD",
    "REPLY_TIMEOUT_S",
    "CtrlC",
    "DemoError",
    "RankProcesses",
    "block_sigint",
    "ctrl_c_recorded",
    "ignore_sigint",
    "restore_sigint",
    "restore_sigmask",
    "sigint_deferred",
    "start_forkserver",
]

#: Seconds a rank process has to answer one message.
REPLY_TIMEOUT_S = 120.0


class DemoError(FstierError, RuntimeError):
    """A rank process failed or stopped answering."""


def ignore_sigint() -> Any:
    """Ignore SIGINT (main thread only: elsewhere signals cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, signal.SIG_IGN)


def restore_sigint(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGINT, previous)


def block_sigint() -> Any:
    """Block SIGINT in this thread (main thread only) and return the old mask.

    Blocked, not ignored: a Ctrl-C that arrives meanwhile stays pending and
    is raised here once the mask is restored (an ignored one was lost, and
    the demo then ran to completion and exited 0)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def restore_sigmask(previous: Any) -> None:
    if previous is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class CtrlC:
    """Every SIGINT of one demo run, counted (see the module docstring).
    ``held`` > 0: counted only; otherwise also raised where it lands."""

    __slots__ = ("count", "depth", "held")

    def __init__(self) -> None:
        self.count = 0
        self.depth = 0
        self.held = 0

    def handler(self, signum: int, frame: Any) -> None:
        self.count += 1
        if not self.held:
            raise KeyboardInterrupt

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` if a Ctrl-C arrived (and is not held)."""
        if self.count and not self.held:
            raise KeyboardInterrupt


#: The recorder of the demo running in this process (ctrl_c_recorded).
_current: CtrlC | None = None


@contextlib.contextmanager
def ctrl_c_recorded() -> Iterator[CtrlC]:
    """Count every Ctrl-C while the block runs; when it ends (normally or
    not) a counted Ctrl-C becomes ``KeyboardInterrupt``. The recording
    handler stays installed afterwards (a later Ctrl-C still raises, and is
    never lost to a restored ``SIG_IGN``). Main thread only."""
    global _current
    if threading.current_thread() is not threading.main_thread() or (
        (_current is None or not _current.depth) and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    ):
        # An inherited SIG_IGN (a background job, nohup) is kept: whoever
        # started us asked for no Ctrl-C (test_demo.py::test_an_inherited_sig_ign_is_kept).
        yield CtrlC()
        return
    rec = _current if _current is not None else CtrlC()
    _current = rec
    if not rec.depth:
        rec.count = rec.held = 0  # a new run: an earlier run's Ctrl-C was raised then
    signal.signal(signal.SIGINT, rec.handler)
    rec.depth += 1
    try:
        yield rec
    except BaseException:
        if rec.count and not rec.held:
            raise KeyboardInterrupt from None
        raise
    finally:
        rec.depth -= 1
    rec.check()


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold a Ctrl-C until the block is done, then raise it: a tier built
    but not yet registered for close() would otherwise be collected open
    and print a warning after the one "interrupted" line (seen in CI), and
    cleanup must not stop half-way."""
    rec = _current
    if rec is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    rec.held += 1
    try:
        yield
    finally:
        rec.held -= 1
    rec.check()


#: What the forkserver imports once, before it forks any rank.
PRELOAD = ("torch", "fstier.gpu_copy", "fstier.layout", "fstier.demo.ranks")


def start_forkserver(preload: Sequence[str] = PRELOAD) -> Any:
    """The forkserver context, its server running and deaf to Ctrl-C.

    Ctrl-C in a terminal signals the whole process group, and only this
    process should handle it (one line, cleanup, exit 130): the server would
    print a KeyboardInterrupt traceback if the signal hit it while it
    imports torch (it ignores SIGINT itself only once its preload is done),
    and so would each rank. So the server is started with SIGINT *ignored*:
    that disposition survives fork and exec and Python keeps it at start-up,
    while the signal mask does not (the child of Python's spawn starts with
    an empty one: /proc/PID/status shows SigBlk 0). SIGINT is also *blocked*
    in this thread for that instant, so a Ctrl-C meanwhile is not lost: it
    stays pending (Linux never discards a blocked signal, ignored or not)
    and is raised here once the handler, then the mask, are restored. That
    holds only while this is the process's one thread (a process-directed
    signal goes to a thread that does not block it, and SIG_IGN discards it
    there): call this first, before anything that starts threads (importing
    torch does); later calls return the running server's context and touch
    no signal state. The
    ranks are forked from the server and inherit its disposition; rank_main
    ignores SIGINT too, for a server that an earlier demo in this process
    started. Main thread only (elsewhere the signal helpers do nothing).
    """
    from multiprocessing import forkserver, resource_tracker

    global _started
    ctx = mp.get_context("forkserver")
    if _started:
        # Running: never ignore SIGINT again. Once other threads exist (torch
        # starts one), a Ctrl-C that the blocked main thread cannot take goes
        # to one of them and, ignored, is discarded: the demo then ran to
        # completion and exited 0 (seen under load).
        return ctx
    ctx.set_forkserver_preload(list(preload))
    mask = block_sigint()
    pending = mask is not None and signal.SIGINT in signal.sigpending()
    handler = None if pending else ignore_sigint()  # SIG_IGN would discard it
    # forkserver.ensure_running() first starts multiprocessing's resource
    # tracker, which blocks SIGINT for its spawn and then UNBLOCKS it: a
    # Ctrl-C pending (or arriving) then met SIG_IGN and was discarded. Told
    # there is no pthread_sigmask, it leaves the mask (ours, blocked) alone;
    # the tracker starts with SIGINT ignored, as the server does
    # (test_demo.py::test_ctrl_c_while_the_forkserver_starts_is_never_lost).
    tracker: Any = resource_tracker
    tracker_mask = getattr(tracker, "_HAVE_SIGMASK", True)
    try:
        if not pending:
            tracker._HAVE_SIGMASK = False
            forkserver.ensure_running()
            _started = True
    finally:
        tracker._HAVE_SIGMASK = tracker_mask
        restore_sigint(handler)
        restore_sigmask(mask)
    return ctx


#: Whether this process started the demo's forkserver (start_forkserver).
_started = False


class RankProcesses:
    """Four spawned rank processes and their pipes."""

    def __init__(self, n: int) -> None:
        # forkserver: a clean server process imports torch once and forks the
        # ranks from it (importing torch four times costs ~10 s of CPU on two
        # cores); forking the parent itself is unsafe once torch has threads.
        ctx = start_forkserver()
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        try:
            for i in range(n):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=rank_main, args=(child,), name=f"fstier-demo-rank{i}", daemon=True)
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
        except BaseException:  # Ctrl-C included: stop the ranks already started
            self.close()
            raise

    def call(self, targets: Sequence[tuple[int, Any]]) -> list[Any]:
        """Send one message to each (process, message) pair, then collect all
        replies (the processes work concurrently)."""
        for idx, msg in targets:
            try:
                self._conns[idx].send(msg)
            except OSError as exc:
                raise self._dead(idx, msg, exc) from None
        values = []
        for idx, msg in targets:
            conn = self._conns[idx]
            if not conn.poll(REPLY_TIMEOUT_S):
                raise DemoError(f"rank process {idx} did not answer {type(msg).__name__} in {REPLY_TIMEOUT_S} s")
            try:
                reply: Reply = conn.recv()
            except (EOFError, OSError) as exc:
                raise self._dead(idx, msg, exc) from None
            if not reply.ok:
                raise DemoError(f"rank process {idx} failed in {type(msg).__name__}:\n{reply.error}")
            values.append(reply.value)
        return values

    def _dead(self, idx: int, msg: Any, exc: BaseException) -> DemoError:
        self._procs[idx].join(timeout=1.0)
        return DemoError(
            f"rank process {idx} exited (code {self._procs[idx].exitcode}) during "
            f"{type(msg).__name__}: {type(exc).__name__}; its traceback is on stderr"
        )

    def close(self) -> None:
        for conn, proc in zip(self._conns, self._procs, strict=True):
            with contextlib.suppress(OSError, ValueError):
                if proc.is_alive():
                    conn.send(Quit())
                    conn.poll(5.0)
        for conn, proc in zip(self._conns, self._procs, strict=True):
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5.0)
            conn.close()
