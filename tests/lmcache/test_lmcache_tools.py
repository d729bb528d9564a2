"""LMCache's own tools against fstier, unchanged (issue 45): its L2 adapter
check (``python -m lmcache.v1.basic_check --mode test_l2_adapter``, the
``lmcache check`` tool of LMCache's docs) and its L2 benchmark (``lmcache
bench l2``, every key its own ``kv_rank``: 256 namespaces), each on both I/O
paths (``native_io`` on and off), reading their own reports.

Without LMCache these tests skip, unless ``FSTIER_REQUIRE_LMCACHE=1``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("DO_NOT_TRACK", "1")
if os.environ.get("FSTIER_REQUIRE_LMCACHE") == "1":
    import lmcache.v1.distributed.l2_adapters.base  # noqa: F401  (fail loudly in CI)
else:
    pytest.importorskip(
        "lmcache.v1.distributed.l2_adapters.base",
        reason="LMCache not installed (make test-lmcache builds .venv-lmcache with it)",
    )

from _lmc import BIN, REPO, env, fstier_spec  # noqa: E402


def run(cmd: list[str], timeout: float = 300) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=timeout, cwd=REPO)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{cmd[:4]} exited {p.returncode}:\n{out[-4000:]}"
    return out


def test_lmcache_check_test_l2_adapter_passes(io: str, tmp_path: Path) -> None:
    """LMCache's adapter check: 4-byte chunk hashes, lookups with no layout
    hint; every phase 5/5 (before: stores refused, 0/5 found)."""
    out = run([
        sys.executable, "-m", "lmcache.v1.basic_check", "--mode", "test_l2_adapter",
        "--l2-adapter", fstier_spec(tmp_path, native_io=io),
    ])
    rows = dict(re.findall(r"^\| (LOOKUP \(absent\)|STORE|LOOKUP \(exist\)|LOAD)\s+\|.*?\|\s+(\d+/\d+) \|", out, re.M))
    assert rows == {"LOOKUP (absent)": "5/5", "STORE": "5/5", "LOOKUP (exist)": "5/5", "LOAD": "5/5"}, out[-3000:]
    assert "Validation (content): 5/5" in out and "Test Failed" not in out


def test_lmcache_bench_l2_stores_and_loads_every_key(io: str, tmp_path: Path) -> None:
    """LMCache's L2 benchmark, 256 keys each of its own kv_rank (256
    namespaces, past MAX_SPACES), its lookups all hits, its byte check on
    (before: 0 of 256 stored)."""
    out = run([
        str(BIN / "lmcache"), "bench", "l2", "--l2-adapter", fstier_spec(tmp_path, native_io=io),
        "--num-keys", "256", "--data-size-kb", "16", "--rounds", "1", "--warmup-rounds", "0",
        "--lookup-max-hit-rate", "1.0", "--no-skip-verify",
    ])
    success = dict(re.findall(r"^Operation:\s+(\w+)\n(?:.*\n)*?Total success:\s+(\d+)", out, re.M))
    assert success == {"Store": "256", "Lookup": "256", "Load": "256"}, out[-3000:]
    assert "All 256 keys data verified OK" in out
