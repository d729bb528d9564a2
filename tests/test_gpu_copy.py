"""HostBlockPool and RankStager: shared slots, real rank processes, layouts, skips, copy counts."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest
import torch

from fstier.config import ModelSpec, ParallelSpec
from fstier.cross_layer import LayerKVSpec, allocate_cross_layer_kv_caches
from fstier.errors import LayoutError, PoolError, PoolExhaustedError
from fstier.gpu_copy import RankStager
from fstier.layout import (
    CanonicalKVCaches,
    LoadStoreSpec,
    PoolTensors,
    rank_page_mapping,
)
from fstier.slots.host_pool import HostBlockPool

NUM_BLOCKS = 12


def _group(layers=3, heads=8, head_size=16, block_size=8, kv="NHD"):
    return ModelSpec(
        name="m",
        dtype="float16",
        groups=[
            {
                "num_layers": layers,
                "num_kv_heads": heads,
                "head_size": head_size,
                "block_size": block_size,
                "kv_layout": kv,
            }
        ],
    ).groups[0]


def _full_kv(group, seed=0) -> torch.Tensor:
    """The whole model's KV: (layer, block, 2, token, head, dim) for NHD or (.., head, token, dim) for HND."""
    g = torch.Generator().manual_seed(seed)
    shape = (group.num_layers, NUM_BLOCKS, 2, group.block_size, group.num_kv_heads, group.head_size)
    full = torch.randn(shape, generator=g).half()
    return full if group.kv_layout == "NHD" else full.transpose(3, 4).contiguous()


def _shard(full, group, tp, rank) -> torch.Tensor:
    hl = group.num_kv_heads // tp
    dim = 4 if group.kv_layout == "NHD" else 3
    return full.narrow(dim, rank * hl, hl).contiguous()


def _register(shard, layout) -> CanonicalKVCaches:
    layers = shard.shape[0]
    if layout == "packed":
        return CanonicalKVCaches.register([[shard[i] for i in range(layers)]])
    if layout == "split":
        return CanonicalKVCaches.register(
            [[shard[i].transpose(0, 1).contiguous() for i in range(layers)]], split_kv_dim0=True
        )
    if layout == "interleaved":  # (blocks, a, b, 2, dim)
        return CanonicalKVCaches.register([[shard[i].permute(0, 2, 3, 1, 4).contiguous() for i in range(layers)]])
    if layout == "cross":  # (blocks, layers, 2, a, b, dim): one row per block
        return CanonicalKVCaches.register([[shard.transpose(0, 1).contiguous()]])
    raise AssertionError(layout)


def _canonical(full, block) -> torch.Tensor:
    return full[:, block].contiguous().view(torch.int8).reshape(-1)


def _staged(pool, slot: int, page_bytes: int, offset: int = 0) -> torch.Tensor:
    """The page of ``page_bytes`` staged at ``offset`` in ``slot`` of ``pool``, as int8 (compared with _canonical)."""
    return PoolTensors.of(pool).slot_tensor(slot)[offset : offset + page_bytes].view(torch.int8)


def _child_stage(pool_name, tp, rank, layout, mode, slots, blocks, q) -> None:
    # A forked child must not enter the parent's OpenMP pool (libgomp is not fork-safe).
    torch.set_num_threads(1)
    try:
        group = _group()
        full = _full_kv(group)
        pool = HostBlockPool.attach(pool_name)
        shard = _shard(full, group, tp, rank)
        kind = "interleaved" if layout == "interleaved" else "packed"
        mapping = rank_page_mapping(group, ParallelSpec(tp_size=tp, rank=rank), kind)
        if mode == "in":
            expected = shard.clone()
            shard.zero_()
        caches = _register(shard, layout)
        stager = RankStager(caches, [mapping], pool)
        spec = LoadStoreSpec(blocks, [len(blocks)], [0])
        if mode == "out":
            stager.wait(stager.stage_out(spec, slots))
            ok = True
        else:
            stager.wait(stager.stage_in(slots, spec))
            back = caches.tensors  # registered int8 rows alias the layer tensors
            ok = bool(back) and all(
                torch.equal(_reconstruct(shard, layout, caches)[:, b], expected[:, b]) for b in blocks
            )
        pool.close()
        q.put((rank, mode, ok))
    except Exception as exc:  # report to the parent instead of dying silently
        q.put((rank, mode, repr(exc)))


def _reconstruct(shard, layout, caches) -> torch.Tensor:
    # packed registrations alias ``shard`` directly; the others were copies, so
    # rebuild the shard view from the registered rows.
    if layout == "packed":
        return shard
    rows = [t.view(torch.float16) for t in caches.tensors]
    L = shard.shape[0]
    nb, two, a, b, d = shard.shape[1:]
    if layout == "split":
        per = [torch.stack([rows[2 * i], rows[2 * i + 1]], 1).view(nb, two, a, b, d) for i in range(L)]
        return torch.stack(per)
    if layout == "interleaved":
        return torch.stack([rows[i].view(nb, a, b, two, d).permute(0, 3, 1, 2, 4) for i in range(L)])
    return rows[0].view(nb, L, two, a, b, d).transpose(0, 1)


@pytest.mark.parametrize("layout", ["packed", "interleaved", "cross"])
def test_tp2_rank_processes_store_tp4_rank_processes_load(layout):
    group = _group()
    full = _full_kv(group)
    ctx = mp.get_context("fork")
    with HostBlockPool(4, group.page_bytes) as pool:
        slots = pool.alloc(3)
        blocks = [7, 2, 11]
        q = ctx.Queue()
        for tp, mode in ((2, "out"), (4, "in")):
            procs = [
                ctx.Process(target=_child_stage, args=(pool.name, tp, r, layout, mode, slots, blocks, q))
                for r in range(tp)
            ]
            for p in procs:
                p.start()
            results = [q.get(timeout=60) for _ in procs]
            for p in procs:
                p.join(30)
                assert p.exitcode == 0
            assert sorted(results) == [(r, mode, True) for r in range(tp)], results
            if mode == "out":
                for s, b in zip(slots, blocks, strict=True):
                    assert torch.equal(_staged(pool, s, group.page_bytes), _canonical(full, b))
        pool.free(slots)


def _round_trip(kv, layout, a, b, device="cpu", cuda_copy=None, slots_order=None):
    """tp=a ranks store 4 blocks, tp=b ranks load them into other blocks; checks
    the slots against the canonical pages and every loaded and untouched block."""
    group = _group(layers=2, kv=kv)
    full = _full_kv(group, seed=a * 10 + b)
    kind = "interleaved" if layout == "interleaved" else "packed"
    blocks_out, blocks_in = [3, 0, 9, 5], [1, 4, 8, 10]
    with HostBlockPool(6, group.page_bytes) as pool:
        held = pool.alloc(6)
        slots = held[:4] if slots_order is None else [held[i] for i in slots_order]
        for s in slots:
            PoolTensors.of(pool).slot_tensor(s).fill_(0x5A)  # poison: every byte must be written
        for r in range(a):
            caches = _register(_shard(full, group, a, r).to(device), layout)
            mapping = rank_page_mapping(group, ParallelSpec(tp_size=a, rank=r), kind)
            st = RankStager(caches, [mapping], pool, cuda_copy=cuda_copy)
            bid = st.stage_out(LoadStoreSpec(blocks_out, [4], [0]), slots)
            st.wait(bid)
            assert st.poll() == [bid] and st.in_flight == 0
        for s, bo in zip(slots, blocks_out, strict=True):
            assert torch.equal(_staged(pool, s, group.page_bytes), _canonical(full, bo))
        for r in range(b):
            shard = torch.zeros_like(_shard(full, group, b, r)).to(device)
            caches = _register(shard, layout)
            mapping = rank_page_mapping(group, ParallelSpec(tp_size=b, rank=r), kind)
            st = RankStager(caches, [mapping], pool, cuda_copy=cuda_copy)
            st.wait(st.stage_in(slots, LoadStoreSpec(blocks_in, [4], [0])))
            got = _reconstruct(shard, layout, caches).cpu()
            want = _shard(full, group, b, r)
            for bo, bi in zip(blocks_out, blocks_in, strict=True):
                assert torch.equal(got[:, bi], want[:, bo])
            untouched = [x for x in range(NUM_BLOCKS) if x not in blocks_in]
            assert got[:, untouched].eq(0).all()


@pytest.mark.parametrize("kv", ["NHD", "HND"])
@pytest.mark.parametrize("layout", ["packed", "split", "interleaved", "cross"])
@pytest.mark.parametrize(("a", "b"), [(1, 4), (2, 8), (8, 2), (4, 1)])
def test_in_process_round_trip_over_layouts(kv, layout, a, b):
    _round_trip(kv, layout, a, b)


@pytest.mark.parametrize("cuda_copy", ["dma", "kernel", "auto"])
@pytest.mark.parametrize("kv", ["NHD", "HND"])
@pytest.mark.parametrize("layout", ["packed", "split", "interleaved", "cross"])
@pytest.mark.parametrize(("a", "b"), [(1, 4), (8, 2)])
def test_device_copy_logic_round_trip_on_cpu(cuda_copy, kv, layout, a, b):
    """The CUDA path's staging, packing and copy lists, run on CPU tensors
    (memcpy in place of the copy engine), so CI checks them without a GPU."""
    _round_trip(kv, layout, a, b, cuda_copy=cuda_copy, slots_order=[5, 0, 2, 3])


def test_staging_packs_a_head_slice_as_one_copy_and_merges_adjacent_slots():
    from fstier.gpu_copy import host_copies

    group = _group(layers=4, heads=8, head_size=16)
    caches = _register(_shard(_full_kv(group), group, 4, 1), "packed")
    mapping = rank_page_mapping(group, ParallelSpec(tp_size=4, rank=1))
    with HostBlockPool(8, group.page_bytes) as pool:
        stg = RankStager(caches, [mapping], pool, cuda_copy="dma")._staging[(0, "store")]
    # rank 1 of 4 owns 2 heads (64 bytes) of every 256-byte token row: one 2-d copy per page
    assert stg.page_bytes == group.page_bytes // 4 and stg.spans_page and stg.density == 0.25
    assert stg.segs.tolist() == [[64, 0, 64, 4 * 2 * 8, 256, 64]]
    pb = group.page_bytes
    # slots 2, 3, 4 adjacent, then slot 0: two copies for four pages
    rows = host_copies(stg, np.array([2 * pb, 3 * pb, 4 * pb, 0]), pb)
    assert rows[:, 3].tolist() == [3 * 64, 64] and rows[:, 0].tolist() == [2 * pb + 64, 64]


def test_block_indices_skip_lands_the_right_pages():
    group = _group(layers=2)
    full = _full_kv(group)
    with HostBlockPool(2, 4 * group.page_bytes) as pool:
        slots = pool.alloc(2)
        st = RankStager(
            _register(full.clone(), "cross"), [rank_page_mapping(group, ParallelSpec())], pool, blocks_per_file=4
        )
        logical = list(range(8))  # logical blocks 0..7 live in GPU blocks 4..11
        st.stage_out(LoadStoreSpec([4 + i for i in logical], [8], [0]), slots)
        for page in range(4):
            off = page * group.page_bytes
            assert torch.equal(_staged(pool, slots[1], group.page_bytes, off), _canonical(full, 8 + page))
        for start in (5, 6, 7):
            dest = torch.zeros_like(full)
            st_in = RankStager(
                _register(dest, "packed"), [rank_page_mapping(group, ParallelSpec())], pool, blocks_per_file=4
            )
            n = 8 - start
            gpu = [0, 1, 2][:n]
            st_in.wait(st_in.stage_in([slots[1]], LoadStoreSpec(gpu, [n], [start])))
            for k, g in enumerate(gpu):
                assert torch.equal(dest[:, g], full[:, 4 + start + k]), (start, k)
        with pytest.raises(ValueError, match="a store must start at a file boundary"):
            st.stage_out(LoadStoreSpec([1], [1], [5]), [slots[0]])
        with pytest.raises(ValueError, match="need 1 slot"):
            st.stage_in(slots, LoadStoreSpec([1, 2], [2], [5]))
        with pytest.raises(ValueError, match="block id 12 >= num_blocks 12"):
            st.stage_in([slots[0]], LoadStoreSpec([12], [1], [0]))
        with pytest.raises(ValueError, match=r"slot 2 is outside the pool \(0\.\.1\)"):
            st.stage_in([2], LoadStoreSpec([1], [1], [0]))
        with pytest.raises(ValueError, match="LoadStoreSpec has 2 groups, the stager has 1"):
            st.stage_in([slots[0]], LoadStoreSpec([1], [1, 0], [0, 0]))


def test_cross_layer_costs_one_copy_per_block_per_direction():
    group = _group(layers=8, heads=4)
    specs = [LayerKVSpec.attention(f"l{i}", 0, group.block_size, group.num_kv_heads, group.head_size) for i in range(8)]
    alloc = allocate_cross_layer_kv_caches(specs, NUM_BLOCKS, "cpu", "float16")
    with HostBlockPool(5, group.page_bytes) as pool:
        st = RankStager(alloc.registration, [rank_page_mapping(group, ParallelSpec())], pool)
        slots = pool.alloc(5)
        st.stage_out(LoadStoreSpec([0, 1, 2, 3, 4], [5], [0]), slots)
        assert (st.stats.ops, st.stats.fragments) == (5, 5)  # one copy per block
        st.stage_in(slots, LoadStoreSpec([5, 6, 7, 8, 9], [5], [0]))
        assert (st.stats.ops, st.stats.fragments) == (10, 10)
        assert torch.equal(alloc.buffers[0][5:10], alloc.buffers[0][0:5])


def test_stager_rejects_mismatched_registration_and_small_slots():
    group = _group()
    caches = _register(_shard(_full_kv(group), group, 2, 0), "packed")
    with HostBlockPool(1, group.page_bytes) as pool:
        with pytest.raises(LayoutError, match="expects a 3072-byte local page, the registered tensors give 6144"):
            RankStager(caches, [rank_page_mapping(group, ParallelSpec(tp_size=4))], pool)
        with pytest.raises(LayoutError, match="create a larger pool"):
            RankStager(caches, [rank_page_mapping(group, ParallelSpec(tp_size=2))], pool, blocks_per_file=2)
        with pytest.raises(LayoutError, match="2 page mappings for 1 registered groups"):
            RankStager(caches, [rank_page_mapping(group, ParallelSpec(tp_size=2))] * 2, pool)


# ---------------------------------------------------------------- CUDA (run with -m gpu on a GPU machine)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cuda_copy", ["dma", "kernel", "auto"])
@pytest.mark.parametrize("kv", ["NHD", "HND"])
@pytest.mark.parametrize("layout", ["packed", "split", "interleaved", "cross"])
@pytest.mark.parametrize(("a", "b"), [(1, 4), (2, 8), (8, 2), (4, 1)])
@pytest.mark.parametrize("slots_order", [None, [5, 0, 2, 3]])
def test_cuda_round_trip_over_layouts(cuda_copy, kv, layout, a, b, slots_order):
    _round_trip(kv, layout, a, b, device="cuda", cuda_copy=cuda_copy, slots_order=slots_order)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cuda_copy", ["dma", "kernel", "auto"])
def test_cuda_stage_calls_queue_and_return_while_the_device_is_busy(cuda_copy):
    """stage_out/stage_in only queue work: with the engine's stream busy for
    ~200 ms they return at once, poll() reports nothing and copies nothing,
    and after the wait the bytes are right; index buffers are reused."""
    group = _group(layers=4, heads=8, head_size=64, block_size=16)
    full = _full_kv(group, seed=3).cuda()
    with HostBlockPool(8, group.page_bytes) as pool:
        slots = pool.alloc(8)
        st = RankStager(
            _register(full.clone(), "cross"), [rank_page_mapping(group, ParallelSpec())], pool, cuda_copy=cuda_copy
        )
        spec = LoadStoreSpec(list(range(8)), [8], [0])
        st.wait(st.stage_out(spec, slots))  # warm-up: kernels loaded, index buffer pinned
        assert st.poll() == [1]
        pinned_before = st._pinned.allocated
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU time on the current stream
        t0 = time.perf_counter()
        bid = st.stage_out(spec, slots)
        call_s = time.perf_counter() - t0
        assert st.poll() == [] and st.in_flight == 1
        assert call_s < 0.05, f"stage_out blocked for {call_s:.3f} s"
        st.wait(bid)
        for s, blk in zip(slots, range(8), strict=True):
            assert torch.equal(_staged(pool, s, group.page_bytes), _canonical(full.cpu(), blk))
        dest = torch.zeros_like(full)
        st_in = RankStager(
            _register(dest, "packed"), [rank_page_mapping(group, ParallelSpec())], pool, cuda_copy=cuda_copy
        )
        st_in.wait(st_in.stage_in(slots, LoadStoreSpec([11, 10, 9, 8, 7, 6, 5, 4], [8], [0])))
        assert st_in.poll() == [1]
        torch.cuda._sleep(400_000_000)
        t0 = time.perf_counter()
        bid = st_in.stage_in(slots, LoadStoreSpec([11, 10, 9, 8, 7, 6, 5, 4], [8], [0]))
        call_s = time.perf_counter() - t0
        assert st_in.poll() == [] and call_s < 0.05, f"stage_in blocked for {call_s:.3f} s"
        st_in.wait(bid)
        torch.cuda.synchronize()
        for k, g in enumerate([11, 10, 9, 8, 7, 6, 5, 4]):
            assert torch.equal(dest[:, g].cpu(), full[:, k].cpu())
        assert st._pinned.allocated == pinned_before  # no pinned allocation per batch


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cuda_copy", ["dma", "kernel", "auto"])
def test_cuda_blocks_per_file_skip_matches_the_cpu_path(cuda_copy):
    group = _group(layers=2)
    full = _full_kv(group, seed=5)
    with HostBlockPool(2, 4 * group.page_bytes) as pool:
        slots = pool.alloc(2)
        st = RankStager(
            _register(full.clone().cuda(), "cross"),
            [rank_page_mapping(group, ParallelSpec())],
            pool,
            4,
            cuda_copy=cuda_copy,
        )
        st.wait(st.stage_out(LoadStoreSpec([4 + i for i in range(8)], [8], [0]), slots))
        for page in range(4):
            off = page * group.page_bytes
            assert torch.equal(_staged(pool, slots[1], group.page_bytes, off), _canonical(full, 8 + page))
        for start in (5, 6, 7):
            dest = torch.zeros_like(full).cuda()
            st_in = RankStager(
                _register(dest, "packed"), [rank_page_mapping(group, ParallelSpec())], pool, 4, cuda_copy=cuda_copy
            )
            n = 8 - start
            st_in.wait(st_in.stage_in([slots[1]], LoadStoreSpec([0, 1, 2][:n], [n], [start])))
            for k in range(n):
                assert torch.equal(dest[:, k].cpu(), full[:, 4 + start + k]), (start, k)


# ---------------------------------------------------------------- pool


def _shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("fstier-")}


def test_pool_alignment_errors_and_cleanup():
    before = _shm_names()
    pool = HostBlockPool(3, 5000)
    assert pool.slot_bytes == 8192 and pool.name in _shm_names()
    for i in range(3):
        view = pool.slot_view(i)
        assert len(view) == 8192
        assert PoolTensors.of(pool).slot_tensor(i).data_ptr() % 4096 == 0
        view.release()
    a = pool.alloc(2)
    with pytest.raises(PoolExhaustedError, match="asked for 2 slot"):
        pool.alloc(2)
    pool.free([a[0]])
    with pytest.raises(PoolError, match=f"double free of slot {a[0]}"):
        pool.free([a[0]])
    with pytest.raises(PoolError, match="unknown slot 7"):
        pool.free([7])
    with pytest.raises(PoolError, match="double free"):
        pool.free([a[1], a[1]])
    assert pool.num_free == 2
    other = HostBlockPool.attach(pool.name)
    assert (other.num_slots, other.slot_bytes) == (3, 8192)
    PoolTensors.of(pool).slot_tensor(2)[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert PoolTensors.of(other).slot_tensor(2)[:4].tolist() == [1, 2, 3, 4]
    with pytest.raises(PoolError, match="reserved to the creating process"):
        other.alloc(1)
    other.close()
    pool.close()
    pool.close()  # idempotent
    assert _shm_names() == before
    with pytest.raises(PoolError, match="no shared memory named"):
        HostBlockPool.attach(pool.name)
    with pytest.raises(PoolError, match="is closed"):
        PoolTensors.of(pool).slot_tensor(0)


def test_attach_in_child_process_leaves_no_segment_and_no_tracker_noise(tmp_path):
    ctx = mp.get_context("spawn")
    with HostBlockPool(2, 4096) as pool:
        PoolTensors.of(pool).slot_tensor(1)[:3] = torch.tensor([9, 8, 7], dtype=torch.uint8)
        p = ctx.Process(target=_child_touch, args=(pool.name, str(tmp_path / "out")))
        p.start()
        p.join(120)
        assert p.exitcode == 0
        assert (tmp_path / "out").read_bytes() == bytes([9, 8, 7])
        assert PoolTensors.of(pool).slot_tensor(1)[3].item() == 42
        name = pool.name
    assert name not in _shm_names()


def _child_touch(name, out):
    pool = HostBlockPool.attach(name)
    with open(out, "wb") as f:
        f.write(bytes(pool.slot_view(1)[:3]))
    PoolTensors.of(pool).slot_tensor(1)[3] = 42
    pool.close()


def test_reclaim_stale_segments_of_dead_creators():
    ctx = mp.get_context("fork")
    p = ctx.Process(target=os._exit, args=(0,))
    p.start()
    p.join()
    stale = f"fstier-{p.pid}-deadbeef"
    with HostBlockPool(1, 4096) as live:
        with open(f"/dev/shm/{stale}", "wb") as f:
            f.write(b"x")
        removed = HostBlockPool.reclaim_stale()
        assert stale in removed and live.name in _shm_names()
    assert stale not in _shm_names()


@pytest.mark.parametrize("cuda_copy", ["dma", "kernel"])
def test_evenly_spaced_layers_share_one_kernel(cuda_copy):
    """Per-layer tensors at a fixed spacing (here views of one allocation) are
    gathered by one index kernel per batch, not one per layer; layers in
    separate CPU allocations keep one each. Bytes are right either way."""
    group = _group(layers=4)
    full = _full_kv(group, seed=9)
    mapping = rank_page_mapping(group, ParallelSpec())
    with HostBlockPool(2, group.page_bytes) as pool:
        slots = pool.alloc(2)
        for shard, units in ((full.clone(), 1), ([full[i].clone() for i in range(4)], 4)):
            caches = CanonicalKVCaches.register([[shard[i] for i in range(4)]])
            st = RankStager(caches, [mapping], pool, cuda_copy=cuda_copy)
            assert [len(st._units[(0, k)]) for k in ("store", "load")] == [units, units]
            PoolTensors.of(pool).tensor.fill_(0)
            st.wait(st.stage_out(LoadStoreSpec([6, 2], [2], [0]), slots))
            assert torch.equal(_staged(pool, slots[0], group.page_bytes), _canonical(full, 6))
            assert torch.equal(_staged(pool, slots[1], group.page_bytes), _canonical(full, 2))


@pytest.mark.parametrize(("tp", "ops"), [(1, 2), (2, 2), (4, 1)])
def test_auto_takes_the_copy_engine_for_big_dense_copies_and_kernels_for_thin_rows(tp, ops):
    """8 adjacent 256 KiB pages: one merged host copy. "auto" moves it with the
    copy engine (gather kernel + 1 copy) when the rank owns at least half of
    each row, with one kernel on the mapped slots at a quarter (thin rows).
    The slots hold what the host path writes."""
    group = _group(layers=4, heads=8, head_size=128, block_size=16)
    shard = _shard(_full_kv(group, seed=1), group, tp, 0)
    mapping = rank_page_mapping(group, ParallelSpec(tp_size=tp, rank=0))
    spec = LoadStoreSpec(list(range(8)), [8], [0])
    with HostBlockPool(8, group.page_bytes) as pool, HostBlockPool(8, group.page_bytes) as ref:
        slots, ref_slots = pool.alloc(8), ref.alloc(8)
        st = RankStager(_register(shard, "packed"), [mapping], pool, cuda_copy="auto")
        st.wait(st.stage_out(spec, slots))
        assert st.stats.ops == ops
        host = RankStager(_register(shard, "packed"), [mapping], ref)
        host.wait(host.stage_out(spec, ref_slots))
        for s, r in zip(slots, ref_slots, strict=True):
            assert torch.equal(PoolTensors.of(pool).slot_tensor(s), PoolTensors.of(ref).slot_tensor(r))


def test_segment_of_a_sigkilled_creator_is_swept_by_the_next_pool():
    """A pool's creator killed with SIGKILL (OOM killer, pod eviction) left its
    /dev/shm segment for good: no later pool swept it, so a crash-looping
    engine filled /dev/shm. The next pool created anywhere on the node now
    removes it; a live creator's segment (another process) is kept."""
    import signal
    import subprocess
    import sys

    code = (
        "import sys, time\n"
        "from fstier.slots.host_pool import HostBlockPool\n"
        "p = HostBlockPool(4, 1 << 20)\n"
        "print(p.name, flush=True)\n"
        "time.sleep(600)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        killed, live = (p.stdout.readline().strip() for p in procs)
        assert {killed, live} <= _shm_names()
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(30)
        assert killed in _shm_names()  # the kernel does not remove it
        with HostBlockPool(1, 4096) as pool:
            names = _shm_names()
            assert killed not in names, "the killed creator's segment outlived it"
            assert live in names and pool.name in names
    finally:
        for p in procs:
            p.kill()
            p.wait(30)
