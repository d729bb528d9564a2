"""Stores and cold loads through FsTier on each job engine (the Python engine
and the C engine, ``FSTIER_ENGINE``), native block I/O path.

Per payload size (``--sizes``: 64 KiB and 1 MiB by default) and engine: a fresh root,
``--mib`` MiB of files stored in jobs of ``--job`` keys (all submitted, then
drained: GB/s to completion), then every file dropped from the page cache
(``posix_fadvise(DONTNEED)`` per file: only these files, so other processes
on a shared machine keep their cache) and loaded back into other slots
(cold load GB/s), every byte compared. CPU per file: the process's user and
system time (``getrusage``, all threads) over the files moved. Engines
alternate which runs first; the median of ``--reps`` passes is printed, with
the load average before and after.

    python benchmarks/bench_engine.py [--dir /var/tmp/x] [--mib 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fstier.config import parse_config  # noqa: E402
from fstier.keys import BlockKey  # noqa: E402
from fstier.manager import FsTier  # noqa: E402

ENGINES = ("python", "native")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _tier(root: Path, layers: int, threads: int) -> FsTier:
    cfg = parse_config({
        "tier": {"root_dir": str(root), "read_threads": threads, "write_threads": threads, "native_io": "on"},
        "model": {"name": "bench/engine", "dtype": "float16", "groups": [
            {"kind": "full_attention", "block_size": 16, "num_layers": layers, "num_kv_heads": 8, "head_size": 64},
        ]},
        "parallel": {},
    })
    return FsTier.from_config(cfg)


def _run(engine: str, base: Path, layers: int, mib: int, job: int, threads: int) -> dict[str, float]:
    os.environ["FSTIER_ENGINE"] = engine
    root = Path(tempfile.mkdtemp(prefix=f"eng-{engine}-", dir=base))
    tier = _tier(root, layers, threads)
    try:
        assert type(tier._engine.engine).__name__.lower().startswith(engine)
        size = tier.payload_bytes(BlockKey(b"\0" * 16, 0))
        n = max(job, mib * 2**20 // size)
        slots = tier.pool.alloc(2 * n)  # type: ignore[attr-defined]  # its private HostBlockPool
        keys = [BlockKey(i.to_bytes(8, "big") * 2, 0) for i in range(n)]
        for i in range(n):
            tier.pool.slot_view(slots[i])[:size] = (i.to_bytes(8, "big") * (size // 8))
        out: dict[str, float] = {}
        for phase, off in (("store", 0), ("load", n)):
            if phase == "load":
                for p in tier.blocks.paths(keys):
                    fd = os.open(p, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
            c0, t0 = _cpu(), time.perf_counter()
            for j in range(0, n, job):
                ks = keys[j : j + job]
                sl = slots[off + j : off + j + len(ks)]
                (tier.submit_store if phase == "store" else tier.submit_load)((phase, j), ks, sl)
            assert tier.drain(600)
            dt, dc = time.perf_counter() - t0, _cpu() - c0
            res = tier.get_finished()
            assert all(r.success for r in res), [r for r in res if not r.success][:3]
            out[f"{phase}_gbs"] = n * size / dt / 1e9
            out[f"{phase}_cpu_us"] = dc / n * 1e6
        for i in range(n):
            got = bytes(tier.pool.slot_view(slots[n + i])[:size])
            assert got == i.to_bytes(8, "big") * (size // 8), f"bad bytes in file {i}"
        out["files"] = n
        return out
    finally:
        tier.close()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp", help="where the roots are made (a real filesystem)")
    ap.add_argument("--mib", type=int, default=64, help="MiB of files per size and engine")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--job", type=int, default=16, help="keys per job")
    ap.add_argument("--threads", type=int, default=4, help="read and write threads of the engine")
    ap.add_argument("--engines", default=",".join(ENGINES), help="engines to run, from python,native")
    ap.add_argument("--sizes", default="64KiB,1MiB", help="payload sizes, from 64KiB,256KiB,1MiB,2MiB")
    args = ap.parse_args()
    engines = tuple(e.strip() for e in args.engines.split(","))
    if not engines or set(engines) - set(ENGINES):
        ap.error(f"--engines: {args.engines!r}; use names from {', '.join(ENGINES)}")
    base = Path(tempfile.mkdtemp(prefix="bench-engine-", dir=args.dir))
    print(f"load average before: {Path('/proc/loadavg').read_text().strip()}")
    known = {"64KiB": ("64 KiB", 2), "256KiB": ("256 KiB", 8), "1MiB": ("1 MiB", 32), "2MiB": ("2 MiB", 64)}
    try:
        sizes = dict(known[s.strip()] for s in args.sizes.split(","))
    except KeyError as e:
        ap.error(f"--sizes: {e.args[0]!r} is not one of {', '.join(known)}")
    print("| size | engine | store GB/s | cold load GB/s | CPU us/file store | CPU us/file load |")
    print("|---|---|---|---|---|---|")
    for label, layers in sizes.items():
        runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
        for rep in range(args.reps):
            order = engines if rep % 2 == 0 else engines[::-1]
            for e in order:
                runs[e].append(_run(e, base, layers, args.mib, args.job, args.threads))
        for e in engines:
            med = {k: statistics.median(r[k] for r in runs[e]) for k in runs[e][0]}
            print(f"| {label} | {e} | {med['store_gbs']:.2f} | {med['load_gbs']:.2f} | "
                  f"{med['store_cpu_us']:.0f} | {med['load_cpu_us']:.0f} |")
    print(f"load average after: {Path('/proc/loadavg').read_text().strip()}")
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
