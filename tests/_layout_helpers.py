"""Independent reference sharding for layout tests (numpy reshapes, no runs)."""

from __future__ import annotations

import numpy as np

from fstier import canonical
from fstier.config import KVGroupSpec, ModelSpec, ParallelSpec


def attn_group(**kw: object) -> KVGroupSpec:
    d: dict[str, object] = {
        "kind": "full_attention",
        "block_size": 16,
        "num_layers": 2,
        "num_kv_heads": 8,
        "head_size": 8,
    }
    dtype = kw.pop("dtype", "float16")
    d.update(kw)
    return ModelSpec(name="m", dtype=dtype, groups=[d]).groups[0]


def canonical_array(group: KVGroupSpec, page: np.ndarray) -> np.ndarray:
    """A canonical page (bytes) as (layer, kv, token, head, dim-bytes) whatever NHD/HND."""
    de = group.head_size * group.element_size
    L, B, H = group.num_layers, group.block_size, group.num_kv_heads
    if group.kv_layout == "NHD":
        return page.reshape(L, 2, B, H, de)
    return page.reshape(L, 2, H, B, de).transpose(0, 1, 3, 2, 4)


def rank_tokens(group: KVGroupSpec, par: ParallelSpec) -> np.ndarray:
    cp, cr = canonical.cp_world(par), canonical.cp_rank(par)
    t = np.arange(group.block_size)
    return t[(t // par.cp_kv_cache_interleave_size) % cp == cr]


def rank_heads(group: KVGroupSpec, par: ParallelSpec) -> np.ndarray:
    hr = par.tp_size // par.dcp_size
    head_rank = par.tp_rank // par.dcp_size
    H = group.num_kv_heads
    if H % hr == 0:
        n = H // hr
        return np.arange(head_rank * n, (head_rank + 1) * n)
    return np.array([head_rank // (hr // H)])


def local_page(group: KVGroupSpec, par: ParallelSpec, page: np.ndarray, kv_packing: str) -> np.ndarray:
    """The bytes rank ``par.rank`` holds for canonical ``page``, built by slicing."""
    arr = canonical_array(group, page)  # (L, 2, B, H, de)
    l0, l1 = canonical.pp_layer_range(group.num_layers, par.pp_size, par.pp_rank)
    sub = arr[l0:l1][:, :, rank_tokens(group, par)][:, :, :, rank_heads(group, par)]
    if group.kv_layout == "HND":
        sub = sub.transpose(0, 1, 3, 2, 4)  # (l, kv, h, t, de)
    if kv_packing == "interleaved":
        sub = np.moveaxis(sub, 1, 3)  # (l, a, b, kv, de)
    return np.ascontiguousarray(sub).reshape(-1)


def apply_store(runs, local: np.ndarray, canon: np.ndarray, count: np.ndarray | None = None) -> None:
    for r in runs:
        for j in range(r.num_fragments):
            lo = r.local_offset + j * r.local_stride
            co = r.canonical_offset + j * r.canonical_stride
            canon[co : co + r.fragment_size] = local[lo : lo + r.fragment_size]
            if count is not None:
                count[co : co + r.fragment_size] += 1


def apply_load(runs, canon: np.ndarray, local: np.ndarray, count: np.ndarray | None = None) -> None:
    for r in runs:
        for j in range(r.num_fragments):
            lo = r.local_offset + j * r.local_stride
            co = r.canonical_offset + j * r.canonical_stride
            local[lo : lo + r.fragment_size] = canon[co : co + r.fragment_size]
            if count is not None:
                count[lo : lo + r.fragment_size] += 1
