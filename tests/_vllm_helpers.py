"""Helpers for the vLLM integration tests: real vLLM configs, specs and managers.

Everything here builds vLLM's own objects (``OffloadingConfig`` ->
``OffloadingSpecFactory.create_spec`` -> ``TieringOffloadingSpec`` ->
``TieringOffloadingManager``) with FstierTier loaded by vLLM's factory from a
``secondary_tiers`` entry, exactly as ``vllm serve`` would.

Without vLLM the tests skip, unless ``FSTIER_REQUIRE_VLLM=1`` (set by
``make test``, whose venv installs it), where a missing vLLM fails them.
"""

from __future__ import annotations

import contextlib
import glob
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

if os.environ.get("FSTIER_REQUIRE_VLLM") == "1":
    import vllm.v1.kv_offload.tiering.manager  # noqa: F401  (fail loudly in CI)
else:
    pytest.importorskip("vllm.v1.kv_offload.tiering.manager", reason="vLLM not installed")

from vllm.v1.kv_offload.base import (  # noqa: E402
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

__all__ = [
    "END",
    "FSTIER_TIER",
    "Locality",
    "LookupResult",
    "Medium",
    "OffloadKey",
    "OffloadingSpecFactory",
    "ReqContext",
    "ScheduleEndContext",
    "TransferJob",
    "block_files",
    "cleanup_shm",
    "fstier_tier",
    "keys_for",
    "lookup_all",
    "make_offload_key",
    "offloading_config",
    "promote",
    "read_rows",
    "row_pattern",
    "steps",
    "store_request",
    "tiering_manager",
]

FSTIER_TIER = {"type": "FstierTier", "module_path": "fstier.integrations.vllm"}
END = ScheduleEndContext((), ())


def offloading_config(
    tiers: Sequence[dict[str, Any]],
    *,
    tp: int = 1,
    agnostic: bool = True,
    worker_kv_bytes: int = 65536,
    num_chunks: int = 32,
    events: bool = True,
    replicated: bool = False,
    engine_id: str | None = None,
    extra: dict[str, Any] | None = None,
) -> OffloadingConfig:
    """A real vLLM OffloadingConfig for a 2-layer, 1-group model at ``tp``
    (rank 0, the scheduler side). ``worker_kv_bytes`` is one worker's bytes
    per block, so the row is ``tp * worker_kv_bytes`` (one copy if replicated)."""
    copies = 1 if replicated else tp
    row = copies * worker_kv_bytes
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=worker_kv_bytes,
        enable_kv_cache_events=events,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": num_chunks * ((row + 4095) // 4096 * 4096),
            "secondary_tiers": [dict(t) for t in tiers],
            **(extra or {}),
        },
        engine_id=engine_id or f"fstiertest-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name="acme/llama-tiny", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=agnostic,
        ),
        replicated_layout=replicated,
    )


def cleanup_shm(engine_id: str) -> None:
    """Remove the /dev/shm region files vLLM left for ``engine_id``."""
    for path in glob.glob(f"/dev/shm/vllm_offload_{engine_id}.mmap*"):
        with contextlib.suppress(OSError):
            os.unlink(path)


@contextlib.contextmanager
def tiering_manager(cfg: OffloadingConfig) -> Iterator[Any]:
    """vLLM's TieringOffloadingManager for ``cfg``; shut down and its shared
    memory removed on exit."""
    spec = OffloadingSpecFactory.create_spec(cfg)
    manager = None
    try:
        manager = spec.get_manager()
        yield manager
    finally:
        try:
            if manager is not None:
                manager.shutdown()
        finally:
            cleanup_shm(cfg.engine_id)


def fstier_tier(manager: Any) -> Any:
    (tier,) = manager.secondary_tiers
    return tier


def keys_for(seed: int, n: int, group: int = 0) -> list[OffloadKey]:
    """``n`` distinct 32-byte keys (vLLM's sha256 block hashes are 32 bytes)."""
    return [make_offload_key(seed.to_bytes(4, "big") + i.to_bytes(4, "big") * 7, group) for i in range(n)]


def row_pattern(key: bytes, size: int) -> bytes:
    """Deterministic row bytes derived from ``key``."""
    unit = (key * (1 + 4096 // len(key)))[:4096]
    return (unit * (size // 4096 + 1))[:size]


def steps(manager: Any, until: Callable[[], bool] | None = None, timeout: float = 20.0) -> None:
    """Run scheduler steps (on_schedule_end under the manager lock) until
    ``until()`` or, without it, until no work is pending."""
    deadline = time.monotonic() + timeout
    while True:
        with manager.lock:
            manager.on_schedule_end(END)
            done = until() if until is not None else not manager.has_pending_work()
        if done:
            return
        if time.monotonic() > deadline:
            raise AssertionError("vLLM manager did not settle in time")
        time.sleep(0.005)


def store_request(manager: Any, req_id: str, keys: Sequence[OffloadKey]) -> dict[OffloadKey, bytes]:
    """Offload ``keys`` as a GPU->CPU store would (rows filled with a
    pattern), complete it, and step until the cascade into FstierTier ended.
    Returns the bytes written per key."""
    view = manager.primary_tier.get_kv_memoryview()
    stride = view.strides[0]
    flat = view.cast("B")
    ctx = ReqContext(req_id=req_id)
    written: dict[OffloadKey, bytes] = {}
    with manager.lock:
        manager.on_new_request(ctx)
        out = manager.prepare_store(list(keys), ctx)
        assert out is not None
        for key, cid in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            data = row_pattern(key, stride)
            flat[int(cid) * stride : (int(cid) + 1) * stride] = data
            written[key] = data
        manager.complete_store(list(keys), ctx)
    steps(manager)
    with manager.lock:
        manager.on_request_finished(ctx)
    return written


def lookup_all(manager: Any, ctx: ReqContext, keys: Sequence[OffloadKey]) -> list[LookupResult]:
    with manager.lock:
        return [manager.lookup(k, ctx) for k in keys]


def promote(
    manager: Any, ctx: ReqContext, keys: Sequence[OffloadKey], timeout: float = 20.0
) -> list[list[LookupResult]]:
    """Look ``keys`` up step after step until each settles on HIT or MISS;
    returns the history of answers (for asserting RETRY -> HIT_PENDING -> HIT)."""
    history: list[list[LookupResult]] = []
    deadline = time.monotonic() + timeout
    while True:
        res = lookup_all(manager, ctx, keys)
        history.append(res)
        if all(r in (LookupResult.HIT, LookupResult.MISS) for r in res):
            return history
        if time.monotonic() > deadline:
            raise AssertionError(f"lookups did not settle: {history[-5:]}")
        with manager.lock:
            manager.on_schedule_end(END)
        time.sleep(0.005)


def read_rows(manager: Any, ctx: ReqContext, keys: Sequence[OffloadKey]) -> list[bytes]:
    """prepare_load the keys (all HIT) and return their primary rows' bytes."""
    view = manager.primary_tier.get_kv_memoryview()
    stride = view.strides[0]
    flat = view.cast("B")
    with manager.lock:
        spec = manager.prepare_load(list(keys), ctx)
    rows = [bytes(flat[int(c) * stride : (int(c) + 1) * stride]) for c in spec.block_ids]
    with manager.lock:
        manager.complete_load(list(keys), ctx)
    return rows


def block_files(root: Any) -> list[str]:
    out = []
    for dirpath, _dirs, files in os.walk(root):
        out.extend(os.path.join(dirpath, f) for f in files if f.endswith(".bin"))
    return sorted(out)
