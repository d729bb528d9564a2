"""A hypothesis state machine: FsTier against a plain model (a set of present
keys and a set of corrupted ones) across store, load, lookup, eviction,
corrupting a file, and restart (a new FsTier on the same root)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from manager_support import FILE_BYTES, fill, key, payload_for, slot_bytes, temp_files, tiny_config

from fstier.keys import BlockKey
from fstier.manager import BlockRemoved, BlockStored, FsTier
from fstier.slots.host_pool import HostBlockPool

KEYS = [key(i) for i in range(10)]
key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=5, unique=True)


class FsTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="fstier-sm-"))
        self.pool = HostBlockPool(16, FILE_BYTES)
        self.pool.alloc(16)  # slots are named by index below; hold them all
        self.cfg = tiny_config(self.root, lookup_cache_ttl_s=30.0)
        self.tier = FsTier(self.cfg, self.pool)
        self.present: set[BlockKey] = set()
        self.corrupt: set[BlockKey] = set()
        self.jobs = 0
        self.clock = time.time() - 10_000  # explicit, strictly increasing recency

    def _job(self) -> int:
        self.jobs += 1
        return self.jobs

    def _age(self, ks: list[BlockKey]) -> None:
        # mtimes tick at the kernel's coarse clock; give each step its own time
        # so the LRU order the model predicts is well defined. The tier's own
        # recency writes (batched, on the write queue, flushed on a timer) land
        # first: one landing later would stamp "now" on several files at once,
        # and the files an eviction then picks among equal mtimes would make
        # the model, and so hypothesis's draws, depend on timing.
        self.tier.flush_recency()
        self.tier.drain()
        for k in ks:
            self.clock += 1
            p = self.tier.mapper.path_for(k)
            if p.exists():
                os.utime(p, (self.clock, self.clock))

    @rule(ks=key_lists)
    def store(self, ks: list[BlockKey]) -> None:
        job = self._job()
        slots = list(range(len(ks)))
        fill(self.tier, ks, slots)
        self.tier.submit_store(job, ks, slots)
        self.tier.drain()
        (res,) = self.tier.get_finished()
        new = [k for k in ks if k not in self.present]
        assert res.success and res.keys_completed == len(ks)
        assert res.skipped == len(ks) - len(new)
        stored = [k for e in self.tier.take_events() if isinstance(e, BlockStored) for k in e.keys]
        assert sorted(stored, key=lambda k: k.hex) == sorted(new, key=lambda k: k.hex)
        self.present.update(ks)
        self._age(ks)

    @rule(ks=key_lists)
    def load(self, ks: list[BlockKey]) -> None:
        job = self._job()
        slots = list(range(len(ks)))
        for s in slots:
            self.pool.slot_view(s)[:] = b"\xee" * self.pool.slot_bytes
        self.tier.submit_load(job, ks, slots)
        self.tier.drain()
        (res,) = self.tier.get_finished()
        expect = 0
        for k in ks:
            if k not in self.present or k in self.corrupt:
                break
            expect += 1
        assert res.keys_completed == expect and res.keys_failed == len(ks) - expect
        assert res.success == (expect == len(ks))
        for k, s in zip(ks[:expect], slots, strict=False):
            assert slot_bytes(self.tier, k, s) == payload_for(k, self.tier.payload_bytes(k))
        # Every op of the job ran: corrupt files among them were proven bad and removed.
        hit_corrupt = {k for k in ks if k in self.corrupt}
        removed = {k for e in self.tier.take_events() if isinstance(e, BlockRemoved) for k in e.keys}
        assert removed == hit_corrupt
        self.present -= hit_corrupt
        self.corrupt -= hit_corrupt
        self._age([k for k in ks if k in self.present])

    @rule(ks=key_lists)
    def lookup(self, ks: list[BlockKey]) -> None:
        expect = 0
        for k in ks:
            if k not in self.present:
                break
            expect += 1
        assert self.tier.lookup(ks) == expect

    @precondition(lambda self: self.present - self.corrupt)
    @rule(data=st.data())
    def corrupt_a_file(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(sorted(self.present - self.corrupt, key=lambda k: k.hex)))
        path = self.tier.mapper.path_for(k)
        raw = bytearray(path.read_bytes())
        raw[4096 + data.draw(st.integers(0, 127))] ^= 0x01
        path.write_bytes(bytes(raw))
        self._age([k])  # the rewrite stamped "now"; keep every mtime distinct
        self.corrupt.add(k)

    @precondition(lambda self: len(self.present) >= 2)
    @rule(keep=st.integers(0, 4))
    def evict(self, keep: int) -> None:
        # max_bytes such that the low watermark keeps `keep` files
        low = self.cfg.tier.low_watermark
        max_bytes = int((keep * FILE_BYTES + FILE_BYTES // 2) / low)
        self.tier.flush_recency()  # recency of recent hits, as the pass will see it
        mtime = {k: self.tier.mapper.path_for(k).stat().st_mtime_ns for k in self.present}
        rep = self.tier.run_capacity_pass(max_bytes=max_bytes)
        removed = [k for e in self.tier.take_events() if isinstance(e, BlockRemoved) for k in e.keys]
        if len(self.present) * FILE_BYTES > max_bytes * self.cfg.tier.high_watermark:
            # LRU: the oldest go first. Files with equal mtimes (coarse
            # timestamps, one recency flush) may go in either order.
            kept = self.present - set(removed)
            assert len(removed) == len(self.present) - keep and len(kept) == keep
            assert not kept or max(mtime[k] for k in removed) <= min(mtime[k] for k in kept)
            assert rep.final_bytes <= max_bytes * low
        else:
            assert removed == []
        self.present -= set(removed)
        self.corrupt -= set(removed)

    @rule()
    def restart(self) -> None:
        self.tier.close()
        self.tier = FsTier(self.cfg, self.pool)

    @invariant()
    def files_match_model(self) -> None:
        on_disk = {k for k in KEYS if self.tier.mapper.path_for(k).exists()}
        assert on_disk == self.present
        assert temp_files(self.root) == []

    def teardown(self) -> None:
        self.tier.close()
        self.pool.close()
        shutil.rmtree(self.root, ignore_errors=True)


FsTierMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFsTierStateMachine = FsTierMachine.TestCase
