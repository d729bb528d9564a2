"""FsTier: the engine-facing filesystem tier (lookups, store/load jobs, capacity).

One key <-> one host slot <-> one file (``FileMapper.path_for(key)``). The
engine's scheduler owns one :class:`FsTier`; it never blocks in it:

- **lookup(keys) -> int** counts the leading keys whose files exist (a prefix
  hit). Answers come from a short-lived positive/negative cache
  (``tier.lookup_cache_ttl_s``) or from ``stat`` calls, done in parallel
  chunks for big batches and stopping at the first miss. A key whose load
  failed is marked *bad*: it is never reported as a hit again until it is
  stored again, so a stale hit cannot livelock a request. Evictions and
  corrupt files invalidate their keys.
- **submit_store / submit_load** queue one pool job per call (one op per key)
  on the dual-queue :class:`~fstier.io.pool.IOPool`; ``get_finished()``
  returns :class:`JobResult` records without blocking. A load keeps its loaded
  *prefix*; from the first key that did not load on, keys are misses to
  recompute. Stores of keys already present are skipped and counted.
- **Backpressure.** An EMA of the measured write speed (bytes written over the
  wall time the write queue was busy) bounds queued store bytes to
  ``max_write_queue_seconds`` of work; beyond it, new stores are dropped with
  cause ``backpressure`` (a future miss, never a blocked caller).
- **Circuit breaker.** ``breaker_failures`` consecutive failures that say
  the device or mount is failing (EIO, EROFS, ESTALE, ENOTCONN, network
  errnos, deadline misses; never misses, corrupt files, a FIFO, socket or
  directory planted at a block path, permissions or a full disk) open the breaker
  for ``breaker_cooldown_s``: lookups return 0, stores drop (``degraded``),
  loads fail fast. Then it is half-open: the next jobs run, a success closes
  it, a failure reopens it. Each transition is logged once.
- **Fencing.** An op past ``io_timeout_s`` is reported failed, but its thread
  may still write into the slot later (or, for a store, read it and publish
  what it reads); that slot is fenced until the pool's ``on_late`` callback
  says the stuck call returned: jobs naming it fail with ``slot_busy``, and
  the slot provider (:mod:`fstier.slots`) is told to ``fence`` it, so a slot
  the engine frees is not handed out again before the late call is over.
  No byte written by an op after its job was reported reaches a later job.
- **Slots** must be currently handed out by the provider
  (``check_slots``): a job naming a slot the caller does not hold is a
  ``ValueError``, as are malformed keys in any call, ``lookup`` included.
- **Capacity.** With ``max_bytes``, usage is scanned once at start (streaming,
  on the capacity thread) and then tracked incrementally; above the high
  watermark the capacity thread removes least-recently-used files down to the
  low watermark (:func:`fstier._capacity.collect_garbage`: unlink only, safe
  with concurrent readers and other processes). Recency is the file mtime,
  bumped by fstier on every load and every store of an already present key.
- **Events and metrics.** ``take_events()`` returns :class:`BlockStored` /
  :class:`BlockRemoved`; ``metrics`` is a :class:`~fstier._metrics.TierMetrics`.

All job bookkeeping lives in one :class:`_Job` record per in-flight job under
``FsTier._lock``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from fstier._capacity import GcReport, collect_garbage, key_from_block_name
from fstier._metrics import TierMetrics
from fstier._usage import SharedUsage
from fstier.config import FstierConfig, TierConfig, load_config
from fstier.errors import ConfigError, FstierError, IOPoolClosedError, PoolError, TierClosedError
from fstier.file_mapper import BLOCK_SUFFIX, FileMapper
from fstier.io import posix
from fstier.io.blockfile import HEADER_SIZE, BlockHeader, ChecksumKind, padded_len, payload_checksum
from fstier.io.pool import OP_CANCELLED, OP_EXPIRED, OP_TIMED_OUT, IOPool
from fstier.keys import BlockKey
from fstier.slots import SlotProvider

if TYPE_CHECKING:  # pragma: no cover
    from fstier.host_pool import HostBlockPool

__all__ = ["BlockRemoved", "BlockStored", "FsTier", "JobResult", "TierEvent"]

log = logging.getLogger("fstier.manager")

#: Prior write speed before the first measurement (bytes/s). Conservative for
#: NVMe (docs/architecture.md, "Facts of the machines": ~1.6 GB/s for new
#: files) so an initial flood is
#: bounded before any store has completed.
_PRIOR_WRITE_BPS = 512e6
_EMA_ALPHA = 0.2
#: A busy period shorter than this is folded into the next sample (timer noise).
_MIN_SAMPLE_S = 0.005
#: Lookup batches at least this long (uncached) are stat-ed in parallel chunks.
_PARALLEL_LOOKUP_MIN = 512
_LOOKUP_CHUNK = 256
_CACHE_MAX_ENTRIES = 1 << 20
_BAD_MAX_ENTRIES = 1 << 18
#: The capacity thread rescans this often even without a trigger: the shared
#: usage count (fstier._usage) drifts only through writers killed mid-store,
#: hand-run ``fstier gc`` and instances without ``max_bytes``.
_RESYNC_INTERVAL_S = 300.0
#: While usage is above the high watermark and another instance holds the
#: eviction lock (or just finished a pass that others outran), look again
#: this soon.
_BUSY_RETRY_S = 0.05
#: Evictions are subtracted from the shared count in batches of this many
#: files, so that a long pass lowers it as it goes (admission sees the room).
_REMOVED_BATCH = 64
#: Default private pool budget when ``from_config`` creates the pool itself.
_DEFAULT_POOL_BYTES = 256 << 20


# ---------------------------------------------------------------- public records
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
    ``bad_file:<why>``,
    ``corrupt:<reason>``, or ``miss``). ``skipped`` counts stores of keys
    already present.
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


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Keys whose block files this tier wrote (not the skipped ones)."""

    keys: tuple[BlockKey, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Keys whose files were removed: ``reason`` is ``evicted`` or ``corrupt``."""

    keys: tuple[BlockKey, ...]
    reason: str = "evicted"


TierEvent = BlockStored | BlockRemoved


# ------------------------------------------------------------- internal parts
@dataclass(slots=True)
class _Job:
    """One in-flight job. Mutable fields change only under ``FsTier._lock``."""

    pool_id: int
    job_id: Hashable
    kind: Literal["store", "load"]
    keys: tuple[BlockKey, ...]
    slots: tuple[int, ...]
    op_bytes: tuple[int, ...]
    submitted: float
    #: store ops whose bytes still count as queued (cleared when the op ends or times out)
    op_open: list[bool] = field(default_factory=list)
    last_end: float = 0.0


class _LookupCache:
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


class _Breaker:
    """Consecutive-failure circuit breaker: closed -> open (cool-down) ->
    half-open -> closed on a success, open again on a failure."""

    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

    def __init__(self, threshold: int, cooldown_s: float, metrics: TierMetrics) -> None:
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._metrics = metrics
        self._state = self.CLOSED
        self._failures = 0
        self._open_until = 0.0
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        with self._lock:
            self._tick(time.monotonic())
            return self._state

    def _tick(self, now: float) -> None:
        if self._state == self.OPEN and now >= self._open_until:
            self._state = self.HALF_OPEN
            log.warning("fstier: circuit breaker half-open; probing the tier again")

    def allow(self) -> bool:
        """False while open (degraded)."""
        with self._lock:
            self._tick(time.monotonic())
            return self._state != self.OPEN

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            if self._state != self.CLOSED:
                self._state = self.CLOSED
                self._metrics.degraded.set(0)
                log.warning("fstier: circuit breaker closed; the tier recovered")

    def failure(self, cause: str) -> None:
        with self._lock:
            now = time.monotonic()
            self._tick(now)
            self._failures += 1
            if self._state == self.HALF_OPEN or (
                self._state == self.CLOSED and self._failures >= self.threshold
            ):
                self._state = self.OPEN
                self._open_until = now + self.cooldown_s
                self._metrics.breaker_trips.inc()
                self._metrics.degraded.set(1)
                log.error(
                    "fstier: circuit breaker open after %d consecutive I/O failure(s) (last: %s); "
                    "tier degraded for %.1fs (lookups miss, stores drop, loads fail fast)",
                    self._failures, cause, self.cooldown_s,
                )


class _WriteBudget:
    """Backpressure: queued store bytes versus an EMA of the write speed.

    The speed sample is bytes completed over the wall time during which the
    write queue was non-empty, so it measures the pool's aggregate throughput
    whatever the number of writer threads and jobs in flight."""

    def __init__(self, max_queue_s: float, metrics: TierMetrics) -> None:
        self.max_queue_s = max_queue_s
        self._metrics = metrics
        self.speed = _PRIOR_WRITE_BPS
        self._measured = False
        self.queued = 0
        self._busy_since = 0.0
        self._busy_bytes = 0
        self._lock = threading.Lock()
        metrics.write_speed.set(self.speed)

    def admit(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` if they fit; an idle queue always admits (a job
        bigger than the budget must still be storable)."""
        with self._lock:
            if self.queued > 0 and self.queued + nbytes > self.max_queue_s * self.speed:
                return False
            if self.queued == 0:
                self._busy_since = time.perf_counter()
                self._busy_bytes = 0
            self.queued += nbytes
            self._metrics.queued_store_bytes.set(self.queued)
            return True

    def release(self, reserved: int, written: int) -> None:
        """An op ended: ``reserved`` bytes leave the queue, ``written`` count
        toward the speed sample."""
        with self._lock:
            self.queued = max(0, self.queued - reserved)
            self._busy_bytes += written
            now = time.perf_counter()
            elapsed = now - self._busy_since
            if self._busy_bytes > 0 and elapsed >= _MIN_SAMPLE_S and (
                self.queued == 0 or elapsed >= 0.25
            ):
                sample = self._busy_bytes / elapsed
                # The first measurement replaces the prior outright: a slow
                # mount must not hide behind an optimistic guess for long.
                if self._measured:
                    self.speed = (1 - _EMA_ALPHA) * self.speed + _EMA_ALPHA * sample
                else:
                    self.speed = sample
                    self._measured = True
                self._metrics.write_speed.set(self.speed)
                self._busy_since = now
                self._busy_bytes = 0
            elif self.queued == 0 and self._busy_bytes == 0:
                self._busy_since = now
            self._metrics.queued_store_bytes.set(self.queued)


#: Hits are recorded in memory and written to the files' mtimes (their LRU
#: recency, read by every process's eviction and by ``fstier gc``) at most this
#: often, and before every capacity pass: a hot block costs one metadata
#: write per interval, not one per hit (a SETATTR round trip on NFS).
_RECENCY_FLUSH_S = 5.0
#: ... or as soon as this many distinct files are pending.
_RECENCY_MAX_PENDING = 4096


def _bump_mtimes(paths: Sequence[str]) -> None:
    for p in paths:
        # Evicted or replaced meanwhile is fine; never through a symlink.
        posix.touch_file(p)


def _ignore_pool_job(_job: object) -> None:
    """``on_done`` of recency jobs: nothing to report to the engine."""


def _is_block_file(path: str) -> bool:
    """True when ``path`` is a regular file (not followed if a symlink). A
    FIFO, socket or directory planted at a block path is a miss here, not a
    hit whose load then fails; lstat costs what ``os.path.exists`` does."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return False


def _exist_many(paths: Sequence[str]) -> list[bool]:
    return [_is_block_file(p) for p in paths]


def _file_bytes(payload_len: int) -> int:
    """Bytes a block file of ``payload_len`` occupies (header + padded payload)."""
    return HEADER_SIZE + padded_len(payload_len)


#: Causes that say the device or mount is failing: only these count toward
#: the circuit breaker. Anything about one file (a FIFO, socket or directory
#: planted at a block path, a permission, a name) is that file's problem: the
#: key is a miss, and the tier keeps serving every other key (issue 15 item 7:
#: eight planted FIFOs used to degrade the whole tier). A full disk (ENOSPC,
#: EDQUOT) is not failing either: loads still work and eviction frees space.
_DEVICE_CAUSES = frozenset({
    "timeout", "EIO", "EROFS", "ESTALE", "ENOTCONN", "ENODEV", "ENOMEDIUM", "ESHUTDOWN",
    "ETIMEDOUT", "EHOSTDOWN", "EHOSTUNREACH", "ENETDOWN", "ENETUNREACH", "ENETRESET",
    "ECONNREFUSED", "ECONNRESET", "ECONNABORTED", "ENOLINK", "EREMOTEIO", "EUCLEAN",
})
#: Load errors that mean "what is at the block path is not a block file":
#: ``not_regular`` (a FIFO or directory: fstat says so), ENXIO (a socket
#: refuses open), EISDIR, ENOTDIR (a file planted where a fan-out directory
#: belongs). They are bad files: a miss with cause ``bad_file:<why>``.
_BAD_FILE_CAUSES = frozenset({"not_regular", "ENXIO", "EISDIR", "ENOTDIR"})


def _wait_timeout(what: str, timeout: float | None) -> float | None:
    """A wait's timeout: ``inf`` means no limit (threading's waits raise
    OverflowError for it); nan or a negative value is a caller's mistake."""
    if timeout is None or timeout == math.inf:
        return None
    if not timeout >= 0:  # also catches nan
        raise ValueError(f"{what}(timeout=...): expected seconds >= 0 or None, got {timeout!r}")
    return min(float(timeout), threading.TIMEOUT_MAX)


def _cause_of(result: object) -> str:
    if isinstance(result, OSError):
        return errno.errorcode.get(result.errno or 0, type(result).__name__)
    return type(result).__name__


# --------------------------------------------------------------------- FsTier
class FsTier:
    """The filesystem tier for one (model, parallel layout, root) config.

    ``pool`` is the :class:`~fstier.slots.SlotProvider` whose slots jobs name
    (a :class:`~fstier.host_pool.HostBlockPool`, or an engine's own rows);
    each slot must hold the largest file payload. A slot at least the payload
    padded to 4096 is used as the I/O buffer whole (its tail is zeroed on
    store); a shorter or unaligned one is moved with exactly the payload's
    bytes (the I/O layer pads from its own buffer), so nothing outside the
    payload is ever written.

    ``config`` is an :class:`FstierConfig` (the namespace comes from its
    model and parallel layout), or a :class:`TierConfig` together with a
    ``mapper`` whose namespace an engine defined
    (:meth:`FileMapper.for_engine`); :attr:`config` is then ``None``.
    """

    def __init__(
        self,
        config: FstierConfig | TierConfig,
        pool: SlotProvider,
        mapper: FileMapper | None = None,
    ) -> None:
        if isinstance(config, FstierConfig) and mapper is None:
            self.config: FstierConfig | None = config
            tier = config.tier
            self.mapper = FileMapper(config)
        elif isinstance(config, TierConfig) and isinstance(mapper, FileMapper):
            self.config = None
            tier = config
            self.mapper = mapper
        else:
            raise ConfigError(
                f"FsTier(config=..., mapper=...): expected an FstierConfig, or a TierConfig "
                f"with a FileMapper, got {type(config).__name__} and {type(mapper).__name__}; "
                "use FsTier.from_config(path) for a YAML file"
            )
        self.tier_config: TierConfig = tier
        self._pool = pool
        self._owns_pool = False
        self._own_pool: HostBlockPool | None = None  # closed by close() (from_config)
        self._payload_len = [
            self.mapper.expected_payload_bytes(g) for g in range(self.mapper.num_groups)
        ]
        need = max(self._payload_len)
        if pool.slot_bytes < need:
            raise PoolError(
                f"{type(pool).__name__} slot_bytes is {pool.slot_bytes} but the largest file "
                f"payload is {need} bytes; provide slots with slot_bytes >= {need} "
                f"({padded_len(need)} lets I/O run on the slot in place)"
            )
        self.mapper.ensure_manifest()
        # mkdirat inside directory fds: never through a swapped namespace dir.
        self.mapper.ensure_parent(self.mapper.blocks_dir / "_")
        support = posix.probe_o_direct(self.mapper.namespace_dir, tier.o_direct)
        self.io_options = posix.IOOptions.from_tier(tier, support)
        self.metrics = TierMetrics()
        self._cache = _LookupCache(tier.lookup_cache_ttl_s)
        self._breaker = _Breaker(tier.breaker_failures, tier.breaker_cooldown_s, self.metrics)
        self._budget = _WriteBudget(tier.max_write_queue_seconds, self.metrics)
        self._blocks_prefix = os.fspath(self.mapper.blocks_dir)
        self._bpf = tier.blocks_per_file

        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._jobs: dict[Hashable, _Job] = {}
        self._user_ids: set[Hashable] = set()
        self._next_pool_id = 0
        self._finished: list[JobResult] = []
        self._events: list[TierEvent] = []
        #: slot -> (pool job id, op index) of the timed-out op holding it
        self._fenced: dict[int, tuple[Hashable, int]] = {}
        #: ops that returned late before their timeout was reaped
        self._late: set[tuple[Hashable, int]] = set()
        self._closed = False

        self._io = IOPool(tier.read_threads, tier.write_threads, tier.io_timeout_s)
        self._io.on_late(self._on_late)
        self._lookup_pool: ThreadPoolExecutor | None = None
        self._lookup_workers = max(2, min(tier.read_threads, 16))

        # Capacity: root-wide usage shared with every instance on this root
        # (fstier._usage); reported as None until this instance's first scan.
        self._max_bytes = tier.max_bytes
        self._shared: SharedUsage | None = (
            SharedUsage(self.mapper.root, tier.file_mode) if self._max_bytes is not None else None
        )
        self._usage_known = False
        self._resynced = time.monotonic()
        self._usage_lock = threading.Lock()
        self._removed_pending = 0  # evicted bytes not yet subtracted from the count
        self._removed_in_pass = 0
        self._cap_lock = threading.Lock()  # one capacity pass at a time
        self._recency_lock = threading.Lock()
        self._recent: dict[str, None] = {}  # files hit since the last flush, in order
        self._recency_flushed = time.monotonic()
        self._recency_seq = 0
        self._cap_wake = threading.Event()
        self._cap_stop = threading.Event()
        self._cap_thread: threading.Thread | None = None
        if self._max_bytes is not None:
            self._cap_thread = threading.Thread(
                target=self._capacity_loop, name="fstier-capacity", daemon=True
            )
            self._cap_thread.start()

    # ---------------------------------------------------------------- creation
    @classmethod
    def from_config(
        cls, config: str | os.PathLike[str] | FstierConfig, pool: SlotProvider | None = None
    ) -> FsTier:
        """Build from a YAML path or an :class:`FstierConfig`. Without ``pool``
        a private :class:`HostBlockPool` is created (slots sized to the largest
        payload, about 256 MiB in all, at least 2 x the I/O threads) and closed
        by :meth:`close`."""
        cfg = config if isinstance(config, FstierConfig) else load_config(config)
        if pool is not None:
            return cls(cfg, pool)
        from fstier.host_pool import HostBlockPool

        mapper = FileMapper(cfg)
        slot_bytes = max(
            padded_len(mapper.expected_payload_bytes(g)) for g in range(len(cfg.model.groups))
        )
        threads = cfg.tier.read_threads + cfg.tier.write_threads
        num_slots = max(2 * threads, min(1024, _DEFAULT_POOL_BYTES // slot_bytes))
        own = HostBlockPool(num_slots, slot_bytes)
        try:
            tier = cls(cfg, own)
        except BaseException:
            own.close()
            raise
        tier._owns_pool = True
        tier._own_pool = own
        return tier

    @property
    def pool(self) -> SlotProvider:
        return self._pool

    def payload_bytes(self, key: BlockKey) -> int:
        """Payload length of ``key``'s file (the slot bytes a job moves)."""
        return self._payload_len[key.group_idx]

    def __enter__(self) -> FsTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ lookup
    def _path_str(self, key: BlockKey) -> str:
        # Same layout as FileMapper.path_for (tests pin the equality) without
        # building Path objects: lookups run on the scheduler's hot path.
        h = key.block_hash.hex()
        return f"{self._blocks_prefix}/{h[:3]}/{h[3:5]}/{h}-g{key.group_idx}{BLOCK_SUFFIX}"

    def _probe_chunk(self, keys: Sequence[BlockKey]) -> int:
        """Leading keys of ``keys`` present: cache first, then stat; stops at
        the first miss and caches what it learned."""
        now = time.monotonic()
        found: list[BlockKey] = []
        count = 0
        exists = _is_block_file
        ngroups = len(self._payload_len)
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
                    if k.group_idx >= ngroups or not exists(self._path_str(k)):
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

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading ``keys`` whose blocks are present (0 while degraded)."""
        self._check_open()
        t0 = time.perf_counter()
        n = len(keys)
        if n == 0:
            return 0
        self._check_keys(keys, "lookup")
        if not self._breaker.allow():
            self.metrics.lookup_keys.inc(n)
            self.metrics.misses.inc()
            return 0
        first = min(n, _LOOKUP_CHUNK)
        hits = self._probe_chunk(keys[:first])
        if hits == first and n - first >= _PARALLEL_LOOKUP_MIN:
            hits += self._parallel_probe(keys, first)
        elif hits == first and first < n:
            hits += self._probe_chunk(keys[first:])
        self.metrics.lookup_keys.inc(n)
        self.metrics.hits.inc(hits)
        if hits < n:
            self.metrics.misses.inc()
        self.metrics.lookup_seconds.observe(time.perf_counter() - t0)
        return hits

    def present(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether its block is present (no prefix stop, unlike
        :meth:`lookup`): for engines that ask about keys out of order (vLLM's
        sliding-window scan). Bad keys are absent; cached answers are used and
        the rest are ``stat``-ed, in parallel chunks on the lookup threads for
        big batches. It blocks on the filesystem: call it off the engine's
        scheduler thread."""
        self._check_open()
        n = len(keys)
        if n == 0:
            return []
        self._check_keys(keys, "present")
        if not self._breaker.allow():
            return [False] * n
        now = time.monotonic()
        states = self._cache.get_many(keys, now)
        out = [bool(s) for s in states]
        ngroups = len(self._payload_len)
        todo = [i for i, s in enumerate(states) if s is None and keys[i].group_idx < ngroups]
        if not todo:
            return out
        paths = [self._path_str(keys[i]) for i in todo]
        if len(todo) < _PARALLEL_LOOKUP_MIN:
            found = _exist_many(paths)
        else:
            executor = self._lookup_executor()
            futures = [
                executor.submit(_exist_many, paths[j : j + _LOOKUP_CHUNK])
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
        self.metrics.lookup_keys.inc(n)
        self.metrics.hits.inc(sum(out))
        return out

    def _lookup_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._lookup_pool is None:
                self._lookup_pool = ThreadPoolExecutor(
                    self._lookup_workers, thread_name_prefix="fstier-lookup"
                )
            return self._lookup_pool

    def _parallel_probe(self, keys: Sequence[BlockKey], start: int) -> int:
        """Probe ``keys[start:]`` in chunks on the lookup threads, in waves of
        one chunk per thread so an early miss wastes at most one wave."""
        executor = self._lookup_executor()
        n = len(keys)
        total = 0
        pos = start
        wave = self._lookup_workers
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

    # -------------------------------------------------------------------- jobs
    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError("FsTier is closed; create a new one with FsTier.from_config(...)")

    def _validate(self, job_id: Hashable, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        if len(keys) != len(slots):
            raise ValueError(
                f"job {job_id!r}: {len(keys)} keys but {len(slots)} slots; one slot per key"
            )
        self._check_keys(keys, f"job {job_id!r}")
        num_slots = self._pool.num_slots
        for s in slots:
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < num_slots:
                raise ValueError(
                    f"job {job_id!r}: slot {s!r} is not a slot index in 0..{num_slots - 1}"
                )
        if len(set(slots)) != len(slots):
            raise ValueError(f"job {job_id!r}: a slot appears twice; one slot per key")
        # The provider knows which slots the caller holds now: a slot that was
        # never allocated, or was freed, may be handed to someone else at any
        # time, so moving bytes through it is refused (issue 15 item 10).
        try:
            self._pool.check_slots(slots)
        except ValueError as exc:
            raise ValueError(f"job {job_id!r}: {exc}") from None

    def _check_keys(self, keys: Sequence[BlockKey], what: str) -> None:
        """Every element a :class:`BlockKey` of a group this model has, or a
        ``ValueError`` naming the first that is not."""
        ngroups = len(self._payload_len)
        for i, k in enumerate(keys):
            if not isinstance(k, BlockKey):
                raise ValueError(
                    f"{what}: keys[{i}] is {k!r} ({type(k).__name__}); keys must be BlockKey, "
                    "e.g. from fstier.chain_hashes"
                )
            if k.group_idx >= ngroups:
                raise ValueError(
                    f"{what}: keys[{i}]: group {k.group_idx} does not exist "
                    f"(the model has {ngroups} group(s))"
                )

    def _finish_now_locked(
        self, job_id: Hashable, kind: Literal["store", "load"], n: int, cause: str
    ) -> None:
        self._finished.append(
            JobResult(job_id, kind, n == 0, 0, n, 0, 0.0, None if n == 0 else cause)
        )

    def submit_store(
        self, job_id: Hashable, keys: Sequence[BlockKey], slots: Sequence[int]
    ) -> None:
        """Queue the store of ``slots[i]`` as ``keys[i]``'s file. Never blocks;
        a job that cannot run (degraded, backpressure, fenced slot) finishes at
        once with ``success=False`` and that cause."""
        self._submit(job_id, "store", keys, slots)

    def submit_load(
        self, job_id: Hashable, keys: Sequence[BlockKey], slots: Sequence[int]
    ) -> None:
        """Queue the load of ``keys[i]``'s file into ``slots[i]``. Never blocks."""
        self._submit(job_id, "load", keys, slots)

    def _submit(
        self,
        job_id: Hashable,
        kind: Literal["store", "load"],
        keys: Sequence[BlockKey],
        slots: Sequence[int],
    ) -> None:
        self._check_open()
        self._validate(job_id, keys, slots)
        self._reap()
        n = len(keys)
        keys_t, slots_t = tuple(keys), tuple(slots)
        op_bytes = tuple(self._payload_len[k.group_idx] for k in keys_t)
        # Every outcome, even one decided at once (empty, degraded, slot busy,
        # backpressure), is taken under one lock after the duplicate-id check:
        # otherwise a second job "J" that finishes at once would report a
        # result for a "J" still in flight (issue 15 item 9).
        with self._lock:
            if job_id in self._user_ids:
                raise ValueError(f"job id {job_id!r} is already in flight; job ids must be unique")
            if n == 0:
                self._finish_now_locked(job_id, kind, 0, "")
                return
            if not self._breaker.allow():
                if kind == "store":
                    self.metrics.drops.inc("degraded", n)
                else:
                    self.metrics.failures.inc("degraded", n)
                self._finish_now_locked(job_id, kind, n, "degraded")
                return
            if any(s in self._fenced for s in slots_t):
                self.metrics.failures.inc("slot_busy", n)
                self._finish_now_locked(job_id, kind, n, "slot_busy")
                return
            if kind == "store" and self._root_full():
                # The root is over max_bytes (counted across every instance on
                # it) and eviction has not caught up: drop, as backpressure
                # does. A future miss, never data loss, never a blocked caller.
                self.metrics.drops.inc("capacity", n)
                self._finish_now_locked(job_id, kind, n, "capacity")
                self._cap_wake.set()
                return
            if kind == "store" and not self._budget.admit(sum(map(_file_bytes, op_bytes))):
                self.metrics.drops.inc("backpressure", n)
                self._finish_now_locked(job_id, kind, n, "backpressure")
                return
            pool_id = self._next_pool_id
            self._next_pool_id += 1
            job = _Job(
                pool_id, job_id, kind, keys_t, slots_t, op_bytes, time.perf_counter(),
                op_open=[kind == "store"] * n,
            )
            self._jobs[pool_id] = job
            self._user_ids.add(job_id)
        if kind == "store":
            ops: list[Callable[[], object]] = [partial(self._store_op, job, i) for i in range(n)]
            self._io.submit(pool_id, "write", ops)
        else:
            ops = [partial(self._load_op, job, i) for i in range(n)]
            self._io.submit(pool_id, "read", ops)

    # -- ops (run on I/O threads) ----------------------------------------------
    def _op_ended(self, job: _Job, i: int, written: int) -> None:
        with self._lock:
            job.last_end = time.perf_counter()
            reserved = _file_bytes(job.op_bytes[i]) if job.op_open[i] else 0
            job.op_open[i] = False
        if job.kind == "store" and reserved:
            self._budget.release(reserved, written)

    def _namespace_back(self) -> bool:
        """Re-create the namespace directory and its manifest if they were
        removed under a running tier (an operator's ``rm -rf`` of the cache);
        True when it did. Without this every later store failed ENOENT until
        a restart, since the fan-out walk starts at the namespace."""
        if os.path.lexists(self.mapper.namespace_dir):
            return False
        try:
            self.mapper.ensure_manifest()
        except FstierError:  # root gone or unwritable: the store fails as it would
            return False
        log.warning(
            "fstier: namespace directory %s was removed under a running tier; re-created it",
            self.mapper.namespace_dir,
        )
        return True

    def _store_op(self, job: _Job, i: int) -> posix.StoreOutcome:
        written = 0
        try:
            key, slot = job.keys[i], job.slots[i]
            n = job.op_bytes[i]
            view = self._pool.slot_view(slot)
            # Exactly the payload: the I/O layer writes the file's zero padding
            # from its own bounce page, so no byte past it is touched.
            io_view = view[:n]
            checksum = self.io_options.checksum
            header = BlockHeader(
                key=key,
                namespace_digest=self.mapper.digest_bytes,
                payload_len=n,
                page_count=self._bpf,
                page_bytes=n // self._bpf,
                checksum_kind=ChecksumKind.XXH3_64 if checksum else ChecksumKind.NONE,
                payload_checksum=payload_checksum(view[:n]) if checksum else 0,
            )
            # A string path: pathlib costs ~40 µs per op at 64 KiB (issue 14).
            path = self._path_str(key)
            try:
                opened = self.mapper.make_parent(path)
            except FileNotFoundError:
                if not self._namespace_back():
                    raise
                opened = self.mapper.make_parent(path)
            if self._cache.is_bad(key):
                # Its last load failed without proof of corruption (EIO,
                # timeout): replace the file rather than skip onto it.
                with contextlib.suppress(FileNotFoundError):
                    posix.FS.unlink(path)
            request = posix.StoreRequest(path, header, io_view)
            if opened is None:
                outcome = posix.store_block(request, self.io_options)
            else:
                # The directory was just made (or checked): store through the
                # fd that walk opened, with no second resolution (issue 14).
                dir_fd, fresh = opened
                try:
                    outcome = posix.store_block_at(
                        dir_fd, path.rpartition("/")[2], header, io_view, self.io_options,
                        fresh=fresh,
                    )
                finally:
                    posix.FS.close(dir_fd)
            if outcome.status is posix.StoreStatus.FAILED and outcome.cause == "ENOENT":
                # The fan-out directory was removed under us (an operator's
                # rm -rf, another host, gc of empty dirs): re-create it once
                # instead of failing every later store into it (the whole
                # namespace directory too, manifest included).
                self._namespace_back()
                self.mapper.forget_parent(path)
                self.mapper.ensure_parent(path)
                outcome = posix.store_block(request, self.io_options)
            if outcome.status is posix.StoreStatus.SKIPPED:
                self._note_recent(path)
            written = outcome.nbytes
            return outcome
        finally:
            self._op_ended(job, i, written)

    def _load_op(self, job: _Job, i: int) -> posix.LoadOutcome:
        try:
            key, slot = job.keys[i], job.slots[i]
            n = job.op_bytes[i]
            view = self._pool.slot_view(slot)
            # Exactly n bytes are written; the I/O layer reads the file's zero
            # padding into its own bounce page.
            io_view = view[:n]
            path = self._path_str(key)
            outcome = posix.load_block(
                posix.LoadRequest(
                    path, io_view, key, self.mapper.digest_bytes, n, self.mapper.root
                ),
                self.io_options,
            )
            if outcome.status is posix.LoadStatus.LOADED:
                self._note_recent(path)
            return outcome
        finally:
            self._op_ended(job, i, 0)

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark ``keys`` recently used (LRU recency) without a system call
        here: their mtimes are bumped by the batched recency writes. Keys
        without a file are ignored."""
        self._check_open()
        ngroups = len(self._payload_len)
        for k in keys:
            if k.group_idx < ngroups:
                self._note_recent(self._path_str(k))

    def _note_recent(self, path: Path | str) -> None:
        """Record a hit. Recency lives in the file's mtime because atime is
        unreliable (relatime/noatime); the writes are batched per file and run
        as their own write-queue job, so no load waits for them."""
        with self._recency_lock:
            self._recent[os.fspath(path)] = None
            due = (
                len(self._recent) >= _RECENCY_MAX_PENDING
                or time.monotonic() - self._recency_flushed >= _RECENCY_FLUSH_S
            )
            paths = self._take_recent_locked() if due else []
            self._recency_seq += 1
            job_id = ("recency", self._recency_seq)
        if paths:
            try:
                self._io.submit(job_id, "write", [partial(_bump_mtimes, paths)], on_done=_ignore_pool_job)
            except IOPoolClosedError:  # the tier is closing: do it here
                _bump_mtimes(paths)

    def _take_recent_locked(self) -> list[str]:
        paths = list(self._recent)
        self._recent = {}
        self._recency_flushed = time.monotonic()
        return paths

    def flush_recency(self) -> None:
        """Write pending hit recency to the files' mtimes now (it is otherwise
        written every few seconds and before each capacity pass), e.g. before
        running ``fstier gc`` from another process."""
        self._check_open()
        self._flush_recency()

    def _flush_recency(self) -> None:
        """Bump the mtime of every file hit since the last flush, once each."""
        with self._recency_lock:
            paths = self._take_recent_locked()
        _bump_mtimes(paths)

    def _on_late(self, pool_id: Hashable, op_index: int) -> None:
        """The pool says a timed-out op finally returned: unfence its slot."""
        with self._lock:
            for slot, owner in list(self._fenced.items()):
                if owner == (pool_id, op_index):
                    del self._fenced[slot]
                    # Only now may the provider hand the slot out again: the
                    # late call can no longer write it.
                    self._pool.unfence(slot)
                    log.info("fstier: slot %d released; its timed-out I/O returned", slot)
                    self._idle.notify_all()
                    return
            self._late.add((pool_id, op_index))

    # -- completion --------------------------------------------------------------
    def _reap(self) -> None:
        """Turn finished pool jobs into JobResults (never blocks)."""
        for pj in self._io.get_finished():
            with self._lock:
                job = self._jobs.pop(pj.job_id, None)
            if job is None:
                continue
            if job.kind == "store":
                result = self._finish_store(job, list(pj.results))
            else:
                result = self._finish_load(job, list(pj.results))
            with self._idle:
                self._user_ids.discard(job.job_id)
                self._finished.append(result)
                self._idle.notify_all()

    def _timed_out(self, job: _Job, i: int) -> None:
        with self._lock:
            reserved = _file_bytes(job.op_bytes[i]) if job.op_open[i] else 0
            job.op_open[i] = False
            owner = (job.pool_id, i)
            if owner in self._late:
                self._late.discard(owner)
            else:
                slot = job.slots[i]
                self._fenced[slot] = owner
                # The provider's fence outlives the engine's free(): without
                # it, alloc() hands the slot out again, new bytes are staged
                # into it, and the stuck read overwrites them (issue 15 item
                # 1). Fenced here, before the job's result is published, so
                # the engine cannot have freed the slot yet.
                self._pool.fence(slot)
        if reserved:
            self._budget.release(reserved, 0)
        log.warning(
            "fstier: %s of %r timed out after %.1fs; slot %d fenced until the call returns",
            job.kind, job.keys[i], self.tier_config.io_timeout_s, job.slots[i],
        )

    def _seconds(self, job: _Job) -> float:
        with self._lock:
            end = job.last_end or time.perf_counter()
        return max(0.0, end - job.submitted)

    def _finish_store(self, job: _Job, results: list[object]) -> JobResult:
        now = time.monotonic()
        stored: list[BlockKey] = []
        present: list[BlockKey] = []
        skipped = failed = 0
        prefix = 0  # leading keys on disk, up to the first failure
        nbytes = 0
        file_bytes = 0
        cause: str | None = None
        for i, r in enumerate(results):
            key = job.keys[i]
            if failed == 0:
                prefix = i
            if r is OP_CANCELLED:
                failed += 1
                cause = cause or "cancelled"
                self.metrics.failures.inc("cancelled")
                continue
            if r is OP_TIMED_OUT:
                self._timed_out(job, i)
                c = "timeout"
            elif r is OP_EXPIRED:  # queued past the deadline behind hung calls; never ran
                self._op_ended(job, i, 0)
                c = "timeout"
            elif isinstance(r, posix.StoreOutcome) and r.status is posix.StoreStatus.STORED:
                stored.append(key)
                nbytes += job.op_bytes[i]
                file_bytes += _file_bytes(job.op_bytes[i])
                self._breaker.success()
                continue
            elif isinstance(r, posix.StoreOutcome) and r.status is posix.StoreStatus.SKIPPED:
                skipped += 1
                present.append(key)
                self._breaker.success()
                continue
            elif isinstance(r, posix.StoreOutcome):
                c = r.cause or "store_failed"
                log.warning("fstier: store of %r failed: %s (%s)", key, c, r.detail)
            else:
                c = _cause_of(r)
                log.warning("fstier: store of %r failed: %s", key, r)
            failed += 1
            cause = cause or c
            self.metrics.failures.inc(c)
            self._breaker_failure(c)
        if failed == 0:
            prefix = len(results)
        self._cache.stored(stored + present, now)
        m = self.metrics
        m.stored_blocks.inc(len(stored))
        m.stored_bytes.inc(nbytes)
        m.skipped_blocks.inc(skipped)
        seconds = self._seconds(job)
        m.store_seconds.observe(seconds)
        if stored:
            with self._lock:
                self._events.append(BlockStored(tuple(stored)))
            self._add_usage(file_bytes)
        return JobResult(
            job.job_id, "store", failed == 0, prefix, len(results) - prefix, nbytes,
            seconds, cause, skipped,
        )

    def _breaker_failure(self, cause: str) -> None:
        """Count ``cause`` toward the breaker only if it says the device or
        mount is failing (see ``_DEVICE_CAUSES``)."""
        if cause in _DEVICE_CAUSES:
            self._breaker.failure(cause)

    def _finish_load(self, job: _Job, results: list[object]) -> JobResult:
        prefix = 0
        nbytes = 0
        cause: str | None = None
        bad: list[BlockKey] = []
        removed: list[BlockKey] = []
        in_prefix = True
        for i, r in enumerate(results):
            key = job.keys[i]
            if isinstance(r, posix.LoadOutcome) and r.status is posix.LoadStatus.LOADED:
                self._breaker.success()
                if in_prefix:
                    prefix += 1
                    nbytes += job.op_bytes[i]
                continue
            in_prefix = False
            bad.append(key)
            if r is OP_TIMED_OUT:
                self._timed_out(job, i)
                c = "timeout"
                self._breaker_failure(c)
            elif r is OP_EXPIRED:  # queued past the deadline behind hung calls; never ran
                c = "timeout"
                self._breaker_failure(c)
            elif r is OP_CANCELLED:
                c = "cancelled"
            elif isinstance(r, posix.LoadOutcome) and r.status is posix.LoadStatus.MISSING:
                c = "miss"
            elif isinstance(r, posix.LoadOutcome) and r.status is posix.LoadStatus.CORRUPT:
                c = f"corrupt:{r.cause}"
                self.metrics.corrupt.inc()
                log.warning("fstier: corrupt block %r removed: %s %s", key, r.cause, r.detail)
                if r.removed:
                    removed.append(key)
            elif isinstance(r, posix.LoadOutcome) and r.cause in _BAD_FILE_CAUSES:
                c = f"bad_file:{r.cause}"
                log.warning(
                    "fstier: %r: the block path holds no block file (%s); a miss. Remove "
                    "whatever was placed at %s", key, r.detail or r.cause, self._path_str(key),
                )
            elif isinstance(r, posix.LoadOutcome):
                c = r.cause or "load_error"
                log.warning("fstier: load of %r failed: %s (%s)", key, c, r.detail)
                self._breaker_failure(c)
            else:
                c = _cause_of(r)
                log.warning("fstier: load of %r failed: %s", key, r)
                self._breaker_failure(c)
            if cause is None:
                cause = c
            self.metrics.failures.inc(c.split(":")[0])
        if bad:
            self._cache.mark_bad(bad)
        if removed:
            with self._lock:
                self._events.append(BlockRemoved(tuple(removed), "corrupt"))
            self._add_usage(-sum(_file_bytes(self._payload_len[k.group_idx]) for k in removed))
        m = self.metrics
        m.loaded_blocks.inc(prefix)
        m.loaded_bytes.inc(nbytes)
        m.load_misses.inc(len(job.keys) - prefix)
        seconds = self._seconds(job)
        m.load_seconds.observe(seconds)
        n = len(job.keys)
        return JobResult(job.job_id, "load", prefix == n, prefix, n - prefix, nbytes, seconds, cause)

    def get_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call (never blocks)."""
        self._reap()
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def take_events(self) -> list[TierEvent]:
        """Stored/removed events since the last call, in order."""
        self._reap()
        with self._lock:
            out, self._events = self._events, []
        return out

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has finished (results stay queued
        for :meth:`get_finished`). Returns False if ``timeout`` expired."""
        timeout = _wait_timeout("drain", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._io.wait_idle(left)
            self._reap()
            with self._lock:
                if not self._jobs:
                    return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    @property
    def degraded(self) -> bool:
        """True while the circuit breaker is open."""
        return not self._breaker.allow()

    @property
    def breaker_state(self) -> str:
        """``closed``, ``open`` or ``half_open``."""
        return self._breaker.state

    @property
    def fenced_slots(self) -> frozenset[int]:
        """Slots held by a timed-out op that has not returned yet."""
        with self._lock:
            return frozenset(self._fenced)

    def wait_fences_released(self, timeout: float | None = None) -> bool:
        """Wait until no slot is fenced by a timed-out op (every stuck call
        returned). Returns False if ``timeout`` expired first."""
        timeout = _wait_timeout("wait_fences_released", timeout)
        self._reap()
        with self._idle:
            return self._idle.wait_for(lambda: not self._fenced, timeout)

    # ---------------------------------------------------------------- capacity
    @property
    def usage_bytes(self) -> int | None:
        """Bytes of block files under the root, counted by every instance
        storing into it (None before this instance's first scan or without
        ``max_bytes``)."""
        if self._shared is None or not self._usage_known:
            return None
        return self._shared.read()

    def _root_full(self) -> bool:
        return (
            self._shared is not None
            and self._max_bytes is not None
            and self._shared.read() > self._max_bytes
        )

    def _over_high(self) -> bool:
        return (
            self._shared is not None
            and self._max_bytes is not None
            and self._shared.read() > self._max_bytes * self.tier_config.high_watermark
        )

    def _add_usage(self, delta: int) -> None:
        if self._shared is None or self._max_bytes is None or delta == 0:
            return
        usage = self._shared.add(delta)
        self.metrics.usage_bytes.set(usage)
        if usage > self._max_bytes * self.tier_config.high_watermark:
            self._cap_wake.set()

    def _flush_removed(self) -> None:
        with self._usage_lock:
            pending, self._removed_pending = self._removed_pending, 0
            self._removed_in_pass += pending
        if pending:
            self._add_usage(-pending)

    def _on_removed(self, path: str, size: int) -> None:
        self.metrics.evicted_blocks.inc()
        self.metrics.evicted_bytes.inc(size)
        with self._usage_lock:
            self._removed_pending += size
            batch = self._removed_pending >= _REMOVED_BATCH * size
        if batch:
            self._flush_removed()
        if not path.startswith(self._blocks_prefix + os.sep):
            return  # another namespace sharing the root
        key = key_from_block_name(os.path.basename(path))
        if key is None:
            return
        self._cache.forget([key])
        with self._lock:
            # Coalesce a burst of evictions into one event.
            last = self._events[-1] if self._events else None
            if isinstance(last, BlockRemoved) and last.reason == "evicted":
                self._events[-1] = BlockRemoved((*last.keys, key), "evicted")
            else:
                self._events.append(BlockRemoved((key,), "evicted"))

    def run_capacity_pass(self, max_bytes: int | None = None) -> GcReport:
        """One synchronous capacity pass over the root: sweep stale temp and
        ``.nfs*`` files and, above the high watermark of ``max_bytes``
        (default: ``tier.max_bytes``), evict LRU files down to the low
        watermark. Waits for a pass another instance on the root is running.
        Resynchronises the shared usage count."""
        self._check_open()
        report = None
        while report is None:
            report = self._capacity_pass(
                max_bytes if max_bytes is not None else self._max_bytes, wait=True, resync=True
            )
        return report

    def _capacity_pass(
        self, max_bytes: int | None, wait: bool = False, resync: bool = False
    ) -> GcReport | None:
        """Run a pass if this instance gets the root's eviction lock; None when
        another instance holds it (``wait``: after a short sleep, so the
        caller can retry).

        The shared count follows evictions as they happen (``_on_removed``).
        It is *reset* from the walk only when ``resync`` is asked, on this
        instance's first pass, or when the pass removed nothing (the walk then
        is the truth, and a count above it would drop stores for nothing):
        a reset counts the stores other instances made during the walk twice
        when the walk saw them, which is safe but, after every evicting pass,
        would keep the count high and drop stores the root has room for."""
        tier = self.tier_config
        self._flush_recency()  # eviction must see this process's latest hits
        shared = self._shared
        with self._cap_lock, contextlib.ExitStack() as stack:
            if shared is not None and not stack.enter_context(shared.evicting()):
                if wait:
                    time.sleep(_BUSY_RETRY_S)
                return None
            before = shared.read() if shared is not None else 0
            with self._usage_lock:
                self._removed_pending = self._removed_in_pass = 0
            report = collect_garbage(
                self.mapper.root,
                max_bytes,
                tier.low_watermark,
                tier.temp_max_age_s,
                high_watermark=tier.high_watermark,
                on_removed=self._on_removed,
                should_stop=self._cap_stop.is_set,
            )
            self._flush_removed()
            if (
                shared is not None
                and report.complete
                and (resync or not self._usage_known or report.removed_files == 0)
            ):
                with self._usage_lock:
                    mine = self._removed_in_pass
                # Others' net stores during the walk are the change of
                # the count that this pass's own subtractions (mine) do
                # not explain: resync adds count - (before - mine).
                usage = shared.resync(report.final_bytes, before - mine)
                self._usage_known = True
                self._resynced = time.monotonic()
                self.metrics.usage_bytes.set(usage)
        self.metrics.temp_swept.inc(report.temp_removed)
        if report.removed_files:
            log.info(
                "fstier: evicted %d file(s), %d bytes; usage now %d bytes",
                report.removed_files, report.removed_bytes, report.final_bytes,
            )
        return report

    def _capacity_loop(self) -> None:
        while not self._cap_stop.is_set():
            report: GcReport | None = None
            soon = False
            rest = 0.0
            try:
                periodic = time.monotonic() - self._resynced >= _RESYNC_INTERVAL_S
                report = self._capacity_pass(self._max_bytes, resync=periodic)
                # Look again soon when another instance held the lock (its
                # pass may not cover what we stored), when no scan has run
                # yet, or when stores outran a pass that did evict.
                soon = (
                    not self._usage_known
                    or (report is None and self._over_high())
                    or (report is not None and report.removed_files > 0 and self._over_high())
                )
                if report is not None and report.removed_files == 0:
                    # Nothing to evict (the count was reset from the walk):
                    # do not walk again at once, however many stores wake us,
                    # so a huge root is not rescanned back to back.
                    rest = 2 * report.seconds
            except Exception:  # a capacity bug must not kill the tier
                log.exception("fstier: capacity pass failed; retrying later")
            if rest and self._cap_stop.wait(rest):
                return
            self._cap_wake.wait(_BUSY_RETRY_S if soon else _RESYNC_INTERVAL_S)
            self._cap_wake.clear()

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Finish in-flight jobs, stop every thread, release a private pool.
        Idempotent. Results of finished jobs remain readable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.drain(timeout=self.tier_config.io_timeout_s + 5.0)
        finally:
            self._cap_stop.set()
            self._cap_wake.set()
            if self._cap_thread is not None:
                self._cap_thread.join()
            self._io.shutdown()
            self._flush_recency()
            with self._lock:
                executor, self._lookup_pool = self._lookup_pool, None
            if executor is not None:
                executor.shutdown(wait=True)
            if self._own_pool is not None:
                self._own_pool.close()
            if self._shared is not None:
                self._shared.close()

    def __del__(self) -> None:
        # Threads are daemons; this only avoids leaking a private pool when
        # a caller forgets close(). Never raise from a finalizer.
        try:
            if not getattr(self, "_closed", True):
                log.warning("fstier: FsTier garbage-collected without close()")
        except Exception:
            pass

    def __repr__(self) -> str:
        return (
            f"FsTier(root={str(self.mapper.root)!r}, namespace={self.mapper.namespace!r}, "
            f"breaker={self._breaker.state})"
        )
