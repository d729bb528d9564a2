"""CPU per file of the native per-key store and load against the C ceiling, with no job path around them.

Stores ``--files`` block files of ``--size`` bytes through one
``fstier.io.native.store_batch`` call (the per-key C of the engine's workers:
``store_one``/``load_one`` in ``fstier/io/_native.c``, one thread), drops them
from the page cache (``posix_fadvise(DONTNEED)`` per file), loads them back
through one ``load_batch`` call, every byte compared; then runs
``benchmarks/ceiling_loop.c`` (built here with ``cc -O2``) on the same count,
size and thread count. Both use O_DIRECT when the filesystem takes it (as the
tier's ``o_direct: auto`` does). ``--fanout existing`` makes the 4096 fan-out
directories before the timed stores (the ceiling's ``existing``);
``fresh`` lets each directory's first store make it (the ceiling's ``lazy``). Prints user and system µs per file
(``getrusage``; the Python process's own time is measured around the one call
only) and the load average before and after.

    python benchmarks/bench_key_cpu.py [--dir /var/tmp] [--files 2048] [--size 65536] [--fanout existing] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fstier.io import native  # noqa: E402
from fstier.io.fsops import aligned_buffer  # noqa: E402
from fstier.io.iotypes import IOOptions  # noqa: E402
from fstier.keys import BlockKey  # noqa: E402

HERE = Path(__file__).resolve().parent


def _times() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def _per_file(t0: tuple[float, float], t1: tuple[float, float], n: int, s: float) -> dict[str, float]:
    return {"user_us_per_file": round((t1[0] - t0[0]) * 1e6 / n, 2),
            "sys_us_per_file": round((t1[1] - t0[1]) * 1e6 / n, 2), "files_per_s": round(n / s, 1)}


def _drop(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fstier_run(root: Path, files: int, size: int, fanout: str, direct: bool) -> dict[str, dict[str, float]]:
    keys = [BlockKey(secrets.token_bytes(16), 0) for _ in range(files)]
    paths = [str(root / k.hex[:3] / f"{k.hex}-g0.bin") for k in keys]
    if fanout == "existing":
        for i in range(4096):
            os.mkdir(root / f"{i:03x}")
    bufs = [aligned_buffer(size) for _ in range(files)]
    for i, b in enumerate(bufs):
        b[:] = bytes([i % 251]) * size
    opts = IOOptions(o_direct=direct)
    digest = b"\x5a" * 8
    out: dict[str, dict[str, float]] = {}
    t0, w0 = _times(), time.perf_counter()
    res = native.store_batch(str(root), paths, keys, bufs, digest, 1, opts)
    t1, w1 = _times(), time.perf_counter()
    if not all(r.ok for r in res):
        raise SystemExit(f"store failed: {next(r for r in res if not r.ok)}")
    out["store"] = _per_file(t0, t1, files, w1 - w0)
    _drop(paths)
    back = [aligned_buffer(size) for _ in range(files)]
    zero = bytes(size)
    for b in back:  # touched now, as a tier's reused slots are: no first-touch page faults in the timed load
        b[:] = zero
    t0, w0 = _times(), time.perf_counter()
    got = native.load_batch(str(root), paths, keys, back, digest, opts)
    t1, w1 = _times(), time.perf_counter()
    if not all(g.ok for g in got) or any(bytes(a) != bytes(b) for a, b in zip(bufs, back, strict=True)):
        raise SystemExit("load failed or bytes differ")
    out["load"] = _per_file(t0, t1, files, w1 - w0)
    return out


def ceiling_run(exe: Path, root: Path, files: int, size: int, fanout: str, direct: bool) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for mode in ("store", "load"):
        if mode == "load":  # the ceiling's files leave the page cache too
            _drop([str(p) for p in root.rglob("*.bin")])
        r = subprocess.run([str(exe), mode, str(root), str(files), str(size), "1",
                            "existing" if fanout == "existing" else "lazy", "1" if direct else "0"],
                           check=True, capture_output=True, text=True)
        j = json.loads(r.stdout)
        out[mode] = {"user_us_per_file": j["user_us_per_file"], "sys_us_per_file": j["sys_us_per_file"],
                     "files_per_s": j["files_per_s"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp", help="where the roots are made (a real filesystem)")
    ap.add_argument("--files", type=int, default=2048)
    ap.add_argument("--size", type=int, default=65536)
    ap.add_argument("--fanout", choices=("existing", "fresh"), default="existing")
    ap.add_argument("--reps", type=int, default=1, help="passes, the sides alternating which goes first")
    ap.add_argument("--buffered", action="store_true", help="no O_DIRECT on either side")
    args = ap.parse_args()
    print("load average before:", Path("/proc/loadavg").read_text().strip())
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-key-cpu-", dir=args.dir) as d:
        exe = Path(d) / "ceiling_loop"
        subprocess.run(["cc", "-O2", "-pthread", "-o", str(exe), str(HERE / "ceiling_loop.c")], check=True)
        for rep in range(args.reps):  # the two sides alternate which runs first
            for name in ("fstier", "ceiling")[:: 1 if rep % 2 == 0 else -1]:
                root = Path(d) / name
                root.mkdir()
                if name == "fstier":
                    r = fstier_run(root, args.files, args.size, args.fanout, not args.buffered)
                else:
                    r = ceiling_run(exe, root, args.files, args.size, args.fanout, not args.buffered)
                shutil.rmtree(root)
                rows.append((rep, name, r))
    print("| pass | side | store user / sys µs per file | store files/s "
          "| load user / sys µs per file | load files/s |")
    print("|---|---|---|---|---|---|")
    for rep, name, r in sorted(rows, key=lambda x: (x[1], x[0])):
        s, ld = r["store"], r["load"]
        print(f"| {rep} | {name} | {s['user_us_per_file']} / {s['sys_us_per_file']} | {s['files_per_s']} | "
              f"{ld['user_us_per_file']} / {ld['sys_us_per_file']} | {ld['files_per_s']} |")
    print("load average after:", Path("/proc/loadavg").read_text().strip())


if __name__ == "__main__":
    main()
