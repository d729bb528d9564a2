"""One LMCache StorageManager in its own process, driven from the tests:
``store`` writes chunks of seeded random bytes through the L2 adapters
(then waits until every L2 store finished), ``load`` prefetches the same
keys from L2 and prints, per key, whether it was served and the SHA-256 of
the bytes served. Prints one JSON line; exit 0 unless the run itself broke.

    python sm_worker.py store|load --adapter JSON [--adapter JSON] --seeds 1,2 --chunks N

Each seed is one request of ``--chunks`` chunks (its own keys and bytes);
``load`` prefetches each seed's keys as a separate request, under
``--shape`` or the seed's ``--load-shape SEED=SHAPE``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

os.environ.setdefault("DO_NOT_TRACK", "1")

import torch  # noqa: E402
from lmcache.v1.distributed.api import (  # noqa: E402
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import parse_args  # noqa: E402
from lmcache.v1.distributed.storage_manager import StorageManager  # noqa: E402


def keys_of(args: argparse.Namespace, seed: int) -> list[ObjectKey]:
    kv_rank = ObjectKey.ComputeKVRank(args.world_size, args.rank, args.world_size, args.rank)
    out = []
    for i in range(args.chunks):
        h = hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=32).digest()
        out.append(ObjectKey(h, args.model, kv_rank, 0, args.salt))
    return out


def payload(args: argparse.Namespace, seed: int, i: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100003 + i)
    return torch.randn(shape, generator=g).to(getattr(torch, args.dtype))


def layout_of(args: argparse.Namespace, shape_text: str) -> tuple[tuple[int, ...], MemoryLayoutDesc]:
    shape = tuple(int(x) for x in shape_text.split(","))
    return shape, MemoryLayoutDesc([torch.Size(shape)], [getattr(torch, args.dtype)])


def digest(obj: object) -> str:
    return hashlib.sha256(obj.tensor.view(torch.uint8).numpy().tobytes()).hexdigest()  # type: ignore[attr-defined]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["store", "load"])
    p.add_argument("--adapter", action="append", required=True)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--seeds", default="1")
    p.add_argument("--shape", default="2,4,256,64")
    p.add_argument("--load-shape", action="append", default=[])
    p.add_argument("--dtype", default="float16")
    p.add_argument("--model", default="test/model")
    p.add_argument("--salt", default="")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    load_shapes = dict(x.split("=", 1) for x in args.load_shape)
    argv = ["--l1-size-gb", "0.25", "--no-l1-use-lazy", "--eviction-policy", "LRU"]
    for a in args.adapter:
        argv += ["--l2-adapter", a]
    sm = StorageManager(parse_args(argv))
    out: dict[str, object] = {"mode": args.mode}
    try:
        if args.mode == "store":
            counts = _count_finalized(sm)
            shape, layout = layout_of(args, args.shape)
            all_keys: list[ObjectKey] = []
            for seed in seeds:
                keys = keys_of(args, seed)
                objs = sm.reserve_write(keys, layout)
                assert len(objs) == len(keys), f"reserved {len(objs)} of {len(keys)}"
                for i, k in enumerate(keys):
                    objs[k].tensor.copy_(payload(args, seed, i, shape))
                out[str(seed)] = [digest(objs[k]) for k in keys]
                sm.finish_write(keys)
                all_keys += keys
            deadline = time.monotonic() + args.timeout
            out["done"] = _wait_stored(counts, len(all_keys), len(args.adapter), deadline)
            out["counts"] = {str(k): v for k, v in counts.items()}
        else:
            for seed in seeds:
                keys = keys_of(args, seed)
                _shape, layout = layout_of(args, load_shapes.get(str(seed), args.shape))
                spec = PrefetchTaskSpec([GroupedObjectKeys(keys, 0, layout)])
                handle = sm.submit_prefetch_task(spec)
                assert sm.wait_prefetch_status(handle, args.timeout), "prefetch timed out"
                res = sm.query_prefetch_status(handle)
                hits = set(res.hit_cells[0].get_indices_list())
                served = [k for i, k in enumerate(keys) if i in hits]
                digests: list[str | None] = [None] * len(keys)
                if served:
                    with sm.read_prefetched_results(served, res.l1_owners) as objs:
                        assert objs is not None
                        for k, o in zip(served, objs, strict=True):
                            digests[keys.index(k)] = digest(o)
                    sm.finish_read_prefetched(served, 1, res.l1_owners)
                out[str(seed)] = digests
                out[f"{seed}.l2_hits"] = res.l2_hit_count
    finally:
        sm.close()
    print("RESULT " + json.dumps(out), flush=True)
    return 0


def _count_finalized(sm: StorageManager) -> dict[int, list[int]]:
    """Per L2 adapter index, [keys stored, keys failed], counted as LMCache's
    store controller finalizes each task (the test reads LMCache's own
    progress; its event bus is off by default)."""
    sc = sm._store_controller
    counts: dict[int, list[int]] = {}
    orig = sc._finalize_store

    def finalize(task_key, task):  # type: ignore[no-untyped-def]
        c = counts.setdefault(task_key[0], [0, 0])
        c[0 if task.l2_store_result else 1] += len(task.keys)
        return orig(task_key, task)

    sc._finalize_store = finalize
    return counts


def _wait_stored(counts: dict[int, list[int]], n: int, adapters: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if len(counts) == adapters and all(sum(c) >= n for c in counts.values()):
            return True
        time.sleep(0.02)
    return False


if __name__ == "__main__":
    sys.exit(main())
