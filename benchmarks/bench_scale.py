"""Million-file scale: inspect, verify, gc and lookup over a root of N small block files.

The tree is what FsTier itself would leave behind: one namespace (manifest
written by :class:`~fstier.file_mapper.FileMapper`), files at
``<ns>/<abc>/<de>/<hash>-g0.bin`` with uniformly distributed 16-byte hashes
(so ~1M files spread over ~660k leaf directories, the real fan-out), each a
valid v1 block file: a 4096-byte header made by
:func:`fstier.io.blockfile.encode_header_into` plus one 4 KiB page whose xxh3
checksum is right. Files are crafted in a tight loop on every core (one
``open/write/close`` each, no rename: generation is set-up, not the thing
measured) instead of going through ``store_block``, which would take ~10x
longer on this disk.

Each measured operation runs in its own subprocess under ``/usr/bin/time``-like
accounting (``resource.getrusage(RUSAGE_CHILDREN)`` of a fresh child), so the
reported peak RSS is that command's alone:

- ``fstier inspect ROOT --json``
- ``fstier verify ROOT --headers-only --json`` and ``fstier verify ROOT --json``
- ``fstier gc ROOT --max-bytes <half> --json``
- ``FsTier.lookup`` of 65,536 keys (all present; cold = first call of a new
  FsTier, warm = repeated), in a child that builds the config itself.

Usage::

    python benchmarks/bench_scale.py generate --root /var/tmp/fstier-scale --files 1000000
    python benchmarks/bench_scale.py measure  --root /var/tmp/fstier-scale [--json]
    python benchmarks/bench_scale.py clean    --root /var/tmp/fstier-scale
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import xxhash
from _raw import drop_caches  # the benchmarks dir is sys.path[0] for a script

from fstier.config import FstierConfig, parse_config
from fstier.file_mapper import FileMapper
from fstier.io.blockfile import (
    HEADER_SIZE,
    BlockHeader,
    ChecksumKind,
    encode_header_into,
    payload_checksum,
)
from fstier.io.manifest import ensure_manifest
from fstier.keys import BlockKey

PAGE = 4096  # one 4 KiB canonical page per file: files are 8 KiB on disk
LOOKUP_KEYS = 65_536


def scale_config(root: Path) -> FstierConfig:
    """A one-group model whose canonical page is exactly 4 KiB
    (2 x 16 tokens x 1 head x 64 x fp16)."""
    return parse_config(
        {
            "tier": {"root_dir": str(root), "read_threads": 8, "lookup_cache_ttl_s": 60.0},
            "model": {
                "name": "bench/scale-4k",
                "dtype": "float16",
                "groups": [
                    {"kind": "full_attention", "block_size": 16, "num_layers": 1, "num_kv_heads": 1, "head_size": 64}
                ],
            },
        }
    )


def scale_key(i: int) -> BlockKey:
    """Key ``i``: a uniformly distributed 16-byte hash, reproducible from ``i``."""
    return BlockKey(xxhash.xxh3_128_digest(i.to_bytes(8, "little")), 0)


def _payload(i: int) -> bytes:
    return (i.to_bytes(8, "little") * (PAGE // 8))[:PAGE]


def _gen_worker(args: tuple[str, int, int, int, bytes]) -> int:
    root_s, start, stop, step, digest = args
    mapper = FileMapper(scale_config(Path(root_s)))
    buf = bytearray(HEADER_SIZE + PAGE)
    view = memoryview(buf)
    written = 0
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    for i in range(start, stop, step):
        key = scale_key(i)
        payload = _payload(i)
        view[HEADER_SIZE:] = payload
        header = BlockHeader(
            key=key,
            namespace_digest=digest,
            payload_len=PAGE,
            page_count=1,
            page_bytes=PAGE,
            checksum_kind=ChecksumKind.XXH3_64,
            payload_checksum=payload_checksum(payload),
        )
        encode_header_into(header, view)
        path = mapper.path_for(key)
        try:
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError:
            os.makedirs(path.parent, exist_ok=True)
            fd = os.open(path, flags, 0o644)
        except FileExistsError:
            continue
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        written += 1
    return written


def generate(root: Path, files: int, procs: int) -> dict[str, Any]:
    mapper = FileMapper(scale_config(root))
    ensure_manifest(mapper)
    t0 = time.perf_counter()
    chunk = 50_000
    jobs = [
        (str(root), lo, min(lo + chunk, files), 1, mapper.digest_bytes) for lo in range(0, files, chunk)
    ]
    done = 0
    with mp.get_context("fork").Pool(procs) as pool:
        for n in pool.imap_unordered(_gen_worker, jobs):
            done += n
            print(f"  generated {done:,} files ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    return {"files": files, "written": done, "seconds": round(seconds, 1), "files_per_s": round(done / seconds)}


# -- measurement: each step in a fresh child, peak RSS from RUSAGE_CHILDREN ----
def _run_child(argv: list[str]) -> dict[str, Any]:
    """Run ``argv`` in a fresh process; wall seconds, peak RSS (MiB), parsed JSON stdout."""
    # A wrapper process (python -c) runs the command and reports its child's
    # ru_maxrss, so successive steps never see each other's peaks.
    wrapper = (
        "import json,resource,subprocess,sys,time;"
        "t=time.perf_counter();p=subprocess.run(sys.argv[1:],capture_output=True,text=True);"
        "s=time.perf_counter()-t;r=resource.getrusage(resource.RUSAGE_CHILDREN);"
        "print(json.dumps({'rc':p.returncode,'s':s,'rss_kib':r.ru_maxrss,'out':p.stdout,'err':p.stderr[-2000:]}))"
    )
    res = subprocess.run([sys.executable, "-c", wrapper, *argv], capture_output=True, text=True, check=True)
    info = json.loads(res.stdout)
    try:
        parsed = json.loads(info["out"]) if info["out"].strip() else None
    except ValueError:
        parsed = None
    return {
        "rc": info["rc"],
        "seconds": round(info["s"], 2),
        "peak_rss_mib": round(info["rss_kib"] / 1024, 1),
        "json": parsed,
        "stderr": info["err"],
    }


_LOOKUP_CHILD = """
import json, sys, time
sys.path.insert(0, {bench_dir!r})
from bench_scale import scale_config, scale_key, LOOKUP_KEYS
from pathlib import Path
from fstier.slots.host_pool import HostBlockPool
from fstier.manager import FsTier
keys = [scale_key(i) for i in range({start}, {start} + LOOKUP_KEYS)]
pool = HostBlockPool(4, 8192)
tier = FsTier(scale_config(Path({root!r})), pool)
t = time.perf_counter(); hits = tier.lookup(keys); cold = time.perf_counter() - t
warm = min((lambda t0: (tier.lookup(keys), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(5))
tier.close(); pool.close()
print(json.dumps({{"keys": len(keys), "hits": hits, "cold_s": cold, "warm_s": warm}}))
"""




def measure(root: Path, files: int, fstier_bin: str) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []

    def step(name: str, argv: list[str], cold: bool = True) -> dict[str, Any]:
        dropped = drop_caches() if cold else False
        r = _run_child(argv)
        r.update(name=name, cache_dropped=dropped, command=" ".join(argv))
        steps.append(r)
        print(
            f"  {name}: {r['seconds']} s, peak RSS {r['peak_rss_mib']} MiB, rc {r['rc']}", file=sys.stderr, flush=True
        )
        return r

    step("inspect", [fstier_bin, "inspect", str(root), "--json"])
    step("inspect (warm cache)", [fstier_bin, "inspect", str(root), "--json"], cold=False)
    step("verify --headers-only", [fstier_bin, "verify", str(root), "--headers-only", "--json"])
    step("verify (full)", [fstier_bin, "verify", str(root), "--json"])
    code = _LOOKUP_CHILD.format(bench_dir=str(Path(__file__).parent), start=files // 3, root=str(root))
    step("FsTier.lookup 65,536 keys", [sys.executable, "-c", code])
    inspect_json = steps[0]["json"] or {}
    total = sum(ns.get("bytes", 0) for ns in inspect_json.get("namespaces", [])) or files * (HEADER_SIZE + PAGE)
    step("gc to half", [fstier_bin, "gc", str(root), "--max-bytes", str(total // 2), "--json"])
    step("inspect after gc", [fstier_bin, "inspect", str(root), "--json"])
    return {"root": str(root), "files": files, "bytes": total, "steps": steps}


def _summary(step: dict[str, Any]) -> str:
    j = step.get("json") or {}
    if "hits" in j:
        return f"hits {j['hits']:,}/{j['keys']:,}; cold {j['cold_s'] * 1e3:.0f} ms, warm {j['warm_s'] * 1e3:.1f} ms"
    if "evicted_files" in j:
        return f"evicted {j['evicted_files']:,} files in {j['passes']} passes; {j['bytes_after'] / 2**30:.2f} GiB left"
    if "namespaces" in j:
        parts = []
        for ns in j["namespaces"]:
            if "checked" in ns:
                parts.append(f"checked {ns['checked']:,}, good {ns['good']:,}, bad {ns['bad']:,}")
            else:
                parts.append(f"{ns.get('files', 0):,} files, {ns.get('bytes', 0) / 2**30:.2f} GiB")
        return "; ".join(parts)
    return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["generate", "measure", "clean", "all"])
    ap.add_argument("--root", type=Path, default=Path("/var/tmp/fstier-scale"))
    ap.add_argument("--files", type=int, default=1_000_000)
    ap.add_argument("--procs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--fstier", default=str(Path(sys.executable).with_name("fstier")))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out: dict[str, Any] = {}
    if args.action in ("generate", "all"):
        if args.root.exists() and any(args.root.iterdir()):
            sys.exit(f"{args.root} is not empty; run 'clean' first")
        out["generate"] = generate(args.root, args.files, args.procs)
    if args.action in ("measure", "all"):
        out["measure"] = measure(args.root, args.files, args.fstier)
    if args.action in ("clean", "all"):
        t0 = time.perf_counter()
        shutil.rmtree(args.root, ignore_errors=True)
        out["clean_seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    if "generate" in out:
        g = out["generate"]
        print(f"generated {g['written']:,} files in {g['seconds']} s ({g['files_per_s']:,}/s)")
    if "measure" in out:
        print("| step | seconds | peak RSS MiB | result |")
        print("|---|---:|---:|---|")
        for s in out["measure"]["steps"]:
            print(f"| {s['name']} | {s['seconds']} | {s['peak_rss_mib']} | {_summary(s)} |")
    if "clean_seconds" in out:
        print(f"removed the tree in {out['clean_seconds']} s")


if __name__ == "__main__":
    main()
