"""Behavioural claims of the docs, held by tests (issue 43): where a page or a docstring says how the code behaves
and a test can check it, the test is here (or names the test that does).

* which timers read a :class:`~fstier.clock.Clock` and which read the system clock (fstier/clock.py, the module
  table of docs/architecture.md); that the ones said to read it move with a ``ManualClock`` is held where each
  is tested: the engine's watchdog and the breaker in tests/test_clock.py, the write budget and the breaker in
  tests/test_manager_faults.py, the recency flush in tests/test_manager.py, the eviction lease in
  tests/test_capacity.py;
* that a job whose units expired unrun is not a success (fstier/tier/outcomes.py; it was the thread pool's
  ``PoolJob.ok`` before the job engine), and the cause an op that expired unrun is reported with (fstier/io/aio.py).
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
from manager_support import keys, open_tier, store

from fstier.io.aio import _failure_cause
from fstier.io.engine import EXPIRED
from fstier.io.fsops import FS

REPO = Path(__file__).resolve().parents[1]
TIER = [REPO / "fstier" / "manager.py", *sorted((REPO / "fstier" / "tier").glob("*.py")),
        *sorted((REPO / "fstier" / "io").rglob("*.py"))]

#: The tier's modules that read the system clock directly (not the Clock handed to them), and for what. Both
#: fstier/clock.py and docs/architecture.md say this list in words; a new direct read fails here: read the Clock,
#: or add the module here and to both.
SYSTEM_CLOCK_READERS = {
    "fstier/tier/lookup.py": "the lookup cache's answer lifetime; lookup seconds",
    "fstier/tier/outcomes.py": "the lookup cache's answer lifetime (answers a finished job leaves)",
    "fstier/tier/capacity.py": "the capacity resync interval and the waits for an eviction pass",
    "fstier/io/engine/python.py": "a job's seconds; shutdown's deadline",
    "fstier/io/engine/native.py": (
        "a job's seconds, the headers' creation stamp, a call job's deadline (the C watchdog keeps its own clock)"
    ),
    "fstier/io/engine/touch.py": "a touch job's seconds (its deadline is the C watchdog's)",
    "fstier/tier/status.py": "`fstier status`: the report's wall-clock time (ages of counts) and its walk's seconds",
    "fstier/manager.py": "drain's deadline",
    "fstier/tier/waiting.py": "FsTier.wait's deadline",
    "fstier/tier/gc.py": "gc's seconds and how often a walk asks whether to stop",
    "fstier/tier/verify.py": "verify's seconds",
    "fstier/io/native.py": "the wall-clock creation stamp of a block header",
    "fstier/tier/lease.py": "the wall-clock mtime a lease file is stamped with (other hosts compare it)",
}
_CLOCK_CALLS = {"monotonic", "monotonic_ns", "time", "time_ns", "perf_counter", "perf_counter_ns"}


def _reads_system_clock(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "time"
                and node.func.attr in _CLOCK_CALLS):
            return True
    return False


def test_the_timers_that_bypass_the_clock_are_the_documented_ones() -> None:
    readers = {p.relative_to(REPO).as_posix() for p in TIER if _reads_system_clock(p)}
    assert readers == set(SYSTEM_CLOCK_READERS), (
        f"read the Clock instead, or document: new {sorted(readers - set(SYSTEM_CLOCK_READERS))}, "
        f"gone {sorted(set(SYSTEM_CLOCK_READERS) - readers)}"
    )
    clock_doc = (REPO / "fstier" / "clock.py").read_text()
    arch = (REPO / "docs" / "architecture.md").read_text()
    claims = ("lookup cache's answer lifetime", "capacity resync", "O_DIRECT re-probe", "durations reported",
              "wall-clock stamps")
    for words in claims:
        assert words in " ".join(clock_doc.split()) and words in arch, words


def test_a_job_with_units_that_expired_unrun_is_not_a_success(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job whose queued units expired behind hung calls did not do its work (issue 43: the pool's
    ``PoolJob.ok`` once read True for it): its result is a failure, ``timeout``, no key loaded."""
    release = threading.Event()
    with open_tier(tmp_path / "root", native_io="off", io_timeout_s=0.5, read_threads=1, write_threads=1) as t:
        ks = keys(0, 4)
        assert store(t, "s", ks).success
        real = FS.preadv

        def hang(fd, bufs, off):  # type: ignore[no-untyped-def]
            release.wait(20)
            return real(fd, bufs, off)

        monkeypatch.setattr(FS, "preadv", hang)
        try:
            t.submit_load("hung", ks, [8, 9, 10, 11])  # 2 threads: 2 units hang, 2 expire unrun
            r = t.wait("hung", 20)
        finally:
            release.set()
        assert r is not None and not r.success and r.keys_completed == 0 and r.cause == "timeout", r


def test_an_expired_op_is_reported_as_a_timeout_not_as_a_marker_class() -> None:
    """aio reported an expired op's cause as ``"_Marker"`` (the sentinel's class name)."""
    cause, detail = _failure_cause(EXPIRED)
    assert cause == "ETIMEDOUT" and "never ran" in detail
