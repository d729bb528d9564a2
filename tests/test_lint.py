"""The suite holds the code's lint: ruff's rules (pyproject's
``[tool.ruff]``: lines of at most 120 characters among them) on every
Python tree of the repository, so ``make test`` fails on a long line or a
lint finding, not only ``make lint``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TREES = ["fstier", "tests", "benchmarks", "examples"]


def test_ruff_is_clean_on_every_python_tree() -> None:
    try:
        import ruff  # noqa: F401  (the dev extra installs it)
    except ImportError:
        pytest.skip("ruff is not installed (make test installs the dev extra)")
    p = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", *TREES],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 0, f"ruff check {' '.join(TREES)} failed:\n{p.stdout[-4000:]}{p.stderr[-2000:]}"


def test_the_line_limit_is_on() -> None:
    """E501 is selected and not ignored anywhere: the limit cannot be switched off quietly."""
    text = (REPO / "pyproject.toml").read_text()
    assert "line-length = 120" in text
    assert "E501" not in text.split("[tool.ruff.lint]", 1)[1].split("[tool.mypy]", 1)[0]
