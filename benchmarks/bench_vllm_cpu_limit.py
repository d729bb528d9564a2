"""How much of a prefix on disk vLLM 0.33 serves, against the size of its CPU tier (issue 43, docs/vllm.md).

In vLLM 0.33's tiering manager a secondary-tier hit is served only after it is promoted into the CPU tier; when
the CPU tier cannot take a promotion, ``lookup`` answers MISS. This script measures that on vLLM's real
``TieringOffloadingManager`` with FstierTier as its secondary tier: a prefix of ``--max-blocks`` blocks is stored
once (through a CPU tier large enough to hold it), then, for each CPU tier size (in chunks of one block) and each
prefix length, a fresh manager (a restart: empty CPU tier, the files on disk) looks the prefix up the way vLLM's
scheduler does (``_maximal_prefix_lookup``: keys in order, stop at the first MISS, look again next step while any
answer is RETRY or HIT_PENDING) until it settles. The table is the blocks served (hit) per prefix length.
(How long a prefix that fits takes to be promoted is benchmarks/bench_vllm_promotion.py's.)

Usage: ``PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_vllm_cpu_limit.py [--json out.json]``. CPU only; a
few seconds per row.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests._vllm_helpers import (  # noqa: E402
    END,
    FSTIER_TIER,
    LookupResult,
    ReqContext,
    keys_for,
    offloading_config,
    store_request,
    tiering_manager,
)

TOKENS_PER_BLOCK = 16  # offloading_config's group: 16 tokens per block, one block per chunk


def served_prefix(manager: Any, keys: list[Any], timeout: float) -> tuple[int | None, int]:
    """(blocks served, scheduler steps) for ``keys`` looked up as vLLM's scheduler does; None served if the
    answers had not settled after ``timeout`` seconds (the scheduler would still be deferring the request)."""
    ctx = ReqContext(req_id=f"lookup-{time.monotonic_ns()}")
    with manager.lock:
        manager.on_new_request(ctx)
    deadline = time.monotonic() + timeout
    steps = 0
    try:
        while True:
            hits, deferred = 0, False
            with manager.lock:
                for key in keys:
                    result = manager.lookup(key, ctx)
                    if result in (LookupResult.HIT, LookupResult.HIT_PENDING):
                        hits += 1
                        deferred |= result is LookupResult.HIT_PENDING
                    elif result is LookupResult.RETRY:
                        deferred = True
                    else:  # MISS
                        break
                if not deferred:
                    return hits, steps
                manager.on_schedule_end(END)
            steps += 1
            if time.monotonic() > deadline:
                return None, steps
            time.sleep(0.005)
    finally:
        with manager.lock:
            manager.on_request_finished(ctx)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-chunks", default="16,32,64", help="CPU tier sizes, in chunks (one block each)")
    ap.add_argument("--prefixes", default="8,16,24,32,48,64,96", help="prefix lengths, in blocks")
    ap.add_argument("--worker-kv-bytes", type=int, default=65536, help="bytes of one block (tp=1)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a lookup may take to settle")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cpu_sizes = [int(x) for x in args.cpu_chunks.split(",")]
    prefixes = [int(x) for x in args.prefixes.split(",")]
    keys = keys_for(43, max(prefixes))
    rows = []
    with tempfile.TemporaryDirectory(prefix="fstier-cpu-limit-", dir="/var/tmp") as tmp:
        tier = {**FSTIER_TIER, "root_dir": str(Path(tmp) / "kv")}
        store_cfg = offloading_config([tier], worker_kv_bytes=args.worker_kv_bytes, num_chunks=len(keys) + 8)
        with tiering_manager(store_cfg) as m:
            store_request(m, "store", keys)
        for chunks in cpu_sizes:
            cfg = offloading_config([tier], worker_kv_bytes=args.worker_kv_bytes, num_chunks=chunks)
            cpu_bytes = cfg.extra_config["cpu_bytes_to_use"]
            for n in prefixes:
                with tiering_manager(
                    offloading_config([tier], worker_kv_bytes=args.worker_kv_bytes, num_chunks=chunks)
                ) as m:
                    t0 = time.monotonic()
                    hits, steps = served_prefix(m, keys[:n], args.timeout)
                    seconds = round(time.monotonic() - t0, 2)
                rows.append({"cpu_chunks": chunks, "cpu_bytes_to_use": cpu_bytes, "prefix_blocks": n,
                             "prefix_tokens": n * TOKENS_PER_BLOCK, "hit_blocks": hits,
                             "hit_tokens": None if hits is None else hits * TOKENS_PER_BLOCK, "steps": steps,
                             "seconds": seconds})
                served = "not settled" if hits is None else f"{hits:>3} served ({hits * TOKENS_PER_BLOCK} tokens)"
                print(f"cpu {chunks:>3} chunks ({cpu_bytes // 1024} KiB): prefix {n:>3} blocks "
                      f"({n * TOKENS_PER_BLOCK} tokens) -> {served}, {steps} steps, {seconds} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
