"""A shared filesystem that runs out of space under fstier: a full pool
(ENOSPC) and a directory quota (EDQUOT), on the filesystems whose env entry
names a pool with a quota (CephFS: ``ceph osd pool set-quota`` on a data
pool; a test directory is pointed at it with ``ceph.dir.layout.pool``).

CephFS reports a full pool late: until the monitors flag it (4-19 s here), a
buffered write succeeds and only ``fsync`` fails (``close`` returns 0), and a
write + close that returned 0 has left a file with a hole of zeros. So:

- A store whose write or fsync failed is never published or counted: the
  blocks a scan finds are exactly those the tier's ``BlockStored`` events
  name and its ``stored_blocks`` counter counts, and no temp file is left.
- Every acknowledged store loads byte-exact (through the writing host: on
  the other host the first lookup of each such file waits seconds on the
  MDS for the writer's caps, after the quota is lifted too), on the
  O_DIRECT path (synchronous writes: the error comes back from ``write``)
  and on the buffered path, ``fsync: file`` or ``none``: under a root on
  ceph-fuse (a FUSE filesystem, which may report a write's error late) a
  buffered store is fsynced before it is acknowledged whatever ``fsync``
  says (with ``none`` 1-71 acknowledged stores per run were dropped before:
  misses, never wrong bytes).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import make_config
from manager_support import payload_for, temp_files

from fstier.keys import BlockKey
from fstier.manager import BlockStored, FsTier
from fstier.slots.host_pool import HostBlockPool
from fstier.tier.gc import scan_usage

from .conftest import FIGURES, SharedFs

#: only on filesystems whose env entry names a pool with a quota
SFS_REQUIRES = ("full_pool", "full_pool_quota")
#: 64 KiB pages: 68 KiB files
GROUP = {"kind": "full_attention", "block_size": 16, "num_layers": 2, "num_kv_heads": 8, "head_size": 64}
PAGE = 16 * 2 * 8 * 64 * 2 * 2
FILE = PAGE + 4096
JOB_KEYS = 8
SLOTS = 64
FILL_LIMIT_S = 40.0
#: how a store meets a full pool: an error, or a write that blocks (an op the
#: full pool paused) until the I/O deadline fails it
FULL_CAUSES = ("ENOSPC", "EDQUOT", "timeout", "degraded")


def _key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(8, "big") * 2, 0)


def _pool_dir(sfs: SharedFs, name: str) -> Path:
    """A directory of the test's on host a whose new files go to the quota pool."""
    d = sfs.a / name
    d.mkdir()
    os.setxattr(d, "ceph.dir.layout.pool", sfs.info["full_pool"].encode())
    return d


def _syncfs(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), f"syncfs {path}")
    finally:
        os.close(fd)


class _Filler:
    """A tier on ``root`` storing new keys, JOB_KEYS per job, until its
    stores have failed for a full pool (:data:`FULL_CAUSES`) three jobs
    running. ``release`` runs then (it lifts the quota, so that writes the
    full pool blocked end) before the tier drains."""

    def __init__(self, root: Path, **tier: Any) -> None:
        self.cfg = make_config(
            root, groups=[dict(GROUP)], tier={"write_threads": 2, "read_threads": 2, "max_bytes": 1 << 30, **tier}
        )
        self.pool = HostBlockPool(SLOTS, PAGE)
        self.free = self.pool.alloc(SLOTS)
        self.tier = FsTier(self.cfg, self.pool)
        self.acked: list[BlockKey] = []
        self.causes: dict[str, int] = {}
        self.first_full_s: float | None = None

    def fill(self, release: Callable[[], None] = lambda: None) -> None:
        t0 = time.monotonic()
        n = 0
        full_jobs = 0
        inflight: dict[int, tuple[list[BlockKey], list[int]]] = {}
        while time.monotonic() - t0 < FILL_LIMIT_S and full_jobs < 3:
            if len(self.free) >= JOB_KEYS and len(inflight) < 4:
                slots = [self.free.pop() for _ in range(JOB_KEYS)]
                ks = [_key(n + i) for i in range(JOB_KEYS)]
                n += JOB_KEYS
                for k, s in zip(ks, slots, strict=True):
                    self.pool.slot_view(s)[:PAGE] = payload_for(k, PAGE)
                self.tier.submit_store(n, ks, slots)
                inflight[n] = (ks, slots)
            self._events()
            for r in self.tier.get_finished():
                ks, slots = inflight.pop(r.job_id)
                self.free.extend(slots)
                if r.cause is not None:
                    self.causes[r.cause] = self.causes.get(r.cause, 0) + r.keys_failed
                if r.cause in FULL_CAUSES:
                    full_jobs += 1
                    if self.first_full_s is None:
                        self.first_full_s = time.monotonic() - t0
                elif r.success:
                    full_jobs = 0
            time.sleep(0.005)
        release()
        self.tier.drain(60)
        # After a full pool the writing client can keep dirty state (caps)
        # that it flushes only on a sync; until then the other host's lookup
        # of such a file waits on the MDS (seen: minutes).
        _syncfs(self.cfg.tier.root_dir)
        self.tier.get_finished()
        self._events()

    def _events(self) -> None:
        # Exactly the keys this tier wrote (a failed job's later keys may
        # have been written: BlockStored names them).
        for e in self.tier.take_events():
            if isinstance(e, BlockStored):
                self.acked.extend(e.keys)

    def close(self) -> None:
        self.tier.close()
        self.pool.close()


def _load_each(root: Path, ks: list[BlockKey]) -> tuple[int, int, int]:
    """Load every key, one job each, through a new tier on ``root``:
    (byte-exact, misses, wrong bytes)."""
    cfg = make_config(root, groups=[dict(GROUP)], tier={"read_threads": 2, "write_threads": 1})
    pool = HostBlockPool(SLOTS, PAGE)
    slots = pool.alloc(SLOTS)
    tier = FsTier(cfg, pool)
    ok = miss = wrong = 0
    try:
        for i in range(0, len(ks), SLOTS):
            batch = ks[i : i + SLOTS]
            for j, k in enumerate(batch):
                tier.submit_load((i, j), [k], [slots[j]])
            tier.drain(60)
            for r in tier.get_finished():
                i0, j = r.job_id
                k = ks[i0 + j]
                if r.success:
                    if bytes(pool.slot_view(slots[j])[:PAGE]) == payload_for(k, PAGE):
                        ok += 1
                    else:
                        wrong += 1
                else:
                    miss += 1
    finally:
        tier.close()
        pool.close()
    return ok, miss, wrong


@pytest.fixture
def full_dir(sfs: SharedFs) -> Iterator[Path]:
    """The quota pool's directory, its quota on (what the pool holds now plus
    ``full_pool_bytes``); at the end the quota is lifted first (an op that
    the full pool paused resumes), then the files are removed."""
    d = _pool_dir(sfs, "pool")
    on, off = sfs.info["full_pool_quota"]
    sfs.inject(on, off)
    try:
        yield d
    finally:
        sfs.undo()
        shutil.rmtree(d, ignore_errors=True)


MODES = {
    "o_direct": {"o_direct": "auto", "fsync": "none"},
    "buffered+fsync": {"o_direct": "off", "fsync": "file"},
    "buffered": {"o_direct": "off", "fsync": "none"},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_full_pool_never_publishes_a_failed_store(sfs: SharedFs, full_dir: Path, mode: str) -> None:
    f = _Filler(full_dir, io_timeout_s=3, **MODES[mode])
    try:
        # The quota is lifted before the tier drains: on a full pool some
        # writes block (an op the pool's full flag paused) rather than fail,
        # and host b's first read of a file host a wrote waits the same way.
        f.fill(release=sfs.undo)
        view = f.tier.usage_bytes
        counted = int(f.tier.metrics.stored_blocks.value)
        fsync = f.tier.io_options.fsync
    finally:
        f.close()
    on_disk = scan_usage(full_dir).block_bytes
    # Loaded through host a: host b's first lookup of each file host a wrote
    # through the full pool waits on the MDS for host a's caps (seconds per
    # file, more than this test can spend; fstier's deadline fails such a
    # load as a timeout, never wrong bytes).
    ok, miss, wrong = _load_each(full_dir, f.acked)
    FIGURES[f"{sfs.name} full pool ({sfs.info['full_pool_bytes'] >> 20} MiB quota), {mode}"] = {
        "acknowledged blocks": len(f.acked),
        "failures by cause": f.causes,
        "first ENOSPC after (s)": None if f.first_full_s is None else round(f.first_full_s, 1),
        "acknowledged loaded byte-exact": ok,
        "acknowledged that are misses": miss,
        "wrong bytes": wrong,
        "blocks on disk": on_disk // FILE,
        "tier's usage view / on disk": None if view is None else round(view / max(on_disk, 1), 3),
        "store fsync": fsync,
    }
    assert f.first_full_s is not None, f"the pool never filled: {f.causes}"
    assert set(f.causes) <= set(FULL_CAUSES), f.causes
    assert wrong == 0
    assert temp_files(full_dir) == []
    # Published = acknowledged = counted: no failed store left a file or was
    # counted as stored.
    assert on_disk == len(f.acked) * FILE == counted * FILE, (on_disk, len(f.acked), counted)
    assert miss == 0 and ok == len(f.acked), (ok, miss)


def test_directory_quota_is_edquot(sfs: SharedFs) -> None:
    """A directory quota (``ceph.quota.max_bytes``): stores fail EDQUOT,
    none is published or counted, every acknowledged one loads byte-exact."""
    d = sfs.a / "quota"
    d.mkdir()
    limit = 8 << 20
    os.setxattr(d, "ceph.quota.max_bytes", str(limit).encode())
    try:
        f = _Filler(d)
        try:
            f.fill()
            counted = int(f.tier.metrics.stored_blocks.value)
        finally:
            f.close()
        on_disk = scan_usage(d).block_bytes
        ok, miss, wrong = _load_each(d, f.acked)
        FIGURES[f"{sfs.name} directory quota 8 MiB"] = {
            "acknowledged blocks": len(f.acked),
            "on disk (MiB)": round(on_disk / 2**20, 2),
            "failures by cause": f.causes,
            "first EDQUOT after (s)": None if f.first_full_s is None else round(f.first_full_s, 1),
            "acknowledged loaded byte-exact": ok,
        }
        assert f.first_full_s is not None, f"the quota never applied: {f.causes}"
        assert set(f.causes) <= set(FULL_CAUSES), f.causes
        assert wrong == 0 and miss == 0 and ok == len(f.acked)
        assert temp_files(d) == []
        assert on_disk == len(f.acked) * FILE == counted * FILE, (on_disk, len(f.acked), counted)
    finally:
        shutil.rmtree(d, ignore_errors=True)
