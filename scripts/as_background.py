#!/usr/bin/env python3
"""Run a command the way a background job starts it (``nohup cmd &``, a CI
runner, cron): SIGINT and SIGHUP ignored, inherited by everything it starts,
and stdin from /dev/null.

``make test`` runs its second pytest pass under this wrapper, so a test that
assumes a terminal's signal dispositions (its own Ctrl-C to a child that
inherited SIGINT ignored is discarded) fails in every run, not only in CI
(issue 42 item 11; tests/_signals.py is how a test sets its target's
disposition itself).

A Ctrl-C at the terminal still ends the command: the command runs in a
process group of its own, and this wrapper, which handles SIGINT, ends that
group with SIGTERM. Exit status: the command's (128 + N when signal N ended
it; 130 after a forwarded Ctrl-C).

Usage: python scripts/as_background.py CMD [ARG...]
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: as_background.py CMD [ARG...]", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the command ...
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    interrupted = []
    # Its own process group: a Ctrl-C (sent to the terminal's foreground group) reaches this wrapper
    # only. stdin from /dev/null, as nohup gives: a read from the terminal would stop a background group.
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=os.setpgrp)  # no thread here: safe

    def forward(signum: int, frame: object) -> None:
        interrupted.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)

    signal.signal(signal.SIGINT, forward)  # ... and this wrapper's Ctrl-C ends it
    rc = child.wait()
    if interrupted:
        return 130
    return 128 - rc if rc < 0 else rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
