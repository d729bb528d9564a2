"""``fstier inspect``, ``verify`` and ``gc`` on a ROOT that never answers (a
real FUSE mount whose server hangs): each gives up after ``--deadline`` with
exit 1 and one line naming ROOT, instead of hanging in a stat on the main
thread (click's ``Path`` argument did that before ROOT was checked on a
thread of its own; fstier.cli.roots.within_deadline).

Each command runs as its own process, as an operator runs it; ``timeout=``
is the test's own limit on a command that hangs, far above the deadline.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from _hung_mount import hung_mount
from manager_support import keys, open_tier, store

COMMANDS = (
    ("inspect",),
    ("verify",),
    ("verify", "--namespace", "m-0123456789abcdef"),
    ("gc", "--max-bytes", "1GiB", "--dry-run"),
)


def _fstier(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-m", "fstier.cli", *args], capture_output=True, text=True,
                             timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"fstier {' '.join(args)} hung past 60 s on a hung ROOT (its --deadline is 2 s)")
    return out, time.monotonic() - started


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_a_hung_root_is_exit_1_within_the_deadline(tmp_path: Path, command: tuple[str, ...]) -> None:
    hung = tmp_path / "hung"
    with hung_mount(hung):
        out, took = _fstier(command[0], str(hung), *command[1:], "--deadline", "2")
    assert out.returncode == 1, out
    assert f"ROOT {str(hung)!r} did not answer within 2 s (a hung mount?)" in out.stderr, out
    assert took < 30, took


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_a_good_root_is_checked_as_before_under_the_deadline(tmp_path: Path, command: tuple[str, ...]) -> None:
    """The same commands on a root that answers: the checks still run (and
    refuse a file as ROOT with exit 2), the report is made."""
    root = tmp_path / "root"
    with open_tier(root) as tier:
        store(tier, "a", keys(0, 2))
        namespace = tier.mapper.namespace
    args = [a if a != "m-0123456789abcdef" else namespace for a in command[1:]]
    out, _ = _fstier(command[0], str(root), *args, "--deadline", "5")
    assert out.returncode == 0, out
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    out, _ = _fstier(command[0], str(a_file), *args, "--deadline", "5")
    assert out.returncode == 2 and "is a file" in out.stderr, out


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf"])
def test_a_bad_deadline_is_exit_2(tmp_path: Path, bad: str) -> None:
    out, _ = _fstier("inspect", str(tmp_path), "--deadline", bad)
    assert out.returncode == 2 and "--deadline" in out.stderr, out
