"""benchmarks/bench_lmcache_stores.py runs on LMCache's real classes: store
tasks of fstier's adapter and ``fs_native`` alternated in one process, each
adapter's last task loaded back and compared byte for byte, its roots
removed. A tiny run keeps it from rotting (its figures are in
docs/performance.md, never checked here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# test_lmcache_adapter skips this module without LMCache (and fails it with
# FSTIER_REQUIRE_LMCACHE=1) before anything of LMCache is imported here.
import test_lmcache_adapter  # noqa: F401

REPO = Path(__file__).resolve().parents[2]


def test_the_stores_benchmark_alternates_adapters_and_checks_bytes(tmp_path: Path) -> None:
    env = {**os.environ, "DO_NOT_TRACK": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_lmcache_stores.py"),
         "--sizes-kib", "64", "--keys", "4", "--tasks", "3", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    rows = {line.split("|")[2].strip(): line for line in run.stdout.splitlines() if line.startswith("| 64 KiB |")}
    assert set(rows) == {"fstier", "fs_native"}, run.stdout
    assert rows["fstier"].rstrip().endswith("x | 0 |"), rows  # a ratio to fs_native, no bad load
    assert rows["fs_native"].rstrip().endswith("|  | 0 |"), rows
    assert "3 tasks per adapter, alternated" in run.stdout
    assert not list(tmp_path.iterdir())  # its roots are removed
