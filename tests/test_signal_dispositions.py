"""Tests run the same from a terminal and from a background job (issue 42
item 11): ``scripts/as_background.py`` gives a command what ``nohup cmd &``,
a CI runner or cron gives it (SIGINT and SIGHUP ignored) and ``make test``
runs its second pass under it; ``tests/_signals.py`` starts a child that a
test signals with a terminal's dispositions, whatever the suite inherited."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from _signals import TERMINAL_SIGNALS, as_from_a_terminal

REPO = Path(__file__).resolve().parents[1]
BACKGROUND = [sys.executable, str(REPO / "scripts" / "as_background.py")]

#: Prints which of the terminal signals this process ignores, then exits with argv[1].
_IGNORED = (
    "import signal, sys\n"
    "mask = int(next(ln for ln in open('/proc/self/status') if ln.startswith('SigIgn:')).split()[1], 16)\n"
    f"print(sorted(n for n in {TERMINAL_SIGNALS!r} if mask >> (getattr(signal, n) - 1) & 1))\n"
    "sys.exit(int(sys.argv[1]))\n"
)


def test_as_background_ignores_sigint_and_sighup_and_passes_the_exit_status_on() -> None:
    """What ``nohup cmd &`` gives a command: SIGINT and SIGHUP ignored, stdin from /dev/null."""
    for code in (0, 3):
        done = subprocess.run([*BACKGROUND, sys.executable, "-c", _IGNORED, str(code)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == code, done.stderr
        assert done.stdout.strip() == "['SIGHUP', 'SIGINT']", done.stdout
    stdin = subprocess.run([*BACKGROUND, sys.executable, "-c", "import os; print(os.readlink('/proc/self/fd/0'))"],
                           capture_output=True, text=True, timeout=60)
    assert stdin.stdout.strip() == "/dev/null", stdin.stdout + stdin.stderr  # as nohup gives
    killed = subprocess.run([*BACKGROUND, sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"],
                            capture_output=True, text=True, timeout=60)
    assert killed.returncode == 128 + signal.SIGKILL, killed.stderr


def test_a_ctrl_c_still_ends_a_command_run_as_a_background_job() -> None:
    """The command ignores SIGINT, yet a Ctrl-C to the wrapper (the terminal's
    foreground group) ends it and all it started: exit 130 at once."""
    script = "import subprocess, time\nprint(subprocess.Popen(['sleep', '300']).pid, flush=True)\ntime.sleep(300)"
    proc = subprocess.Popen([*BACKGROUND, sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 130
    assert time.monotonic() - t0 < 30
    while _alive(grandchild) and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    assert not _alive(grandchild), "what the command started outlived the Ctrl-C"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return not re.search(r"^State:\s+[ZX]", state, re.M)


def test_a_child_started_as_from_a_terminal_has_default_dispositions() -> None:
    """From a parent that ignores every terminal signal (what a background
    job hands down), the child sees none ignored, and a Python child's own
    Ctrl-C raises KeyboardInterrupt (the test_demo forkserver cases lost it)."""
    cmd = [*BACKGROUND, *as_from_a_terminal([sys.executable, "-c", _IGNORED, "0"])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
    ctrl_c = (
        "import os, signal\ntry:\n    os.kill(os.getpid(), signal.SIGINT)\n"
        "except KeyboardInterrupt:\n    print('ok')"
    )
    done = subprocess.run([*BACKGROUND, *as_from_a_terminal([sys.executable, "-c", ctrl_c])],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_make_test_runs_one_pass_as_a_background_job() -> None:
    """The guard that keeps the class from coming back: every `make test`
    runs the suite once with SIGINT and SIGHUP ignored."""
    make = (REPO / "Makefile").read_text()
    recipe = re.search(r"^test:.*?\n((?:\t.*\n)+)", make, re.M)
    assert recipe is not None, "no test target in the Makefile"
    assert "scripts/as_background.py" in recipe.group(1) and "$$bg $(BIN)/python -m pytest" in recipe.group(1)
