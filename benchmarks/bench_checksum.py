"""Checksum candidates for the block format, measured in C without the GIL.

XXH3-64 (fstier's own implementation from the specification, AVX2/SSE2/
scalar chosen at run time) against CRC32C (SSE4.2 ``crc32`` instruction,
one stream, and the portable table), plus the ``xxhash`` package the
Python path uses. docs/format.md records the figures and the choice.

    python benchmarks/bench_checksum.py [--sizes 64KiB,1MiB,8MiB] [--seconds 0.3]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import xxhash

from fstier.io import native
from fstier.units import parse_size


def _rate(fn: Callable[[], object], nbytes: int, seconds: float) -> float:
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        reps += 1
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--sizes", default="64KiB,1MiB,8MiB")
    ap.add_argument("--seconds", type=float, default=0.3)
    args = ap.parse_args()
    ext = native._ext
    if ext is None:
        raise SystemExit(f"native extension not built: {native._import_error}")
    impl = native._settings["xxh3_impl"]
    print(f"| buffer | XXH3-64 ({impl}) | CRC32C (SSE4.2, 1 stream) | CRC32C (table) | xxhash package |")
    print("|---|---|---|---|---|")
    for label in args.sizes.split(","):
        n = parse_size(label)
        buf = os.urandom(n)
        cells = []
        for kind in (0, 1, 2):
            reps = max(3, int(2e9 // n) if kind != 2 else int(5e7 // n))
            secs, _ = ext.checksum_bench(buf, kind, reps)
            cells.append(n * reps / secs / 1e9)
        cells.append(_rate(lambda b=buf: xxhash.xxh3_64_intdigest(b), n, args.seconds))
        print(f"| {label} | " + " | ".join(f"{c:.1f} GB/s" for c in cells) + " |")


if __name__ == "__main__":
    main()
