"""Sweeps of the end-to-end pipeline (bench_pipeline.py) and a plot of GB/s against block size.

Every cell is one :func:`bench_pipeline.run_pipeline` call: tp=2 stage_out +
store, cold load + tp=4 stage_in, with the raw O_DIRECT baselines measured in
the same call on the same directory (rounds alternate the order; medians).
Sweeps, each varying one thing from the default (2 MiB pages,
blocks_per_file 1, 8 read + 4 write threads, checksum on, O_DIRECT auto):

- ``size``: canonical page (GPU block, all layers) 64 KiB .. 16 MiB;
- ``bpf``: blocks_per_file 1, 4, 16 at 64 KiB and 256 KiB pages;
- ``threads``: (read, write) = (2, 1), (4, 2), (8, 4), (16, 8);
- ``checksum``: off; ``odirect``: off (buffered I/O, page cache dropped
  before loads when run as root).

``--plot`` writes docs/img/pipeline_gbps_vs_block.png: store and load GB/s
against the GPU block size, with the raw lines drawn and the
blocks_per_file points at 64 KiB / 256 KiB.

    .venv/bin/python benchmarks/bench_sweep.py [--sweeps size,bpf,threads,checksum,odirect]
        [--total 256MiB] [--rounds 3] [--json out.json] [--plot docs/img/pipeline_gbps_vs_block.png]
    .venv/bin/python benchmarks/bench_sweep.py --from-json out.json --plot ...   # re-plot only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pipeline import PipelineParams, run_pipeline  # noqa: E402

from fstier.units import parse_size  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
SIZES = [64 * KIB, 256 * KIB, 1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB]


def cells(sweeps: list[str], base: PipelineParams) -> list[tuple[str, PipelineParams]]:
    out: list[tuple[str, PipelineParams]] = []
    if "size" in sweeps:
        for s in SIZES:
            # Keep >= 2 chunks and jobs of ~>= 4 MiB at every size.
            chunk = max(2, min(64, (8 * MIB) // s))
            out.append(("size", replace(base, page_bytes=s, chunk_blocks=chunk)))
    if "bpf" in sweeps:
        for s in (64 * KIB, 256 * KIB):
            for bpf in (1, 4, 16):
                out.append(("bpf", replace(base, page_bytes=s, blocks_per_file=bpf, chunk_blocks=64)))
    if "threads" in sweeps:
        for r, w in ((2, 1), (4, 2), (8, 4), (16, 8)):
            out.append(("threads", replace(base, read_threads=r, write_threads=w)))
    if "checksum" in sweeps:
        out.append(("checksum", replace(base, checksum=False)))
    if "odirect" in sweeps:
        out.append(("odirect", replace(base, o_direct="off")))
    return out


def row_of(sweep: str, res: dict[str, Any]) -> dict[str, Any]:
    p = res["params"]
    return {
        "sweep": sweep,
        "page_bytes": p["page_bytes"],
        "blocks_per_file": p["blocks_per_file"],
        "file_payload_bytes": p["page_bytes"] * p["blocks_per_file"],
        "read_threads": p["read_threads"],
        "write_threads": p["write_threads"],
        "checksum": p["checksum"],
        "o_direct": res["o_direct"],
        "total_bytes": res["bytes"],
        "store_gbps": round(res["store_gbps"], 3),
        "load_gbps": round(res["load_gbps"], 3),
        "raw_write_gbps": round(res["raw_write_gbps"], 3),
        "raw_read_gbps": round(res["raw_read_gbps"], 3),
        "raw_write_large_gbps": round(res["raw_write_large_gbps"], 3),
        "raw_write_files_gbps": round(res["raw_write_files_gbps"], 3),
        "raw_read_large_gbps": round(res["raw_read_large_gbps"], 3),
        "raw_read_files_gbps": round(res["raw_read_files_gbps"], 3),
        "store_ratio": round(res["store_ratio"], 3),
        "load_ratio": round(res["load_ratio"], 3),
        "stage_out_gbps": round(res["stage_out_gbps"], 2),
        "stage_in_gbps": round(res["stage_in_gbps"], 2),
    }


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| sweep | GPU block | bpf | file payload | threads r+w | checksum | O_DIRECT | store GB/s | raw write "
        "(large / file-per-block) | store ratio | load GB/s | raw read (large / file-per-block) | load ratio |"
    )
    print("|---|---:|---:|---:|---|---|---|---:|---|---:|---:|---|---:|")
    for r in rows:
        print(
            f"| {r['sweep']} | {_size(r['page_bytes'])} | {r['blocks_per_file']} | {_size(r['file_payload_bytes'])} | "
            f"{r['read_threads']}+{r['write_threads']} | {'on' if r['checksum'] else 'off'} | "
            f"{'on' if r['o_direct'] else 'off'} | {r['store_gbps']:.2f} | "
            f"{r['raw_write_large_gbps']:.2f} / {r['raw_write_files_gbps']:.2f} | {r['store_ratio']:.2f} | "
            f"{r['load_gbps']:.2f} | {r['raw_read_large_gbps']:.2f} / {r['raw_read_files_gbps']:.2f} | "
            f"{r['load_ratio']:.2f} |"
        )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size_rows = sorted((r for r in rows if r["sweep"] == "size"), key=lambda r: r["page_bytes"])
    bpf_rows = [r for r in rows if r["sweep"] == "bpf" and r["blocks_per_file"] > 1]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, op, raw, raw_l, raw_f in (
        (axes[0], "store", "raw_write_gbps", "raw_write_large_gbps", "raw_write_files_gbps"),
        (axes[1], "load", "raw_read_gbps", "raw_read_large_gbps", "raw_read_files_gbps"),
    ):
        xs = [r["page_bytes"] / KIB for r in size_rows]
        ax.plot(
            xs, [r[f"{op}_gbps"] for r in size_rows], "o-", color="tab:blue", lw=2, label="fstier end-to-end (bpf=1)"
        )
        ax.plot(xs, [r[raw] for r in size_rows], "s-", color="black", lw=1.5, label="raw O_DIRECT (best shape)")
        ax.plot(xs, [r[raw_l] for r in size_rows], ":", color="gray", label="raw: one large file")
        ax.plot(xs, [r[raw_f] for r in size_rows], "--", color="gray", label="raw: new file per block")
        for bpf, marker in ((4, "^"), (16, "D")):
            pts = [r for r in bpf_rows if r["blocks_per_file"] == bpf]
            if pts:
                ax.plot(
                    [r["page_bytes"] / KIB for r in pts],
                    [r[f"{op}_gbps"] for r in pts],
                    marker,
                    color="tab:orange" if bpf == 4 else "tab:red",
                    ms=8,
                    ls="none",
                    label=f"fstier, blocks_per_file={bpf}",
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [_size(r["page_bytes"]) for r in size_rows], rotation=30)
        ax.set_xlabel("GPU block (canonical page, all layers)")
        ax.set_title(f"{op} (tp=2 stage_out + store)" if op == "store" else "load (cold, + tp=4 stage_in)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s (KV payload bytes)")
    axes[0].set_ylim(bottom=0)
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle("fstier end-to-end vs raw O_DIRECT, same run, same directory (2-core VM, virtio disk)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweeps", default="size,bpf,threads,checksum,odirect")
    ap.add_argument("--total", default="256MiB", help="KV bytes per cell and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--root", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    ap.add_argument("--from-json", type=Path, default=None, help="skip measuring; re-plot/print these rows")
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    if args.from_json:
        rows = json.loads(args.from_json.read_text())["rows"]
    else:
        base = PipelineParams(total_bytes=parse_size(args.total), rounds=args.rounds)
        rows = []
        t0 = time.perf_counter()
        for sweep, p in cells([s.strip() for s in args.sweeps.split(",") if s.strip()], base):
            res = run_pipeline(args.root, p)
            rows.append(row_of(sweep, res))
            r = rows[-1]
            print(
                f"  [{time.perf_counter() - t0:5.0f}s] {sweep} page {_size(p.page_bytes)} bpf {p.blocks_per_file} "
                f"t {p.read_threads}+{p.write_threads} ck {p.checksum} od {p.o_direct}: store {r['store_gbps']:.2f} "
                f"(x{r['store_ratio']:.2f}) load {r['load_gbps']:.2f} (x{r['load_ratio']:.2f})",
                file=sys.stderr,
                flush=True,
            )
            if args.json:  # keep partial results if the run is cut short
                args.json.write_text(json.dumps({"rows": rows}, indent=2))
    print_table(rows)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
