"""Staging throughput: RankStager stage_out/stage_in vs a plain contiguous copy.

Cases (same model, same bytes): ``cross-layer`` (one contiguous row per block,
allocate_cross_layer_kv_caches), ``per-layer`` (one packed tensor per layer),
``per-layer tp=2`` (rank 0 of tp=2: 1 KiB-ish strided fragments). The baseline
is ``dst.copy_(src)`` of the same number of bytes between two touched
contiguous host buffers, measured in the same run. Pool and tensors are
prefaulted and a warm-up pass runs first (docs/architecture.md, "Facts of the
machines").

    .venv/bin/python benchmarks/bench_staging.py [--layers 16] [--blocks 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fstier.config import ModelSpec, ParallelSpec  # noqa: E402
from fstier.cross_layer import LayerKVSpec, allocate_cross_layer_kv_caches  # noqa: E402
from fstier.gpu_copy import RankStager  # noqa: E402
from fstier.layout import (  # noqa: E402
    CanonicalKVCaches,
    LoadStoreSpec,
    rank_page_mapping,
)
from fstier.slots.host_pool import HostBlockPool  # noqa: E402


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=64, help="blocks per stage call")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = ModelSpec(
        name="bench",
        dtype="float16",
        groups=[
            {
                "num_layers": args.layers,
                "num_kv_heads": args.heads,
                "head_size": args.head_size,
                "block_size": args.block_size,
            }
        ],
    )
    group = model.groups[0]
    num_blocks = 2 * args.blocks
    ids = list(range(0, num_blocks, 2))  # every other block: a realistic scattered batch
    spec = LoadStoreSpec(ids, [len(ids)], [0])
    rows = []
    with HostBlockPool(args.blocks, group.page_bytes) as pool:
        slots = pool.alloc(args.blocks)
        cases = []
        specs = [
            LayerKVSpec.attention(f"l{i}", 0, group.block_size, group.num_kv_heads, group.head_size)
            for i in range(args.layers)
        ]
        cross = allocate_cross_layer_kv_caches(specs, num_blocks, "cpu", "float16")
        cases.append(("cross-layer tp=1", cross.registration, ParallelSpec()))
        per_layer = [
            torch.randn(num_blocks, 2, group.block_size, group.num_kv_heads, group.head_size).half()
            for _ in range(args.layers)
        ]
        cases.append(("per-layer tp=1", CanonicalKVCaches.register([per_layer]), ParallelSpec()))
        hl = group.num_kv_heads // 2
        per_layer_tp2 = [t[:, :, :, :hl].contiguous() for t in per_layer]
        cases.append(("per-layer tp=2 r0", CanonicalKVCaches.register([per_layer_tp2]), ParallelSpec(tp_size=2)))
        for name, caches, par in cases:
            for t in caches.tensors:
                t.random_(-128, 127)
            mapping = rank_page_mapping(group, par)
            st = RankStager(caches, [mapping], pool)
            nbytes = len(ids) * mapping.local_page_bytes
            src = torch.randint(-128, 127, (nbytes,), dtype=torch.int8)
            dst = torch.empty_like(src).zero_()
            t_base = _time(lambda src=src, dst=dst: dst.copy_(src), args.repeats)
            t_out = _time(lambda st=st: st.wait(st.stage_out(spec, slots)), args.repeats)
            t_in = _time(lambda st=st: st.wait(st.stage_in(slots, spec)), args.repeats)
            frag = min(r.fragment_size for r in mapping.load_runs)
            rows.append(
                {
                    "case": name,
                    "bytes": nbytes,
                    "min_run_bytes": frag,
                    "copies_per_call": sum(st.num_plans[0]) // 2,
                    "baseline_gbps": nbytes / t_base / 1e9,
                    "stage_out_gbps": nbytes / t_out / 1e9,
                    "stage_in_gbps": nbytes / t_in / 1e9,
                }
            )
        pool.free(slots)
    for r in rows:
        r["out_vs_baseline"] = r["stage_out_gbps"] / r["baseline_gbps"]
        r["in_vs_baseline"] = r["stage_in_gbps"] / r["baseline_gbps"]
    by = {r["case"]: r for r in rows}
    cross_ratio = {
        "stage_out": by["cross-layer tp=1"]["stage_out_gbps"] / by["per-layer tp=1"]["stage_out_gbps"],
        "stage_in": by["cross-layer tp=1"]["stage_in_gbps"] / by["per-layer tp=1"]["stage_in_gbps"],
    }
    result = {
        "args": vars(args),
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
        "cross_vs_per_layer": cross_ratio,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{'case':<20} {'MiB':>6} {'run B':>8} {'copies':>6} {'base GB/s':>10} "
        f"{'out GB/s':>9} {'in GB/s':>8} {'out/base':>8} {'in/base':>8}"
    )
    for r in rows:
        print(
            f"{r['case']:<20} {r['bytes'] / 2**20:>6.0f} {r['min_run_bytes']:>8} {r['copies_per_call']:>6} "
            f"{r['baseline_gbps']:>10.2f} {r['stage_out_gbps']:>9.2f} {r['stage_in_gbps']:>8.2f} "
            f"{r['out_vs_baseline']:>8.2f} {r['in_vs_baseline']:>8.2f}"
        )
    print(
        f"cross-layer / per-layer: stage_out {cross_ratio['stage_out']:.2f}x, stage_in {cross_ratio['stage_in']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
