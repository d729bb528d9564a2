"""``benchmarks/bench_key_cpu.py`` runs end to end: the per-key C store and load
(one native call each, every byte compared by the bench) and ``ceiling_loop.c``'s
``lazy`` fan-out (each directory made by its first store, then loaded back by the
same names) on real files, each side printing a row per pass."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fstier.io import native

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_key_cpu.py"

pytestmark = [
    pytest.mark.skipif(native._ext is None, reason=f"native extension not built: {native._import_error}"),
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) to build ceiling_loop.c"),
]


def test_bench_key_cpu_stores_and_loads_on_both_sides(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--dir", str(tmp_path), "--files", "24", "--fanout", "fresh", "--buffered",
         "--reps", "2"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "FSTIER_NATIVE": "1"},
    )
    assert out.returncode == 0, out.stderr
    rows = re.findall(r"^\| (\d) \| (fstier|ceiling) \| .* \| ([\d.]+) \| .* \| ([\d.]+) \|$", out.stdout, re.M)
    assert sorted((p, side) for p, side, _, _ in rows) == [
        ("0", "ceiling"), ("0", "fstier"), ("1", "ceiling"), ("1", "fstier")
    ], out.stdout
    assert all(float(store) > 0 and float(load) > 0 for _, _, store, load in rows), out.stdout
    assert not any(tmp_path.iterdir()), "the bench left files behind"


def test_ceiling_loop_lazy_makes_only_the_directories_its_stores_use(tmp_path: Path) -> None:
    exe = tmp_path / "ceiling_loop"
    subprocess.run(["cc", "-O2", "-pthread", "-o", str(exe), str(BENCH.parent / "ceiling_loop.c")], check=True)
    root = tmp_path / "root"
    root.mkdir()
    for mode in ("store", "load"):
        subprocess.run([str(exe), mode, str(root), "24", "4096", "2", "lazy", "0"], check=True, capture_output=True)
    dirs = [d for d in root.iterdir() if d.is_dir()]
    files = [f for d in dirs for f in d.iterdir()]
    assert len(files) == 24
    # Only the directories its stores used: none of them empty ("existing" would have made all 4096).
    assert [d.name for d in dirs if not any(d.iterdir())] == []
    assert len(dirs) == len({f.parent for f in files}) <= 24
    assert all(f.stat().st_size == 4096 + 4096 for f in files)
