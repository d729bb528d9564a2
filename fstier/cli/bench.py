"""The I/O benchmark core: fstier's store/load path against raw O_DIRECT.

Both sides run in the same process, on the same directory, with the same
number of threads, block size and block count, alternating round by round so
that drift of the device hits both equally. The fstier side is the real
path FsTier runs: a :class:`~fstier.io.blockstore.BlockStore` (header,
checksum, atomic publication, O_DIRECT when the probe allows; on load size,
header, key, namespace and xxh3 checks) on the backend ``FSTIER_NATIVE``
selects (native: batches of :data:`BATCH` blocks per GIL-free call; Python:
one block per call); the result names the path and why (``io_path``). The raw side is the floor
we compare against: ``open(O_CREAT|O_DIRECT)``, one ``pwrite`` of the padded
length, ``close``; and ``open(O_DIRECT)``, one ``preadv``, ``close``.

Facts of these machines that shape it (docs/architecture.md, "Facts of the
machines"): every round writes
NEW files (overwriting allocated blocks is ~3x faster and would flatter the
raw side), buffers are prefaulted and a warm-up round runs first, and reads
use many threads. Used by ``fstier bench`` and ``benchmarks/bench_io.py``.
"""

from __future__ import annotations

import errno
import os
import queue
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import click

from fstier.cli.exits import UsageFailure
from fstier.cli.options import json_option, parse_size_option
from fstier.cli.output import display, emit_report, fmt_size, make_console
from fstier.cli.progress import progress_bar, show_progress
from fstier.config import parse_config
from fstier.file_mapper import FileMapper
from fstier.io import (
    HEADER_SIZE,
    BlockStore,
    IOOptions,
    NativeStatus,
    aligned_buffer,
    native_status,
    padded_len,
    probe_o_direct,
)
from fstier.keys import BlockKey

__all__ = ["BenchRow", "bench_files", "run_bench"]

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_DIGEST = bytes.fromhex("00fe5b0e0c0ffee0")


@dataclass(frozen=True, slots=True)
class BenchRow:
    """One operation's median-of-rounds throughput, both sides."""

    op: str
    fstier_gbps: float
    raw_gbps: float

    @property
    def ratio(self) -> float:
        return self.fstier_gbps / self.raw_gbps if self.raw_gbps else 0.0


def _key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(8, "big") + b"fstbench", 0)


def _parallel(ex: ThreadPoolExecutor, jobs: Sequence[Callable[[], bool]]) -> float:
    t0 = time.perf_counter()
    for ok in ex.map(lambda f: f(), jobs):
        if not ok:
            raise OSError(errno.EIO, "a benchmark operation failed; see the log for its cause")
    return time.perf_counter() - t0


#: blocks per batch-method call on the native backend (a job's share of one
#: I/O thread); the Python backend runs one key per call, as FsTier cuts it
BATCH = 4


def _bench_blocks(root: Path, block_bytes: int, opts: IOOptions, backend: NativeStatus) -> BlockStore:
    """The block store the fstier side runs: a namespace of one group whose
    files hold ``block_bytes`` of payload, under ``root``."""
    cfg = parse_config({
        "tier": {"root_dir": str(root)},
        "model": {"name": "fstier/bench", "dtype": "float16", "groups": [{
            "kind": "mamba", "block_size": 1, "num_layers": 1, "num_kv_heads": 1, "head_size": 8,
            "page_size_bytes": block_bytes,
        }]},
        "parallel": {},
    })
    blocks = BlockStore(FileMapper(cfg), opts, backend)
    blocks.ensure_namespace()
    return blocks


def _f_store(blocks: BlockStore, keys: list[BlockKey], nbytes: int, bufs: list[memoryview]) -> bool:
    outs = blocks.store_many([(k, b[:nbytes]) for k, b in zip(keys, bufs, strict=False)])
    return all(o.ok for o in outs)


def _f_load(blocks: BlockStore, keys: list[BlockKey], nbytes: int, bufs: list[memoryview]) -> bool:
    outs = blocks.load_many([(k, b[:nbytes]) for k, b in zip(keys, bufs, strict=False)])
    return all(o.ok for o in outs)


class _Buffers:
    """Prefaulted aligned buffers lent :data:`BATCH` at a time to one
    operation, so a load never reads into a buffer another thread is
    checksumming."""

    def __init__(self, count: int, nbytes: int, fill: bytes, per: int = BATCH) -> None:
        self._q: queue.SimpleQueue[list[memoryview]] = queue.SimpleQueue()
        for _ in range(count):
            group = [aligned_buffer(nbytes) for _ in range(per)]
            for b in group:
                b[: len(fill)] = fill
            self._q.put(group)

    def run(self, op: Callable[[list[memoryview]], bool]) -> bool:
        bufs = self._q.get()
        try:
            return op(bufs)
        finally:
            self._q.put(bufs)


def _raw_write(path: Path, buf: memoryview, *, direct: bool) -> bool:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (_O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    try:
        return os.pwritev(fd, [buf], 0) == len(buf)
    finally:
        os.close(fd)


def _raw_read(path: Path, buf: memoryview, *, direct: bool) -> bool:
    fd = os.open(path, os.O_RDONLY | (_O_DIRECT if direct else 0))
    try:
        return os.preadv(fd, [buf], 0) == len(buf)
    finally:
        os.close(fd)


def bench_files(num_blocks: int, rounds: int = 3) -> int:
    """File operations one :func:`run_bench` performs (for a progress bar):
    four passes (raw and fstier, store and load) per round, plus the warm-up."""
    return 4 * min(num_blocks, 1 << 16) * (rounds + 1)


def run_bench(
    root: Path | None, *, block_bytes: int = 2 << 20, num_blocks: int = 256, threads: int = 8, rounds: int = 3,
    on_files: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark under ``root`` (a fresh temp dir when None; files
    it writes are removed afterwards). Returns the JSON-ready result.
    ``on_files(n)`` is called after each pass of ``n`` file operations
    (:func:`bench_files` in all)."""
    own = root is None
    base = Path(tempfile.mkdtemp(prefix="fstier-bench-")) if root is None else Path(root)
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".fstier-bench-", dir=base))
    try:
        support = probe_o_direct(work, "auto")
        opts = IOOptions(o_direct=support.enabled, alignment=support.alignment)
        direct = support.enabled
        path_now = native_status()
        n = min(num_blocks, 1 << 16)
        payload = padded_len(block_bytes)
        fill = bytes(range(256)) * (min(block_bytes, 1 << 16) // 256)
        pool = _Buffers(threads, payload, fill)
        raw_pool = _Buffers(threads, HEADER_SIZE + payload, fill, per=1)
        keys = [_key(i) for i in range(n)]
        samples: dict[str, list[tuple[float, float]]] = {"store": [], "load": []}
        with ThreadPoolExecutor(max_workers=threads) as ex:
            for rnd in range(rounds + 1):  # round 0 is the warm-up
                fdir = work / f"f{rnd}"
                rdir = work / f"r{rnd}"
                rdir.mkdir()
                blocks = _bench_blocks(fdir, block_bytes, opts, path_now)
                b = blocks.batch_bounds(n, max(1, n // BATCH))
                spans = list(zip(b[:-1], b[1:], strict=True))
                raw_paths = [rdir / f"{i:06d}.raw" for i in range(n)]

                def done(seconds: float) -> float:
                    if on_files is not None:
                        on_files(n)
                    return seconds

                def raw(op: Callable[..., bool], p: Path, bufs: list[memoryview]) -> bool:
                    return op(p, bufs[0], direct=direct)

                raw_store = done(_parallel(ex, [partial(raw_pool.run, partial(raw, _raw_write, p)) for p in raw_paths]))
                f_store = done(_parallel(ex, [
                    partial(pool.run, partial(_f_store, blocks, keys[lo:hi], block_bytes)) for lo, hi in spans]))
                raw_load = done(_parallel(ex, [partial(raw_pool.run, partial(raw, _raw_read, p)) for p in raw_paths]))
                f_load = done(_parallel(ex, [
                    partial(pool.run, partial(_f_load, blocks, keys[lo:hi], block_bytes)) for lo, hi in spans]))
                if rnd:
                    total = n * block_bytes
                    samples["store"].append((total / f_store / 1e9, total / raw_store / 1e9))
                    samples["load"].append((total / f_load / 1e9, total / raw_load / 1e9))
                shutil.rmtree(fdir, ignore_errors=True)
                shutil.rmtree(rdir, ignore_errors=True)
        rows = [
            BenchRow(
                op,
                statistics.median(s[0] for s in samples[op]),
                statistics.median(s[1] for s in samples[op]),
            )
            for op in ("store", "load")
        ]
        return {
            "root": str(base),
            "root_temporary": own,
            "o_direct": direct,
            "o_direct_reason": support.reason,
            "io_path": path_now.backend,
            "io_path_reason": path_now.reason,
            "checksum": path_now.checksum,
            "block_bytes": block_bytes,
            "num_blocks": n,
            "threads": threads,
            "rounds": rounds,
            "rows": [
                {
                    "op": r.op,
                    # 4 significant digits: on a slow disk two decimals left
                    # 0.15 vs 0.153, and the ratio no longer matched them.
                    "fstier_gbps": float(f"{r.fstier_gbps:.4g}"),
                    "raw_gbps": float(f"{r.raw_gbps:.4g}"),
                    "ratio": round(r.ratio, 3),
                }
                for r in rows
            ],
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if own:
            shutil.rmtree(base, ignore_errors=True)


# -- the command -----------------------------------------------------------
@click.command("bench")
@click.option(
    "--root", "root", type=click.Path(file_okay=False), default=None, help="Directory to test (default: a temp dir)."
)
@click.option("--block-size", "block_size", default="2MiB", show_default=True, help="Bytes per block file.")
@click.option("--blocks", "num_blocks", type=int, default=256, show_default=True, help="Files per pass.")
@click.option("--threads", type=int, default=8, show_default=True, help="I/O threads for both sides.")
@json_option
def bench_cmd(root: str | None, block_size: str, num_blocks: int, threads: int, as_json: bool) -> None:
    """fstier store/load vs raw O_DIRECT on the same directory in the same run."""
    size = parse_size_option(block_size, "--block-size")
    if size < 4096 or size % 4096:
        raise UsageFailure(f"--block-size: must be a multiple of 4096, got {size}")
    if num_blocks < 1:
        raise UsageFailure(f"--blocks: must be >= 1, got {num_blocks}")
    if threads < 1:
        raise UsageFailure(f"--threads: must be >= 1, got {threads}")
    # Progress on stderr (a terminal only, never with --json): the default
    # run writes and reads 8 GiB.
    with progress_bar("bench", show_progress(as_json), total=bench_files(num_blocks)) as bar:
        result = run_bench(
            Path(root) if root else None, block_bytes=size, num_blocks=num_blocks, threads=threads,
            on_files=bar.advance,
        )
    if as_json:
        emit_report(result)
        return
    from rich.table import Table

    table = Table(title="fstier bench")
    for col in ("op", "fstier GB/s", "raw O_DIRECT GB/s", "ratio"):
        table.add_column(col)
    for row in result["rows"]:
        table.add_row(row["op"], f"{row['fstier_gbps']:.2f}", f"{row['raw_gbps']:.2f}", f"{row['ratio']:.2f}")
    console = make_console()
    console.print(table)
    temporary = " (a temporary directory, now deleted)" if result["root_temporary"] else ""
    console.print(
        f"{result['num_blocks']} x {fmt_size(size)} files, {threads} threads, median of "
        f"{result['rounds']} rounds after a warm-up, on {display(result['root'])}"
        f"{temporary} (o_direct={result['o_direct']})",
        markup=False,
    )
    console.print(f"I/O path: {result['io_path']} ({result['io_path_reason']}; checksum {result['checksum']})",
                  markup=False)

