"""Shared, aligned host memory: the slots that files and device copies meet in.

:class:`HostBlockPool` is ``num_slots`` 4096-aligned slots in one named POSIX
shared-memory segment (``/dev/shm/fstier-<pid>-<token>``), prefaulted at
creation because first touch is slow on these machines. The creating
process (the scheduler side, which owns ``FsTier``) allocates and frees
slots; rank processes :meth:`HostBlockPool.attach` by name and only read
and write slot bytes. A 4096-byte header in front of the slots records the
geometry so attach needs nothing but the name.

This module imports neither torch nor numpy: :class:`~fstier.manager.FsTier`
moves bytes between files and slots through :meth:`HostBlockPool.slot_view`.
The staging side (:class:`fstier.layout.PoolTensors`) views the same
memory as tensors and pins it with ``cudaHostRegister`` in the process that
stages; it hooks :meth:`HostBlockPool.on_close` to unpin before the mapping
goes (tests/test_torch_free.py pins that this module loads no torch).

Crash reclamation: a segment whose creator was killed (SIGKILL, the OOM
killer) keeps its ``/dev/shm`` entry, and a crash-looping engine would fill
``/dev/shm`` and then the node's memory. The creator holds a shared ``flock``
on its segment for the pool's life (the kernel drops it when the process dies,
however it dies); every new pool first runs
:meth:`HostBlockPool.reclaim_stale`, which unlinks each ``fstier-<pid>-*``
segment whose ``pid`` is not a live process here AND nobody holds that lock
on (a creator in another pid namespace sharing ``/dev/shm`` is invisible to
``kill(pid, 0)`` but holds its lock; a live pid keeps its segment, whatever
wrote it). Cost: one ``listdir`` of ``/dev/shm`` and one open + flock
per fstier segment, at pool creation only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import stat
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import add, mul

from fstier.errors import PoolError, PoolExhaustedError
from fstier.slots.provider import plain_indices

__all__ = ["ALIGN", "HostBlockPool"]

ALIGN = 4096
_SHM_DIR = "/dev/shm"
_PREFIX = "fstier-"
_MAGIC = b"FSTIERPOOL1\0"
_HEADER = struct.Struct("<12sQQQ")  # magic, num_slots, slot_bytes, creator pid
#: Bytes zeroed per step of the prefault (one reused buffer).
_PREFAULT_CHUNK = 1 << 20


def _round_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def _shm_free_bytes() -> int:
    try:
        st = os.statvfs(_SHM_DIR)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def _unlink_quiet(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _release(path: str, fd: int) -> None:
    """The creator's end of a segment: unlink the name, then drop the lock."""
    _unlink_quiet(path)
    with contextlib.suppress(OSError):
        os.close(fd)


def _create_locked(path: str, name: str) -> int:
    """Create the segment and take the creator's shared lock on it. A sweeper
    in another process may have found the new, not yet locked file and
    unlinked it (it holds an exclusive lock while it does): then the name no
    longer names our inode and creation fails loudly rather than handing
    out a segment no rank could attach to."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise PoolError(f"HostBlockPool: shared memory {name!r} already exists; pick another name") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
            raise FileNotFoundError(errno.ENOENT, "removed while being created", path)
    except OSError as exc:
        os.close(fd)
        raise PoolError(
            f"HostBlockPool: shared memory {name!r} was removed while being created ({exc}); retry"
        ) from None
    return fd


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0  # another user's live process (or a name that is no pid)
    return True


def _reclaim(name: str) -> bool:
    """Unlink ``/dev/shm/<name>`` if no process holds a lock on it (its
    creator died). Never follows a symlink, never blocks, never raises."""
    path = os.path.join(_SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # gone, another user's, or a symlink: not ours to judge
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while the creator lives
        if os.stat(path, follow_symlinks=False).st_ino != st.st_ino:
            return False
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class HostBlockPool:
    """Shared, aligned, prefaulted host slots. See the module docstring."""

    def __init__(self, num_slots: int, slot_bytes: int, name: str | None = None) -> None:
        if num_slots < 1:
            raise PoolError(f"HostBlockPool: num_slots must be >= 1, got {num_slots}")
        if slot_bytes < 1:
            raise PoolError(f"HostBlockPool: slot_bytes must be >= 1, got {slot_bytes}")
        slot_bytes = _round_up(slot_bytes)
        HostBlockPool.reclaim_stale()
        name = name or f"{_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        _check_name(name)
        path = os.path.join(_SHM_DIR, name)
        size = ALIGN + num_slots * slot_bytes
        fd = _create_locked(path, name)
        try:
            os.ftruncate(fd, size)
            # Reserve the pages now: ftruncate alone makes a sparse tmpfs file,
            # and prefaulting it on a too-small /dev/shm (Docker's default is
            # 64 MiB) would kill the process with SIGBUS instead of an error.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            _unlink_quiet(path)
            free = _shm_free_bytes()
            raise PoolError(
                f"HostBlockPool: cannot create {size} bytes of shared memory {name!r} in "
                f"{_SHM_DIR} ({exc.strerror or exc}; {free} bytes free there); raise the "
                f"shared-memory size (e.g. docker --shm-size) or use fewer/smaller slots"
            ) from exc
        except BaseException:  # Ctrl-C during the reservation: no segment may outlive us
            os.close(fd)
            _unlink_quiet(path)
            raise
        #: held open (with its shared flock) until close(): the "creator alive" mark
        self._lock_fd: int | None = fd
        try:
            mm[: _HEADER.size] = _HEADER.pack(_MAGIC, num_slots, slot_bytes, os.getpid())
            self._setup(name, mm, num_slots, slot_bytes, owner=True)
            # Prefault: writing every page now keeps first-touch faults off the hot path.
            zeros = bytes(_PREFAULT_CHUNK)
            for off in range(ALIGN, size, _PREFAULT_CHUNK):
                end = min(size, off + _PREFAULT_CHUNK)
                mm[off:end] = zeros[: end - off]
        except BaseException:  # a Ctrl-C during the (slow) prefault included
            self._lock_fd = None
            os.close(fd)
            _unlink_quiet(path)
            raise
        self._free = list(range(num_slots - 1, -1, -1))
        self._allocated: set[int] = set()
        #: slots a timed-out I/O call may still write; kept off the free list
        self._fenced: set[int] = set()
        #: fenced slots the engine already freed: they return on unfence()
        self._freed_fenced: set[int] = set()
        self._finalizer: weakref.finalize[[str, int], HostBlockPool] | None = weakref.finalize(
            self, _release, path, fd
        )

    @classmethod
    def attach(cls, name: str) -> HostBlockPool:
        """Attach to a pool created by another process (no allocation rights)."""
        _check_name(name)
        path = os.path.join(_SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise PoolError(f"HostBlockPool.attach: no shared memory named {name!r} (was the pool closed?)") from None
        try:
            size = os.fstat(fd).st_size
            if size < ALIGN:
                raise PoolError(f"HostBlockPool.attach: {name!r} is not an fstier pool ({size} bytes)")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, num_slots, slot_bytes, _pid = _HEADER.unpack(mm[: _HEADER.size])
        if magic != _MAGIC or ALIGN + num_slots * slot_bytes != size:
            mm.close()
            raise PoolError(f"HostBlockPool.attach: {name!r} is not an fstier pool (bad header)")
        self = cls.__new__(cls)
        self._setup(name, mm, int(num_slots), int(slot_bytes), owner=False)
        # Map the pages into this process now (reads only, the data stays):
        # one byte of every page.
        with memoryview(mm) as whole:
            bytes(whole[ALIGN::ALIGN])
        self._free = []
        self._allocated = set()
        self._fenced = set()
        self._freed_fenced = set()
        self._finalizer = None
        self._lock_fd = None
        return self

    def _setup(self, name: str, mm: mmap.mmap, num_slots: int, slot_bytes: int, owner: bool) -> None:
        self.name = name
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.owner = owner
        self._mm: mmap.mmap | None = mm
        self._lock = threading.Lock()
        self._on_close: list[Callable[[], None]] = []

    # -- slots ------------------------------------------------------------
    def alloc(self, n: int = 1) -> list[int]:
        """Take ``n`` free slots (all or none)."""
        self._check_owner("alloc")
        with self._lock:
            if n > len(self._free):
                raise PoolExhaustedError(
                    f"HostBlockPool {self.name!r}: asked for {n} slot(s), {len(self._free)} of "
                    f"{self.num_slots} free; free finished jobs' slots or create a larger pool"
                )
            slots = [self._free.pop() for _ in range(n)]
            self._allocated.update(slots)
            return slots

    def free(self, slots: Sequence[int]) -> None:
        """Return slots; double free and unknown slots are errors (nothing is freed then)."""
        self._check_owner("free")
        with self._lock:
            seen: set[int] = set()
            for s in slots:
                if not 0 <= s < self.num_slots:
                    raise PoolError(f"HostBlockPool {self.name!r}: unknown slot {s} (pool has {self.num_slots})")
                if s not in self._allocated or s in seen:
                    raise PoolError(f"HostBlockPool {self.name!r}: double free of slot {s}")
                seen.add(s)
            self._allocated.difference_update(seen)
            held = seen & self._fenced
            self._freed_fenced.update(held)
            self._free.extend(seen - held)

    # -- the SlotProvider contract (fstier.slots) ---------------------------
    def check_slots(self, slots: Sequence[int]) -> None:
        """Raise ``ValueError`` naming the first slot a job must not use: out
        of range, or (in the creating process) not currently allocated."""
        with self._lock:
            if plain_indices(slots, self.num_slots) and (not self.owner or self._allocated.issuperset(slots)):
                return  # no per-slot Python (test_checks_fast.py)
            for s in slots:
                if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < self.num_slots:
                    raise ValueError(
                        f"HostBlockPool {self.name!r}: slot {s!r} is not a slot index in "
                        f"0..{self.num_slots - 1}"
                    )
                if self.owner and s not in self._allocated:
                    raise ValueError(
                        f"HostBlockPool {self.name!r}: slot {s} is not allocated; take slots "
                        "with alloc() and pass only slots you hold"
                    )

    def check_plain(self, slots: Sequence[int]) -> None:
        """:meth:`check_slots` of ``slots`` its caller found plain slot indices in range (FsTier's common
        job): only whether they are allocated is left (one C-level ``issuperset``, atomic under the GIL);
        a slot that is not: :meth:`check_slots` names it."""
        if self.owner and not self._allocated.issuperset(slots):
            self.check_slots(slots)

    def fence(self, i: int) -> None:
        """Keep slot ``i`` from being handed out again until :meth:`unfence`
        (a timed-out I/O call may still write it)."""
        self._check_slot(i)
        with self._lock:
            self._fenced.add(i)

    def unfence(self, i: int) -> None:
        """The late call on slot ``i`` returned; a freed slot becomes free again."""
        self._check_slot(i)
        with self._lock:
            self._fenced.discard(i)
            if i in self._freed_fenced:
                self._freed_fenced.discard(i)
                self._free.append(i)

    @property
    def fenced(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._fenced)

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def slot_view(self, i: int) -> memoryview:
        """Writable, 4096-aligned ``slot_bytes`` view of slot ``i``."""
        self._check_slot(i)
        mm = self._live()
        start = ALIGN + i * self.slot_bytes
        return memoryview(mm)[start : start + self.slot_bytes]

    def slot_views(self, slots: Sequence[int]) -> list[memoryview]:
        """:meth:`slot_view` of each of ``slots``: slots in range are sliced
        from one view of the mapping by C-level loops (no bytecode per
        slot), anything else slot by slot (its own refusal)."""
        if not plain_indices(slots, self.num_slots):
            return list(map(self.slot_view, slots))
        whole, size = memoryview(self._live()), self.slot_bytes
        starts = list(map(add, map(mul, slots, repeat(size)), repeat(ALIGN)))
        return list(map(whole.__getitem__, map(slice, starts, map(add, starts, repeat(size)))))

    @property
    def buffer(self) -> memoryview:
        """Writable view of all slots, ``num_slots * slot_bytes`` bytes, slot
        ``i`` at ``i * slot_bytes`` (4096-aligned): what the staging side
        views as tensors. Keeps the mapping alive while it lives."""
        mm = self._live()
        return memoryview(mm)[ALIGN : ALIGN + self.num_slots * self.slot_bytes]

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when :meth:`close` runs, before the mapping is
        released (the staging side unpins the memory and drops its views)."""
        self._live()
        self._on_close.append(callback)

    def close(self) -> None:
        """Release this process's mapping; the creator also unlinks the segment. Idempotent."""
        mm, self._mm = self._mm, None
        if mm is None:
            return
        callbacks, self._on_close = self._on_close, []
        for cb in callbacks:
            cb()
        if self.owner and self._finalizer is not None:
            self._finalizer()  # unlink now (the name is gone for new attachers), drop the lock
            self._lock_fd = None
        # Views handed out (slot_view, buffer, tensors over them) keep the
        # mapping alive until they are dropped; mmap refuses to close under
        # them, which is safe.
        with contextlib.suppress(BufferError):
            mm.close()

    def __enter__(self) -> HostBlockPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def reclaim_stale() -> list[str]:
        """Unlink fstier segments (``fstier-<pid>-*``) whose creator is gone:
        nobody holds the creator's shared ``flock`` on them. Runs at every
        pool creation; never raises. Returns the names removed."""
        removed: list[str] = []
        try:
            names = os.listdir(_SHM_DIR)
        except OSError:
            return removed
        for n in names:
            pid = n[len(_PREFIX) :].split("-", 1)[0]
            if n.startswith(_PREFIX) and pid.isdigit() and not _pid_alive(int(pid)) and _reclaim(n):
                removed.append(n)
        return removed

    def _check_owner(self, what: str) -> None:
        self._live()
        if not self.owner:
            raise PoolError(
                f"HostBlockPool {self.name!r}: {what} is reserved to the creating process; "
                "attached processes only read and write the slots they are given"
            )

    def _check_slot(self, i: int) -> None:
        if not 0 <= i < self.num_slots:
            raise PoolError(f"HostBlockPool {self.name!r}: unknown slot {i} (pool has {self.num_slots})")

    def _live(self) -> mmap.mmap:
        if self._mm is None:
            raise PoolError(f"HostBlockPool {self.name!r} is closed")
        return self._mm


def _check_name(name: str) -> None:
    if not name or "/" in name or "\x00" in name or name in (".", "..") or len(name) > 200:
        raise PoolError(f"HostBlockPool: invalid shared memory name {name!r}; use letters, digits, '-', '_'")
