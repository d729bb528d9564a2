"""A real hung mount for tests: a FUSE filesystem whose server never answers
(what an NFS or FUSE mount whose server hangs looks like to a reader).
Used by the tests of every command that must give up on ROOT within its
--deadline (tests/test_status.py, tests/test_cli_hung_root.py)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["hung_mount"]


@contextlib.contextmanager
def hung_mount(path: Path) -> Iterator[None]:
    """A FUSE filesystem mounted at ``path`` whose server never answers:
    every stat or listing under it blocks, as on an NFS or FUSE mount whose
    server hangs. Closing the server's fd aborts it (the blocked calls fail
    with ENOTCONN); then it is unmounted."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("a hung FUSE mount needs root and /dev/fuse")
    path.mkdir(parents=True, exist_ok=True)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open("/dev/fuse", os.O_RDWR)
    opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0".encode()
    if libc.mount(b"fstier-test-hung", str(path).encode(), b"fuse", 0, opts) != 0:
        os.close(fd)
        pytest.skip(f"cannot mount FUSE here: {os.strerror(ctypes.get_errno())}")
    try:
        yield
    finally:
        os.close(fd)
        subprocess.run(["umount", "-l", str(path)], check=False)
