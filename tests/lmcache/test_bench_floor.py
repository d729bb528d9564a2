"""benchmarks/bench_lmcache_floor.py runs on LMCache's real classes: it
captures the adapter's own native load call, replays it as the floor, and
fails on a wrong byte. A tiny run keeps it from rotting (its figures are in
docs/lmcache.md, never checked here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# test_lmcache_adapter skips this module without LMCache (and fails it with
# FSTIER_REQUIRE_LMCACHE=1) before anything of LMCache is imported here.
import test_lmcache_adapter  # noqa: F401

REPO = Path(__file__).resolve().parents[2]


def test_the_floor_benchmark_runs_and_checks_bytes(tmp_path: Path) -> None:
    env = {**os.environ, "DO_NOT_TRACK": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_lmcache_floor.py"),
         "--sizes-kib", "64", "--reps", "3", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )
    if os.environ.get("FSTIER_NATIVE") == "0":  # the Python path: no native call to replay, said at once
        assert run.returncode == 2 and "the floor replays the adapter's native load call" in run.stderr
        assert not list(tmp_path.iterdir())
        return
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    row = next(line for line in run.stdout.splitlines() if line.startswith("| 64 KiB |"))
    assert row.count("x)") == 4  # fs_native, fstier, floor, floor_unchecked
    assert not list(tmp_path.iterdir())  # its roots are removed
