"""A C engine job's summary judged into its record's results (the engine's
``_native_engine.c`` summaries; :class:`~fstier.io.engine.native.NativeEngine`
calls these at completion).

- A mixed job (its keys did not all return alike) comes as ``(codes,
  classes, failures)`` (``ce_mixed``): a byte per key naming one of a few
  distinct success tuples (``classes``), or 255: a key listed in
  ``failures`` as ``(key index, tuple)`` in key order, or one given up on
  (its mark byte says which). :func:`judge_mixed` judges each class once
  (one shared, frozen outcome, cached in :data:`SHARED` with the uniform
  successes), picks every key's outcome by its byte in one C-level pass and
  judges only the failures one by one (:func:`outcomes`).
- The C side did the rare work a failure needs before the job was published:
  a load's proven-corrupt file or planted link removed (``remove_bad``), a
  store whose namespace directory was removed under the tier stored again
  after making the directories and the manifest again (``ce_store_again``;
  its success carries the stage :data:`SG_NSBACK`, logged here once per
  job). A key C still failed ENOENT (the root itself gone: C makes nothing
  above the namespace) is handed to ``BlockStore.store_many``, the batch
  path's own hand-back, the one I/O left to Python at completion.

Invariants
    The outcomes are the ones the extension's per-key tuples give
    (:func:`fstier.io.native.load_outcomes` / ``store_outcomes``), key for
    key; only a success is shared between keys.

Costs
    O(1) Python per class and per failed key; the pass over the keys is
    ``map`` over a bytes object (no bytecode per key).
"""

from __future__ import annotations

import errno
import logging
from typing import Any

from fstier.io import native as nat
from fstier.io.engine.record import CANCELLED, EXPIRED, TIMED_OUT, EngineJob

__all__ = ["SG_NSBACK", "SHARED", "judge_mixed", "outcomes", "success"]

log = logging.getLogger("fstier.io")

_MARKS = (None, TIMED_OUT, EXPIRED, CANCELLED)
#: a store's status code for "failed" in the extension's per-key tuples (0 stored, 1 skipped)
_ST_FAILED = 2
#: the stage of a store stored after C made its removed namespace directory again (``SG_NSBACK``)
SG_NSBACK = 12
#: (kind, a success's per-key tuple) -> its one (frozen) outcome: uniform jobs' and mixed jobs' classes
SHARED: dict[tuple[str, tuple[int, ...]], Any] = {}
_SHARED_MAX = 256


def judge_mixed(job: EngineJob, per_key: Any, marks: bytes | None) -> None:
    """``job.results`` from a mixed summary ``(codes, classes, failures)``
    (module docstring); with ``marks``, the keys given up on are
    :data:`TIMED_OUT`, :data:`EXPIRED` or :data:`CANCELLED`, each key its
    own unit, and the slots of keys running or never run are fenced."""
    codes, classes, failures = per_key
    table: list[Any] = [success(job, raw) for raw in classes]
    table += [None] * (256 - len(table))
    outs = list(map(table.__getitem__, codes))  # C-level: no bytecode per key
    if failures:
        idx = [i for i, _ in failures]
        for i, o in zip(idx, outcomes(job, [raw for _, raw in failures], idx), strict=True):
            outs[i] = o
    if marks is None:
        job.results = [outs]
        return
    n = len(job.keys)
    job.bounds = tuple(range(n + 1))
    job.results = [[o] if m == 0 else _MARKS[m] for o, m in zip(outs, marks, strict=True)]
    late = marks.count(1)
    if late:
        # Fenced as a batch call's would be: the keys running and those
        # that never ran (released together, when the last late key returned).
        job.fenced = tuple(job.slots[i] for i in range(n) if marks[i] in (1, 2))
        job.late = late
        log.warning(
            "I/O job %r exceeded its deadline (%ss): %d key(s) still running, %d slot(s) fenced",
            job.tag, job.timeout_s, late, len(job.fenced),
        )


def success(job: EngineJob, raw: Any) -> Any:
    """The one shared outcome of a success tuple (a load LOADED, a store
    STORED or SKIPPED with no O_TMPFILE refusal: no path in it), cached in
    :data:`SHARED`."""
    one = SHARED.get((job.kind, raw))
    if one is None:
        if job.kind == "load":
            one = nat.load_outcomes([raw], ("",))[0]
        else:
            one = nat.store_outcomes([raw], ("",), job.block_io()[0].options)[0]
        if len(SHARED) >= _SHARED_MAX:
            SHARED.clear()
        SHARED[(job.kind, raw)] = one
    return one


def outcomes(job: EngineJob, raw: list[Any], idx: Any) -> list[Any]:
    """The outcomes of per-key tuples ``raw`` of the keys ``idx`` (a failed
    uniform job's, or a mixed job's failures): the one place a key is
    judged alone."""
    blocks, buffers = job.block_io()
    paths = [job.paths[i] for i in idx] if len(raw) != len(job.keys) else job.paths
    if job.kind == "load":
        return nat.load_outcomes(raw, paths)
    if any(r[3] == SG_NSBACK for r in raw):
        log.warning(
            "fstier: namespace directory %s was removed under a running tier; re-created it",
            blocks.mapper.namespace_dir,
        )
    outs = nat.store_outcomes(raw, paths, blocks.options)
    for j, r in enumerate(raw):
        if r[0] == _ST_FAILED and r[1] == errno.ENOENT:
            # Still ENOENT after C made the directories again: the batch
            # path's hand-back, as on the Python engine.
            i = idx[j]
            view = buffers.views(job.slots[i : i + 1], job.nbytes[i : i + 1])[0]
            replace = [bool(job.replace[i])] if job.replace is not None else None
            outs[j] = blocks.store_many([(job.keys[i], view)], replace=replace, paths=[job.paths[i]])[0]
    return outs
