"""The one record of a job, from the caller's submit to its completion, and
how a job is cut into units.

An :class:`EngineJob` is created by the caller (:class:`fstier.manager.FsTier`
builds one per ``submit_store`` / ``submit_load``), handed to an engine's
``submit``, moved by the engine's I/O threads, and given back, finished, by
the registration's ``collect``. Nothing else stands for the job: no op
table, no per-batch record, no result object in between. The caller's tag
(its job id) rides on it.

A job is cut into *units* (:func:`plan`): keys ``bounds[u]:bounds[u + 1]``,
each moved by one call of one I/O thread. On the native backend a job is
ONE unit, moved by that thread and up to ``helpers`` C helper threads inside
the call (``min(threads, n // MIN_KEYS_PER_THREAD)`` threads in all); on the
Python backend one key is one unit, so any idle thread takes the job's next
key. Which helpers a native load starts at once (:func:`load_eager`): a
buffered load of cached files only copies and hashes, so no more threads
than the process has CPUs (8 on 2 CPUs loaded cached 256 KiB files 25%
slower than 2); the rest start as reads would block (``RWF_NOWAIT`` in C).
Direct loads and every store start all of them (32 buffered 256 KiB stores
ran 9-15% faster with 7 helpers than with 1, at the same CPU per GB).

Invariants
    Every mutable field changes only under the engine's lock. ``results[u]``
    is :data:`PENDING` until unit ``u`` returned, or the engine gave up on it
    (:data:`TIMED_OUT`: it was running at the deadline; :data:`EXPIRED`: it
    had not started; :data:`CANCELLED`: the engine shut down first); a unit
    the engine gave up on never publishes a result. ``fenced`` names the
    slots of the units running at the deadline; ``released`` turns true once
    every one of them returned (no late call can touch a buffer any more).

Costs
    One record per job: its constructor sets the caller's fields only (the
    engine's start at class defaults); :func:`plan` is arithmetic;
    :data:`CPUS` is read once at import.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from fstier.io.blockstore import BlockStore
    from fstier.keys import BlockKey

__all__ = [
    "CANCELLED",
    "CPUS",
    "EXPIRED",
    "MIN_KEYS_PER_THREAD",
    "PENDING",
    "TIMED_OUT",
    "Buffers",
    "EngineJob",
    "Marker",
    "load_eager",
    "plan",
]

_NEW = object.__new__

#: Keys per native thread at least (a job is spread across threads, but not
#: into shares smaller than this: each costs a thread start).
MIN_KEYS_PER_THREAD = 4

#: CPUs this process may run on: how many threads a load that only copies
#: and hashes can keep busy.
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class Marker:
    """A named sentinel standing in ``EngineJob.results`` for a unit that
    returned nothing."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name

    def __reduce__(self) -> str:
        return self._name


#: The unit was running at its job's deadline; its late result is dropped.
TIMED_OUT = Marker("OP_TIMED_OUT")
#: The unit was still queued when the engine (or its registration) shut down.
CANCELLED = Marker("OP_CANCELLED")
#: The unit had not started at its job's deadline; it never runs (no buffer
#: is touched by it, now or later).
EXPIRED = Marker("OP_EXPIRED")
#: The unit has not returned yet.
PENDING = Marker("PENDING")

Kind = Literal["store", "load", "call", "probe"]


class Buffers(Protocol):
    """Where a job's bytes live: the payload views of some of its slots
    (exactly each payload's bytes, never a byte past them)."""

    def views(self, slots: Sequence[int], nbytes: Sequence[int]) -> list[memoryview]: ...


class EngineJob:
    """One job, submit to completion (see the module docstring).

    A ``"call"`` job is one unit that runs ``call()`` (a recency flush);
    its result is dropped and nothing is published for it. A ``"probe"``
    job is a call job that a caller waits for (a presence probe on the
    Python I/O path, :class:`~fstier.io.aio.AsyncBlockIO`'s ``present``): it
    waits in the engine's probe queue, which every thread takes before reads
    and writes, and hands its answer back through its own ``call``.

    A plain class: the constructor sets the caller's fields and the empty
    results list; the engine's fields start at their class defaults and are
    set (on the instance) by the engine that runs the job, so a job costs
    no assignment of a field its engine never writes."""

    tag: Hashable
    kind: Kind
    keys: tuple[BlockKey, ...]
    slots: tuple[int, ...]
    #: each key's payload bytes
    nbytes: tuple[int, ...]
    blocks: BlockStore | None
    buffers: Buffers | None
    _paths: Sequence[str] | None
    #: a store's per-key "replace the file" flags (a key whose last load failed), or None
    replace: Sequence[bool] | None
    #: seconds from submission to the deadline (None: no deadline)
    timeout_s: float | None
    call: Callable[[], Any] | None
    #: what the caller keeps on the record and reads back at completion (no table of its own)
    context: Any
    #: bytes of the write budget its submit reserved, marked as they were (``WriteBudget.admit``): what a submit
    #: interrupted before the engine took the job gives back (0: nothing, or given back already)
    reserved: int = 0
    #: bytes of the root's usage count its submit counted (``max_bytes``: ``Capacity.try_reserve``), marked in
    #: the statement that counts them, given back as ``reserved`` is
    counted: int = 0
    # -- set by the engine ---------------------------------------------------
    results: list[Any]
    bounds: tuple[int, ...] = ()
    helpers: int = 0
    #: the one outcome every key of the job returned alike (the engine's
    #: compact summary: ``results`` then holds it once per key), or None
    uniform: Any = None
    #: units handed to a thread so far (units below it started)
    started_units: int = 0
    #: units with no result yet
    remaining: int = 0
    #: the engine's clock at submission, and the deadline on it
    submitted: float = 0.0
    deadline: float = float("inf")
    #: wall time (perf_counter) at submission and when the last unit returned or the job timed out
    t_submit: float = 0.0
    t_end: float = 0.0
    done: bool = False
    #: slots of units running at the deadline, fenced until they return
    fenced: tuple[int, ...] = ()
    #: units running past the deadline that have not returned yet
    late: int = 0
    released: bool = False
    #: set True by the engine at the exact point it takes the job (in C by the call that queues it, or right
    #: after the Python engine's queue append): a submit interrupted before it gives the job back, one after it
    #: leaves the job to complete and be published (``FsTier`` and the engines roll back only when False)
    accepted: bool = False
    #: the registration that collects it (set by ``submit``)
    owner: Any = None

    def __init__(
        self, tag: Hashable, kind: Kind, keys: tuple[BlockKey, ...] = (), slots: tuple[int, ...] = (),
        nbytes: tuple[int, ...] = (), blocks: BlockStore | None = None, buffers: Buffers | None = None,
        paths: Sequence[str] | None = None, replace: Sequence[bool] | None = None, timeout_s: float | None = None,
        call: Callable[[], Any] | None = None, context: Any = None,
    ) -> None:
        self.tag = tag
        self.kind = kind
        self.keys = keys
        self.slots = slots
        self.nbytes = nbytes
        self.blocks = blocks
        self.buffers = buffers
        self._paths = paths
        self.replace = replace
        self.timeout_s = timeout_s
        self.call = call
        self.context = context
        self.results = []

    @classmethod
    def made(cls, fixed: Mapping[str, Any], **fields: Any) -> EngineJob:
        """A record with the caller's ``fixed`` fields (those that do not
        change from job to job: block store, buffers, deadline; every caller
        field of ``__init__`` between them and ``fields``, ``paths`` as
        ``_paths``) and the job's own ``fields``, set in one update: a
        tier's submit runs no line per field."""
        job = _NEW(cls)
        job.__dict__.update(fixed, results=[], **fields)
        return job

    def __repr__(self) -> str:
        return f"EngineJob({self.tag!r}, {self.kind!r}, keys={len(self.keys)}, done={self.done})"

    @property
    def paths(self) -> Sequence[str]:
        """Each key's file path (``blocks.paths(keys)``), named on first use
        (the C engine formats its own names: a uniform store never needs them)."""
        paths = self._paths
        if paths is None:
            paths = self._paths = () if self.blocks is None else self.blocks.paths(self.keys)
        return paths

    @property
    def kind_queue(self) -> str:
        """The queue it waits in: loads are reads, probes probes, stores and calls writes."""
        kind = self.kind
        return "read" if kind == "load" else "probe" if kind == "probe" else "write"

    def block_io(self) -> tuple[BlockStore, Buffers]:
        """The block store and buffers a store or load job moves its keys
        with. A job without them (a call job, a record built by hand) is a
        caller's bug: one ``ValueError`` naming the job, never an ``assert``
        that ``python -O`` drops."""
        if self.blocks is None or self.buffers is None:
            raise ValueError(
                f"engine job {self.tag!r} ({self.kind}) has no block store or buffers: "
                "only a store or load job built by its tier moves keys"
            )
        return self.blocks, self.buffers

    def unit_keys(self, unit: int) -> range:
        """The key indices unit ``unit`` moves."""
        return range(self.bounds[unit], self.bounds[unit + 1])

    @property
    def seconds(self) -> float:
        """Wall time from submission to the last unit's end (or the deadline)."""
        return max(0.0, self.t_end - self.t_submit)


def plan(n: int, threads: int, batched: bool) -> tuple[tuple[int, ...], int]:
    """``(bounds, helpers)`` for ``n`` keys and ``threads`` free threads:
    ``batched`` (native): one unit of every key with up to ``helpers`` C
    helper threads inside its call; else one key per unit and no helpers."""
    if not batched:
        return tuple(range(n + 1)), 0
    return (0, n), max(1, min(threads, n // MIN_KEYS_PER_THREAD)) - 1


def bounds(n: int, threads: int, batched: bool) -> tuple[int, ...]:
    """One call per thread (no helpers): at most ``threads`` near-equal
    parts of at least :data:`MIN_KEYS_PER_THREAD` keys; Python: one key each."""
    if not batched:
        return tuple(range(n + 1))
    parts = max(1, min(threads, n // MIN_KEYS_PER_THREAD))
    return tuple(n * j // parts for j in range(parts + 1))


def load_eager(helpers: int, o_direct: bool) -> int:
    """The helpers a native load call starts at once (the rest of
    ``helpers`` start as reads would block): all for direct I/O (every read
    goes to the device), else one thread per CPU."""
    return helpers if o_direct else max(0, min(helpers, CPUS - 1))
