"""Recency: LRU order lives in block files' mtimes, written in batches.

atime is unreliable (``relatime``/``noatime``), so a hit (a load, or a store
of a present key) is recorded in memory and written to the file's mtime at
most every :data:`FLUSH_S` seconds, or once :data:`MAX_PENDING` distinct
files are pending, and before every capacity pass: a hot block costs one
metadata write per interval, not one per hit (a SETATTR round trip on NFS).
The writes run as their own job (a ``"call"`` job naming the block store
and the files) on the engine's write queue, so no load waits for them;
every process's eviction and ``fstier gc`` read them. Hits of a batch are
noted under one lock (:meth:`Recency.note_many`). On the native path a
flush is ONE C job of the C engine (``engine_touch``: its worker touches
the files, no Python thread runs it), or ONE call
(:meth:`BlockStore.touch_many`, GIL released) on the Python engine's
thread; on the Python path one touch per file. Either way no symlink is
followed and a file with a second link is left alone
(test_recency_batch.py). A finished job's hits are noted by key
(:meth:`Recency.note_keys`): their paths are named at the flush, once per
file per interval, not per job.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from functools import partial
from operator import attrgetter
from pathlib import Path

from fstier.clock import SYSTEM_CLOCK, Clock
from fstier.errors import IOPoolClosedError
from fstier.io import BlockStore, EngineJob, Registration, touch_file
from fstier.keys import BlockKey

__all__ = ["FLUSH_S", "MAX_PENDING", "Recency"]

#: Hits are recorded in memory and written to the files' mtimes (their LRU
#: recency, read by every process's eviction and by ``fstier gc``) at most this
#: often, and before every capacity pass: a hot block costs one metadata
#: write per interval, not one per hit (a SETATTR round trip on NFS).
FLUSH_S = 5.0
#: ... or as soon as this many distinct files are pending.
MAX_PENDING = 4096
#: a key's identity made in C (``BlockKey.__hash__`` is a Python function)
_ID = attrgetter("block_hash", "group_idx")


def _bump_mtimes(paths: Sequence[str], blocks: BlockStore | None = None) -> None:
    """Evicted or replaced meanwhile is fine; never through a symlink. One
    native call for the batch when ``blocks`` runs the native path."""
    if blocks is not None:
        blocks.touch_many(paths)
        return
    for p in paths:
        touch_file(p)


class Recency:
    """Pending hits of one tier, flushed to mtimes through ``io``'s write queue
    (each flush's deadline ``timeout_s``)."""

    def __init__(
        self, io: Registration, blocks: BlockStore | None = None, *, clock: Clock = SYSTEM_CLOCK,
        timeout_s: float | None = None,
    ) -> None:
        self._io = io
        self._timeout_s = timeout_s
        #: the store whose files are touched (one native call per flush), or
        #: None: one Python touch per file
        self._blocks = blocks
        self._clock = clock
        self._lock = threading.Lock()
        self._recent: dict[str, None] = {}  # files hit since the last flush, in order
        #: keys hit since the last flush (note_keys), by identity: their paths are named at the flush
        self._recent_keys: dict[tuple[bytes, int], BlockKey] = {}
        self._flushed = self._clock.monotonic()
        self._seq = 0

    def note(self, path: Path | str) -> None:
        """Record a hit. Recency lives in the file's mtime because atime is
        unreliable (relatime/noatime); the writes are batched per file and run
        as their own write-queue job, so no load waits for them."""
        self.note_many((os.fspath(path),))

    def note_many(self, paths: Sequence[str]) -> None:
        """Record hits on ``paths`` (a batch's keys): one lock for them all."""
        if not paths:
            return
        with self._lock:
            self._recent.update(dict.fromkeys(paths))
            if len(self._recent) + len(self._recent_keys) < MAX_PENDING and (
                    self._clock.monotonic() - self._flushed < FLUSH_S):
                return  # not due: written by a later batch or the periodic flush
            take = self._take_locked()
        self._submit_flush(take)

    def note_keys(self, keys: Sequence[BlockKey]) -> None:
        """Record hits on ``keys`` of this recency's block store (a finished
        job's): one lock, and no path named now (:meth:`note_many`'s
        batching; the paths are named once, at the flush)."""
        if self._blocks is None:
            raise ValueError("Recency.note_keys: this Recency has no block store to name the keys' files; pass blocks=")
        if not keys:
            return
        with self._lock:
            self._recent_keys.update(zip(map(_ID, keys), keys, strict=True))
            if len(self._recent) + len(self._recent_keys) < MAX_PENDING and (
                    self._clock.monotonic() - self._flushed < FLUSH_S):
                return  # not due: written by a later batch or the periodic flush
            take = self._take_locked()
        self._submit_flush(take)

    def pending(self) -> list[str]:
        """The paths a flush would touch now, each once (a look: nothing is taken)."""
        with self._lock:
            return self._paths_locked()

    def _submit_flush(self, take: list[str]) -> None:
        """Write ``take``'s mtimes as one write-queue job (here when the engine is closing)."""
        with self._lock:
            self._seq += 1
            job_id = ("recency", self._seq)
        if take:
            try:
                self._io.submit(EngineJob(
                    job_id, "call", blocks=self._blocks, paths=take, timeout_s=self._timeout_s,
                    call=partial(_bump_mtimes, take, self._blocks),
                ))
            except IOPoolClosedError:  # the tier is closing: do it here
                _bump_mtimes(take, self._blocks)

    def _paths_locked(self) -> list[str]:
        if not self._recent_keys or self._blocks is None:  # (note_keys refuses keys without a block store)
            return list(self._recent)
        return list(dict.fromkeys([*self._recent, *self._blocks.paths(list(self._recent_keys.values()))]))

    def _take_locked(self) -> list[str]:
        paths = self._paths_locked()
        self._recent, self._recent_keys = {}, {}
        self._flushed = self._clock.monotonic()
        return paths

    def flush(self) -> None:
        """Bump the mtime of every file hit since the last flush, once each."""
        with self._lock:
            paths = self._take_locked()
        _bump_mtimes(paths, self._blocks)
