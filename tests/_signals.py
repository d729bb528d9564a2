"""Signal dispositions of the children a test signals (issue 42 item 11).

A test that delivers a signal sets its target's disposition itself: a
background job (``nohup make test &``, a CI runner, cron) runs the suite
with SIGINT and SIGHUP *ignored*, every child inherits that, and Python (like
most programs) keeps an inherited ``SIG_IGN``: a test's Ctrl-C was then
discarded (test_demo's forkserver tests failed "lost after spawn 2"), or an
``lmcache server`` stopped with SIGINT waited for its SIGKILL fallback.
``make test`` runs its second pass under ``scripts/as_background.py`` so a
test that assumes a terminal's dispositions fails in every run.

Cost: :func:`as_from_a_terminal` adds one interpreter start (tens of ms)
before the command's ``exec``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["AS_FROM_A_TERMINAL", "TERMINAL_SIGNALS", "as_from_a_terminal"]

#: The signals a terminal leaves at their default and a background job may ignore.
TERMINAL_SIGNALS = ("SIGINT", "SIGHUP", "SIGTERM")

_RESET = (
    "import os, signal, sys\n"
    f"for name in {TERMINAL_SIGNALS!r}:\n"
    "    signal.signal(getattr(signal, name), signal.SIG_DFL)\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n"
)


def as_from_a_terminal(cmd: Sequence[str]) -> list[str]:
    """``cmd`` run the way a terminal starts it: SIGINT, SIGHUP and SIGTERM at
    their default dispositions (a Python target then raises
    ``KeyboardInterrupt`` on SIGINT), whatever this process inherited."""
    return [sys.executable, "-c", _RESET, *cmd]


#: A prefix for a Python child: ``[*AS_FROM_A_TERMINAL, "-c", script, ...]``.
AS_FROM_A_TERMINAL = tuple(as_from_a_terminal([sys.executable]))
