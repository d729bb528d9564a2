"""Staging between device KV caches and canonical pages in shared host memory.

The host side is a :class:`~fstier.slots.host_pool.HostBlockPool` (shared,
aligned, torch-free); :class:`~fstier.layout.PoolTensors` views it as tensors
in the process that stages and pins it there when CUDA is usable.

:class:`RankStager` moves one rank's bytes: ``stage_out(spec, slots)`` gathers
the rank's store runs of the blocks in ``spec`` into canonical positions in the
slots; ``stage_in(slots, spec)`` scatters the load runs back into device blocks.
Slot content is ``blocks_per_file`` consecutive canonical pages of one group.
What to copy is planned once, at start-up, by :mod:`fstier.copy_plan` (numpy):
*copy plans* (runs of one shape at evenly spaced offsets, each one 4-d strided
view), staging layouts and, per batch, the block/slot/page indices and host
copy rows; a transfer costs one batched gather/scatter per plan for all its
blocks, never a Python step per fragment or per layer. This module moves the
bytes: it owns the stager's stream, buffers, events and batch records.

CUDA tensors never pass through a temporary pinned buffer or a CPU loop: the
pool is registered pinned and mapped, and ``cuda_copy`` picks how a batch moves:

* ``"dma"``: on the stager's stream, gather the blocks' fragments into a device
  staging buffer laid out as the rank's canonical ranges packed in canonical
  order (one index kernel per plan), then let the copy engine move them with
  one ``cudaMemcpy2DAsync`` per uniform run of ranges (rows of equal width at a
  fixed pitch). A rank's share of a page is one such run for the regular
  layouts (a head slice of every token row, NHD; a head slice of every layer's
  K and V, HND; the whole page at tp=1) and pages of adjacent slots merge, so a
  batch costs a few copies whatever its size. Loads run the same in reverse.
* ``"kernel"``: index kernels read or write the mapped slots directly.
* ``"auto"`` (the default on CUDA): per batch, ``"dma"`` when its copies
  average at least 1 MiB and the rank owns at least half of each row it
  copies, ``"kernel"`` otherwise (many small copies: small pages in scattered
  slots; thin rows: a quarter of the heads or less), as measured on an H100.

Both only queue work: ``stage_out``/``stage_in`` return once it is queued (the
only host work is building index arrays), completion is an event per batch,
and :meth:`RankStager.poll` only queries events. ``bench_gpu_staging.py``
measures both against a pinned contiguous copy. On CPU tensors the default is
numpy's strided copies; ``cuda_copy`` there runs the same index and packing
logic with memcpy in place of the copy engine (how CI tests it).

Hand-off: the scheduler allocates slots, tells the ranks (slot ids travel with
the job); after stage_out completes on every rank the scheduler owns the slots
and writes them to files; for a load the scheduler fills the slots and then the
ranks stage in; the scheduler frees the slots once every rank reported
completion. A slot is never touched by two sides at once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from fstier._cudart import cudart, device_view
from fstier.copy_plan import (
    Plan,
    Staging,
    Work,
    batch_work,
    elem_bytes,
    group_plans,
    host_copies,
    host_views,
    staging_for,
    unit_groups,
)
from fstier.errors import LayoutError
from fstier.layout import CanonicalKVCaches, LoadStoreSpec, PageMapping, PoolTensors
from fstier.slots.host_pool import HostBlockPool

__all__ = ["CopyStats", "CudaCopy", "RankStager"]

#: How a CUDA stager moves bytes (see the module docstring).
CudaCopy = Literal["auto", "dma", "kernel"]
_CUDA_COPIES = ("auto", "dma", "kernel")
#: The default, chosen by bench_gpu_staging on an H100 (docs/performance.md).
_DEFAULT_CUDA_COPY: CudaCopy = "auto"
#: "auto" takes the copy engine when a batch's host copies average at least
#: this many bytes (each copy costs a few microseconds of launch, on the CPU and
#: on the engine) and the rank's rows fill at least this share of their pitch;
#: index kernels on the mapped pool otherwise. On an H100 (bench_gpu_staging,
#: pages >= 64 KiB, 4 batches in flight) 2-d copies of a quarter of each row
#: ran at a median 0.77x of a contiguous copy, kernels at 0.85x; at half and
#: full rows the copy engine led (0.91x / 0.92x against 0.86x / 0.87x).
_DMA_MIN_BYTES_PER_COPY = 1 << 20
_DMA_MIN_DENSITY = 0.5

#: The integer element type of each width :func:`~fstier.copy_plan.elem_bytes` picks.
_INT_OF_BYTES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}

#: Per-block bytes of a plan from which one copy per block beats one batched
#: fancy-index copy (which needs a temporary and a second pass).
_PER_BLOCK_MIN_BYTES = 16 * 1024
#: Per-block copies at least this big use torch's (parallel, vectorised)
#: ``copy_``; smaller ones numpy's assignment, whose per-call cost is lower.
_TORCH_COPY_MIN_BYTES = 256 * 1024


@dataclass
class _Unit:
    """Plans of one shape whose tensors sit at evenly spaced addresses, moved by
    one kernel per batch: ``src`` is ``(plan, block, rep, fragment, elems)``,
    ``stage`` the staging geometry ``(offset, plan stride, rep stride, fragment
    stride)`` in bytes, ``dst`` the mapped pool as ``(plan, slot, page, rep,
    fragment, elems)`` (kernel copies only). Per-layer caches whose layers were
    allocated at a fixed spacing (one allocation, or equal ones back to back)
    cost one launch per batch instead of one per layer."""

    plans: list[Plan]
    src: torch.Tensor
    stage: tuple[int, int, int, int]
    dst: torch.Tensor | None = None


@dataclass
class CopyStats:
    """Copy instrumentation: ``ops`` copies issued (CPU: batched numpy/torch
    copies; CUDA: index kernels plus copy-engine copies), ``fragments``
    contiguous byte ranges moved (a cross-layer row counts 1), ``bytes`` moved."""

    ops: int = 0
    fragments: int = 0
    bytes: int = 0


@dataclass
class _Batch:
    """One in-flight stage_out/stage_in call (one record, under the stager lock).

    ``keep`` holds the device buffers its queued work uses and ``pinned`` the
    index buffers its host-to-device index copy reads; both are released when
    its event has completed."""

    batch_id: int
    event: Any = None
    keep: list[torch.Tensor] = field(default_factory=list)
    pinned: list[torch.Tensor] = field(default_factory=list)


def _typed(
    base: torch.Tensor, dtype: torch.dtype, byte_offset: int, shape: Sequence[int], byte_strides: Sequence[int]
) -> torch.Tensor:
    """A ``dtype`` view of ``base``'s storage; the last dim is bytes with stride 1."""
    es = torch.empty(0, dtype=dtype).element_size()
    start = base.storage_offset() * base.element_size() + byte_offset
    v = torch.empty(0, dtype=dtype, device=base.device)
    v.set_(
        base.untyped_storage(),
        start // es,
        (*shape[:-1], shape[-1] // es),
        (*(s // es for s in byte_strides[:-1]), 1),
    )
    return v


class _PinnedIndices:
    """Pinned int64 buffers for batches' index arrays, reused once their batch
    finished: pinning is a slow system call, so it happens only while the
    number of batches in flight grows past what was ever in flight before."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        #: pinned buffers ever allocated (tests: no growth after warm-up)
        self.allocated = 0

    def take(self, n: int) -> torch.Tensor:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.numel() >= n:
                    return self._free.pop(i)
        cap = max(1024, 1 << max(0, n - 1).bit_length())
        self.allocated += 1
        return torch.empty(cap, dtype=torch.int64, pin_memory=True)

    def give(self, bufs: Sequence[torch.Tensor]) -> None:
        with self._lock:
            self._free.extend(bufs)


# --------------------------------------------------------------------------- #
# RankStager
# --------------------------------------------------------------------------- #


class RankStager:
    """Gather/scatter between one rank's KV tensors and canonical pages in a pool.

    ``page_mappings[g]`` is this rank's mapping of group ``g`` (its
    ``local_page_bytes`` must equal the registered references' total).
    Tensors on CUDA use a dedicated stream, the pinned pool and an event per
    batch, copying as ``cuda_copy`` says (default: the measured best);
    CPU tensors copy synchronously. Both report through :meth:`poll` /
    :meth:`wait`.
    """

    def __init__(
        self,
        canonical_kv_caches: CanonicalKVCaches,
        page_mappings: Sequence[PageMapping],
        pool: HostBlockPool,
        blocks_per_file: int = 1,
        cuda_copy: CudaCopy | None = None,
    ) -> None:
        caches = canonical_kv_caches
        caches.check()
        if len(page_mappings) != len(caches.group_refs):
            raise LayoutError(
                f"RankStager: {len(page_mappings)} page mappings for {len(caches.group_refs)} registered groups"
            )
        if blocks_per_file < 1:
            raise LayoutError(f"RankStager: blocks_per_file must be >= 1, got {blocks_per_file}")
        if cuda_copy is not None and cuda_copy not in _CUDA_COPIES:
            raise ValueError(f"RankStager: cuda_copy must be one of {_CUDA_COPIES}, got {cuda_copy!r}")
        self.caches = caches
        self.mappings = list(page_mappings)
        self.pool = pool
        self.blocks_per_file = blocks_per_file
        self.stats = CopyStats()
        self._lock = threading.Lock()
        self._batches: dict[int, _Batch] = {}
        self._done: list[int] = []
        self._next_id = 0
        self._groups = group_plans(self.mappings, caches, pool.slot_bytes, blocks_per_file)
        #: blocks per group (the smallest of its tensors), checked against every spec
        self._num_blocks = [caches.num_blocks(g) for g in range(len(caches.group_refs))]
        self._host = PoolTensors.of(pool)
        self._pool_i8 = self._host.tensor.view(torch.int8).view(-1)
        devices = {t.device for t in caches.tensors}
        self.device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        if devices:
            raise LayoutError("RankStager: all registered tensors must be on one device")
        self._cuda = self.device.type == "cuda"
        #: "host" (numpy, CPU tensors), "dma" or "kernel" (module docstring)
        self.copy_mode: str = (cuda_copy or _DEFAULT_CUDA_COPY) if self._cuda else (cuda_copy or "host")
        if self._cuda and self.copy_mode == "auto" and not self._host.pinned:
            self.copy_mode = "dma"  # kernels need the mapped pool; plain copies still work
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._np_src: dict[tuple[int, str, int], np.ndarray] = {}
        self._np_dst: dict[tuple[int, str, int], np.ndarray] = {}
        self._t_src: dict[tuple[int, str, int], torch.Tensor] = {}
        self._t_dst: dict[tuple[int, str, int], torch.Tensor] = {}
        if self.copy_mode == "host":
            # The CPU path uses numpy views of the same memory: torch's CPU
            # index kernels copy byte by byte (~0.2 GB/s measured by
            # bench_staging) while numpy moves each strided block with
            # memcpy-sized inner loops.
            self._np_src, self._np_dst = host_views(
                self._groups, caches.tensors, self._pool_i8.numpy(), pool.num_slots, pool.slot_bytes, blocks_per_file
            )
            # The same views as torch tensors for big per-block copies: torch's
            # strided copy of >= 256 KiB is ~1.1-1.4x numpy's assignment here.
            self._t_src = {k: torch.from_numpy(v) for k, v in self._np_src.items()}
            self._t_dst = {k: torch.from_numpy(v) for k, v in self._np_dst.items()}
        else:
            self._setup_device_path()

    # -- device path (CUDA, or its CPU emulation) ----------------------------

    def _setup_device_path(self) -> None:
        """Staging layouts, element types and typed views, built once."""
        self._pinned = _PinnedIndices()
        self._idx_dev: torch.Tensor | None = None
        self._rt: Any = None
        if self._cuda and self.copy_mode in ("dma", "auto"):
            self._rt = cudart()
        if self.copy_mode in ("kernel", "auto"):
            self._pool_dev = self._host.device_tensor(self.device) if self._cuda else self._host.tensor.view(-1)
        self._staging: dict[tuple[int, str], Staging] = {}
        self._stage_bufs: dict[tuple[int, str], tuple[int, torch.Tensor, list[torch.Tensor]]] = {}
        self._dtype: dict[tuple[int, str], torch.dtype] = {}
        self._units: dict[tuple[int, str], list[_Unit]] = {}
        for g, gp in enumerate(self._groups):
            cpb = gp.canonical_page_bytes
            for kind, plans in (("store", gp.store), ("load", gp.load)):
                st = staging_for(plans, cpb)
                groups = unit_groups(plans, st.views, self.caches.tensors, raw_ok=self._cuda)
                quantities: list[int] = [cpb, self.pool.slot_bytes, st.page_bytes]
                for p, v in zip(plans, st.views, strict=True):
                    t = self.caches.tensors[p.tensor_idx]
                    quantities += [p.size, p.local_offset, p.rep_local, p.local_stride, p.canonical_offset]
                    quantities += [p.rep_canonical, p.canonical_stride, *v]
                    quantities += [int(t.stride(0)), int(t.storage_offset()), t.untyped_storage().data_ptr()]
                    quantities += [t.data_ptr()]
                dt = _INT_OF_BYTES[elem_bytes(*quantities)]
                self._staging[(g, kind)] = st
                self._dtype[(g, kind)] = dt
                self._units[(g, kind)] = [
                    self._make_unit([plans[i] for i in grp], [st.views[i] for i in grp], dt, cpb) for grp in groups
                ]

    def _make_unit(self, plans: list[Plan], views: list[tuple[int, int, int]], dt: torch.dtype, cpb: int) -> _Unit:
        p, m = plans[0], len(plans)
        t = self.caches.tensors[p.tensor_idx]
        addr0 = t.data_ptr() + p.local_offset
        d_addr = (self.caches.tensors[plans[1].tensor_idx].data_ptr() + plans[1].local_offset - addr0) if m > 1 else 1
        d_can = plans[1].canonical_offset - p.canonical_offset if m > 1 else 1
        d_stage = views[1][0] - views[0][0] if m > 1 else 1
        shape = (m, int(t.shape[0]), p.reps, p.num, p.size)
        strides = (d_addr, int(t.stride(0)), p.rep_local, p.local_stride, 1)
        extent = sum((n - 1) * st for n, st in zip(shape, strides, strict=True)) + 1
        if m == 1 or not self._cuda:
            # One tensor, or (CPU) one storage: an ordinary view of it.
            base = t.untyped_storage().data_ptr()
            holder = torch.empty(0, dtype=torch.int8, device=self.device).set_(t.untyped_storage())
            src = _typed(holder, dt, addr0 - base, shape, strides)
        else:
            # Layers in separate allocations at a fixed spacing: a raw view
            # spanning them (only the layers' own bytes are ever touched).
            src = _typed(device_view(addr0, extent, self.device), dt, 0, shape, strides)
        dst = None
        if self.copy_mode in ("kernel", "auto"):
            dst = _typed(
                self._pool_dev, dt, p.canonical_offset,
                (m, self.pool.num_slots, self.blocks_per_file, p.reps, p.num, p.size),
                (d_can, self.pool.slot_bytes, cpb, p.rep_canonical, p.canonical_stride, 1),
            )
        return _Unit(plans, src, (views[0][0], d_stage, views[0][1], views[0][2]), dst)

    def _device_indices(self, batch: _Batch, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Index arrays on the device: one async copy from a reused pinned buffer
        (a pageable source could make the copy wait for the stream)."""
        if not self._cuda:
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays]
        n = sum(a.size for a in arrays)
        buf = self._pinned.take(n)
        batch.pinned.append(buf)
        host = buf.numpy()
        at = 0
        for a in arrays:
            host[at : at + a.size] = a
            at += a.size
        # One device index buffer, reused like the staging buffers (stream order).
        if self._idx_dev is None or self._idx_dev.numel() < n:
            self._idx_dev = torch.empty(1 << max(0, n - 1).bit_length(), dtype=torch.int64, device=self.device)
        dev = self._idx_dev
        dev[:n].copy_(buf[:n], non_blocking=True)
        batch.keep.append(dev)
        out, at = [], 0
        for a in arrays:
            out.append(dev[at : at + a.size])
            at += a.size
        return out

    def _move(self, rows: np.ndarray, stage: torch.Tensor, out: bool) -> None:
        """Host copies (:func:`host_copies` rows) between staging and slots (copy engine on CUDA)."""
        self.stats.ops += rows.shape[0]
        if self._cuda:
            if self._stream is None or self._rt is None:
                raise RuntimeError("RankStager: CUDA stream not set up (a CUDA stager without a stream)")
            stream = self._stream.cuda_stream
            hbase, sbase = self._pool_i8.data_ptr(), stage.data_ptr()
            for h, so, w, r, hp, sp in rows.tolist():
                if out:
                    self._rt.memcpy_2d_async(hbase + h, hp, sbase + so, sp, w, r, stream)
                else:
                    self._rt.memcpy_2d_async(sbase + so, sp, hbase + h, hp, w, r, stream)
            return
        # CPU emulation of the same copies (tests): numpy strided assignment.
        pool = self._pool_i8.numpy()
        stg = stage.view(torch.int8).numpy()
        for h, so, w, r, hp, sp in rows.tolist():
            hv = np.lib.stride_tricks.as_strided(pool[h:], (r, w), (hp, 1))
            sv = np.lib.stride_tricks.as_strided(stg[so:], (r, w), (sp, 1))
            if out:
                hv[...] = sv
            else:
                sv[...] = hv

    def _stage_buffer(self, key: tuple[int, str], n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The persistent staging buffer of ``key`` for ``n`` blocks and its plan views.

        One buffer per group and direction is enough: all of a stager's work
        runs on its one stream, so a batch's staging is reused only after the
        previous batch's copies out of it (stream order). It grows to the next
        power of two; a batch still in flight keeps the old buffer alive."""
        have = self._stage_bufs.get(key)
        if have is None or have[0] < n:
            cap = 1 << max(0, n - 1).bit_length()
            st, dt = self._staging[key], self._dtype[key]
            es = torch.empty(0, dtype=dt).element_size()
            buf = torch.empty(cap * st.page_bytes // es, dtype=dt, device=self.device)
            views = []
            for u in self._units[key]:
                p = u.plans[0]
                p0, dp, a, b = u.stage
                views.append(
                    _typed(buf, dt, p0, (len(u.plans), cap, p.reps, p.num, p.size), (dp, st.page_bytes, a, b, 1))
                )
            have = self._stage_bufs[key] = (cap, buf, views)
        _, buf, views = have
        return buf, [v[:, :n] for v in views]

    def _stage_device(self, work: list[Work], batch: _Batch, out: bool) -> None:
        kind = "store" if out else "load"
        for g, ids, sidx, pidx in work:
            gp = self._groups[g]
            plans = gp.store if out else gp.load
            if not plans:
                continue
            n = len(ids)
            st = self._staging[(g, kind)]
            host_off = sidx * self.pool.slot_bytes + pidx * gp.canonical_page_bytes
            rows = host_copies(st, host_off, gp.canonical_page_bytes)
            use_kernel = self.copy_mode == "kernel" or (
                self.copy_mode == "auto"
                and (n * st.page_bytes < _DMA_MIN_BYTES_PER_COPY * rows.shape[0] or st.density < _DMA_MIN_DENSITY)
            )
            units = self._units[(g, kind)]
            if use_kernel:
                ids_d, s_d, p_d = self._device_indices(batch, [ids, sidx, pidx])
                for u in units:
                    if u.dst is None:
                        raise RuntimeError("RankStager: kernel copy unit without a mapped slot view")
                    if out:
                        u.dst[:, s_d, p_d] = u.src.index_select(1, ids_d)
                    else:
                        u.src.index_copy_(1, ids_d, u.dst[:, s_d, p_d])
                    self._count_unit(u, n)
                continue
            (ids_d,) = self._device_indices(batch, [ids])
            stage, views = self._stage_buffer((g, kind), n)
            batch.keep.append(stage)
            if not out:
                # Copies first: the engine does not wait for the scatter launches.
                self._move(rows, stage, out=False)
            for u, view in zip(units, views, strict=True):
                if out:
                    # One kernel, straight into the (strided) staging view.
                    torch.index_select(u.src, 1, ids_d, out=view)
                else:
                    u.src.index_copy_(1, ids_d, view)
                self._count_unit(u, n)
            if out:
                self._move(rows, stage, out=True)

    # -- host path (CPU tensors) ----------------------------------------------

    def _cpu_copy(
        self, key: tuple[int, str, int], p: Plan, ids: np.ndarray, sidx: np.ndarray, pidx: np.ndarray, out: bool
    ) -> None:
        src, dst = self._np_src[key], self._np_dst[key]
        if p.reps * p.num * p.size >= _PER_BLOCK_MIN_BYTES:
            # Big blocks: strided copies without a temporary (one pass). Runs of
            # consecutive block ids that land on consecutive pages of one slot
            # (blocks_per_file > 1) move as one copy: each numpy call re-takes
            # the GIL, which the I/O threads hold often (bench_pipeline, 64 KiB
            # pages x 16 per file: 0.9 GB/s staging with one copy per block).
            ni, ns, npg = ids, sidx, pidx
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
            ni, ns, npg = ids, sidx, pidx
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

    def stage_out(self, spec: LoadStoreSpec, slots: Sequence[int]) -> int:
        """Gather this rank's store runs of ``spec``'s blocks into ``slots``; returns a batch id.

        On CUDA this only queues work on the stager's stream (after the
        caller's current stream, so pending writes to the blocks are seen)."""
        work = batch_work(spec, slots, self._num_blocks, self.pool.num_slots, self.blocks_per_file, store=True)
        return self._run(work, out=True)

    def stage_in(self, slots: Sequence[int], spec: LoadStoreSpec) -> int:
        """Scatter this rank's load runs from ``slots`` into ``spec``'s blocks; returns a batch id.

        On CUDA the blocks are written when the batch completes (:meth:`poll`);
        make the engine's stream wait for that before reading them."""
        work = batch_work(spec, slots, self._num_blocks, self.pool.num_slots, self.blocks_per_file, store=False)
        return self._run(work, out=False)

    def _run(self, work: list[Work], out: bool) -> int:
        batch = self._new_batch()
        if self.copy_mode == "host":
            kind = "store" if out else "load"
            for g, ids, sidx, pidx in work:
                for i, p in enumerate(self._groups[g].store if out else self._groups[g].load):
                    self._cpu_copy((g, kind, i), p, ids, sidx, pidx, out=out)
            return self._submit(batch)
        if self._stream is None:
            self._stage_device(work, batch, out)
            return self._submit(batch)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._stage_device(work, batch, out)
        return self._submit(batch)

    def _count_unit(self, u: _Unit, n: int) -> None:
        self.stats.ops += 1
        for p in u.plans:
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
        # Nothing to copy: the batch's work finished on the device. Its buffers
        # go back (pinned index buffers to the reuse list).
        batch.keep.clear()
        if batch.pinned:
            self._pinned.give(batch.pinned)
            batch.pinned = []

    def poll(self) -> list[int]:
        """Batch ids finished since the last poll (never blocks, never copies)."""
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
