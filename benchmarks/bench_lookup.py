"""Benchmark FsTier.lookup against a plain os.path.exists loop.

For 1,024 / 4,096 / 65,536 keys and three hit patterns (all hits, all misses,
first half hits) it times, in the same run and over the same paths:

- ``fstier cold``: a new FsTier (empty lookup cache) doing one lookup;
- ``fstier warm``: the same lookup again (served by the short-lived cache);
- ``exists cold`` / ``exists warm``: ``os.path.exists`` over the same paths,
  stopping at the first miss (the prefix an engine asks for).

"cold" also drops the kernel's dentry/inode caches before each cold run when
``/proc/sys/vm/drop_caches`` is writable (root, not in a read-only /proc);
the table says whether that happened. Lookups only stat, so the files are
created empty (the block payload is irrelevant to this benchmark).

    .venv/bin/python benchmarks/bench_lookup.py [--sizes 1024,4096,65536] [--root DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _raw import drop_caches  # the benchmarks dir is sys.path[0] for a script

from fstier.config import parse_config
from fstier.io.blockstore import NamespaceDirs
from fstier.keys import BlockKey
from fstier.manager import FsTier
from fstier.slots.host_pool import HostBlockPool


def _config(root: Path):
    return parse_config(
        {
            "tier": {"root_dir": str(root), "read_threads": 8, "write_threads": 2},
            "model": {
                "name": "bench/lookup",
                "dtype": "float16",
                "groups": [{"block_size": 16, "num_layers": 2, "num_kv_heads": 2, "head_size": 64}],
            },
        }
    )




def _exists_prefix(paths: list[str]) -> int:
    n = 0
    for p in paths:
        if not os.path.exists(p):
            break
        n += 1
    return n


def _time(fn, repeat: int) -> tuple[float, int]:
    best = float("inf")
    out = 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def run(sizes: list[int], root: Path, repeat: int) -> list[dict[str, object]]:
    cfg = _config(root)
    rows: list[dict[str, object]] = []
    largest = max(sizes)
    with HostBlockPool(4, 4096 * 16) as pool:
        with FsTier(cfg, pool) as tier:
            keys = [BlockKey(i.to_bytes(8, "big") * 2) for i in range(2 * largest)]
            paths = [str(tier.mapper.path_for(k)) for k in keys]
            # keys[:largest] exist; keys[largest:] never do.
            for p in paths[:largest]:
                NamespaceDirs(tier.mapper).ensure(Path(p))
                open(p, "wb").close()
        for n in sizes:
            cases = {
                "hits": (keys[:n], paths[:n], n),
                "misses": (keys[largest : largest + n], paths[largest : largest + n], 0),
                "half": (
                    keys[: n // 2] + keys[largest : largest + n // 2],
                    paths[: n // 2] + paths[largest : largest + n // 2],
                    n // 2,
                ),
            }
            for case, (ks, ps, expect) in cases.items():
                dropped = drop_caches(2)
                with FsTier(cfg, pool) as tier:
                    t0 = time.perf_counter()
                    got = tier.lookup(ks)
                    fs_cold = time.perf_counter() - t0
                    fs_warm, got_warm = _time(lambda t=tier, ks=ks: t.lookup(ks), repeat)
                drop_caches(2)
                t0 = time.perf_counter()
                ex = _exists_prefix(ps)
                ex_cold = time.perf_counter() - t0
                ex_warm, _ = _time(lambda ps=ps: _exists_prefix(ps), repeat)
                if not got == got_warm == ex == expect:
                    raise SystemExit(f"wrong answer for {n} {case}: {got} {got_warm} {ex} != {expect}")
                rows.append(
                    {
                        "keys": n,
                        "case": case,
                        "hits": expect,
                        "fstier_cold_ms": fs_cold * 1e3,
                        "fstier_warm_ms": fs_warm * 1e3,
                        "exists_cold_ms": ex_cold * 1e3,
                        "exists_warm_ms": ex_warm * 1e3,
                        "kernel_caches_dropped": dropped,
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1024,4096,65536")
    ap.add_argument("--root", default=None, help="directory to create the test root in")
    ap.add_argument("--repeat", type=int, default=5, help="warm repetitions (best is reported)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    base = Path(tempfile.mkdtemp(prefix="fstier-bench-lookup-", dir=args.root))
    try:
        rows = run(sizes, base / "root", args.repeat)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    print(f"{'keys':>6} {'case':>6} {'fstier cold':>12} {'exists cold':>12} {'fstier warm':>12} "
          f"{'exists warm':>12} {'warm x':>7}  (ms; x = exists/fstier)")
    for r in rows:
        fw, ew = float(r["fstier_warm_ms"]), float(r["exists_warm_ms"])  # type: ignore[arg-type]
        print(f"{r['keys']:>6} {r['case']:>6} {float(r['fstier_cold_ms']):>12.3f} "  # type: ignore[arg-type]
              f"{float(r['exists_cold_ms']):>12.3f} {fw:>12.3f} {ew:>12.3f} "  # type: ignore[arg-type]
              f"{(ew / fw if fw else float('nan')):>7.1f}")
    dropped = {bool(r["kernel_caches_dropped"]) for r in rows}
    print(f"kernel dentry/inode caches dropped before cold runs: {sorted(dropped)}")
    warm_us_per_key = [
        float(r["fstier_warm_ms"]) / max(1, int(r["keys"])) * 1e3  # type: ignore[arg-type]
        for r in rows
        if r["case"] == "hits"
    ]
    print(f"median fstier warm per key: {statistics.median(warm_us_per_key):.3f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
