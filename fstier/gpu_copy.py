"""Staging between device KV caches and canonical pages in shared host memory.

The host side is a :class:`~fstier.host_pool.HostBlockPool` (shared, aligned,
pinned when CUDA is there; re-exported here for older imports).

:class:`RankStager` moves one rank's bytes: ``stage_out(spec, slots)`` gathers
the rank's store runs of the blocks in ``spec`` into canonical positions in the
slots; ``stage_in(slots, spec)`` scatters the load runs back into device blocks.
Slot content is ``blocks_per_file`` consecutive canonical pages of one group.
At start-up every run is clipped to the registered tensors and grouped into
*copy plans*: runs of one shape whose offsets form an arithmetic progression
become one 4-d strided view, so a transfer costs one batched gather/scatter per
plan for all blocks at once, never a Python step per fragment or per layer; a
cross-layer or packed row is one plan whose fragments are whole rows.

Hand-off: the scheduler allocates slots, tells the ranks (slot ids travel with
the job); after stage_out completes on every rank the scheduler owns the slots
and writes them to files; for a load the scheduler fills the slots and then the
ranks stage in; the scheduler frees the slots once every rank reported
completion. A slot is never touched by two sides at once.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fstier.errors import LayoutError
from fstier.host_pool import HostBlockPool
from fstier.layout import (
    CanonicalKVCaches,
    LoadStoreSpec,
    PageMapping,
    PageRun,
    _coalesce,
    _expand,
    _Frags,
)

__all__ = ["CopyStats", "HostBlockPool", "RankStager"]

#: Per-block bytes of a plan from which one copy per block beats one batched
#: fancy-index copy (which needs a temporary and a second pass).
_PER_BLOCK_MIN_BYTES = 16 * 1024
#: Per-block copies at least this big use torch's (parallel, vectorised)
#: ``copy_``; smaller ones numpy's assignment, whose per-call cost is lower.
_TORCH_COPY_MIN_BYTES = 256 * 1024


# --------------------------------------------------------------------------- #
# RankStager
# --------------------------------------------------------------------------- #


@dataclass
class CopyStats:
    """Copy instrumentation: ``ops`` batched torch copies issued, ``fragments``
    contiguous byte ranges moved (a cross-layer row counts 1), ``bytes`` moved."""

    ops: int = 0
    fragments: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class _Plan:
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
class _GroupPlans:
    store: list[_Plan]
    load: list[_Plan]
    canonical_page_bytes: int


@dataclass
class _Batch:
    """One in-flight stage_out/stage_in call (one record, under the stager lock)."""

    batch_id: int
    event: Any = None
    finish: list[tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)


def _progressions(runs: list[PageRun]) -> list[tuple[int, int, int, int, int]]:
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


def _plans_for(runs: Sequence[PageRun], refs: Sequence[Any]) -> list[_Plan]:
    """Clip runs (local-page coordinates) to the group's references and group them."""
    if not runs:
        return []
    bounds = np.cumsum([0] + [r.size for r in refs])
    unit = 0
    for r in runs:
        unit = math.gcd(unit, r.fragment_size, r.local_offset, r.local_stride if r.num_fragments > 1 else 0)
    for b in bounds.tolist():
        unit = math.gcd(unit, int(b))
    frags = _expand(runs, unit)
    ref_of = np.searchsorted(bounds, frags.lo, side="right") - 1
    plans: list[_Plan] = []
    for k, ref in enumerate(refs):
        sel = ref_of == k
        if not sel.any():
            continue
        sub = _Frags(frags.lo[sel] - bounds[k] + ref.offset, frags.co[sel], unit)
        by_shape: dict[tuple[int, int, int, int], list[PageRun]] = {}
        for run in _coalesce(sub):
            key = (run.fragment_size, run.num_fragments, run.local_stride, run.canonical_stride)
            by_shape.setdefault(key, []).append(run)
        for (f, nf, ls, cs), group in by_shape.items():
            for lo0, co0, reps, dlo, dco in _progressions(group):
                plans.append(_Plan(ref.tensor_idx, lo0, co0, reps, dlo, dco, nf, ls, cs, f))
    return plans


class RankStager:
    """Gather/scatter between one rank's KV tensors and canonical pages in a pool.

    ``page_mappings[g]`` is this rank's mapping of group ``g`` (its
    ``local_page_bytes`` must equal the registered references' total).
    Tensors on CUDA use a dedicated stream, pinned slots and an event per
    batch; CPU tensors copy synchronously. Both report through
    :meth:`poll` / :meth:`wait`.
    """

    def __init__(
        self,
        canonical_kv_caches: CanonicalKVCaches,
        page_mappings: Sequence[PageMapping],
        pool: HostBlockPool,
        blocks_per_file: int = 1,
    ) -> None:
        caches = canonical_kv_caches
        caches.check()
        if len(page_mappings) != len(caches.group_refs):
            raise LayoutError(
                f"RankStager: {len(page_mappings)} page mappings for {len(caches.group_refs)} registered groups"
            )
        if blocks_per_file < 1:
            raise LayoutError(f"RankStager: blocks_per_file must be >= 1, got {blocks_per_file}")
        self.caches = caches
        self.mappings = list(page_mappings)
        self.pool = pool
        self.blocks_per_file = blocks_per_file
        self.stats = CopyStats()
        self._lock = threading.Lock()
        self._batches: dict[int, _Batch] = {}
        self._done: list[int] = []
        self._next_id = 0
        self._groups: list[_GroupPlans] = []
        for g, (m, refs) in enumerate(zip(self.mappings, caches.group_refs, strict=True)):
            have = caches.local_page_bytes(g)
            if have != m.local_page_bytes:
                raise LayoutError(
                    f"RankStager: group {g} ({m.format_id}, kv_packing {m.kv_packing!r}) expects a "
                    f"{m.local_page_bytes}-byte local page, the registered tensors give {have}; "
                    "check the group spec, parallel layout and registration order"
                )
            need = blocks_per_file * m.canonical_page_bytes
            if need > pool.slot_bytes:
                raise LayoutError(
                    f"RankStager: group {g} needs {need} bytes per slot ({blocks_per_file} x "
                    f"{m.canonical_page_bytes}), pool slots hold {pool.slot_bytes}; create a larger pool"
                )
            self._groups.append(
                _GroupPlans(_plans_for(m.store_runs, refs), _plans_for(m.load_runs, refs), m.canonical_page_bytes)
            )
        self._pool_i8 = pool.tensor.view(torch.int8).view(-1)
        devices = {t.device for t in caches.tensors}
        self.device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        if devices:
            raise LayoutError("RankStager: all registered tensors must be on one device")
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        # Views are built once; a call only indexes them. The CPU path uses
        # numpy views of the same memory: torch's CPU index kernels copy byte by
        # byte (~0.2 GB/s measured by bench_staging) while numpy moves each
        # strided block with memcpy-sized inner loops.
        self._np_src = {}
        self._np_dst = {}
        if not self._cuda:
            for key, v in self._src_views_list():
                self._np_src[key] = v
            for key, v in self._dst_views_list():
                self._np_dst[key] = v
        # The same views as torch tensors for big per-block copies: torch's
        # strided copy of >= 256 KiB is ~1.1-1.4x numpy's assignment here.
        self._t_src = {k: torch.from_numpy(v) for k, v in self._np_src.items()}
        self._t_dst = {k: torch.from_numpy(v) for k, v in self._np_dst.items()}
        self._src_views = {
            (g, kind, i): self._src_view(p)
            for g, gp in enumerate(self._groups)
            for kind, plans in (("store", gp.store), ("load", gp.load))
            for i, p in enumerate(plans)
        }
        self._dst_views = {
            (g, kind, i): self._dst_view(p, gp.canonical_page_bytes)
            for g, gp in enumerate(self._groups)
            for kind, plans in (("store", gp.store), ("load", gp.load))
            for i, p in enumerate(plans)
        }

    def _src_views_list(self) -> list[tuple[tuple[int, str, int], np.ndarray]]:
        out = []
        for g, gp in enumerate(self._groups):
            for kind, plans in (("store", gp.store), ("load", gp.load)):
                for i, p in enumerate(plans):
                    t = self.caches.tensors[p.tensor_idx]
                    base = t.numpy()[0, p.local_offset :]
                    view = np.lib.stride_tricks.as_strided(
                        base, (t.shape[0], p.reps, p.num, p.size), (t.stride(0), p.rep_local, p.local_stride, 1)
                    )
                    out.append(((g, kind, i), view))
        return out

    def _dst_views_list(self) -> list[tuple[tuple[int, str, int], np.ndarray]]:
        flat = self._pool_i8.numpy()
        out = []
        for g, gp in enumerate(self._groups):
            for kind, plans in (("store", gp.store), ("load", gp.load)):
                for i, p in enumerate(plans):
                    view = np.lib.stride_tricks.as_strided(
                        flat[p.canonical_offset :],
                        (self.pool.num_slots, self.blocks_per_file, p.reps, p.num, p.size),
                        (self.pool.slot_bytes, gp.canonical_page_bytes, p.rep_canonical, p.canonical_stride, 1),
                    )
                    out.append(((g, kind, i), view))
        return out

    def _cpu_copy(self, key: tuple[int, str, int], p: _Plan, ids: torch.Tensor, sidx: torch.Tensor, pidx: torch.Tensor, out: bool) -> None:
        src, dst = self._np_src[key], self._np_dst[key]
        if p.reps * p.num * p.size >= _PER_BLOCK_MIN_BYTES:
            # Big blocks: strided copies without a temporary (one pass). Runs of
            # consecutive block ids that land on consecutive pages of one slot
            # (blocks_per_file > 1) move as one copy: each numpy call re-takes
            # the GIL, which the I/O threads hold often (bench_pipeline, 64 KiB
            # pages x 16 per file: 0.9 GB/s staging with one copy per block).
            ni, ns, npg = ids.numpy(), sidx.numpy(), pidx.numpy()
            n = len(ni)
            brk = np.flatnonzero((np.diff(ni) != 1) | (np.diff(ns) != 0) | (np.diff(npg) != 1)) + 1
            starts = [0, *brk.tolist()]
            block_bytes = p.reps * p.num * p.size
            for a, e in zip(starts, [*brk.tolist(), n], strict=True):
                b0, s0, pg0, m = int(ni[a]), int(ns[a]), int(npg[a]), e - a
                # torch's copy_ is faster for big copies, numpy's call cost
                # lower for small ones (crossover ~256 KiB here).
                if m * block_bytes >= _TORCH_COPY_MIN_BYTES:
                    tsrc, tdst = self._t_src[key], self._t_dst[key]
                    if out:
                        tdst[s0, pg0 : pg0 + m].copy_(tsrc[b0 : b0 + m])
                    else:
                        tsrc[b0 : b0 + m].copy_(tdst[s0, pg0 : pg0 + m])
                elif out:
                    dst[s0, pg0 : pg0 + m] = src[b0 : b0 + m]
                else:
                    src[b0 : b0 + m] = dst[s0, pg0 : pg0 + m]
            self.stats.ops += len(starts)
        else:
            # Small blocks: one batched fancy-index copy for all blocks.
            ni, ns, npg = ids.numpy(), sidx.numpy(), pidx.numpy()
            if out:
                dst[ns, npg] = src[ni]
            else:
                src[ni] = dst[ns, npg]
            self.stats.ops += 1
        n = len(ids)
        self.stats.fragments += n * p.reps * p.num
        self.stats.bytes += n * p.reps * p.num * p.size

    @property
    def num_plans(self) -> list[tuple[int, int]]:
        """(store plans, load plans) per group: copies per call per group."""
        return [(len(g.store), len(g.load)) for g in self._groups]

    def _src_view(self, p: _Plan) -> torch.Tensor:
        t = self.caches.tensors[p.tensor_idx]
        return t.as_strided(
            (t.shape[0], p.reps, p.num, p.size),
            (t.stride(0), p.rep_local, p.local_stride, 1),
            t.storage_offset() + p.local_offset,
        )

    def _dst_view(self, p: _Plan, cpb: int) -> torch.Tensor:
        pool = self._pool_i8
        return pool.as_strided(
            (self.pool.num_slots, self.blocks_per_file, p.reps, p.num, p.size),
            (self.pool.slot_bytes, cpb, p.rep_canonical, p.canonical_stride, 1),
            pool.storage_offset() + p.canonical_offset,
        )

    def _indices(self, spec: LoadStoreSpec, slots: Sequence[int], store: bool) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        if len(spec.group_sizes) != len(self._groups):
            raise ValueError(
                f"LoadStoreSpec has {len(spec.group_sizes)} groups, the stager has {len(self._groups)}"
            )
        bpf = self.blocks_per_file
        want = sum(spec.num_files(g, bpf) for g in range(len(self._groups)))
        if len(slots) != want:
            raise ValueError(f"need {want} slot(s) for this spec (blocks_per_file={bpf}), got {len(slots)}")
        for s in slots:
            if not 0 <= s < self.pool.num_slots:
                raise ValueError(f"slot {s} is outside the pool (0..{self.pool.num_slots - 1})")
        out = []
        slot_base = 0
        for g in range(len(self._groups)):
            ids = spec.group_block_ids(g)
            nfiles = spec.num_files(g, bpf)
            if ids:
                skip = spec.skip(g, bpf)
                if store and skip:
                    raise ValueError(
                        f"group {g}: a store must start at a file boundary (block_indices[{g}] = "
                        f"{spec.block_indices[g]} is not a multiple of blocks_per_file = {bpf})"
                    )
                limit = self.caches.num_blocks(g)
                if max(ids) >= limit:
                    raise ValueError(f"group {g}: block id {max(ids)} >= num_blocks {limit}")
                k = torch.arange(len(ids)) + skip
                gslots = torch.tensor(slots[slot_base : slot_base + nfiles], dtype=torch.long)
                out.append((g, torch.tensor(ids, dtype=torch.long), gslots[k // bpf], k % bpf))
            slot_base += nfiles
        return out

    def stage_out(self, spec: LoadStoreSpec, slots: Sequence[int]) -> int:
        """Gather this rank's store runs of ``spec``'s blocks into ``slots``; returns a batch id."""
        work = self._indices(spec, slots, store=True)
        batch = self._new_batch()
        stream_ctx = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with stream_ctx:
            for g, ids, sidx, pidx in work:
                dev_ids = ids.to(self.device, non_blocking=True) if self._cuda else ids
                for i, p in enumerate(self._groups[g].store):
                    src, dst = self._src_views[(g, "store", i)], self._dst_views[(g, "store", i)]
                    if self._cuda:
                        gathered = src[dev_ids]
                        host = torch.empty(gathered.shape, dtype=torch.int8, pin_memory=True)
                        host.copy_(gathered, non_blocking=True)
                        batch.keep.append(gathered)
                        batch.finish.append((dst, (sidx, pidx), host))
                        self._count(p, len(ids))
                    else:
                        self._cpu_copy((g, "store", i), p, ids, sidx, pidx, out=True)
        return self._submit(batch)

    def stage_in(self, slots: Sequence[int], spec: LoadStoreSpec) -> int:
        """Scatter this rank's load runs from ``slots`` into ``spec``'s blocks; returns a batch id."""
        work = self._indices(spec, slots, store=False)
        batch = self._new_batch()
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        for g, ids, sidx, pidx in work:
            for i, p in enumerate(self._groups[g].load):
                src, dst = self._src_views[(g, "load", i)], self._dst_views[(g, "load", i)]
                if self._cuda and self._stream is not None:
                    host = torch.empty((len(ids), p.reps, p.num, p.size), dtype=torch.int8, pin_memory=True)
                    host.copy_(dst[sidx, pidx])
                    with torch.cuda.stream(self._stream):
                        dev = host.to(self.device, non_blocking=True)
                        src[ids.to(self.device, non_blocking=True)] = dev
                    batch.keep.extend((host, dev))
                    self._count(p, len(ids))
                else:
                    self._cpu_copy((g, "load", i), p, ids, sidx, pidx, out=False)
        return self._submit(batch)

    def _count(self, p: _Plan, n: int) -> None:
        self.stats.ops += 1
        self.stats.fragments += n * p.reps * p.num
        self.stats.bytes += n * p.reps * p.num * p.size

    def _new_batch(self) -> _Batch:
        with self._lock:
            self._next_id += 1
            return _Batch(self._next_id)

    def _submit(self, batch: _Batch) -> int:
        if self._stream is not None:
            batch.event = torch.cuda.Event()
            batch.event.record(self._stream)
        with self._lock:
            if batch.event is None:
                self._done.append(batch.batch_id)
            else:
                self._batches[batch.batch_id] = batch
        return batch.batch_id

    def _complete(self, batch: _Batch) -> None:
        # Host-side scatter of device->host gathers, once their copy finished.
        for dst, index, host in batch.finish:
            dst[index] = host
        batch.finish.clear()
        batch.keep.clear()

    def poll(self) -> list[int]:
        """Batch ids finished since the last poll (never blocks)."""
        with self._lock:
            ready = [b for b in self._batches.values() if b.event is None or b.event.query()]
            for b in ready:
                del self._batches[b.batch_id]
            done, self._done = self._done, []
        for b in ready:
            self._complete(b)
            done.append(b.batch_id)
        return sorted(done)

    def wait(self, batch_id: int | None = None) -> None:
        """Block until ``batch_id`` (or every in-flight batch) has finished."""
        with self._lock:
            targets = [b for k, b in self._batches.items() if batch_id is None or k == batch_id]
        for b in targets:
            if b.event is not None:
                b.event.synchronize()
        with self._lock:
            for b in targets:
                self._batches.pop(b.batch_id, None)
                self._done.append(b.batch_id)
        for b in targets:
            self._complete(b)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._batches)

