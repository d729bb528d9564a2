"""What a root shows about the tiers running on it, read without writing
anything: the report ``fstier status`` prints (:func:`read_status`).

A running FsTier publishes, in ``<root>/.fstier-usage.d``
(:mod:`fstier.tier.usage`, :mod:`fstier.tier.countnames`,
:mod:`fstier.tier.lease`):

- one count per instance, carried by an empty file's name
  (``<host>-<pid>-<token>.<gen>.<stored>.<removed>.<inflight>.cnt``): its
  newest name's mtime is when it last published (a new generation at least
  every ``HEARTBEAT_S``, so an older one is silent: its tier closed, its
  last count kept for the others' sums, or hangs; one older than
  ``STALE_S`` is gone: every reader removes its names);
- settled scans (``<instance>.<bytes>.<digest>.scn``): the block bytes a
  walk found while no count moved, and a digest of every instance's
  (stored, removed) it saw then. While every count is still what it saw
  (the digest matches the counts listed now), those bytes are what the
  instances' shared count holds: "usage as the count sees it";
- the eviction lease ``evict.lease`` (``fstier-lease 2 <instance>``,
  renewed every ``RENEW_S`` while a capacity pass runs; unchanged for
  ``LEASE_S`` it may be taken over).

:func:`read_status` lists that directory, then walks the root
(:func:`fstier.tier.scan.inspect_root`: usage as the disk holds it, and each
namespace's bytes and last use, its newest block mtime: loads and stores
write recency into mtimes), then lists the directory again: counts that
moved meanwhile make the comparison of the two figures moot (``raced``).
Everything runs on a daemon thread the caller waits for at most
``deadline_s``: a hung mount (a stat that never returns) makes a report
that says so, never a caller that hangs; a walk still running at the
deadline is told to stop at its next file.

Nothing here writes, opens anything but the usage directory and the lease
(``O_NOFOLLOW|O_NONBLOCK``, at most 256 bytes) or follows a symlink.
Costs: two listings of the usage directory, an ``lstat`` per count name,
and one walk of the root (one ``stat`` per entry).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fstier.tier.countnames import (
    counts_digest,
    is_leftover,
    is_legacy_name,
    parse_count_name,
    parse_scan_name,
    read_legacy_count,
)
from fstier.tier.lease import LEASE_NAME, LEASE_S
from fstier.tier.liveness import HEARTBEAT_S, STALE_S
from fstier.tier.usagedir import USAGE_DIR_NAME

__all__ = [
    "InstanceCount",
    "LeaseStatus",
    "NamespaceUse",
    "RootStatus",
    "SettledScan",
    "read_status",
]

#: A count whose newest name is older than this is silent (2 heartbeats
#: missed): its tier closed (its last count stays) or hangs.
SILENT_S = 2 * HEARTBEAT_S
_INSTANCE = re.compile(r"^(.+)-(\d{1,10})-([0-9a-f]{8})$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class _Stopped(Exception):
    """The caller's deadline passed: the walk stops at its next file."""


@dataclass(frozen=True, slots=True)
class InstanceCount:
    """One instance's newest published count."""

    instance: str
    host: str | None
    pid: int | None
    generation: int | None  # None for fstier < 0.6's count files
    stored_bytes: int
    removed_bytes: int
    inflight_bytes: int
    age_s: float  # since its newest name was published (wall clock)
    state: str  # "live", "silent" (no new name for SILENT_S: closed or hung) or "gone" (> STALE_S)

    @property
    def net_bytes(self) -> int:
        return self.stored_bytes - self.removed_bytes


@dataclass(frozen=True, slots=True)
class SettledScan:
    instance: str
    bytes: int
    current: bool  # every count is still what the scan saw


@dataclass(frozen=True, slots=True)
class LeaseStatus:
    holder: str | None  # the instance named in the lease, None when unreadable
    age_s: float  # since it was taken or last renewed
    expired: bool  # unchanged for LEASE_S or more: another instance may take it over


@dataclass(frozen=True, slots=True)
class NamespaceUse:
    namespace: str
    files: int
    bytes: int
    last_use: float | None  # the newest block file's mtime (unix time)


@dataclass
class RootStatus:
    """What :func:`read_status` found; ``problems`` says what is wrong, one
    line each (empty: healthy)."""

    root: str
    read_at: float
    deadline_s: float
    max_bytes: int | None = None
    #: None: no usage directory (no tier has run here), or it did not answer
    published: bool | None = None
    instances: list[InstanceCount] = field(default_factory=list)
    scans: list[SettledScan] = field(default_factory=list)
    lease: LeaseStatus | None = None
    leftovers: int = 0
    bad_names: list[str] = field(default_factory=list)
    #: usage as the shared count holds it (a current settled scan), else None
    counts_bytes: int | None = None
    #: why counts_bytes is None, or whose scan it is
    counts_note: str = ""
    scan_complete: bool = False
    scan_bytes: int | None = None
    scan_files: int | None = None
    scan_seconds: float | None = None
    #: counts moved while the root was walked (the two figures are not comparable)
    raced: bool = False
    namespaces: list[NamespaceUse] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def agree(self) -> bool | None:
        """Whether the shared count and the disk agree (None: not comparable)."""
        if self.counts_bytes is None or self.scan_bytes is None or not self.scan_complete or self.raced:
            return None
        return self.counts_bytes == self.scan_bytes

    @property
    def hosts(self) -> list[str]:
        return sorted({i.host for i in self.instances if i.host is not None})

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["agree"] = self.agree
        doc["hosts"] = self.hosts
        for inst, raw in zip(self.instances, doc["instances"], strict=True):
            raw["net_bytes"] = inst.net_bytes
            raw["age_s"] = round(inst.age_s, 3)
        if self.lease is not None:
            doc["lease"]["age_s"] = round(self.lease.age_s, 3)
        if self.scan_seconds is not None:
            doc["scan_seconds"] = round(self.scan_seconds, 3)
        return doc


def split_instance(instance: str) -> tuple[str | None, int | None]:
    """(host, pid) of an instance name ``<host>-<pid>-<8 hex>``, else (None, None)."""
    m = _INSTANCE.match(instance)
    return (m.group(1), int(m.group(2))) if m else (None, None)


def _state(age_s: float) -> str:
    return "gone" if age_s > STALE_S else "silent" if age_s > SILENT_S else "live"


@dataclass
class _Listing:
    counts: dict[str, tuple[int | None, int, int, int, str]] = field(default_factory=dict)
    scans: list[tuple[str, int, str]] = field(default_factory=list)
    leftovers: int = 0
    bad: list[str] = field(default_factory=list)
    lease: bool = False


def _list_counts(dfd: int) -> _Listing:
    """Each instance's newest count (by generation) and its name, the shared
    scans, leftovers and names holding no valid count."""
    out = _Listing()
    for name in sorted(os.listdir(dfd)):
        if name == LEASE_NAME:
            out.lease = True
        elif is_leftover(name):
            out.leftovers += 1
        elif (scan := parse_scan_name(name)) is not None:
            out.scans.append(scan)
        elif (parsed := parse_count_name(name)) is not None:
            inst, gen, stored, removed, inflight = parsed
            old = out.counts.get(inst)
            if old is None or (old[0] or 0) <= gen:
                out.counts[inst] = (gen, stored, removed, inflight, name)
        elif is_legacy_name(name):
            value, _, wrong = read_legacy_count(dfd, name)
            if value is None:
                out.bad.append(f"{name}: {wrong or 'unreadable'}")
            else:
                out.counts[name] = (None, value[0], value[1], 0, name)
    return out


def _age(dfd: int, name: str, now: float) -> float | None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return None  # replaced by a newer generation meanwhile
    return max(0.0, now - st.st_mtime)


def _read_lease(dfd: int, now: float) -> LeaseStatus | None:
    try:
        st = os.stat(LEASE_NAME, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return None
    holder = None
    if stat.S_ISREG(st.st_mode) and st.st_size <= 256:
        with contextlib.suppress(OSError):
            fd = os.open(LEASE_NAME, _READ_FLAGS, dir_fd=dfd)
            try:
                parts = os.read(fd, 256).decode("ascii", "replace").split()
            finally:
                os.close(fd)
            if len(parts) == 3 and parts[0] == "fstier-lease":
                holder = parts[2]
    age = max(0.0, now - st.st_mtime)
    return LeaseStatus(holder, age, age >= LEASE_S)


def _read_usage_dir(status: RootStatus, root: Path) -> _Listing | None:
    try:
        dfd = os.open(root / USAGE_DIR_NAME, _DIR_FLAGS)
    except FileNotFoundError:
        status.published = False
        status.counts_note = f"no {USAGE_DIR_NAME}: no tier with max_bytes has run on this root"
        return None
    except OSError as exc:
        status.published = False
        status.problems.append(f"{USAGE_DIR_NAME} cannot be read ({exc.strerror or exc}); tiers do not share usage")
        status.counts_note = "the usage directory cannot be read"
        return None
    try:
        listing = _list_counts(dfd)
        now = time.time()
        for inst, (gen, stored, removed, inflight, name) in listing.counts.items():
            age = _age(dfd, name, now)
            if age is None:
                continue
            host, pid = split_instance(inst)
            status.instances.append(
                InstanceCount(inst, host, pid, gen, stored, removed, inflight, age, _state(age))
            )
        status.lease = _read_lease(dfd, now) if listing.lease else None
    finally:
        os.close(dfd)
    status.published = True
    status.leftovers = listing.leftovers
    status.bad_names = listing.bad
    digest = counts_digest({n: (c[1], c[2]) for n, c in listing.counts.items()})
    status.scans = [SettledScan(inst, nbytes, seen == digest) for inst, nbytes, seen in listing.scans]
    current = [s for s in status.scans if s.current]
    if current:
        status.counts_bytes = current[0].bytes
        status.counts_note = f"settled scan by {current[0].instance}, no count moved since"
    elif listing.scans:
        status.counts_note = "counts moved since the last settled scan"
    elif listing.counts:
        status.counts_note = "no settled scan published (stores ran since the last quiet scan)"
    else:
        status.counts_note = "no instance has published a count"
    return listing


def _gather(root: Path, status: RootStatus, scan: bool, stop: threading.Event, done: dict[str, bool]) -> None:
    from fstier.tier.scan import inspect_root

    first = _read_usage_dir(status, root)
    done["counts"] = True
    if not scan:
        return

    def check_stop() -> None:
        if stop.is_set():
            raise _Stopped

    started = time.monotonic()
    report = inspect_root(root, on_file=check_stop)
    status.scan_seconds = time.monotonic() - started
    status.scan_bytes = report.total_bytes
    status.scan_files = report.total_files
    status.scan_complete = not report.partial
    if report.partial:
        status.problems.append(
            f"the walk could not read {report.unreadable.count:,} path(s) under ROOT: its totals are partial"
        )
    status.namespaces = [NamespaceUse(ns.namespace, ns.files, ns.bytes, ns.newest) for ns in report.namespaces]
    if first is not None:
        again = _Listing()
        with contextlib.suppress(OSError):
            dfd = os.open(root / USAGE_DIR_NAME, _DIR_FLAGS)
            try:
                again = _list_counts(dfd)
            finally:
                os.close(dfd)
        values = {n: c[1:4] for n, c in first.counts.items()}
        status.raced = values != {n: c[1:4] for n, c in again.counts.items()}
    done["scan"] = True


def read_status(
    root: str | os.PathLike[str],
    *,
    deadline_s: float = 10.0,
    scan: bool = True,
    max_bytes: int | None = None,
) -> RootStatus:
    """What ``root`` shows of the tiers on it (see the module docstring),
    within ``deadline_s`` seconds: whatever did not answer by then is
    reported as such in ``problems``. ``scan=False`` reads only the usage
    directory (no walk). ``max_bytes``: the limit the tiers run with, to
    judge usage against (the root does not record it)."""
    root = Path(root)
    status = RootStatus(str(root), time.time(), deadline_s, max_bytes=max_bytes)
    stop = threading.Event()
    done: dict[str, bool] = {}
    failed: list[BaseException] = []

    def run() -> None:
        try:
            _gather(root, status, scan, stop, done)
        except _Stopped:
            pass
        except Exception as exc:  # reported below, never raised on a thread
            failed.append(exc)

    worker = threading.Thread(target=run, name="fstier-status", daemon=True)
    worker.start()
    worker.join(deadline_s)
    stop.set()
    if worker.is_alive() or failed:
        why = f"failed: {failed[0]}" if failed else f"did not answer within {deadline_s:g} s (a hung mount?)"
        # The thread may still be writing into ``status``: report a copy.
        status = RootStatus(
            status.root, status.read_at, deadline_s, max_bytes=max_bytes,
            published=status.published if "counts" in done else None,
            instances=list(status.instances) if "counts" in done else [],
            scans=list(status.scans) if "counts" in done else [],
            lease=status.lease if "counts" in done else None,
            counts_bytes=status.counts_bytes if "counts" in done else None,
            counts_note=status.counts_note if "counts" in done else f"the usage directory {why}",
        )
        status.problems.append(
            f"the walk of ROOT {why}; usage on disk unknown" if "counts" in done
            else f"{USAGE_DIR_NAME} {why}"
        )
    _judge(status)
    return status


def _judge(status: RootStatus) -> None:
    """Add the problems the figures show: disagreement, over max_bytes, an
    expired lease, bad names. A silent instance is not one: a tier that
    closed cleanly leaves its last count (the others keep summing it)."""
    if status.agree is False and status.counts_bytes is not None and status.scan_bytes is not None:
        status.problems.append(
            f"the shared count holds {status.counts_bytes:,} bytes but the disk holds {status.scan_bytes:,}: "
            f"the next capacity pass rescans; if this persists, run `fstier gc` on ROOT"
        )
    usage = status.scan_bytes if status.scan_complete else status.counts_bytes
    if status.max_bytes is not None and usage is not None and usage > status.max_bytes:
        status.problems.append(f"usage {usage:,} bytes is over max_bytes {status.max_bytes:,}")
    if status.lease is not None and status.lease.expired:
        status.problems.append(
            f"the eviction lease (held by {status.lease.holder or '?'}) was not renewed for "
            f"{status.lease.age_s:.0f} s: its holder died or hangs; another instance will take it over"
        )
    if status.bad_names:
        status.problems.append(f"{len(status.bad_names)} name(s) in {USAGE_DIR_NAME} hold no valid count")
