"""The engine side's shape (issue 23: no module over ~600 lines): the staging
modules stay small, and the planning half of it needs numpy but never torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "fstier"

#: the engine side: canonical pages, their byte runs, copy plans, the stager
#: and the cross-layer allocator
ENGINE_SIDE = ("canonical.py", "layout.py", "cross_layer.py", "page_runs.py", "copy_plan.py", "gpu_copy.py")
MAX_LINES = 600


@pytest.mark.parametrize("name", ENGINE_SIDE)
def test_engine_side_module_stays_under_600_lines(name: str) -> None:
    lines = len((PKG / name).read_text().splitlines())
    assert lines <= MAX_LINES, f"fstier/{name} has {lines} lines (limit {MAX_LINES}): split a concept out"


def test_planning_modules_load_numpy_but_not_torch() -> None:
    code = (
        "import sys, fstier.page_runs, fstier.copy_plan\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')) [:1])\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["['numpy']", "False"], proc.stdout
