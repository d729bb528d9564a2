"""vLLM's built-in fs tier vs FstierTier, on vLLM's own primary memory.

Four contenders, built by vLLM's ``SecondaryTierFactory`` over the SAME
prefaulted primary memoryview (vLLM's ``SharedOffloadRegion`` of a
``TieringOffloadingSpec``), with the same keys, in sibling directories of
one ``--dir``, each with its shipped defaults (vLLM fs: 16 read + 16 write
threads, O_DIRECT, no checksum; fstier: 8 read + 4 write threads, O_DIRECT,
xxh3 checksums ON, header and key checked on every load):

- ``vllm``: vLLM's fs tier on its native path (``vllm.fs_io_C``, what every
  GPU host runs; on a CPU-only machine this script builds three empty stub
  libraries for the CUDA libraries it names but never calls, re-executes
  itself with them on ``LD_LIBRARY_PATH``, and checks ``_HAS_FSIO_C``);
- ``vllm-py``: the same tier on its pure-Python path (``_HAS_FSIO_C``
  switched off around its phases only);
- ``fstier``: FstierTier on fstier's native path (``fstier.io._native``);
- ``fstier-py``: FstierTier on its pure-Python path (``native_io: off``);

plus the **C ceiling** (``benchmarks/ceiling_loop.c``, built with ``cc``):
the same files (4096 + row bytes, O_DIRECT) published with O_TMPFILE +
linkat and read back cold, no checksum, no Python, 8 store / 16 load
threads; each of its 4096 fan-out directories made by the first store into
it, as the tiers' stores make theirs in the bench's fresh roots
(``--ceiling-fanout existing``: all made before its timed stores). They are driven
through the tier API the tiering manager uses: ``submit_store`` /
``submit_load`` of ``TransferJob``s (``--job-rows`` rows each, all submitted
at once, like many requests' cascades) and ``get_finished_jobs`` polled
until every job finished.

Per row size (64 KiB, 256 KiB, 1 MiB, 2 MiB, 8 MiB by default), ``--total``
bytes of rows:

- **store** GB/s to completion (new files; new keys every pass);
- **cold load** GB/s: page cache dropped (``drop_caches``, as root), rows
  zeroed, every row loaded back and compared with what was stored;
- **CPU per file**: user and system CPU time of the process (all threads)
  over the files moved: ``os.times``' quantities, read with
  ``resource.getrusage`` (microseconds; ``os.times`` counts 10 ms ticks,
  too coarse for a few thousand files).

Lookup: 4,096 keys whose files exist (the 64 KiB rows), asked through
``lookup``/``on_schedule_end`` as the manager does until every key resolved;
**cold** after ``drop_caches``, **warm** right after for a new request.

Passes rotate which contender runs first (``--reps``, default 3); the table
reports the median per contender and ratios against vLLM native and the C
ceiling from the same run.
``--syscalls`` also counts system calls per file on both sides with
``strace -c`` attached to a child doing only the timed I/O phase.

    python benchmarks/bench_vllm_tier.py [--dir /var/tmp/x] [--total 256MiB]
        [--sizes 64KiB,256KiB,1MiB,2MiB,8MiB] [--reps 2] [--json out.json]
        [--plot docs/img/vllm_tier_gbps.png] [--syscalls]
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import logging
import os
import resource
import shutil
import signal
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

from fstier.units import parse_size  # noqa: E402

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
TIERS = ("vllm", "vllm-py", "fstier", "fstier-py")
#: the contender every ratio is taken against
BASE = "vllm"
CEILING_SRC = Path(__file__).resolve().parent / "ceiling_loop.c"
STUB_DIR = Path("/tmp/fstier-vllm-stubs")
_STUB_LIBS = ("libc10_cuda.so", "libtorch_cuda.so", "libnvrtc.so.13")
LOOKUP_KEYS = 4096


def _cfg(row: int, rows: int, engine_id: str) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=row,
        enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": rows * row,
                      "secondary_tiers": []},
        engine_id=engine_id,
        model=OffloadingModelConfig(name="bench/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


class Bench:
    """One row size: vLLM's primary region plus both tiers over it."""

    def __init__(self, root: Path, row: int, rows: int, job_rows: int,
                 fstier_options: dict[str, Any] | None = None) -> None:
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

        self.row, self.rows, self.job_rows = row, rows, job_rows
        fstier_options = fstier_options or {}
        self.engine_id = f"fstier-bench-{uuid.uuid4().hex[:10]}"
        self.spec = OffloadingSpecFactory.create_spec(_cfg(row, rows, self.engine_id))
        self.manager = self.spec.get_manager()  # prefaults the whole region
        self.view = self.manager.primary_tier.get_kv_memoryview()
        self.flat = self.view.cast("B")
        self.arr = np.frombuffer(self.flat, dtype=np.uint8).reshape(rows, row)
        self.dirs = {t: root / t for t in TIERS}
        configs = {
            "vllm": {"type": "fs", "root_dir": str(self.dirs["vllm"])},
            "vllm-py": {"type": "fs", "root_dir": str(self.dirs["vllm-py"])},
            "fstier": {"type": "FstierTier", "module_path": "fstier.integrations.vllm",
                       "root_dir": str(self.dirs["fstier"]), **fstier_options},
            "fstier-py": {"type": "FstierTier", "module_path": "fstier.integrations.vllm",
                          "root_dir": str(self.dirs["fstier-py"]), **fstier_options,
                          "native_io": "off"},
        }
        self.tiers = {
            t: SecondaryTierFactory.create_secondary_tier(c, self.view, self.spec)
            for t, c in configs.items()
        }
        self._job = 0

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.shutdown()
        del self.arr
        self.flat.release()
        self.manager.shutdown()
        for p in glob.glob(f"/dev/shm/vllm_offload_{self.engine_id}.mmap*"):
            with contextlib.suppress(OSError):
                os.unlink(p)

    def keys(self, seed: str) -> list[bytes]:
        from vllm.v1.kv_offload.base import make_offload_key

        return [make_offload_key(xxhash.xxh3_128_digest(f"{seed}/{i}".encode()) * 2, 0)
                for i in range(self.rows)]

    def fill(self, seed: int) -> list[int]:
        rng = np.random.default_rng(seed)
        for i in range(0, self.rows, 64):
            n = min(64, self.rows - i)
            self.arr[i : i + n] = rng.integers(0, 256, size=(n, self.row), dtype=np.uint8)
        return [xxhash.xxh3_64_intdigest(self.arr[i]) for i in range(self.rows)]

    def _run_jobs(self, tier_name: str, keys: list[bytes], promotion: bool) -> tuple[float, tuple[float, float], int]:
        """Submit every job, poll to completion. Returns (seconds, (user_s,
        sys_s), failed jobs)."""
        with _vllm_path(native=tier_name != "vllm-py"):
            return self._run_jobs_now(tier_name, keys, promotion)

    def _run_jobs_now(
        self, tier_name: str, keys: list[bytes], promotion: bool
    ) -> tuple[float, tuple[float, float], int]:
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.tiering.base import TransferJob

        tier = self.tiers[tier_name]
        ctx = ReqContext(req_id=f"bench-{self._job}")
        jobs = []
        for start in range(0, len(keys), self.job_rows):
            self._job += 1
            ids = np.arange(start, min(len(keys), start + self.job_rows), dtype=np.int32)
            jobs.append(TransferJob(job_id=self._job, keys=keys[start : start + len(ids)],
                                    chunk_ids=ids, is_promotion=promotion, req_context=ctx))
        pending = {j.job_id for j in jobs}
        failed = 0
        c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for j in jobs:
            (tier.submit_load if promotion else tier.submit_store)(j)
        while pending:
            for r in tier.get_finished_jobs():
                pending.discard(r.job_id)
                failed += not r.success
            if pending:
                time.sleep(0.0005)
        secs, c1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        return secs, (c1.ru_utime - c0.ru_utime, c1.ru_stime - c0.ru_stime), failed

    def store(self, tier: str, keys: list[bytes]) -> tuple[float, tuple[float, float], int]:
        return self._run_jobs(tier, keys, promotion=False)

    def load(self, tier: str, keys: list[bytes], sums: list[int]) -> tuple[float, tuple[float, float], int]:
        dropped = drop_caches()
        self.arr[:] = 0
        secs, cpu, failed = self._run_jobs(tier, keys, promotion=True)
        bad = sum(xxhash.xxh3_64_intdigest(self.arr[i]) != sums[i] for i in range(self.rows))
        if bad or failed:
            raise SystemExit(f"{tier}: {failed} failed load jobs, {bad} rows differ after load")
        return secs, cpu, int(dropped)

    def lookup(self, tier_name: str, keys: list[bytes], tag: str) -> tuple[float, float]:
        """Seconds until every key resolved, and scheduler-thread seconds spent in lookup()."""
        with _vllm_path(native=tier_name != "vllm-py"):
            return self._lookup_now(tier_name, keys, tag)

    def _lookup_now(self, tier_name: str, keys: list[bytes], tag: str) -> tuple[float, float]:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

        tier = self.tiers[tier_name]
        ctx = ReqContext(req_id=f"lookup-{tag}-{uuid.uuid4().hex[:6]}")
        end = ScheduleEndContext((), ())
        tier.on_new_request(ctx)
        sync = 0.0
        t0 = time.perf_counter()
        while True:
            s0 = time.perf_counter()
            answers = [tier.lookup(k, ctx) for k in keys]
            sync += time.perf_counter() - s0
            if all(a is LookupResult.HIT for a in answers):
                break
            if any(a is LookupResult.MISS for a in answers):
                raise SystemExit(f"{tier_name}: lookup missed a stored key")
            tier.on_schedule_end(end)
            time.sleep(0.0005)
        total = time.perf_counter() - t0
        tier.on_request_finished(ctx)
        return total, sync


@contextlib.contextmanager
def _vllm_path(*, native: bool) -> Any:
    """vLLM's fs tier reads ``_HAS_FSIO_C`` / ``_HAS_BATCH_LOOKUP_C`` at call
    time: switch them off for the ``vllm-py`` contender's phases only."""
    from vllm.v1.kv_offload.tiering.fs import io as vio
    from vllm.v1.kv_offload.tiering.fs import manager as vman

    saved = (vio._HAS_FSIO_C, vman._HAS_BATCH_LOOKUP_C)
    if not native:
        vio._HAS_FSIO_C = False
        vman._HAS_BATCH_LOOKUP_C = False
    try:
        yield
    finally:
        vio._HAS_FSIO_C, vman._HAS_BATCH_LOOKUP_C = saved


def _ensure_vllm_native(allow_python: bool, script: str = __file__) -> None:
    """Make ``vllm.fs_io_C`` importable on a CPU-only machine: it names three
    CUDA libraries (DT_NEEDED) whose symbols it never uses. Build empty
    stubs for them and re-execute this script with them on
    LD_LIBRARY_PATH (the loader reads it only at process start); ``script``
    is the benchmark to re-execute (this one by default)."""
    from vllm.v1.kv_offload.tiering.fs import io as vio

    if vio._HAS_FSIO_C or allow_python:
        return
    if os.environ.get("FSTIER_BENCH_STUBS") == "1":
        raise SystemExit("vllm.fs_io_C still does not import with the stub libraries on "
                         "LD_LIBRARY_PATH; pass --allow-vllm-python to compare with its Python path only")
    STUB_DIR.mkdir(parents=True, exist_ok=True)
    src = STUB_DIR / "stub.c"
    src.write_text("void fstier_stub(void){}\n")
    for so in _STUB_LIBS:
        if not (STUB_DIR / so).exists():
            subprocess.run(["cc", "-shared", "-fPIC", f"-Wl,-soname,{so}", "-o", str(STUB_DIR / so), str(src)],
                           check=True)
    env = dict(os.environ, FSTIER_BENCH_STUBS="1",
               LD_LIBRARY_PATH=f"{STUB_DIR}:{os.environ.get('LD_LIBRARY_PATH', '')}".rstrip(":"))
    os.execve(sys.executable, [sys.executable, script, *sys.argv[1:]], env)


def _build_ceiling() -> Path:
    out = Path(tempfile.gettempdir()) / f"fstier-ceiling-loop-{os.getuid()}"
    if not out.exists() or out.stat().st_mtime < CEILING_SRC.stat().st_mtime:
        subprocess.run(["cc", "-O2", "-pthread", "-o", str(out), str(CEILING_SRC)], check=True)
    return out


def ceiling(binary: Path, root: Path, size: int, rows: int, fanout: str = "lazy") -> dict[str, float]:
    """The C loop's store then cold load of ``rows`` files of ``size`` bytes
    (``fanout``: ``lazy`` or ``existing``, see ``ceiling_loop.c``)."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        def one(mode: str, threads: int) -> dict[str, float]:
            p = subprocess.run([str(binary), mode, str(root), str(rows), str(size), str(threads),
                                fanout, "1"], check=True, capture_output=True, text=True)
            return dict(json.loads(p.stdout))

        st = one("store", 8)
        drop_caches()
        ld = one("load", 16)
        return {"store": st["gb_per_s"], "load": ld["gb_per_s"],
                "store_user_us": st["user_us_per_file"], "store_sys_us": st["sys_us_per_file"],
                "load_user_us": ld["user_us_per_file"], "load_sys_us": ld["sys_us_per_file"]}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("vllm").setLevel(logging.WARNING)
    results: dict[str, Any] = {"sizes": [], "lookup": None, "cold": None}
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-vllm-tier-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    binary = None if args.no_ceiling else _build_ceiling()
    tiers = args.tiers
    for size in args.sizes:
        rows = max(args.min_rows, args.total // size)
        b = Bench(base / f"row{size}", size, rows, args.job_rows, args.fstier_options)
        try:
            sums = b.fill(size)
            metrics = ("store", "load", "store_user", "store_sys", "load_user", "load_sys")
            per: dict[str, dict[str, list[float]]] = {t: {m: [] for m in metrics} for t in tiers}
            ceil: list[dict[str, float]] = []
            cold = True
            for rep in range(args.reps):
                order = tiers[rep % len(tiers):] + tiers[:rep % len(tiers)]
                for t in order:
                    keys = b.keys(f"{size}/{rep}/{t}")
                    s, (su, ss), failed = b.store(t, keys)
                    if failed:
                        raise SystemExit(f"{t}: {failed} failed store jobs at {size} B rows")
                    ld, (lu, ls), dropped = b.load(t, keys, sums)
                    cold = cold and bool(dropped)
                    nbytes = rows * size
                    for m, v in zip(metrics, (nbytes / s / 1e9, nbytes / ld / 1e9, su / rows * 1e6,
                                              ss / rows * 1e6, lu / rows * 1e6, ls / rows * 1e6), strict=True):
                        per[t][m].append(v)
                    if size == min(args.sizes) and rep == 0 and rows >= LOOKUP_KEYS and not args.no_lookup:
                        lk = keys[:LOOKUP_KEYS]
                        drop_caches()
                        c_total, c_sync = b.lookup(t, lk, "cold")
                        w_total, w_sync = b.lookup(t, lk, "warm")
                        results.setdefault("lookup_by_tier", {})[t] = {
                            "cold_s": c_total, "cold_sync_s": c_sync,
                            "warm_s": w_total, "warm_sync_s": w_sync,
                        }
                    if not args.quiet:
                        print(f"  {size >> 10:>5} KiB rows x {rows}: {t:<9} store {nbytes / s / 1e9:5.2f} GB/s"
                              f"  load {nbytes / ld / 1e9:5.2f} GB/s  user us/file {su / rows * 1e6:5.0f}",
                              file=sys.stderr, flush=True)
                if binary is not None:
                    c = ceiling(binary, base / f"row{size}" / "ceiling", size, rows, args.ceiling_fanout)
                    ceil.append(c)
                    if not args.quiet:
                        print(f"  {size >> 10:>5} KiB rows x {rows}: C ceiling store {c['store']:5.2f} GB/s"
                              f"  load {c['load']:5.2f} GB/s", file=sys.stderr, flush=True)
            results["cold"] = cold if results["cold"] is None else (results["cold"] and cold)
            entry: dict[str, Any] = {"row_bytes": size, "rows": rows}
            for t in tiers:
                for k, v in per[t].items():
                    entry[f"{t}_{k}"] = statistics.median(v)
                    entry[f"{t}_{k}_all"] = v
            if ceil:
                for k in ceil[0]:
                    entry[f"ceiling_{k}"] = statistics.median(c[k] for c in ceil)
                    entry[f"ceiling_{k}_all"] = [c[k] for c in ceil]
            for t in tiers:
                if BASE in tiers:
                    entry[f"{t}_store_ratio"] = entry[f"{t}_store"] / entry[f"{BASE}_store"]
                    entry[f"{t}_load_ratio"] = entry[f"{t}_load"] / entry[f"{BASE}_load"]
                if ceil:
                    entry[f"{t}_store_of_ceiling"] = entry[f"{t}_store"] / entry["ceiling_store"]
                    entry[f"{t}_load_of_ceiling"] = entry[f"{t}_load"] / entry["ceiling_load"]
            results["sizes"].append(entry)
        finally:
            b.close()
            shutil.rmtree(base / f"row{size}", ignore_errors=True)
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    return results


# ---------------------------------------------------------------- syscalls
def _child(args: argparse.Namespace) -> None:
    """Build one tier, wait for the tracer, then store and cold-load."""
    logging.getLogger("vllm").setLevel(logging.WARNING)
    base = Path(args.dir)
    size = args.sizes[0]
    b = Bench(base, size, args.total // size, args.job_rows, args.fstier_options)
    try:
        sums = b.fill(1)
        keys = b.keys(f"sys/{args.child}")
        # Warm the tier's threads and directories outside the traced phase.
        b.store(args.child, b.keys(f"warm/{args.child}")[:64])
        print("READY", flush=True)
        sys.stdin.readline()
        b.store(args.child, keys)
        drop_caches()
        b.arr[:] = 0
        b._run_jobs(args.child, keys, promotion=True)
        if any(xxhash.xxh3_64_intdigest(b.arr[i]) != sums[i] for i in range(b.rows)):
            raise SystemExit("rows differ")
        print("DONE", flush=True)
        sys.stdin.readline()
    finally:
        b.close()


def _strace_counts(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[-1].isidentifier() and parts[-1] != "total" and parts[0][0].isdigit():
            # % time, seconds, usecs/call, calls, [errors,] syscall
            counts[parts[-1]] = int(parts[3])
    return counts


def syscalls(args: argparse.Namespace) -> dict[str, Any]:
    if shutil.which("strace") is None:
        return {"error": "strace not installed"}
    out: dict[str, Any] = {}
    size = min(args.sizes)
    files = args.syscall_total // size
    for t in TIERS:
        with tempfile.TemporaryDirectory(prefix="bench-vllm-sys-", dir="/var/tmp") as d:
            child = subprocess.Popen(
                [sys.executable, __file__, "--child", t, "--dir", d, "--sizes", str(size),
                 "--total", str(args.syscall_total), "--job-rows", str(args.job_rows),
                 "--fstier", json.dumps(args.fstier_options),
                 *(["--vllm-python"] if args.vllm_python else [])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )
            assert child.stdout is not None and child.stdin is not None
            if child.stdout.readline().strip() != "READY":
                raise SystemExit(f"{t}: syscall child did not start")
            summary = Path(d) / "strace.txt"
            tids = [f"-p{tid}" for tid in os.listdir(f"/proc/{child.pid}/task")]
            tracer = subprocess.Popen(["strace", "-f", "-c", "-o", str(summary), *tids],
                                      stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # let strace attach to every thread
            child.stdin.write("\n")
            child.stdin.flush()
            if child.stdout.readline().strip() != "DONE":
                raise SystemExit(f"{t}: syscall child failed")
            tracer.send_signal(signal.SIGINT)
            tracer.wait(timeout=60)
            child.stdin.write("\n")
            child.stdin.flush()
            child.wait(timeout=120)
            if args.strace_keep:
                Path(args.strace_keep).mkdir(parents=True, exist_ok=True)
                shutil.copy(summary, Path(args.strace_keep) / f"strace-{t}.txt")
            counts = _strace_counts(summary)
            if not counts:
                raise SystemExit(f"{t}: no strace summary:\n{summary.read_text()[:2000]}")
            # Per file moved: each file is stored once and loaded once.
            out[t] = {
                k: round(v / files, 2) for k, v in sorted(counts.items(), key=lambda kv: -kv[1]) if v >= files // 2
            }
            out[t]["_total_per_file"] = round(sum(counts.values()) / files, 1)
    return {"row_bytes": size, "files": files, "per_file": out}


# ------------------------------------------------------------------ output
def _label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def table(res: dict[str, Any]) -> str:
    tiers = res["tiers"]
    has_ceiling = any("ceiling_store" in e for e in res["sizes"])
    cols = [*tiers, *(["ceiling"] if has_ceiling else [])]
    lines = []
    for kind, title in (("store", "store GB/s"), ("load", "cold load GB/s")):
        head = f"| row | {' | '.join(cols)} | fstier / vLLM native | fstier / C ceiling |"
        lines += [f"**{title}** (median of {res['reps']} passes)", "", head,
                  "|---" * (len(cols) + 3) + "|"]
        for e in res["sizes"]:
            vals = " | ".join(f"{e[f'{c}_{kind}']:.2f}" for c in cols)
            r = e.get(f"fstier_{kind}_ratio")
            oc = e.get(f"fstier_{kind}_of_ceiling")
            lines.append(f"| {_label(e['row_bytes'])} | {vals} | {'-' if r is None else f'{r:.2f}x'} "
                         f"| {'-' if oc is None else f'{oc:.2f}x'} |")
        lines.append("")
    lines += ["**CPU us per file, user / system** (store; cold load)", "",
              f"| row | {' | '.join(tiers)} |", "|---" * (len(tiers) + 1) + "|"]
    for e in res["sizes"]:
        cells = [f"{e[f'{t}_store_user']:.0f} / {e[f'{t}_store_sys']:.0f}; "
                 f"{e[f'{t}_load_user']:.0f} / {e[f'{t}_load_sys']:.0f}" for t in tiers]
        lines.append(f"| {_label(e['row_bytes'])} | {' | '.join(cells)} |")
    lk = res.get("lookup_by_tier")
    if lk:
        lines += ["", "| lookup of 4,096 keys (until all resolved; scheduler-thread time) | "
                  + " | ".join(lk) + " |", "|---" * (len(lk) + 1) + "|"]
        for phase in ("cold", "warm"):
            cells = [f"{v[f'{phase}_s'] * 1e3:.1f} ms ({v[f'{phase}_sync_s'] * 1e3:.1f} ms)" for v in lk.values()]
            lines.append(f"| {phase} | {' | '.join(cells)} |")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [e["row_bytes"] for e in res["sizes"]]
    labels = [f"{s >> 20} MiB" if s >= 1 << 20 else f"{s >> 10} KiB" for s in sizes]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
    names = {"vllm": "vLLM fs (native)", "vllm-py": "vLLM fs (Python)",
             "fstier": "FstierTier (native, checksums on)", "fstier-py": "FstierTier (Python, checksums on)",
             "ceiling": "C ceiling (no checksum)"}
    cols = [*res["tiers"], *(["ceiling"] if "ceiling_store" in res["sizes"][0] else [])]
    for ax, kind in zip(axes, ("store", "load"), strict=True):
        for c, mark in zip(cols, "osD^x", strict=False):
            ax.plot(labels, [e[f"{c}_{kind}"] for e in res["sizes"]], f"{mark}-", label=names[c])
        ax.set_title("store (to completion)" if kind == "store" else "cold load (page cache dropped)")
        ax.set_xlabel("row (chunk) size")
        ax.set_ylabel("GB/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--dir", help="directory for both tiers' files (default: a temporary one in /var/tmp)")
    ap.add_argument("--sizes", default="64KiB,256KiB,1MiB,2MiB,8MiB")
    ap.add_argument("--total", default="256MiB", help="bytes of rows per size and pass")
    ap.add_argument("--min-rows", type=int, default=32)
    ap.add_argument("--job-rows", type=int, default=16, help="rows per TransferJob")
    ap.add_argument("--reps", type=int, default=3, help="passes per size, rotating which contender goes first")
    ap.add_argument("--tiers", default=",".join(TIERS), help="contenders, from " + ",".join(TIERS))
    ap.add_argument("--no-ceiling", action="store_true", help="skip the C ceiling loop")
    ap.add_argument("--ceiling-fanout", choices=("lazy", "existing"), default="lazy",
                    help="the ceiling's fan-out directories: made by their first store (as the tiers'), or before")
    ap.add_argument("--allow-vllm-python", action="store_true",
                    help="do not insist on vLLM's native path (vllm.fs_io_C)")
    ap.add_argument("--no-lookup", action="store_true")
    ap.add_argument("--syscalls", action="store_true", help="also count syscalls per file with strace")
    ap.add_argument("--syscall-total", default="64MiB")
    ap.add_argument("--strace-keep", help="directory to keep strace -c summaries in")
    ap.add_argument("--json", help="write results as JSON to this file")
    ap.add_argument("--plot", help="write a PNG plot to this file (needs matplotlib)")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--fstier", default="{}", help="JSON of extra FstierTier options (default: shipped defaults)")
    ap.add_argument("--vllm-python", action="store_true",
                    help="run vLLM's fs tier without its C extension (vllm.fs_io_C), i.e. its pure-Python I/O path")
    ap.add_argument("--switch-interval", type=float,
                    help="diagnostic: sys.setswitchinterval(seconds) for both tiers (default: Python's 0.005)")
    ap.add_argument("--child", choices=TIERS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.total = parse_size(args.total)
    args.syscall_total = parse_size(args.syscall_total)
    args.fstier_options = json.loads(args.fstier)
    args.tiers = [t for t in args.tiers.split(",") if t]
    if set(args.tiers) - set(TIERS):
        ap.error(f"--tiers: unknown contender(s) {sorted(set(args.tiers) - set(TIERS))}")
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    if args.vllm_python:
        # vLLM's fs tier imports its C batch I/O optionally; a None entry makes
        # that import fail, so it takes its pure-Python path.
        sys.modules["vllm.fs_io_C"] = None  # type: ignore[assignment]
    if args.child:
        _child(args)
        return
    if not args.vllm_python:
        _ensure_vllm_native(args.allow_vllm_python)
    t0 = time.perf_counter()
    res = run(args)
    if args.syscalls:
        res["syscalls"] = syscalls(args)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["command"] = " ".join(["python", "benchmarks/bench_vllm_tier.py", *sys.argv[1:]])
    from vllm.v1.kv_offload.tiering.fs import io as vllm_fs_io

    res["vllm_io_path"] = "C extension (vllm.fs_io_C)" if vllm_fs_io._HAS_FSIO_C else "pure Python"
    res["tiers"], res["reps"] = args.tiers, args.reps
    from fstier.io import native as fstier_native

    res["fstier_native"] = fstier_native.status()._asdict()
    res["fstier_options"] = args.fstier_options
    res["page_cache_dropped"] = res.pop("cold")
    print(table(res))
    if "syscalls" in res:
        print(json.dumps(res["syscalls"], indent=1))
    print(f"(vLLM fs tier I/O ('vllm'): {res['vllm_io_path']}; fstier: {res['fstier_native']['reason']}; "
          f"page cache dropped before loads: "
          f"{res['page_cache_dropped']}; {res['seconds']} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    if args.plot:
        plot(res, Path(args.plot))


if __name__ == "__main__":
    main()
