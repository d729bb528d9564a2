"""bench_io: fstier store/load throughput against a raw O_DIRECT baseline.

For each block size and thread count, in the same run and the same directory:

- raw: O_DIRECT pwrite of NEW blocks (one new large file, and one new file
  per block) and pread of them back, with the same thread count
  (benchmarks/_raw.py);
- fstier: ``store_block`` (header + xxh3 checksum + temp file + rename) and
  ``load_block`` (fstat, preadv, header/key/length/checksum checks) on a
  thread pool with the same number of threads, checksums on and off.

Buffers come from a prefaulted, reused aligned pool (first-touch page faults
are slow on these VMs, docs/architecture.md), and a warm-up pass runs first. ``raw_gbps``
is the faster of the two raw shapes (the strictest baseline) and ``ratio`` is
fstier GB/s over it. ``--aio`` also compares an aiofiles-only block path with the
AsyncBlockIO path (on the job engine).

    .venv/bin/python benchmarks/bench_io.py                 # default, < 3 min on 2 cores
    .venv/bin/python benchmarks/bench_io.py --full          # threads 1,2,4,8,16, more data
    .venv/bin/python benchmarks/bench_io.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiofiles  # noqa: E402
import aiofiles.os  # noqa: E402
import xxhash  # noqa: E402
from _raw import RawBaseline, aligned  # noqa: E402

from fstier.cli.bench import _bench_blocks  # noqa: E402
from fstier.io import native  # noqa: E402
from fstier.io._blockio import load_block, store_block  # noqa: E402
from fstier.io.aio import AsyncBlockIO  # noqa: E402
from fstier.io.blockfile import (  # noqa: E402
    HEADER_SIZE,
    BlockHeader,
    ChecksumKind,
    decode_header,
    encode_header,
    padded_len,
    payload_checksum,
)
from fstier.io.capabilities import probe_o_direct  # noqa: E402
from fstier.io.fsops import temp_path_for  # noqa: E402
from fstier.io.iotypes import IOOptions, LoadRequest, LoadStatus, StoreRequest, StoreStatus  # noqa: E402
from fstier.keys import BlockKey  # noqa: E402

DIGEST = b"benchio!"
PATTERN = os.urandom(1 << 16)


@dataclass
class Row:
    op: str
    block_bytes: int
    threads: int
    checksum: bool
    gbps: float
    raw_gbps: float  # the faster raw shape: the strictest baseline
    ratio: float
    raw_large_gbps: float
    raw_files_gbps: float


def _key(i: int) -> BlockKey:
    return BlockKey(xxhash.xxh3_128(i.to_bytes(8, "little")).digest(), 0)


class _Slots:
    """Per-thread prefaulted aligned buffers, handed out from a preallocated
    list so no page is touched for the first time while timing."""

    def __init__(self, nbytes: int, threads: int) -> None:
        self._free = [aligned(padded_len(nbytes), PATTERN) for _ in range(threads + 2)]
        self._lock = threading.Lock()
        self._local = threading.local()

    def get(self) -> memoryview:
        buf: memoryview | None = getattr(self._local, "buf", None)
        if buf is None:
            with self._lock:
                buf = self._free.pop()
            self._local.buf = buf
        return buf


class FstierRun:
    """``count`` blocks of ``block`` bytes stored/loaded through fstier.io."""

    def __init__(self, root: Path, block: int, count: int, opts: IOOptions) -> None:
        self.root = root
        self.block = block
        self.count = count
        self.opts = opts
        self.keys = [_key(i) for i in range(count)]
        self.paths = []
        for k in self.keys:
            h = k.hex
            d = root / h[:3]
            d.mkdir(parents=True, exist_ok=True)  # the manager's ensure_parent, cached
            self.paths.append(d / f"{h}-g0.bin")

    def _store(self, slots: _Slots, i: int) -> Any:
        buf = slots.get()
        n = self.block
        checksum = self.opts.checksum
        header = BlockHeader(
            key=self.keys[i],
            namespace_digest=DIGEST,
            payload_len=n,
            page_count=1,
            page_bytes=n,
            checksum_kind=ChecksumKind.XXH3_64 if checksum else ChecksumKind.NONE,
            payload_checksum=payload_checksum(buf[:n]) if checksum else 0,
        )
        return store_block(StoreRequest(self.paths[i], header, buf), self.opts)

    def _load(self, slots: _Slots, i: int) -> Any:
        req = LoadRequest(self.paths[i], slots.get(), self.keys[i], DIGEST, self.block)
        return load_block(req, self.opts)

    def run(self, kind: str, threads: int) -> float:
        slots = _Slots(self.block, threads)
        fn = self._store if kind == "store" else self._load
        ops = [partial(fn, slots, i) for i in range(self.count)]
        if threads == 1:
            t0 = time.perf_counter()
            results = [op() for op in ops]
            seconds = time.perf_counter() - t0
        else:
            # ``threads`` threads, each taking the next op when idle (the ops are Python-path calls).
            with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="bench") as ex:
                t0 = time.perf_counter()
                results = list(ex.map(lambda op: op(), ops))
                seconds = time.perf_counter() - t0
        want = StoreStatus.STORED if kind == "store" else LoadStatus.LOADED
        bad = [r for r in results if getattr(r, "status", None) is not want]
        if bad:
            raise RuntimeError(f"fstier {kind}: {len(bad)} op(s) failed, first: {bad[0]!r}")
        return seconds

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def bench_sizes(
    directory: Path, sizes: list[int], threads: list[int], total: int, repeat: int, o_direct: bool
) -> list[Row]:
    """Each cell: best of ``repeat`` rounds; the rounds alternate which of raw
    and fstier runs first, because this VM's disk absorbs bursts and then
    throttles, so whichever runs first in a quiet period looks faster."""
    rows: list[Row] = []
    inf = float("inf")
    for size in sizes:
        count = max(4 * max(threads), total // size)
        nbytes = count * size
        for t in threads:
            raw = RawBaseline(directory, size, count, PATTERN)
            raw.warm(t)
            best: dict[str, float] = {}

            def keep(name: str, seconds: float, best: dict[str, float] = best) -> None:
                best[name] = min(best.get(name, inf), seconds)

            def raw_round(t: int = t, raw: RawBaseline = raw, keep: Any = keep) -> None:
                keep("large:store", raw.store_large(t))
                keep("large:load", raw.load_large(t))
                raw.cleanup()
                keep("files:store", raw.store_files(t))
                keep("files:load", raw.load_files(t))
                raw.cleanup()

            def fst_round(
                t: int = t, size: int = size, count: int = count, keep: Any = keep
            ) -> None:
                for checksum in (True, False):
                    opts = IOOptions(o_direct=o_direct, checksum=checksum)
                    run = FstierRun(directory / "fst", size, count, opts)
                    keep(f"{checksum}:store", run.run("store", t))
                    keep(f"{checksum}:load", run.run("load", t))
                    run.cleanup()

            for r in range(repeat):
                for step in (raw_round, fst_round) if r % 2 == 0 else (fst_round, raw_round):
                    step()
            for checksum in (True, False):
                for op in ("store", "load"):
                    g = _gbps(nbytes, best[f"{checksum}:{op}"])
                    large = _gbps(nbytes, best[f"large:{op}"])
                    files = _gbps(nbytes, best[f"files:{op}"])
                    best_raw = max(large, files)
                    rows.append(
                        Row(
                            op,
                            size,
                            t,
                            checksum,
                            round(g, 3),
                            round(best_raw, 3),
                            round(g / best_raw, 3),
                            round(large, 3),
                            round(files, 3),
                        )
                    )
                    _progress(rows[-1])
    return rows


def _progress(r: Row) -> None:
    print(
        f"  {r.op:5} {r.block_bytes >> 10:6} KiB  t={r.threads:2}  ck={'on ' if r.checksum else 'off'} "
        f"{r.gbps:6.2f} GB/s  raw {r.raw_gbps:5.2f}  ratio {r.ratio:5.2f}  "
        f"(raw large file {r.raw_large_gbps:5.2f}, raw file per block {r.raw_files_gbps:5.2f})",
        file=sys.stderr,
        flush=True,
    )


# --------------------------------------------------- aiofiles vs the engine
async def _aio_pool_path(
    directory: Path, size: int, count: int, threads: int, opts: IOOptions
) -> tuple[float, float]:
    root = directory / "aio-pool"
    root.mkdir()
    bufs = [aligned(padded_len(size), PATTERN) for _ in range(count)]
    keys = [_key(i) for i in range(count)]
    blocks = _bench_blocks(root, size, opts, native.status())
    aio = AsyncBlockIO(blocks, read_threads=threads // 2 or 1, write_threads=threads - threads // 2, io_timeout_s=None)
    try:
        t0 = time.perf_counter()
        outs = await aio.store([(k, b[:size]) for k, b in zip(keys, bufs, strict=True)])
        t_store = time.perf_counter() - t0
        assert all(o.status is StoreStatus.STORED for o in outs)
        t0 = time.perf_counter()
        res = await aio.load([(k, b[:size]) for k, b in zip(keys, bufs, strict=True)])
        t_load = time.perf_counter() - t0
        assert all(o.status is LoadStatus.LOADED for o in res)
    finally:
        await aio.aclose()
        shutil.rmtree(root)
    return t_store, t_load


async def _aio_files_path(
    directory: Path, size: int, count: int, threads: int
) -> tuple[float, float]:
    """Blocks through aiofiles only: buffered write of header+payload to a temp
    name, aiofiles.os.replace; load = read whole file, decode, checksum, copy."""
    root = directory / "aio-files"
    root.mkdir()
    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(threads))
    bufs = [aligned(padded_len(size), PATTERN) for _ in range(count)]
    keys = [_key(i) for i in range(count)]
    paths = [root / f"{k.hex}-g0.bin" for k in keys]
    sem = asyncio.Semaphore(threads)
    pad = bytes(padded_len(size) - size)

    async def store(k: BlockKey, p: Path, b: memoryview) -> None:
        async with sem:
            h = BlockHeader(
                k, DIGEST, size, 1, size, ChecksumKind.XXH3_64, payload_checksum(b[:size])
            )
            tmp = temp_path_for(p)
            async with aiofiles.open(tmp, "wb") as f:
                await f.write(encode_header(h))
                await f.write(b[:size])
                if pad:
                    await f.write(pad)
            await aiofiles.os.replace(tmp, p)

    async def load(k: BlockKey, p: Path, b: memoryview) -> None:
        async with sem:
            async with aiofiles.open(p, "rb") as f:
                data = await f.read()
            h = decode_header(data[:HEADER_SIZE])
            payload = memoryview(data)[HEADER_SIZE : HEADER_SIZE + size]
            if h.key != k or payload_checksum(payload) != h.payload_checksum:
                raise RuntimeError("aiofiles path loaded a bad block")
            b[:size] = payload

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(store(k, p, b) for k, p, b in zip(keys, paths, bufs, strict=True)))
        t_store = time.perf_counter() - t0
        t0 = time.perf_counter()
        await asyncio.gather(*(load(k, p, b) for k, p, b in zip(keys, paths, bufs, strict=True)))
        t_load = time.perf_counter() - t0
    finally:
        shutil.rmtree(root)
    return t_store, t_load


def bench_aio(
    directory: Path, size: int, count: int, threads: int, o_direct: bool
) -> dict[str, Any]:
    opts = IOOptions(o_direct=o_direct, checksum=True)
    nbytes = size * count
    pool_s, pool_l = asyncio.run(_aio_pool_path(directory, size, count, threads, opts))
    files_s, files_l = asyncio.run(_aio_files_path(directory, size, count, threads))
    out = {
        "block_bytes": size,
        "threads": threads,
        "pool_store_gbps": round(_gbps(nbytes, pool_s), 3),
        "pool_load_gbps": round(_gbps(nbytes, pool_l), 3),
        "aiofiles_store_gbps": round(_gbps(nbytes, files_s), 3),
        "aiofiles_load_gbps": round(_gbps(nbytes, files_l), 3),
    }
    out["faster"] = (
        "pool"
        if out["pool_store_gbps"] + out["pool_load_gbps"]
        >= out["aiofiles_store_gbps"] + out["aiofiles_load_gbps"]
        else "aiofiles"
    )
    return out


# ------------------------------------------------------------------ main
def _size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1] in mult:
        return int(float(text[:-1]) * mult[text[-1]])
    return int(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--dir", type=Path, default=None, help="parent directory for the run (default /var/tmp)"
    )
    ap.add_argument("--sizes", default="256K,2M,8M")
    ap.add_argument("--threads", default="1,4,16")
    ap.add_argument("--total", default="96M", help="bytes per measurement")
    ap.add_argument("--repeat", type=int, default=2, help="best of N per measurement")
    ap.add_argument(
        "--full", action="store_true", help="threads 1,2,4,8,16, 512 MiB per cell, best of 3"
    )
    ap.add_argument("--no-aio", action="store_true", help="skip the aiofiles vs pool comparison")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.full:
        args.threads, args.total, args.repeat = "1,2,4,8,16", "512M", 3
    sizes = [_size(s) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    parent = args.dir or Path("/var/tmp")
    directory = Path(tempfile.mkdtemp(prefix="fstier-bench-io-", dir=parent))
    t_start = time.perf_counter()
    try:
        support = probe_o_direct(directory, "auto")
        print(f"bench_io in {directory}: {support.reason}", file=sys.stderr)
        # Warm-up: threads, page tables, allocator, dentry caches.
        warm = FstierRun(directory / "warm", 2 << 20, 64, IOOptions(o_direct=support.enabled))
        warm.run("store", 4)
        warm.run("load", 4)
        warm.cleanup()
        rows = bench_sizes(
            directory, sizes, threads, _size(args.total), args.repeat, support.enabled
        )
        aio = None if args.no_aio else bench_aio(directory, 2 << 20, 96, 4, support.enabled)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    elapsed = time.perf_counter() - t_start
    meta = {
        "directory": str(parent),
        "o_direct": support.enabled,
        "probe": support.reason,
        "total_bytes_per_measurement": _size(args.total),
        "repeat": args.repeat,
        "seconds": round(elapsed, 1),
        "cpus": os.cpu_count(),
    }
    if args.json:
        print(
            json.dumps({"results": [asdict(r) for r in rows], "aio": aio, "meta": meta}, indent=2)
        )
        return 0
    print(
        f"\nbench_io ({meta['probe']}; {meta['total_bytes_per_measurement'] >> 20} MiB per cell, {elapsed:.0f} s)"
    )
    print(
        "| op | block | threads | checksum | fstier GB/s | raw GB/s | ratio | raw large file | raw file/block |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.op} | {r.block_bytes >> 10} KiB | {r.threads} | {'on' if r.checksum else 'off'} | "
            f"{r.gbps:.2f} | {r.raw_gbps:.2f} | {r.ratio:.2f} | {r.raw_large_gbps:.2f} | {r.raw_files_gbps:.2f} |"
        )
    if aio:
        print(
            f"\naio ({aio['block_bytes'] >> 20} MiB, {aio['threads']} threads): pool store "
            f"{aio['pool_store_gbps']:.2f} / load {aio['pool_load_gbps']:.2f} GB/s; aiofiles store "
            f"{aio['aiofiles_store_gbps']:.2f} / load {aio['aiofiles_load_gbps']:.2f} GB/s -> {aio['faster']} is faster"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
