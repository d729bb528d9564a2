"""Disk usage of a root, shared by every FsTier instance (and host) storing into it.

Capacity is root-wide (one disk, one budget), so every instance on a root
must see the bytes the others store (five writers each counting only their
own reached 2.86x ``max_bytes``). An instance is one process's count of a
root, held by each of its tiers on that root (:mod:`fstier.tier.rootcount`).

Design: one count per instance, published only by its owner, summed by
readers, no lock. Nothing shared is ever rewritten in place and re-read:
network clients (GlusterFS, ceph-fuse) serve a rewritten file's old pages,
and a renamed-over or unlinked name's old entry, for a second or more, so
every shared value is carried by a **name**, which a directory listing
returns fresh.

- Each instance's count is an empty file's name
  (:mod:`fstier.tier.countnames`): the bytes it stored and removed since it
  started (both only grow), the part of those stored not written yet, and a
  generation. Its owner creates the new name (``O_EXCL``: never through a
  planted link) and then unlinks the old one; a reader lists the directory
  and takes the largest value of each instance (fstier < 0.6's files too).
- A reader's view is ``base + sum(stored_i - stored_i at base) -
  sum(removed_i - removed_i at base)``: ``base`` is the bytes its last full
  scan found; stores count from just *before* that scan and removals from
  just *after* it, so a store or removal racing the walk can only make the
  view too high (it evicts a little early), never too low (which would let
  the root overshoot); a scan that raced is repeated later. The eviction
  lease orders removals with scans: every scan runs under it and a holder
  publishes its count before giving it back, so a removal published after
  a scan began is of a file it counted.
- A store counts from its admission (:meth:`SharedUsage.reserve`), so every
  instance sees stores in flight; what it did not store is given back as
  removed when it ends (:meth:`SharedUsage.settle`). A scan counts every
  instance's stores in flight at its start on top of what it walked (it
  may not have seen their files).
- The hot path does no I/O: :meth:`SharedUsage.add` and
  :meth:`SharedUsage.read` touch memory under a thread lock, and ``add``
  wakes the ``fstier-usage`` thread, which publishes this instance's count
  (coalescing changes; a new generation every ``HEARTBEAT_S`` regardless)
  and lists the others' (every ``REFRESH_S`` when idle); a hung mount
  stalls that thread only, after the first round (made at start, before
  any store: of two instances started at once one lists the other).
- **Content is never trusted beyond what the disk shows.** A name that does
  not parse, a value outside 0..2^60 or one that went down is ignored (the
  instance keeps its last good value); so is a claim that more bytes were
  removed since this reader's scan than that scan found plus everything
  stored since (a planted ``removed`` of 2^60 pinned the view at 0 and let
  the root reach 3x ``max_bytes``): either asks for a rescan, which takes
  the file's claim as its new baseline. A count that vanished keeps its last value;
  the sum is clamped to ``[0, 2^62]``. Nothing here raises to a caller.
- **A settled scan is shared.** A scan that raced nothing, with no store
  in flight anywhere, is published as a name too (``<instance>.<bytes>.
  <digest>.scn``, :mod:`fstier.tier.countnames`): the bytes it found and a
  digest of every instance's (stored, removed) it saw. Another instance
  whose own view of every count has that same digest takes those bytes as
  its own scan's (exact: no count moved since, so the disk still holds
  them): one walk per quiet spell per root, not one per instance (a
  ceph-fuse walk took 74 s). The owner's next count that moved removes it.
- An instance whose generation has not moved for ``STALE_S`` of this
  reader's own monotonic time is gone: any reader removes its names.
- **Eviction is one instance at a time per root** through a lease,
  ``.fstier-usage.d/evict.lease`` (:mod:`fstier.tier.lease`: an ``O_EXCL``
  create, expiry judged by each reader's own clock).
- **The directory is re-resolved under the root every round**
  (:mod:`fstier.tier.usagedir`): the fd opened at start is used only while
  ``<root>/.fstier-usage.d`` names it (``st_dev``/``st_ino``); moved away
  or replaced, the old one is never written again and a new one is opened
  (or made) under the root. One fstier cannot use at start (a symlink, a
  FIFO, no permission) turns sharing off for this instance with one
  warning: it counts its own stores until its next scan.

Costs per round (back to back while storing): one create, one unlink, one
listing, two ``stat`` calls; nothing on the caller's thread after start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fstier.clock import SYSTEM_CLOCK, Clock
from fstier.tier.countnames import (
    MAX_COUNT,
    SCAN_SUFFIX,
    count_name,
    counts_digest,
    instance_name,
    read_listing,
    scan_name,
)
from fstier.tier.lease import LEASE_NAME, LEASE_S, RENEW_S, EvictionLease
from fstier.tier.liveness import HEARTBEAT_S, STALE_S, Liveness
from fstier.tier.unseen import StoreRates
from fstier.tier.usagedir import USAGE_DIR_NAME, UsageDir

__all__ = [
    "EVICT_LOCK_NAME",
    "HEARTBEAT_S",
    "LEASE_NAME",
    "LEASE_S",
    "RENEW_S",
    "ROOT_FILES",
    "STALE_S",
    "USAGE_DIR_NAME",
    "USAGE_FILE_NAME",
    "SharedUsage",
]

log = logging.getLogger("fstier.manager")

#: fstier < 0.4 kept one count here under ``flock`` (no longer written)
USAGE_FILE_NAME = ".fstier-usage"
#: fstier < 0.4's eviction lock (no longer used)
EVICT_LOCK_NAME = ".fstier-evict.lock"
#: fstier's own entries at the top of a root (not strays for ``fstier inspect``)
ROOT_FILES = frozenset({USAGE_DIR_NAME, USAGE_FILE_NAME, EVICT_LOCK_NAME})

_MAX_ABS = MAX_COUNT
_SINK = SimpleNamespace(counted=0)
_MAX_SUM = 1 << 62

#: Rounds of the background thread are at least this far apart.
MIN_ROUND_S = 0.001
#: Read the other instances' counts this often.
REFRESH_S = 0.2
#: How late another instance's count may reach a reader (publish + refresh
#: + a FUSE mount's 1 s caches), with margin: a scan that saw counts move
#: this close to its start may have raced them (it is repeated).
SETTLE_S = 2.0
#: Wait at most this long for a rescan after a bad count asked for one.
_RESCAN_MIN_INTERVAL_S = 10.0

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class ScanToken:
    """What :meth:`SharedUsage.begin_scan` saw just before a full scan:
    (stored, removed) of this instance and of every other one."""

    own: tuple[int, int]
    others: dict[str, tuple[int, int]]
    at: float  # the usage clock when it was taken


class SharedUsage:
    """The usage count of one root shared by every instance on it, and the
    root's eviction lease (see the module docstring).

    ``clock`` (:mod:`fstier.clock`) times lease expiry, staleness and
    quiet spells (tests pass a :class:`~fstier.clock.ManualClock`)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        file_mode: int = 0o644,
        *,
        background: bool = True,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.root = Path(root)
        self._mode = file_mode
        self._clock = clock.monotonic
        self.instance = instance_name()
        self._lock = threading.Lock()
        self._io_lock = threading.Lock()  # one publisher/reader at a time
        self._pass_lock = threading.Lock()  # one capacity pass at a time (of every tier holding this count)
        #: bytes this instance stored and removed since it started
        self._stored = 0
        self._removed = 0
        self._inflight = 0  # reserved for stores not ended yet (in _stored)
        self._gen = 0
        self._published: tuple[int, int, int] | None = None
        self._published_at = 0.0
        self._own_names: list[str] = []  # this instance's names to remove (the newest last)
        #: other instances' last good (stored, removed), and at this instance's base
        self._others: dict[str, tuple[int, int]] = {}
        self._others_base: dict[str, tuple[int, int]] = {}
        #: claims refused as impossible, taken as their baseline by the next scan
        self._refused: dict[str, tuple[int, int]] = {}
        #: other instances' stores in flight (counted in their stored, maybe not on disk yet)
        self._others_inflight: dict[str, int] = {}
        self._rates = StoreRates()  # others' stores not listed yet, estimated for admission
        self._liveness = Liveness()  # when each other instance's generation last moved
        #: leftover names and when this instance first saw them
        self._leftovers: dict[str, float] = {}
        self._scanned = False  # no claim is judged before this instance's first scan
        self._own_base = (0, 0)
        self._base = 0
        self.rescan_wanted = False
        #: the last scan raced stores or removals (its count may be high)
        self.scan_raced = False
        self._last_activity = -1e18  # when another instance's count last moved
        self._last_add = -1e18  # when this instance's count last moved
        #: the count moved since the last full scan (a settled rescan makes it exact)
        self.changed_since_scan = False
        #: a settled scan to share: (bytes, digest of every count it saw)
        self._scan_to_share: tuple[int, str] | None = None
        #: settled scans of other instances taken as this instance's own
        self.scans_adopted = 0
        self._rescan_asked = -1e18
        self._warned: set[str] = set()
        self._lease = EvictionLease(self.instance, file_mode, clock.monotonic, self._warn_once)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self._usage_dir: UsageDir | None = UsageDir(self.root, self._warn_once, self._dir_replaced)
        except OSError as exc:
            self._usage_dir = None
            log.warning(
                "fstier: usage of %s is not shared with other instances (%s); each instance "
                "counts its own stores until its next capacity pass. Remove whatever is at "
                "%s to share it again", self.root, exc.strerror or exc, self.root / USAGE_DIR_NAME,
            )
            self._disabled = True
            return
        self._disabled = False
        if background:  # the first round here: two instances started at once, one sees the other
            self._round()
            self._thread = threading.Thread(target=self._run, name="fstier-usage", daemon=True)
            self._thread.start()

    def _dir(self) -> int | None:
        """The usage directory's fd (:class:`~fstier.tier.usagedir.UsageDir`:
        re-resolved under the root), None when none is usable now."""
        return None if self._disabled or self._usage_dir is None else self._usage_dir.fd()

    def _dir_replaced(self) -> None:
        # Our names and lease were in the old directory: publish anew.
        self._published = None
        self._own_names = []
        self._lease.drop()

    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    @property
    def shared(self) -> bool:
        return not self._disabled

    # ------------------------------------------------------------- hot path
    def read(self) -> int:
        """The root's usage as this instance sees it (memory only)."""
        with self._lock:
            return self._sum_locked()

    def _stored_since_base_locked(self, others: dict[str, tuple[int, int]]) -> int:
        """What the last scan found plus every store since (by ``others`` too)."""
        return self._base + (self._stored - self._own_base[0]) + sum(
            max(0, stored - self._others_base.get(name, (0, 0))[0]) for name, (stored, _r) in others.items()
        )

    def _sum_locked(self) -> int:
        total = self._base + (self._stored - self._own_base[0]) - (self._removed - self._own_base[1])
        for name, (stored, removed) in self._others.items():
            b_stored, b_removed = self._others_base.get(name, (0, 0))
            total += (stored - b_stored) - (removed - b_removed)
        return max(0, min(_MAX_SUM, total))

    def add(self, delta: int) -> int:
        """Add ``delta`` bytes (negative for removals); returns the new view.
        Memory only: the background thread publishes it."""
        with self._lock:
            self._stored, self._removed = (
                (min(_MAX_ABS, self._stored + delta), self._removed) if delta > 0
                else (self._stored, min(_MAX_ABS, self._removed - delta))
            )
            view = self._sum_locked()
            self._last_add = self._clock()
            self.changed_since_scan = True
        self._wake.set()  # publish now (the thread coalesces a burst)
        return view

    def reserve(self, nbytes: int, admit: Callable[[int], bool] = lambda view: True, mark: Any = None) -> int | None:
        """Count a store in flight (it counts as stored from now on: others
        see it) if ``admit(view)``, in one step under the lock (two threads
        or tiers never both admit against one view; ``view`` counts the
        others' stores not listed yet, :mod:`fstier.tier.unseen`);
        :meth:`settle` when it ends. Returns the new view, None when refused.
        ``mark.counted = nbytes`` in the statement that counts them (no call: no signal handler between)."""
        with self._lock:
            if not admit(self._sum_locked() + self._rates.unseen(self._clock(), self._stored)):
                return None
            sink = _SINK if mark is None else mark
            inflight, stored = self._inflight + nbytes, min(_MAX_ABS, self._stored + nbytes)
            self._inflight, self._stored, sink.counted = inflight, stored, nbytes
            view = self._sum_locked()
            self._last_add = self._clock()
            self.changed_since_scan = True
        self._wake.set()
        return view

    def settle(self, reserved: int, stored: int) -> int:
        """A store :meth:`reserve` counted ``reserved`` bytes for ended with
        ``stored`` on disk: the rest counts as removed. Returns the new view."""
        with self._lock:
            self._inflight = max(0, self._inflight - reserved)
        return self.add(stored - reserved) if reserved > stored else self.read()

    # ---------------------------------------------------------------- scans
    def begin_scan(self) -> ScanToken:
        """Call just before a full scan: refreshes the others' counts (on
        the calling thread, the capacity thread) and returns what they were."""
        self.refresh()
        with self._lock:
            # Stores in flight are not on disk yet: the walk may miss them,
            # so they count on top of it (as stores made after the token).
            own = (self._stored - self._inflight, self._removed)
            others = {
                name: (stored - self._others_inflight.get(name, 0), removed)
                for name, (stored, removed) in self._others.items()
            }
            return ScanToken(own, others, self._clock())

    def end_scan(self, token: ScanToken, scanned: int, removed_by_scan: int) -> int:
        """A full scan that began at ``token`` left ``scanned`` bytes on disk
        (after removing ``removed_by_scan`` bytes, which it also added to
        this instance's removals). Stores made since the token count on top
        (twice if the walk saw them: high, never low). A scan that raced
        (:attr:`scan_raced`; rescanned once quiet) only bounds the truth to
        [``scanned``, its new view]: the view it replaces (every count
        followed since the last scan, or before the first, every count as
        listed) is kept when it lies in there. Returns the view."""
        self.refresh()
        with self._lock:
            trusted, before = not self._refused and not self.rescan_wanted, self._sum_locked()
            # Others' stores reach us late (publish + refresh): any activity
            # seen near the walk may have raced it.
            self.scan_raced = (
                (self._stored, self._removed - removed_by_scan) != token.own
                or self._last_activity >= token.at - SETTLE_S
            )
            self._base = max(0, scanned)
            self._own_base = (token.own[0], self._removed)
            # Claims refused as impossible: the scan is the truth, and what
            # they claim now is their baseline (test_planted_removal_claim...).
            self._others.update(self._refused)
            self._others_base = {
                name: (token.others.get(name, (0, 0))[0], removed)
                for name, (_stored, removed) in self._others.items()
            }
            for name, value in self._refused.items():
                self._others_base[name] = value
            self._refused.clear()
            self.rescan_wanted = False
            self.changed_since_scan = self.scan_raced
            self._scanned = True
            self._scan_to_share = None
            new = self._sum_locked()
            if self.scan_raced and trusted and scanned <= before < new:  # two hosts' views were 12-23% high
                self._base += before - new
            if not self.scan_raced and self._inflight == 0 and not any(self._others_inflight.values()):
                self._scan_to_share = (self._base, counts_digest(self._counts_locked()))
                self._wake.set()
            return self._sum_locked()

    def _counts_locked(self) -> dict[str, tuple[int, int]]:
        """Every instance's (stored, removed) as this one sees it."""
        return {**self._others, self.instance: (self._stored, self._removed)}

    def live_instances(self) -> int:
        """This instance and every other whose count moved in the last two heartbeats (memory only)."""
        with self._lock:
            return 1 + len(self._liveness.live(self._clock()))

    @property
    def inflight(self) -> int:  # this instance's stores counted, maybe not on disk
        return self._inflight

    def quiet_s(self) -> float:
        """Seconds since this instance's or any other's count last moved."""
        return self._clock() - max(self._last_add, self._last_activity)

    def _want_rescan(self, why: str) -> None:
        now = self._clock()
        self._warn_once(why, "fstier: %s; ignoring it and rescanning %s", why, self.root)
        if now - self._rescan_asked >= _RESCAN_MIN_INTERVAL_S:
            self._rescan_asked = now
            self.rescan_wanted = True

    # ------------------------------------------------------ the background side
    def _run(self) -> None:
        while not self._stop.is_set():
            self._round()
            self._wake.wait(REFRESH_S)
            self._wake.clear()
            self._stop.wait(MIN_ROUND_S)

    def _round(self) -> None:
        try:
            self.refresh()
        except Exception:  # a bookkeeping bug must not kill the tier
            log.exception("fstier: refreshing the shared usage count failed")

    def refresh(self, *, force: bool = False) -> None:
        """Publish this instance's count if it changed (or for a heartbeat;
        ``force``: in any case, e.g. after its name was removed) and read the
        others'. Never raises for filesystem trouble."""
        with self._io_lock:
            dfd = self._dir()
            if dfd is None:
                return
            self._publish(dfd, force)
            self._share_scan(dfd)
            self._read_others(dfd)

    def _publish(self, dfd: int, force: bool = False) -> None:
        with self._lock:
            value = (self._stored, self._removed, self._inflight)
        now = self._clock()
        if not force and value == self._published and now - self._published_at < HEARTBEAT_S:
            return
        gen = self._gen + 1
        name = count_name(self.instance, gen, *value)
        try:
            os.close(os.open(name, _CREATE_FLAGS, self._mode, dir_fd=dfd))
        except OSError as exc:
            self._warn_once(f"write:{exc.errno}", "fstier: cannot publish the usage count in %s: %s",
                            self.root / USAGE_DIR_NAME, exc)
            return
        self._gen = gen
        moved = value != self._published
        self._published = value
        self._published_at = now
        # A shared scan stays while the count it saw does (a heartbeat or a
        # lease given back publishes the same value anew).
        old = [n for n in self._own_names if moved or not n.endswith(SCAN_SUFFIX)]
        self._own_names = [n for n in self._own_names if n not in old]
        for stale in old:
            try:
                os.unlink(stale, dir_fd=dfd)
            except FileNotFoundError:
                pass
            except OSError:
                self._own_names.append(stale)  # try again next time
        self._own_names.append(name)

    def _share_scan(self, dfd: int) -> None:
        """Publish the settled scan :meth:`end_scan` left, while every count
        is still what it saw (this instance's own published)."""
        with self._lock:
            pending, self._scan_to_share = self._scan_to_share, None
            if pending is None or self._published != (self._stored, self._removed, 0):
                return
            if counts_digest(self._counts_locked()) != pending[1]:
                return  # a count moved since the scan: nothing to share
        for old in [n for n in self._own_names if n.endswith(SCAN_SUFFIX)]:
            with contextlib.suppress(OSError):
                os.unlink(old, dir_fd=dfd)
            self._own_names.remove(old)
        name = scan_name(self.instance, *pending)
        try:
            os.close(os.open(name, _CREATE_FLAGS, self._mode, dir_fd=dfd))
        except OSError:
            return
        self._own_names.insert(0, name)  # the next count that moved removes it

    def _adopt_scan_locked(self, scans: dict[str, tuple[int, str]]) -> None:
        """Take another instance's settled scan as this one's (see the module
        docstring) when every count is still what that scan saw."""
        if not (self._scanned and (self.changed_since_scan or self.scan_raced)) or self._refused:
            return
        if self._inflight or any(self._others_inflight.values()):
            return
        digest = counts_digest(self._counts_locked())
        for nbytes, seen in scans.values():
            if seen == digest and nbytes <= _MAX_SUM:
                self._base = nbytes
                self._own_base = (self._stored, self._removed)
                self._others_base = dict(self._others)
                self.changed_since_scan = self.scan_raced = False
                self.scans_adopted += 1
                return

    def _read_others(self, dfd: int) -> None:
        try:
            names = [e.name for e in os.scandir(dfd)]
        except OSError:
            return
        listing = read_listing(dfd, names, set(self._own_names), self.instance)
        for name, why in listing.bad:
            self._want_rescan(f"{USAGE_DIR_NAME}/{name} {why}")
        seen, beats, files, scans = listing.counts, listing.beats, listing.files, listing.scans
        with self._lock:
            now = self._clock()
            good: dict[str, tuple[int, int]] = {}
            for inst, value in seen.items():
                last = self._others.get(inst)
                if last is not None and (value[0] < last[0] or value[1] < last[1]):
                    self._want_rescan(f"{USAGE_DIR_NAME}/{inst} holds no valid count (it went down)")
                    continue
                good[inst] = value
            # No instance can have removed more bytes since the base than the
            # scan found plus everything stored since: such a claim is not
            # what the disk shows (test_planted_removal_claim...).
            stored_since = self._stored_since_base_locked({**self._others, **good})
            for inst, value in list(good.items()):
                if self._scanned and value[1] - self._others_base.get(inst, (0, 0))[1] > stored_since:
                    del good[inst]
                    self._refused[inst] = value
                    self._want_rescan(
                        f"{USAGE_DIR_NAME}/{inst} claims more bytes removed than the root held"
                    )
            for inst in good:
                self._refused.pop(inst, None)
                self._others_inflight[inst] = min(good[inst][0], listing.inflight.get(inst, 0))
            if any(self._others.get(i) != v for i, v in good.items()):
                self._last_activity = now
                self.changed_since_scan = True
            self._others.update(good)
            dead = self._liveness.saw(beats, now)
            others_stored = {inst: value[0] for inst, value in self._others.items()}
            self._rates.listed(others_stored, now, self._stored, self._liveness.live(now))
            if scans:
                self._adopt_scan_locked(scans)
        self._leftovers = self._liveness.remove_gone(dfd, dead, files, self._leftovers, listing.leftovers, now)

    # ---------------------------------------------------------------- lease
    def try_lease(self) -> bool:
        """Take (or renew) the root's eviction lease (:mod:`fstier.tier.lease`);
        False while another live instance holds it. Never blocks on a lock."""
        if self._disabled:
            return True  # not shared: this instance is alone as far as it knows
        with self._io_lock:
            dfd = self._dir()
            if dfd is None:
                return True  # no usable directory now: evict (the behaviour before sharing)
            return self._lease.take(dfd)

    @property
    def holds_lease(self) -> bool:
        return self._lease.held

    def lease_lost(self) -> bool:
        """For a running pass: renew the lease when due; True when it was
        taken over (the pass must stop)."""
        if self._disabled or not self._lease.renewal_due():
            return False
        return not self.try_lease()

    def release_lease(self) -> None:
        """Publish this instance's count, then give the lease back: the next
        holder's scan sees every removal made under it."""
        if not self._lease.held:
            return
        self.refresh(force=True)
        with self._io_lock:
            self._lease.give_back(self._dir())

    @contextlib.contextmanager
    def evicting(self) -> Iterator[bool]:
        """Try to become the one instance running a capacity pass on this
        root: yields True while this instance holds the lease, False when
        another live instance, or another tier of this process
        (:mod:`fstier.tier.rootcount`), does (the caller skips its pass)."""
        if not self._pass_lock.acquire(blocking=False):
            yield False
            return
        try:
            if not self.try_lease():
                yield False
                return
            try:
                yield True
            finally:
                self.release_lease()
        finally:
            self._pass_lock.release()

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the thread and publish the final count (others keep it)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10.0)
        with contextlib.suppress(Exception):
            self.release_lease()
        with contextlib.suppress(Exception):
            self.refresh(force=True)
        with self._io_lock:
            self._disabled = True
            if self._usage_dir is not None:
                self._usage_dir.close()
