
"""Disk usage with several FsTier instances on one root, each with max_bytes.

``--procs`` real processes (default 5) each open their own FsTier on one root
with ``max_bytes`` worth ``--max-files`` block files (default 300) and store
``--files`` distinct blocks each (default 1,000: ~17x max_bytes in all) in
jobs of ``--job`` keys, one job per ``--step-ms`` (an engine's scheduler
step; 0 submits back to back, so a writer whose stores are dropped races
through its keys). Meanwhile this process walks
the root every few milliseconds and sums the sizes of the block files in it.
When every writer has stored its blocks it keeps its tier open for
``--settle-s`` seconds (its capacity manager may still be evicting), then
reports its metrics and exits; the root is measured once more after all
have exited.

Printed: peak and settled usage over max_bytes, the number of samples,
stores dropped because the root was full (cause ``capacity``) as a count
and a fraction of the stores offered, evictions.

    .venv/bin/python benchmarks/bench_multi_instance.py [--procs 5] [--max-files 300] [--json]

The reliability suite runs it as a slow test
(``tests/reliability/test_concurrency.py::test_many_instances_share_max_bytes``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FILE_BYTES = 8192  # 4 KiB header + one 128-byte page padded to 4 KiB
_GROUP = {"block_size": 4, "num_layers": 1, "num_kv_heads": 1, "head_size": 8}


def _config(root: Path, max_files: int) -> Any:
    from fstier.config import parse_config

    return parse_config(
        {
            "tier": {
                "root_dir": str(root),
                "read_threads": 2,
                "write_threads": 2,
                "max_bytes": max_files * FILE_BYTES,
            },
            "model": {"name": "bench/multi", "dtype": "float16", "groups": [_GROUP]},
        }
    )


def _worker(args: argparse.Namespace) -> None:
    from fstier.keys import BlockKey
    from fstier.manager import FsTier
    from fstier.slots.host_pool import HostBlockPool

    cfg = _config(Path(args.root), args.max_files)
    pool = HostBlockPool(args.job, FILE_BYTES)
    slots = pool.alloc(args.job)
    tier = FsTier(cfg, pool)
    try:
        base = (args.worker + 1) << 40
        step = args.step_ms / 1000
        for start in range(0, args.files, args.job):
            t0 = time.perf_counter()
            n = min(args.job, args.files - start)
            ks = [BlockKey((base + start + i).to_bytes(16, "big")) for i in range(n)]
            for k, s in zip(ks, slots, strict=False):
                pool.slot_view(s)[:128] = k.block_hash * 8
            tier.submit_store(("s", start), ks, slots[:n])
            tier.drain()
            tier.get_finished()
            # An engine stores what one scheduler step computed: at most one
            # job per step, whether the last one was stored or dropped.
            time.sleep(max(0.0, step - (time.perf_counter() - t0)))
        time.sleep(args.settle_s)
        snap = tier.metrics.snapshot()
    finally:
        tier.close()
        pool.close()
    print(json.dumps({
        "worker": args.worker,
        "dropped": snap.get("fstier_store_dropped_blocks_total", {}),
        "stored": snap.get("fstier_stored_blocks_total", 0),
        "evicted": snap.get("fstier_evicted_blocks_total", 0),
    }))


def _block_bytes(root: str) -> int:
    """Bytes of final block files under ``root`` (as FsTier counts usage)."""
    total = 0
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for e in it:
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    elif e.name.endswith(".bin") and not e.name.startswith("."):
                        total += e.stat(follow_symlinks=False).st_size
                except OSError:
                    continue
    return total


def run(
    procs: int, max_files: int, files: int, job: int, settle_s: float, root: Path, step_ms: float = 5.0
) -> dict[str, Any]:
    max_bytes = max_files * FILE_BYTES
    # Create the namespace once so that the writers start together.
    from fstier.file_mapper import FileMapper
    from fstier.io.manifest import ensure_manifest

    ensure_manifest(FileMapper(_config(root, max_files)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(w), "--root", str(root),
             "--max-files", str(max_files), "--files", str(files), "--job", str(job),
             "--settle-s", str(settle_s), "--step-ms", str(step_ms)],
            stdout=subprocess.PIPE, text=True, env=env,
        )
        for w in range(procs)
    ]
    peak = 0
    samples = 0
    t0 = time.perf_counter()
    while any(c.poll() is None for c in children):
        peak = max(peak, _block_bytes(str(root)))
        samples += 1
        time.sleep(0.002)
    seconds = time.perf_counter() - t0
    reports = []
    for c in children:
        out, _ = c.communicate()
        if c.returncode != 0:
            raise SystemExit(f"writer exited {c.returncode}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    settled = _block_bytes(str(root))
    peak = max(peak, settled)
    dropped: dict[str, int] = {}
    for r in reports:
        for cause, n in r["dropped"].items():
            dropped[cause] = dropped.get(cause, 0) + int(n)
    return {
        "procs": procs,
        "step_ms": step_ms,
        "max_bytes": max_bytes,
        "stored_bytes": sum(int(r["stored"]) for r in reports) * FILE_BYTES,
        "peak_ratio": round(peak / max_bytes, 3),
        "settled_ratio": round(settled / max_bytes, 3),
        "samples": samples,
        "seconds": round(seconds, 2),
        "dropped": dropped,
        "dropped_fraction": round(sum(dropped.values()) / (procs * files), 3),
        "evicted_files": sum(int(r["evicted"]) for r in reports),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=5)
    ap.add_argument("--max-files", type=int, default=300)
    ap.add_argument("--files", type=int, default=1000, help="blocks each writer stores")
    ap.add_argument("--job", type=int, default=8, help="keys per store job")
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument(
        "--step-ms", type=float, default=5.0,
        help="a writer submits at most one job per step (0: back to back)",
    )
    ap.add_argument("--root", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        _worker(args)
        return
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="fstier-multi-"))
    try:
        res = run(args.procs, args.max_files, args.files, args.job, args.settle_s, root, args.step_ms)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(res))
        return
    print(
        f"{res['procs']} processes, max_bytes {res['max_bytes']} B ({args.max_files} files), "
        f"{res['stored_bytes'] / res['max_bytes']:.1f}x max_bytes stored in {res['seconds']} s: "
        f"peak {res['peak_ratio']:.2f}x, settled {res['settled_ratio']:.2f}x max_bytes "
        f"({res['samples']} samples); dropped {res['dropped'] or 0} ({res['dropped_fraction']:.0%} of stores); "
        f"evicted {res['evicted_files']} files"
    )


if __name__ == "__main__":
    main()
