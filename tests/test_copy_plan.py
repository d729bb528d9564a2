"""Copy plans (fstier.copy_plan), checked through its own functions: plans
cover a mapping's bytes exactly once, a packed staging page holds only the
rank's bytes, a batch's blocks land on the right slot and page, and the index
kernels' element width divides every quantity."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fstier.config import ModelSpec, ParallelSpec
from fstier.copy_plan import batch_work, elem_bytes, group_plans, plans_for, staging_for
from fstier.cross_layer import LayerKVSpec, allocate_cross_layer_kv_caches
from fstier.errors import LayoutError
from fstier.layout import (
    CanonicalKVCaches,
    LoadStoreSpec,
    rank_page_mapping,
)
from fstier.page_runs import expand


def _group(layers=3, heads=8, head_size=16, block_size=8, kv="NHD"):
    groups = [
        {"num_layers": layers, "num_kv_heads": heads, "head_size": head_size, "block_size": block_size, "kv_layout": kv}
    ]
    return ModelSpec(name="m", dtype="float16", groups=groups).groups[0]


def _per_layer(group, tp, packing, num_blocks=4):
    """One tensor per layer (``split``: two, K then V) holding this rank's local page."""
    hl = group.num_kv_heads // tp
    b, d = group.block_size, group.head_size
    if packing == "interleaved":
        shape = (num_blocks, b, hl, 2 * d) if group.kv_layout == "NHD" else (num_blocks, hl, b, 2 * d)
    else:
        shape = (num_blocks, 2, b, hl, d) if group.kv_layout == "NHD" else (num_blocks, 2, hl, b, d)
    if packing == "split":
        half = (num_blocks, *shape[2:])
        entries = [
            [torch.zeros(half, dtype=torch.float16), torch.zeros(half, dtype=torch.float16)]
            for _ in range(group.num_layers)
        ]
    else:
        entries = [torch.zeros(shape, dtype=torch.float16) for _ in range(group.num_layers)]
    return CanonicalKVCaches.register([entries])


def _plan_bytes(plans, refs) -> set[tuple[int, int]]:
    """Every byte a direction's plans move, as (local page offset, canonical offset)."""
    start = {}
    at = 0
    for r in refs:
        start[r.tensor_idx] = at - r.offset
        at += r.size
    out: list[tuple[int, int]] = []
    for p in plans:
        for i in range(p.reps):
            for j in range(p.num):
                lo = start[p.tensor_idx] + p.local_offset + i * p.rep_local + j * p.local_stride
                co = p.canonical_offset + i * p.rep_canonical + j * p.canonical_stride
                out.extend((lo + k, co + k) for k in range(p.size))
    assert len(out) == len(set(out)), "a byte is planned twice"
    return set(out)


def _run_bytes(runs) -> set[tuple[int, int]]:
    f = expand(runs, 1)
    return set(zip(f.lo.tolist(), f.co.tolist(), strict=True))


@pytest.mark.parametrize("kv", ["NHD", "HND"])
@pytest.mark.parametrize("packing", ["packed", "split", "interleaved"])
@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1), (4, 2), (16, 5)])
def test_plans_move_each_byte_of_the_mapping_once(kv, packing, tp, rank):
    group = _group(kv=kv)
    caches = _per_layer(group, min(tp, group.num_kv_heads), packing)
    mapping = rank_page_mapping(group, ParallelSpec(tp_size=tp, rank=rank), "packed" if packing == "split" else packing)
    refs = caches.group_refs[0]
    for runs in (mapping.store_runs, mapping.load_runs):
        plans = plans_for(runs, refs)
        assert _plan_bytes(plans, refs) == _run_bytes(runs)
    # a few plans per layer tensor (K and V apart at most), never one per fragment
    assert len(plans_for(mapping.load_runs, refs)) <= 2 * len(caches.tensors)


def test_a_cross_layer_row_is_one_plan_of_whole_rows():
    group = _group(layers=4)
    specs = [LayerKVSpec.attention(f"l{i}", 0, group.block_size, group.num_kv_heads, group.head_size) for i in range(4)]
    alloc = allocate_cross_layer_kv_caches(specs, num_blocks=4)
    mapping = rank_page_mapping(group, ParallelSpec())
    (gp,) = group_plans([mapping], alloc.registration, slot_bytes=group.page_bytes, blocks_per_file=1)
    for plans in (gp.store, gp.load):
        assert len(plans) == 1
        p = plans[0]
        assert (p.reps, p.num, p.size) == (1, 1, group.page_bytes)


def test_group_plans_name_the_group_and_the_fix():
    group = _group()
    caches = _per_layer(group, 2, "packed")
    with pytest.raises(
        LayoutError, match="group 0 .* expects a 3072-byte local page, the registered tensors give 6144"
    ):
        group_plans([rank_page_mapping(group, ParallelSpec(tp_size=4))], caches, group.page_bytes, 1)
    with pytest.raises(
        LayoutError,
        match=r"group 0 needs 24576 bytes per slot \(2 x 12288\), pool slots hold 12288; create a larger pool",
    ):
        group_plans([rank_page_mapping(group, ParallelSpec(tp_size=2))], caches, group.page_bytes, 2)


@pytest.mark.parametrize("kv", ["NHD", "HND"])
def test_packed_staging_holds_only_the_ranks_bytes(kv):
    group = _group(kv=kv)
    caches = _per_layer(group, 4, "packed")
    mapping = rank_page_mapping(group, ParallelSpec(tp_size=4, rank=1))
    plans = plans_for(mapping.store_runs, caches.group_refs[0])
    st = staging_for(plans, group.page_bytes)
    assert st.page_bytes == group.page_bytes // 4
    # segments: every staged byte once, each inside the canonical page
    co, so, w, rows, cp, sp = st.segs.T
    staged = np.concatenate(
        [s + np.arange(r)[:, None] * p + np.arange(x) for s, x, r, p in zip(so, w, rows, sp, strict=True)], axis=None
    )
    assert sorted(staged.tolist()) == list(range(st.page_bytes))
    assert int((co + (rows - 1) * cp + w).max()) <= group.page_bytes


def test_batch_work_places_blocks_on_slots_and_pages():
    spec = LoadStoreSpec([7, 8, 9, 3, 4], [3, 2], [6, 0])
    work = batch_work(spec, [10, 11, 12], num_blocks=[16, 16], num_slots=20, blocks_per_file=4, store=False)
    assert [(w.group, w.ids.tolist(), w.slots.tolist(), w.pages.tolist()) for w in work] == [
        (0, [7, 8, 9], [10, 10, 11], [2, 3, 0]),  # entered at page 6 % 4 = 2 of its first file
        (1, [3, 4], [12, 12], [0, 1]),
    ]
    with pytest.raises(ValueError, match=r"group 0: a store must start at a file boundary \(block_indices\[0\] = 6"):
        batch_work(spec, [10, 11, 12], num_blocks=[16, 16], num_slots=20, blocks_per_file=4, store=True)
    with pytest.raises(ValueError, match="group 0: block id 9 >= num_blocks 9"):
        batch_work(spec, [10, 11, 12], num_blocks=[9, 16], num_slots=20, blocks_per_file=4, store=False)
    with pytest.raises(ValueError, match=r"slot 12 is outside the pool \(0\.\.11\)"):
        batch_work(spec, [10, 11, 12], num_blocks=[16, 16], num_slots=12, blocks_per_file=4, store=False)


@pytest.mark.parametrize(("quantities", "width"), [((16, 24), 8), ((16, 4), 4), ((6, 64), 2), ((3, 8), 1), ((), 8)])
def test_elem_bytes_is_the_widest_integer_dividing_every_quantity(quantities, width):
    assert elem_bytes(*quantities) == width
