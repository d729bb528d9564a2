"""Cross-layer KV allocation: one contiguous row per block for all layers of a page-size group.

:func:`allocate_cross_layer_kv_caches` allocates, per page size, one int8
buffer ``(num_blocks, layer_slots, page_bytes)``, hands out zero-copy views in
each layer's own shapes (:class:`LayerKVSpec`, :class:`StateSpec`) and the
:class:`~fstier.layout.CanonicalKVCaches` registration that moves a block of a
group as one row (the fast staging layout: one copy per block). Allocation
only: the page geometry and the copies are :mod:`fstier.layout` and
:mod:`fstier.gpu_copy`. Costs: one ``torch.zeros`` per distinct page size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from fstier.config import DTYPE_SIZES
from fstier.errors import LayoutError
from fstier.layout import CanonicalKVCaches, KVRef

__all__ = ["CrossLayerKVCaches", "LayerKVSpec", "StateSpec", "allocate_cross_layer_kv_caches"]


class StateSpec(NamedTuple):
    """One per-block tensor of a layer: its shape per block and dtype name (None: default)."""

    shape: tuple[int, ...]
    dtype: str | None = None


@dataclass(frozen=True)
class LayerKVSpec:
    """One layer's KV page: its KV group and the per-block states it holds
    (attention: one ``(2, block_size, heads, head_size)`` state)."""

    name: str
    group_idx: int
    states: tuple[StateSpec, ...]

    @classmethod
    def attention(
        cls,
        name: str,
        group_idx: int,
        block_size: int,
        num_heads: int,
        head_size: int,
        kv_layout: str = "NHD",
        dtype: str | None = None,
    ) -> LayerKVSpec:
        tokens_heads = (block_size, num_heads) if kv_layout == "NHD" else (num_heads, block_size)
        shape = (2, *tokens_heads, head_size)
        return cls(name, group_idx, (StateSpec(shape, dtype),))

    def page_bytes(self, default_dtype: str) -> int:
        total = 0
        for s in self.states:
            es = DTYPE_SIZES[s.dtype or default_dtype]
            total = -(-total // es) * es + math.prod(s.shape) * es
        return -(-total // 16) * 16 if len(self.states) > 1 else total


@dataclass
class CrossLayerKVCaches:
    """Result of :func:`allocate_cross_layer_kv_caches`."""

    buffers: list[torch.Tensor]
    views: dict[str, tuple[torch.Tensor, ...]]
    registration: CanonicalKVCaches
    buffer_layers: list[list[str]]


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise LayoutError(f"unknown dtype {name!r}")
    return dt


def allocate_cross_layer_kv_caches(
    layer_specs: Sequence[LayerKVSpec],
    num_blocks: int,
    device: torch.device | str = "cpu",
    dtype: str | torch.dtype = "float16",
) -> CrossLayerKVCaches:
    """One contiguous int8 buffer ``(num_blocks, num_layers, page_bytes)`` per page size.

    Layers of one KV group must share one page size. KV groups with the same
    page size share a buffer (as an engine's hybrid allocator shares memory:
    a block id belongs to one group at a time); layer ``j`` of each such group
    uses layer slot ``j``. Returns per-layer zero-copy views in the layer's own
    shapes and the registration: one tensor per buffer, one reference per
    group covering its layer slots, so a block of a group moves as one row.
    """
    dname = str(dtype).removeprefix("torch.")
    if dname not in DTYPE_SIZES:
        raise LayoutError(f"allocate_cross_layer_kv_caches: unknown dtype {dtype!r}")
    if num_blocks < 1:
        raise LayoutError(f"allocate_cross_layer_kv_caches: num_blocks must be >= 1, got {num_blocks}")
    if not layer_specs:
        raise LayoutError("allocate_cross_layer_kv_caches: no layers given")
    by_group: dict[int, list[LayerKVSpec]] = {}
    for spec in layer_specs:
        if not spec.states or any(any(d < 1 for d in s.shape) for s in spec.states):
            raise LayoutError(f"layer {spec.name!r}: every state needs a non-empty shape, got {spec.states}")
        by_group.setdefault(spec.group_idx, []).append(spec)
    if sorted(by_group) != list(range(len(by_group))):
        raise LayoutError(f"group indices must be 0..{len(by_group) - 1}, got {sorted(by_group)}")
    page_of: dict[int, int] = {}
    for g, layers in by_group.items():
        sizes = {lay.page_bytes(dname) for lay in layers}
        if len(sizes) != 1:
            raise LayoutError(
                f"group {g}: layers have different page sizes {sorted(sizes)} "
                f"({', '.join(lay.name for lay in layers)}); put them in separate groups"
            )
        page_of[g] = sizes.pop()
    buf_of_page: dict[int, int] = {}
    for g in sorted(by_group):
        buf_of_page.setdefault(page_of[g], len(buf_of_page))
    buffers: list[torch.Tensor] = []
    buffer_layers: list[list[str]] = []
    for page, _b in sorted(buf_of_page.items(), key=lambda kv: kv[1]):
        slots = max(len(by_group[g]) for g in by_group if page_of[g] == page)
        buffers.append(torch.zeros((num_blocks, slots, page), dtype=torch.int8, device=device))
        buffer_layers.append([])
    views: dict[str, tuple[torch.Tensor, ...]] = {}
    group_refs: list[list[KVRef]] = []
    for g in sorted(by_group):
        page, b = page_of[g], buf_of_page[page_of[g]]
        buf = buffers[b]
        for j, lay in enumerate(by_group[g]):
            if lay.name in views:
                raise LayoutError(f"layer name {lay.name!r} appears twice")
            buffer_layers[b].append(lay.name)
            off = j * page
            states = []
            for s in lay.states:
                dt = _dtype(s.dtype or dname)
                es = DTYPE_SIZES[s.dtype or dname]
                off = -(-off // es) * es
                inner = [1] * len(s.shape)
                for k in range(len(s.shape) - 2, -1, -1):
                    inner[k] = inner[k + 1] * s.shape[k + 1]
                row = buf.stride(0)
                if row % es or off % es:
                    raise LayoutError(f"layer {lay.name!r}: state of {s.dtype or dname} is not aligned in the row")
                v = torch.empty(0, dtype=dt, device=buf.device)
                v.set_(buf.untyped_storage(), off // es, (num_blocks, *s.shape), (row // es, *inner))
                states.append(v)
                off += math.prod(s.shape) * es
            views[lay.name] = tuple(states)
        group_refs.append([KVRef(b, 0, len(by_group[g]) * page)])
    names = [f"buffer {i}" for i in range(len(buffers))]
    reg = CanonicalKVCaches([buf.view(num_blocks, -1) for buf in buffers], group_refs, names)
    return CrossLayerKVCaches(buffers, views, reg, buffer_layers)
