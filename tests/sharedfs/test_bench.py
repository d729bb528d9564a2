"""``fstier bench`` on each shared filesystem's mount: fstier's store/load
against raw O_DIRECT on the same mount in the same run (the ratios that
docs/deployment.md publishes, with the load average beside them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .conftest import FIGURES, SharedFs

BLOCK = "1MiB"
BLOCKS = 16
THREADS = 4


def test_bench_against_raw_o_direct(sfs: SharedFs) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "fstier.cli", "bench", "--root", str(sfs.a / "bench"),
         "--block-size", BLOCK, "--blocks", str(BLOCKS), "--threads", str(THREADS), "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    rows = {r["op"]: r for r in doc["rows"]}
    FIGURES[f"{sfs.name} fstier bench ({BLOCKS} x {BLOCK}, {THREADS} threads)"] = {
        **{f"{op} fstier / raw GB/s": f"{r['fstier_gbps']:.3f} / {r['raw_gbps']:.3f}" for op, r in rows.items()},
        **{f"{op} ratio": round(r["ratio"], 2) for op, r in rows.items()},
        "o_direct": doc["o_direct"],
        "load average": os.getloadavg()[0],
    }
    assert doc["o_direct"] is not None
    for op, r in rows.items():
        assert r["fstier_gbps"] > 0 and r["raw_gbps"] > 0, (op, r)
