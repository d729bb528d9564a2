"""SGLang's built-in ``HiCacheFile`` vs ``FstierHiCacheStorage``, on SGLang's own host pool.

Both backends are built by SGLang's ``StorageBackendFactory.create_backend``
(``"file"`` and ``"dynamic"``) over the SAME real ``MHATokenToKVPoolHost``
(CPU, ``--layout``, bf16), with the same page keys, in two sibling
directories of one ``--dir``, each with its shipped defaults (HiCacheFile:
serial, buffered, size checks only; fstier: 8 read + 4 write threads,
O_DIRECT, xxh3 checksums ON, header and key checked on every load). Each is
driven the way SGLang's cache controller drives it, in batches of 128 pages
(``STORAGE_BATCH_SIZE``):

- HiCacheFile through the legacy calls (``_generic_page_set``: a flat copy
  of each page, then ``batch_set``; ``_generic_page_get``: ``batch_get`` into
  flat pages, then ``set_from_flat_data_page``);
- fstier through the zero-copy calls (``batch_set_v1`` / ``batch_get_v1``
  with the batch's host indices), as ``"interface_v1": true`` selects.

Per page size (64 KiB, 256 KiB, 1 MiB, 2 MiB by default), ``--total`` bytes
of pages:

- **store** GB/s to completion (new keys every pass, so new files);
- **cold load** GB/s: page cache dropped (``drop_caches``, as root), the
  pool's pages zeroed, every page loaded back and compared byte for byte with
  what was stored (outside the timing).

Passes alternate which backend runs first (``--reps``, default 2); the table
reports the mean per backend and the ratio fstier / HiCacheFile from the
same run.

    python benchmarks/bench_sglang.py [--dir /var/tmp/x] [--total 256MiB]
        [--sizes 64KiB,256KiB,1MiB,2MiB] [--layout page_first] [--reps 2]
        [--json out.json] [--fstier-options '{"o_direct": "off"}']
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _sglang_cpu as sgl  # noqa: E402
from _raw import drop_caches  # noqa: E402

from fstier.units import parse_size  # noqa: E402

BATCH = 128
LAYERS, HEADS, HEAD_DIM = 4, 8, 128  # bf16: 16 KiB of K+V per token


def _fmt(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


class Bench:
    """One page size: one host pool, both backends attached to it."""

    def __init__(
        self, base: Path, page_bytes: int, total: int, layout: str, options: dict[str, Any]
    ) -> None:
        import torch

        per_token = 2 * LAYERS * HEADS * HEAD_DIM * 2
        if page_bytes % per_token:
            raise SystemExit(f"page size {page_bytes} is not a multiple of {per_token} bytes")
        self.page_tokens = page_bytes // per_token
        self.pages = max(BATCH, total // page_bytes // BATCH * BATCH)
        device_pages = max(8, self.pages // 16)
        self.pool = sgl.mha_pool(
            layout, dtype=torch.bfloat16, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM,
            page_size=self.page_tokens, device_pages=device_pages,
            ratio=(self.pages + 1) / device_pages,
        )
        self.pool.kv_buffer.view(-1).view(torch.uint8).fill_(1)  # prefault
        self.indices = self.pool.alloc(self.pages * self.page_tokens)
        if self.indices is None:
            raise SystemExit("host pool too small for the batch")
        self.page_bytes = page_bytes
        self.base = base
        self.options = options
        self.seq = 0

    def _batches(self) -> list[tuple[int, Any]]:
        ps = self.page_tokens
        return [
            (i, self.indices[i * ps : (i + BATCH) * ps]) for i in range(0, self.pages, BATCH)
        ]

    def run_file(self, keys: list[str], root: Path) -> tuple[float, float]:
        backend = sgl.file_backend(root, self.pool)
        pool, ps = self.pool, self.page_tokens
        try:
            t0 = time.perf_counter()
            for i, idx in self._batches():
                data = [pool.get_data_page(idx[j * ps]) for j in range(len(idx) // ps)]
                if not backend.batch_set(keys[i : i + len(data)], data):
                    raise SystemExit("HiCacheFile: a store failed")
            store = time.perf_counter() - t0
            want = self._snapshot()
            self._cold()
            t0 = time.perf_counter()
            for i, idx in self._batches():
                n = len(idx) // ps
                dst = [pool.get_dummy_flat_data_page() for _ in range(n)]
                got = backend.batch_get(keys[i : i + n], dst)
                for j in range(n):
                    if got[j] is None:
                        raise SystemExit(f"HiCacheFile: page {i + j} did not load")
                    pool.set_from_flat_data_page(int(idx[j * ps]), got[j])
            load = time.perf_counter() - t0
            self._check(want, "HiCacheFile")
            return store, load
        finally:
            if hasattr(backend, "close"):
                backend.close()

    def run_fstier(self, keys: list[str], root: Path) -> tuple[float, float]:
        backend = sgl.fstier_backend(root, self.pool, options=self.options)
        ps = self.page_tokens
        try:
            t0 = time.perf_counter()
            for i, idx in self._batches():
                ok = backend.batch_set_v1(keys[i : i + len(idx) // ps], idx)
                if not all(ok):
                    raise SystemExit("fstier: a store failed")
            store = time.perf_counter() - t0
            want = self._snapshot()
            self._cold()
            t0 = time.perf_counter()
            for i, idx in self._batches():
                ok = backend.batch_get_v1(keys[i : i + len(idx) // ps], idx)
                if not all(ok):
                    raise SystemExit(f"fstier: a load failed in batch {i // BATCH}")
            load = time.perf_counter() - t0
            self._check(want, "fstier")
            return store, load
        finally:
            backend.close()

    def _snapshot(self) -> Any:
        return self.pool.kv_buffer.clone()

    def _cold(self) -> None:
        import torch

        drop_caches()
        self.pool.kv_buffer.view(-1).view(torch.uint8).fill_(0)

    def _check(self, want: Any, who: str) -> None:
        import torch

        # Every page of the batch, byte for byte, against what was stored.
        ptrs, sizes = self.pool.get_page_buffer_meta(self.indices)
        base = self.pool.kv_buffer.data_ptr()
        cur = self.pool.kv_buffer.view(-1).view(torch.uint8)
        ref = want.view(-1).view(torch.uint8)
        for p, s in zip(ptrs, sizes, strict=True):
            o = p - base
            if not torch.equal(cur[o : o + s], ref[o : o + s]):
                raise SystemExit(f"{who}: loaded bytes differ from the stored ones")

    def fresh_data(self) -> list[str]:
        """New random page contents and new keys (so stores write new files)."""
        self.seq += 1
        sgl.fill_pages(self.pool, self.indices, seed=self.seq)
        return sgl.page_keys(self.pages, salt=f"{self.page_bytes}-{self.seq}-{os.getpid()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory for both roots (default: a temp dir)")
    ap.add_argument("--total", default="256MiB", help="bytes of pages per size and pass")
    ap.add_argument("--sizes", default="64KiB,256KiB,1MiB,2MiB")
    ap.add_argument(
        "--layout", default="page_first", choices=["layer_first", "page_first", "page_first_direct", "page_head"]
    )
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--fstier-options", default="{}",
        help='extra fstier options as JSON, e.g. \'{"o_direct": "off"}\' (default: shipped defaults)',
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sgl.import_sglang()
    total = parse_size(args.total)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    top = Path(tempfile.mkdtemp(prefix="bench-sglang-", dir=args.dir))
    rows: list[dict[str, Any]] = []
    cold = drop_caches()
    try:
        for size in sizes:
            bench = Bench(top, size, total, args.layout, json.loads(args.fstier_options))
            res: dict[str, dict[str, list[float]]] = {
                "file": {"store": [], "load": []}, "fstier": {"store": [], "load": []}
            }
            nbytes = bench.pages * size
            for rep in range(args.reps + 1):  # pass 0 warms up (not counted)
                order = ["file", "fstier"] if rep % 2 else ["fstier", "file"]
                for who in order:
                    keys = bench.fresh_data()
                    root = top / f"{who}-{size}-{rep}"
                    run = bench.run_file if who == "file" else bench.run_fstier
                    store, load = run(keys, root)
                    shutil.rmtree(root, ignore_errors=True)
                    if rep:
                        res[who]["store"].append(nbytes / store / 1e9)
                        res[who]["load"].append(nbytes / load / 1e9)
            row = {
                "page_bytes": size,
                "pages": bench.pages,
                **{
                    f"{who}_{phase}_gbps": statistics.mean(res[who][phase])
                    for who in res for phase in ("store", "load")
                },
            }
            row["store_ratio"] = row["fstier_store_gbps"] / row["file_store_gbps"]
            row["load_ratio"] = row["fstier_load_gbps"] / row["file_load_gbps"]
            rows.append(row)
            print(
                f"{_fmt(size):>8}  store  HiCacheFile {row['file_store_gbps']:.2f} GB/s  "
                f"fstier {row['fstier_store_gbps']:.2f} GB/s  x{row['store_ratio']:.1f}   "
                f"cold load  HiCacheFile {row['file_load_gbps']:.2f} GB/s  "
                f"fstier {row['fstier_load_gbps']:.2f} GB/s  x{row['load_ratio']:.1f}",
                flush=True,
            )
            del bench
    finally:
        shutil.rmtree(top, ignore_errors=True)
    if not cold:
        print("note: page cache NOT dropped (not root); loads were warm", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "layout": args.layout, "batch": BATCH, "cold": cold,
                    "fstier_options": json.loads(args.fstier_options), "rows": rows,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
