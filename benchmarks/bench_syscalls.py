"""bench_syscalls: system calls per stored and per loaded block file, counted by strace.

Runs a child that stores (then, separately, loads) N block files through
``fstier.io._blockio.store_block`` / ``load_block`` under ``strace -f -c``, once
with a small N and once with a large one; the difference divided by the
difference in N is the per-file count, free of interpreter start-up.

    python3 benchmarks/bench_syscalls.py                   # 64 KiB, buffered and O_DIRECT
    python3 benchmarks/bench_syscalls.py --size 256K --json
    FSTIER_SRC=/path/to/other/checkout python3 benchmarks/bench_syscalls.py   # compare

Needs ``strace`` on PATH. The child imports fstier from ``FSTIER_SRC`` (this
checkout by default), so two checkouts can be compared with one script.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()

_CHILD = r"""
import os, sys
sys.path.insert(0, os.environ["FSTIER_SRC"])
from pathlib import Path
from fstier.io import _blockio, fsops, iotypes
from fstier.io.blockfile import header_for_payload
from fstier.keys import BlockKey
mode, n, d, size, direct = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
opts = iotypes.IOOptions(o_direct=direct)
buf = fsops.aligned_buffer(size)
data = bytes(range(256)) * (size // 256)
buf[:size] = data
digest = b"\x5a" * 8
for i in range(n):
    key = BlockKey(i.to_bytes(16, "big"), 0)
    path = d / f"{key.hex}-g0.bin"
    if mode == "store":
        header = header_for_payload(key, digest, data, 1, size)
        out = _blockio.store_block(iotypes.StoreRequest(path, header, buf), opts)
    else:
        out = _blockio.load_block(iotypes.LoadRequest(path, buf, key, digest, size), opts)
    assert out.ok, out
"""

_LINE = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$")


def _strace_counts(mode: str, n: int, d: Path, size: int, direct: bool, src: str) -> dict[str, int]:
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
        env = {**os.environ, "FSTIER_SRC": src}
        cmd = ["strace", "-f", "-c", "-o", out.name, sys.executable, "-c", _CHILD,
               mode, str(n), str(d), str(size), "1" if direct else "0"]
        subprocess.run(cmd, check=True, env=env, capture_output=True)
        counts: dict[str, int] = {}
        for line in Path(out.name).read_text().splitlines():
            m = _LINE.match(line)
            if m and m.group(2) != "total":
                counts[m.group(2)] = int(m.group(1))
        return counts


def per_file(mode: str, size: int, direct: bool, src: str, small: int = 50, large: int = 1050) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="fstier-sys-", dir=os.environ.get("BENCH_DIR", "/tmp")))
    try:
        result = []
        for n in (small, large):
            d = root / f"n{n}"
            d.mkdir()
            if mode == "load":  # files to load, stored by an untraced child
                subprocess.run([sys.executable, "-c", _CHILD, "store", str(n), str(d), str(size),
                                "1" if direct else "0"], check=True, env={**os.environ, "FSTIER_SRC": src})
            result.append(_strace_counts(mode, n, d, size, direct, src))
        a, b = result
        names = sorted(set(a) | set(b))
        out = {k: (b.get(k, 0) - a.get(k, 0)) / (large - small) for k in names}
        return {k: round(v, 2) for k, v in out.items() if round(v, 2) > 0}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _size(text: str) -> int:
    units = {"K": 1024, "M": 1024**2}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="64K")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if shutil.which("strace") is None:
        sys.exit("bench_syscalls: strace is not installed (apt-get install strace)")
    src = os.environ.get("FSTIER_SRC", str(HERE.parents[1]))
    size = _size(args.size)
    rows = []
    for direct in (False, True):
        for mode in ("store", "load"):
            counts = per_file(mode, size, direct, src)
            rows.append({"mode": mode, "o_direct": direct, "total": round(sum(counts.values()), 2), "calls": counts})
    if args.json:
        print(json.dumps({"src": src, "size": size, "rows": rows}, indent=2))
        return
    print(f"system calls per file, {args.size} payload, fstier from {src}")
    for r in rows:
        calls = ", ".join(f"{k} {v:g}" for k, v in sorted(r["calls"].items(), key=lambda kv: -kv[1]))
        print(f"  {r['mode']:5s} {'O_DIRECT' if r['o_direct'] else 'buffered':8s} {r['total']:5.2f}: {calls}")


if __name__ == "__main__":
    main()
