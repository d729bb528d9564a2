"""What a root's filesystem can do, probed rather than assumed.

Capabilities are an attribute of the root they were found under, never of
the process: :class:`RootCapabilities` is probed for one root
(:meth:`RootCapabilities.probe`) and held by that root's block store (FsTier
passes it in ``IOOptions.capabilities``), so an NFS or FUSE root that refuses
``O_TMPFILE`` or O_DIRECT changes nothing for a local NVMe root in the same
process.

O_DIRECT (:func:`probe_o_direct`)
    Probed per call (one probe file written and read; FsTier probes once per
    tier): statx ``DIOALIGN`` where the kernel reports it,
    then an aligned write and read of a probe temp file (some filesystems accept
    the open and refuse the write). ``auto`` falls back to buffered I/O with one
    warning; ``on`` raises :class:`~fstier.errors.DirectIOUnsupportedError`.
    A single operation whose buffer does not start aligned uses buffered I/O.
    Only a refusal (``EINVAL``/``EOPNOTSUPP``, statx, wrong bytes) is a
    finding; a probe that could not run (``ENOSPC`` on a full CephFS pool,
    ``EDQUOT``, ``EACCES``, ``EIO``) says nothing about O_DIRECT: the root
    runs buffered and :class:`RootCapabilities` probes again every
    ``REPROBE_S`` of the tier's :class:`~fstier.clock.Clock` from the store
    path until a probe runs: at most one probe per ``REPROBE_S``, run by one
    store thread at a time (a full pool at start left a root buffered for
    life: test_enospc_probe_is_retried_not_final,
    test_a_full_filesystem_at_start_decides_nothing_for_good); with ``on``
    such a root uses O_DIRECT as configured.

O_TMPFILE (:attr:`RootCapabilities.tmpfile`)
    Stores publish an anonymous ``O_TMPFILE`` inode with ``linkat``; the
    first refusal under a root (NFS, FUSE: ``EOPNOTSUPP``; a kernel without
    it: ``EISDIR``) switches that root to named temps + ``renameat``, with one
    log line. A store without capabilities (a bare ``store_block`` call)
    tries ``O_TMPFILE`` every time and falls back for that store only.

Late write errors (:attr:`RootCapabilities.late_write_errors`)
    ``statfs(2)`` of the root: on a network or FUSE filesystem
    (:data:`LATE_WRITE_ERROR_FS`) a buffered ``write`` can return before the
    filesystem has taken the bytes, and its error (ENOSPC on a full CephFS
    pool) comes at ``fsync``, or never: 1-71 acknowledged stores per run
    were dropped. A buffered store under such a root is fsynced before it
    is published and acknowledged, whatever ``fsync`` says
    (:meth:`~fstier.io.iotypes.IOOptions.from_tier`); O_DIRECT stores get
    their errors from ``write``. One ``statfs`` per probe.

Every probe goes through the syscall seam (:data:`fstier.io.fsops.FS`),
except ``statfs`` (:func:`filesystem_type`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fstier.clock import SYSTEM_CLOCK, Clock
from fstier.errors import DirectIOUnsupportedError
from fstier.io import fsops
from fstier.io.blockfile import ALIGNMENT
from fstier.io.fsops import (
    O_CLOEXEC,
    O_DIRECT,
    O_NOFOLLOW,
    O_TMPFILE,
    aligned_buffer,
    errno_name,
    temp_path_for,
)

__all__ = [
    "COHERENT_CACHE_FS", "LATE_WRITE_ERROR_FS", "REPROBE_S", "DirectIOSupport", "RootCapabilities",
    "filesystem_type", "probe_o_direct",
]

log = logging.getLogger("fstier.io")

_PROBE_NAME = ".fstier-odirect-probe"
#: A root whose O_DIRECT probe could not run (ENOSPC, EACCES, ...) probes again this often.
REPROBE_S = 60.0
#: statfs ``f_type`` of filesystems that can report a buffered write's error
#: after ``write`` returned (at ``fsync`` or ``close``), or drop the write
LATE_WRITE_ERROR_FS = {
    0x65735546: "fuse", 0x00C36400: "ceph", 0x6969: "nfs", 0xFF534D42: "cifs", 0xFE534D42: "smb2",
    0x517B: "smb", 0x0BD00BD0: "lustre", 0x01021997: "9p", 0x5346414F: "afs", 0x47504653: "gpfs",
}
#: statfs ``f_type`` of local filesystems, whose dentry and inode caches no
#: other host changes: a presence probe may trust them
#: (:attr:`RootCapabilities.coherent_cache`). Anything else (FUSE, NFS,
#: CephFS, an unknown type) asks the filesystem.
COHERENT_CACHE_FS = {
    0xEF53: "ext4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0x01021994: "tmpfs", 0xF2F52010: "f2fs",
    0x858458F6: "ramfs", 0x2FC12FC1: "zfs", 0xCA451A4E: "bcachefs",
}


def filesystem_type(path: str | Path) -> int | None:
    """``statfs(2)`` ``f_type`` of the filesystem holding ``path``; None
    when it cannot be read."""
    try:
        statfs = ctypes.CDLL(None, use_errno=True).statfs
    except (OSError, AttributeError):
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if statfs(os.fsencode(path), buf) != 0:
        return None
    return int(struct.unpack_from("=l", buf.raw, 0)[0]) & 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class DirectIOSupport:
    """Whether O_DIRECT is used under a directory, with which memory/offset
    alignment, and why (the probe's finding, for logs)."""

    enabled: bool
    alignment: int
    reason: str
    #: False when the probe could not run (ENOSPC, EACCES, ...): no finding, probe again later
    definitive: bool = True


def _statx_dioalign(fd: int) -> tuple[int, int] | None:
    """(mem_align, offset_align) from statx STATX_DIOALIGN, or None where the
    kernel or filesystem does not report it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.statx
    except (OSError, AttributeError):
        return None
    buf = ctypes.create_string_buffer(256)
    at_empty_path, statx_dioalign = 0x1000, 0x2000
    if fn(fd, b"", at_empty_path, statx_dioalign, buf) != 0:
        return None
    (mask,) = struct.unpack_from("<I", buf.raw, 0)
    if not mask & statx_dioalign:
        return None
    mem, off = struct.unpack_from("<II", buf.raw, 152)
    return int(mem), int(off)


def _unlink_own_temp(tmp: Path, exc: OSError) -> None:
    """Remove a temp file that a failed ``open`` may still have created.

    Some filesystems (ramfs) create the file for ``O_CREAT|O_EXCL|O_DIRECT``
    and then fail the open with EINVAL. The name is unique to this thread, so
    unless the failure was EEXIST (someone else's file) it can only be ours.
    """
    if exc.errno == errno.EEXIST:
        return
    with contextlib.suppress(OSError):
        fsops.FS.unlink(tmp)


def _probe(directory: Path) -> tuple[DirectIOSupport, bool]:
    """Probe ``directory``; returns the finding and whether it is definitive
    (cacheable). A directory we cannot write to says nothing about O_DIRECT."""
    if not O_DIRECT:
        return DirectIOSupport(False, ALIGNMENT, "this platform has no O_DIRECT"), True
    tmp = temp_path_for(directory / _PROBE_NAME)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC
    try:
        fd = fsops.FS.open(tmp, flags | O_DIRECT, 0o600)
    except OSError as exc:
        _unlink_own_temp(tmp, exc)
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return DirectIOSupport(False, ALIGNMENT, f"open(O_DIRECT) refused: {errno_name(exc)}"), True
        return DirectIOSupport(False, ALIGNMENT, f"probe file not creatable: {errno_name(exc)}"), False
    try:
        alignment = ALIGNMENT
        dio = _statx_dioalign(fd)
        if dio is not None:
            mem, off = dio
            if mem == 0 or off == 0:
                return DirectIOSupport(
                    False, ALIGNMENT, "statx reports no direct I/O support"
                ), True
            if max(mem, off) > ALIGNMENT:
                return DirectIOSupport(
                    False, ALIGNMENT, f"direct I/O alignment {max(mem, off)} exceeds {ALIGNMENT}"
                ), True
            alignment = max(mem, off)
        buf = aligned_buffer(ALIGNMENT)
        buf[:8] = b"fstierpr"
        try:
            written = fsops.FS.pwritev(fd, [buf], 0)
            back = aligned_buffer(ALIGNMENT)
            read = fsops.FS.preadv(fd, [back], 0)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return DirectIOSupport(
                    False, ALIGNMENT, f"O_DIRECT open accepted but I/O refused: {errno_name(exc)}"
                ), True
            return DirectIOSupport(False, ALIGNMENT, f"probe I/O failed: {errno_name(exc)}"), False
        if written != ALIGNMENT or read != ALIGNMENT or bytes(back[:8]) != b"fstierpr":
            return DirectIOSupport(False, ALIGNMENT, "O_DIRECT probe read back wrong bytes"), True
        how = "statx DIOALIGN" if dio is not None else "probe write/read"
        return DirectIOSupport(
            True, alignment, f"O_DIRECT works ({how}, alignment {alignment})"
        ), True
    finally:
        try:
            fsops.FS.close(fd)
        finally:
            with contextlib.suppress(OSError):
                fsops.FS.unlink(tmp)


def probe_o_direct(directory: str | Path, mode: str = "auto") -> DirectIOSupport:
    """Decide O_DIRECT for files under ``directory`` (one probe per call;
    keep the result with the root, as :class:`RootCapabilities` does).

    ``off``: never. ``auto``: use it where it works, otherwise buffered I/O
    and one warning. ``on``: refusal raises :class:`DirectIOUnsupportedError`.
    ``cold``: as ``auto``, for the loads of large files outside the page
    cache only (:attr:`IOOptions.o_direct_cold`); a refusal is logged at
    info level (those loads read buffered, like every other I/O).
    """
    if mode not in ("auto", "on", "off", "cold"):
        raise ValueError(f"o_direct mode must be 'auto', 'on', 'off' or 'cold', got {mode!r}")
    if mode == "off":
        return DirectIOSupport(False, ALIGNMENT, "o_direct: off")
    directory = Path(directory)
    found, definitive = _probe(directory)
    if found.enabled:
        return found
    if not definitive:
        found = DirectIOSupport(mode == "on", ALIGNMENT, found.reason, definitive=False)
        log.warning(
            "O_DIRECT could not be probed under %s (%s); %s until a probe runs",
            directory, found.reason, "using O_DIRECT as configured" if mode == "on" else "using buffered I/O",
        )
        return found
    if mode == "on":
        raise DirectIOUnsupportedError(
            errno.EINVAL,
            f"o_direct: on, but {directory} refuses O_DIRECT ({found.reason}); "
            "set tier.o_direct to 'auto' or 'off', or use a filesystem that supports it",
        )
    if mode == "cold":
        log.info("O_DIRECT unavailable under %s (%s); cold loads read buffered", directory, found.reason)
    else:
        log.warning("O_DIRECT unavailable under %s (%s); using buffered I/O", directory, found.reason)
    return found


# ------------------------------------------------------------ per root
class RootCapabilities:
    """What one root's filesystem can do: O_DIRECT (probed once, at
    creation) and ``O_TMPFILE`` (assumed until the first refusal under this
    root). Thread-safe; one per root, held by whoever stores into it."""

    def __init__(
        self, o_direct: DirectIOSupport | None = None, *, tmpfile: bool = True, root: str | Path = "",
        o_direct_mode: str = "auto", late_write_errors: bool = False, clock: Clock | None = None,
        coherent_cache: bool = False,
    ) -> None:
        self.o_direct = o_direct if o_direct is not None else DirectIOSupport(False, ALIGNMENT, "not probed")
        #: the filesystem may report a buffered write's error late or drop it (module docstring)
        self.late_write_errors = late_write_errors
        #: a local filesystem (:data:`COHERENT_CACHE_FS`): a presence probe may
        #: be answered from the kernel's caches, holding the GIL
        #: (:func:`fstier.io.native.lookup_batch`'s ``cached``)
        self.coherent_cache = coherent_cache
        self.root = str(root)
        self._tmpfile = tmpfile and bool(O_TMPFILE)
        self._lock = threading.Lock()
        self._probe_lock = threading.Lock()  # one re-probe at a time
        self._mode = o_direct_mode
        self._clock = clock if clock is not None else SYSTEM_CLOCK  # the tier's: a test moves it
        #: when to probe O_DIRECT again (the clock's monotonic()), None once a probe found out
        self.reprobe_at: float | None = (
            None if self.o_direct.definitive or o_direct is None else self._clock.monotonic() + REPROBE_S
        )
        #: run (no argument) after this root's O_TMPFILE state or its stores' options changed
        #: (:meth:`changed`): the native engine's cached submit arguments are dropped
        self.watchers: list[Callable[[], None]] = []

    @classmethod
    def probe(cls, directory: str | Path, o_direct: str = "auto", *, clock: Clock | None = None) -> RootCapabilities:
        """Probe ``directory`` (the root, or its namespace directory) once;
        a probe that could not run is repeated by :meth:`reprobe`, every
        ``REPROBE_S`` of ``clock`` (the tier's; the system clock by default)."""
        fstype = filesystem_type(directory) or 0
        kind = LATE_WRITE_ERROR_FS.get(fstype)
        if kind is not None:
            log.info("%s is on %s, which may report a buffered write's error late: buffered stores "
                     "are fsynced before they are acknowledged", directory, kind)
        return cls(
            probe_o_direct(directory, o_direct), root=directory, o_direct_mode=o_direct,
            late_write_errors=kind is not None, clock=clock, coherent_cache=fstype in COHERENT_CACHE_FS,
        )

    def reprobe_due(self) -> bool:
        """Whether the O_DIRECT probe is to run again now (an attribute read
        and, only while one is pending, a clock read)."""
        at = self.reprobe_at
        return at is not None and self._clock.monotonic() >= at

    def reprobe(self) -> DirectIOSupport:
        """Probe O_DIRECT again (one thread at a time; others return the
        current finding at once) and keep the finding; a probe that could
        not run again is retried after ``REPROBE_S``. Never raises."""
        if not self._probe_lock.acquire(blocking=False):
            return self.o_direct
        try:
            if not self.reprobe_due():
                return self.o_direct
            try:
                found, definitive = _probe(Path(self.root))
            except Exception as exc:  # noqa: BLE001 - a probe bug must not fail a store
                found, definitive = DirectIOSupport(False, ALIGNMENT, f"probe failed: {exc!r}"), False
            if found.enabled or definitive:
                self.o_direct = found
                self.reprobe_at = None
                log.info("O_DIRECT under %s probed again: %s", self.root, found.reason)
            else:
                self.reprobe_at = self._clock.monotonic() + REPROBE_S
            return self.o_direct
        finally:
            self._probe_lock.release()

    @property
    def o_direct_mode(self) -> str:
        """The configured ``o_direct`` mode (``auto``, ``on``, ``off``, ``cold``)."""
        return self._mode

    @property
    def tmpfile(self) -> bool:
        """Whether stores under this root still try ``O_TMPFILE``."""
        return self._tmpfile

    def refuse_tmpfile(self, exc: OSError | None = None) -> None:
        """Record that this root refused ``O_TMPFILE``: named temps from now
        on under this root only (one log line)."""
        with self._lock:
            if not self._tmpfile:
                return
            self._tmpfile = False
        self.changed()
        why = errno_name(exc) if exc is not None else "asked"
        where = self.root or "this root"
        log.info("O_TMPFILE unavailable under %s (%s); publishing through named temp files", where, why)

    def changed(self) -> None:
        """Run the :attr:`watchers`: this root's O_TMPFILE state or a block store's options under it changed
        (``BlockStore._reprobe`` after it replaced them, :meth:`refuse_tmpfile`)."""
        for watcher in list(self.watchers):
            watcher()

    def __repr__(self) -> str:
        return f"RootCapabilities(root={self.root!r}, o_direct={self.o_direct.enabled}, tmpfile={self._tmpfile})"
