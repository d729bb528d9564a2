"""Python work per file on FstierTier's store and load paths, counted, not timed.

Counts the Python line events (``sys.settrace`` on every thread, the tier's
I/O threads included: the tracer is installed before the tier starts them)
while vLLM's job API stores, then loads, ``--rows`` rows of ``--row`` bytes
through FstierTier, and prints them per file, with the functions that run
the most lines. A count does not move with the machine's load, unlike CPU
time on a shared VM, so it shows what a change to the hot path removed;
the benchmark's own driver loop is not counted.

vLLM polls ``get_finished_jobs`` every scheduler step, so how many polls
find nothing depends on timing, not on the job path: the lines of a poll
that returned no result (on the driver's thread) are counted apart, as
"idle poll" lines per poll, and the per-file figures hold the rest (the
jobs' own work on every thread: submit, completion, judging, results).

    .venv/bin/python benchmarks/bench_python_lines.py --rows 1024 --top 15

``--serial`` keeps one job in flight at a time: every collect then finds
exactly one job, so a collect's fixed lines are each job's and the figure
does not move with timing (the figure to compare completions by).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
from bench_vllm_tier import Bench  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

from fstier.units import parse_size  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", default="64KiB")
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--job-rows", type=int, default=16)
    ap.add_argument("--top", type=int, default=15, help="functions to list per phase")
    ap.add_argument("--serial", action="store_true",
                    help="one job in flight at a time, so every collect finds exactly one job (steady figures)")
    ap.add_argument("--lookup", action="store_true",
                    help="look the keys up (the adapter's batch_lookup, not counted) before the loads, as vLLM does")
    args = ap.parse_args()

    lines: collections.Counter[tuple[str, str]] = collections.Counter()
    phase = [""]

    def tracer(frame: FrameType, _event: str, _arg: Any) -> Any:
        if not phase[0] or frame.f_code.co_filename.endswith(("bench_vllm_tier.py", "bench_python_lines.py")):
            return None
        return local

    main_thread = threading.get_ident()
    polling = [False]
    scratch: collections.Counter[tuple[str, str]] = collections.Counter()
    #: the caller's submit calls apart: their lines do not depend on timing (a completion's do: how many
    #: jobs one collect finds, which thread collects them)
    submitting = [False]

    def local(frame: FrameType, event: str, _arg: Any) -> Any:
        if event == "line":
            where = f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name})"
            if polling[0] and threading.get_ident() == main_thread:
                scratch[phase[0], where] += 1
            elif submitting[0] and threading.get_ident() == main_thread:
                lines[phase[0] + " submit", where] += 1
            else:
                lines[phase[0], where] += 1
        return local

    def make_jobs(keys: list[bytes], load: bool) -> list[Any]:
        """vLLM's job records, built before counting starts (the driver's work, not fstier's)."""
        jobs = []
        for start in range(0, len(keys), args.job_rows):
            bench._job += 1
            ids = np.arange(start, min(len(keys), start + args.job_rows), dtype=np.int32)
            jobs.append(TransferJob(job_id=bench._job, keys=keys[start : start + len(ids)], chunk_ids=ids,
                                    is_promotion=load, req_context=ReqContext(req_id="lines")))
        return jobs

    def run_jobs(tier: Any, jobs: list[Any], load: bool) -> tuple[int, int]:
        """Submit every job, then poll as vLLM does; (failed jobs, idle polls)."""
        failed, idle = 0, 0
        for batch in ([j] for j in jobs) if args.serial else [jobs]:
            f, i = run_batch(tier, batch, load)
            failed, idle = failed + f, idle + i
        return failed, idle

    def run_batch(tier: Any, jobs: list[Any], load: bool) -> tuple[int, int]:
        pending, failed, idle = {j.job_id for j in jobs}, 0, 0
        submit = tier.submit_load if load else tier.submit_store
        for j in jobs:
            submitting[0] = True
            submit(j)
            submitting[0] = False
        while pending:
            polling[0] = True
            got = list(tier.get_finished_jobs())
            polling[0] = False
            name, phase[0] = phase[0], ""  # the merge below is the driver's
            if got:
                lines.update(scratch)
            else:
                idle += 1
                for (p, f), v in scratch.items():
                    lines[p + " idle poll", f] += v
            scratch.clear()
            phase[0] = name
            for r in got:
                pending.discard(r.job_id)
                failed += not r.success
            if pending:
                time.sleep(0.0005)
        return failed, idle

    sys.settrace(tracer)
    threading.settrace(tracer)  # before the tier starts its I/O threads
    root = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="fstier-lines-"))
    bench = Bench(root, parse_size(args.row), args.rows, args.job_rows)
    polls: dict[str, int] = {}
    try:
        bench.fill(1)
        keys = bench.keys("lines")
        for name, load in (("store", False), ("load", True)):
            jobs = make_jobs(keys, load)
            if load and args.lookup:  # vLLM's scheduler looks a request's keys up before it loads them
                bench.tiers["fstier"]._lookup.batch_lookup(keys, ReqContext(req_id="lines"))
            phase[0] = name
            failed, polls[name] = run_jobs(bench.tiers["fstier"], jobs, load)
            phase[0] = ""
            if failed:
                raise SystemExit(f"{failed} {name} jobs failed")
    finally:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
        bench.close()
        shutil.rmtree(root, ignore_errors=True)
    for name in ("store", "load"):
        idle_lines = sum(v for (p, _), v in lines.items() if p == name + " idle poll")
        print(f"{name} idle polls: {polls[name]}, {idle_lines / max(1, polls[name]):.1f} Python lines each")
    for name in ("store", "load"):
        done = sum(v for (p, _), v in lines.items() if p == name)
        sub = sum(v for (p, _), v in lines.items() if p == name + " submit")
        print(f"{name}: {(done + sub) / args.rows:.1f} Python lines per file; the caller's submit calls "
              f"{sub * args.job_rows / args.rows:.0f} per job, the rest {done * args.job_rows / args.rows:.0f} per job")
        for part in (name + " submit", name):
            top = sorted(((v, f) for (p, f), v in lines.items() if p == part), reverse=True)[: args.top]
            for v, f in top:
                print(f"  {v * args.job_rows / args.rows:6.1f} per job  {f}  [{part}]")


if __name__ == "__main__":
    main()
