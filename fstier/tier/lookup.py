"""Lookup: the short-lived answer cache and the presence probe (:class:`Lookup`).

A lookup answers from :class:`LookupCache` (present/absent answers that
live ``tier.lookup_cache_ttl_s``, and the *bad* set: keys whose load failed,
never a hit again until stored again) and probes the rest of a batch on the
filesystem in ONE call, :meth:`~fstier.io.blockstore.BlockStore.present_many`:
on the native path one ``lookup_batch`` (GIL released once for the whole
batch), on the Python path one pass of ``fstatat`` calls (the slow path,
logged once). A regular file is a hit; a FIFO, socket,
directory or symlink at a block path, or a path whose fan-out directory is
a symlink, is a miss (the load would not follow it either). While the
circuit breaker is open every key is absent (no system call).

The probe has a deadline: the caller waits at most ``tier.io_timeout_s``,
then answers from the cache alone (uncached keys absent) and counts a
``timeout`` failure for the breaker: a dead mount never holds an engine's
thread longer than the per-I/O deadline
(test_lookup_presence.py::test_a_hung_probe_returns_within_the_deadline).
On the native path the deadline is kept in C
(:meth:`~fstier.io.blockstore.BlockStore.present_within`): the caller's
thread releases the GIL once while a C thread probes, and takes it back
once; a probe handed to a Python thread cost two more GIL hand-offs per
batch, each up to the switch interval behind a scheduler that never sleeps
(test_lookup_presence.py::test_native_probe_runs_on_the_callers_thread).
Any deadline a caller can pass ends: ``inf`` is no deadline here, one past
``threading.TIMEOUT_MAX`` is clamped to it (in C too), nan or a negative one
is a ``ValueError`` (a deadline of 2**63 ns once spun the native probe
forever: test_lookup_presence.py::test_a_huge_or_infinite_probe_deadline_returns).
The Python path probes on a lookup thread (an :class:`~fstier.io.pool.IOPool`
shared by every tier of the process on the same root and deadline: a
namespace costs no threads of its own; a hung probe delays only probes of
its own root, by at most the deadline), taken by :meth:`Lookup.start` as
the tier's constructor ends: a pool started at the first lookup cost the
first prompt after an engine's restart 28-34 ms, each new thread waiting
for the GIL; test_lookup_presence.py::test_the_first_lookup_starts_no_thread).
The last tier of a root to close stops its pool; a forked child starts its own.

:class:`Lookup` counts what it answers in the tier's metrics (keys looked
up, hits, misses, lookup seconds). Costs per batch: one cache pass under
one lock, one probe call for the uncached keys (native: one ``openat2``
and one ``fstat`` per key, on one short-lived C thread; Python: two
thread hand-offs). Memory is bounded: at most 2**20
answers and 2**18 bad keys.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from operator import attrgetter

from fstier.io.blockstore import BlockStore
from fstier.io.pool import IOPool, PoolJob
from fstier.keys import BlockKey
from fstier.tier.admission import Breaker
from fstier.tier.checks import wait_timeout
from fstier.tier.metrics import TierMetrics

__all__ = ["Lookup", "LookupCache"]

log = logging.getLogger("fstier.manager")

_CACHE_MAX_ENTRIES = 1 << 20
_BAD_MAX_ENTRIES = 1 << 18
#: a key as the cache holds it: ``(block_hash, group_idx)``, made and hashed in C
_ID = attrgetter("block_hash", "group_idx")


class LookupCache:
    """Short-lived present/absent answers plus the *bad* set (keys whose load
    failed; never a hit until stored again). One lock; batch methods take it
    once per batch. Keys are held as ``(block_hash, group_idx)`` tuples
    (:data:`_ID`: made and hashed in C), so a batch of keys costs no
    ``BlockKey.__hash__`` call per key."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl = ttl_s
        self._entries: dict[tuple[bytes, int], tuple[bool, float]] = {}
        self._bad: OrderedDict[tuple[bytes, int], None] = OrderedDict()
        self._lock = threading.Lock()

    def get_many(self, keys: Sequence[BlockKey], now: float) -> list[bool | None]:
        out: list[bool | None] = []
        with self._lock:
            entries, bad = self._entries, self._bad
            for k in map(_ID, keys):
                if k in bad:
                    out.append(False)
                    continue
                e = entries.get(k)
                out.append(e[0] if e is not None and e[1] > now else None)
        return out

    def put_many(self, keys: Sequence[BlockKey], present: bool, now: float) -> None:
        self._put(list(map(_ID, keys)), present, now)

    def _put(self, ids: list[tuple[bytes, int]], present: bool, now: float) -> None:
        if self.ttl <= 0 or not ids:
            return
        expiry = now + self.ttl
        with self._lock:
            if len(self._entries) + len(ids) > _CACHE_MAX_ENTRIES:
                self._entries = {k: v for k, v in self._entries.items() if v[1] > now}
                if len(self._entries) + len(ids) > _CACHE_MAX_ENTRIES:
                    self._entries.clear()
            self._entries.update(dict.fromkeys(ids, (present, expiry)))  # one C-level loop per batch

    def stored(self, keys: Sequence[BlockKey], now: float) -> None:
        """Keys now present on disk (stored, or found present by a store)."""
        ids = list(map(_ID, keys))
        with self._lock:
            bad = self._bad
            if bad and not bad.keys().isdisjoint(ids):
                for k in ids:
                    bad.pop(k, None)
        self._put(ids, True, now)

    def mark_bad(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            for k in map(_ID, keys):
                self._entries.pop(k, None)
                self._bad[k] = None
                self._bad.move_to_end(k)
            while len(self._bad) > _BAD_MAX_ENTRIES:
                self._bad.popitem(last=False)

    def is_bad(self, key: BlockKey) -> bool:
        with self._lock:
            return _ID(key) in self._bad

    def bad_flags(self, keys: Sequence[BlockKey]) -> list[bool] | None:
        """Per key, whether it is bad; None when none is (the common case:
        one lock and one set test per batch)."""
        with self._lock:
            bad = self._bad
            if not bad:
                return None
            ids = list(map(_ID, keys))
            if bad.keys().isdisjoint(ids):
                return None
            return list(map(bad.__contains__, ids))

    def forget(self, keys: Sequence[BlockKey]) -> None:
        """Keys whose files were removed: drop any cached answer."""
        with self._lock:
            for k in map(_ID, keys):
                self._entries.pop(k, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


# ---------------------------------------------------------------- the probe
class Lookup:
    """Which keys' block files are present: ``cache`` first, then one probe
    call for the uncached keys on the lookup thread, waited for at most
    ``timeout_s`` (see the module docstring)."""

    def __init__(
        self,
        cache: LookupCache,
        blocks: BlockStore,
        num_groups: int,
        timeout_s: float | None,
        *,
        breaker: Breaker,
        metrics: TierMetrics,
    ) -> None:
        self._breaker = breaker
        self._metrics = metrics
        self._cache = cache
        self._blocks = blocks
        self._base = os.fspath(blocks.mapper.blocks_dir)
        self._num_groups = num_groups
        # inf: no deadline; nan or negative: ValueError; else at most threading.TIMEOUT_MAX
        self._timeout = wait_timeout("Lookup", timeout_s)
        self._lock = threading.Lock()
        #: started by start(), never at the first lookup (see the module docstring)
        self._pool: IOPool | None = None
        self._closed = False
        self._logged_slow = False

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
        out, _ = self._answer(keys, prefix=True)
        for i, hit in enumerate(out):
            if not hit:
                return i
        return len(keys)

    def present(self, keys: Sequence[BlockKey]) -> tuple[list[bool], bool]:
        """Per key, whether it is present (no prefix stop), and whether any
        key had to be probed on disk (False: all answers came from the cache)."""
        return self._answer(keys, prefix=False)

    def _answer(self, keys: Sequence[BlockKey], *, prefix: bool) -> tuple[list[bool], bool]:
        """Answers per key from the cache, the uncached ones probed in one
        call (with ``prefix``, only up to the first cached miss, and the
        probe stops at its first miss: answers after a miss are False)."""
        now = time.monotonic()
        states = self._cache.get_many(keys, now)
        n = len(keys)
        end = n
        if prefix:
            for i, s in enumerate(states):
                if s is False:
                    end = i
                    break
        out = [s is True for s in states]
        ngroups = self._num_groups
        todo = [i for i in range(end) if states[i] is None and keys[i].group_idx < ngroups]
        if not todo:
            return out, False
        found = self._probe([keys[i] for i in todo], prefix)
        if found is None:  # the probe ran past the deadline: uncached keys are absent
            return out, True
        hits: list[BlockKey] = []
        misses: list[BlockKey] = []
        for i, hit in zip(todo, found, strict=False):
            out[i] = hit
            (hits if hit else misses).append(keys[i])
            if prefix and not hit:
                # The probe stopped here: the Falses after it were never
                # checked and must not be cached as misses
                # (test_manager_state.py's lookup after a longer lookup).
                break
        self._cache.put_many(hits, True, now)
        self._cache.put_many(misses, False, now)
        return out, True

    # -- the probe call, on the lookup thread ------------------------------------
    def _probe(self, keys: list[BlockKey], prefix: bool) -> list[bool] | None:
        """One probe of ``keys``; None if it did not answer within the
        deadline (a hung mount), counted as a timeout. Native: on the
        caller's thread, the deadline kept in C (one GIL release); Python:
        on the lookup thread."""
        if self._blocks.batched:
            if self._closed:
                return [False] * len(keys)
            if self._timeout is None:
                return self._blocks.present_many(keys, prefix=prefix)
            found = self._blocks.present_within(keys, prefix=prefix, timeout_s=self._timeout)
            if found is None:
                self._timed_out(keys, "past the deadline in the native probe")
            return found
        pool = self._executor()
        if pool is None:  # closed: nothing is probed any more
            return [False] * len(keys)
        done = threading.Event()
        got: list[object] = []

        def finished(pj: PoolJob) -> None:
            got.append(pj.results[0])
            done.set()

        pool.submit("lookup", "read", [lambda: self._probe_now(keys, prefix)], on_done=finished)
        # The pool's watchdog ends the op at the deadline; the extra second
        # covers its wake-up, never a hung call.
        wait = None if self._timeout is None else min(self._timeout + 1.0, threading.TIMEOUT_MAX)
        if not done.wait(wait) or not isinstance(got[0], list):
            self._timed_out(keys, got[0] if got else "no answer")
            return None
        return got[0]

    def _timed_out(self, keys: list[BlockKey], why: object) -> None:
        self._metrics.failures.inc("timeout")
        self._breaker.failure("timeout")
        log.warning(
            "fstier: presence probe of %d key(s) under %s did not answer within "
            "io_timeout_s=%s (%r); they count as misses", len(keys), self._base, self._timeout, why,
        )

    def _probe_now(self, keys: list[BlockKey], prefix: bool) -> list[bool]:
        if not self._blocks.batched and not self._logged_slow:
            self._logged_slow = True
            log.info(
                "fstier: presence is probed on the Python I/O path (%s): one fstatat per key, the "
                "slow path", self._blocks.io_path.reason,
            )
        return self._blocks.present_many(keys, prefix=prefix)

    def start(self) -> None:
        """Take the root's lookup pool now, starting it if no tier of the
        root holds it (idempotent; a no-op once closed)."""
        with self._lock:
            # the native path probes on the caller's thread (deadline in C)
            if self._pool is None and not self._closed and not self._blocks.batched:
                self._pool = _SHARED.take((os.fspath(self._blocks.mapper.root), self._timeout))

    def _executor(self) -> IOPool | None:
        """The lookup pool; None once closed (or never started)."""
        with self._lock:
            return self._pool

    def close(self) -> None:
        """Stop the lookup threads (idempotent)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            _SHARED.give_back(pool)


class _SharedPools:
    """The lookup pools of the process, one per (root, deadline), each with
    the count of tiers holding it; forgotten in a forked child."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[tuple[str, float | None], tuple[IOPool, int]] = {}
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._pools = {}

    def take(self, key: tuple[str, float | None]) -> IOPool:
        with self._lock:
            pool, n = self._pools.get(key, (None, 0))
            if pool is None or pool.closed:
                pool, n = IOPool(1, 1, key[1], name="fstier-lookup"), 0
            self._pools[key] = (pool, n + 1)
            return pool

    def give_back(self, pool: IOPool) -> None:
        with self._lock:
            key = next((k for k, (p, _) in self._pools.items() if p is pool), None)
            if key is not None and self._pools[key][1] > 1:
                self._pools[key] = (pool, self._pools[key][1] - 1)
                return
            if key is not None:
                del self._pools[key]
        pool.shutdown()


_SHARED = _SharedPools()
