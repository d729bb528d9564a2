"""Copy plans: what one rank copies between its KV tensors and canonical pages.

A page mapping (:mod:`fstier.layout`) says which byte runs of a rank's local
page land where in the canonical page. :class:`~fstier.gpu_copy.RankStager`
plans the copies once, at start-up, here, and moves the bytes itself:

* :func:`group_plans` checks that a group's mapping and its registered
  tensors agree on the local page and that a slot holds ``blocks_per_file``
  canonical pages, then :func:`plans_for` clips the mapping's runs to the
  group's references (the tensor rows that concatenate into the local page)
  and groups runs of one shape whose offsets form an arithmetic progression
  (:func:`progressions`) into one :class:`Plan`: ``R x N`` fragments of ``F``
  bytes per block, a 4-d strided view on each side. A transfer then costs one
  batched copy per plan for all its blocks, never a Python step per fragment
  or per layer; a cross-layer or packed row is one plan of whole rows.
* CPU tensors: :func:`host_views` gives every plan as numpy views of the
  tensor and of the pool, so a copy is one strided assignment.
* The device path: :func:`staging_for` lays out a group's staging page per
  direction (the plans' canonical ranges packed in canonical order) and its
  *segments* (runs of equal ranges at a fixed pitch), each one 2-d copy per
  page; :func:`unit_groups` finds plans that one index kernel can move
  (same shape, evenly spaced addresses: layers allocated at a fixed spacing).
* Per batch: :func:`batch_work` checks a :class:`~fstier.layout.LoadStoreSpec`
  against the slots and gives each group's block ids with the slot and page
  each lands on (:class:`Work`); :func:`host_copies` turns the slots' offsets
  into copy rows, adjacent pages of adjacent slots merged into one copy when a
  segment tiles whole pages.

Invariants: a direction's plans cover the mapping's runs exactly, each byte
once, in the tensors' own coordinates (a reference's offset included); the
staging page holds exactly the rank's bytes when the packed order is affine,
and falls back to canonical offsets (a full-page staging buffer) otherwise;
copy rows name every staged byte once; a bad spec or slot list is one
``ValueError`` before anything moves. Costs: numpy only, no torch import
(tensors are only asked for their strides and addresses); plans, views and
staging are start-up work, a few Python steps per stride change; a batch's
indices and rows are a handful of numpy calls whatever its size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from fstier.errors import LayoutError
from fstier.page_runs import Fragments, PageRun, coalesce, expand

if TYPE_CHECKING:
    import torch

    from fstier.layout import CanonicalKVCaches, KVRef, LoadStoreSpec, PageMapping

__all__ = [
    "GroupPlans",
    "Plan",
    "Staging",
    "Work",
    "batch_work",
    "elem_bytes",
    "group_plans",
    "host_copies",
    "host_views",
    "plans_for",
    "progressions",
    "staging_for",
    "unit_groups",
]


@dataclass(frozen=True)
class Plan:
    """``R x N`` fragments of ``F`` bytes per block: a 4-d strided view on each side."""

    tensor_idx: int
    local_offset: int  # in the tensor row
    canonical_offset: int  # in the canonical page
    reps: int
    rep_local: int
    rep_canonical: int
    num: int
    local_stride: int
    canonical_stride: int
    size: int


@dataclass
class GroupPlans:
    """One group's plans per direction (store: what this rank writes into the
    canonical page; load: its whole local page) and the canonical page size."""

    store: list[Plan]
    load: list[Plan]
    canonical_page_bytes: int


def progressions(runs: list[PageRun]) -> list[tuple[int, int, int, int, int]]:
    """Split same-shape runs into arithmetic progressions of (local, canonical)
    offsets: ``(lo0, co0, count, dlo, dco)``. Tries canonical order and a few
    residue orders (K runs of all layers, then V runs) and keeps the fewest."""
    arr = np.array([(r.local_offset, r.canonical_offset) for r in runs], dtype=np.int64)
    arr = arr[np.argsort(arr[:, 1], kind="stable")]
    candidates = [arr]
    for j in range(1, min(9, len(arr))):
        m = int(arr[j, 1] - arr[0, 1])
        if m > 0:
            candidates.append(arr[np.lexsort((arr[:, 1], arr[:, 1] % m))])
    return min((_greedy_progressions(c) for c in candidates), key=len)


def _greedy_progressions(arr: np.ndarray) -> list[tuple[int, int, int, int, int]]:
    out: list[tuple[int, int, int, int, int]] = []
    i, n = 0, len(arr)
    if n == 1:
        return [(int(arr[0, 0]), int(arr[0, 1]), 1, 0, 0)]
    d = np.diff(arr, axis=0)
    ok = (d[:, 0] > 0) & (d[:, 1] > 0)
    while i < n:
        if i == n - 1 or not ok[i]:
            out.append((int(arr[i, 0]), int(arr[i, 1]), 1, 0, 0))
            i += 1
            continue
        step = d[i]
        same = ok[i:] & (d[i:, 0] == step[0]) & (d[i:, 1] == step[1])
        k = int(np.argmin(same)) if not same.all() else len(same)
        out.append((int(arr[i, 0]), int(arr[i, 1]), k + 1, int(step[0]), int(step[1])))
        i += k + 1
    return out


def plans_for(runs: Sequence[PageRun], refs: Sequence[KVRef]) -> list[Plan]:
    """Clip runs (local-page coordinates) to the group's references and group them."""
    if not runs:
        return []
    bounds = np.cumsum([0] + [r.size for r in refs])
    unit = 0
    for r in runs:
        unit = math.gcd(unit, r.fragment_size, r.local_offset, r.local_stride if r.num_fragments > 1 else 0)
    for b in bounds.tolist():
        unit = math.gcd(unit, int(b))
    frags = expand(runs, unit)
    ref_of = np.searchsorted(bounds, frags.lo, side="right") - 1
    plans: list[Plan] = []
    for k, ref in enumerate(refs):
        sel = ref_of == k
        if not sel.any():
            continue
        sub = Fragments(frags.lo[sel] - bounds[k] + ref.offset, frags.co[sel], unit)
        by_shape: dict[tuple[int, int, int, int], list[PageRun]] = {}
        for run in coalesce(sub):
            key = (run.fragment_size, run.num_fragments, run.local_stride, run.canonical_stride)
            by_shape.setdefault(key, []).append(run)
        for (f, nf, ls, cs), group in by_shape.items():
            for lo0, co0, reps, dlo, dco in progressions(group):
                plans.append(Plan(ref.tensor_idx, lo0, co0, reps, dlo, dco, nf, ls, cs, f))
    return plans


def group_plans(
    mappings: Sequence[PageMapping], caches: CanonicalKVCaches, slot_bytes: int, blocks_per_file: int
) -> list[GroupPlans]:
    """Each group's store and load plans, once its mapping and the registered
    tensors agree on the local page and a slot holds ``blocks_per_file``
    canonical pages (one ``LayoutError`` naming the group and the fix)."""
    groups: list[GroupPlans] = []
    for g, (m, refs) in enumerate(zip(mappings, caches.group_refs, strict=True)):
        have = caches.local_page_bytes(g)
        if have != m.local_page_bytes:
            raise LayoutError(
                f"RankStager: group {g} ({m.format_id}, kv_packing {m.kv_packing!r}) expects a "
                f"{m.local_page_bytes}-byte local page, the registered tensors give {have}; "
                "check the group spec, parallel layout and registration order"
            )
        need = blocks_per_file * m.canonical_page_bytes
        if need > slot_bytes:
            raise LayoutError(
                f"RankStager: group {g} needs {need} bytes per slot ({blocks_per_file} x "
                f"{m.canonical_page_bytes}), pool slots hold {slot_bytes}; create a larger pool"
            )
        groups.append(
            GroupPlans(plans_for(m.store_runs, refs), plans_for(m.load_runs, refs), m.canonical_page_bytes)
        )
    return groups


def host_views(
    groups: Sequence[GroupPlans],
    tensors: Sequence[torch.Tensor],
    pool: np.ndarray,
    num_slots: int,
    slot_bytes: int,
    blocks_per_file: int,
) -> tuple[dict[tuple[int, str, int], np.ndarray], dict[tuple[int, str, int], np.ndarray]]:
    """Every plan as numpy views of the same memory (CPU tensors), keyed
    ``(group, "store" | "load", plan)``: the tensor side ``(block, rep,
    fragment, bytes)`` and the pool side ``(slot, page, rep, fragment, bytes)``
    over ``pool``, the whole pool as one int8 array."""
    src: dict[tuple[int, str, int], np.ndarray] = {}
    dst: dict[tuple[int, str, int], np.ndarray] = {}
    for g, gp in enumerate(groups):
        for kind, plans in (("store", gp.store), ("load", gp.load)):
            for i, p in enumerate(plans):
                t = tensors[p.tensor_idx]
                base = t.numpy()[0, p.local_offset :]
                src[(g, kind, i)] = np.lib.stride_tricks.as_strided(
                    base, (t.shape[0], p.reps, p.num, p.size), (t.stride(0), p.rep_local, p.local_stride, 1)
                )
                dst[(g, kind, i)] = np.lib.stride_tricks.as_strided(
                    pool[p.canonical_offset :],
                    (num_slots, blocks_per_file, p.reps, p.num, p.size),
                    (slot_bytes, gp.canonical_page_bytes, p.rep_canonical, p.canonical_stride, 1),
                )
    return src, dst


@dataclass(frozen=True)
class Staging:
    """Device staging layout of one group and direction.

    ``page_bytes`` staging bytes per block; ``views[i]`` is plan ``i``'s
    ``(offset, rep stride, fragment stride)`` in a staging page; ``segs`` rows
    ``(canonical offset, staging offset, width, rows, canonical pitch, staging
    pitch)``: the host copies of one page. ``spans_page``: one segment that
    tiles whole pages on both sides, so adjacent pages merge into one copy."""

    page_bytes: int
    views: tuple[tuple[int, int, int], ...]
    segs: np.ndarray
    spans_page: bool
    #: smallest width / canonical pitch of a segment (1.0: contiguous rows)
    density: float = 1.0


def staging_for(plans: Sequence[Plan], cpb: int) -> Staging:
    """Pack the plans' canonical fragments in canonical order (start-up only).

    Packed order keeps each range's bytes adjacent, so the staging page is
    exactly the rank's bytes and every run of equal ranges at a fixed pitch is
    one 2-d copy. When a plan's fragments do not land on an affine grid in the
    packed order, staging uses canonical offsets instead (always affine, at the
    cost of a full-page staging buffer)."""
    if not plans:
        return Staging(0, (), np.zeros((0, 6), np.int64), False)
    cos, sizes, counts = [], [], []
    for p in plans:
        offs = (
            p.canonical_offset
            + np.arange(p.reps, dtype=np.int64)[:, None] * p.rep_canonical
            + np.arange(p.num, dtype=np.int64)[None, :] * p.canonical_stride
        ).ravel()
        cos.append(offs)
        sizes.append(np.full(offs.size, p.size, dtype=np.int64))
        counts.append(offs.size)
    co, sz = np.concatenate(cos), np.concatenate(sizes)
    order = np.argsort(co, kind="stable")
    co_s, sz_s = co[order], sz[order]
    brk = np.ones(co_s.size, dtype=bool)
    brk[1:] = co_s[1:] != co_s[:-1] + sz_s[:-1]
    first = np.flatnonzero(brk)
    rstart = co_s[first]
    rsize = np.add.reduceat(sz_s, first)
    rpos = np.cumsum(rsize) - rsize
    ri = np.cumsum(brk) - 1
    pos = np.empty_like(co)
    pos[order] = rpos[ri] + co_s - rstart[ri]
    views: list[tuple[int, int, int]] = []
    packed = True
    at = 0
    for p, n in zip(plans, counts, strict=True):
        grid = pos[at : at + n].reshape(p.reps, p.num)
        at += n
        p0 = int(grid[0, 0])
        a = int(grid[1, 0] - p0) if p.reps > 1 else 0
        b = int(grid[0, 1] - p0) if p.num > 1 else 0
        want = p0 + np.arange(p.reps)[:, None] * a + np.arange(p.num)[None, :] * b
        if not np.array_equal(grid, want):
            packed = False
            break
        views.append((p0, a, b))
    if packed:
        page_bytes, spos = int(rsize.sum()), rpos
    else:
        page_bytes, spos = cpb, rstart
        views = [(p.canonical_offset, p.rep_canonical, p.canonical_stride) for p in plans]
    segs: list[tuple[int, int, int, int, int, int]] = []
    i, m = 0, rstart.size
    while i < m:
        j = i + 1
        w = int(rsize[i])
        cp = sp = w
        if j < m and rsize[j] == w:
            cp, sp = int(rstart[j] - rstart[i]), int(spos[j] - spos[i])
            while j < m and rsize[j] == w and rstart[j] - rstart[j - 1] == cp and spos[j] - spos[j - 1] == sp:
                j += 1
        segs.append((int(rstart[i]), int(spos[i]), w, j - i, cp, sp))
        i = j
    arr = np.array(segs, dtype=np.int64)
    spans = len(segs) == 1 and segs[0][3] * segs[0][4] == cpb and segs[0][3] * segs[0][5] == page_bytes
    density = min(1.0 if rows == 1 else w / cp for _, _, w, rows, cp, _ in segs)
    return Staging(page_bytes, tuple(views), arr, spans, density)


def host_copies(st: Staging, host_off: np.ndarray, cpb: int) -> np.ndarray:
    """One batch's copies as rows ``(host offset, staging offset, width, rows,
    host pitch, staging pitch)``; staging page ``j`` is block ``j`` of the batch."""
    n = host_off.size
    if st.spans_page:
        co0, so0, w, rows, cp, sp = (int(x) for x in st.segs[0])
        brk = np.flatnonzero(np.diff(host_off) != cpb) + 1
        starts = np.concatenate([[0], brk]).astype(np.int64)
        counts = np.diff(np.append(starts, n))
        out = np.empty((starts.size, 6), dtype=np.int64)
        out[:, 0] = host_off[starts] + co0
        out[:, 1] = starts * st.page_bytes + so0
        out[:, 2] = w
        out[:, 3] = rows * counts
        out[:, 4] = cp
        out[:, 5] = sp
        return out
    k = st.segs.shape[0]
    out = np.repeat(st.segs[None, :, :], n, axis=0).reshape(n * k, 6).copy()
    out[:, 0] += np.repeat(host_off, k)
    out[:, 1] += np.repeat(np.arange(n, dtype=np.int64) * st.page_bytes, k)
    return out


class Work(NamedTuple):
    """One group's part of a batch: block ids, and each block's slot and page in it."""

    group: int
    ids: np.ndarray
    slots: np.ndarray
    pages: np.ndarray


def unit_groups(
    plans: Sequence[Plan], views: Sequence[tuple[int, int, int]], tensors: Sequence[torch.Tensor], raw_ok: bool
) -> list[list[int]]:
    """Indices of plans that can share a kernel: same shapes and strides, and
    source address, canonical offset and staging offset each advancing by one
    positive step. Without raw device views (CPU) the tensors must also share
    one storage."""
    by_key: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(plans):
        t = tensors[p.tensor_idx]
        key = (
            p.reps, p.num, p.size, p.rep_local, p.local_stride, p.rep_canonical, p.canonical_stride,
            int(t.stride(0)), int(t.shape[0]), views[i][1], views[i][2],
            0 if raw_ok else t.untyped_storage().data_ptr(),
        )
        by_key.setdefault(key, []).append(i)
    out: list[list[int]] = []
    for idx in by_key.values():
        idx = sorted(idx, key=lambda i: plans[i].canonical_offset)

        def coords(i: int) -> tuple[int, int, int]:
            p = plans[i]
            return (tensors[p.tensor_idx].data_ptr() + p.local_offset, p.canonical_offset, views[i][0])

        run = [idx[0]]
        step: tuple[int, int, int] | None = None
        for i in idx[1:]:
            prev, cur = coords(run[-1]), coords(i)
            d = (cur[0] - prev[0], cur[1] - prev[1], cur[2] - prev[2])
            if min(d) > 0 and (step is None or d == step):
                step = d
                run.append(i)
            else:
                out.append(run)
                run, step = [i], None
        out.append(run)
    return sorted(out, key=lambda r: r[0])


def elem_bytes(*byte_quantities: int) -> int:
    """The widest integer element (8, 4, 2 or 1 bytes) dividing every offset,
    stride and size: index kernels move one element per thread, so 8-byte
    elements move 8x the bytes per instruction of int8 (and make 256-byte bus
    writes per warp)."""
    g = 0
    for q in byte_quantities:
        g = math.gcd(g, int(q))
    return next(size for size in (8, 4, 2, 1) if g % size == 0)


def batch_work(
    spec: LoadStoreSpec,
    slots: Sequence[int],
    num_blocks: Sequence[int],
    num_slots: int,
    blocks_per_file: int,
    store: bool,
) -> list[Work]:
    """Each group's block ids of ``spec`` with the slot and page each lands on:
    ``slots`` hold the groups' files in group order, a group's first file
    entered at page ``spec.skip(g, blocks_per_file)`` (a store must start at a
    file boundary). ``num_blocks[g]`` is group ``g``'s block count; a bad
    count, slot or block id is one ``ValueError`` naming it."""
    # numpy, not Python loops or small torch ops: this runs on the caller's
    # thread for every batch (thousands of blocks cost tens of microseconds).
    if len(spec.group_sizes) != len(num_blocks):
        raise ValueError(
            f"LoadStoreSpec has {len(spec.group_sizes)} groups, the stager has {len(num_blocks)}"
        )
    bpf = blocks_per_file
    want = sum(spec.num_files(g, bpf) for g in range(len(num_blocks)))
    if len(slots) != want:
        raise ValueError(f"need {want} slot(s) for this spec (blocks_per_file={bpf}), got {len(slots)}")
    all_slots = np.asarray(slots, dtype=np.int64)
    bad = np.flatnonzero((all_slots < 0) | (all_slots >= num_slots))
    if bad.size:
        raise ValueError(f"slot {int(all_slots[bad[0]])} is outside the pool (0..{num_slots - 1})")
    out = []
    slot_base = 0
    for g in range(len(num_blocks)):
        ids = np.asarray(spec.group_block_ids(g), dtype=np.int64)
        nfiles = spec.num_files(g, bpf)
        if ids.size:
            skip = spec.skip(g, bpf)
            if store and skip:
                raise ValueError(
                    f"group {g}: a store must start at a file boundary (block_indices[{g}] = "
                    f"{spec.block_indices[g]} is not a multiple of blocks_per_file = {bpf})"
                )
            limit = num_blocks[g]
            top = int(ids.max())
            if top >= limit:
                raise ValueError(f"group {g}: block id {top} >= num_blocks {limit}")
            k = np.arange(ids.size, dtype=np.int64) + skip
            gslots = all_slots[slot_base : slot_base + nfiles]
            out.append(Work(g, ids, gslots[k // bpf], k % bpf))
        slot_base += nfiles
    return out
