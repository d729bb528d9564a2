"""Disk usage of a root, shared by every FsTier instance (and host) storing into it.

Capacity is root-wide (one disk, one budget), so every instance on a root
must see the bytes the others store. Each instance tracking only its own
stores let five writers on one root reach several times ``max_bytes``
between their rescans (``benchmarks/bench_multi_instance.py``).

Design: one count file per instance, written only by its owner, summed by
readers. No lock anywhere.

- ``<root>/.fstier-usage.d/<instance>.count`` holds one line,
  ``fstier-usage 2 <stored> <removed>``: the bytes this instance has stored
  and removed since it started (both only grow). Only its owner writes it, and only
  by writing a new temp file and renaming it over the name, so no write
  ever goes through a hard link or a symlink planted there (the rename
  replaces the name, never the inode it named), and a reader on another
  host opens a new inode (GlusterFS keeps serving a rewritten file's old
  bytes to a long-lived fd for over a minute; an ``flock``-guarded
  read-modify-write lost half of two hosts' updates there).
- A reader's view is ``base + sum(stored_i - stored_i at base) -
  sum(removed_i - removed_i at base)``: ``base`` is the bytes its last full
  scan found; stores count from just *before* that scan and removals from
  just *after* it, so a store or removal racing the walk can only make the
  view too high (it evicts a little early), never too low (which would let
  the root overshoot); a scan that raced is repeated about 2 s later. Between
  scans only deltas matter, so an instance that died keeps contributing
  nothing new, and a new instance counts from when it is first seen.
- The hot path does no I/O: :meth:`SharedUsage.add` and
  :meth:`SharedUsage.read` touch memory under a thread lock held for a few
  instructions, and :meth:`SharedUsage.add` wakes a background thread
  (``fstier-usage``), which publishes this instance's count (one write at a
  time: changes made meanwhile are coalesced into the next; every
  ``HEARTBEAT_S`` regardless) and then reads the others' files (also every
  ``REFRESH_S`` when idle); a hung mount stalls that thread only.
- Content is never trusted: a file that is not a regular file, is larger
  than 256 bytes, does not parse, holds a value outside 0..2^60 or one that
  went down is ignored
  (the instance keeps its last good value) and asks for a rescan
  (:attr:`SharedUsage.rescan_wanted`); a count file that vanished keeps its
  last value; the sum is clamped to ``[0, 2^62]``. Nothing here raises to a
  caller.
- Count files not rewritten for ``STALE_S`` (their owner is gone) are
  removed by any reader: only regular files with the count-file name.
- Eviction is one instance at a time per root through a **lease**,
  ``.fstier-usage.d/evict.lease`` (``fstier-lease 1 <owner> <expires-ns>``),
  written the same way (temp + rename). An instance takes it when it is
  absent, expired, unreadable or its own; the holder renews it while a pass
  runs and gives it back after. A holder that dies or hangs stops renewing
  and any other instance takes over after ``LEASE_S``; a holder that finds
  the lease taken from it stops its pass. Two instances that take a free
  lease in the same instant both evict once (over-eviction of one pass at
  most, never wrong data: eviction unlinks only unchanged files).
- A directory that is not one fstier can use (a symlink, a file, a FIFO, no
  permission) turns sharing off for this instance with one warning: it
  counts its own stores until its next scan (the behaviour before sharing
  existed).

Accuracy: while instances store, each sees the others' stores as soon as
its own thread's next round reads them (about a millisecond on a local
disk, one round trip per file on a network mount; at most ``REFRESH_S``
for an instance that does not store) plus the filesystem's own metadata
cache (about 1 s on a default GlusterFS mount); a full scan (the capacity
pass) is the truth and resets the base. Costs per instance: one small file
written and renamed per round while it stores (rounds run back to back, so
a slow mount means fewer, larger rounds), one directory listing and N small
reads per round (N = instances on the root), nothing on the caller's
thread.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import socket
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "EVICT_LOCK_NAME",
    "ROOT_FILES",
    "USAGE_DIR_NAME",
    "USAGE_FILE_NAME",
    "SharedUsage",
]

log = logging.getLogger("fstier.manager")

USAGE_DIR_NAME = ".fstier-usage.d"
#: fstier < 0.4 kept one count here under ``flock`` (no longer written)
USAGE_FILE_NAME = ".fstier-usage"
#: fstier < 0.4's eviction lock (no longer used)
EVICT_LOCK_NAME = ".fstier-evict.lock"
#: fstier's own entries at the top of a root (not strays for ``fstier inspect``)
ROOT_FILES = frozenset({USAGE_DIR_NAME, USAGE_FILE_NAME, EVICT_LOCK_NAME})

LEASE_NAME = "evict.lease"
COUNT_SUFFIX = ".count"
#: a count file's name: <host>-<pid>-<token>.count (host made one safe component)
_COUNT_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}\.count$")
_MAX_FILE = 256
_MAX_ABS = 1 << 60
_MAX_SUM = 1 << 62

#: Rounds of the background thread are at least this far apart.
MIN_ROUND_S = 0.001
#: Read the other instances' counts this often.
REFRESH_S = 0.2
#: Rewrite the count file this often even when unchanged (others judge staleness by it).
HEARTBEAT_S = 30.0
#: A count file not rewritten for this long belongs to a dead instance.
STALE_S = 3600.0
#: An eviction lease lasts this long unless renewed.
LEASE_S = 30.0
#: A holder renews its lease this often while a pass runs.
RENEW_S = 5.0
#: How late another instance's count may reach a reader (publish + refresh
#: + a FUSE mount's 1 s caches), with margin.
SETTLE_S = 2.0
#: Wait at most this long for a rescan after a bad count file asked for one.
_RESCAN_MIN_INTERVAL_S = 10.0

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _safe_host() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64].lstrip(".")
    return host or "host"


@dataclass(frozen=True, slots=True)
class ScanToken:
    """What :meth:`SharedUsage.begin_scan` saw just before a full scan:
    (stored, removed) of this instance and of every other one."""

    own: tuple[int, int]
    others: dict[str, tuple[int, int]]
    #: time.monotonic() when it was taken
    at: float


class SharedUsage:
    """The usage count of one root shared by every instance on it, and the
    root's eviction lease (see the module docstring)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        file_mode: int = 0o644,
        *,
        background: bool = True,
    ) -> None:
        self.root = Path(root)
        self._mode = file_mode
        self.instance = f"{_safe_host()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._name = self.instance + COUNT_SUFFIX
        self._lock = threading.Lock()
        self._io_lock = threading.Lock()  # one publisher/reader at a time
        self._dir_fd: int | None = None
        #: bytes this instance stored and removed since it started
        self._stored = 0
        self._removed = 0
        self._published: tuple[int, int] | None = None
        self._published_at = 0.0
        #: other instances' last good (stored, removed), and at this instance's base
        self._others: dict[str, tuple[int, int]] = {}
        self._others_base: dict[str, tuple[int, int]] = {}
        self._own_base = (0, 0)
        self._base = 0
        self.rescan_wanted = False
        #: the last scan raced stores or removals (its count may be high)
        self.scan_raced = False
        self._last_activity = 0.0  # monotonic time another instance's count last moved
        self._freeze_until = 0.0
        self._rescan_asked = 0.0
        self._warned: set[str] = set()
        self._lease_until = 0.0  # monotonic time our lease runs out (0: not held)
        self._lease_renewed = 0.0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self._dir_fd = self._open_dir()
        except OSError as exc:
            log.warning(
                "fstier: usage of %s is not shared with other instances (%s); each instance "
                "counts its own stores until its next capacity pass. Remove whatever is at "
                "%s to share it again", self.root, exc.strerror or exc, self.root / USAGE_DIR_NAME,
            )
            return
        if background:
            self._thread = threading.Thread(target=self._run, name="fstier-usage", daemon=True)
            self._thread.start()

    def _open_dir(self) -> int:
        path = self.root / USAGE_DIR_NAME
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o755)
        fd = os.open(path, _DIR_FLAGS)
        try:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                raise OSError(errno.ENOTDIR, "not a directory")
        except BaseException:
            os.close(fd)
            raise
        return fd

    @property
    def shared(self) -> bool:
        return self._dir_fd is not None

    # ------------------------------------------------------------- hot path
    def read(self) -> int:
        """The root's usage as this instance sees it (memory only)."""
        with self._lock:
            return self._sum_locked()

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
            if delta > 0:
                self._stored = min(_MAX_ABS, self._stored + delta)
            else:
                self._removed = min(_MAX_ABS, self._removed - delta)
            view = self._sum_locked()
        self._wake.set()  # publish now (the thread coalesces a burst)
        return view

    # ---------------------------------------------------------------- scans
    def begin_scan(self) -> ScanToken:
        """Call just before a full scan: refreshes the others' counts (on
        the calling thread, the capacity thread) and returns what they were."""
        self.refresh()
        with self._lock:
            return ScanToken((self._stored, self._removed), dict(self._others), time.monotonic())

    def end_scan(self, token: ScanToken, scanned: int, removed_by_scan: int) -> int:
        """A full scan that began at ``token`` left ``scanned`` bytes on disk
        (after removing ``removed_by_scan`` bytes, which it also added to
        this instance's removals). Stores made since the token count on top
        (twice if the walk saw them); removals count from now on (none
        during the walk: those it saw are in ``scanned`` too high). Both
        errors make the view high, never low; :attr:`scan_raced` says the
        scan raced any, and the capacity thread scans again soon. Returns
        the new view."""
        self.refresh()
        with self._lock:
            # Others' counts reach us late (publish + refresh + the mount's
            # cache): any activity seen near the walk may have raced it.
            self.scan_raced = (
                (self._stored, self._removed - removed_by_scan) != token.own
                or self._last_activity >= token.at - SETTLE_S
            )
            # Others' removals published during the next SETTLE_S may be of
            # files this walk already missed: they are not subtracted (the
            # view stays high, never low) until then.
            self._freeze_until = time.monotonic() + SETTLE_S
            self._base = max(0, scanned)
            self._own_base = (token.own[0], self._removed)
            self._others_base = {
                name: (token.others.get(name, (0, 0))[0], removed)
                for name, (_stored, removed) in self._others.items()
            }
            self.rescan_wanted = False
            return self._sum_locked()

    def _want_rescan(self, why: str) -> None:
        now = time.monotonic()
        if why not in self._warned:
            self._warned.add(why)
            log.warning("fstier: %s; ignoring it and rescanning %s", why, self.root)
        if now - self._rescan_asked >= _RESCAN_MIN_INTERVAL_S:
            self._rescan_asked = now
            self.rescan_wanted = True

    # ------------------------------------------------------ the background side
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception:  # a bookkeeping bug must not kill the tier
                log.exception("fstier: refreshing the shared usage count failed")
            self._wake.wait(REFRESH_S)
            self._wake.clear()
            self._stop.wait(MIN_ROUND_S)

    def refresh(self, *, force: bool = False) -> None:
        """Publish this instance's count if it changed (or for a heartbeat;
        ``force``: in any case, e.g. after its file was removed) and read the
        others'. Never raises for filesystem trouble."""
        dfd = self._dir_fd
        if dfd is None:
            return
        with self._io_lock:
            self._publish(dfd, force)
            self._read_others(dfd)

    def _publish(self, dfd: int, force: bool = False) -> None:
        with self._lock:
            value = (self._stored, self._removed)
        now = time.monotonic()
        if not force and value == self._published and now - self._published_at < HEARTBEAT_S:
            return
        if self._write_file(dfd, self._name, f"fstier-usage 2 {value[0]} {value[1]}\n"):
            self._published = value
            self._published_at = now

    def _write_file(self, dfd: int, name: str, text: str) -> bool:
        """Write ``text`` as a new file and rename it over ``name`` (both in
        the directory fd): never through a planted link, never in place."""
        tmp = f".{name}.tmp.{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, _CREATE_FLAGS, self._mode, dir_fd=dfd)
            try:
                data = text.encode()
                if os.write(fd, data) != len(data):
                    raise OSError(errno.EIO, "short write")
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
            os.close(fd)  # a deferred write error surfaces here: nothing is renamed then
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            return True
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            key = f"write:{name}:{exc.errno}"
            if key not in self._warned:
                self._warned.add(key)
                log.warning("fstier: cannot write %s: %s", self.root / USAGE_DIR_NAME / name, exc)
            return False

    def _read_file(self, dfd: int, name: str) -> tuple[str | None, float]:
        """The text of a regular file of at most 256 bytes (None for anything
        else: absent, a link, a FIFO, a directory, too big) and its mtime."""
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
        except OSError:
            return None, 0.0
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_FILE:
                return None, st.st_mtime
            data = os.read(fd, _MAX_FILE + 1)
            if len(data) > _MAX_FILE:
                return None, st.st_mtime
            return data.decode("ascii", "replace"), st.st_mtime
        except OSError:
            return None, 0.0
        finally:
            # GlusterFS fails the close (ESTALE, ENOENT) of a file its owner
            # replaced meanwhile; what was read is still what was read.
            with contextlib.suppress(OSError):
                os.close(fd)

    def _read_others(self, dfd: int) -> None:
        try:
            names = [e.name for e in os.scandir(dfd)]
        except OSError:
            return
        now = time.time()
        seen: dict[str, tuple[int, int]] = {}
        for name in names:
            if name == self._name or not _COUNT_NAME.match(name):
                continue
            text, mtime = self._read_file(dfd, name)  # never raises
            if text is None:
                if mtime:  # present but not a count file fstier could have written
                    self._want_rescan(f"{USAGE_DIR_NAME}/{name} is not a regular count file")
                continue
            value = _parse_count(text)
            last = self._others.get(name)
            if value is None or (last is not None and (value[0] < last[0] or value[1] < last[1])):
                self._want_rescan(f"{USAGE_DIR_NAME}/{name} holds no valid count")
                continue
            if now - mtime > STALE_S:
                # Its owner stopped rewriting it an hour ago: gone. Its last
                # value stays in this view (a delta of zero from now on).
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dfd)
            seen[name] = value
        with self._lock:
            now_m = time.monotonic()
            if any(self._others.get(name) != v for name, v in seen.items()):
                self._last_activity = now_m
            self._others.update(seen)
            if now_m < self._freeze_until:
                for name, (_stored, removed) in seen.items():
                    b_stored = self._others_base.get(name, (0, 0))[0]
                    self._others_base[name] = (b_stored, removed)

    # ---------------------------------------------------------------- lease
    def _lease_text(self, until_ns: int) -> str:
        return f"fstier-lease 1 {self.instance} {until_ns}\n"

    def _lease_holder(self, dfd: int) -> tuple[str | None, int]:
        text, _ = self._read_file(dfd, LEASE_NAME)
        if text is None:
            return None, 0
        parts = text.split()
        if len(parts) != 4 or parts[:2] != ["fstier-lease", "1"] or not parts[3].isdigit():
            return None, 0
        return parts[2], int(parts[3])

    def try_lease(self) -> bool:
        """Take (or renew) the root's eviction lease; False while another
        live instance holds it. Never blocks on a lock."""
        dfd = self._dir_fd
        if dfd is None:
            return True  # not shared: this instance is alone as far as it knows
        holder, until_ns = self._lease_holder(dfd)
        now_ns = time.time_ns()
        if holder is not None and holder != self.instance and until_ns > now_ns:
            return False
        until = now_ns + int(LEASE_S * 1e9)
        if not self._write_file(dfd, LEASE_NAME, self._lease_text(until)):
            return True  # cannot write the lease here: evict anyway (the old behaviour)
        holder, _ = self._lease_holder(dfd)
        if holder != self.instance:
            return False  # another instance renamed its lease over ours
        self._lease_until = time.monotonic() + LEASE_S
        self._lease_renewed = time.monotonic()
        return True

    def lease_lost(self) -> bool:
        """For a running pass: renew the lease when due; True when it was
        taken over (the pass must stop)."""
        if self._dir_fd is None or not self._lease_until:
            return False
        now = time.monotonic()
        if now - self._lease_renewed < RENEW_S:
            return False
        return not self.try_lease()

    def release_lease(self) -> None:
        dfd = self._dir_fd
        if dfd is None or not self._lease_until:
            return
        self._lease_until = 0.0
        holder, _ = self._lease_holder(dfd)
        if holder == self.instance:
            self._write_file(dfd, LEASE_NAME, self._lease_text(0))

    @contextlib.contextmanager
    def evicting(self) -> Iterator[bool]:
        """Try to become the one instance running a capacity pass on this
        root: yields True while this instance holds the lease, False when
        another live instance does (the caller skips its pass)."""
        if not self.try_lease():
            yield False
            return
        try:
            yield True
        finally:
            self.release_lease()

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the thread and publish the final count (others keep it)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10.0)
        dfd, self._dir_fd = self._dir_fd, None
        if dfd is None:
            return
        with self._io_lock:
            with contextlib.suppress(Exception):
                self._publish(dfd, force=True)
            with contextlib.suppress(OSError):
                os.close(dfd)


def _parse_count(text: str) -> tuple[int, int] | None:
    parts = text.split()
    if len(parts) != 4 or parts[:2] != ["fstier-usage", "2"]:
        return None
    try:
        stored, removed = int(parts[2]), int(parts[3])
    except ValueError:
        return None
    if not (0 <= stored <= _MAX_ABS and 0 <= removed <= _MAX_ABS):
        return None
    return stored, removed
