"""GPU staging throughput: RankStager stage_out/stage_in vs a pinned contiguous copy.

Needs a CUDA device. For each canonical page size (16 KiB, 64 KiB, 256 KiB,
2 MiB), cache kind (``per-layer``: one packed tensor per layer; ``cross``: one
row per block for all layers), tp share (1, 1/2, 1/4 of the heads: rank 0 of
tp 1, 2, 4), KV layout (NHD, HND) and copy mode (``dma``, ``kernel``), rank 0
stages a batch of scattered device blocks out to pool slots and back in. The
baseline is one ``cudaMemcpyAsync`` of the same number of bytes between a
device buffer and pinned host memory (the pool), each direction, in the same
run. Times are wall clock from the call to the batch's completion (the
caller's view: index building, launches, copies), median of ``--repeats``
after warm-up. Every configuration's bytes are compared with the CPU stager's
result on the same data (slots after stage_out, the whole cache after
stage_in); a mismatch stops the run.

Slots are consecutive (a fresh pool hands them out so); ``--shuffle-slots``
also measures ``dma`` with slots in random order (one copy per page then).

    python3 benchmarks/bench_gpu_staging.py [--batch-mib 16] [--json out.json]
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
from fstier.gpu_copy import RankStager  # noqa: E402
from fstier.layout import (  # noqa: E402
    CanonicalKVCaches,
    LoadStoreSpec,
    PoolTensors,  # noqa: E402
    rank_page_mapping,
)
from fstier.slots.host_pool import HostBlockPool  # noqa: E402

HEADS, HEAD_SIZE = 8, 128  # 2 KiB per token row of K or V (fp16)
#: page KiB -> (layers, block_size); page = layers * 2 * block_size * 2 KiB
PAGES = {16: (2, 2), 64: (4, 4), 256: (4, 16), 2048: (32, 16)}


DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _median_s(fn, repeats: int) -> float:
    fn()
    fn()
    samples = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _caches(full: torch.Tensor, kind: str) -> CanonicalKVCaches:
    """``full``: (layers, blocks, 2, a, b, dim) of one rank."""
    if kind == "per-layer":
        return CanonicalKVCaches.register([[full[i] for i in range(full.shape[0])]])
    return CanonicalKVCaches.register([[full.transpose(0, 1).contiguous()]])


def run_case(page_kib, kind, tp, kv, modes, batch_mib, repeats, shuffle, inflight, gen, profile=False):
    layers, bs = PAGES[page_kib]
    model = ModelSpec(
        name="bench",
        dtype="float16",
        groups=[
            {"num_layers": layers, "num_kv_heads": HEADS, "head_size": HEAD_SIZE, "block_size": bs, "kv_layout": kv}
        ],
    )
    group = model.groups[0]
    cpb = group.page_bytes
    assert cpb == page_kib * 1024, (cpb, page_kib)
    share = cpb // tp
    n = max(16, min(8192, batch_mib * 2**20 // share))
    num_blocks = n + n // 4
    heads = HEADS // tp
    shape = (
        (layers, num_blocks, 2, bs, heads, HEAD_SIZE) if kv == "NHD" else (layers, num_blocks, 2, heads, bs, HEAD_SIZE)
    )
    # Random bits (NaN payloads included): the copies must be bit-exact.
    cpu_kv = torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16).view(torch.float16)
    mapping = rank_page_mapping(group, ParallelSpec(tp_size=tp, rank=0))
    ids = torch.randperm(num_blocks, generator=gen)[:n].tolist()
    ids_in = torch.randperm(num_blocks, generator=gen)[:n].tolist()
    spec_out, spec_in = LoadStoreSpec(ids, [n], [0]), LoadStoreSpec(ids_in, [n], [0])
    results = []
    with HostBlockPool(n, cpb) as pool, HostBlockPool(n, cpb) as ref_pool:
        slots_adj = pool.alloc(n)
        ref_slots = ref_pool.alloc(n)
        # CPU reference: the host stager on the same data, same poison.
        PoolTensors.of(pool).tensor.fill_(0x5A)
        PoolTensors.of(ref_pool).tensor.fill_(0x5A)
        ref_caches = _caches(cpu_kv.clone(), kind)
        ref = RankStager(ref_caches, [mapping], ref_pool)
        ref.wait(ref.stage_out(spec_out, ref_slots))
        ref_in_kv = torch.zeros_like(cpu_kv)
        ref_in = RankStager(_caches(ref_in_kv, kind), [mapping], ref_pool)
        ref_in.wait(ref_in.stage_in(ref_slots, spec_in))
        ref_in_rows = [t.clone() for t in ref_in.caches.tensors]
        # Baseline: the same bytes as one contiguous pinned <-> device copy.
        host = PoolTensors.of(pool).tensor.view(-1)[: n * share]
        dev = torch.empty(n * share, dtype=torch.uint8, device=DEVICE)

        def d2h():
            host.copy_(dev, non_blocking=True)
            _sync()

        def h2d():
            dev.copy_(host, non_blocking=True)
            _sync()

        base_out, base_in = n * share / _median_s(d2h, repeats) / 1e9, n * share / _median_s(h2d, repeats) / 1e9
        variants = [(m, False) for m in modes] + ([(m, True) for m in modes] if shuffle else [])
        for mode, shuffled in variants:
            slots = list(slots_adj)
            if shuffled:
                perm = torch.randperm(n, generator=gen).tolist()
                slots = [slots_adj[i] for i in perm]
            dev_kv = cpu_kv.to(DEVICE)
            st = RankStager(_caches(dev_kv, kind), [mapping], pool, cuda_copy=mode)
            PoolTensors.of(pool).tensor.fill_(0x5A)
            t_out = _median_s(lambda st=st, slots=slots: st.wait(st.stage_out(spec_out, slots)), repeats)
            # Correctness: the slots hold what the CPU stager wrote (same slot order).
            for k in range(n):
                if not torch.equal(
                    PoolTensors.of(pool).slot_tensor(slots[k]), PoolTensors.of(ref_pool).slot_tensor(ref_slots[k])
                ):
                    raise SystemExit(
                        f"MISMATCH stage_out {page_kib}KiB {kind} tp{tp} {kv} {mode}: slot of block {ids[k]}"
                    )
            _sync()
            ops0 = st.stats.ops
            t0 = time.perf_counter()
            bid = st.stage_out(spec_out, slots)
            enqueue_us = (time.perf_counter() - t0) * 1e6
            st.wait(bid)
            ops = st.stats.ops - ops0
            if profile:
                import cProfile
                import pstats

                prof = cProfile.Profile()
                prof.enable()
                for _ in range(50):
                    st.stage_out(spec_out, slots)
                prof.disable()
                st.wait()
                print(f"--- profile: 50 x stage_out, {page_kib} KiB {kind} 1/{tp} {kv} {mode} n={n}")
                pstats.Stats(prof).sort_stats("tottime").print_stats(14)
            in_kv = torch.zeros_like(dev_kv)
            st_in = RankStager(_caches(in_kv, kind), [mapping], pool, cuda_copy=mode)
            t_in = _median_s(lambda st_in=st_in, slots=slots: st_in.wait(st_in.stage_in(slots, spec_in)), repeats)

            def many_out(st=st, slots=slots):
                for _ in range(inflight):
                    st.stage_out(spec_out, slots)
                st.wait()

            def many_in(st_in=st_in, slots=slots):
                for _ in range(inflight):
                    st_in.stage_in(slots, spec_in)
                st_in.wait()

            tk_out, tk_in = _median_s(many_out, repeats) / inflight, _median_s(many_in, repeats) / inflight
            for got, want in zip(st_in.caches.tensors, ref_in_rows, strict=True):
                if not torch.equal(got.cpu(), want):
                    raise SystemExit(f"MISMATCH stage_in {page_kib}KiB {kind} tp{tp} {kv} {mode}")
            moved = n * share
            results.append(
                {
                    "page_kib": page_kib,
                    "cache": kind,
                    "tp": tp,
                    "kv": kv,
                    "mode": mode + ("/shuffled" if shuffled else ""),
                    "blocks": n,
                    "mib": round(moved / 2**20, 1),
                    "out_gbs": moved / t_out / 1e9,
                    "in_gbs": moved / t_in / 1e9,
                    "outk_gbs": moved / tk_out / 1e9,
                    "ink_gbs": moved / tk_in / 1e9,
                    "base_out_gbs": base_out,
                    "base_in_gbs": base_in,
                    "out_ratio": moved / t_out / 1e9 / base_out,
                    "in_ratio": moved / t_in / 1e9 / base_in,
                    "outk_ratio": moved / tk_out / 1e9 / base_out,
                    "ink_ratio": moved / tk_in / 1e9 / base_in,
                    "enqueue_us": enqueue_us,
                    "ops_per_batch": ops,
                }
            )
            del st, st_in, dev_kv, in_kv
    return results


def print_tables(rows: list[dict], inflight: int, mode: str) -> None:
    """Markdown: one mode per configuration, then every mode's median over configurations."""
    by = {(r["page_kib"], r["cache"], r["tp"], r["kv"], r["mode"]): r for r in rows}
    print(
        f"\n{mode}: GB/s (x the pinned contiguous copy); 1 = one batch at a time, {inflight} = {inflight} batches "
        "queued back to back; shuffled = slots in random order\n"
    )
    print(
        f"| page | cache | share | layout | blocks | out 1 | out {inflight} | in 1 | in {inflight} | "
        f"out {inflight} shuffled | in {inflight} shuffled | copy out / in |"
    )
    print("| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if r["mode"] != mode:
            continue
        sh = by.get((r["page_kib"], r["cache"], r["tp"], r["kv"], mode + "/shuffled"))

        def cell(x, k):
            return f"{x[k + '_gbs']:.1f} ({x[k + '_ratio']:.2f})" if x else "-"

        print(
            f"| {r['page_kib']} KiB | {r['cache']} | 1/{r['tp']} | {r['kv']} | {r['blocks']} | {cell(r, 'out')} | "
            f"{cell(r, 'outk')} | {cell(r, 'in')} | {cell(r, 'ink')} | {cell(sh, 'outk')} | {cell(sh, 'ink')} | "
            f"{r['base_out_gbs']:.1f} / {r['base_in_gbs']:.1f} |"
        )
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    pages = list(dict.fromkeys(r["page_kib"] for r in rows))
    print(f"\nmedian (min) ratio to the contiguous copy over caches, shares and layouts, {inflight} in flight\n")
    print("| mode | " + " | ".join(f"{p} KiB out | {p} KiB in" for p in pages) + " |")
    print("| --- | " + " | ".join("---: | ---:" for _ in pages) + " |")
    for m in modes:
        cells = []
        for p in pages:
            sel = [r for r in rows if r["mode"] == m and r["page_kib"] == p]
            for k in ("outk_ratio", "ink_ratio"):
                v = [r[k] for r in sel]
                cells.append(f"{statistics.median(v):.2f} ({min(v):.2f})")
        print(f"| {m} | " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-mib", type=int, default=64, help="rank bytes per batch (blocks: 16..8192)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--pages", default="16,64,256,2048", help="page sizes in KiB")
    ap.add_argument("--modes", default="dma,kernel")
    ap.add_argument("--shuffle-slots", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile the enqueue of the first case's stage_out")
    ap.add_argument("--inflight", type=int, default=4, help="batches queued back to back for the pipelined figure")
    ap.add_argument("--json", default=None, help="write all rows here")
    ap.add_argument("--device", default="cuda", help="cpu: smoke-test the logic on CPU (numbers meaningless)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_staging: needs a CUDA device", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    name = torch.cuda.get_device_properties(0).name if DEVICE == "cuda" else "cpu (emulated copies)"
    print(f"device: {name}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    modes = args.modes.split(",")
    rows = []
    for page in (int(x) for x in args.pages.split(",")):
        for kind in ("per-layer", "cross"):
            for tp in (1, 2, 4):
                for kv in ("NHD", "HND"):
                    t0 = time.perf_counter()
                    rs = run_case(
                        page, kind, tp, kv, modes, args.batch_mib, args.repeats, args.shuffle_slots, args.inflight, gen,
                        profile=args.profile and not rows,
                    )
                    rows += rs
                    if args.json:  # after every case: a run cut short keeps what it measured
                        Path(args.json).write_text(
                            json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=1)
                        )
                    for r in rs:
                        print(
                            f"{r['page_kib']:>5} KiB {r['cache']:<9} 1/{r['tp']} {r['kv']} {r['mode']:<12} "
                            f"n={r['blocks']:<5} out {r['out_gbs']:5.1f} / {r['outk_gbs']:5.1f} GB/s "
                            f"({r['out_ratio']:.2f}x / {r['outk_ratio']:.2f}x)  in {r['in_gbs']:5.1f} / "
                            f"{r['ink_gbs']:5.1f} GB/s ({r['in_ratio']:.2f}x / {r['ink_ratio']:.2f}x)  "
                            f"enqueue {r['enqueue_us']:.0f} us ops {r['ops_per_batch']}",
                            flush=True,
                        )
                    print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=1))
    print_tables(rows, args.inflight, "auto" if "auto" in modes else modes[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
