"""bench_unaligned: payloads that are not a multiple of 4096 (engine rows).

An engine row of ``n`` bytes, ``n % 4096 != 0``, starting 4096-aligned (vLLM's
shared-memory rows do), stored and loaded through ``store_block`` /
``load_block`` with exactly ``n`` bytes, two ways, in the same run:

- ``bounce``: O_DIRECT; the whole pages come straight from/to the row and
  the last partial page goes through a 4 KiB per-thread bounce page;
- ``buffered``: the same iovec through the page cache (``o_direct=False``).

Loads are cold (page cache dropped between store and load when run as root).
Rounds alternate the order of the two ways.

    python3 benchmarks/bench_unaligned.py
    python3 benchmarks/bench_unaligned.py --sizes 64K,256K,1M --threads 8 --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _raw import drop_caches  # noqa: E402

from fstier.io import _blockio, capabilities, fsops, iotypes  # noqa: E402
from fstier.io.blockfile import header_for_payload  # noqa: E402
from fstier.keys import BlockKey  # noqa: E402

DIGEST = b"unalign!"
TAIL = 1000  # bytes past the last whole page


def _size(text: str) -> int:
    units = {"K": 1024, "M": 1024**2}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def run_once(d: Path, n: int, count: int, threads: int, direct: bool) -> tuple[float, float]:
    """(store GB/s, cold load GB/s) for ``count`` rows of ``n`` bytes."""
    d.mkdir(parents=True)
    opts = iotypes.IOOptions(o_direct=direct)
    rows = [fsops.aligned_buffer(n + 4096) for _ in range(threads)]
    data = os.urandom(n)
    for r in rows:
        r[:n] = data
    keys = [BlockKey(i.to_bytes(16, "big"), 0) for i in range(count)]
    header = [header_for_payload(k, DIGEST, data, 1, n) for k in keys]

    def store(i: int) -> None:
        out = _blockio.store_block(iotypes.StoreRequest(d / f"{i}.bin", header[i], rows[i % threads][:n]), opts)
        if not out.ok:
            raise RuntimeError(out)

    def load(i: int) -> None:
        out = _blockio.load_block(iotypes.LoadRequest(d / f"{i}.bin", rows[i % threads][:n], keys[i], DIGEST, n), opts)
        if not out.ok:
            raise RuntimeError(out)

    with ThreadPoolExecutor(threads) as ex:
        t0 = time.perf_counter()
        list(ex.map(store, range(count)))
        t_store = time.perf_counter() - t0
        drop_caches(1)
        t0 = time.perf_counter()
        list(ex.map(load, range(count)))
        t_load = time.perf_counter() - t0
    shutil.rmtree(d)
    return n * count / t_store / 1e9, n * count / t_load / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64K,256K,1M")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--total", default="64M")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="fstier-unaligned-", dir=os.environ.get("BENCH_DIR", os.getcwd())))
    support = capabilities.probe_o_direct(base, "auto")
    if not support.enabled:
        sys.exit(f"bench_unaligned: no O_DIRECT under {base} ({support.reason})")
    rows = []
    try:
        for text in args.sizes.split(","):
            n = _size(text) + TAIL
            count = max(4 * args.threads, _size(args.total) // n)
            best: dict[str, tuple[float, float]] = {}
            for r in range(args.rounds):
                order = (True, False) if r % 2 == 0 else (False, True)
                for direct in order:
                    name = "bounce" if direct else "buffered"
                    s, lo = run_once(base / f"{name}-{r}", n, count, args.threads, direct)
                    old = best.get(name, (0.0, 0.0))
                    best[name] = (max(old[0], s), max(old[1], lo))
            rows.append({"payload_bytes": n, "threads": args.threads, **{
                f"{k}_{op}_gbps": round(v[i], 3) for k, v in best.items() for i, op in enumerate(("store", "load"))
            }})
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| payload | threads | bounce store | buffered store | bounce load (cold) | buffered load (cold) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['payload_bytes']} | {r['threads']} | {r['bounce_store_gbps']} | {r['buffered_store_gbps']} "
              f"| {r['bounce_load_gbps']} | {r['buffered_load_gbps']} |")


if __name__ == "__main__":
    main()
