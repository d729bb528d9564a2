"""Store and load throughput of LMCache L2 adapters on one harness:
fstier (``FstierL2Adapter``, checksums on) against LMCache's own disk
adapters ``fs``, ``fs_native`` and ``raw_block`` (a file-backed device), in
one process, rounds interleaved so every adapter sees the same machine load.

Each adapter is built by LMCache's own factory (``create_l2_adapter``) over
an L1 buffer and memory objects made by LMCache's ``lmcache bench l2``
helpers (``make_aligned_tensor``, ``make_memory_objects``,
``create_l1_memory_desc``, ``wait_eventfd``). A round stores ``--keys`` new
chunks in one task and waits on the adapter's store eventfd, then loads them
twice into other objects, waiting on the load eventfd, and checks every byte:

* **warm**: right after the store, as LMCache's buffered adapters find their
  files: in the page cache;
* **cold**: after the adapter's files are written back (``fsync``) and
  dropped from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)`` on
  each file of the adapter's directory, or on ``raw_block``'s device file;
  not counted in any timing), so every adapter reads the device. Only these
  files are dropped: other processes' caches are left alone
  (``/proc/sys/vm/drop_caches`` would drop the whole machine's).

The keys are a real server's: one model, one ``kv_rank``, 32-byte chunk
hashes. (``lmcache bench l2`` itself gives every key its own ``kv_rank``,
which fstier maps, as LMCache's keys say, to a namespace per key; that is
why this harness makes its own keys.)

    make bench-lmcache                      # 256 KiB and 2 MiB chunks
    python benchmarks/bench_lmcache.py --sizes-kib 256 --rounds 9 --json out.json
    python benchmarks/bench_lmcache.py --from-json out.json --plot docs/img/lmcache_l2.png

Prints one table: per size and adapter, the median MB/s of store, warm load
and cold load (wall clock, from submit to the eventfd's result), the median
process CPU seconds per GB of store and warm load (every thread of the
process: a cost that machine load does not inflate), and each fstier
variant's ratio to the best of LMCache's adapters; the load average before
and after is printed with it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

ADAPTERS = ("fstier", "fstier_direct", "fstier_off", "fs", "fs_native", "raw_block")
#: fstier's variants: the adapter's defaults (``DEFAULT_O_DIRECT``,
#: ``cold``: buffered I/O, the page-cache regime of LMCache's own adapters,
#: but large chunks found outside the page cache read direct), ``o_direct:
#: auto`` (direct I/O where the root allows it, so even a warm load reads
#: the device) and ``off`` (all buffered).
FSTIER: dict[str, dict[str, Any]] = {
    "fstier": {}, "fstier_direct": {"o_direct": "auto"}, "fstier_off": {"o_direct": "off"},
}
ALIGN = 4096


def _spec(name: str, work: Path, size: int, max_keys: int) -> dict[str, Any]:
    d = work / name
    if name in FSTIER:
        d.mkdir()
        return {
            "type": "plugin", "module_path": "fstier.integrations.lmcache",
            "class_name": "FstierL2Adapter",
            "adapter_params": {"root_dir": str(d), "checksum": "xxh3", **FSTIER[name]},
        }
    if name in ("fs", "fs_native"):
        d.mkdir()
        return {"type": name, "base_path": str(d)}
    if name == "raw_block":
        slot = size + 4096  # one 4 KiB header per slot
        dev = work / "raw_block.img"
        with open(dev, "wb") as f:
            f.truncate((64 << 20) + slot * (max_keys + 8))
        return {"type": "raw_block", "device_path": str(dev), "slot_bytes": slot,
                "meta_total_bytes": 16 << 20}
    raise ValueError(f"unknown adapter {name!r}; choose from {', '.join(ADAPTERS)}")


def _keys(n: int, round_no: int, salt: str) -> list[Any]:
    from lmcache.v1.distributed.api import ObjectKey

    rank = ObjectKey.ComputeKVRank(1, 0, 1, 0)
    return [
        ObjectKey(hashlib.blake2b(f"{salt}:{round_no}:{i}".encode(), digest_size=32).digest(),
                  "bench/model", rank)
        for i in range(n)
    ]


def _drop_cached(paths: list[Path]) -> None:
    """Write back and drop from the page cache every file under ``paths``."""
    for top in paths:
        files = [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file() and not p.is_symlink()]
        for f in files:
            try:
                fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue  # evicted or renamed meanwhile
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Bench:
    """One adapter with its L1 buffer: store and load rounds."""

    def __init__(self, name: str, spec: dict[str, Any], size: int, keys: int) -> None:
        from lmcache.cli.commands.bench.l2_adapter_bench import data
        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class

        self.name, self.size, self.n, self.data = name, size, keys, data
        self.buf = data.make_aligned_tensor(2 * keys * size, ALIGN)
        cfg = get_l2_adapter_config_class(spec["type"]).from_dict(spec)
        self.adapter = create_l2_adapter(cfg, l1_memory_desc=data.create_l1_memory_desc(self.buf, ALIGN))
        #: what a cold load drops from the page cache (the adapter's files)
        self.files = [Path(spec["adapter_params"]["root_dir"]) if "adapter_params" in spec
                      else Path(spec.get("base_path") or spec["device_path"])]
        self.series: dict[str, list[float]] = {
            k: [] for k in ("store_mbps", "warm_mbps", "cold_mbps", "store_cpu", "warm_cpu")
        }
        self.bad = 0

    def _load(self, keys: list[Any], dst: list[Any]) -> tuple[float, float, Any]:
        """Load ``keys`` into ``dst``: (wall s, process CPU s, bitmap)."""
        a, data = self.adapter, self.data
        c0, t0 = time.process_time(), time.perf_counter()
        tid = a.submit_load_task(keys, dst)
        bits = None
        while bits is None:
            assert data.wait_eventfd(a.get_load_event_fd(), 60), f"{self.name}: load timed out"
            bits = a.query_load_result(tid)
        return time.perf_counter() - t0, time.process_time() - c0, bits

    def store(self, keys: list[Any], src: list[Any]) -> None:
        """Store ``src`` as ``keys`` in one task; return once it succeeded."""
        a, data = self.adapter, self.data
        tid = a.submit_store_task(keys, src)
        done: dict[int, Any] = {}
        while tid not in done:
            assert data.wait_eventfd(a.get_store_event_fd(), 60), f"{self.name}: store timed out"
            done.update(a.pop_completed_store_tasks())
        assert done[tid].is_successful(), f"{self.name}: store failed"

    def round(self, r: int) -> None:
        data, n, size = self.data, self.n, self.size
        src = data.make_memory_objects(self.buf, n, size, 0, fill_offset=r)
        keys = _keys(n, r, self.name)
        c0, t0 = time.process_time(), time.perf_counter()
        self.store(keys, src)
        c1, t1 = time.process_time(), time.perf_counter()
        nbytes = n * size
        s = self.series
        s["store_mbps"].append(nbytes / (t1 - t0) / 1e6)
        s["store_cpu"].append((c1 - c0) / nbytes * 1e9)
        for regime in ("warm", "cold"):
            if regime == "cold":
                _drop_cached(self.files)
            dst = data.make_memory_objects(self.buf, n, size, n * size, fill_offset=r + 128)
            wall, cpu, bits = self._load(keys, dst)
            s[f"{regime}_mbps"].append(nbytes / wall / 1e6)
            if regime == "warm":
                s["warm_cpu"].append(cpu / nbytes * 1e9)
            ok = bits.popcount() == n and all(
                bytes(x.byte_array) == bytes(y.byte_array) for x, y in zip(src, dst, strict=True)
            )
            self.bad += 0 if ok else 1

    def close(self) -> None:
        self.adapter.close()


def run(
    sizes_kib: list[int], keys: int, rounds: int, warmup: int, names: list[str], workdir: str | None
) -> dict[str, Any]:
    out: dict[str, Any] = {"load_before": os.getloadavg(), "cpus": os.cpu_count(), "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="bench-lmcache-", dir=workdir) as tmp:
        for kib in sizes_kib:
            size = kib << 10
            work = Path(tmp) / f"{kib}k"
            work.mkdir()
            total = keys * (rounds + warmup)
            benches = [Bench(n, _spec(n, work, size, total), size, keys) for n in names]
            order = list(benches)
            try:
                for r in range(warmup + rounds):
                    random.Random(r).shuffle(order)
                    for b in order:
                        b.round(r)
                    if r < warmup:
                        for b in benches:
                            for series in b.series.values():
                                series.clear()
            finally:
                for b in benches:
                    b.close()
            out["sizes"][kib] = {
                b.name: {
                    **{k: statistics.median(v) for k, v in b.series.items()},
                    "loads_with_bad_bytes": b.bad,
                }
                for b in benches
            }
    out["load_after"] = os.getloadavg()
    return out


def table(res: dict[str, Any], keys: int) -> str:
    lines = [
        f"load average before {res['load_before'][0]:.2f}, after {res['load_after'][0]:.2f} "
        f"({res['cpus']} CPUs); {keys} chunks per task; median MB/s and CPU s/GB",
        "",
        "| chunk | adapter | store MB/s | warm load MB/s | cold load MB/s | store CPU s/GB "
        "| warm load CPU s/GB | bad loads |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    cols = ("store_mbps", "warm_mbps", "cold_mbps")
    for kib, per in res["sizes"].items():
        for name, r in per.items():
            lines.append(
                f"| {kib} KiB | {name} | {r['store_mbps']:.0f} | {r['warm_mbps']:.0f} | "
                f"{r['cold_mbps']:.0f} | {r['store_cpu']:.2f} | {r['warm_cpu']:.2f} | "
                f"{r['loads_with_bad_bytes']} |"
            )
        own = {n: r for n, r in per.items() if n not in FSTIER}
        for fname in (n for n in FSTIER if n in per and own):
            ratios = [per[fname][c] / max(r[c] for r in own.values()) for c in cols]
            lines.append(
                f"| {kib} KiB | {fname} / best LMCache | {ratios[0]:.2f}x | {ratios[1]:.2f}x | "
                f"{ratios[2]:.2f}x | | | |"
            )
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    """Bars of store, warm-load and cold-load MB/s per adapter, one panel
    per chunk size (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(res["sizes"].items())
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4), squeeze=False)
    cols = (("store_mbps", "store"), ("warm_mbps", "warm load"), ("cold_mbps", "cold load"))
    for ax, (kib, per) in zip(axes[0], sizes, strict=True):
        names = list(per)
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(cols))]
            ax.bar(xs, [per[name][c] for c, _ in cols], width, label=name,
                   hatch="//" if name in FSTIER else None)
        ax.set_xticks(range(len(cols)), [label for _, label in cols])
        ax.set_ylabel("MB/s (median)")
        keys = res.get("keys")
        ax.set_title(f"{kib} KiB chunks" + (f", {keys} per task" if keys else ""))
        ax.legend(fontsize=8, loc="upper left")
    la = res["load_before"][0], res["load_after"][0]
    fig.suptitle(f"LMCache L2 adapters, one run; load average {la[0]:.1f} -> {la[1]:.1f} on {res['cpus']} CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-kib", default="256,2048", help="chunk sizes in KiB (default 256,2048)")
    p.add_argument("--keys", type=int, default=32,
                   help="chunks per store/load task (default 32, as `lmcache bench l2`)")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--adapters", default=",".join(ADAPTERS))
    p.add_argument("--workdir", default=None, help="directory for the roots (default: the temp dir)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--from-json", default=None, help="print (and plot) a saved result instead of running")
    p.add_argument("--plot", default=None, help="write a PNG of the result here (needs matplotlib)")
    a = p.parse_args(argv)
    if a.from_json:
        res = json.loads(Path(a.from_json).read_text())
    else:
        res = run(
            [int(x) for x in a.sizes_kib.split(",")], a.keys, a.rounds, a.warmup,
            a.adapters.split(","), a.workdir,
        )
        res["keys"] = a.keys
    print(table(res, res.get("keys", a.keys)))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    if a.plot:
        plot(res, Path(a.plot))
    return 1 if any(r["loads_with_bad_bytes"] for per in res["sizes"].values() for r in per.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
