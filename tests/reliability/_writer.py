"""Writer subprocess of the crash tests (run as a script, never imported by pytest).

``_writer.py point ROOT KILL_POINT INDEX``
    Store ``key_for(INDEX)`` under ROOT through a wrapped ``fsops.FS`` that
    SIGKILLs this very process at KILL_POINT: ``after_write`` (the data is in
    the temp file), ``before_rename`` (fsync done, the link or rename that
    publishes it not yet issued) or ``after_rename`` (published, not yet
    acknowledged). No production hook is
    involved: the kill rides on the fault-injection seam.

``_writer.py zygote ROOT``
    Import everything once, then serve commands on stdin so the kill loop
    pays no interpreter start per kill:
    ``fork ACK_FILE SALT`` forks a writer child (replies ``pid N``) that
    stores ``key_for(0, SALT)``, ``key_for(1, SALT)``... and after each store
    returns STORED/SKIPPED appends ``i`` to ACK_FILE and fsyncs it, forever;
    ``reap PID`` waits for it and replies ``signal S`` or ``exit C``.
    A store that FAILS makes the child write ``FAILED ...`` to ACK_FILE and
    exit 3, which the parent reports as a test failure.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import _support  # the script's directory is on sys.path

from fstier.io import fsops


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def run_point(root: str, point: str, index: int) -> None:
    tier = _support.Tier.open(root, fsync="file")
    ops = _support.FaultyOps()

    def pwritev(real: Any, fd: int, bufs: Any, offset: int) -> int:
        n = real(fd, bufs, offset)
        if point == "after_write" and offset + n >= _support.header_size_file(tier.payload_len):
            _kill_self()
        return n

    # Publication is a linkat of an O_TMPFILE inode, or a renameat of a named
    # temp where the filesystem has no O_TMPFILE: both are "the rename".
    def publish(real: Any, *args: Any) -> None:
        if point == "before_rename":
            _kill_self()
        real(*args)
        if point == "after_rename":
            _kill_self()

    ops.hooks.update(pwritev=pwritev, link_at=publish, replace_at=publish)
    if os.environ.get("FSTIER_TEST_NAMED_TEMPS") == "1":
        tier.opts.capabilities.refuse_tmpfile()  # type: ignore[union-attr]
    fsops.FS = ops
    out = tier.store(_support.key_for(index))
    # Reaching this line means the kill point was never hit: the parent fails.
    print(f"NOT KILLED: {out}", flush=True)
    sys.exit(4)


def _writer_child(tier: _support.Tier, ack_file: str, salt: str) -> None:
    fd = os.open(ack_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    i = 0
    while True:
        out = tier.store(_support.key_for(i, salt))
        if not out.ok:
            os.write(fd, f"FAILED {i} {out.cause} {out.detail}\n".encode())
            os.fsync(fd)
            os._exit(3)
        os.write(fd, f"{i}\n".encode())
        os.fsync(fd)
        i += 1


def run_zygote(root: str) -> None:
    # Built once (manifest written) so a child starts storing at once; fsync
    # per file so kills land mid-store as often as between stores.
    tier = _support.Tier.open(root, fsync="file")
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "fork":
            pid = os.fork()
            if pid == 0:
                try:
                    _writer_child(tier, args[0], args[1])
                finally:
                    os._exit(5)
            print(f"pid {pid}", flush=True)
        elif cmd == "reap":
            _, status = os.waitpid(int(args[0]), 0)
            if os.WIFSIGNALED(status):
                print(f"signal {os.WTERMSIG(status)}", flush=True)
            else:
                print(f"exit {os.WEXITSTATUS(status)}", flush=True)
        elif cmd == "quit":
            return


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "point":
        run_point(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif mode == "zygote":
        run_zygote(sys.argv[2])
    else:
        sys.exit(f"unknown mode {mode!r}")
