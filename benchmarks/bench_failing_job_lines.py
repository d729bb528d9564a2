"""Python lines a FAILING C-engine job costs, counted, not timed.

One ``--keys``-key job on the C engine (the contract suite's rig: a tier's
block store and host slots, tests/test_engine_contract.py) whose keys do not
all return alike, counted with ``sys.settrace`` on every thread from its
submit until it is published (the completion thread's collect and judging
included):

- ``load``: one key's file corrupt (removed), one missing, the rest loaded;
- ``store``: one key's write fails (the C fault seam's EIO), the rest stored;
- ``ns``: every key stored after ``rm -rf`` of the namespace directory.

A count does not move with the machine's load. docs/performance.md ("The C
engine's rare paths in C") has the figures before and after they moved into C.

    .venv/bin/python benchmarks/bench_failing_job_lines.py --mode load --keys 64
"""

from __future__ import annotations

import argparse
import collections
import errno
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from manager_support import keys  # noqa: E402
from test_engine_contract import Rig, outcomes  # noqa: E402

from fstier.io import native  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["load", "store", "ns"], default="load")
    ap.add_argument("--keys", type=int, default=64, help="3..64 (the rig's slots)")
    args = ap.parse_args()
    if not 3 <= args.keys <= 64:
        ap.error("--keys: 3..64 (the rig's host slots)")
    n = args.keys
    lines: collections.Counter[str] = collections.Counter()
    on = [False]

    def local(frame: FrameType, event: str, _arg: Any) -> Any:
        if event == "line" and on[0]:
            lines[frame.f_code.co_filename] += 1
        return local

    def tracer(_frame: FrameType, event: str, _arg: Any) -> Any:
        return local if on[0] and event == "call" else None

    threading.settrace(tracer)
    sys.settrace(tracer)
    with tempfile.TemporaryDirectory() as d:
        rig = Rig(Path(d) / "root", "native")
        try:
            ks = keys(0, n)
            rig.fill(ks, list(range(n)))
            rig.run(rig.job("s", "store", ks, list(range(n))))
            job = rig.job("l", "load", ks, list(range(n)))
            if args.mode == "load":
                paths = rig.blocks.paths(ks)
                with open(paths[n // 2], "r+b") as f:
                    f.seek(4096)
                    f.write(b"\xff\xfe")
                os.unlink(paths[n // 3])
            elif args.mode == "store":
                native.fault("write", errno.EIO, nth=3)
                job = rig.job("s2", "store", keys(1000, n), list(range(n)))
            else:
                shutil.rmtree(rig.blocks.mapper.namespace_dir)
                job = rig.job("s3", "store", keys(2000, n), list(range(n)))
            on[0] = True
            rig.reg.submit(job)
            while not job.done:
                time.sleep(0.001)
            time.sleep(0.05)  # the completion thread's last lines after publishing
            on[0] = False
            got = collections.Counter(o.status.name for o in outcomes(job))
        finally:
            native.clear_faults()
            rig.close()
    ours = sum(v for k, v in lines.items() if f"{os.sep}fstier{os.sep}" in k)
    print(f"{args.mode}: {n} keys, outcomes {dict(got)}: {ours} Python lines in fstier/ ({sum(lines.values())} in all)")
    for name, count in lines.most_common(5):
        print(f"  {count:6d} {name}")


if __name__ == "__main__":
    main()
