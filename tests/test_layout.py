"""Canonical page mappings: tiling, coverage, resharding round trips, fail-closed cases."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from _layout_helpers import apply_load, apply_store, attn_group, local_page
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fstier import canonical
from fstier.config import ModelSpec, ParallelSpec
from fstier.errors import LayoutError
from fstier.layout import (
    CanonicalKVCaches,
    LoadStoreSpec,
    PageMapping,
    PageRun,
    rank_page_mapping,
    verify_layout,
)

LAYOUTS = ("packed", "split", "interleaved")


def _all_maps(group, par, kv_packing="packed") -> list[PageMapping]:
    return [rank_page_mapping(group, par.with_rank(r), kv_packing) for r in range(par.world_size)]


def _store_all(group, par, page, kv_packing) -> tuple[np.ndarray, np.ndarray]:
    canon = np.zeros_like(page)
    count = np.zeros(page.size, dtype=np.int32)
    for m in _all_maps(group, par, kv_packing):
        apply_store(m.store_runs, local_page(group, m.parallel, page, kv_packing), canon, count)
    return canon, count


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    heads=st.integers(1, 64),
    tp=st.sampled_from([1, 2, 4, 8]),
    head_size=st.sampled_from([1, 3, 8, 16]),
    block_size=st.sampled_from([1, 2, 4, 16]),
    dtype=st.sampled_from(["float32", "float16", "int8"]),
    kv=st.sampled_from(["NHD", "HND"]),
    kv_packing=st.sampled_from(LAYOUTS),
    layers=st.integers(1, 3),
)
def test_tiling_and_coverage_or_rank_private(heads, tp, head_size, block_size, dtype, kv, kv_packing, layers):
    group = attn_group(
        num_kv_heads=heads, head_size=head_size, block_size=block_size, dtype=dtype, kv_layout=kv, num_layers=layers
    )
    par = ParallelSpec(tp_size=tp)
    m = rank_page_mapping(group, par, kv_packing)
    assert m.canonical_page_bytes == canonical.canonical_page_bytes(group, par)
    assert m.local_page_bytes == canonical.local_page_bytes(group, par)
    certified = heads % tp == 0 or tp % heads == 0
    assert m.rank_private is not certified
    m.verify()
    if certified:
        # Independent check by simulation: bytes tile once and land right.
        page = np.random.default_rng(0).integers(0, 256, group.page_bytes, dtype=np.uint8)
        canon, count = _store_all(group, par, page, kv_packing)
        assert (count == 1).all()
        np.testing.assert_array_equal(canon, page)
        for mm in _all_maps(group, par, kv_packing):
            local = np.zeros(mm.local_page_bytes, dtype=np.uint8)
            cover = np.zeros(mm.local_page_bytes, dtype=np.int32)
            apply_load(mm.load_runs, page, local, cover)
            assert (cover == 1).all()
            np.testing.assert_array_equal(local, local_page(group, mm.parallel, page, kv_packing))
    else:
        assert m.canonical_page_bytes == tp * m.local_page_bytes


@pytest.mark.parametrize("kv", ["NHD", "HND"])
@pytest.mark.parametrize("kv_packing", LAYOUTS)
def test_round_trip_every_tp_pair(kv, kv_packing):
    group = attn_group(num_kv_heads=8, head_size=4, block_size=4, kv_layout=kv, num_layers=3)
    page = np.random.default_rng(1).integers(0, 256, group.page_bytes, dtype=np.uint8)
    for a, b in itertools.product([1, 2, 4, 8], repeat=2):
        canon, _ = _store_all(group, ParallelSpec(tp_size=a), page, kv_packing)
        for m in _all_maps(group, ParallelSpec(tp_size=b), kv_packing):
            local = np.zeros(m.local_page_bytes, dtype=np.uint8)
            apply_load(m.load_runs, canon, local)
            np.testing.assert_array_equal(local, local_page(group, m.parallel, page, kv_packing), err_msg=f"{a}->{b}")


@pytest.mark.parametrize(("heads", "a", "b"), [(2, 4, 8), (2, 8, 1), (1, 4, 2), (2, 2, 8), (4, 8, 2)])
def test_replicated_heads_one_contributor_all_load(heads, a, b):
    group = attn_group(num_kv_heads=heads, head_size=4, block_size=4)
    page = np.random.default_rng(2).integers(0, 256, group.page_bytes, dtype=np.uint8)
    maps = _all_maps(group, ParallelSpec(tp_size=a))
    contributors = [m for m in maps if m.store_runs]
    assert len(contributors) == min(heads, a)
    canon, count = _store_all(group, ParallelSpec(tp_size=a), page, "packed")
    assert (count == 1).all()
    for m in _all_maps(group, ParallelSpec(tp_size=b)):
        assert m.load_runs
        local = np.zeros(m.local_page_bytes, dtype=np.uint8)
        apply_load(m.load_runs, canon, local)
        np.testing.assert_array_equal(local, local_page(group, m.parallel, page, "packed"))


PARALLELS = [
    {"tp_size": 2, "pcp_size": 2},
    {"tp_size": 4, "dcp_size": 2},
    {"tp_size": 4, "dcp_size": 2, "pcp_size": 2, "cp_kv_cache_interleave_size": 2},
    {"tp_size": 2, "pp_size": 3},
    {"tp_size": 8, "dcp_size": 4, "cp_kv_cache_interleave_size": 4},
    {"tp_size": 1, "pcp_size": 4, "cp_kv_cache_interleave_size": 2, "pp_size": 2},
]


@pytest.mark.parametrize("src", PARALLELS)
@pytest.mark.parametrize("kv", ["NHD", "HND"])
def test_round_trip_with_context_and_pipeline_parallel(src, kv):
    group = attn_group(num_kv_heads=4, head_size=4, block_size=16, kv_layout=kv, num_layers=4)
    page = np.random.default_rng(3).integers(0, 256, group.page_bytes, dtype=np.uint8)
    par = ParallelSpec(**src)
    verify_layout(group, par, "interleaved")
    canon, count = _store_all(group, par, page, "interleaved")
    assert (count == 1).all()
    np.testing.assert_array_equal(canon, page)
    for m in _all_maps(group, ParallelSpec(tp_size=2, dcp_size=2), "packed"):
        local = np.zeros(m.local_page_bytes, dtype=np.uint8)
        apply_load(m.load_runs, canon, local)
        np.testing.assert_array_equal(local, local_page(group, m.parallel, page, "packed"))


def test_contiguous_layout_is_one_run_and_sharded_nhd_is_one_strided_run():
    group = attn_group(num_kv_heads=8, head_size=64, block_size=16, num_layers=4)
    m1 = rank_page_mapping(group, ParallelSpec(tp_size=1))
    assert m1.load_runs == (PageRun(0, 0, group.page_bytes, 1, group.page_bytes, group.page_bytes),)
    m2 = rank_page_mapping(group, ParallelSpec(tp_size=2, rank=1))
    (run,) = m2.load_runs
    assert run == PageRun(0, 512, 512, 4 * 2 * 16, 512, 1024)


def test_mla_is_rank_private_and_fails_closed_across_world_sizes():
    model = ModelSpec(
        name="m", dtype="bfloat16", groups=[{"kind": "mla", "block_size": 16, "num_layers": 3, "head_size": 576}]
    )
    g = model.groups[0]
    m2 = rank_page_mapping(g, ParallelSpec(tp_size=2, rank=1))
    m4 = rank_page_mapping(g, ParallelSpec(tp_size=4, rank=1))
    local = 3 * 16 * 576 * 2
    assert m2.rank_private and m2.local_page_bytes == local
    assert m2.canonical_page_bytes == 2 * local == canonical.canonical_page_bytes(g, m2.parallel)
    assert m4.canonical_page_bytes == 4 * local
    assert m2.store_runs == (PageRun(0, local, local, 1, local, local),)
    # The file size differs, so the load size check turns tp=2 bytes into a miss at tp=4.
    assert m2.canonical_page_bytes != m4.canonical_page_bytes
    m2.verify()
    m4.verify()


@pytest.mark.parametrize(
    ("group_kw", "par_kw"),
    [
        ({"num_kv_heads": 3}, {"tp_size": 2}),
        ({"num_kv_heads": 6}, {"tp_size": 4}),
        ({"block_size": 6}, {"tp_size": 1, "pcp_size": 4}),
        ({"block_size": 16}, {"tp_size": 2, "dcp_size": 2, "cp_kv_cache_interleave_size": 16}),
        ({"kind": "mamba", "head_size": 0, "page_size_bytes": 4096}, {"tp_size": 2, "pp_size": 3}),
    ],
)
def test_uncertified_layouts_are_rank_private_and_agree_with_format(group_kw, par_kw):
    group = attn_group(**group_kw)
    par = ParallelSpec(**par_kw)
    assert not canonical.is_certified(group, par)
    slice_bytes = canonical.rank_private_slice_bytes(group, par)
    for r in range(par.world_size):
        m = rank_page_mapping(group, par.with_rank(r))
        assert m.rank_private
        assert m.canonical_page_bytes == par.world_size * slice_bytes == canonical.canonical_page_bytes(group, par)
        assert m.local_page_bytes <= slice_bytes
    verify_layout(group, par)


def test_mapping_agrees_with_format_for_every_parallel_layout():
    groups = [attn_group(num_kv_heads=h, block_size=b) for h in (1, 2, 8) for b in (4, 16)]
    groups.append(ModelSpec(name="m", groups=[{"kind": "mla", "head_size": 8}]).groups[0])
    for group, kw in itertools.product(groups, PARALLELS + [{"tp_size": 8}]):
        par = ParallelSpec(**kw)
        for r in range(par.world_size):
            m = rank_page_mapping(group, par.with_rank(r))
            assert m.canonical_page_bytes == canonical.canonical_page_bytes(group, par)
            assert m.format_id == canonical.canonical_format_id(group)
            assert m.local_page_bytes == canonical.local_page_bytes(group, par.with_rank(r))


def test_verify_detects_a_broken_mapping():
    group = attn_group()
    good = rank_page_mapping(group, ParallelSpec(tp_size=2))
    r = good.load_runs[0]
    bad = PageMapping(**{**good.__dict__, "load_runs": (r._replace(num_fragments=r.num_fragments - 1),)})
    with pytest.raises(LayoutError, match="do not cover the local page"):
        bad.check_self()
    bad_store = PageMapping(**{**good.__dict__, "store_runs": (r._replace(canonical_offset=r.canonical_offset + 8),)})
    with pytest.raises(LayoutError, match="does not match the load mapping"):
        bad_store.check_self()
    with pytest.raises(LayoutError, match="kv_packing must be one of"):
        rank_page_mapping(group, ParallelSpec(), "sideways")


# ---------------------------------------------------------------- LoadStoreSpec


def test_load_store_spec_validation():
    s = LoadStoreSpec([4, 5, 6, 9], [3, 1], [5, 0])
    assert s.group_block_ids(0) == (4, 5, 6) and s.group_block_ids(1) == (9,)
    assert s.skip(0, 4) == 1 and s.num_files(0, 4) == 1 and s.num_files(0, 2) == 2
    with pytest.raises(ValueError, match=r"sum\(group_sizes\) = 3 must equal len\(block_ids\) = 4"):
        LoadStoreSpec([1, 2, 3, 4], [3], [0])
    with pytest.raises(ValueError, match="one block index per group"):
        LoadStoreSpec([1, 2], [1, 1], [0])
    with pytest.raises(ValueError, match="block ids must be >= 0"):
        LoadStoreSpec([1, -2], [2], [0])
    with pytest.raises(ValueError, match="group_sizes must be >= 0"):
        LoadStoreSpec([], [-1, 1], [0, 0])


# ---------------------------------------------------------------- registration


def test_register_dedupes_shared_tensors_and_splits_kv():
    packed = torch.zeros(6, 2, 4, 2, 8, dtype=torch.float16)
    split = torch.zeros(2, 6, 4, 2, 8, dtype=torch.float16)
    reg = CanonicalKVCaches.register([[packed, (split[0], split[1])], [packed]])
    assert len(reg.tensors) == 3
    assert all(t.dtype == torch.int8 and t.shape[0] == 6 for t in reg.tensors)
    assert reg.group_refs[0][0] == reg.group_refs[1][0] == (0, 0, 2 * 4 * 2 * 8 * 2)
    assert reg.local_page_bytes(0) == 256 + 2 * 128
    reg2 = CanonicalKVCaches.register([[split]], split_kv_dim0=True)
    assert [r.tensor_idx for r in reg2.group_refs[0]] == [0, 1]
    # The int8 rows alias the engine tensor.
    reg.tensors[0][2].fill_(1)
    assert packed[2].view(torch.int8).eq(1).all() and packed[1].view(torch.int8).eq(0).all()


def test_register_refuses_bad_layouts_naming_the_layer():
    blocks_inner = torch.zeros(4, 2, 6, 8).transpose(0, 2)  # (6 blocks?, 2, 4, 8) with blocks strided inside
    with pytest.raises(LayoutError, match="layer 0: blocks are not the outermost physical dimension"):
        CanonicalKVCaches.register([[blocks_inner]], names=[["layer 0"]])
    noncontig = torch.zeros(6, 2, 4, 16)[..., ::2]
    with pytest.raises(LayoutError, match="group 0 layer 1: a block's page is not contiguous"):
        CanonicalKVCaches.register([[torch.zeros(6, 2, 4, 8), noncontig]])
    with pytest.raises(LayoutError, match="split_kv_dim0 expects shape"):
        CanonicalKVCaches.register([[torch.zeros(3, 6, 4)]], split_kv_dim0=True)
