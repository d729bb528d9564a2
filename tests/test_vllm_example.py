"""examples/vllm_tier.py runs vLLM's real tiering manager against FstierTier
and prints store -> restart -> promotion -> hit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tests._vllm_helpers  # noqa: F401  (skips without vLLM, fails with FSTIER_REQUIRE_VLLM=1)

REPO = Path(__file__).resolve().parents[1]


def test_vllm_example_prints_store_restart_promotion_hit(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "vllm_tier.py"), "--root", str(root), "--chunks", "6"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "FstierTier wrote 6 files" in out
    assert "2. restart" in out
    assert "lookup -> 6 RETRY" in out
    assert "lookup -> 6 HIT_PENDING" in out
    assert "4. hit: 6 of 6 chunks HIT; rows match the stored bytes" in out
    assert len(list(root.rglob("*.bin"))) == 6
    assert "Keeping /dev/shm" not in proc.stderr  # the example releases its views


def test_vllm_example_counts_only_what_this_run_wrote(tmp_path: Path) -> None:
    """A second run on the same root writes nothing new and says so."""
    root = tmp_path / "kv"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, str(REPO / "examples" / "vllm_tier.py"), "--root", str(root), "--chunks", "4"]
    first = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0 and "FstierTier wrote 4 files" in first.stdout, first.stdout + first.stderr
    again = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "FstierTier wrote 0 files" in again.stdout and "4 already on disk (skipped)" in again.stdout
