"""The recency flush as a C touch job of the
:class:`~fstier.io.engine.native.NativeEngine` (``engine_touch``).

A ``"call"`` job naming a native block store's files (``blocks``, ``paths``,
no keys: :class:`~fstier.tier.recency.Recency`'s flush) is queued on the C
engine's write queue and run by a C worker, its deadline kept by the C
watchdog; its ``call`` never runs, so no Python thread touches a file.
Its events are told apart from other jobs' by the tag alone (:data:`TAGS`).

Invariants
    A touch job is finished like a call job: ``results`` is ``[None]``, or
    :data:`~fstier.io.engine.record.TIMED_OUT` / ``CANCELLED`` when names were
    given up on; its "released" event (a late touch returned) is only logged.

Costs
    One C call to submit (the names split below the base in one call), one
    event to finish.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from fstier.io import native as nat
from fstier.io.engine.python import Registration
from fstier.io.engine.record import CANCELLED, TIMED_OUT, EngineJob

if TYPE_CHECKING:  # pragma: no cover
    from fstier.io.engine.native import NativeEngine

__all__ = ["TAGS", "finished", "submit"]

log = logging.getLogger("fstier.io")

#: the tag bit of a touch job: its events are told apart by the tag alone
TAGS = 1 << 62


def submit(engine: NativeEngine, reg: Registration, job: EngineJob) -> None:
    """Queue ``job`` (a call job naming a native block store's files) as a C
    touch job of ``engine`` for ``reg``; finished by :func:`finished`."""
    base = os.fspath(job.blocks.mapper.blocks_dir)  # type: ignore[union-attr]  # checked by the caller
    rels = nat.split(base, job.paths)
    job.owner = reg
    job.t_submit = time.perf_counter()
    job.bounds, job.helpers = (0, 1), 0
    job.results = []
    job.remaining = 1
    tag, base_b = TAGS | next(engine._tags), os.fsencode(base)
    timeout = -1.0 if job.timeout_s is None else float(job.timeout_s)
    with engine.lock:
        engine._check_open(reg, job)
        try:  # C marks job.accepted as it takes the job: only a job C does not have is rolled back
            reg.active += 1
            engine._jobs[tag] = job
            engine._ext.engine_touch(engine._cap, tag, base_b, rels, timeout, job)
        except BaseException:
            if not job.accepted:
                engine._jobs.pop(tag, None)
                reg.active -= 1
            raise


def finished(engine: NativeEngine, ev: tuple[Any, ...]) -> None:
    """A touch job's event from ``engine``'s collect (see the module docstring)."""
    tag = ev[0]
    if ev[1] == 1:
        with engine.lock:
            job = engine._jobs.pop(tag)
        log.warning("late call job %r returned after its deadline", job.tag)
        return
    marks = ev[5]
    with engine.lock:
        job = engine._jobs[tag] if marks is not None and 1 in marks else engine._jobs.pop(tag)
    job.results = [None if not marks or not any(marks) else CANCELLED if 3 in marks else TIMED_OUT]
    engine._finish(job, ev[2])
