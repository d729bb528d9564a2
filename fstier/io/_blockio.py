"""One block file at a given path: stored atomically, loaded and checked (the
Python backend of :class:`fstier.io.blockstore.BlockStore`; private: callers
go through ``BlockStore``).

No path is ever resolved through a symlink: every path goes through
:func:`fstier.io.fsops.open_nofollow` (``openat2`` with
``RESOLVE_NO_SYMLINKS``), and every name is acted on inside a directory fd
opened that way, so a directory swapped for a symlink at any moment is
refused (``ELOOP``), never followed out of the root.

Payloads are **exact-length**: a store reads, and a load writes, exactly
``payload_len`` bytes of the caller's buffer, at any address and any length.
The file holds the payload zero-padded to 4096; the payload's whole pages go
straight between the buffer and the file, its last partial page through a
4 KiB per-thread bounce page, so a buffer that starts 4096-aligned stays on
O_DIRECT whatever its length (docs/architecture.md has the measurement).

Store path (:func:`store_block`), 7 system calls
    1. Open the final path's directory (``openat2``, no symlinks).
    2. ``fstatat`` the name: a regular file there means SKIPPED
       (content-addressed: the same key always means the same bytes).
    3. Encode the header into a 4096-aligned per-thread buffer; open an
       anonymous inode in the directory (``O_TMPFILE``, explicit mode,
       ``O_DIRECT`` when enabled and the buffer is aligned); where the
       filesystem has no ``O_TMPFILE`` (NFS), a unique temp name instead
       (``O_CREAT|O_EXCL|O_NOFOLLOW``).
    4. ``pwritev([header, whole pages, bounce page])`` in a loop that
       survives short writes; fsync per policy (a failed fsync is never
       retried).
    5. Publish: ``linkat`` the anonymous inode to the final name (if the
       name exists, link a temp name and ``renameat`` it over, so the last
       writer wins), or ``renameat`` the named temp; close; fsync the
       directory fd for ``file+dir``.
    Any error removes the temp name and publishes nothing; the outcome is
    FAILED with the errno name as cause. A crash before the link leaves
    nothing at all (the anonymous inode dies with the process). Nothing
    here raises ``OSError``.

Load path (:func:`load_block`), 3 system calls
    ``openat2`` the final path (``O_RDONLY|O_NOFOLLOW|O_NONBLOCK``, no
    symlinks, ``O_DIRECT`` when enabled), then ONE ``preadv`` into
    [aligned header buffer, the caller's whole pages, bounce page, overflow
    page], close. A file of the expected size ends inside the overflow page;
    any other size shows as a short or long read, and only then is the fd
    ``fstat``-ed (never a path stat: NFS close-to-open). Then, in order:
    magic/version -> header checksum -> key and namespace -> payload length
    -> payload checksum. Proven corruption unlinks the file (only if the name
    still holds the inode we read) and returns CORRUPT; a missing file is
    MISSING; a symlink on the path is CORRUPT (a link at the final name is
    removed, never its target); a FIFO, socket, directory or device is
    ERROR ``not_regular``/``ENXIO``/``ENOTDIR``; transient errors (EMFILE,
    EIO, ESTALE, EINTR, EACCES) are ERROR and leave the file. Bytes of a
    block that is not LOADED must be treated as garbage.

O_DIRECT and O_TMPFILE are decided per root by :mod:`fstier.io.capabilities`.
Options, requests and outcomes are :mod:`fstier.io.iotypes`' (shared with the
native backend); checking a stored file without loading it is
:mod:`fstier.io.blockcheck`'s.

Every system call goes through :data:`fstier.io.fsops.FS`, so tests and the
reliability suite can inject faults by swapping its methods.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
from pathlib import Path

from fstier.errors import BlockCorruptError
from fstier.io import fsops
from fstier.io.blockfile import (
    ALIGNMENT,
    HEADER_SIZE,
    BlockHeader,
    ChecksumKind,
    Expected,
    check_block,
    check_payload,
    decode_header,
    encode_header_into,
    padded_len,
    payload_checksum,
)
from fstier.io.fsops import (
    O_CLOEXEC,
    O_DIR_FLAGS,
    O_DIRECT,
    O_NOFOLLOW,
    O_TMPFILE,
    advance,
    aligned_buffer,
    byte_view,
    close_quietly,
    discard_at,
    errno_name,
    is_aligned,
    pwritev_all,
    split_parent,
    temp_path_for,
    unlink_if_same,
)
from fstier.io.iotypes import (
    IOOptions,
    LoadOutcome,
    LoadRequest,
    LoadStatus,
    StoreOutcome,
    StoreRequest,
    StoreStatus,
)

__all__ = ["load_block", "store_block", "store_block_at"]

log = logging.getLogger("fstier.io")


# ------------------------------------------------- per-thread pages
class _ThreadBuffers(threading.local):
    """Per-thread aligned header, bounce and overflow pages, reused for every op."""

    def __init__(self) -> None:
        self.header = aligned_buffer(HEADER_SIZE)
        #: bounce page for a payload's last partial page (store and load)
        self.tail = aligned_buffer(ALIGNMENT)
        #: overflow page: a too-long file shows up in the load's one preadv
        self.over = aligned_buffer(ALIGNMENT)


_BUFS = _ThreadBuffers()
_ZEROS = bytes(ALIGNMENT)


# --------------------------------------------------------------------- store
def _store_iov(
    payload: memoryview, n: int, header: memoryview, alignment: int
) -> tuple[list[memoryview], bool]:
    """The write vector for exactly ``payload[:n]`` (never a byte beyond it)
    and whether it is O_DIRECT-aligned.

    The file holds the payload zero-padded to 4096. The whole 4096-byte pages
    of the payload are written from the caller's buffer; the last partial
    page, if any, goes through the thread's bounce page (a copy of at most
    4095 bytes plus zeros), so an aligned buffer of any length stays on
    O_DIRECT and nothing outside ``payload[:n]`` is read or written."""
    whole = n - n % ALIGNMENT
    rest = n - whole
    bufs = [header]
    if whole:
        bufs.append(payload[:whole])
    if rest:
        bounce = _BUFS.tail
        bounce[:rest] = payload[whole:n]
        bounce[rest:] = _ZEROS[: ALIGNMENT - rest]
        bufs.append(bounce)
    # The header and bounce pages are page-aligned by construction.
    return bufs, is_aligned(payload[:whole], alignment)


def _create_temp(dir_fd: int, name: str, direct: bool, opts: IOOptions) -> tuple[int, str | None]:
    """An fd to write the new file into, and its temp name (``None`` for an
    anonymous O_TMPFILE inode, which a crash leaves nowhere at all)."""
    flags = os.O_WRONLY | O_CLOEXEC | (O_DIRECT if direct else 0)
    caps = opts.capabilities
    if caps is None or caps.tmpfile:
        try:
            return fsops.FS.openat(dir_fd, ".", flags | O_TMPFILE, opts.file_mode), None
        except OSError as exc:
            # EISDIR: a kernel without O_TMPFILE read it as O_DIRECTORY.
            # EOPNOTSUPP: the filesystem has none (NFS, FUSE). Anything else
            # (ENOSPC, EACCES, EINVAL from O_DIRECT) is the store's failure.
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR):
                raise
            if caps is not None:
                caps.refuse_tmpfile(exc)
    tmp = temp_path_for(Path(name)).name
    try:
        return fsops.FS.openat(dir_fd, tmp, flags | os.O_CREAT | os.O_EXCL, opts.file_mode), tmp
    except OSError as exc:
        if exc.errno != errno.EEXIST:
            # Some filesystems (ramfs) create the file for O_CREAT|O_EXCL|O_DIRECT
            # and then fail the open; the name is unique to this thread.
            with contextlib.suppress(OSError):
                fsops.FS.unlink_at(dir_fd, tmp)
        raise


def _link_anonymous(fd: int, dir_fd: int, name: str) -> None:
    """Publish an O_TMPFILE inode as ``name``. linkat never replaces, so when
    the name exists (a concurrent writer, a planted link) the inode is linked
    under a temp name and renamed over it: the last writer wins, as with
    named temps."""
    try:
        fsops.FS.link_at(fd, dir_fd, name)
        return
    except FileExistsError:
        pass
    tmp = temp_path_for(Path(name)).name
    fsops.FS.link_at(fd, dir_fd, tmp)
    try:
        fsops.FS.replace_at(dir_fd, tmp, name)
    except BaseException:
        discard_at(dir_fd, tmp)
        raise


def _store_once(
    dir_fd: int, name: str, bufs: list[memoryview], direct: bool, opts: IOOptions
) -> StoreOutcome:
    try:
        fd, tmp = _create_temp(dir_fd, name, direct, opts)
    except OSError as exc:
        return StoreOutcome(StoreStatus.FAILED, errno_name(exc), f"create temp for {name}: {exc.strerror}")
    stage = "write"
    linked = False
    try:
        try:
            written = pwritev_all(fd, bufs, 0)
            if opts.fsync != "none":
                # Never retried: after a failed fsync the kernel may have
                # dropped the dirty pages, so a retry could "succeed" on garbage.
                stage = "fsync"
                fsops.FS.fsync(fd)
            if tmp is None:
                # An anonymous inode is published through its open fd.
                stage = "link"
                _link_anonymous(fd, dir_fd, name)
                linked = True
        except OSError:
            close_quietly(fd)
            raise
        stage = "close"
        fsops.FS.close(fd)  # NFS reports deferred write errors here
        if tmp is not None:
            stage = "rename"
            fsops.FS.replace_at(dir_fd, tmp, name)
    except OSError as exc:
        if tmp is not None:
            discard_at(dir_fd, tmp)
        elif linked:
            # close failed after the link: withdraw the name rather than
            # acknowledge a file whose writes may be lost (at worst this
            # removes a concurrent writer's identical copy: a future miss).
            discard_at(dir_fd, name)
        return StoreOutcome(StoreStatus.FAILED, errno_name(exc), f"{stage} {name}: {exc.strerror}")
    if opts.fsync == "file+dir":
        try:
            fsops.FS.fsync(dir_fd)
        except OSError as exc:
            # The complete file is visible but not durable: never acknowledge it.
            return StoreOutcome(
                StoreStatus.FAILED, errno_name(exc), f"directory fsync after publishing {name}"
            )
    return StoreOutcome(StoreStatus.STORED, nbytes=written)


def store_block(req: StoreRequest, opts: IOOptions) -> StoreOutcome:
    """Store one block atomically. Never raises ``OSError``; raises
    ``ValueError`` only for a malformed request (a programming error).

    Exactly ``req.header.payload_len`` bytes of ``req.payload`` are read, at
    any alignment; the caller's buffer is never written."""
    n = req.header.payload_len
    payload = byte_view(req.payload)
    if len(payload) < n:
        raise ValueError(
            f"StoreRequest.payload holds {len(payload)} bytes but header.payload_len is {n}"
        )
    parent, name = split_parent(req.path)
    try:
        dir_fd = fsops.FS.open(parent, O_DIR_FLAGS)
    except OSError as exc:
        # ENOENT: the fan-out directory is missing (the caller creates it);
        # ELOOP/ENOTDIR: a component is a symlink or a file: refused, since
        # following it could place the block outside the root.
        return StoreOutcome(StoreStatus.FAILED, errno_name(exc), f"open directory of {name}: {exc.strerror}")
    try:
        return _store_in(dir_fd, name, req.header, payload, opts, fresh=False)
    finally:
        close_quietly(dir_fd)


def store_block_at(
    dir_fd: int,
    name: str,
    header: BlockHeader,
    payload: memoryview,
    opts: IOOptions,
    *,
    fresh: bool = False,
) -> StoreOutcome:
    """:func:`store_block` into ``name`` inside ``dir_fd``, a directory the
    caller opened with no symlink on its path (and closes). ``fresh``: the
    caller has just created that directory, so the existence check is
    skipped (one system call less per store into a new fan-out directory; a
    racing writer's identical copy is still handled by the publication)."""
    n = header.payload_len
    view = byte_view(payload)
    if len(view) < n:
        raise ValueError(f"store_block_at: payload holds {len(view)} bytes but payload_len is {n}")
    return _store_in(dir_fd, name, header, view, opts, fresh=fresh)


def _store_in(
    dir_fd: int, name: str, h: BlockHeader, payload: memoryview, opts: IOOptions, *, fresh: bool
) -> StoreOutcome:
    n = h.payload_len
    if not fresh:
        try:
            st = fsops.FS.stat_at(dir_fd, name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            return StoreOutcome(StoreStatus.FAILED, errno_name(exc), f"stat {name}: {exc.strerror}")
        else:
            if stat.S_ISREG(st.st_mode):
                return StoreOutcome(StoreStatus.SKIPPED)
            # Anything else (a planted symlink) is replaced: rename swaps the
            # link itself and never writes through it.
    header = _BUFS.header
    encode_header_into(h, header)
    bufs, aligned = _store_iov(payload, n, header, opts.alignment)
    direct = opts.o_direct and aligned
    out = _store_once(dir_fd, name, bufs, direct, opts)
    if direct and out.status is StoreStatus.FAILED and out.cause == "EINVAL":
        # A filesystem that passed the probe but refuses this write: one
        # buffered retry (a new temp file) rather than a lost block.
        out = _store_once(dir_fd, name, bufs, False, opts)
    return out


# ---------------------------------------------------------------------- load

def _remove_planted_link(path: str | Path) -> bool:
    """Remove a symlink found at a block's final name (fstier never writes
    one). Only the link itself, and only when its directory resolves without
    a symlink: an ELOOP from a symlinked *directory* removes nothing."""
    parent, name = split_parent(path)
    try:
        dir_fd = fsops.FS.open(parent, O_DIR_FLAGS)
    except OSError:
        return False
    try:
        if not stat.S_ISLNK(fsops.FS.stat_at(dir_fd, name).st_mode):
            return False
        fsops.FS.unlink_at(dir_fd, name)
        return True
    except OSError:
        return False
    finally:
        close_quietly(dir_fd)


def _read_vector(buf: memoryview, n: int) -> list[memoryview]:
    """[header, whole pages of ``buf[:n]``, bounce page, overflow page]
    (O_DIRECT-aligned when ``buf`` starts aligned). The bounce page takes the payload's last
    partial page and the padding, so nothing beyond ``buf[:n]`` is written;
    the overflow page makes a file longer than expected show up in the same
    ``preadv`` (no ``fstat`` on the hot path)."""
    whole = n - n % ALIGNMENT
    bufs = [_BUFS.header]
    if whole:
        bufs.append(buf[:whole])
    if n > whole:
        bufs.append(_BUFS.tail)
    bufs.append(_BUFS.over)
    return bufs


def _read_file(fd: int, bufs: list[memoryview], want: int) -> int:
    """Read until ``want`` bytes or EOF. One ``preadv`` for a file of the
    expected size: its EOF lands inside the overflow page."""
    total = 0
    while True:
        got = fsops.FS.preadv(fd, bufs, total)
        if got <= 0:
            return total  # EOF: the file is short (or shrank under us)
        total += got
        if total >= want:
            return total  # == want: exact; > want: the file is too long
        bufs = advance(bufs, got)


def _removal_failed(exc: OSError) -> None:
    log.warning("could not remove corrupt block %s: %s", exc.filename, exc.strerror or exc)


def _name(path: str) -> str:
    return path.rpartition("/")[2]


def _load_once(req: LoadRequest, buf: memoryview, direct: bool, opts: IOOptions) -> LoadOutcome:
    path = os.fspath(req.path)  # a str: Path objects cost ~8 us per op here
    n = req.payload_len
    padded = padded_len(n)
    # O_NONBLOCK: a FIFO planted at a block path would block open() forever;
    # with it the open returns and the read fails (ESPIPE). It has no effect
    # on regular files. No symlink is followed in any component.
    flags = os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC | os.O_NONBLOCK
    if direct:
        flags |= O_DIRECT
    try:
        fd = fsops.FS.open(path, flags)
    except FileNotFoundError:
        return LoadOutcome(LoadStatus.MISSING, "ENOENT")
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            # A symlink where a block or one of its directories belongs was
            # planted, never written by fstier: remove a link at the final
            # name (never its target, never through a symlinked directory).
            removed = _remove_planted_link(path)
            return LoadOutcome(
                LoadStatus.CORRUPT, "symlink", f"{_name(path)}: a symlink on its path", removed=removed
            )
        return LoadOutcome(LoadStatus.ERROR, errno_name(exc), f"open {_name(path)}: {exc.strerror}")
    want = HEADER_SIZE + padded
    try:
        bufs = _read_vector(buf, n)
        try:
            got = _read_file(fd, bufs, want)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ESTALE):
                # Removed between open and read, by another host's eviction
                # (GlusterFS fails the read ENOENT, kernel NFS ESTALE): a
                # miss, not a device error.
                return LoadOutcome(
                    LoadStatus.MISSING, errno_name(exc), f"{_name(path)} vanished while being read"
                )
            if exc.errno in (errno.EISDIR, errno.ESPIPE, errno.EINVAL, errno.ENXIO):
                # Not a regular file (a directory, FIFO, device): a bad file.
                with contextlib.suppress(OSError):
                    if not stat.S_ISREG(fsops.FS.fstat(fd).st_mode):
                        return LoadOutcome(
                            LoadStatus.ERROR, "not_regular", f"{_name(path)} is not a regular file"
                        )
            return LoadOutcome(LoadStatus.ERROR, errno_name(exc), f"read {_name(path)}: {exc.strerror}")
        try:
            if got != want:
                # Only the slow path pays for an fstat: was it ever a block?
                st = fsops.FS.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    return LoadOutcome(
                        LoadStatus.ERROR, "not_regular", f"{_name(path)} is not a regular file"
                    )
                if st.st_size != want:
                    raise BlockCorruptError("bad_size", f"file is {st.st_size} bytes, expected {want}")
                raise BlockCorruptError("short_read", f"read {got} of {want} bytes")
            h = decode_header(_BUFS.header)
            check_block(h, Expected(req.key, req.namespace_digest, n))
            whole = n - n % ALIGNMENT
            if n > whole:
                buf[whole:n] = _BUFS.tail[: n - whole]
            if opts.checksum and h.checksum_kind == ChecksumKind.XXH3_64:
                check_payload(h, payload_checksum(buf[:n]))
        except BlockCorruptError as exc:
            try:
                st = fsops.FS.fstat(fd)
            except OSError:
                return LoadOutcome(LoadStatus.CORRUPT, exc.reason, exc.detail)
            removed = (
                unlink_if_same(path, ino=st.st_ino, dev=st.st_dev, on_error=_removal_failed) == "removed"
            )
            return LoadOutcome(LoadStatus.CORRUPT, exc.reason, exc.detail, removed=removed)
        except OSError as exc:
            return LoadOutcome(LoadStatus.ERROR, errno_name(exc), f"read {_name(path)}: {exc.strerror}")
    finally:
        close_quietly(fd)
    return LoadOutcome(LoadStatus.LOADED, nbytes=n)


def load_block(req: LoadRequest, opts: IOOptions) -> LoadOutcome:
    """Load and verify one block. Never raises ``OSError``; raises
    ``ValueError`` only for a malformed request.

    Exactly ``req.payload_len`` bytes of ``req.buffer`` are written, at any
    alignment (the last partial page goes through a bounce page). O_DIRECT is
    used when the buffer's start is aligned; its bytes are garbage unless the
    outcome is LOADED."""
    buf = byte_view(req.buffer)
    n = req.payload_len
    if n < 0 or len(buf) < n:
        raise ValueError(f"LoadRequest.buffer holds {len(buf)} bytes but payload_len is {n}")
    if buf.readonly:
        raise ValueError("LoadRequest.buffer must be writable")
    whole = n - n % ALIGNMENT
    direct = opts.o_direct and is_aligned(buf[:whole], opts.alignment)
    out = _load_once(req, buf, direct, opts)
    if direct and out.status is LoadStatus.ERROR and out.cause == "EINVAL":
        out = _load_once(req, buf, False, opts)
    return out
