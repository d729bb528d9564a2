"""Lookup: the short-lived answer cache and the existence probe (:class:`Lookup`).

A lookup answers from :class:`LookupCache` (present/absent answers that
live ``tier.lookup_cache_ttl_s``, and the *bad* set: keys whose load failed,
never a hit again until stored again) or from ``lstat`` calls
(:func:`exist_many`; a FIFO, socket or directory at a block path is a miss).
While the circuit breaker is open every key is absent (no system call).
:class:`Lookup` counts what it answers in the tier's metrics (keys looked up,
hits, misses, lookup seconds). Costs: a cached answer is one dict lookup under one lock per batch; an
uncached one is one ``lstat`` (~3 us warm, ~80 us cold). Memory is bounded:
at most 2**20 answers and 2**18 bad keys.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from fstier.keys import BlockKey
from fstier.tier.admission import Breaker
from fstier.tier.metrics import TierMetrics

__all__ = ["Lookup", "LookupCache", "exist_many", "is_block_file"]

_CACHE_MAX_ENTRIES = 1 << 20
_BAD_MAX_ENTRIES = 1 << 18


class LookupCache:
    """Short-lived present/absent answers plus the *bad* set (keys whose load
    failed; never a hit until stored again). One lock; batch methods take it
    once per batch."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl = ttl_s
        self._entries: dict[BlockKey, tuple[bool, float]] = {}
        self._bad: OrderedDict[BlockKey, None] = OrderedDict()
        self._lock = threading.Lock()

    def get_many(self, keys: Sequence[BlockKey], now: float) -> list[bool | None]:
        out: list[bool | None] = []
        with self._lock:
            entries, bad = self._entries, self._bad
            for k in keys:
                if k in bad:
                    out.append(False)
                    continue
                e = entries.get(k)
                out.append(e[0] if e is not None and e[1] > now else None)
        return out

    def put_many(self, keys: Sequence[BlockKey], present: bool, now: float) -> None:
        if self.ttl <= 0 or not keys:
            return
        expiry = now + self.ttl
        with self._lock:
            if len(self._entries) + len(keys) > _CACHE_MAX_ENTRIES:
                self._entries = {k: v for k, v in self._entries.items() if v[1] > now}
                if len(self._entries) + len(keys) > _CACHE_MAX_ENTRIES:
                    self._entries.clear()
            for k in keys:
                self._entries[k] = (present, expiry)

    def stored(self, keys: Sequence[BlockKey], now: float) -> None:
        """Keys now present on disk (stored, or found present by a store)."""
        with self._lock:
            for k in keys:
                self._bad.pop(k, None)
        self.put_many(keys, True, now)

    def mark_bad(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            for k in keys:
                self._entries.pop(k, None)
                self._bad[k] = None
                self._bad.move_to_end(k)
            while len(self._bad) > _BAD_MAX_ENTRIES:
                self._bad.popitem(last=False)

    def is_bad(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._bad

    def forget(self, keys: Sequence[BlockKey]) -> None:
        """Keys whose files were removed: drop any cached answer."""
        with self._lock:
            for k in keys:
                self._entries.pop(k, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def is_block_file(path: str) -> bool:
    """True when ``path`` is a regular file (not followed if a symlink). A
    FIFO, socket or directory planted at a block path is a miss here, not a
    hit whose load then fails; lstat costs what ``os.path.exists`` does."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return False


def exist_many(paths: Sequence[str]) -> list[bool]:
    return [is_block_file(p) for p in paths]

# ---------------------------------------------------------------- the probe
#: Lookup batches at least this long (uncached) are stat-ed in parallel chunks.
_PARALLEL_LOOKUP_MIN = 512
_LOOKUP_CHUNK = 256


class Lookup:
    """Which keys' block files are present: ``cache`` first, then ``lstat``
    of ``path(key)``; batches of at least 512 uncached keys are probed in
    chunks of 256 on ``workers`` lookup threads (created on first need), in
    waves, so an early miss wastes at most one wave."""

    def __init__(
        self,
        cache: LookupCache,
        path: Callable[[BlockKey], str],
        num_groups: int,
        workers: int,
        *,
        breaker: Breaker,
        metrics: TierMetrics,
    ) -> None:
        self._breaker = breaker
        self._metrics = metrics
        self._cache = cache
        self._path = path
        self._num_groups = num_groups
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading ``keys`` present (0 while the breaker is open), counted."""
        t0 = time.perf_counter()
        n = len(keys)
        m = self._metrics
        m.lookup_keys.inc(n)
        if not self._breaker.allow():
            m.misses.inc()
            return 0
        hits = self.prefix(keys)
        m.hits.inc(hits)
        if hits < n:
            m.misses.inc()
        m.lookup_seconds.observe(time.perf_counter() - t0)
        return hits

    def present_counted(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether it is present (all absent while the breaker is
        open); keys and hits are counted when any key was probed on disk."""
        if not self._breaker.allow():
            return [False] * len(keys)
        out, probed = self.present(keys)
        if probed:
            self._metrics.lookup_keys.inc(len(keys))
            self._metrics.hits.inc(sum(out))
        return out

    def prefix(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading ``keys`` present (stops at the first miss)."""
        n = len(keys)
        first = min(n, _LOOKUP_CHUNK)
        hits = self._probe_chunk(keys[:first])
        if hits == first and n - first >= _PARALLEL_LOOKUP_MIN:
            hits += self._parallel_probe(keys, first)
        elif hits == first and first < n:
            hits += self._probe_chunk(keys[first:])
        return hits

    def present(self, keys: Sequence[BlockKey]) -> tuple[list[bool], bool]:
        """Per key, whether it is present (no prefix stop), and whether any
        key had to be probed on disk (False: all answers came from the cache)."""
        now = time.monotonic()
        states = self._cache.get_many(keys, now)
        out = [bool(s) for s in states]
        ngroups = self._num_groups
        todo = [i for i, s in enumerate(states) if s is None and keys[i].group_idx < ngroups]
        if not todo:
            return out, False
        paths = [self._path(keys[i]) for i in todo]
        if len(todo) < _PARALLEL_LOOKUP_MIN:
            found = exist_many(paths)
        else:
            executor = self._executor()
            futures = [
                executor.submit(exist_many, paths[j : j + _LOOKUP_CHUNK])
                for j in range(0, len(paths), _LOOKUP_CHUNK)
            ]
            found = [hit for fut in futures for hit in fut.result()]
        hits: list[BlockKey] = []
        misses: list[BlockKey] = []
        for i, hit in zip(todo, found, strict=True):
            out[i] = hit
            (hits if hit else misses).append(keys[i])
        self._cache.put_many(hits, True, now)
        self._cache.put_many(misses, False, now)
        return out, True

    def _probe_chunk(self, keys: Sequence[BlockKey]) -> int:
        """Leading keys of ``keys`` present: cache first, then stat; stops at
        the first miss and caches what it learned."""
        now = time.monotonic()
        found: list[BlockKey] = []
        count = 0
        exists = is_block_file
        ngroups = self._num_groups
        missed = False
        # Cache answers are fetched 32 at a time so a miss near the front
        # does not pay for a whole chunk of cache probes.
        for j in range(0, len(keys), 32):
            sub = keys[j : j + 32]
            for k, state in zip(sub, self._cache.get_many(sub, now), strict=True):
                if state is False:
                    missed = True
                    break
                if state is None:
                    if k.group_idx >= ngroups or not exists(self._path(k)):
                        if k.group_idx < ngroups:
                            self._cache.put_many([k], False, now)
                        missed = True
                        break
                    found.append(k)
                count += 1
            if missed:
                break
        self._cache.put_many(found, True, now)
        return count

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="fstier-lookup")
            return self._pool

    def _parallel_probe(self, keys: Sequence[BlockKey], start: int) -> int:
        """Probe ``keys[start:]`` in chunks on the lookup threads, in waves of
        one chunk per thread so an early miss wastes at most one wave."""
        executor = self._executor()
        n = len(keys)
        total = 0
        pos = start
        wave = self._workers
        while pos < n:
            futures: list[tuple[int, Future[int]]] = []
            for _ in range(wave):
                if pos >= n:
                    break
                end = min(n, pos + _LOOKUP_CHUNK)
                futures.append((end - pos, executor.submit(self._probe_chunk, keys[pos:end])))
                pos = end
            stopped = False
            for size, fut in futures:
                if stopped:
                    fut.cancel()
                    continue
                got = fut.result()
                total += got
                if got < size:
                    stopped = True
            if stopped:
                break
        return total

    def close(self) -> None:
        """Stop the lookup threads (idempotent)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
