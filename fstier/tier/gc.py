"""One garbage-collection pass over a tier root: streaming usage scan, LRU eviction, temp sweep.

The library call behind ``fstier gc``, and what :class:`fstier.tier.capacity.Capacity` (FsTier's
capacity thread) runs.

- **Only fstier's files.** The candidates are exactly what
  :func:`fstier.io.tree.iter_root` yields: block files where fstier puts them,
  its temp files and NFS silly-renamed ``.nfs*`` files, and only inside
  namespace directories with a valid manifest. Nothing else under the root
  (other directories, the root's top level, symlinks) is counted or touched.
  The walk streams through directory fds and never follows a symlink.
- **One budget per root.** ``max_bytes`` is the whole root's: one disk, one
  budget, least recently used first across every namespace in it.
- **Recency is mtime.** fstier bumps a block file's mtime when it is loaded
  (batched by :mod:`fstier.tier.recency` through
  :meth:`~fstier.io.blockstore.BlockStore.touch_many`, no symlink followed)
  because atime is unreliable under ``relatime``/``noatime``;
  eviction removes the smallest mtimes first.
- **Bounded memory.** Selecting the oldest files worth ``excess`` bytes keeps a
  max-heap (by mtime) of at most ``max_candidates`` entries: a file newer than
  every candidate is dropped as soon as the older candidates already cover the
  excess. When the excess needs more files than the cap, a pass removes the
  oldest ``max_candidates`` and the next pass rescans, so memory stays
  O(max_candidates) for any tree size.
- **Unlink only.** A file is never truncated or rewritten, so a reader that
  already opened it (this or another process, or another host) keeps reading
  valid bytes; a reader that opens it afterwards sees a miss. Just before
  unlinking, the file is stat-ed again through its directory fd (resolved
  without symlinks, :func:`fstier.io.fsops.unlink_if_same`): if its mtime or inode
  moved (someone loaded or replaced it since the scan) it is kept.
- **Foreign namespaces** (another fstier format version, e.g. v1 after the
  upgrade to v2) are never part of a pass: :func:`remove_foreign_namespaces`
  removes them whole, only when asked (``fstier gc --remove-foreign``),
  holding each checked directory by its fd (:mod:`fstier.io.heldtree`).
"""

from __future__ import annotations

import errno
import heapq
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fstier.io import (
    FileKind,
    TreeFile,
    check_namespace,
    empty_held_dir,
    held_tree_size,
    iter_root,
    open_held_dir,
    rmdir_if_same,
    unlink_if_same,
)

__all__ = [
    "DEFAULT_MAX_CANDIDATES",
    "UNLINK_THREADS",
    "GcReport",
    "UsageScan",
    "ForeignNamespace",
    "collect_garbage",
    "remove_foreign_namespaces",
    "scan_usage",
]

#: Upper bound on eviction candidates held in memory by one pass (~100 B each).
DEFAULT_MAX_CANDIDATES = 200_000
#: A walk polls ``should_stop`` at least this often (checked every 16 files).
STOP_POLL_S = 0.5



@dataclass(frozen=True, slots=True)
class ForeignNamespace:
    """A namespace directory of another fstier format version."""

    path: str
    version: int
    files: int
    bytes: int
    removed: bool


def remove_foreign_namespaces(
    root: str | os.PathLike[str],
    *,
    dry_run: bool = False,
    on_error: Callable[[OSError], None] | None = None,
) -> list[ForeignNamespace]:
    """Remove every namespace directory under ``root`` whose manifest is a
    valid fstier manifest of ANOTHER format version (see
    :func:`fstier.io.tree.check_namespace`). Only those: a directory with a
    missing, forged or unreadable manifest is not fstier's to remove.

    Each directory is opened once (:mod:`fstier.io.heldtree`), its manifest
    read through that fd, and what is removed is what that fd holds: a
    directory renamed into the checked name afterwards is never touched
    (tests/test_held_removal.py). Nothing is followed through a symlink."""
    out: list[ForeignNamespace] = []
    try:
        # The root itself may be a link the operator chose (/mnt/kv -> /data/kv).
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        if on_error is not None and not isinstance(exc, FileNotFoundError):
            exc.filename = os.fspath(root)
            on_error(exc)
        return out
    try:
        try:
            with os.scandir(root_fd) as it:
                names = [e.name for e in it if e.is_dir(follow_symlinks=False)]
        except OSError as exc:
            if on_error is not None:
                exc.filename = os.fspath(root)
                on_error(exc)
            return out
        for name in sorted(names):
            found = _remove_if_foreign(root_fd, Path(root) / name, dry_run, on_error)
            if found is not None:
                out.append(found)
    finally:
        os.close(root_fd)
    return out


def _remove_if_foreign(
    root_fd: int, path: Path, dry_run: bool, on_error: Callable[[OSError], None] | None
) -> ForeignNamespace | None:
    """Check the directory ``path`` (an entry of ``root_fd``) through its
    own fd and, if it is a foreign namespace, remove what that fd holds."""
    try:
        fd = open_held_dir(root_fd, path.name)
    except OSError as exc:
        # ENOENT: gone meanwhile; ELOOP/ENOTDIR: swapped for a link or file.
        if on_error is not None and not isinstance(exc, FileNotFoundError):
            exc.filename = str(path)
            on_error(exc)
        return None
    try:
        ns = check_namespace(path, dir_fd=fd)
        if ns.foreign_version is None:
            return None
        files, size = held_tree_size(fd, str(path), on_error)
        removed = False
        if not dry_run:
            removed = empty_held_dir(fd, str(path), on_error) == 0 and _rmdir_held(root_fd, path, fd, on_error)
        return ForeignNamespace(str(path), ns.foreign_version, files, size, removed)
    finally:
        os.close(fd)


def _rmdir_held(root_fd: int, path: Path, fd: int, on_error: Callable[[OSError], None] | None) -> bool:
    try:
        result = rmdir_if_same(root_fd, path.name, fd)
    except OSError as exc:
        result = "error"
        if on_error is not None:
            exc.filename = str(path)
            on_error(exc)
    if result == "replaced" and on_error is not None:
        on_error(OSError(errno.ESTALE, "replaced while it was removed; the new directory is left alone", str(path)))
    return result in ("removed", "gone")


@dataclass(frozen=True, slots=True)
class UsageScan:
    """What one streaming walk of a root found."""

    block_files: int
    block_bytes: int
    temp_files: int
    temp_bytes: int
    other_files: int
    seconds: float


@dataclass(frozen=True, slots=True)
class GcReport:
    """The result of :func:`collect_garbage`. With ``dry_run`` the ``removed_*``
    fields count what would have been removed."""

    scanned_files: int
    scanned_bytes: int
    removed_files: int
    removed_bytes: int
    kept_recently_used: int
    temp_removed: int
    temp_removed_bytes: int
    final_bytes: int
    target_bytes: int | None
    passes: int
    errors: int
    seconds: float
    dry_run: bool
    #: False when ``should_stop`` ended the walk early (sizes are partial)
    complete: bool = True


def _walk(root: str, on_error: Callable[[OSError], None] | None = None) -> Iterator[TreeFile]:
    """The candidates under ``root`` (block, temp and ``.nfs`` files of valid
    namespaces), streamed."""
    return iter_root(Path(root), on_error)


def scan_usage(root: str | os.PathLike[str]) -> UsageScan:
    """Walk ``root`` once (streaming) and total block and temp file sizes."""
    t0 = time.perf_counter()
    blocks = block_bytes = temps = temp_bytes = other = 0
    for e in _walk(os.fspath(root)):
        if e.kind == FileKind.BLOCK:
            blocks += 1
            block_bytes += e.size
        elif e.kind in (FileKind.TEMP, FileKind.NFS):
            temps += 1
            temp_bytes += e.size
        else:
            other += 1
    return UsageScan(blocks, block_bytes, temps, temp_bytes, other, time.perf_counter() - t0)


def _unlink_if_unchanged(
    path: str, mtime_ns: int, ino: int, on_error: Callable[[OSError], None] | None = None
) -> str:
    """Unlink ``path`` unless its mtime or inode moved since the scan, never
    through a symlink (:func:`fstier.io.fsops.unlink_if_same`). Returns
    ``removed``, ``kept`` (recently used or replaced), ``gone`` or ``error``
    (the error also goes to ``on_error``)."""
    return unlink_if_same(path, ino=ino, mtime_ns=mtime_ns, on_error=on_error)


#: Threads unlinking eviction victims at once. Unlinking a file whose blocks
#: are allocated (O_DIRECT or flushed writes) costs ~0.5-1 ms on ext4 here,
#: one at a time, ~50 us each with 8 in parallel: serial unlinks let five
#: writers outrun one evicting instance (benchmarks/bench_multi_instance.py).
UNLINK_THREADS = 8


def _unlink_all(
    victims: list[tuple[int, str, int, int]],
    dry_run: bool,
    threads: int,
    on_error: Callable[[OSError], None] | None,
) -> Iterator[str]:
    """``_unlink_if_unchanged`` of every victim, results in victim order."""
    if dry_run:
        yield from ("removed" for _ in victims)
        return
    if threads <= 1 or len(victims) <= 1:
        for neg_mtime, path, _size, ino in victims:
            yield _unlink_if_unchanged(path, -neg_mtime, ino, on_error)
        return
    with ThreadPoolExecutor(min(threads, len(victims)), thread_name_prefix="fstier-unlink") as ex:
        yield from ex.map(lambda v: _unlink_if_unchanged(v[1], -v[0], v[3], on_error), victims)


def collect_garbage(
    root: str | os.PathLike[str],
    max_bytes: int | None,
    low_watermark: float = 0.80,
    temp_max_age_s: float = 3600.0,
    dry_run: bool = False,
    *,
    high_watermark: float = 1.0,
    max_candidates: int = DEFAULT_MAX_CANDIDATES,
    on_removed: Callable[[str, int], None] | None = None,
    now_ns: int | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_error: Callable[[OSError], None] | None = None,
    on_file: Callable[[], None] | None = None,
    unlink_threads: int = UNLINK_THREADS,
    pending_bytes: Callable[[int], int] | None = None,
) -> GcReport:
    """Sweep stale temp/``.nfs*`` files and, when block files under ``root``
    total more than ``high_watermark x max_bytes``, unlink the least recently
    used ones until they total at most ``low_watermark x max_bytes``.

    ``max_bytes=None`` only sweeps temp files. ``on_removed(path, size)`` is
    called after each block file is unlinked (FsTier turns it into a
    ``BlockRemoved`` event). ``should_stop()`` is polled every 1024 files or
    every ``STOP_POLL_S`` of the walk, whichever comes first, and ends the
    pass early (FsTier's close; a capacity pass renews its eviction lease
    there, so a walk slowed to tens of ms per file, as on ceph-fuse over
    another host's fresh files, never lets it lapse:
    test_slow_walk_polls_should_stop_in_time). Never raises for per-file errors; they are counted
    in ``errors`` and, with ``on_error``, handed over (``exc.filename`` names the
    path) so that a caller can say which. ``on_file()`` is called for every
    file walked (progress). Victims are unlinked by ``unlink_threads``
    threads at once (``on_removed`` is still called from the calling thread,
    oldest first). ``pending_bytes(walked)`` is called after each walk with
    the block bytes it found and returns the bytes admitted but not on disk
    yet (stores in flight, none the walk saw); they count toward both
    watermarks, so a pass makes room for them before they land (the
    report's ``final_bytes`` is still what is on disk).
    """
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
    # inf made int(temp_max_age_s * 1e9) raise OverflowError in every pass,
    # silently disabling eviction (test_collect_garbage_refuses_non_finite_temp_age).
    if not (isinstance(temp_max_age_s, int | float) and 0 < temp_max_age_s <= 1e10):
        raise ValueError(
            f"temp_max_age_s must be a finite number of seconds > 0, got {temp_max_age_s!r}"
        )
    if not 0.0 <= low_watermark <= 1.0 or not 0.0 < high_watermark <= 1.0:
        raise ValueError(
            f"watermarks must be fractions in (0, 1], got low={low_watermark} high={high_watermark}"
        )
    if low_watermark > high_watermark:
        raise ValueError(f"low_watermark ({low_watermark}) must be <= high_watermark ({high_watermark})")
    if max_candidates < 1:
        raise ValueError(f"max_candidates must be >= 1, got {max_candidates}")
    t0 = time.perf_counter()
    root_s = os.fspath(root)
    now = time.time_ns() if now_ns is None else now_ns
    temp_cutoff = now - int(temp_max_age_s * 1e9)
    target = None if max_bytes is None else int(max_bytes * low_watermark)
    trigger = None if max_bytes is None else int(max_bytes * high_watermark)

    scanned_files = scanned_bytes = 0
    removed_files = removed_bytes = kept = 0
    temp_removed = temp_removed_bytes = 0
    errors = 0
    passes = 0
    usage = 0
    excess = 0
    first = True
    stopped = False

    def count_error(exc: OSError) -> None:
        nonlocal errors
        errors += 1
        if on_error is not None:
            on_error(exc)

    while True:
        passes += 1
        usage = 0
        files = 0
        # max-heap by mtime (negated) of the oldest candidates seen so far.
        heap: list[tuple[int, str, int, int]] = []
        heap_bytes = 0
        # Before the walk we do not know the excess; collect up to the cap and
        # trim once the total is known. During the walk, trim only when the
        # cap is exceeded (drop the newest candidate).
        stopped = False
        polled = time.monotonic()
        for seen, e in enumerate(_walk(root_s, count_error)):
            if should_stop is not None and seen % 16 == 15:
                now_s = time.monotonic()
                if seen % 1024 == 1023 or now_s - polled >= STOP_POLL_S:
                    polled = now_s
                    if should_stop():
                        stopped = True
                        break
            if on_file is not None:
                on_file()
            if e.kind == FileKind.BLOCK:
                usage += e.size
                files += 1
                if max_bytes is not None:
                    heapq.heappush(heap, (-e.mtime_ns, e.path, e.size, e.ino))
                    heap_bytes += e.size
                    if len(heap) > max_candidates:
                        _, _, size, _ = heapq.heappop(heap)
                        heap_bytes -= size
            elif first and e.kind in (FileKind.TEMP, FileKind.NFS) and e.mtime_ns < temp_cutoff:
                # Old temp files are leftovers of killed writers (a live writer
                # renames within seconds); .nfs* ones are files deleted while
                # open on NFS whose holder is long gone.
                result = "removed" if dry_run else _unlink_if_unchanged(e.path, e.mtime_ns, e.ino, on_error)
                if result == "removed":
                    temp_removed += 1
                    temp_removed_bytes += e.size
                elif result == "error":
                    errors += 1
        if first:
            scanned_bytes = usage
            scanned_files = files
            first = False
        if stopped:
            break
        pending = 0 if pending_bytes is None or target is None else max(0, pending_bytes(usage))
        if trigger is None or target is None or usage + pending <= (trigger if passes == 1 else target):
            break
        excess = usage + pending - target
        # Keep only the oldest candidates that cover the excess: pop newest
        # while the rest still cover it.
        while heap and heap_bytes - heap[0][2] >= excess:
            _, _, size, _ = heapq.heappop(heap)
            heap_bytes -= size
        victims = sorted(heap, reverse=True)  # oldest first (largest negated mtime)
        progress = 0
        for (_, path, size, _ino), result in zip(
            victims, _unlink_all(victims, dry_run, unlink_threads, on_error), strict=True
        ):
            if result == "removed":
                removed_files += 1
                removed_bytes += size
                progress += size
                usage -= size
                if on_removed is not None and not dry_run:
                    on_removed(path, size)
            elif result == "kept":
                kept += 1
            elif result == "error":
                errors += 1
        if dry_run or progress == 0 or usage == 0 or usage + pending <= target:
            break
        # The cap limited this pass, or files were kept/raced: rescan.
    return GcReport(
        scanned_files=scanned_files,
        scanned_bytes=scanned_bytes,
        removed_files=removed_files,
        removed_bytes=removed_bytes,
        kept_recently_used=kept,
        temp_removed=temp_removed,
        temp_removed_bytes=temp_removed_bytes,
        final_bytes=usage,
        target_bytes=target,
        passes=passes,
        errors=errors,
        seconds=time.perf_counter() - t0,
        dry_run=dry_run,
        complete=not stopped,
    )
