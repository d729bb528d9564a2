"""What each real shared filesystem does to what fstier depends on, probed
from two client hosts, and fstier's per-root capabilities choosing the path
by that probe (never by the filesystem's name).

Every probe records its finding in ``FIGURES`` (printed at the end of
``make test-sharedfs``; docs/deployment.md's tables quote them) and asserts
only what fstier relies on:

- O_DIRECT: statx ``DIOALIGN`` where reported, else an aligned write + read;
  the tier's probe enables O_DIRECT exactly where an aligned raw O_DIRECT
  write and read work (and then stores and loads through it).
- O_TMPFILE: refused on all three; the tier's root switches to named temps
  after the first refusal and stores still land.
- Publication by rename: a file renamed into place on host a is seen whole
  on host b (never a partial file), and a rename-replace shows the new
  inode's bytes to a new open on b.
- Recency: ``utime`` on a is seen on b (to the second at least: MooseFS
  keeps whole seconds), as eviction reads it.
- In-place rewrites of the same size through a long-lived fd, read by new
  opens on b: recorded (ceph-fuse serves the old bytes from the second
  rewrite on; fstier never rewrites a file in place: count files and leases
  are new names).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import struct
import time
from pathlib import Path

from manager_support import keys, load, open_tier, store

from fstier.io.capabilities import RootCapabilities

from .conftest import FIGURES, SharedFs

PAGE = 4096


def _note(sfs: SharedFs, what: str, value: object) -> None:
    FIGURES.setdefault(f"{sfs.name} semantics", {})[what] = value


def _statx_mask(path: Path) -> tuple[int, int]:
    """(stx_mask, stx_blksize) of ``path`` with STATX_DIOALIGN asked."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(256)
    statx_basic, statx_dioalign = 0x7FF, 0x2000
    if libc.statx(-100, os.fsencode(path), 0, statx_basic | statx_dioalign, buf) != 0:
        raise OSError(ctypes.get_errno(), "statx")
    mask, blksize = struct.unpack_from("<II", buf.raw, 0)
    return mask, blksize


def _raw_o_direct(d: Path) -> tuple[bool, str]:
    """An aligned 4 KiB O_DIRECT write and read of a new file, raw."""
    p = d / "odirect-raw"
    buf = mmap.mmap(-1, PAGE)
    buf.write(b"d" * PAGE)
    try:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as exc:
        return False, f"open: {errno.errorcode[exc.errno or 0]}"
    try:
        if os.pwritev(fd, [buf], 0) != PAGE:
            return False, "short write"
        back = mmap.mmap(-1, PAGE)
        if os.preadv(fd, [back], 0) != PAGE or back[:] != buf[:]:
            return False, "read back differs"
    except OSError as exc:
        return False, f"I/O: {errno.errorcode[exc.errno or 0]}"
    finally:
        os.close(fd)
        p.unlink()
    return True, "aligned 4 KiB write + read"


def _unaligned_o_direct(d: Path) -> str:
    p = d / "odirect-unaligned"
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as exc:
        return f"open refused ({errno.errorcode[exc.errno or 0]})"
    try:
        try:
            os.write(fd, b"u" * 100)
        except OSError as exc:
            return f"write refused ({errno.errorcode[exc.errno or 0]})"
        try:
            os.close(fd)
        except OSError as exc:
            return f"write accepted, close failed ({errno.errorcode[exc.errno or 0]})"
        fd = -1
        return "accepted"
    finally:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        p.unlink(missing_ok=True)


def _o_tmpfile(d: Path) -> str:
    try:
        fd = os.open(d, os.O_WRONLY | os.O_TMPFILE, 0o600)
    except OSError as exc:
        return errno.errorcode[exc.errno or 0]
    os.close(fd)
    return "works"


def test_o_direct_and_tmpfile_chosen_by_probe(sfs: SharedFs) -> None:
    probe_dir = sfs.a / "probe"
    probe_dir.mkdir()
    mask, blksize = _statx_mask(probe_dir)
    raw_ok, raw_how = _raw_o_direct(probe_dir)
    caps = RootCapabilities.probe(probe_dir, "auto")
    _note(sfs, "statx DIOALIGN", "reported" if mask & 0x2000 else f"not reported (blksize {blksize})")
    _note(sfs, "O_DIRECT aligned 4 KiB (raw)", "works" if raw_ok else raw_how)
    _note(sfs, "O_DIRECT unaligned 100 B write", _unaligned_o_direct(probe_dir))
    tmpfile = _o_tmpfile(probe_dir)
    _note(sfs, "O_TMPFILE", tmpfile)
    _note(sfs, "fstier's probe", caps.o_direct.reason)
    # The probe's decision is what the raw syscalls show, on this mount.
    assert caps.o_direct.enabled == raw_ok, (caps.o_direct, raw_how)
    ks = keys(0, 16)
    with open_tier(sfs.a) as tier:
        rc = tier.blocks.options.capabilities
        assert rc is not None
        assert rc.o_direct.enabled == raw_ok
        assert store(tier, "s", ks).success
        # The first store met the refusal (if any) and switched this root only.
        assert rc.tmpfile == (tmpfile == "works"), (rc, tmpfile)
    with open_tier(sfs.b) as tier:
        res = load(tier, "l", ks)
        assert res.success and res.keys_completed == len(ks), res


def _poll(fn, limit_s: float) -> float | None:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while True:
        if fn():
            return time.monotonic() - t0
        if time.monotonic() - t0 > limit_s:
            return None
        time.sleep(0.002)


def _read(p: Path) -> bytes | None:
    try:
        return p.read_bytes()
    except OSError:
        return None


def test_rename_publication_and_utime_across_hosts(sfs: SharedFs) -> None:
    a, b = sfs.a, sfs.b
    body1, body2 = os.urandom(64 << 10), os.urandom(64 << 10)
    # A new file published by rename on a: b sees it whole, never partial.
    tmp = a / ".tmp-new"
    tmp.write_bytes(body1)
    os.rename(tmp, a / "pub")
    seen_new = _poll(lambda: _read(b / "pub") == body1, 30)
    # Rename-replace on a (a new inode, as fstier's count files and leases).
    tmp.write_bytes(body2)
    os.rename(tmp, a / "pub")
    seen_replace = _poll(lambda: _read(b / "pub") == body2, 30)
    # Recency: utime on a, with ns precision, as eviction reads it on b.
    t_ns = 1_700_000_000_123_456_789
    os.utime(a / "pub", ns=(t_ns, t_ns))
    # (MooseFS keeps whole seconds: recency needs order, not nanoseconds.)
    seen_utime = _poll(lambda: abs(os.stat(b / "pub").st_mtime_ns - t_ns) < 1_000_000_000, 30)
    mtime_b = os.stat(b / "pub").st_mtime_ns
    # In-place rewrites of the same size through one long-lived fd on a, b
    # holding an fd too (fstier never does this; a count or lease shared
    # that way would be read stale).
    inplace = a / "inplace"
    fa = os.open(inplace, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fa, b"1" * PAGE, 0)
        assert _poll(lambda: _read(b / "inplace") == b"1" * PAGE, 30) is not None
        fb = os.open(b / "inplace", os.O_RDONLY)
        try:
            seen_inplace = []
            for v in (b"2", b"3"):
                os.pwrite(fa, v * PAGE, 0)
                seen_inplace.append(_poll(lambda v=v: _read(b / "inplace") == v * PAGE, 3))
        finally:
            os.close(fb)
    finally:
        os.close(fa)

    def ms(x: float | None) -> str:
        return "not within the wait" if x is None else f"{x * 1000:.0f} ms"

    _note(sfs, "new file (rename) seen on b", ms(seen_new))
    _note(sfs, "rename-replace seen by a new open on b", ms(seen_replace))
    _note(sfs, "utime on a seen on b", ms(seen_utime) + (", ns precision" if mtime_b == t_ns else ", whole seconds"))
    _note(
        sfs, "same-size in-place rewrites (a's fd kept open), seen by a new open on b",
        ", ".join("stale after 3 s" if x is None else ms(x) for x in seen_inplace),
    )
    assert seen_new is not None and seen_replace is not None
    assert seen_utime is not None and mtime_b // 1_000_000_000 == t_ns // 1_000_000_000
