"""The job engine: the storage layer's one asynchronous face.

A caller (:class:`fstier.manager.FsTier`) registers with an engine once
(:meth:`Engine.register`: a :class:`Registration`, where its finished jobs
wait), then per job builds ONE :class:`~fstier.io.engine.record.EngineJob`
(keys, slots, paths, buffers, kind, deadline, its tag) and submits it; the
engine's I/O threads move it, and :meth:`Registration.collect` gives the
same record back, finished: one result per unit, or a marker for a unit the
engine gave up on (:data:`TIMED_OUT`, :data:`EXPIRED`, :data:`CANCELLED`).

Deadlines and fences live in the engine: a job past its deadline completes
as timed out, the slots of its units still running named in ``job.fenced``;
when the last of them returns ``job.released`` turns true and the
registration's ``on_released(job)`` runs, so the owner unfences them.

One engine per process and thread configuration (:func:`shared_engine`)
serves every namespace: a namespace costs a registration, not threads. The
last registration to close stops the engine's threads; a forked child never
inherits an engine (it builds its own on first use).

Adding a backend
    A backend is a class with the :class:`Engine` methods whose
    registrations have the :class:`Registration` methods, honouring the
    record's invariants (:mod:`~fstier.io.engine.record`): every job is
    published exactly once, by its deadline; a unit given up on never
    publishes and its slots stay in ``job.fenced`` until it returned.
    :class:`~fstier.io.engine.python.PythonEngine` is the worked example.

Costs
    :func:`shared_engine`: one dict lookup under a lock per registration.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Protocol

from fstier.clock import SYSTEM_CLOCK, Clock
from fstier.errors import ConfigError, IOPoolClosedError
from fstier.io.engine.python import PythonEngine, Registration
from fstier.io.engine.record import CANCELLED, EXPIRED, PENDING, TIMED_OUT, EngineJob, Marker

__all__ = [
    "CANCELLED",
    "EXPIRED",
    "PENDING",
    "TIMED_OUT",
    "Engine",
    "EngineJob",
    "Marker",
    "PythonEngine",
    "Registration",
    "shared_engine",
]


class Engine(Protocol):
    """What a backend implements (see "Adding a backend")."""

    backend: str
    read_threads: int
    write_threads: int

    @property
    def closed(self) -> bool: ...

    def register(
        self, on_complete: Callable[[str], None] | None = None,
        on_released: Callable[[EngineJob], None] | None = None, notify_fds: Mapping[str, int] | None = None,
    ) -> Registration: ...

    def submit(self, reg: Registration, job: EngineJob) -> None: ...

    def spare_threads(self, queue: str) -> int: ...

    def queue_depth(self, queue: str) -> int: ...

    @property
    def stuck_threads(self) -> int: ...

    def shutdown(self, timeout: float | None = 10.0) -> None: ...


_lock = threading.Lock()
_engines: dict[tuple[int, int, int, str], Engine] = {}

#: The backends :func:`shared_engine` builds; ``FSTIER_ENGINE`` picks one. Unset: ``native`` (the C
#: engine) for a caller on the native I/O path where the extension has the engine, else ``python``.
BACKENDS = ("python", "native")


def _backend(backend: str | None, native_io: bool = False) -> str:
    """The backend to build: ``backend``, else ``FSTIER_ENGINE``, else the default (above)."""
    name = backend or os.environ.get("FSTIER_ENGINE", "").strip()
    if not name:
        from fstier.io.engine.native import available

        name = "native" if native_io and available() else "python"
    if name not in BACKENDS:
        raise ConfigError(f"FSTIER_ENGINE={name!r} names no job engine; use one of {', '.join(BACKENDS)}")
    return name


def _make(backend: str, read_threads: int, write_threads: int, clock: Clock) -> Engine:
    if backend == "native":
        from fstier.io.engine.native import NativeEngine, available

        if not available():
            raise ConfigError(
                "FSTIER_ENGINE=native, but fstier's native extension is not built; "
                "reinstall fstier where a C compiler exists, or unset FSTIER_ENGINE"
            )
        return NativeEngine(read_threads, write_threads, clock=clock)
    return PythonEngine(read_threads, write_threads, clock=clock)


def _forget_after_fork() -> None:
    """A child starts with no engine: the parent's threads do not exist in it."""
    global _lock
    _lock = threading.Lock()
    _engines.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def shared_engine(
    read_threads: int, write_threads: int, *, clock: Clock = SYSTEM_CLOCK,
    on_complete: Callable[[str], None] | None = None,
    on_released: Callable[[EngineJob], None] | None = None, backend: str | None = None,
    native_io: bool = False,
    notify_fds: Mapping[str, int] | None = None,
) -> Registration:
    """A registration with this process's engine of ``read_threads`` read-
    and ``write_threads`` write-priority threads on ``clock`` (one engine per
    such triple and backend, started by its first registration). ``backend``:
    ``"python"`` or ``"native"`` (None: ``FSTIER_ENGINE``, else the C engine
    when ``native_io`` (the caller's blocks move on the native I/O path) and
    the extension has it, else python). ``notify_fds``: an eventfd per job
    kind the engine writes when a job of that kind is published or released
    (the C engine in C), in place of ``on_complete`` (:class:`Registration`)."""
    name = _backend(backend, native_io)
    key = (read_threads, write_threads, id(clock), name)
    with _lock:
        engine = _engines.get(key)
        if engine is not None and not engine.closed:
            try:
                return engine.register(on_complete, on_released, notify_fds)
            except IOPoolClosedError:  # its last registration closed meanwhile
                pass
        engine = _engines[key] = _make(name, read_threads, write_threads, clock)
        return engine.register(on_complete, on_released, notify_fds)
