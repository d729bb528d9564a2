"""Tests of FstierHiCacheStorage against SGLang's real storage seam; the CPU
helpers live in benchmarks/_sglang_cpu.py (shared with bench_sglang.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
