"""Helpers shared by the FsTier tests: a tiny model config, a pool, keys, payloads."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from conftest import make_config

from fstier.clock import SYSTEM_CLOCK, Clock
from fstier.config import FstierConfig
from fstier.keys import BlockKey
from fstier.manager import FsTier
from fstier.slots.host_pool import HostBlockPool

# One group, 1 layer x 1 head x 4 tokens x 8 fp16 x (K,V) = 128-byte pages:
# files are 8 KiB (header + one padded page), so tests stay fast.
TINY_GROUP = {"kind": "full_attention", "block_size": 4, "num_layers": 1, "num_kv_heads": 1, "head_size": 8}
FILE_BYTES = 8192


def tiny_config(root: Path, **tier: Any) -> FstierConfig:
    tier.setdefault("read_threads", 2)
    tier.setdefault("write_threads", 2)
    return make_config(root, groups=[dict(TINY_GROUP)], tier=tier)


def key(i: int, group: int = 0) -> BlockKey:
    return BlockKey(i.to_bytes(4, "big") * 4, group)


def keys(start: int, n: int) -> list[BlockKey]:
    return [key(i) for i in range(start, start + n)]


def payload_for(k: BlockKey, n: int) -> bytes:
    """Deterministic, key-specific payload bytes."""
    seed = k.block_hash[:4] * ((n + 3) // 4)
    return bytes(b ^ 0x5A for b in seed[:n])


def fill(tier: FsTier, ks: list[BlockKey], slots: list[int]) -> None:
    for k, s in zip(ks, slots, strict=True):
        n = tier.payload_bytes(k)
        tier.pool.slot_view(s)[:n] = payload_for(k, n)


def slot_bytes(tier: FsTier, k: BlockKey, s: int) -> bytes:
    return bytes(tier.pool.slot_view(s)[: tier.payload_bytes(k)])


def store(tier: FsTier, job: object, ks: list[BlockKey], slots: list[int] | None = None):
    slots = list(range(len(ks))) if slots is None else slots
    fill(tier, ks, slots)
    tier.submit_store(job, ks, slots)
    tier.drain()
    (res,) = [r for r in tier.get_finished() if r.job_id == job]
    return res


def load(tier: FsTier, job: object, ks: list[BlockKey], first_slot: int = 0):
    slots = list(range(first_slot, first_slot + len(ks)))
    for s in slots:  # poison: a reported-loaded slot must hold the real bytes
        tier.pool.slot_view(s)[:] = b"\xee" * tier.pool.slot_bytes
    tier.submit_load(job, ks, slots)
    tier.drain()
    (res,) = [r for r in tier.get_finished() if r.job_id == job]
    for k, s in zip(ks[: res.keys_completed], slots, strict=False):
        assert slot_bytes(tier, k, s) == payload_for(k, tier.payload_bytes(k))
    return res


@contextmanager
def open_tier(root: Path, num_slots: int = 64, clock: Clock = SYSTEM_CLOCK, **tier_kw: Any) -> Iterator[FsTier]:
    cfg = tiny_config(root, **tier_kw)
    pool = HostBlockPool(num_slots, FILE_BYTES)
    # These tests name slots by index; FsTier refuses slots the caller does
    # not hold, so the test holds them all (alloc returns 0, 1, 2, ...).
    pool.alloc(num_slots)
    tier = FsTier(cfg, pool, clock=clock)
    try:
        yield tier
    finally:
        tier.close()
        pool.close()


def temp_files(root: Path) -> list[str]:
    out = []
    for dirpath, _dirs, files in os.walk(root):
        out += [os.path.join(dirpath, f) for f in files if ".tmp." in f]
    return out


def fstier_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("fstier")]


def valid_namespace(root: Path, model: str = "m") -> Path:
    """``root/<model>-<digest>`` with a valid manifest (made by hand, as a
    real FileMapper would write it), created once."""
    import hashlib
    import json

    from fstier.file_mapper import NAMESPACE_VERSION, canonical_json

    fields = {"model": model, "namespace_version": NAMESPACE_VERSION}
    digest = hashlib.sha256(canonical_json(fields)).hexdigest()[:16]
    d = root / f"{model}-{digest}"
    if not (d / "config.json").exists():
        d.mkdir(parents=True, exist_ok=True)
        manifest = {
            "fstier_manifest": NAMESPACE_VERSION,
            "namespace": d.name,
            "digest": digest,
            "parallel_agnostic": True,
            "fields": fields,
        }
        (d / "config.json").write_text(json.dumps(manifest))
    return d
