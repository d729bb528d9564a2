"""Store tasks of LMCache L2 adapters, alternated task by task in one process:
the same-run store ratio of fstier to LMCache's ``fs_native``.

``bench_lmcache.py`` times one store per adapter per round, between loads
and page-cache drops, and takes the median of a few rounds; on a shared
2-CPU machine its store ratio swung 0.5-1.3x at the same code. Here every
adapter (LMCache's factory, L1 buffer and memory objects: ``bench_lmcache``'s
harness) stores one untimed task first (its namespace and first files),
then ``--tasks`` store tasks of ``--keys`` new chunks each, the adapters
taking turns task by task, so each sees the same machine moment (page-cache
state, inode allocator, other processes). Nothing is loaded or dropped
while timing; afterwards each adapter's last task is loaded back and
compared byte for byte (a wrong byte fails the run: exit status 1).

Prints per size and adapter the median wall milliseconds per task, its
MB/s, the median process CPU milliseconds during a task (every thread of
the process), and each fstier variant's ratio to ``fs_native`` (>1:
faster), with the load average before and after.

    DO_NOT_TRACK=1 .venv-lmcache/bin/python benchmarks/bench_lmcache_stores.py --sizes-kib 256,2048 --tasks 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import bench_lmcache as B  # noqa: E402  (sets LMCache's environment first)


def run_size(size: int, keys: int, tasks: int, names: list[str], work: Path) -> dict[str, dict[str, float]]:
    """Median wall and process CPU seconds per store task, per adapter, and
    whether its last task loads back byte for byte (``bad``: 0 or 1)."""
    benches = [B.Bench(n, B._spec(n, work, size, keys * (tasks + 1)), size, keys) for n in names]
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    try:
        src = {b.name: b.data.make_memory_objects(b.buf, keys, size, 0, fill_offset=1) for b in benches}
        for b in benches:  # untimed: the namespace, the adapter's first files
            b.store(B._keys(keys, -1, b.name), src[b.name])
        for r in range(tasks):
            for b in benches:
                ks = B._keys(keys, r, b.name)
                c0, t0 = time.process_time(), time.perf_counter()
                b.store(ks, src[b.name])
                wall[b.name].append(time.perf_counter() - t0)
                cpu[b.name].append(time.process_time() - c0)
        bad = {}
        for b in benches:  # the last task's chunks, loaded back into the buffer's other half
            dst = b.data.make_memory_objects(b.buf, keys, size, keys * size, fill_offset=7)
            *_, bits = b._load(B._keys(keys, tasks - 1, b.name), dst)
            same = all(bytes(x.byte_array) == bytes(y.byte_array) for x, y in zip(src[b.name], dst, strict=True))
            bad[b.name] = 0 if bits.popcount() == keys and same else 1
    finally:
        for b in benches:
            b.close()
    return {
        n: {"wall": statistics.median(wall[n]), "cpu": statistics.median(cpu[n]), "bad": bad[n]} for n in names
    }


def table(res: dict[str, Any], keys: int) -> str:
    lines = [
        f"load average before {res['load_before']:.2f}, after {res['load_after']:.2f} ({res['cpus']} CPUs); "
        f"{keys} chunks per task, {res['tasks']} tasks per adapter, alternated; medians",
        "",
        "| chunk | adapter | ms per task | MB/s | process CPU ms per task | / fs_native | bad loads |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kib, per in res["sizes"].items():
        ref = per.get("fs_native")
        for name, r in per.items():
            ratio = f"{ref['wall'] / r['wall']:.2f}x" if ref and name in B.FSTIER else ""
            mbps = keys * (int(kib) << 10) / r["wall"] / 1e6
            ms, cpu = r["wall"] * 1e3, r["cpu"] * 1e3
            lines.append(f"| {kib} KiB | {name} | {ms:.2f} | {mbps:.0f} | {cpu:.2f} | {ratio} | {r['bad']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-kib", default="256,2048")
    p.add_argument("--keys", type=int, default=32, help="chunks per store task (default 32)")
    p.add_argument("--tasks", type=int, default=30, help="timed store tasks per adapter (default 30)")
    p.add_argument("--adapters", default="fstier,fs_native")
    p.add_argument("--workdir", default=None, help="directory for the roots (default: the temp dir)")
    a = p.parse_args(argv)
    names = a.adapters.split(",")
    res: dict[str, Any] = {"load_before": os.getloadavg()[0], "cpus": os.cpu_count(), "tasks": a.tasks, "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="bench-lmcache-stores-", dir=a.workdir) as tmp:
        for kib in (int(x) for x in a.sizes_kib.split(",")):
            work = Path(tmp) / f"{kib}k"
            work.mkdir()
            res["sizes"][kib] = run_size(kib << 10, a.keys, a.tasks, names, work)
    res["load_after"] = os.getloadavg()[0]
    print(table(res, a.keys))
    return 1 if any(r["bad"] for per in res["sizes"].values() for r in per.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
