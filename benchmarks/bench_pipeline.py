"""End-to-end pipeline: stage_out -> store -> (cold) -> load -> stage_in, against raw O_DIRECT.

The workload is a full-attention model whose canonical page (all layers,
all heads of one 16-token block) is ``--page`` bytes (2 MiB by default: 32
layers x 8 KV heads x 128 x fp16, a Llama-3-8B-shaped block); ``--total``
bytes of KV (1 GiB by default) are stored by a tp=2 deployment and loaded by
a tp=4 deployment of the same model, which is legal because full attention
is parallel-agnostic (both FsTiers resolve to the same namespace). Every
rank has its own cross-layer KV cache (``allocate_cross_layer_kv_caches``,
CPU tensors here: this VM has no GPU) and its own
:class:`~fstier.gpu_copy.RankStager`; all ranks share one
:class:`~fstier.slots.host_pool.HostBlockPool` that is *smaller* than the workload
(``--pool``), so slots are recycled exactly as an engine would.

Store phase (timed from the first stage_out to the last file on disk): a
chunk of ``--chunk`` GPU blocks (a request) takes ``chunk / blocks_per_file``
slots, both tp=2 ranks stage their halves of every page into those slots,
and the slots are handed to ``FsTier.submit_store``; the next chunk is
staged while earlier chunks are being written. A finished store frees its
slots. Load phase (after ``drop_caches`` when run as root; the files are read
with O_DIRECT either way): ``submit_load`` of chunks while slots are free;
each finished load is staged into all four tp=4 ranks and its slots freed.
After the timed part every tp=4 rank's KV is compared byte for byte with the
tp=2 ranks' heads it must equal.

Raw baseline, same run, same directory, same number of I/O threads as the
FsTier pool (read + write threads: idle read threads also take writes):
new O_DIRECT files of the payload size, written with pwrite and read with
pread (``benchmarks/_raw.py``), both as one large file and as one file per
block; "raw" is the faster of the two. Rounds alternate which side runs
first; medians are reported, and the ratio is fstier / raw.

    .venv/bin/python benchmarks/bench_pipeline.py [--page 2MiB] [--total 1GiB] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import xxhash  # noqa: E402
from _raw import RawBaseline, drop_caches  # noqa: E402

from fstier.config import FstierConfig, ParallelSpec, parse_config  # noqa: E402
from fstier.cross_layer import LayerKVSpec, allocate_cross_layer_kv_caches  # noqa: E402
from fstier.gpu_copy import RankStager  # noqa: E402
from fstier.io.blockfile import padded_len  # noqa: E402
from fstier.keys import BlockKey  # noqa: E402
from fstier.layout import (  # noqa: E402
    LoadStoreSpec,
    rank_page_mapping,
)
from fstier.manager import FsTier, JobResult  # noqa: E402
from fstier.slots.host_pool import HostBlockPool  # noqa: E402
from fstier.units import parse_size  # noqa: E402

HEADS = 8
HEAD_SIZE = 128
BLOCK_TOKENS = 16
LAYER_PAGE = 2 * BLOCK_TOKENS * HEADS * HEAD_SIZE * 2  # 64 KiB per layer (fp16, K and V)
STORE_TP = 2
LOAD_TP = 4


@dataclass(frozen=True)
class PipelineParams:
    """One pipeline measurement's shape."""

    page_bytes: int = 2 << 20
    total_bytes: int = 1 << 30
    blocks_per_file: int = 1
    chunk_blocks: int = 32
    pool_bytes: int = 256 << 20
    read_threads: int = 8
    write_threads: int = 4
    checksum: bool = True
    o_direct: str = "auto"
    rounds: int = 3
    #: False: FsTier jobs only (slots are not staged), to attribute time
    staging: bool = True

    @property
    def num_layers(self) -> int:
        return self.page_bytes // LAYER_PAGE

    @property
    def num_blocks(self) -> int:
        n = self.total_bytes // self.page_bytes
        return max(self.chunk_blocks, n - n % self.chunk_blocks)

    @property
    def io_threads(self) -> int:
        return self.read_threads + self.write_threads


@dataclass
class PhaseTimes:
    """Seconds of one round's phases; GB/s are over KV payload bytes."""

    store_s: float
    load_s: float
    stage_out_s: float
    stage_in_s: float
    raw_store_large_s: float
    raw_load_large_s: float
    raw_store_files_s: float
    raw_load_files_s: float


def make_config(root: Path, p: PipelineParams, tp: int, rank: int = 0) -> FstierConfig:
    if p.page_bytes % LAYER_PAGE or p.page_bytes < LAYER_PAGE:
        raise SystemExit(f"--page must be a multiple of {LAYER_PAGE} bytes (one 16-token layer), got {p.page_bytes}")
    return parse_config(
        {
            "tier": {
                "root_dir": str(root),
                "blocks_per_file": p.blocks_per_file,
                "read_threads": p.read_threads,
                "write_threads": p.write_threads,
                "checksum": "xxh3" if p.checksum else "none",
                "o_direct": p.o_direct,
                # Throughput run: the queue may hold the whole pool; backpressure
                # drops would be counted and fail the run, not hidden.
                "max_write_queue_seconds": 600.0,
            },
            "model": {
                "name": "bench/llama-like",
                "dtype": "float16",
                "groups": [
                    {
                        "kind": "full_attention",
                        "block_size": BLOCK_TOKENS,
                        "num_layers": p.num_layers,
                        "num_kv_heads": HEADS,
                        "head_size": HEAD_SIZE,
                    }
                ],
            },
            "parallel": {"tp_size": tp, "rank": rank},
        }
    )


class Deployment:
    """The ranks of one tp deployment: KV caches and stagers over one pool."""

    def __init__(self, cfg: FstierConfig, tp: int, num_blocks: int, pool: HostBlockPool, bpf: int) -> None:
        group = cfg.model.groups[0]
        self.tp = tp
        self.caches = []
        self.stagers = []
        for rank in range(tp):
            par = ParallelSpec(tp_size=tp, rank=rank)
            specs = [
                LayerKVSpec.attention(f"l{j}", 0, BLOCK_TOKENS, HEADS // tp, HEAD_SIZE) for j in range(group.num_layers)
            ]
            cross = allocate_cross_layer_kv_caches(specs, num_blocks, "cpu", "float16")
            self.caches.append(cross)
            self.stagers.append(RankStager(cross.registration, [rank_page_mapping(group, par)], pool, bpf))

    def fill_random(self) -> None:
        for c in self.caches:
            for b in c.buffers:
                b.random_(-128, 127)

    def zero(self) -> None:
        for c in self.caches:
            for b in c.buffers:
                b.zero_()

    def stage_out(self, spec: LoadStoreSpec, slots: list[int]) -> None:
        batches = [(s, s.stage_out(spec, slots)) for s in self.stagers]
        for s, b in batches:
            s.wait(b)

    def stage_in(self, slots: list[int], spec: LoadStoreSpec) -> None:
        batches = [(s, s.stage_in(slots, spec)) for s in self.stagers]
        for s, b in batches:
            s.wait(b)

    def heads(self, rank: int, layer: int) -> torch.Tensor:
        """(blocks, 2, tokens, local heads, head) view of one rank's layer."""
        return self.caches[rank].views[f"l{layer}"][0]


def check_same_kv(store: Deployment, load: Deployment, num_layers: int) -> None:
    """Every tp=4 rank holds exactly the heads the tp=2 ranks stored."""
    per_load = HEADS // load.tp
    per_store = HEADS // store.tp
    for r in range(load.tp):
        h0 = r * per_load
        src_rank, off = divmod(h0, per_store)
        for j in range(num_layers):
            want = store.heads(src_rank, j)[:, :, :, off : off + per_load]
            have = load.heads(r, j)
            if not torch.equal(have.view(torch.int16), want.view(torch.int16)):
                raise SystemExit(f"MISMATCH: tp=4 rank {r} layer {j} differs from what tp=2 stored")


def _key(round_id: int, i: int) -> BlockKey:
    # Uniformly spread hashes, like real chained prefix hashes: files land
    # across the two-level fan-out, not in one directory.
    return BlockKey(xxhash.xxh3_128_digest(round_id.to_bytes(4, "big") + i.to_bytes(8, "big")), 0)


def _wait_one(tier: FsTier) -> list[JobResult]:
    """Block (politely) until at least one job finished."""
    while True:
        done = tier.get_finished()
        if done:
            return done
        time.sleep(0.0005)




class Pipeline:
    """Everything of one parameter set, built once and reused by every round."""

    def __init__(self, root: Path, p: PipelineParams) -> None:
        self.root = root
        self.p = p
        bpf = p.blocks_per_file
        if p.chunk_blocks % bpf:
            raise SystemExit(f"--chunk ({p.chunk_blocks}) must be a multiple of blocks_per_file ({bpf})")
        slot_bytes = padded_len(bpf * p.page_bytes)
        files_per_chunk = p.chunk_blocks // bpf
        num_slots = max(2 * files_per_chunk, p.pool_bytes // slot_bytes)
        self.pool = HostBlockPool(num_slots, slot_bytes)
        self.store_cfg = make_config(root, p, STORE_TP)
        self.load_cfg = make_config(root, p, LOAD_TP)
        self.store_tier = FsTier(self.store_cfg, self.pool)
        self.load_tier = FsTier(self.load_cfg, self.pool)
        if self.store_tier.mapper.namespace != self.load_tier.mapper.namespace:
            raise SystemExit("tp=2 and tp=4 resolved to different namespaces; full attention should share")
        self.o_direct = self.store_tier.io_options.o_direct
        nb = p.num_blocks
        self.store_dep = Deployment(self.store_cfg, STORE_TP, nb, self.pool, bpf)
        self.load_dep = Deployment(self.load_cfg, LOAD_TP, nb, self.pool, bpf)
        self.store_dep.fill_random()
        self.load_dep.zero()  # touch every page now (first touch is slow here)
        self.raw_dir = root / "raw"
        self.raw_dir.mkdir(exist_ok=True)
        self.payload = bpf * p.page_bytes
        self.raw = RawBaseline(self.raw_dir, self.payload, nb // bpf, b"\xa5\x5a")
        self.raw.warm(p.io_threads)

    def close(self) -> None:
        self.store_tier.close()
        self.load_tier.close()
        self.pool.close()

    def _chunks(self) -> list[tuple[LoadStoreSpec, int, int]]:
        """(spec, first block, number of files) per chunk, in prompt order."""
        p = self.p
        out = []
        for start in range(0, p.num_blocks, p.chunk_blocks):
            ids = list(range(start, start + p.chunk_blocks))
            out.append((LoadStoreSpec(ids, [len(ids)], [start]), start, p.chunk_blocks // p.blocks_per_file))
        return out

    def run_fstier(self, round_id: int) -> tuple[float, float, float, float]:
        """One store + load pass; (store s, load s, stage_out s, stage_in s)."""
        bpf = self.p.blocks_per_file
        chunks = self._chunks()
        pending: dict[int, list[int]] = {}
        stage_s = 0.0
        t0 = time.perf_counter()
        for c, (spec, start, nfiles) in enumerate(chunks):
            while self.pool.num_free < nfiles:
                for r in _wait_one(self.store_tier):
                    if not r.success:
                        raise SystemExit(f"store failed: {r}")
                    self.pool.free(pending.pop(r.job_id))
            slots = self.pool.alloc(nfiles)
            ts = time.perf_counter()
            if self.p.staging:
                self.store_dep.stage_out(spec, slots)
            stage_s += time.perf_counter() - ts
            keys = [_key(round_id, start // bpf + f) for f in range(nfiles)]
            pending[c] = slots
            self.store_tier.submit_store(c, keys, slots)
        while pending:
            for r in _wait_one(self.store_tier):
                if not r.success:
                    raise SystemExit(f"store failed: {r}")
                self.pool.free(pending.pop(r.job_id))
        store_s = time.perf_counter() - t0

        drop_caches()
        load_pending: dict[int, tuple[list[int], LoadStoreSpec]] = {}
        stage_in_s = 0.0
        t0 = time.perf_counter()
        todo = list(enumerate(chunks))
        while todo or load_pending:
            while todo and self.pool.num_free >= todo[0][1][2]:
                c, (spec, start, nfiles) = todo.pop(0)
                slots = self.pool.alloc(nfiles)
                keys = [_key(round_id, start // bpf + f) for f in range(nfiles)]
                load_pending[c] = (slots, spec)
                self.load_tier.submit_load(c, keys, slots)
            for r in _wait_one(self.load_tier):
                if not r.success:
                    raise SystemExit(f"load failed: {r}")
                slots, spec = load_pending.pop(r.job_id)
                ts = time.perf_counter()
                if self.p.staging:
                    self.load_dep.stage_in(slots, spec)
                stage_in_s += time.perf_counter() - ts
                self.pool.free(slots)
        load_s = time.perf_counter() - t0
        return store_s, load_s, stage_s, stage_in_s

    def run_raw(self) -> tuple[float, float, float, float]:
        t = self.p.io_threads
        self.raw.cleanup()
        sl = self.raw.store_large(t)
        sf = self.raw.store_files(t)
        drop_caches()
        ll = self.raw.load_large(t)
        lf = self.raw.load_files(t)
        self.raw.cleanup()
        return sl, ll, sf, lf

    def remove_round(self, round_id: int) -> None:
        """Delete one round's files so every round writes NEW files
        (docs/architecture.md, "Facts of the machines"). Directories stay, as
        they do in a long-running tier (and FileMapper remembers which parents
        it already created)."""
        for dirpath, _dirs, files in os.walk(self.store_tier.mapper.blocks_dir):
            for name in files:
                os.unlink(os.path.join(dirpath, name))
        self.store_tier._cache.clear()
        self.load_tier._cache.clear()


def run_pipeline(
    root: Path | None, p: PipelineParams, *, verify: bool = True, progress: bool = False
) -> dict[str, Any]:
    """Run ``p.rounds`` measured rounds (after a warm-up) and return medians."""
    own = root is None
    base = Path(tempfile.mkdtemp(prefix="fstier-pipe-", dir="/var/tmp")) if root is None else root
    work = Path(tempfile.mkdtemp(prefix="pipe-", dir=base))
    pipe = Pipeline(work, p)
    rounds: list[PhaseTimes] = []
    try:
        for rnd in range(p.rounds + 1):  # round 0 warms up both sides
            fst_first = rnd % 2 == 0
            if fst_first:
                f = pipe.run_fstier(rnd)
                r = pipe.run_raw()
            else:
                r = pipe.run_raw()
                f = pipe.run_fstier(rnd)
            if verify and p.staging and rnd == 0:
                check_same_kv(pipe.store_dep, pipe.load_dep, p.num_layers)
            pipe.remove_round(rnd)
            pipe.load_dep.zero()
            if rnd:
                rounds.append(PhaseTimes(*f, *r))
            if progress:
                print(f"    round {rnd}: fstier store {f[0]:.2f}s load {f[1]:.2f}s; raw {r}", file=sys.stderr)
    finally:
        pipe.close()
        shutil.rmtree(work, ignore_errors=True)
        if own:
            shutil.rmtree(base, ignore_errors=True)
    total = p.num_blocks * p.page_bytes

    def gbps(field: str) -> float:
        return total / statistics.median(getattr(x, field) for x in rounds) / 1e9

    raw_w = max(gbps("raw_store_large_s"), gbps("raw_store_files_s"))
    raw_r = max(gbps("raw_load_large_s"), gbps("raw_load_files_s"))
    out = {
        "params": {**asdict(p), "num_layers": p.num_layers, "num_blocks": p.num_blocks},
        "o_direct": pipe.o_direct,
        "page_cache_dropped": drop_caches(),
        "bytes": total,
        "store_gbps": gbps("store_s"),
        "load_gbps": gbps("load_s"),
        "stage_out_gbps": gbps("stage_out_s"),
        "stage_in_gbps": gbps("stage_in_s"),
        "raw_write_large_gbps": gbps("raw_store_large_s"),
        "raw_write_files_gbps": gbps("raw_store_files_s"),
        "raw_read_large_gbps": gbps("raw_load_large_s"),
        "raw_read_files_gbps": gbps("raw_load_files_s"),
        "raw_write_gbps": raw_w,
        "raw_read_gbps": raw_r,
        "store_ratio": gbps("store_s") / raw_w,
        "load_ratio": gbps("load_s") / raw_r,
        "verified": verify and p.staging,
        "rounds": [asdict(x) for x in rounds],
    }
    return out


def _print(res: dict[str, Any]) -> None:
    p = res["params"]
    print(
        f"page {p['page_bytes'] >> 10} KiB x {p['num_blocks']} blocks ({res['bytes'] / 2**30:.2f} GiB), "
        f"blocks_per_file {p['blocks_per_file']}, tp={STORE_TP} store -> tp={LOAD_TP} load, "
        f"threads {p['read_threads']}r+{p['write_threads']}w, checksum {'on' if p['checksum'] else 'off'}, "
        f"O_DIRECT {res['o_direct']}, median of {p['rounds']} rounds"
    )
    print("| op | fstier GB/s | raw large file | raw file/block | raw (best) | ratio | staging GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(
        f"| store (stage_out+store) | {res['store_gbps']:.2f} | {res['raw_write_large_gbps']:.2f} | "
        f"{res['raw_write_files_gbps']:.2f} | {res['raw_write_gbps']:.2f} | {res['store_ratio']:.2f} | "
        f"{res['stage_out_gbps']:.1f} |"
    )
    print(
        f"| load (load+stage_in) | {res['load_gbps']:.2f} | {res['raw_read_large_gbps']:.2f} | "
        f"{res['raw_read_files_gbps']:.2f} | {res['raw_read_gbps']:.2f} | {res['load_ratio']:.2f} | "
        f"{res['stage_in_gbps']:.1f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=None, help="directory to test (default: a temp dir in /var/tmp)")
    ap.add_argument("--page", default="2MiB", help="canonical page (one block, all layers); multiple of 64KiB")
    ap.add_argument("--total", default="1GiB", help="KV bytes moved per round")
    ap.add_argument("--blocks-per-file", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=32, help="GPU blocks per store/load job")
    ap.add_argument("--pool", default="256MiB", help="host pool size (slots are recycled)")
    ap.add_argument("--read-threads", type=int, default=8)
    ap.add_argument("--write-threads", type=int, default=4)
    ap.add_argument("--no-checksum", action="store_true")
    ap.add_argument("--o-direct", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-staging", action="store_true", help="FsTier jobs only: attribute time to I/O vs staging")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    p = PipelineParams(
        page_bytes=parse_size(args.page),
        total_bytes=parse_size(args.total),
        blocks_per_file=args.blocks_per_file,
        chunk_blocks=args.chunk,
        pool_bytes=parse_size(args.pool),
        read_threads=args.read_threads,
        write_threads=args.write_threads,
        checksum=not args.no_checksum,
        o_direct=args.o_direct,
        rounds=args.rounds,
        staging=not args.no_staging,
    )
    with contextlib.suppress(KeyboardInterrupt):
        res = run_pipeline(args.root, p, progress=not args.json)
        if args.json:
            print(json.dumps(res, indent=2))
        else:
            _print(res)


if __name__ == "__main__":
    main()
