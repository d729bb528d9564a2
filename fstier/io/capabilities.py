"""What a root's filesystem can do, probed rather than assumed.

O_DIRECT (:func:`probe_o_direct`)
    Probed once per directory: statx ``DIOALIGN`` where the kernel reports it,
    then an aligned write and read of a probe temp file (some filesystems accept
    the open and refuse the write). ``auto`` falls back to buffered I/O with one
    warning; ``on`` raises :class:`~fstier.errors.DirectIOUnsupportedError`.
    A single operation whose buffer does not start aligned uses buffered I/O.

O_TMPFILE (:func:`tmpfile_usable`, :func:`refuse_tmpfile`)
    Stores publish an anonymous ``O_TMPFILE`` inode with ``linkat``; the
    first refusal (NFS, FUSE: ``EOPNOTSUPP``; a kernel without it: ``EISDIR``)
    switches to named temps + ``renameat``.

Every probe goes through the syscall seam (:data:`fstier.io.fsops.FS`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

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

__all__ = ["DirectIOSupport", "probe_o_direct", "refuse_tmpfile", "reset_probe_cache", "tmpfile_usable"]

log = logging.getLogger("fstier.io")

_PROBE_NAME = ".fstier-odirect-probe"


@dataclass(frozen=True, slots=True)
class DirectIOSupport:
    """Whether O_DIRECT is used under a directory, with which memory/offset
    alignment, and why (the probe's finding, for logs)."""

    enabled: bool
    alignment: int
    reason: str


_probe_lock = threading.Lock()
_probe_cache: dict[str, DirectIOSupport] = {}


def reset_probe_cache() -> None:
    """Forget every probe result (tests; a remounted filesystem)."""
    with _probe_lock:
        _probe_cache.clear()


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
    """Decide O_DIRECT for files under ``directory`` (probed once, cached).

    ``off``: never. ``auto``: use it where it works, otherwise buffered I/O
    and one warning. ``on``: refusal raises :class:`DirectIOUnsupportedError`.
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"o_direct mode must be 'auto', 'on' or 'off', got {mode!r}")
    if mode == "off":
        return DirectIOSupport(False, ALIGNMENT, "o_direct: off")
    directory = Path(directory)
    key = os.path.realpath(directory)
    with _probe_lock:
        found = _probe_cache.get(key)
        fresh = found is None
        if found is None:
            found, definitive = _probe(directory)
            if definitive:
                _probe_cache[key] = found
    if found.enabled:
        return found
    if mode == "on":
        raise DirectIOUnsupportedError(
            errno.EINVAL,
            f"o_direct: on, but {directory} refuses O_DIRECT ({found.reason}); "
            "set tier.o_direct to 'auto' or 'off', or use a filesystem that supports it",
        )
    if fresh:
        log.warning(
            "O_DIRECT unavailable under %s (%s); using buffered I/O", directory, found.reason
        )
    return found



# ----------------------------------------------------------------- O_TMPFILE
#: Set once O_TMPFILE was refused (NFS, old kernels): named temps from then on.
_tmpfile_refused = not O_TMPFILE


def tmpfile_usable() -> bool:
    """Whether stores still try ``O_TMPFILE`` (no refusal seen yet)."""
    return not _tmpfile_refused


def refuse_tmpfile(exc: OSError) -> None:
    """Record that ``O_TMPFILE`` was refused: named temps from now on."""
    global _tmpfile_refused
    if not _tmpfile_refused:
        _tmpfile_refused = True
        log.info("O_TMPFILE unavailable (%s); publishing through named temp files", errno_name(exc))
