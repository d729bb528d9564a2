"""The eviction lease of a root: one instance (on any host) runs a capacity
pass at a time.

The lease is ``<root>/.fstier-usage.d/evict.lease``
(:class:`~fstier.tier.usage.SharedUsage` holds the directory and calls in
here with its fd):

- **Taken** by creating it with ``O_EXCL``: one winner, on every filesystem
  tried, also across hosts (0 double wins in 20 races between two GlusterFS
  or MooseFS clients). Never by renaming over it: a renamed-over lease was
  read 1.0 s stale through another GlusterFS client, and two hosts took it
  within 0.2 s of each other.
- **Renewed** by its holder bumping the file's mtime through the fd it
  created it with (``futimens``: never through a name someone replaced), to
  a new value each time even from a clock that stands still or steps back.
- **Given back** by removing it; :class:`~fstier.tier.usage.SharedUsage`
  first publishes the holder's count, so the next holder's scan sees every
  removal made under this one.
- **Expiry is judged by each reader's own monotonic observation**, never by
  anything written in the file or by the holder's clock: a lease whose
  (device, inode, mtime, size) has not changed for ``LEASE_S`` of the
  reader's clock belongs to a dead or hung holder and is taken over (a lease
  of fstier < 0.6 claiming an expiry a year ahead was never taken over). A
  lease that is not one fstier writes (not a regular file, a hard link,
  larger than 256 bytes, foreign content) or one fstier < 0.6 gave back is
  taken at once.
- **Taking over or giving back never removes another's lease**: the file is
  renamed aside first and, when it is not the one judged (someone created a
  new lease meanwhile), linked back.
- A holder that finds the name no longer its file (taken over while it
  hung) drops it; its pass stops.

Costs: a ``stat`` per attempt, one create, a ``futimens`` per renewal (every
``RENEW_S`` while a pass runs), a rename and an unlink to give it back.
Nothing blocks on a lock another process holds.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import time
from collections.abc import Callable

__all__ = ["LEASE_NAME", "LEASE_S", "RENEW_S", "EvictionLease"]

LEASE_NAME = "evict.lease"
#: A lease unchanged for this long (the reader's time) belongs to a dead or hung holder.
LEASE_S = 30.0
#: A holder renews its lease this often while a pass runs.
RENEW_S = 5.0
_MAX_FILE = 256
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class EvictionLease:
    """This instance's side of the root's lease: every method takes the
    usage directory's fd (the caller serialises calls)."""

    def __init__(
        self,
        instance: str,
        file_mode: int,
        clock: Callable[[], float],
        warn: Callable[[str, str], None],
    ) -> None:
        self.instance = instance
        self._mode = file_mode
        self._clock = clock
        self._warn = warn  # warn(key, message): once per key
        self._fd: int | None = None
        self._id: tuple[int, int] | None = None
        self._renewed = 0.0
        self._mtime_ns = 0
        #: another holder's lease as last observed: (dev, ino, mtime, size) and since when
        self._seen: tuple[tuple[int, int, int, int], float] | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def renewal_due(self) -> bool:
        return self._fd is not None and self._clock() - self._renewed >= RENEW_S

    def drop(self) -> None:
        """Forget the lease without touching the directory (it is gone)."""
        fd, self._fd, self._id = self._fd, None, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _is_ours(self, dfd: int) -> bool:
        try:
            st = os.stat(LEASE_NAME, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._id

    def _renew(self) -> None:
        if self._fd is None:  # not holding the lease: nothing to renew
            return
        self._mtime_ns = max(time.time_ns(), self._mtime_ns + 1_000_000)
        with contextlib.suppress(OSError):
            os.utime(self._fd, ns=(self._mtime_ns, self._mtime_ns))
        self._renewed = self._clock()

    def _create(self, dfd: int) -> bool:
        try:
            fd = os.open(LEASE_NAME, _CREATE_FLAGS, self._mode, dir_fd=dfd)
        except FileExistsError:
            return False
        except OSError as exc:
            self._warn(f"lease:{exc.errno}", f"fstier: cannot take the eviction lease ({exc}); evicting without it")
            return True  # the behaviour before the lease existed
        st = os.fstat(fd)
        self._fd, self._id = fd, (st.st_dev, st.st_ino)
        self._seen = None
        with contextlib.suppress(OSError):
            os.write(fd, f"fstier-lease 2 {self.instance}\n".encode())
        self._renew()
        return True

    def _remove_if(self, dfd: int, ident: tuple[int, int]) -> None:
        """Remove the lease only while it is the file ``ident`` (dev, ino)."""
        aside = f".{LEASE_NAME}.old.{self.instance}.{secrets.token_hex(4)}"
        try:
            os.rename(LEASE_NAME, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError:
            return  # gone already (its holder gave it back, or another taker won)
        try:
            st = os.stat(aside, dir_fd=dfd, follow_symlinks=False)
            if (st.st_dev, st.st_ino) != ident:
                with contextlib.suppress(OSError):
                    os.link(aside, LEASE_NAME, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            os.unlink(aside, dir_fd=dfd)

    def _expired(self, dfd: int, st: os.stat_result) -> bool:
        """Whether another instance's lease ``st`` may be taken over now."""
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size > _MAX_FILE:
            return True
        if st.st_size:
            text = ""
            with contextlib.suppress(OSError):
                fd = os.open(LEASE_NAME, _READ_FLAGS, dir_fd=dfd)
                try:
                    text = os.read(fd, _MAX_FILE).decode("ascii", "replace")
                finally:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            parts = text.split()
            if text and (not parts or parts[0] != "fstier-lease"):
                return True  # foreign content: not a lease
            if parts[:2] == ["fstier-lease", "1"] and parts[-1:] == ["0"]:
                return True  # fstier < 0.6 gave it back
        sig = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        now = self._clock()
        if self._seen is None or self._seen[0] != sig:
            self._seen = (sig, now)  # renewed (or new) since we last looked
            return False
        return now - self._seen[1] >= LEASE_S

    def take(self, dfd: int) -> bool:
        """Take or renew the lease; False while another live instance holds
        it (or took it over from this one)."""
        if self._fd is not None:
            if not self._is_ours(dfd):
                self.drop()
                return False  # taken over: this holder was judged dead
            self._renew()
            return True
        try:
            st = os.stat(LEASE_NAME, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return self._create(dfd)
        except OSError:
            return False
        if not self._expired(dfd, st):
            return False
        self._seen = None
        self._remove_if(dfd, (st.st_dev, st.st_ino))
        return self._create(dfd)

    def give_back(self, dfd: int | None) -> None:
        ident = self._id
        self.drop()
        if dfd is not None and ident is not None:
            self._remove_if(dfd, ident)
