"""Fences under many timeouts, on both I/O paths: every slot a timed-out op
fenced is released once its late call returned, however the late returns
interleave with the reaping of the job (one fence record per batch)."""

from __future__ import annotations

import pytest
from manager_support import FILE_BYTES, fill, keys, tiny_config

from fstier.manager import FsTier
from fstier.slots.host_pool import HostBlockPool


@pytest.mark.parametrize("native_io", ["auto", "off"])
def test_hundreds_of_timeouts_leave_no_slot_fenced(tmp_path, native_io: str) -> None:
    """30+ rounds of "store 32 keys, load them back into fresh slots" with a
    0.5 ms deadline: every op times out and every late call returns; once
    they all did, 0 slots are fenced, here and at the pool (on the native
    path 189 of 1,024 stayed fenced for good: a late return between the
    fencing of two keys of one batch released the first and left the
    others fenced)."""
    nslots = 1024
    cfg = tiny_config(tmp_path / "root", io_timeout_s=0.0005, read_threads=2, write_threads=2,
                      native_io=native_io, breaker_failures=1_000_000)
    pool = HostBlockPool(nslots, FILE_BYTES)
    pool.alloc(nslots)
    tier = FsTier(cfg, pool)
    timed_out = 0
    try:
        for r in range(40):
            ks = keys(r * 32, 32)
            base = (r * 64) % nslots
            store_slots = list(range(base, base + 32))
            load_slots = list(range(base + 32, base + 64))
            fill(tier, ks, store_slots)
            tier.submit_store(("s", r), ks, store_slots)
            tier.submit_load(("l", r), ks, load_slots)
            assert tier.drain(30)
            for res in tier.get_finished():
                timed_out += res.cause == "timeout"
        assert timed_out >= 20, f"only {timed_out} jobs timed out: the test did not test timeouts"
        assert tier.wait_fences_released(20), f"{len(tier.fenced_slots)} slots still fenced"
        assert tier.fenced_slots == frozenset()
        assert pool.fenced == frozenset()
        # The exported gauge went up with the fences and is back at 0.
        assert tier.metrics.fenced_slots.changes >= 2 and tier.metrics.snapshot()["fstier_fenced_slots"] == 0
    finally:
        tier.close()
        pool.close()
