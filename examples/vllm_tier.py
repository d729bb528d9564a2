"""fstier inside vLLM, on a CPU-only machine: store -> restart -> promotion -> hit.

This runs vLLM's own offloading stack, exactly as ``vllm serve`` builds it
from ``--kv-transfer-config``: ``OffloadingSpecFactory.create_spec`` with
``TieringOffloadingSpec`` (a CPU primary tier in shared memory) and one
secondary tier, ``FstierTier``, loaded by vLLM's factory from its module
path. The GPU side of the connector needs CUDA, so this script plays the
scheduler's part: it fills primary rows as a GPU->CPU store would, steps
the scheduler, and reads rows back the way a CPU->GPU load would.

    python examples/vllm_tier.py [--root DIR] [--chunks 8] [--tp 2]

1. **store**: a request's chunks land in the CPU tier; ``complete_store``
   cascades them to FstierTier, which writes one verified file per chunk.
2. **restart**: the manager (and its shared memory) is shut down and a new
   one created, as after a vLLM restart: the CPU tier is empty.
3. **promotion**: the first lookups answer RETRY while fstier checks the
   files on a background thread; then HIT_PENDING while the rows load.
4. **hit**: HIT, and ``prepare_load`` gives rows holding the stored bytes.

Needs vLLM 0.33.x importable (``make install-vllm``; see docs/vllm.md).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import logging
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _quiet_vllm() -> None:
    # vLLM logs its start-up at INFO; keep this demo's output readable.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.getLogger("vllm").setLevel(logging.WARNING)


def offloading_config(root: Path, tp: int, chunks: int, engine_id: str) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    worker_kv_bytes = 128 * 1024 // tp  # one 128 KiB row per chunk at any tp
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer.0", "layer.1"), group_id=0),),
        worker_kv_bytes_per_block=worker_kv_bytes,
        enable_kv_cache_events=True,
        # What --kv-transfer-config's kv_connector_extra_config carries:
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 2 * chunks * 128 * 1024,
            "secondary_tiers": [
                {
                    "type": "FstierTier",
                    "module_path": "fstier.integrations.vllm",
                    "root_dir": str(root),
                    "max_bytes": "1GiB",
                }
            ],
        },
        engine_id=engine_id,
        model=OffloadingModelConfig(name="acme/llama-demo", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


@contextlib.contextmanager
def vllm_manager(root: Path, tp: int, chunks: int) -> Iterator[Any]:
    """vLLM's TieringOffloadingManager; shut down and its /dev/shm region removed."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    engine_id = f"fstier-example-{uuid.uuid4().hex[:10]}"
    manager = OffloadingSpecFactory.create_spec(offloading_config(root, tp, chunks, engine_id)).get_manager()
    try:
        yield manager
    finally:
        manager.shutdown()
        for path in glob.glob(f"/dev/shm/vllm_offload_{engine_id}.mmap*"):
            with contextlib.suppress(OSError):
                os.unlink(path)


def row_bytes(key: bytes, size: int) -> bytes:
    unit = (key * (4096 // len(key) + 1))[:4096]
    return (unit * (size // 4096 + 1))[:size]


def step(manager: Any) -> None:
    from vllm.v1.kv_offload.base import ScheduleEndContext

    with manager.lock:
        manager.on_schedule_end(ScheduleEndContext((), ()))


def run(root: Path, chunks: int, tp: int) -> int:
    _quiet_vllm()
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

    keys = [make_offload_key(i.to_bytes(4, "big") * 8, 0) for i in range(chunks)]

    print(f"1. store: {chunks} chunks of a request, tp={tp}, root {root}")
    with vllm_manager(root, tp, chunks) as m:
        tier = m.secondary_tiers[0]
        view = m.primary_tier.get_kv_memoryview()
        stride, flat = view.strides[0], view.cast("B")
        ctx = ReqContext(req_id="first-request")
        with m.lock:
            m.on_new_request(ctx)
            out = m.prepare_store(keys, ctx)
            for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                flat[int(chunk) * stride : (int(chunk) + 1) * stride] = row_bytes(key, stride)
            m.complete_store(keys, ctx)  # cascades into FstierTier
        flat.release()  # so vLLM can unmap its shared memory at shutdown
        while True:
            step(m)
            with m.lock:
                if not m.has_pending_work():
                    break
            time.sleep(0.005)
        with m.lock:
            m.on_request_finished(ctx)
        events = [e for e in m.take_events() if e.medium.name == "STORAGE"]
        # What this run wrote, from the tier's own counters: a root used
        # before may already hold some of these files (those are skipped).
        metrics = tier.fstier.metrics
        wrote, present = int(metrics.stored_blocks.value), int(metrics.skipped_blocks.value)
        already = f", {present} already on disk (skipped)" if present else ""
        print(f"   FstierTier wrote {wrote} files under {tier.mapper.namespace} "
              f"({metrics.stored_bytes.value / 1e6:.1f} MB){already}, "
              f"{sum(len(e.keys) for e in events)} keys in STORAGE events")

    print("2. restart: a new vLLM manager, empty CPU tier, same root_dir")
    with vllm_manager(root, tp, chunks) as m:
        ctx = ReqContext(req_id="after-restart")
        with m.lock:
            m.on_new_request(ctx)
        seen: list[str] = []
        deadline = time.monotonic() + 30
        while True:
            with m.lock:
                answers = [m.lookup(k, ctx) for k in keys]
            summary = ", ".join(f"{n} {r.name}" for r, n in Counter(answers).items())
            if not seen or seen[-1] != summary:
                seen.append(summary)
                print(f"3. promotion: lookup -> {summary}")
            if all(a is LookupResult.HIT for a in answers) or time.monotonic() > deadline:
                break
            step(m)
            time.sleep(0.005)
        if not all(a is LookupResult.HIT for a in answers):
            print("FAILED: not every chunk became a HIT", file=sys.stderr)
            return 1
        view = m.primary_tier.get_kv_memoryview()
        stride, flat = view.strides[0], view.cast("B")
        with m.lock:
            spec = m.prepare_load(keys, ctx)
        same = all(
            bytes(flat[int(c) * stride : (int(c) + 1) * stride]) == row_bytes(k, stride)
            for k, c in zip(keys, spec.block_ids, strict=True)
        )
        flat.release()
        with m.lock:
            m.complete_load(keys, ctx)
            m.on_request_finished(ctx)
        print(f"4. hit: {len(keys)} of {len(keys)} chunks HIT; rows "
              f"{'match the stored bytes' if same else 'DIFFER'}")
        return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, help="root_dir for block files (default: a temporary one)")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2, choices=(1, 2, 4, 8))
    args = parser.parse_args(argv)
    from fstier.integrations.vllm import VllmUnavailableError, check_vllm

    try:
        check_vllm()
    except VllmUnavailableError as exc:
        print(f"examples/vllm_tier.py: {exc}", file=sys.stderr)
        return 2
    if args.root is not None:
        return run(args.root, args.chunks, args.tp)
    with tempfile.TemporaryDirectory(prefix="fstier-vllm-") as tmp:
        return run(Path(tmp), args.chunks, args.tp)


if __name__ == "__main__":
    sys.exit(main())
