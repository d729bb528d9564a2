"""Cross-layer allocation: aliasing views, hybrid groups, one copy per block per group."""

from __future__ import annotations

import pytest
import torch

from fstier.config import ModelSpec, ParallelSpec
from fstier.cross_layer import LayerKVSpec, StateSpec, allocate_cross_layer_kv_caches
from fstier.errors import LayoutError
from fstier.gpu_copy import RankStager
from fstier.layout import (
    LoadStoreSpec,
    PoolTensors,
    rank_page_mapping,
)
from fstier.slots.host_pool import HostBlockPool

B, H, D = 8, 4, 16
MAMBA_STATES = (StateSpec((16, 4), "float32"), StateSpec((4, 16, 8), "float16"))


def _hybrid_specs():
    specs = [LayerKVSpec.attention(f"full{i}", 0, B, H, D) for i in range(4)]
    specs += [LayerKVSpec.attention(f"swa{i}", 1, B, H, D) for i in range(2)]
    specs += [LayerKVSpec(f"mamba{i}", 2, MAMBA_STATES) for i in range(2)]
    return specs


def _hybrid_model():
    mamba_page = LayerKVSpec("x", 2, MAMBA_STATES).page_bytes("float16")
    return ModelSpec(
        name="hybrid",
        dtype="float16",
        groups=[
            {"num_layers": 4, "num_kv_heads": H, "head_size": D, "block_size": B},
            {
                "kind": "sliding_window",
                "sliding_window": 64,
                "num_layers": 2,
                "num_kv_heads": H,
                "head_size": D,
                "block_size": B,
            },
            {"kind": "mamba", "num_layers": 2, "page_size_bytes": mamba_page, "block_size": B},
        ],
    )


def test_views_alias_rows_and_never_overlap():
    alloc = allocate_cross_layer_kv_caches(_hybrid_specs(), 6, "cpu", "float16")
    assert len(alloc.buffers) == 2  # full + sliding window share a page size; mamba has its own
    assert alloc.buffer_layers == [["full0", "full1", "full2", "full3", "swa0", "swa1"], ["mamba0", "mamba1"]]
    assert alloc.views["full0"][0].shape == (6, 2, B, H, D)
    conv, ssm = alloc.views["mamba1"]
    assert conv.dtype == torch.float32 and conv.shape == (6, 16, 4) and ssm.shape == (6, 4, 16, 8)
    # Writes through a view appear in that block's row, at the layer's slot.
    alloc.views["full2"][0][3].fill_(1.5)
    row = alloc.buffers[0][3].view(torch.float16)
    page = 2 * B * H * D
    assert row[2].eq(1.5).all() and row[:2].eq(0).all() and row[3].eq(0).all()
    assert alloc.buffers[0][2].eq(0).all()
    # Distinct layers of one group, and the states of one layer, never share bytes.
    spans = []
    for name in ("full0", "full1", "full2", "full3", "mamba0", "mamba1"):
        for v in alloc.views[name]:
            start = v[0].data_ptr()
            spans.append((start, start + v[0].numel() * v.element_size(), name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        assert end <= start, (a, b)
    assert page * 2 == alloc.buffers[0].shape[2]
    conv[1].fill_(2.0)
    assert alloc.buffers[1][1, 1, : 16 * 4 * 4].view(torch.float32).eq(2.0).all()


def test_registration_is_one_tensor_per_buffer_with_full_row_refs():
    alloc = allocate_cross_layer_kv_caches(_hybrid_specs(), 6, "cpu", "float16")
    reg = alloc.registration
    assert len(reg.tensors) == 2
    page = 2 * B * H * D * 2
    assert reg.group_refs == [[(0, 0, 4 * page)], [(0, 0, 2 * page)], [(1, 0, reg.tensors[1].shape[1])]]


def test_hybrid_round_trip_through_files_one_copy_per_block_per_group(tmp_path):
    model = _hybrid_model()
    alloc = allocate_cross_layer_kv_caches(_hybrid_specs(), 8, "cpu", "float16")
    torch.manual_seed(0)
    for views in alloc.views.values():
        for v in views:
            v.copy_(torch.randn(v.shape).to(v.dtype))
    saved = [b.clone() for b in alloc.buffers]
    maps = [rank_page_mapping(g, ParallelSpec()) for g in model.groups]
    for m in maps:
        m.verify()
    slot_bytes = max(m.canonical_page_bytes for m in maps)
    spec = LoadStoreSpec([1, 2, 3, 1, 4], [2, 1, 2], [0, 0, 0])
    with HostBlockPool(5, slot_bytes) as pool:
        st = RankStager(alloc.registration, maps, pool)
        slots = pool.alloc(5)
        st.wait(st.stage_out(spec, slots))
        assert (st.stats.ops, st.stats.fragments) == (3, 5)
        payload_len = (
            [maps[0].canonical_page_bytes] * 2 + [maps[1].canonical_page_bytes] + [maps[2].canonical_page_bytes] * 2
        )
        for i, (s, n) in enumerate(zip(slots, payload_len, strict=True)):
            (tmp_path / f"{i}.bin").write_bytes(bytes(pool.slot_view(s)[:n]))
        for b in alloc.buffers:
            b.zero_()
        pool.free(slots)
        slots = pool.alloc(5)
        for s in slots:
            PoolTensors.of(pool).slot_tensor(s).zero_()
        for i, s in enumerate(slots):
            data = (tmp_path / f"{i}.bin").read_bytes()
            pool.slot_view(s)[: len(data)] = data
        st.wait(st.stage_in(slots, spec))
        assert (st.stats.ops, st.stats.fragments) == (6, 10)
        for g_blocks, (buf_idx, layer_slots) in zip(
            ([1, 2], [3], [1, 4]), ((0, slice(0, 4)), (0, slice(0, 2)), (1, slice(0, 2))), strict=True
        ):
            for blk in g_blocks:
                assert torch.equal(alloc.buffers[buf_idx][blk, layer_slots], saved[buf_idx][blk, layer_slots])
        assert alloc.buffers[0][5].eq(0).all()


def test_unplaceable_specs_are_refused_clearly():
    mixed = [LayerKVSpec.attention("a", 0, B, H, D), LayerKVSpec.attention("b", 0, B, 2 * H, D)]
    with pytest.raises(LayoutError, match=r"group 0: layers have different page sizes .* \(a, b\)"):
        allocate_cross_layer_kv_caches(mixed, 4)
    with pytest.raises(LayoutError, match="group indices must be 0..0"):
        allocate_cross_layer_kv_caches([LayerKVSpec.attention("a", 1, B, H, D)], 4)
    with pytest.raises(LayoutError, match="appears twice"):
        allocate_cross_layer_kv_caches([LayerKVSpec.attention("a", 0, B, H, D)] * 2, 4)
    with pytest.raises(LayoutError, match="num_blocks must be >= 1"):
        allocate_cross_layer_kv_caches(_hybrid_specs(), 0)
    with pytest.raises(LayoutError, match="non-empty shape"):
        allocate_cross_layer_kv_caches([LayerKVSpec("z", 0, (StateSpec((0, 3)),))], 4)
