"""How many C workers a job of the C engine wakes (``ce_wake`` in
fstier/io/_native_engine.c): a buffered load wakes no more than the CPUs
at once (cached files are a copy and a hash each: CPU work), and one more
worker per read that would block, up to the job's spread in all; a store
wakes its whole spread at once. Every key still loads exactly.

Run in a child process pinned to one CPU, so the engine it makes counts one
CPU whatever the machine has (the engine reads the CPUs it may run on once,
when it is made)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fstier.io.engine.native import available

REPO = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.skipif(not available(), reason="the native extension is not built"),
    pytest.mark.skipif(os.environ.get("FSTIER_NATIVE") == "0", reason="FSTIER_NATIVE=0: the Python I/O path"),
]

CHILD = r"""
import errno, os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
os.environ["FSTIER_ENGINE"] = "native"
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from manager_support import keys, load, open_tier, store
from fstier.io import native

root = Path(sys.argv[1])
ks = keys(0, 32)
with open_tier(root, read_threads=8, write_threads=4, o_direct="off") as tier:
    engine = tier._engine.engine
    info = engine.info()
    assert info["cpus"] == 1, info
    woken = info["woken"]
    assert store(tier, "s", ks).success
    stored = engine.info()["woken"] - woken  # a store: its whole spread (32 // 4 = 8) at once
    for f in root.rglob("*.bin"):  # in the page cache and written back: a read from the cache never blocks
        f.read_bytes()
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    woken = engine.info()["woken"]
    assert load(tier, "warm", ks).success
    warm = engine.info()["woken"] - woken
    native.fault("nowait", errno.EAGAIN, times=-1)  # every page-cache-only attempt finds nothing
    woken = engine.info()["woken"]
    assert load(tier, "cold", ks).success
    cold = engine.info()["woken"] - woken
    attempts = native.fault_count("nowait")
    native.clear_faults()
    print(stored, warm, cold, attempts)
"""


def test_a_buffered_load_wakes_a_worker_per_cpu_and_more_only_as_reads_would_block(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "root"), str(REPO / "tests")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    stored, warm, cold, attempts = map(int, run.stdout.split()[-4:])
    assert stored == 8  # a store: every worker its spread allows, at once
    assert warm == 1  # cached files: one worker per CPU, no more
    # Files the page cache "lacks": each read that would block woke one more
    # worker, up to the job's spread in all (not one per read: on one busy
    # CPU the first worker's every read would), and then stopped asking.
    assert cold == 8
    assert 7 <= attempts < 32
