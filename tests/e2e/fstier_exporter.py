"""FsTier used directly, exporting its metrics the way an SGLang or LMCache
deployment would (``FsTier.metrics.start_prometheus_exporter``), for the
Prometheus end-to-end test (tests/e2e/test_vllm_engine.py).

Usage: python tests/e2e/fstier_exporter.py ROOT PORT FULL_ROOT FULL_PORT GO_FILE STOP_FILE

- a tier on ROOT (max_bytes 1 MiB) exporting on PORT stores, looks up and
  loads 8 blocks every half second; once GO_FILE exists (the test creates
  it when Prometheus scrapes both ports: an alert fires on an increase),
  one stored file gets a flipped payload byte, so its load proves it
  corrupt;
- a tier on FULL_ROOT (a filesystem with no room: the test mounts a small
  tmpfs) exporting on FULL_PORT, once GO_FILE exists, stores 32 blocks,
  more than the filesystem holds: the last ones fail with ENOSPC.

Prints ``ready`` once both have run two rounds, then runs until STOP_FILE
exists. Every block loaded is checked against what was stored.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from fstier.config import parse_config
from fstier.keys import BlockKey
from fstier.manager import FsTier
from fstier.slots.host_pool import HostBlockPool

GROUP = {"kind": "full_attention", "block_size": 4, "num_layers": 1, "num_kv_heads": 1, "head_size": 8}
FILE_BYTES = 8192
N = 8


def open_tier(root: Path, max_bytes: int | None) -> FsTier:
    cfg = parse_config({
        "tier": {"root_dir": str(root), "max_bytes": max_bytes, "read_threads": 2, "write_threads": 2},
        "model": {"name": "acme/exporter", "dtype": "float16", "groups": [GROUP]},
        "parallel": {},
    })
    pool = HostBlockPool(4 * N, FILE_BYTES)
    pool.alloc(4 * N)
    return FsTier(cfg, pool)


def payload(k: BlockKey, n: int) -> bytes:
    return (k.block_hash * (n // len(k.block_hash) + 1))[:n]


def store(tier: FsTier, job: object, ks: list[BlockKey]) -> None:
    for i, k in enumerate(ks):
        n = tier.payload_bytes(k)
        tier.pool.slot_view(i)[:n] = payload(k, n)
    tier.submit_store(job, ks, list(range(len(ks))))
    tier.drain()
    tier.get_finished()


def load(tier: FsTier, job: object, ks: list[BlockKey]) -> None:
    slots = list(range(N, N + len(ks)))
    tier.submit_load(job, ks, slots)
    tier.drain()
    for res in tier.get_finished():
        for k, s in zip(ks[: res.keys_completed], slots, strict=False):
            n = tier.payload_bytes(k)
            if bytes(tier.pool.slot_view(s)[:n]) != payload(k, n):
                raise SystemExit(f"wrong bytes reported loaded for {k}")


def main() -> None:
    root, port, full_root, full_port, go, stop = sys.argv[1:7]
    tier = open_tier(Path(root), 1 << 20)
    full = open_tier(Path(full_root), None)
    tier.metrics.start_prometheus_exporter(int(port), addr="127.0.0.1")
    full.metrics.start_prometheus_exporter(int(full_port), addr="127.0.0.1")
    ks = [BlockKey(i.to_bytes(4, "big") * 4, 0) for i in range(N)]
    rounds = faulty = 0
    try:
        while rounds < 2 or not Path(stop).exists():
            store(tier, ("s", rounds), ks)
            if faulty == 0 and Path(go).exists():  # one flipped payload byte: the next load proves it bad
                victim = Path(tier.mapper.path_for(ks[3]))
                data = bytearray(victim.read_bytes())
                data[4096 + 10] ^= 0xFF  # in the payload, after the 4 KiB header
                victim.write_bytes(bytes(data))
            tier.lookup(ks)
            load(tier, ("l", rounds), ks)
            if Path(go).exists() and faulty < 4:  # the filesystem is full after a few files
                more = [BlockKey((1000 + faulty * N + i).to_bytes(4, "big") * 4, 0) for i in range(N)]
                store(full, ("f", faulty), more)
                faulty += 1
            if rounds == 1:
                print("ready", flush=True)
            rounds += 1
            time.sleep(0.5)
    finally:
        tier.close()
        full.close()
    snap, fsnap = tier.metrics.snapshot(), full.metrics.snapshot()
    print(f"corrupt {snap['fstier_corrupt_blocks_total']} enospc {fsnap['fstier_failures_total']}", flush=True)


if __name__ == "__main__":
    main()
