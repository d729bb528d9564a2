"""What the tier hands the engine with a job: each key's payload bytes
(:func:`payload_sizes`), where the bytes live (:class:`SlotBuffers`: the
slot provider's payload views) and the job's one record (:class:`JobMaker`:
keys, slots, a store's replace flags, the deadline; paths named on first use).

The job's one record is the engine's :class:`~fstier.io.engine.EngineJob`;
the tier keeps no table or per-batch record of its own.

Invariants
    A job moves exactly each key's payload bytes of its slot, never a byte
    past them (:func:`~fstier.slots.provider.payload_views`).

Costs
    :func:`payload_sizes`: a product for a one-group model (its file size
    cached per payload length), O(keys) otherwise. :meth:`SlotBuffers.views`: C-level loops where the provider
    has a batch ``slot_views``; no bytecode per key.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from functools import lru_cache, partial
from typing import Any, Literal

from fstier.io import BlockStore, EngineJob, block_file_size
from fstier.keys import BlockKey
from fstier.slots.provider import SlotProvider, payload_views
from fstier.tier.lookup import LookupCache

__all__ = ["JobMaker", "SlotBuffers", "payload_sizes"]

#: :func:`~fstier.io.block_file_size` of a tier's few payload lengths, cached (a hit runs no Python line)
_file_size = lru_cache(maxsize=256)(block_file_size)


def payload_sizes(payload_len: Sequence[int], keys: Sequence[BlockKey]) -> tuple[tuple[int, ...], int]:
    """Each key's payload bytes (``payload_len`` by group) and the bytes of
    their files in all. One group (the common model): a product, no loop
    over the keys."""
    if len(payload_len) == 1:
        return (payload_len[0],) * len(keys), _file_size(payload_len[0]) * len(keys)
    op_bytes = tuple(payload_len[k.group_idx] for k in keys)
    return op_bytes, sum(map(_file_size, op_bytes))


class SlotBuffers:
    """The engine's view of a tier's slots (:class:`fstier.io.engine.record.Buffers`):
    ``views`` is the provider's own ``payload_views_checked`` (a job's slots were
    checked by ``check_job`` before its record was made: the slicing alone) or
    ``payload_views`` where it has one (no call in between per job), else
    :func:`~fstier.slots.provider.payload_views`."""

    __slots__ = ("_pool", "views")

    def __init__(self, pool: SlotProvider) -> None:
        self._pool = pool
        own = getattr(pool, "payload_views_checked", None) or getattr(pool, "payload_views", None)
        self.views: Callable[[Sequence[int], Sequence[int]], list[memoryview]] = (
            own if own is not None else partial(payload_views, pool)
        )


class JobMaker:
    """Builds the one record of each job of a tier (``blocks``' files,
    ``pool``'s slots, deadline ``timeout_s`` after submission): the fields
    that do not change from job to job are one dict, set with the job's own
    in one update (no line per field)."""

    def __init__(self, blocks: BlockStore, pool: SlotProvider, cache: LookupCache, timeout_s: float | None) -> None:
        self._cache = cache
        self._fixed: dict[str, Any] = {
            "blocks": blocks, "buffers": SlotBuffers(pool), "_paths": None, "timeout_s": timeout_s, "call": None,
        }

    def job(
        self, job_id: Hashable, kind: Literal["store", "load"], keys: tuple[BlockKey, ...],
        slots: tuple[int, ...], nbytes: tuple[int, ...], context: Any = None,
    ) -> EngineJob:
        """The record (its paths named on first use, by ``EngineJob.paths``); a
        store replaces the files of keys whose last load failed (bad); the
        caller's ``context`` rides on it to the job's result."""
        replace = self._cache.bad_flags(keys) if kind == "store" else None
        return EngineJob.made(self._fixed, tag=job_id, kind=kind, keys=keys, slots=slots, nbytes=nbytes,
                              replace=replace, context=context)
