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
The Python path probes on the tier's job engine (:mod:`fstier.io.engine`): one
``"probe"`` job per batch, in the engine's probe queue, which every engine
thread takes before queued reads and writes, so a probe never waits behind a
burst of queued I/O, only for a thread to finish its unit (one key on this
path); the caller waits on the job's own answer at most the deadline,
and a probe stuck past it is the engine's (its thread counted stuck and
replaced, as for any unit). A namespace costs no lookup thread: the engine's
threads, running since the tier was built, serve every namespace's probes
(there was a lookup pool of 3 threads per root and deadline, which the
first lookup once started, costing the first prompt after an engine's
restart 28-34 ms; test_lookup_presence.py::test_the_first_lookup_starts_no_thread).

:class:`Lookup` counts what it answers in the tier's metrics (keys looked
up, hits, misses, lookup seconds). Costs per batch: one cache pass under
one lock, one probe call for the uncached keys (native: one ``openat2``
and one ``fstat`` per key, on one short-lived C thread; Python: one engine
job and two thread hand-offs). Memory is bounded: at most 2**20
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

from fstier.errors import IOPoolClosedError
from fstier.io import BlockStore, EngineJob, Registration
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
        with self._lock:
            self._put_locked(ids, present, now)

    def _put_locked(self, ids: list[tuple[bytes, int]], present: bool, now: float) -> None:
        if self.ttl <= 0 or not ids:
            return
        if len(self._entries) + len(ids) > _CACHE_MAX_ENTRIES:
            self._entries = {k: v for k, v in self._entries.items() if v[1] > now}
            if len(self._entries) + len(ids) > _CACHE_MAX_ENTRIES:
                self._entries.clear()
        self._entries.update(dict.fromkeys(ids, (present, now + self.ttl)))  # one C-level loop per batch

    def stored(self, keys: Sequence[BlockKey], now: float) -> None:
        """Keys now present on disk (stored, or found present by a store): one lock; :meth:`_put_locked`'s common
        case (a cache with room) inline."""
        ids = list(map(_ID, keys))
        with self._lock:
            if self._bad and not self._bad.keys().isdisjoint(ids):
                for k in ids:
                    self._bad.pop(k, None)
            if self.ttl > 0 and len(self._entries) + len(ids) <= _CACHE_MAX_ENTRIES:
                self._entries.update(dict.fromkeys(ids, (True, now + self.ttl)))
            else:
                self._put_locked(ids, True, now)

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
        one lock and one set test per batch; no lock while no key is bad)."""
        if not self._bad:
            return None  # a key marked bad while this runs is as if marked after it
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
    call for the uncached keys (native: on the caller's thread; Python: a
    probe job of ``engine``), waited for at most ``timeout_s`` (see the
    module docstring)."""

    def __init__(
        self,
        cache: LookupCache,
        blocks: BlockStore,
        num_groups: int,
        timeout_s: float | None,
        *,
        breaker: Breaker,
        metrics: TierMetrics,
        engine: Registration,
    ) -> None:
        self._breaker = breaker
        self._metrics = metrics
        self._cache = cache
        self._blocks = blocks
        self._base = os.fspath(blocks.mapper.blocks_dir)
        self._num_groups = num_groups
        # inf: no deadline; nan or negative: ValueError; else at most threading.TIMEOUT_MAX
        self._timeout = wait_timeout("Lookup", timeout_s)
        #: the tier's registration with its engine: the Python path's probes are its jobs
        self._engine = engine
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

    # -- the probe call ----------------------------------------------------------
    def _probe(self, keys: list[BlockKey], prefix: bool) -> list[bool] | None:
        """One probe of ``keys``; None if it did not answer within the
        deadline (a hung mount), counted as a timeout. Native: on the
        caller's thread, the deadline kept in C (no GIL release when the kernel's caches answer, else one); Python: a
        probe job of the engine, its answer waited for at most the deadline."""
        if self._closed:
            return [False] * len(keys)
        if self._blocks.batched:
            if self._timeout is None:
                return self._blocks.present_many(keys, prefix=prefix)
            found = self._blocks.present_within(keys, prefix=prefix, timeout_s=self._timeout)
            if found is None:
                self._timed_out(keys, "past the deadline in the native probe")
            return found
        done = threading.Event()
        got: list[object] = []

        def probe() -> None:
            try:
                got.append(self._probe_now(keys, prefix))
            except Exception as exc:  # the caller's answer: a failed probe is a timeout-like miss
                got.append(exc)
            finally:
                done.set()

        try:
            self._engine.submit(EngineJob("lookup", "probe", call=probe, timeout_s=self._timeout))
        except IOPoolClosedError:  # the tier closed meanwhile: nothing is probed any more
            return [False] * len(keys)
        # The engine gives the probe up at the same deadline (its thread counted stuck, replaced).
        if not done.wait(self._timeout) or not isinstance(got[0], list):
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

    def close(self) -> None:
        """Probe nothing any more: every key is absent (idempotent)."""
        self._closed = True
