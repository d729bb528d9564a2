"""The tier's public records: what a job did (:class:`JobResult`) and what
changed on disk (:class:`BlockStored`, :class:`BlockRemoved`, together
:data:`TierEvent`).

:class:`fstier.manager.FsTier` returns them from ``get_finished()`` and
``take_events()``; engines' adapters translate them. They are importable
from :mod:`fstier.manager` (and :mod:`fstier`), their public home.

:func:`note_evicted` coalesces a burst of evictions into one event.

Invariants: frozen, slotted values; a result's ``keys_completed`` is always
a leading prefix of the job's keys. Costs: none beyond the values
(:mod:`fstier.tier.results` builds a result with no bytecode per field: ``_NEW``, ``_SET``, ``_RESULT_FIELDS``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from fstier.keys import BlockKey

__all__ = ["BlockRemoved", "BlockStored", "JobResult", "TierEvent", "note_evicted"]


@dataclass(frozen=True, slots=True)
class JobResult:
    """The outcome of one store or load job.

    ``keys_completed`` is always a leading prefix: ``keys[:keys_completed]``
    loaded (load) or are on disk (store: stored, or skipped as already
    present), up to the first failure. ``keys_failed = len(keys) -
    keys_completed`` are misses to recompute (load) or blocks not
    acknowledged (store; a later key of a failed store job may still have
    been written, and :class:`BlockStored` events list exactly which were).
    ``cause`` names the first failure (an errno name such as ``ENOSPC``,
    ``timeout``, ``backpressure``, ``capacity``, ``degraded``, ``slot_busy``,
    ``bad_file:<why>``, ``corrupt:<reason>``, or ``miss``). ``skipped`` counts stores of keys
    already present. ``loaded_after`` (loads): the positions past the prefix
    whose keys loaded and checked anyway, their bytes in their slots (an
    engine that can use a chunk after a miss, e.g. LMCache, takes them;
    others keep the prefix). ``context``: what the caller passed with the
    job (``submit_store(..., context=...)``), given back untouched, so a
    caller needs no table of its jobs (not compared, not in the repr).
    """

    job_id: Hashable
    kind: Literal["store", "load"]
    success: bool
    keys_completed: int
    keys_failed: int
    nbytes: int
    seconds: float
    cause: str | None = None
    skipped: int = 0
    loaded_after: tuple[int, ...] = ()
    context: Any = field(default=None, compare=False, repr=False)


#: a result built with no ``__init__`` line per field (tier/results.py): new, then each field set by C-level loops
_NEW, _SET = object.__new__, object.__setattr__
_RESULT_FIELDS = tuple(f.name for f in fields(JobResult))


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Keys whose block files this tier wrote (not the skipped ones)."""

    keys: tuple[BlockKey, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Keys whose files were removed: ``reason`` is ``evicted``, ``corrupt``
    or ``cleared`` (:meth:`FsTier.clear`)."""

    keys: tuple[BlockKey, ...]
    reason: str = "evicted"


TierEvent = BlockStored | BlockRemoved


def note_evicted(events: list[TierEvent], key: BlockKey) -> None:
    """Add ``key``'s eviction to ``events``, a burst of evictions coalesced
    into one ``BlockRemoved(keys, "evicted")`` event (the caller holds the
    list's lock)."""
    last = events[-1] if events else None
    if isinstance(last, BlockRemoved) and last.reason == "evicted":
        events[-1] = BlockRemoved((*last.keys, key), "evicted")
    else:
        events.append(BlockRemoved((key,), "evicted"))
