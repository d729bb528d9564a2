"""benchmarks/bench_lmcache_floor.py runs on LMCache's real classes: it
captures the adapter's own native load call (the C engine's
``engine_submit``, or the Python engine's batch call), replays it as the
floor, and fails on a wrong byte; ``--timeline`` says where a task's time
goes (``--cold``: after the ratio loop's work between tasks), ``--steps``
the caller's CPU per step. Tiny runs keep it from rotting (its figures are
in docs/lmcache.md, never checked here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("cold", [[], ["--cold"]], ids=["warm", "cold"])
def test_the_timeline_names_the_engine_and_the_threads_a_task_wakes(tmp_path: Path, cold: list[str]) -> None:
    if os.environ.get("FSTIER_NATIVE") == "0":
        return  # refused as above
    env = {**os.environ, "DO_NOT_TRACK": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_lmcache_floor.py"),
         "--sizes-kib", "64", "--reps", "3", "--workdir", str(tmp_path), "--timeline", *cold],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    want = "python" if os.environ.get("FSTIER_ENGINE") == "python" else "native (C)"
    assert run.stdout.startswith(f"engine {want};"), run.stdout
    for phase in ("submit", "wait", "collect", "job in the engine (its submit to its completion)",
                  "caller_cpu_submit", "process_cpu"):
        assert f"  {phase}: " in run.stdout, run.stdout
    assert "  caller: 1 thread(s)" in run.stdout, run.stdout
    if want == "native (C)":  # the submit split at the tier's and the engine's calls, the collect at the tier's
        for part in ("adapter_before_tier", "tier_before_engine", "tier_collect"):
            assert f"  of which {part}: " in run.stdout, run.stdout
    assert not list(tmp_path.iterdir())


def test_the_steps_name_the_adapters_steps_and_the_tiers_calls(tmp_path: Path) -> None:
    if os.environ.get("FSTIER_NATIVE") == "0":
        return  # refused as above
    env = {**os.environ, "DO_NOT_TRACK": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_lmcache_floor.py"),
         "--sizes-kib", "64", "--reps", "3", "--workdir", str(tmp_path), "--steps", "--cold"],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    for step in ("adapter: one_signature", "adapter: L1Arena.lend", "tier: submit_load (the C call in it)",
                 "tier: get_finished", "adapter: _publish", "the caller's submit", "the caller's collect"):
        assert f"  {step}: " in run.stdout and " us CPU" in run.stdout, run.stdout
    assert not list(tmp_path.iterdir())
