"""Python work per file on FstierTier's store and load paths, counted, not timed.

Counts the Python line events (``sys.settrace`` on every thread, the tier's
I/O threads included: the tracer is installed before the tier starts them)
while vLLM's job API stores, then loads, ``--rows`` rows of ``--row`` bytes
through FstierTier, and prints them per file, with the functions that run
the most lines. A count does not move with the machine's load, unlike CPU
time on a shared VM, so it shows what a change to the hot path removed;
the benchmark's own driver loop (``bench_vllm_tier.Bench``) is not counted.

    .venv/bin/python benchmarks/bench_python_lines.py --rows 1024 --top 15
"""

from __future__ import annotations

import argparse
import collections
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vllm_tier import Bench  # noqa: E402

from fstier.units import parse_size  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", default="64KiB")
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--job-rows", type=int, default=16)
    ap.add_argument("--top", type=int, default=15, help="functions to list per phase")
    args = ap.parse_args()

    lines: collections.Counter[tuple[str, str]] = collections.Counter()
    phase = [""]

    def local(frame: FrameType, event: str, _arg: Any) -> Any:
        if event == "line":
            lines[phase[0], f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name})"] += 1
        return local

    def tracer(frame: FrameType, _event: str, _arg: Any) -> Any:
        if not phase[0] or frame.f_code.co_filename.endswith("bench_vllm_tier.py"):
            return None
        return local

    sys.settrace(tracer)
    threading.settrace(tracer)  # before the tier starts its I/O threads
    root = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="fstier-lines-"))
    bench = Bench(root, parse_size(args.row), args.rows, args.job_rows)
    try:
        bench.fill(1)
        keys = bench.keys("lines")
        for name, promotion in (("store", False), ("load", True)):
            phase[0] = name
            _secs, _cpu, failed = bench._run_jobs_now("fstier", keys, promotion)
            phase[0] = ""
            if failed:
                raise SystemExit(f"{failed} {name} jobs failed")
    finally:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
        bench.close()
        shutil.rmtree(root, ignore_errors=True)
    for name in ("store", "load"):
        total = sum(v for (p, _), v in lines.items() if p == name)
        print(f"{name}: {total / args.rows:.1f} Python lines per file")
        top = sorted(((v, f) for (p, f), v in lines.items() if p == name), reverse=True)[: args.top]
        for v, f in top:
            print(f"  {v / args.rows:6.2f}  {f}")


if __name__ == "__main__":
    main()
