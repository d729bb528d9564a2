"""The demo's rank processes from the parent's side, and its Ctrl-C rules.

:class:`RankProcesses` starts the four rank processes
(:func:`fstier.demo.ranks.rank_main`) from a forkserver that imported torch
once, sends each a message and collects the replies (the processes work
concurrently); a rank that fails, exits or does not answer within
:data:`REPLY_TIMEOUT_S` is a :class:`DemoError` naming it.

Ctrl-C: a terminal signals the whole process group, and only the parent
handles it (one line, cleanup, exit 130). The forkserver is spawned with
SIGINT ignored and blocked (:func:`start_forkserver`: it and its ranks never
see the signal, and a Ctrl-C meanwhile stays pending here and is raised
right after), a tier is built with the signal *deferred*
(:func:`sigint_deferred`) so it is registered for ``close()`` before the
interrupt lands, and cleanup runs with SIGINT *ignored*
(:func:`ignore_sigint`) so a second Ctrl-C cannot leave ranks, temp files
or the shared memory segment behind. Each helper acts on the main thread
only (signals cannot be set elsewhere) and does nothing on another thread.
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
    "DemoError",
    "RankProcesses",
    "block_sigint",
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


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold a Ctrl-C until the block is done, then raise it: a tier built
    but not yet registered for close() would otherwise be collected open
    and print a warning after the one "interrupted" line (seen in CI)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt


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
    from multiprocessing import forkserver

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
    try:
        if not pending:
            forkserver.ensure_running()
            _started = True
    finally:
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
