"""Time to full HIT after a restart: vLLM's tiering manager promoting one
request whose whole prefix is on disk, FstierTier vs vLLM's fs tier.

What a restarted engine does before the first token of a long prompt whose
KV chunks a previous run stored: its scheduler asks vLLM 0.33's real
``TieringOffloadingManager`` about every chunk key of the request, every
step (``lookup`` of each key in order, stopping at a MISS, as
``OffloadingConnectorScheduler._maximal_prefix_lookup`` does), then ends the
step (``on_schedule_end``: the tier's async lookup batch is flushed, finished
promotion jobs are polled, pending promotions are submitted as one load job).
Keys answer RETRY (lookup in flight), HIT_PENDING (promotion in flight),
then HIT once every chunk is in the primary tier. This benchmark times that,
from the first lookup to the step where every key is a HIT:

- **lookup s**: until no key answers RETRY (the tier's presence batch done);
- **full HIT s**: until every key answers HIT (the promotion loaded too);
- **steps**: scheduler steps it took.

Each measurement is a restart: the files were stored by an earlier manager
(``submit_store`` of the primary tier's rows), the page cache, dentries and
inodes are dropped (``/proc/sys/vm/drop_caches``, as root; the table says
if it was not possible), and a fresh spec + manager are built on the same
root. The loaded rows are compared with what was stored.

Two drivers, because vLLM has two kinds of engine loop:

- ``spin``: steps back to back, holding the GIL like the in-process engine
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``LLM(...)``) whose ``step()``
  never sleeps: a background thread that released the GIL for a system call
  can wait up to ``sys.getswitchinterval()`` (5 ms) to get it back;
- ``sleep``: 1 ms of sleep per idle step, like the multi-process engine core.

Contenders, in the same process and run, alternating order per rep:
``vllm`` (vLLM's fs tier on its native path, ``vllm.fs_io_C``: on a CPU-only
machine the script builds empty stubs for the CUDA libraries that module
names but never calls and re-executes itself, as bench_vllm_tier.py does)
and ``fstier`` (FstierTier with its shipped defaults on fstier's native
path; ``fstier-py`` adds its Python path). Nothing here changes
``sys.setswitchinterval``.

    python benchmarks/bench_vllm_promotion.py [--files 256,2048] [--row 64KiB]
        [--reps 3] [--drivers spin,sleep] [--tiers vllm,fstier] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _raw import drop_caches  # noqa: E402
from bench_vllm_tier import _ensure_vllm_native, _vllm_path  # noqa: E402

from fstier.units import parse_size  # noqa: E402

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
TIERS = ("vllm", "fstier", "fstier-py")
DRIVERS = ("spin", "sleep")
#: give up on a measurement after this long (a bug, not a figure)
STEP_LIMIT_S = 120.0


def _tier_config(tier: str, root: Path) -> dict[str, Any]:
    if tier == "vllm":
        return {"type": "fs", "root_dir": str(root)}
    cfg: dict[str, Any] = {"type": "FstierTier", "module_path": "fstier.integrations.vllm",
                           "root_dir": str(root)}
    if tier == "fstier-py":
        cfg["native_io"] = "off"
    return cfg


def _spec(row: int, rows: int, tier_cfg: dict[str, Any]) -> tuple[Any, str]:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    engine_id = f"fstier-promo-{uuid.uuid4().hex[:10]}"
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=row,
        enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": rows * row,
                      "secondary_tiers": [tier_cfg]},
        engine_id=engine_id,
        model=OffloadingModelConfig(name="bench/promotion", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )
    return OffloadingSpecFactory.create_spec(cfg), engine_id


class Engine:
    """One engine's offloading manager (a restart is a new one)."""

    def __init__(self, row: int, rows: int, tier_cfg: dict[str, Any]) -> None:
        self.spec, self.engine_id = _spec(row, rows, tier_cfg)
        self.manager = self.spec.get_manager()
        self.view = self.manager.primary_tier.get_kv_memoryview()
        self.flat = self.view.cast("B")
        self.arr = np.frombuffer(self.flat, dtype=np.uint8).reshape(rows, row)
        self.tier = self.manager.secondary_tiers[0]

    @property
    def io_path(self) -> str:
        fs = getattr(self.tier, "fstier", None)
        return fs.io_path.backend if fs is not None else "vllm.fs_io_C"

    def close(self) -> None:
        # Our views first: vLLM unmaps its region at shutdown.
        del self.arr
        self.flat.release()
        self.view.release()
        self.manager.shutdown()
        for p in glob.glob(f"/dev/shm/vllm_offload_{self.engine_id}.mmap*"):
            with contextlib.suppress(OSError):
                os.unlink(p)


def _keys(seed: str, n: int) -> list[bytes]:
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(xxhash.xxh3_128_digest(f"{seed}/{i}".encode()) * 2, 0) for i in range(n)]


def fill(eng: Engine, keys: list[bytes], job_rows: int = 64) -> list[int]:
    """Store rows 0..n-1 as ``keys`` through the tier (the earlier run)."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    n = len(keys)
    rng = np.random.default_rng(len(keys))
    eng.arr[:n] = rng.integers(0, 256, size=(n, eng.arr.shape[1]), dtype=np.uint8)
    sums = [xxhash.xxh3_64_intdigest(eng.arr[i]) for i in range(n)]
    ctx = ReqContext(req_id="fill")
    jobs: dict[int, TransferJob] = {}
    for j, start in enumerate(range(0, n, job_rows)):
        ids = np.arange(start, min(n, start + job_rows), dtype=np.int32)
        jobs[10_000 + j] = TransferJob(job_id=10_000 + j, keys=keys[start : start + len(ids)],
                                       chunk_ids=ids, is_promotion=False, req_context=ctx)
    for job in jobs.values():
        eng.tier.submit_store(job)
    pending = set(jobs)
    deadline = time.monotonic() + STEP_LIMIT_S
    while pending:
        for r in eng.tier.get_finished_jobs():
            if r.success:
                pending.discard(r.job_id)
            else:  # dropped (e.g. the tier's write budget under a flood): store it again
                eng.tier.submit_store(jobs[r.job_id])
        if time.monotonic() > deadline:
            raise SystemExit(f"fill: {len(pending)} store jobs did not succeed")
        time.sleep(0.005)
    return sums


def promote(eng: Engine, keys: list[bytes], driver: str) -> dict[str, float]:
    """Drive the manager like vLLM's scheduler until every key is a HIT."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

    mgr = eng.manager
    ctx = ReqContext(req_id=f"promo-{uuid.uuid4().hex[:6]}")
    n = len(keys)
    HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
    first = ScheduleEndContext((ctx.req_id,), ())
    later = ScheduleEndContext((), ())
    t0 = time.perf_counter()
    with mgr.lock:
        mgr.on_new_request(ctx)
    steps = 0
    t_lookup: float | None = None
    sched_s = 0.0
    while True:
        steps += 1
        s0 = time.perf_counter()
        with mgr.lock:
            hits = retry = 0
            for k in keys:
                r = mgr.lookup(k, ctx)
                if r is MISS:
                    raise SystemExit(f"{eng.tier.tier_type}: a stored key answered MISS after {steps} steps")
                hits += r is HIT
                retry += r is RETRY
            done = hits == n
            if not done:
                mgr.on_schedule_end(first if steps == 1 else later)
        sched_s += time.perf_counter() - s0
        now = time.perf_counter()
        if t_lookup is None and retry == 0:
            t_lookup = now - t0
        if done:
            break
        if now - t0 > STEP_LIMIT_S:
            raise SystemExit(f"{eng.tier.tier_type}: no full HIT after {STEP_LIMIT_S:.0f} s")
        if driver == "sleep":
            time.sleep(0.001)
    total = time.perf_counter() - t0
    with mgr.lock:
        mgr.on_request_finished(ctx)
        mgr.on_schedule_end(later)
    return {"lookup_s": t_lookup or total, "hit_s": total, "steps": steps, "sched_s": sched_s}


def one(args: argparse.Namespace, base: Path, tier: str, nfiles: int, driver: str, rep: int) -> dict[str, Any]:
    root = base / f"{tier}-{nfiles}-{driver}-{rep}"
    cfg = _tier_config(tier, root)
    keys = _keys(f"{tier}/{nfiles}/{driver}/{rep}/{uuid.uuid4().hex}", nfiles)
    rows = nfiles + 64
    with _vllm_path(native=True):
        first = Engine(args.row, rows, cfg)
        try:
            sums = fill(first, keys)
        finally:
            first.close()
        dropped = drop_caches()
        second = Engine(args.row, rows, cfg)
        try:
            second.arr[:] = 0
            out = promote(second, keys, driver)
            out["io_path"] = second.io_path
            # Which primary row each key landed in is the manager's choice:
            # compare the set of row checksums.
            got = sorted(xxhash.xxh3_64_intdigest(second.arr[i]) for i in range(rows))
            want = sorted(sums)
            missing = len(set(want) - set(got))
            if missing:
                raise SystemExit(f"{tier}: {missing} of {nfiles} rows differ after promotion")
        finally:
            second.close()
    shutil.rmtree(root, ignore_errors=True)
    out["cold"] = dropped
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("vllm").setLevel(logging.WARNING)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-vllm-promo-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    try:
        for nfiles in args.files:
            for driver in args.drivers:
                per: dict[str, list[dict[str, Any]]] = {t: [] for t in args.tiers}
                for rep in range(args.reps):
                    order = args.tiers[rep % len(args.tiers):] + args.tiers[:rep % len(args.tiers)]
                    for t in order:
                        r = one(args, base, t, nfiles, driver, rep)
                        per[t].append(r)
                        if not args.quiet:
                            print(f"  {nfiles:>5} files {driver:<5} {t:<9} lookup {r['lookup_s']:7.3f} s"
                                  f"  full HIT {r['hit_s']:7.3f} s  steps {r['steps']:6d}"
                                  f"  load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
                entry: dict[str, Any] = {"files": nfiles, "driver": driver}
                for t in args.tiers:
                    for m in ("lookup_s", "hit_s", "steps", "sched_s"):
                        entry[f"{t}_{m}"] = statistics.median(r[m] for r in per[t])
                        entry[f"{t}_{m}_all"] = [r[m] for r in per[t]]
                    entry[f"{t}_cold"] = all(r["cold"] for r in per[t])
                    entry[f"{t}_io_path"] = per[t][0]["io_path"]
                if "vllm" in args.tiers:
                    for t in args.tiers:
                        entry[f"{t}_hit_ratio"] = entry[f"{t}_hit_s"] / entry["vllm_hit_s"]
                rows.append(entry)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    return {"rows": rows}


def table(res: dict[str, Any]) -> str:
    tiers = res["tiers"]
    head = "| files | driver | " + " | ".join(
        f"{t} lookup s | {t} full HIT s" for t in tiers) + " | " + " | ".join(
        f"{t} / vllm" for t in tiers if t != "vllm") + " |"
    lines = [head, "|" + "---:|" * (2 + 2 * len(tiers) + len([t for t in tiers if t != "vllm"]))]
    for e in res["rows"]:
        cells = [str(e["files"]), e["driver"]]
        for t in tiers:
            cells += [f"{e[f'{t}_lookup_s']:.3f}", f"{e[f'{t}_hit_s']:.3f}"]
        cells += [f"{e[f'{t}_hit_ratio']:.2f}x" for t in tiers if t != "vllm" and f"{t}_hit_ratio" in e]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"command: {res['command']}")
    lines.append(f"load average before / after: {res['load_before']} / {res['load_after']}; "
                 f"page cache dropped: {res['cold']}; vLLM I/O path: {res['vllm_io_path']}; "
                 f"I/O paths: {res['io_paths']}; "
                 f"switch interval: {res['switch_interval']} s")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--dir", help="directory for the roots (default: a temporary one in /var/tmp)")
    ap.add_argument("--files", default="256,2048", help="files (chunks) of the request's prefix")
    ap.add_argument("--row", default="64KiB", help="bytes per chunk row (one file's payload)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--drivers", default=",".join(DRIVERS))
    ap.add_argument("--tiers", default="vllm,fstier", help="contenders, from " + ",".join(TIERS))
    ap.add_argument("--allow-vllm-python", action="store_true",
                    help="do not insist on vLLM's native path (vllm.fs_io_C)")
    ap.add_argument("--json", help="write results as JSON to this file")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    args.files = [int(x) for x in args.files.split(",") if x]
    args.row = parse_size(args.row)
    args.drivers = [d for d in args.drivers.split(",") if d]
    args.tiers = [t for t in args.tiers.split(",") if t]
    if set(args.tiers) - set(TIERS) or set(args.drivers) - set(DRIVERS):
        ap.error(f"--tiers from {TIERS}, --drivers from {DRIVERS}")
    _ensure_vllm_native(args.allow_vllm_python, __file__)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    t0 = time.perf_counter()
    res = run(args)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["load_before"] = load_before
    res["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    res["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    res["command"] = " ".join(["python", "benchmarks/bench_vllm_promotion.py", *sys.argv[1:]])
    from vllm.v1.kv_offload.tiering.fs import io as vllm_fs_io

    res["vllm_io_path"] = "C extension (vllm.fs_io_C)" if vllm_fs_io._HAS_FSIO_C else "pure Python"
    from fstier.io import native as fstier_native

    res["fstier_native"] = fstier_native.status()._asdict()
    res["switch_interval"] = sys.getswitchinterval()
    res["io_paths"] = {t: res["rows"][0][f"{t}_io_path"] for t in args.tiers}
    res["cold"] = all(e[f"{t}_cold"] for e in res["rows"] for t in args.tiers)
    res["tiers"], res["reps"] = args.tiers, args.reps
    print(table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
