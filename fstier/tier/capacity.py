"""Capacity: keeping a root under ``max_bytes`` while FsTier runs.

One :class:`Capacity` per :class:`~fstier.manager.FsTier` with ``max_bytes``:

- **Shared usage.** The root's byte count lives in the root itself
  (:class:`~fstier.tier.usage.SharedUsage`: one count file per instance,
  written only by its owner and summed by every reader, no lock), so N
  instances on one root, on one host or many, never fill N x ``max_bytes``.
  It is reported as ``None`` until this instance's first scan.
- **Admission.** :meth:`Capacity.try_reserve` counts a store or says it
  must be dropped (cause ``capacity``), in one step; crossing the high
  watermark wakes the thread, and so does a refusal. A pass counts this
  process's stores in flight toward both watermarks, so it makes room for
  them before they land (a deep write queue no longer keeps admission
  refusing until it drained). Tiers of one process on one root hold one
  count (:mod:`fstier.tier.rootcount`), so each sees the others' stores at
  once, and one of them runs a pass at a time.
- **The thread.** ``fstier-capacity`` runs a pass (:func:`fstier.tier.gc.collect_garbage`)
  on start, when woken above the high watermark, when a count file was bad,
  and every 300 s to resync the count; one evicting instance per root at a
  time (the root's eviction lease, which another instance takes over when
  its holder dies or hangs; a holder that lost it stops its pass). A pass
  first flushes pending recency (``before_pass``), so eviction sees this
  process's latest hits. A capacity bug is logged, never raised
  into the tier.

Costs: a store or an eviction batch costs a few instructions (the count is
published by a background thread); a pass walks the whole root (streaming,
bounded memory). Nothing here waits on a lock another process holds.
Without ``max_bytes`` there is no thread and every call is a no-op.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fstier.clock import SYSTEM_CLOCK, Clock
from fstier.config import TierConfig
from fstier.tier.gc import GcReport, collect_garbage
from fstier.tier.metrics import TierMetrics
from fstier.tier.rootcount import acquire_count, release_count
from fstier.tier.usage import LEASE_S, SharedUsage

if TYPE_CHECKING:  # pragma: no cover
    from fstier.io import EngineJob

__all__ = ["Capacity"]

log = logging.getLogger("fstier.manager")

#: The capacity thread rescans this often even without a trigger: the shared
#: usage count (fstier.tier.usage) drifts only through writers killed mid-store,
#: hand-run ``fstier gc`` and instances without ``max_bytes``.
_RESYNC_INTERVAL_S = 300.0
#: While usage is above the high watermark and another instance holds the
#: eviction lock (or just finished a pass that others outran), look again
#: this soon.
_BUSY_RETRY_S = 0.05
#: Evictions are subtracted from the shared count in batches of this many
#: files, so that a long pass lowers it as it goes (admission sees the room).
_REMOVED_BATCH = 64
#: How often an idle capacity thread looks at the shared view (memory only).
_WATCH_S = 0.5
#: A scan that raced stores is repeated after at least this long.
_RECHECK_MIN_S = 2.0
#: Once no instance's count has moved for this long, a count that moved since
#: the last full scan is made exact by one more (the settled rescan).
_QUIET_S = 2.0


class Capacity:
    """The root-wide usage count and the capacity thread of one tier.

    ``on_evicted(path)`` is called for every block file a pass removes (the
    tier forgets the key and publishes an event); ``before_pass()`` runs
    before each pass (the tier flushes its pending recency)."""

    def __init__(
        self,
        root: Path,
        tier: TierConfig,
        metrics: TierMetrics,
        *,
        on_evicted: Callable[[str], None],
        before_pass: Callable[[], None],
        background: bool = True,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._tier = tier
        self.max_bytes = tier.max_bytes
        self.metrics = metrics
        self._on_evicted = on_evicted
        self._before_pass = before_pass
        # One count per root per process: this process's other tiers on the
        # root see this one's stores the instant they are admitted.
        self._shared: SharedUsage | None = (
            acquire_count(root, tier.file_mode, clock) if self.max_bytes is not None else None
        )
        if self.max_bytes is not None:
            metrics.max_bytes.set(self.max_bytes)
            metrics.high_watermark_bytes.set(self.max_bytes * tier.high_watermark)
            metrics.root_instances.set(1)
        self._root = root
        self._released = False
        self._usage_known = False
        self._resynced = time.monotonic()
        self._recheck_at: float | None = None
        self._scan_s = 0.0  # how long the last full scan took
        self._usage_lock = threading.Lock()
        self._removed_pending = 0  # evicted bytes not yet subtracted from the count
        self._removed_in_pass = 0
        self._cap_lock = threading.Lock()  # one capacity pass at a time
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.max_bytes is not None and background:
            self._thread = threading.Thread(target=self._loop, name="fstier-capacity", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------- the count
    @property
    def usage_bytes(self) -> int | None:
        """Bytes of block files under the root, counted by every instance
        storing into it (None before this instance's first scan or without
        ``max_bytes``)."""
        if self._shared is None or not self._usage_known:
            return None
        return self._shared.read()

    @property
    def shared(self) -> bool:
        """Whether the count is shared with other instances on the root
        (False without ``max_bytes`` or when the root's usage file is not
        one fstier can use)."""
        return self._shared is not None and self._shared.shared

    @property
    def settled(self) -> bool:
        """Whether the count is a scan's, exact: this instance's last complete
        scan raced no store or removal and no instance's count moved since
        (memory only). A steady store workload leaves it False (every walk
        races stores); once every instance is idle the settled rescan makes
        it True within ``_QUIET_S`` plus a walk of the root per instance."""
        shared = self._shared
        return (
            shared is not None and self._usage_known
            and not shared.changed_since_scan and not shared.scan_raced
        )

    @property
    def scans_adopted(self) -> int:
        """Settled scans of other instances this one took as its own."""
        return 0 if self._shared is None else self._shared.scans_adopted

    def refresh_usage(self, *, force: bool = False) -> None:
        """Publish this instance's count now and read every other instance's
        (what the background refresh does every few seconds), through the
        count's I/O lock, so no read that began earlier lands after it.
        ``force`` publishes even an unchanged count (its file was removed).
        For callers that need the root-wide count current now (tools, tests);
        a no-op without ``max_bytes``. Costs one small write and one read per
        instance on the root."""
        if self._shared is not None:
            self._shared.refresh(force=force)

    @property
    def rescan_wanted(self) -> bool:
        """Whether the shared count asked for a rescan of the root (an
        instance's count file was truncated or unreadable); the capacity
        thread rescans at its next round."""
        return self._shared is not None and self._shared.rescan_wanted

    def root_full(self, nbytes: int = 0) -> bool:
        """A store of ``nbytes`` must be dropped: the root is over
        ``max_bytes``, or above the high watermark (a pass is due or
        running) and the job would take it over ``max_bytes``. Counting the
        job itself keeps N instances admitting at once within their unseen
        jobs of ``max_bytes``; below the high watermark any job is admitted,
        so a job larger than the gap to ``max_bytes`` is never refused for
        good (test_admission_counts_the_job_above_the_high_watermark)."""
        if self._shared is None or self.max_bytes is None:
            return False
        return self._full(self._shared.read(), nbytes)

    def _full(self, view: int, nbytes: int) -> bool:
        max_bytes = self.max_bytes
        if max_bytes is None:  # no limit: never full
            return False
        return view > max_bytes or (
            view + nbytes > max_bytes and view > max_bytes * self._tier.high_watermark
        )

    def try_reserve(self, nbytes: int, job: EngineJob | None = None) -> bool:
        """:meth:`root_full` and :meth:`reserve` in one step under the
        count's lock: False (nothing counted) when the store must be
        dropped. Threads and tiers of this process admitting at once never
        all pass against one view. True without ``max_bytes``. The bytes
        counted are marked on ``job.counted`` as they are counted
        (:meth:`~fstier.tier.usage.SharedUsage.reserve`)."""
        if self._shared is None or self.max_bytes is None or nbytes <= 0:
            return self._shared is None or not self.root_full(nbytes)
        view = self._shared.reserve(nbytes, lambda v: not self._full(v, nbytes), job)
        if view is None:
            return False
        self.metrics.usage_bytes.set(view)
        return True

    def _over_high(self) -> bool:
        # The thread wakes by itself for bytes on disk only: stores in flight
        # above the watermark wake it when admission refuses one (a pass then
        # makes room for them too: pending_bytes), not at every settle.
        return (
            self._shared is not None
            and self.max_bytes is not None
            and self._shared.read() - self._shared.inflight > self.max_bytes * self._tier.high_watermark
        )

    def add(self, delta: int) -> None:
        """Add ``delta`` bytes (stores: positive; removals: negative) to the
        shared count; crossing the high watermark wakes the thread."""
        if self._shared is None or self.max_bytes is None or delta == 0:
            return
        usage = self._shared.add(delta)
        self.metrics.usage_bytes.set(usage)
        if usage > self.max_bytes * self._tier.high_watermark:
            self._wake.set()

    def reserve(self, nbytes: int) -> None:
        """Count an admitted store's ``nbytes`` now, before it is written
        (every instance's admission sees stores in flight); :meth:`settle`
        when it ends. A pass counts this process's stores in flight toward
        both watermarks (room is made for them before they land)."""
        if self._shared is not None and self.max_bytes is not None and nbytes > 0:
            view = self._shared.reserve(nbytes)
            if view is not None:
                self.metrics.usage_bytes.set(view)

    def settle(self, reserved: int, stored: int) -> None:
        """A store that :meth:`reserve` counted ``reserved`` bytes for ended
        with ``stored`` bytes on disk: the rest is given back; a pass starts
        when the root is now over the high watermark."""
        if self._shared is not None and self.max_bytes is not None and reserved > 0:
            self.metrics.usage_bytes.set(self._shared.settle(reserved, stored))
            if self._over_high():
                self._wake.set()

    def wake(self) -> None:
        """Ask the thread for a pass now."""
        self._wake.set()

    def _flush_removed(self) -> None:
        with self._usage_lock:
            pending, self._removed_pending = self._removed_pending, 0
            self._removed_in_pass += pending
        if pending:
            self.add(-pending)

    def _on_removed(self, path: str, size: int) -> None:
        self.metrics.evicted_blocks.inc()
        self.metrics.evicted_bytes.inc(size)
        with self._usage_lock:
            self._removed_pending += size
            batch = self._removed_pending >= _REMOVED_BATCH * size
        if batch:
            self._flush_removed()
        self._on_evicted(path)

    # ---------------------------------------------------------------- passes
    def run_pass(self, max_bytes: int | None = None, timeout: float | None = 60.0) -> GcReport:
        """One synchronous pass (see :meth:`fstier.manager.FsTier.run_capacity_pass`).
        Raises :class:`TimeoutError` when another instance held the root's
        eviction lease for all of ``timeout`` seconds; a pass still walking
        at the deadline stops there (``report.complete`` is False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        report = None
        while report is None:
            report = self._pass(
                max_bytes if max_bytes is not None else self.max_bytes,
                wait=True, deadline=deadline,
            )
            if report is None and deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"run_capacity_pass: another instance held the eviction lease of "
                    f"{self._root} for {timeout} s; retry later (a holder that died or hangs "
                    f"loses it within {LEASE_S:.0f} s)"
                )
        return report

    def _pass(
        self,
        max_bytes: int | None,
        wait: bool = False,
        deadline: float | None = None,
    ) -> GcReport | None:
        """Run a pass if this instance gets the root's eviction lock; None when
        another instance holds it (``wait``: after a short sleep, so the
        caller can retry).

        The shared count follows evictions as they happen (``_on_removed``).
        Every complete pass's walk resets it
        (:meth:`~fstier.tier.usage.SharedUsage.end_scan`): exact when the
        walk raced no store, else only a bound on the count (a walk may see a
        store the count also holds: it never raises an exact count). Before,
        only passes that removed nothing reset it, and a high count from a
        raced walk stayed through every evicting pass: a CephFS host's view
        was 22.5% above the disk 5 s after both hosts drained."""
        tier = self._tier
        self._before_pass()  # eviction must see this process's latest hits
        shared = self._shared
        with self._cap_lock, contextlib.ExitStack() as stack:
            if shared is not None and not stack.enter_context(shared.evicting()):
                if wait:
                    time.sleep(_BUSY_RETRY_S)
                return None
            token = shared.begin_scan() if shared is not None else None
            with self._usage_lock:
                self._removed_pending = self._removed_in_pass = 0

            def should_stop() -> bool:
                return (
                    self._stop.is_set()
                    or (deadline is not None and time.monotonic() >= deadline)
                    or (shared is not None and shared.lease_lost())
                )

            report = collect_garbage(
                self._root,
                max_bytes,
                tier.low_watermark,
                tier.temp_max_age_s,
                high_watermark=tier.high_watermark,
                on_removed=self._on_removed,
                should_stop=should_stop,
                # This process's admitted stores not on disk yet: room is made
                # for them now, not once they land (admission refuses meanwhile).
                pending_bytes=self._pending if shared is not None else None,
            )
            self._flush_removed()
            if shared is not None and token is not None and report.complete:
                with self._usage_lock:
                    mine = self._removed_in_pass
                before = shared.read()
                # The walk is the new base; what anyone stored since the
                # token counts on top, this pass's own removals (mine) once.
                usage = shared.end_scan(token, report.final_bytes, mine)
                if self._usage_known and not shared.scan_raced:
                    # How far the count was from the disk (exported: an
                    # alert on it names writers the count does not see).
                    self.metrics.usage_correction_bytes.set(abs(usage - before))
                self._usage_known = True
                self._resynced = time.monotonic()
                self._scan_s = report.seconds
                # Stores during the walk may be counted twice: scan again
                # once things are quieter, so the count ends exact.
                self._recheck_at = (
                    self._resynced + max(_RECHECK_MIN_S, 10 * report.seconds)
                    if shared.scan_raced else None
                )
                self.metrics.usage_bytes.set(usage)
        self.metrics.temp_swept.inc(report.temp_removed)
        if report.removed_files:
            log.info(
                "fstier: evicted %d file(s), %d bytes; usage now %d bytes",
                report.removed_files, report.removed_bytes, report.final_bytes,
            )
        return report

    def _pending(self, walked: int) -> int:
        """Bytes of this process's stores in flight that a walk finding
        ``walked`` bytes did not see: what the count holds beyond the walk,
        at most the bytes in flight. A store whose file landed (the walk saw
        it) but whose job is not reaped yet counts once, in the walk: the
        newest files are never evicted for their own bytes."""
        shared = self._shared
        if shared is None:
            return 0
        self._flush_removed()  # this pass's removals so far leave the count first
        return min(shared.inflight, max(0, shared.read() - walked))

    def _rescan_due(self) -> bool:
        now = time.monotonic()
        shared = self._shared
        return (
            now - self._resynced >= _RESYNC_INTERVAL_S
            # (a raced scan; not once another instance's settled scan was
            # taken as this one's: test_a_settled_scan_is_shared)
            or (
                self._recheck_at is not None and now >= self._recheck_at
                and (shared is None or shared.scan_raced)
            )
            or (shared is not None and shared.rescan_wanted)
            # Settled: the count moved by deltas since the last scan (each a
            # little off: stores the walk saw twice, another host's late
            # count) and nothing moves now; one walk makes it exact, once per
            # quiet spell, at most one walk per two walks' time
            # (test_settled_count_is_rescanned_exact).
            or (
                shared is not None
                and self._usage_known
                and shared.changed_since_scan
                and shared.quiet_s() >= _QUIET_S
                and now - self._resynced >= max(_RECHECK_MIN_S, 2 * self._scan_s)
            )
        )

    def _loop(self) -> None:
        while not self._stop.is_set():
            report: GcReport | None = None
            soon = False
            rest = 0.0
            try:
                report = self._pass(self.max_bytes)
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
            if rest and self._stop.wait(rest):
                return
            if soon:
                self._wake.wait(_BUSY_RETRY_S)
            else:
                # Wake on a store over the high watermark, on others' stores
                # pushing the shared view over it, on a bad count file, or
                # for the periodic resync.
                end = time.monotonic() + _RESYNC_INTERVAL_S
                while not self._wake.wait(_WATCH_S):
                    if self._shared is not None:
                        self.metrics.root_instances.set(self._shared.live_instances())
                    if self._stop.is_set() or time.monotonic() >= end or self._over_high():
                        break
                    if self._rescan_due():
                        break
            self._wake.clear()

    # ------------------------------------------------------------- lifecycle
    def stop(self) -> None:
        """Stop the thread (a running pass stops at its next file) and wait for it."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        """Release the shared count (after :meth:`stop` and the last store)."""
        if self._shared is not None and not self._released:
            self._released = True
            release_count(self._shared)
