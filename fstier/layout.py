"""Canonical pages: how a rank's KV bytes map onto parallel-independent pages.

A *canonical page* is one GPU block of one KV group as the whole model sees it:
all layers of the group, all KV heads, all ``block_size`` tokens, encoded as
``[layer][k|v][token][head][dim]`` (NHD, format ``attn-NHD-v1``) or
``[layer][k|v][head][token][dim]`` (HND, ``attn-HND-v1``). A rank's *local
page* holds its PP layers, its heads (an even share of the
``tp_size // dcp_size`` head ranks, or one replicated head) and its tokens
(token ``t`` belongs to context-parallel rank ``(t // interleave) % (pcp*dcp)``,
a local block holds ``block_size / (pcp*dcp)`` tokens). The local page is the
concatenation of the group's registered references (:class:`KVRef`) in order.

:func:`rank_page_mapping` turns that geometry into byte runs
(:class:`PageRun`): *store runs* (what this rank writes into the canonical page;
for replicated heads only replica 0 writes) and *load runs* (what it reads back,
covering its whole local page). Fragments are built with numpy and coalesced
(the run arithmetic is :mod:`fstier.page_runs`), so a contiguous layout is one
run. :meth:`PageMapping.verify` proves, for every
rank of the layout, that store runs tile the canonical page exactly once and
that load runs cover each local page exactly once, mapping the same bytes.

Everything that cannot be certified (MLA, mamba, uneven heads or tokens) is
*rank-private*: the canonical page is ``world_size x slice`` and rank ``r`` owns
slice ``r``; the file length then depends on the world size, so a load at
another size fails the size check (fail closed). ``fstier.canonical`` holds the
torch-free sizes and ids; this module agrees with it by construction.

:class:`CanonicalKVCaches` registers engine tensors as unique int8
``(num_blocks, row_bytes)`` views; :class:`PoolTensors` views a torch-free host
pool as tensors, pinned where CUDA is; :class:`LoadStoreSpec` names the blocks of a
transfer. Cross-layer allocation (one contiguous row per block for all layers
of a page-size group) is :mod:`fstier.cross_layer`.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np
import torch

from fstier import canonical
from fstier._cudart import cudart, device_view, pin_host, unpin_host
from fstier.config import KVGroupSpec, ParallelSpec
from fstier.errors import LayoutError, PoolError
from fstier.page_runs import Fragments, PageRun, coalesce, intervals_tile, run_intervals

if TYPE_CHECKING:  # pragma: no cover
    from fstier.slots.host_pool import HostBlockPool

__all__ = [
    "CanonicalKVCaches",
    "KVPacking",
    "KVRef",
    "LoadStoreSpec",
    "PageMapping",
    "PageRun",
    "PoolTensors",
    "rank_page_mapping",
    "verify_layout",
]

#: How K and V sit inside one layer of a rank-local attention page: the
#: ``kv_packing`` argument of :func:`rank_page_mapping`. (Not to be confused
#: with ``KVGroupSpec.kv_layout``, NHD or HND: the order of tokens and heads,
#: which is part of the canonical format and of the namespace.)
#: ``packed``: ``(2, tokens, heads, head_size)`` (NHD; HND swaps tokens and
#: heads), i.e. vLLM's ``(num_blocks, 2, block_size, heads, head_size)``.
#: ``split``: the same bytes registered as two tensors per layer (K then V);
#: local coordinates are identical to ``packed``.
#: ``interleaved``: ``(tokens, heads, 2 * head_size)`` (HND: ``(heads, tokens,
#: 2 * head_size)``), K and V side by side per head.
KVPacking = Literal["packed", "split", "interleaved"]
_KV_PACKINGS = ("packed", "split", "interleaved")


# --------------------------------------------------------------------------- #
# PageMapping
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class PageMapping:
    """One rank's byte mapping between its local page and the canonical page of a group."""

    group: KVGroupSpec
    parallel: ParallelSpec
    kv_packing: str
    format_id: str
    canonical_page_bytes: int
    local_page_bytes: int
    store_runs: tuple[PageRun, ...]
    load_runs: tuple[PageRun, ...]
    rank_private: bool

    def check_self(self) -> None:
        """This rank alone: load runs cover the local page once and land inside
        the canonical page; store runs are a subset of the load mapping."""
        ls, lz = run_intervals(self.load_runs, "local")
        err = intervals_tile(ls, lz, self.local_page_bytes)
        if err:
            raise LayoutError(f"{self._name()}: load runs do not cover the local page: {err}")
        cs, cz = run_intervals(self.load_runs, "canonical")
        if cs.size and (cs.min() < 0 or (cs + cz).max() > self.canonical_page_bytes):
            raise LayoutError(f"{self._name()}: load runs leave the canonical page")
        # Each store fragment must lie inside one load fragment with the same
        # local->canonical shift, so a store writes exactly what a load reads.
        sl, sz = run_intervals(self.store_runs, "local")
        sc, _ = run_intervals(self.store_runs, "canonical")
        if sl.size:
            order = np.argsort(ls)
            l_s, l_z, l_c = ls[order], lz[order], cs[order]
            k = np.searchsorted(l_s, sl, side="right") - 1
            bad = (k < 0) | (sl + sz > l_s[k] + l_z[k]) | (sc - sl != l_c[k] - l_s[k])
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise LayoutError(
                    f"{self._name()}: store fragment at local byte {int(sl[i])} does not match the load mapping"
                )

    def verify(self) -> None:
        """Prove the mapping for every rank of this layout (start-up only).

        Certified: store runs of all ranks tile the canonical page exactly once.
        Rank-private: each rank's runs stay inside its own slice. Raises
        :class:`~fstier.errors.LayoutError` naming the rank and the first bad byte.
        """
        verify_layout(self.group, self.parallel, self.kv_packing)

    def _name(self) -> str:
        return f"group {self.format_id} rank {self.parallel.rank} ({self.kv_packing})"


def verify_layout(group: KVGroupSpec, parallel: ParallelSpec, kv_packing: str = "packed") -> None:
    """Build every rank's mapping of ``parallel`` and prove tiling and coverage."""
    maps = [_build_mapping(group, parallel.with_rank(r), kv_packing) for r in range(parallel.world_size)]
    for m in maps:
        m.check_self()
    cpb = maps[0].canonical_page_bytes
    if any(m.canonical_page_bytes != cpb for m in maps):
        raise LayoutError(f"group {maps[0].format_id}: ranks disagree on the canonical page size")
    if maps[0].rank_private:
        for m in maps:
            s, z = run_intervals(m.store_runs, "canonical")
            lo_, hi_ = (
                m.parallel.rank * (cpb // parallel.world_size),
                (m.parallel.rank + 1) * (cpb // parallel.world_size),
            )
            if s.size and (s.min() < lo_ or (s + z).max() > hi_):
                raise LayoutError(f"{m._name()}: rank-private store runs leave the rank's slice")
        return
    parts = [run_intervals(m.store_runs, "canonical") for m in maps]
    starts = np.concatenate([p[0] for p in parts])
    sizes = np.concatenate([p[1] for p in parts])
    err = intervals_tile(starts, sizes, cpb)
    if err:
        raise LayoutError(
            f"group {maps[0].format_id} at tp={parallel.tp_size} pp={parallel.pp_size} "
            f"pcp={parallel.pcp_size} dcp={parallel.dcp_size}: store runs do not tile the canonical page: {err}"
        )


def _attention_fragments(group: KVGroupSpec, par: ParallelSpec, kv_packing: str) -> tuple[Fragments, np.ndarray, int]:
    """All fragments of this rank's local page (one head-dim each), the mask of
    those it stores, and the local page size."""
    es = group.element_size
    de = group.head_size * es
    big_h, b = group.num_kv_heads, group.block_size
    l0, l1 = canonical.pp_layer_range(group.num_layers, par.pp_size, par.pp_rank)
    nl = l1 - l0
    hr = canonical.head_ranks(par)
    head_rank = par.tp_rank // par.dcp_size
    if big_h % hr == 0:
        hl = big_h // hr
        h0, contributor = head_rank * hl, True
    else:  # replicated: hr % H == 0 (certified), hr/H ranks hold each head
        per = hr // big_h
        hl, h0, contributor = 1, head_rank // per, head_rank % per == 0
    cp, cr, inter = canonical.cp_world(par), canonical.cp_rank(par), par.cp_kv_cache_interleave_size
    tl_n = b // cp
    li, kv, tl, hl_i = np.meshgrid(
        np.arange(nl), np.arange(2), np.arange(tl_n), np.arange(hl), indexing="ij"
    )
    li, kv, tl, hl_i = (x.ravel().astype(np.int64) for x in (li, kv, tl, hl_i))
    t = ((tl // inter) * cp + cr) * inter + tl % inter
    h = h0 + hl_i
    layer = l0 + li
    if group.kv_layout == "NHD":
        co = (((layer * 2 + kv) * b + t) * big_h + h) * de
        if kv_packing == "interleaved":
            lo = (((li * tl_n + tl) * hl + hl_i) * 2 + kv) * de
        else:
            lo = (((li * 2 + kv) * tl_n + tl) * hl + hl_i) * de
    else:
        co = (((layer * 2 + kv) * big_h + h) * b + t) * de
        if kv_packing == "interleaved":
            lo = (((li * hl + hl_i) * tl_n + tl) * 2 + kv) * de
        else:
            lo = (((li * 2 + kv) * hl + hl_i) * tl_n + tl) * de
    order = np.argsort(co, kind="stable")
    frags = Fragments(lo[order], co[order], de)
    store = np.full(lo.size, contributor, dtype=bool)
    return frags, store, nl * 2 * tl_n * hl * de


def _build_mapping(group: KVGroupSpec, parallel: ParallelSpec, kv_packing: str) -> PageMapping:
    if kv_packing not in _KV_PACKINGS:
        raise LayoutError(f"kv_packing must be one of {_KV_PACKINGS}, got {kv_packing!r}")
    fmt = canonical.canonical_format_id(group)
    cpb = canonical.canonical_page_bytes(group, parallel)
    if canonical.is_certified(group, parallel):
        frags, store, lpb = _attention_fragments(group, parallel, kv_packing)
        if lpb != canonical.local_page_bytes(group, parallel):
            raise LayoutError(f"group {fmt}: local page size disagrees with fstier.canonical")
        load_runs = tuple(coalesce(frags))
        st = Fragments(frags.lo[store], frags.co[store], frags.size)
        store_runs = tuple(coalesce(st))
        return PageMapping(group, parallel, kv_packing, fmt, cpb, lpb, store_runs, load_runs, False)
    lpb = canonical.local_page_bytes(group, parallel)
    slice_bytes = canonical.rank_private_slice_bytes(group, parallel)
    runs = (PageRun(0, parallel.rank * slice_bytes, lpb, 1, lpb, lpb),) if lpb else ()
    return PageMapping(group, parallel, kv_packing, fmt, cpb, lpb, runs, runs, True)


def rank_page_mapping(group: KVGroupSpec, parallel: ParallelSpec, kv_packing: str = "packed") -> PageMapping:
    """This rank's mapping of ``group`` under ``parallel``.

    ``kv_packing`` is the rank-local arrangement of K and V (:data:`KVPacking`);
    the token/head order comes from ``group.kv_layout`` (NHD/HND). Groups that
    cannot be certified get a rank-private mapping (``rank_private`` is true).
    """
    return _build_mapping(group, parallel, kv_packing)


# --------------------------------------------------------------------------- #
# KV cache registration
# --------------------------------------------------------------------------- #


class KVRef(NamedTuple):
    """``size`` bytes at ``offset`` in every row of registered tensor ``tensor_idx``."""

    tensor_idx: int
    offset: int
    size: int


def _int8_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` (blocks outermost) as an int8 ``(num_blocks, page_bytes)`` view."""
    if t.dim() < 1:
        raise LayoutError(f"{name}: a KV tensor needs a blocks dimension, got a scalar")
    nb = t.shape[0]
    es = t.element_size()
    page_elems = math.prod(t.shape[1:])
    if page_elems == 0 or nb == 0:
        raise LayoutError(f"{name}: empty KV tensor of shape {tuple(t.shape)}")
    if nb > 1 and t.stride(0) < page_elems:
        raise LayoutError(
            f"{name}: blocks are not the outermost physical dimension (shape {tuple(t.shape)}, "
            f"strides {t.stride()}); allocate blocks first, e.g. (num_blocks, 2, block_size, heads, head_size)"
        )
    if not t[0].is_contiguous():
        raise LayoutError(
            f"{name}: a block's page is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}); "
            "register a tensor whose per-block page is one contiguous region"
        )
    view = torch.empty(0, dtype=torch.int8, device=t.device)
    row_stride = t.stride(0) * es if nb > 1 else page_elems * es
    view.set_(t.untyped_storage(), t.storage_offset() * es, (nb, page_elems * es), (row_stride, 1))
    return view


@dataclass
class CanonicalKVCaches:
    """An engine's KV tensors as unique int8 ``(num_blocks, row_bytes)`` tensors
    plus, per group, the references that concatenate into the local page."""

    tensors: list[torch.Tensor]
    group_refs: list[list[KVRef]]
    names: list[str] = field(default_factory=list)

    @classmethod
    def register(
        cls,
        groups: Sequence[Sequence[torch.Tensor | Sequence[torch.Tensor]]],
        *,
        split_kv_dim0: bool = False,
        names: Sequence[Sequence[str]] | None = None,
    ) -> CanonicalKVCaches:
        """Register per-group lists of layer entries.

        An entry is a tensor whose first dimension is blocks (packed
        ``(num_blocks, 2, block_size, heads, head_size)``, MLA
        ``(num_blocks, block_size, latent)``, cross-layer
        ``(num_blocks, num_layers, ...)`` for a whole group, a backing tensor
        shared by several groups, opaque mamba state), or a sequence of such
        tensors (split K/V: K then V). With ``split_kv_dim0`` every tensor entry
        is vLLM's split ``(2, num_blocks, ...)`` and is registered as K then V.
        A tensor met twice (same memory and geometry) is stored once.
        """
        tensors: list[torch.Tensor] = []
        tensor_names: list[str] = []
        seen: dict[tuple[object, ...], int] = {}
        group_refs: list[list[KVRef]] = []
        for g, entries in enumerate(groups):
            refs: list[KVRef] = []
            for i, entry in enumerate(entries):
                name = names[g][i] if names is not None else f"group {g} layer {i}"
                parts: list[tuple[str, torch.Tensor]]
                if isinstance(entry, torch.Tensor):
                    if split_kv_dim0:
                        if entry.dim() < 2 or entry.shape[0] != 2:
                            raise LayoutError(
                                f"{name}: split_kv_dim0 expects shape (2, num_blocks, ...), got {tuple(entry.shape)}"
                            )
                        parts = [(f"{name} K", entry[0]), (f"{name} V", entry[1])]
                    else:
                        parts = [(name, entry)]
                else:
                    parts = [(f"{name} part {j}", p) for j, p in enumerate(entry)]
                for pname, t in parts:
                    rows = _int8_rows(t, pname)
                    key = (rows.device, rows.data_ptr(), tuple(rows.shape), tuple(rows.stride()))
                    idx = seen.get(key)
                    if idx is None:
                        idx = seen[key] = len(tensors)
                        tensors.append(rows)
                        tensor_names.append(pname)
                    refs.append(KVRef(idx, 0, int(rows.shape[1])))
            group_refs.append(refs)
        return cls(tensors, group_refs, tensor_names)

    def local_page_bytes(self, group_idx: int) -> int:
        return sum(r.size for r in self.group_refs[group_idx])

    def num_blocks(self, group_idx: int) -> int:
        return min(int(self.tensors[r.tensor_idx].shape[0]) for r in self.group_refs[group_idx])

    def check(self) -> None:
        """References stay inside their tensors' rows."""
        for g, refs in enumerate(self.group_refs):
            for r in refs:
                if not 0 <= r.tensor_idx < len(self.tensors):
                    raise LayoutError(f"group {g}: reference to unknown tensor {r.tensor_idx}")
                row = int(self.tensors[r.tensor_idx].shape[1])
                if r.offset < 0 or r.size <= 0 or r.offset + r.size > row:
                    raise LayoutError(f"group {g}: reference {r} leaves the {row}-byte row")


# --------------------------------------------------------------------------- #
# LoadStoreSpec
class PoolTensors:
    """A :class:`~fstier.slots.host_pool.HostBlockPool`'s slots as tensors of
    this process (the host side of a copy; :class:`CanonicalKVCaches` is the
    device side), pinned (portable and mapped) when CUDA is usable, so device
    copies run asynchronously and kernels reach the slots in place. One per
    pool and process (:meth:`of`); the pool's ``close()`` unpins it and drops
    its tensors first. A child forked after its parent initialised CUDA
    cannot use CUDA at all: it stays unpinned, as CPU-only."""

    _of: weakref.WeakKeyDictionary[HostBlockPool, PoolTensors] = weakref.WeakKeyDictionary()
    _of_lock = threading.Lock()

    def __init__(self, pool: HostBlockPool) -> None:
        self.name, self.num_slots, self.slot_bytes = pool.name, pool.num_slots, pool.slot_bytes
        #: all slots as one uint8 ``(num_slots, slot_bytes)`` tensor sharing the memory
        self.tensor = torch.frombuffer(pool.buffer, dtype=torch.uint8).view(pool.num_slots, pool.slot_bytes)
        self._views: dict[int, torch.Tensor] = {}
        self._closed = False
        ok = torch.cuda.is_available() and not torch.cuda._is_in_bad_fork()
        self.pinned = ok and pin_host(self.tensor.data_ptr(), self.tensor.numel())
        pool.on_close(self._close)

    @classmethod
    def of(cls, pool: HostBlockPool) -> PoolTensors:
        """The pool's tensors in this process (made, and pinned, once)."""
        with cls._of_lock:
            got = cls._of.get(pool)
            if got is None:
                got = cls._of[pool] = cls(pool)
            return got

    def slot_tensor(self, i: int) -> torch.Tensor:
        """Slot ``i`` as a uint8 tensor sharing the memory."""
        if self._closed or not 0 <= i < self.num_slots:
            why = "is closed" if self._closed else f"has no slot {i} ({self.num_slots} slots)"
            raise PoolError(f"HostBlockPool {self.name!r} {why}")
        return self.tensor[i]

    def device_tensor(self, device: torch.device | str | int | None = None) -> torch.Tensor:
        """All slots as one CUDA uint8 ``(num_slots * slot_bytes,)`` tensor of the
        mapped pinned memory itself: kernels on ``device`` read and write the
        slots over the bus, without a copy. Needs a pinned pool."""
        if not self.pinned:
            raise PoolError(
                f"HostBlockPool {self.name!r}: the slots are not registered with CUDA (no CUDA, "
                "cudaHostRegister failed, or closed); device_tensor needs a pinned pool"
            )
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        idx = int(dev.index or 0)
        if idx not in self._views:
            flat = self.tensor.view(-1)
            ptr = cudart().host_device_pointer(flat.data_ptr(), idx)
            self._views[idx] = device_view(ptr, flat.numel(), dev, owner=self)
        return self._views[idx]

    def _close(self) -> None:
        self._closed, self._views = True, {}
        if self.pinned:
            unpin_host(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = torch.empty((0, self.slot_bytes), dtype=torch.uint8)


# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class LoadStoreSpec:
    """Blocks of one transfer: flat GPU ``block_ids`` of all groups,
    ``group_sizes[g]`` of them per group, ``block_indices[g]`` the logical
    index of group g's first block.

    With ``blocks_per_file > 1`` a group's blocks fill its files in order;
    the first file is entered at page ``block_indices[g] % blocks_per_file``
    (the skip), so a load starting mid-file lands on the right pages.
    """

    block_ids: tuple[int, ...]
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]

    def __init__(
        self, block_ids: Sequence[int], group_sizes: Sequence[int], block_indices: Sequence[int] | None = None
    ) -> None:
        ids = tuple(int(x) for x in block_ids)
        sizes = tuple(int(x) for x in group_sizes)
        idx = tuple(int(x) for x in block_indices) if block_indices is not None else (0,) * len(sizes)
        if any(s < 0 for s in sizes):
            raise ValueError(f"LoadStoreSpec: group_sizes must be >= 0, got {list(sizes)}")
        if sum(sizes) != len(ids):
            raise ValueError(
                f"LoadStoreSpec: sum(group_sizes) = {sum(sizes)} must equal len(block_ids) = {len(ids)}"
            )
        if len(idx) != len(sizes):
            raise ValueError(
                f"LoadStoreSpec: need one block index per group ({len(sizes)}), got {len(idx)}"
            )
        if any(i < 0 for i in ids):
            raise ValueError(f"LoadStoreSpec: block ids must be >= 0, got {min(ids)}")
        if any(i < 0 for i in idx):
            raise ValueError(f"LoadStoreSpec: block_indices must be >= 0, got {list(idx)}")
        object.__setattr__(self, "block_ids", ids)
        object.__setattr__(self, "group_sizes", sizes)
        object.__setattr__(self, "block_indices", idx)

    def group_block_ids(self, g: int) -> tuple[int, ...]:
        start = sum(self.group_sizes[:g])
        return self.block_ids[start : start + self.group_sizes[g]]

    def skip(self, g: int, blocks_per_file: int) -> int:
        return self.block_indices[g] % blocks_per_file

    def num_files(self, g: int, blocks_per_file: int) -> int:
        n = self.group_sizes[g]
        return 0 if n == 0 else -(-(self.skip(g, blocks_per_file) + n) // blocks_per_file)
