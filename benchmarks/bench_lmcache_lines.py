"""Python work per LMCache task through FstierL2Adapter, counted, not timed.

Counts the Python line events (``sys.settrace`` on every thread, the tier's
I/O threads included: the tracer is installed before the adapter opens its
first namespace) of ``--tasks`` store tasks of ``--keys`` new chunks each,
then as many warm load tasks of them, driven as ``bench_lmcache.py`` drives
the adapter (LMCache's own factory, L1 buffer and memory objects), and
prints them per task, split into fstier's adapter, the rest of fstier (the
job machinery: the tier's job, its checks, admission and result, the
engine's submit and collect) and LMCache's own code, with the functions that run the most lines. A count
does not move with the machine's load, unlike CPU time on a shared VM, so
it shows what a change to the per-task path removed; the driver loop here
is not counted.

    DO_NOT_TRACK=1 .venv-lmcache/bin/python benchmarks/bench_lmcache_lines.py --keys 32 --top 12
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_lmcache as B  # noqa: E402

from fstier.units import parse_size  # noqa: E402


def where(path: str) -> str:
    if "/fstier/integrations/" in path or path.endswith("/fstier/keys.py"):
        return "adapter"
    if "/fstier/" in path:
        return "fstier"
    if "/lmcache/" in path:
        return "lmcache"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk", default="256KiB")
    ap.add_argument("--keys", type=int, default=32, help="chunks per task")
    ap.add_argument("--tasks", type=int, default=20)
    ap.add_argument("--top", type=int, default=12, help="functions to list per phase")
    ap.add_argument("--only", choices=("adapter", "fstier", "lmcache", "other"), help="list only these functions")
    args = ap.parse_args()
    size, n = parse_size(args.chunk), args.keys

    lines: collections.Counter[tuple[str, str, str]] = collections.Counter()
    phase = [""]
    # the driver: this loop, bench_lmcache.py and LMCache's bench helpers
    # (wait_eventfd); the I/O threads run while it waits, so a task's phase
    # spans its waits
    driver = (Path(__file__).name, "bench_lmcache.py", "l2_adapter_bench/data.py")

    def local(frame: FrameType, event: str, _arg: Any) -> Any:
        if event == "line" and phase[0]:
            path = frame.f_code.co_filename
            lines[phase[0], where(path), f"{frame.f_code.co_name} ({Path(path).name})"] += 1
        return local

    def tracer(frame: FrameType, _event: str, _arg: Any) -> Any:
        if not phase[0] or frame.f_code.co_filename.endswith(driver):
            return None
        return local

    sys.settrace(tracer)
    threading.settrace(tracer)  # before the adapter's tiers start their I/O threads
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="fstier-lmc-lines-") as tmp:
        b = B.Bench("fstier", B._spec("fstier", Path(tmp), size, 4 * n), size, n)
        try:
            data, a = b.data, b.adapter
            src = data.make_memory_objects(b.buf, n, size, 0, fill_offset=1)
            dst = data.make_memory_objects(b.buf, n, size, n * size, fill_offset=3)
            warm = B._keys(n, 0, "fstier")
            for name, kind in (("", "store"), ("", "load"), ("store", "store"), ("load", "load")):
                for t in range(args.tasks if name else 1):  # unnamed: the warm-up, not counted
                    ks = B._keys(n, t + 1, "fstier") if name == "store" else warm
                    phase[0] = name
                    if kind == "store":
                        tid, done = a.submit_store_task(ks, src), {}
                        while tid not in done:
                            assert data.wait_eventfd(a.get_store_event_fd(), 60), "store timed out"
                            done.update(a.pop_completed_store_tasks())
                        assert done[tid].is_successful(), "a store failed"
                    else:
                        tid, bits = a.submit_load_task(ks, dst), None
                        while bits is None:
                            assert data.wait_eventfd(a.get_load_event_fd(), 60), "load timed out"
                            bits = a.query_load_result(tid)
                        assert bits.popcount() == n, "a load missed"
                    phase[0] = ""
        finally:
            sys.settrace(None)
            threading.settrace(None)  # type: ignore[arg-type]
            b.close()
    for name in ("store", "load"):
        per = {w: sum(v for (p, ww, _), v in lines.items() if p == name and ww == w) / args.tasks
               for w in ("adapter", "fstier", "lmcache", "other")}
        print(f"{name} ({n} x {args.chunk}): {sum(per.values()):.0f} Python lines per task: "
              + ", ".join(f"{w} {v:.0f}" for w, v in per.items()))
        print(f"  job machinery (fstier's tier and engine outside the adapter; issue 41's target <= 40): "
              f"{per['fstier']:.0f}")
        top = sorted(
            ((v, w, f) for (p, w, f), v in lines.items() if p == name and args.only in (None, w)), reverse=True
        )[: args.top]
        for v, w, f in top:
            print(f"  {v / args.tasks:7.1f}  {w:8s} {f}")


if __name__ == "__main__":
    main()
