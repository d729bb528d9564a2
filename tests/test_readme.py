"""The README's Python quickstart runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_quickstart_runs() -> None:
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert code is not None, "README has no python quickstart"
    lines = code.group(1).strip().splitlines()
    assert len(lines) <= 15, "the quickstart should stay short"
    out = subprocess.run([sys.executable, "-c", code.group(1)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "4 of 4 blocks cached" in out.stdout
    assert "('store', True, 4)" in out.stdout and "('load', True, 4)" in out.stdout


def test_readme_names_the_two_commands() -> None:
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    assert "torch==2.13.0" in text
