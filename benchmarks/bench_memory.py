"""Memory bound: store and load ``--total`` (10 GiB) through a ``--pool`` (1 GiB) host pool.

The scheduler-side loop of an engine, without the GPU: a bounded
:class:`~fstier.slots.host_pool.HostBlockPool` (prefaulted, so it is resident from
the start), jobs of ``--chunk`` slots submitted to :class:`~fstier.manager.FsTier`
whenever enough slots are free, slots freed as jobs finish. Each slot gets a
stamp (its file index) in its first and last 8 bytes before the store, and
every loaded slot is checked for the right stamp, so the run proves the bytes
went through and came back. Nothing of the workload is kept in Python
objects beyond the in-flight jobs.

Peak RSS is this process's ``ru_maxrss`` (which counts the touched shared
pool pages), sampled alongside ``VmRSS`` split into anonymous and shared
memory every 50 ms by a watcher thread. The target is peak <= pool + 300 MiB,
where the 300 MiB must cover the interpreter, torch (imported by the pool
module: ~220 MiB by itself here) and fstier.

    .venv/bin/python benchmarks/bench_memory.py [--total 10GiB] [--pool 1GiB] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import xxhash  # noqa: E402

from fstier.config import parse_config  # noqa: E402
from fstier.keys import BlockKey  # noqa: E402
from fstier.manager import FsTier  # noqa: E402
from fstier.slots.host_pool import HostBlockPool  # noqa: E402
from fstier.units import parse_size  # noqa: E402

MIB = 1 << 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class RssWatcher(threading.Thread):
    """Samples VmRSS / RssAnon / RssShmem; keeps only the maxima."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.max_rss = self.max_anon = self.max_shmem = 0
        self._stop_evt = threading.Event()

    def run(self) -> None:
        while not self._stop_evt.wait(0.05):
            self.sample()

    def sample(self) -> None:
        self.max_rss = max(self.max_rss, _status_kib("VmRSS"))
        self.max_anon = max(self.max_anon, _status_kib("RssAnon"))
        self.max_shmem = max(self.max_shmem, _status_kib("RssShmem"))

    def stop(self) -> None:
        self._stop_evt.set()
        self.join()
        self.sample()


def _finished(tier: FsTier) -> list[Any]:
    """Finished jobs, sleeping 1 ms first when there are none (no busy spin
    stealing one of the two cores from the I/O threads)."""
    done = tier.get_finished()
    if not done:
        time.sleep(0.001)
    return done


def _key(i: int) -> BlockKey:
    return BlockKey(xxhash.xxh3_128_digest(b"mem" + i.to_bytes(8, "big")), 0)


def run(root: Path, total: int, pool_bytes: int, page: int, chunk: int) -> dict[str, Any]:
    layers = page // (64 << 10)
    cfg = parse_config(
        {
            "tier": {"root_dir": str(root), "max_write_queue_seconds": 600.0},
            "model": {
                "name": "bench/memory",
                "dtype": "float16",
                "groups": [{"block_size": 16, "num_layers": layers, "num_kv_heads": 8, "head_size": 128}],
            },
        }
    )
    rss_start = _status_kib("VmRSS")
    watcher = RssWatcher()
    watcher.start()
    pool = HostBlockPool(pool_bytes // page, page)
    rss_pool = _status_kib("VmRSS")
    tier = FsTier(cfg, pool)
    nfiles = total // page
    stamp_at = page - 8
    result: dict[str, Any] = {}
    try:
        pending: dict[int, list[int]] = {}
        t0 = time.perf_counter()
        for job, start in enumerate(range(0, nfiles, chunk)):
            n = min(chunk, nfiles - start)
            while pool.num_free < n:
                for r in _finished(tier):
                    if not r.success:
                        raise SystemExit(f"store failed: {r}")
                    pool.free(pending.pop(r.job_id))
            slots = pool.alloc(n)
            for k, s in enumerate(slots):
                view = pool.slot_view(s)
                stamp = (start + k).to_bytes(8, "little")
                view[:8] = stamp
                view[stamp_at : stamp_at + 8] = stamp
            pending[job] = slots
            tier.submit_store(job, [_key(start + k) for k in range(n)], slots)
        while pending:
            for r in _finished(tier):
                if not r.success:
                    raise SystemExit(f"store failed: {r}")
                pool.free(pending.pop(r.job_id))
        store_s = time.perf_counter() - t0

        pend_load: dict[int, tuple[int, list[int]]] = {}
        t0 = time.perf_counter()
        checked = 0
        starts = list(range(0, nfiles, chunk))
        job = 0
        while starts or pend_load:
            while starts and pool.num_free >= min(chunk, nfiles - starts[0]):
                start = starts.pop(0)
                n = min(chunk, nfiles - start)
                slots = pool.alloc(n)
                pend_load[job] = (start, slots)
                tier.submit_load(job, [_key(start + k) for k in range(n)], slots)
                job += 1
            for r in _finished(tier):
                start, slots = pend_load.pop(r.job_id)
                if not r.success:
                    raise SystemExit(f"load failed: {r}")
                for k, s in enumerate(slots):
                    view = pool.slot_view(s)
                    want = (start + k).to_bytes(8, "little")
                    if view[:8] != want or view[stamp_at : stamp_at + 8] != want:
                        raise SystemExit(f"file {start + k}: wrong bytes in slot {s}")
                    checked += 1
                pool.free(slots)
        load_s = time.perf_counter() - t0
        result = {
            "files": nfiles,
            "checked": checked,
            "store_gbps": round(nfiles * page / store_s / 1e9, 3),
            "load_gbps": round(nfiles * page / load_s / 1e9, 3),
        }
    finally:
        tier.close()
        watcher.stop()
        pool.close()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result.update(
        total_bytes=nfiles * page,
        pool_bytes=pool.num_slots * page,
        page_bytes=page,
        chunk=chunk,
        rss_before_pool_mib=round(rss_start / 1024, 1),
        rss_after_pool_mib=round(rss_pool / 1024, 1),
        peak_rss_mib=round(peak_kib / 1024, 1),
        peak_anon_mib=round(watcher.max_anon / 1024, 1),
        peak_shmem_mib=round(watcher.max_shmem / 1024, 1),
        bound_mib=round(pool_bytes / MIB + 300, 1),
    )
    result["within_bound"] = result["peak_rss_mib"] <= result["bound_mib"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=None)
    ap.add_argument("--total", default="10GiB")
    ap.add_argument("--pool", default="1GiB")
    ap.add_argument("--page", default="2MiB", help="file payload (multiple of 64KiB)")
    ap.add_argument("--chunk", type=int, default=32, help="files per job")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="fstier-mem-", dir="/var/tmp")) if args.root is None else args.root
    try:
        res = run(base, parse_size(args.total), parse_size(args.pool), parse_size(args.page), args.chunk)
    finally:
        if args.root is None:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(
        "| total | pool | files | store GB/s | load GB/s | RSS before pool | after pool "
        "| peak RSS | peak anon | peak shmem | bound | ok |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    print(
        f"| {res['total_bytes'] / 2**30:.0f} GiB | {res['pool_bytes'] / 2**30:.2f} GiB | {res['files']:,} | "
        f"{res['store_gbps']:.2f} | {res['load_gbps']:.2f} | {res['rss_before_pool_mib']} MiB | "
        f"{res['rss_after_pool_mib']} MiB | {res['peak_rss_mib']} MiB | {res['peak_anon_mib']} MiB | "
        f"{res['peak_shmem_mib']} MiB | {res['bound_mib']} MiB | {'yes' if res['within_bound'] else 'NO'} |"
    )


if __name__ == "__main__":
    main()
