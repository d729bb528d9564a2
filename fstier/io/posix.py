"""POSIX block I/O: probe O_DIRECT once, store atomically, load and verify.

Store path (:func:`store_block`)
    1. If the final path already holds a regular file, the block is SKIPPED
       (content-addressed: the same key always means the same bytes).
    2. Encode the header into a 4096-aligned per-thread buffer.
    3. Open a unique temp name beside the final path
       (``O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC``, explicit mode, ``O_DIRECT``
       when enabled and the caller's buffer is aligned).
    4. ``pwritev([header, payload padded to 4096])`` in a loop that survives
       short writes; fsync per policy (a failed fsync is never retried).
    5. ``os.replace`` onto the final name; fsync the directory for ``file+dir``.
    Any error removes the temp file and publishes nothing; the outcome is
    FAILED with the errno name as cause. Nothing here raises ``OSError``.

Load path (:func:`load_block`)
    Open the final path (``O_RDONLY|O_NOFOLLOW``, ``O_DIRECT`` when enabled),
    ``fstat`` the fd (never a path stat: NFS close-to-open), then check in
    order: size == 4096 + padded(expected payload) -> ``preadv`` into
    [aligned header buffer, caller's buffer] -> magic/version -> header
    checksum -> key and namespace -> payload length -> payload checksum.
    Proven corruption unlinks the file (only if the path still names the inode
    we opened) and returns CORRUPT; a missing file is MISSING; transient
    errors (EMFILE, EIO, ESTALE, EINTR, EACCES) are ERROR and leave the file.
    Bytes of a block that is not LOADED must be treated as garbage.

O_DIRECT (:func:`probe_o_direct`)
    Probed once per directory: statx ``DIOALIGN`` where the kernel reports it,
    then an aligned write and read of a probe temp file (some filesystems accept
    the open and refuse the write). ``auto`` falls back to buffered I/O with one
    warning; ``on`` raises :class:`~fstier.errors.DirectIOUnsupportedError`.
    A single operation whose buffer is not aligned silently uses buffered I/O.

Every system call goes through :data:`FS`, an :class:`_OsOps` instance, so
tests and the reliability suite can inject faults by swapping its methods.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import stat
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from fstier._atomic import temp_path_for
from fstier.errors import BlockCorruptError, DirectIOUnsupportedError
from fstier.io.blockfile import (
    ALIGNMENT,
    HEADER_SIZE,
    BlockHeader,
    ChecksumKind,
    decode_header,
    encode_header_into,
    padded_len,
    payload_checksum,
)
from fstier.keys import BlockKey

if TYPE_CHECKING:  # pragma: no cover
    from fstier.config import TierConfig

__all__ = [
    "FS",
    "BatchLoadResult",
    "DirectIOSupport",
    "FileCheck",
    "IOOptions",
    "LoadOutcome",
    "LoadRequest",
    "LoadStatus",
    "StoreOutcome",
    "StoreRequest",
    "StoreStatus",
    "aligned_buffer",
    "buffer_address",
    "load_block",
    "load_blocks",
    "probe_o_direct",
    "read_header",
    "reset_probe_cache",
    "store_block",
    "store_blocks",
    "verify_file",
]

log = logging.getLogger("fstier.io")

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_O_NOFOLLOW: int = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC: int = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY: int = getattr(os, "O_DIRECTORY", 0)
_PROBE_NAME = ".fstier-odirect-probe"


# ---------------------------------------------------------------- the FS seam
class _OsOps:
    """Every system call the io layer makes. Tests replace methods on the
    module-level :data:`FS` instance (``monkeypatch.setattr(posix.FS, "fsync", f)``)
    to inject ENOSPC, EIO, short writes, hangs..."""

    def open(self, path: str | Path, flags: int, mode: int = 0o600) -> int:
        return os.open(path, flags, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwritev(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def replace(self, src: str | Path, dst: str | Path) -> None:
        os.replace(src, dst)

    def unlink(self, path: str | Path) -> None:
        os.unlink(path)

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def lstat(self, path: str | Path) -> os.stat_result:
        return os.lstat(path)

    def mkdir(self, path: str | Path, mode: int = 0o755) -> None:
        os.mkdir(path, mode)


FS = _OsOps()


def _cause(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, type(exc).__name__)


# ------------------------------------------------------------ aligned buffers
def aligned_buffer(nbytes: int) -> memoryview:
    """A page-aligned, writable, zeroed buffer (anonymous mmap) of at least
    ``nbytes`` rounded up to 4096. The memory is prefaulted."""
    size = max(ALIGNMENT, padded_len(nbytes))
    # MAP_PRIVATE: Python's default for anonymous maps is MAP_SHARED, which a
    # forked child would share with its parent (tests/reliability/
    # test_concurrency.py::test_io_buffers_private_after_fork).
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(m)
    # Touch every page now: first-touch faults are slow on these VMs
    # (docs/architecture.md, "Facts of the machines").
    view[:: mmap.PAGESIZE] = bytes(len(range(0, size, mmap.PAGESIZE)))
    return view


def buffer_address(view: memoryview) -> int:
    """The address of the first byte of a contiguous buffer."""
    if len(view) == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])


def _is_aligned(view: memoryview, alignment: int) -> bool:
    return buffer_address(view) % alignment == 0 and len(view) % alignment == 0


class _ThreadBuffers(threading.local):
    """Per-thread aligned header buffer and zero tail, reused for every op."""

    def __init__(self) -> None:
        self.header = aligned_buffer(HEADER_SIZE)
        self.tail = aligned_buffer(ALIGNMENT)


_BUFS = _ThreadBuffers()
_ZEROS = bytes(ALIGNMENT)


def _byte_view(buf: Any) -> memoryview:
    view = memoryview(buf)
    if view.ndim != 1 or view.itemsize != 1 or view.format not in ("B", "b", "c"):
        view = view.cast("B")
    return view


# ----------------------------------------------------------------- O_DIRECT
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
        FS.unlink(tmp)


def _probe(directory: Path) -> tuple[DirectIOSupport, bool]:
    """Probe ``directory``; returns the finding and whether it is definitive
    (cacheable). A directory we cannot write to says nothing about O_DIRECT."""
    if not O_DIRECT:
        return DirectIOSupport(False, ALIGNMENT, "this platform has no O_DIRECT"), True
    tmp = temp_path_for(directory / _PROBE_NAME)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
    try:
        fd = FS.open(tmp, flags | O_DIRECT, 0o600)
    except OSError as exc:
        _unlink_own_temp(tmp, exc)
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return DirectIOSupport(False, ALIGNMENT, f"open(O_DIRECT) refused: {_cause(exc)}"), True
        return DirectIOSupport(False, ALIGNMENT, f"probe file not creatable: {_cause(exc)}"), False
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
            written = FS.pwritev(fd, [buf], 0)
            back = aligned_buffer(ALIGNMENT)
            read = FS.preadv(fd, [back], 0)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return DirectIOSupport(
                    False, ALIGNMENT, f"O_DIRECT open accepted but I/O refused: {_cause(exc)}"
                ), True
            return DirectIOSupport(False, ALIGNMENT, f"probe I/O failed: {_cause(exc)}"), False
        if written != ALIGNMENT or read != ALIGNMENT or bytes(back[:8]) != b"fstierpr":
            return DirectIOSupport(False, ALIGNMENT, "O_DIRECT probe read back wrong bytes"), True
        how = "statx DIOALIGN" if dio is not None else "probe write/read"
        return DirectIOSupport(
            True, alignment, f"O_DIRECT works ({how}, alignment {alignment})"
        ), True
    finally:
        try:
            FS.close(fd)
        finally:
            with contextlib.suppress(OSError):
                FS.unlink(tmp)


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


# ------------------------------------------------------------------- options
@dataclass(frozen=True, slots=True)
class IOOptions:
    """How one store or load is performed."""

    o_direct: bool = False
    alignment: int = ALIGNMENT
    fsync: str = "none"
    file_mode: int = 0o644
    checksum: bool = True

    def __post_init__(self) -> None:
        if self.fsync not in ("none", "file", "file+dir"):
            raise ValueError(
                f"IOOptions.fsync must be 'none', 'file' or 'file+dir', got {self.fsync!r}"
            )
        if self.alignment < 1 or ALIGNMENT % self.alignment:
            raise ValueError(f"IOOptions.alignment must divide {ALIGNMENT}, got {self.alignment}")

    @classmethod
    def from_tier(cls, tier: TierConfig, support: DirectIOSupport) -> IOOptions:
        """Options for a tier config and its directory's probe result."""
        return cls(
            o_direct=support.enabled,
            alignment=support.alignment,
            fsync=tier.fsync,
            file_mode=tier.file_mode,
            checksum=tier.checksum != "none",
        )


# --------------------------------------------------------------------- store
class StoreStatus(str, Enum):
    """Result of one store. The values equal the names, so ``== "STORED"`` works."""

    STORED = "STORED"
    SKIPPED = "SKIPPED"
    FAILED = "FAILED"


@dataclass(frozen=True, slots=True)
class StoreRequest:
    """Write ``header`` then ``payload`` to ``path``. ``payload`` holds at least
    ``header.payload_len`` bytes; when it holds the padded length and is
    writable (a pool slot), the padding tail is zeroed in place and the slot is
    written directly (O_DIRECT capable)."""

    path: Path
    header: BlockHeader
    payload: memoryview


@dataclass(frozen=True, slots=True)
class StoreOutcome:
    """What happened to one store: ``cause`` is an errno name (``ENOSPC``) or a
    short reason, ``detail`` says at which step, ``nbytes`` is bytes written."""

    status: StoreStatus
    cause: str = ""
    detail: str = ""
    nbytes: int = 0

    @property
    def ok(self) -> bool:
        return self.status is not StoreStatus.FAILED


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first ``n`` bytes from a list of buffers (short-write resume)."""
    out: list[memoryview] = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(b[n:] if n else b)
        n = 0
    return out


def _pwritev_all(fd: int, bufs: list[memoryview], offset: int) -> int:
    total = 0
    while bufs:
        n = FS.pwritev(fd, bufs, offset + total)
        if n <= 0:
            raise OSError(errno.EIO, f"pwritev wrote {n} bytes")
        total += n
        bufs = _advance(bufs, n)
    return total


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        FS.close(fd)


def _discard(tmp: Path) -> None:
    try:
        FS.unlink(tmp)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove temp file %s: %s", tmp, exc)


def _fsync_dir(directory: Path) -> None:
    fd = FS.open(directory, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        FS.fsync(fd)
    finally:
        FS.close(fd)


def _store_iov(
    payload: memoryview, n: int, header: memoryview, alignment: int
) -> tuple[list[memoryview], bool]:
    """The write vector and whether it is O_DIRECT-aligned."""
    padded = padded_len(n)
    pad = padded - n
    if pad and len(payload) >= padded and not payload.readonly:
        payload[n:padded] = _ZEROS[:pad]
        pad = 0
        body = [payload[:padded]]
    elif pad:
        body = [payload[:n], memoryview(_ZEROS)[:pad]]
    else:
        body = [payload[:n]]
    bufs = [header, *[b for b in body if len(b)]]
    return bufs, all(_is_aligned(b, alignment) for b in bufs)


def _store_once(path: Path, bufs: list[memoryview], direct: bool, opts: IOOptions) -> StoreOutcome:
    tmp = temp_path_for(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
    if direct:
        flags |= O_DIRECT
    stage = "open temp"
    try:
        fd = FS.open(tmp, flags, opts.file_mode)
    except OSError as exc:
        _unlink_own_temp(tmp, exc)
        return StoreOutcome(StoreStatus.FAILED, _cause(exc), f"{stage} {tmp.name}: {exc.strerror}")
    try:
        try:
            stage = "write"
            written = _pwritev_all(fd, bufs, 0)
            if opts.fsync != "none":
                # Never retried: after a failed fsync the kernel may have
                # dropped the dirty pages, so a retry could "succeed" on garbage.
                stage = "fsync"
                FS.fsync(fd)
        except OSError:
            _close_quietly(fd)
            raise
        stage = "close"
        FS.close(fd)  # NFS reports deferred write errors here
        stage = "rename"
        FS.replace(tmp, path)
    except OSError as exc:
        _discard(tmp)
        return StoreOutcome(StoreStatus.FAILED, _cause(exc), f"{stage} {path.name}: {exc.strerror}")
    if opts.fsync == "file+dir":
        try:
            _fsync_dir(path.parent)
        except OSError as exc:
            # The complete file is visible but not durable: never acknowledge it.
            return StoreOutcome(
                StoreStatus.FAILED, _cause(exc), f"directory fsync after publishing {path.name}"
            )
    return StoreOutcome(StoreStatus.STORED, nbytes=written)


def store_block(req: StoreRequest, opts: IOOptions) -> StoreOutcome:
    """Store one block atomically. Never raises ``OSError``; raises
    ``ValueError`` only for a malformed request (a programming error)."""
    path = Path(req.path)
    n = req.header.payload_len
    payload = _byte_view(req.payload)
    if len(payload) < n:
        raise ValueError(
            f"StoreRequest.payload holds {len(payload)} bytes but header.payload_len is {n}"
        )
    try:
        st = FS.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return StoreOutcome(StoreStatus.FAILED, _cause(exc), f"lstat {path.name}: {exc.strerror}")
    else:
        if stat.S_ISREG(st.st_mode):
            return StoreOutcome(StoreStatus.SKIPPED)
        # Anything else (a planted symlink) is replaced: rename swaps the link
        # itself and never writes through it.
    header = _BUFS.header
    encode_header_into(req.header, header)
    bufs, aligned = _store_iov(payload, n, header, opts.alignment)
    direct = opts.o_direct and aligned
    out = _store_once(path, bufs, direct, opts)
    if direct and out.status is StoreStatus.FAILED and out.cause == "EINVAL":
        # A filesystem that passed the probe but refuses this write: one
        # buffered retry (a new temp file) rather than a lost block.
        out = _store_once(path, bufs, False, opts)
    return out


def store_blocks(reqs: Sequence[StoreRequest], opts: IOOptions) -> list[StoreOutcome]:
    """Store every request (a failure does not stop the batch)."""
    return [store_block(r, opts) for r in reqs]


# ---------------------------------------------------------------------- load
class LoadStatus(str, Enum):
    """Result of one load. The values equal the names, so ``== "LOADED"`` works."""

    LOADED = "LOADED"
    MISSING = "MISSING"
    CORRUPT = "CORRUPT"
    ERROR = "ERROR"


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """Load the file at ``path`` into ``buffer`` (at least ``payload_len``
    bytes; with the padded length and 4096 alignment it is read directly, with
    O_DIRECT when enabled) and check that it holds ``key`` of namespace
    ``namespace_digest`` with exactly ``payload_len`` payload bytes."""

    path: Path
    buffer: memoryview
    key: BlockKey
    namespace_digest: bytes
    payload_len: int
    #: The cache root. When set, a corrupt file is removed only if its
    #: directory really lies under this root (no symlinked component led
    #: elsewhere): promise 5, nothing outside root is ever removed.
    root: Path | None = None


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """What happened to one load. ``removed`` is true when a corrupt file was
    unlinked. Only LOADED means the buffer holds verified bytes."""

    status: LoadStatus
    cause: str = ""
    detail: str = ""
    nbytes: int = 0
    removed: bool = False

    @property
    def ok(self) -> bool:
        return self.status is LoadStatus.LOADED


@dataclass(frozen=True, slots=True)
class BatchLoadResult:
    """A batched load: the first ``num_loaded`` blocks verified; ``outcomes``
    has one entry per attempted block (the last one is the failure, if any)."""

    num_loaded: int
    outcomes: list[LoadOutcome]

    @property
    def complete(self) -> bool:
        return self.num_loaded == len(self.outcomes) and all(o.ok for o in self.outcomes)


def _preadv_all(fd: int, bufs: list[memoryview], offset: int) -> int:
    total = 0
    while bufs:
        n = FS.preadv(fd, bufs, offset + total)
        if n <= 0:
            break  # EOF: the file shrank under us; the caller sees a short read
        total += n
        bufs = _advance(bufs, n)
    return total


def _contained(path: Path, root: Path | None) -> bool:
    """True when ``path``'s directory resolves (symlinks followed) under
    ``root``'s real path. Only called before a removal, never on the hot path."""
    if root is None:
        return True
    real_parent = os.path.realpath(path.parent)
    real_root = os.path.realpath(root)
    return real_parent == real_root or real_parent.startswith(real_root.rstrip(os.sep) + os.sep)


def _remove_if_same(path: Path, st: os.stat_result, root: Path | None = None) -> bool:
    """Unlink ``path`` only if it still names the inode we read, so a file a
    concurrent writer has just renamed into place is never removed, and only
    if it lies under ``root``."""
    if not _contained(path, root):
        log.warning("not removing corrupt file %s: it resolves outside the cache root", path)
        return False
    try:
        now = FS.lstat(path)
        if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
            return False
        FS.unlink(path)
        return True
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("could not remove corrupt block %s: %s", path, exc)
        return False


def _load_once(req: LoadRequest, buf: memoryview, direct: bool, opts: IOOptions) -> LoadOutcome:
    path = Path(req.path)
    n = req.payload_len
    padded = padded_len(n)
    # O_NONBLOCK: a FIFO planted at a block path would block open() forever;
    # with it the open returns and the S_ISREG check below rejects the file.
    # It has no effect on regular files.
    flags = os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | os.O_NONBLOCK
    if direct:
        flags |= O_DIRECT
    try:
        fd = FS.open(path, flags)
    except FileNotFoundError:
        return LoadOutcome(LoadStatus.MISSING, "ENOENT")
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            # A symlink where a block belongs was planted, never written by
            # fstier: remove the link itself (never its target).
            removed = False
            if _contained(path, req.root):
                try:
                    FS.unlink(path)
                    removed = True
                except OSError:
                    pass
            return LoadOutcome(
                LoadStatus.CORRUPT, "symlink", f"{path.name} is a symlink", removed=removed
            )
        return LoadOutcome(LoadStatus.ERROR, _cause(exc), f"open {path.name}: {exc.strerror}")
    st: os.stat_result | None = None
    try:
        try:
            st = FS.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return LoadOutcome(
                    LoadStatus.ERROR, "not_regular", f"{path.name} is not a regular file"
                )
            want = HEADER_SIZE + padded
            if st.st_size != want:
                raise BlockCorruptError("bad_size", f"file is {st.st_size} bytes, expected {want}")
            header = _BUFS.header
            if len(buf) >= padded:
                bufs = [header, buf[:padded]]
            else:
                bufs = [header, buf[:n], _BUFS.tail[: padded - n]]
            got = _preadv_all(fd, [b for b in bufs if len(b)], 0)
            if got != want:
                raise BlockCorruptError("short_read", f"read {got} of {want} bytes")
            h = decode_header(header)
            if h.key != req.key:
                raise BlockCorruptError("wrong_key", f"file holds {h.key!r}, expected {req.key!r}")
            if h.namespace_digest != req.namespace_digest:
                raise BlockCorruptError(
                    "wrong_namespace",
                    f"file digest {h.namespace_digest.hex()}, expected {req.namespace_digest.hex()}",
                )
            if h.payload_len != n:
                raise BlockCorruptError(
                    "wrong_length", f"payload_len {h.payload_len}, expected {n}"
                )
            if (
                opts.checksum
                and h.checksum_kind == ChecksumKind.XXH3_64
                and payload_checksum(buf[:n]) != h.payload_checksum
            ):
                raise BlockCorruptError("payload_checksum", "payload bytes do not match checksum")
        except BlockCorruptError as exc:
            removed = st is not None and _remove_if_same(path, st, req.root)
            return LoadOutcome(LoadStatus.CORRUPT, exc.reason, exc.detail, removed=removed)
        except OSError as exc:
            return LoadOutcome(LoadStatus.ERROR, _cause(exc), f"read {path.name}: {exc.strerror}")
    finally:
        _close_quietly(fd)
    return LoadOutcome(LoadStatus.LOADED, nbytes=n)


def load_block(req: LoadRequest, opts: IOOptions) -> LoadOutcome:
    """Load and verify one block. Never raises ``OSError``; raises
    ``ValueError`` only for a malformed request."""
    buf = _byte_view(req.buffer)
    n = req.payload_len
    if n < 0 or len(buf) < n:
        raise ValueError(f"LoadRequest.buffer holds {len(buf)} bytes but payload_len is {n}")
    if buf.readonly:
        raise ValueError("LoadRequest.buffer must be writable")
    direct = (
        opts.o_direct
        and len(buf) >= padded_len(n)
        and _is_aligned(buf[: padded_len(n)], opts.alignment)
    )
    out = _load_once(req, buf, direct, opts)
    if direct and out.status is LoadStatus.ERROR and out.cause == "EINVAL":
        out = _load_once(req, buf, False, opts)
    return out


def load_blocks(reqs: Sequence[LoadRequest], opts: IOOptions) -> BatchLoadResult:
    """Load blocks in order, stopping at the first one that is not LOADED."""
    outcomes: list[LoadOutcome] = []
    for r in reqs:
        out = load_block(r, opts)
        outcomes.append(out)
        if not out.ok:
            return BatchLoadResult(len(outcomes) - 1, outcomes)
    return BatchLoadResult(len(outcomes), outcomes)


# ------------------------------------------------------------- CLI helpers
@dataclass(frozen=True, slots=True)
class FileCheck:
    """The verdict on one block file: ``ok``, the ``reason`` when not, the
    decoded header when it parsed, and the file size."""

    ok: bool
    reason: str
    header: BlockHeader | None
    size: int


def read_header(path: str | Path) -> BlockHeader:
    """Decode a block file's header (no payload read). Raises
    :class:`BlockCorruptError` for a bad header and ``OSError`` for I/O."""
    fd = FS.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | os.O_NONBLOCK)
    try:
        buf = bytearray(HEADER_SIZE)
        got = _preadv_all(fd, [memoryview(buf)], 0)
        if got < HEADER_SIZE:
            raise BlockCorruptError("short_header", f"{got} < {HEADER_SIZE} bytes")
        return decode_header(buf)
    finally:
        FS.close(fd)


def verify_file(
    path: str | Path,
    full: bool = True,
    *,
    key: BlockKey | None = None,
    namespace_digest: bytes | None = None,
) -> FileCheck:
    """Check a block file without a caller buffer: header, size and, with
    ``full``, the payload checksum (streamed in 1 MiB chunks, so a hostile
    length never causes a large allocation). Raises ``OSError`` for I/O."""
    fd = FS.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = FS.fstat(fd)
        size = st.st_size
        if not stat.S_ISREG(st.st_mode):
            return FileCheck(False, "not_regular", None, size)
        buf = bytearray(HEADER_SIZE)
        if _preadv_all(fd, [memoryview(buf)], 0) < HEADER_SIZE:
            return FileCheck(False, "short_header", None, size)
        try:
            h = decode_header(buf)
        except BlockCorruptError as exc:
            return FileCheck(False, exc.reason, None, size)
        if size != HEADER_SIZE + padded_len(h.payload_len):
            return FileCheck(False, "bad_size", h, size)
        if key is not None and h.key != key:
            return FileCheck(False, "wrong_key", h, size)
        if namespace_digest is not None and h.namespace_digest != namespace_digest:
            return FileCheck(False, "wrong_namespace", h, size)
        if full and h.checksum_kind == ChecksumKind.XXH3_64:
            hasher = xxhash.xxh3_64()
            chunk = bytearray(1 << 20)
            view = memoryview(chunk)
            left, off = h.payload_len, HEADER_SIZE
            while left:
                want = min(left, len(chunk))
                got = FS.preadv(fd, [view[:want]], off)
                if got <= 0:
                    return FileCheck(False, "short_read", h, size)
                hasher.update(view[:got])
                left -= got
                off += got
            if hasher.intdigest() != h.payload_checksum:
                return FileCheck(False, "payload_checksum", h, size)
        return FileCheck(True, "", h, size)
    finally:
        FS.close(fd)
