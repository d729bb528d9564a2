"""Two hosts with ``max_bytes`` storing new blocks into one shared root as
fast as they can (a steady store workload, ~2x ``max_bytes`` stored in all):
the bytes on disk (sampled all along) peak at most 1.25 x ``max_bytes``, and
once both drained and their counts settled (``Capacity.settled``: each
host's rescan after the last change, one host at a time under the eviction
lease) each host's view of the usage is within 5% of the bytes on disk, and
so it is already ``QUIET_BOUND_S`` (5 s) after both drained, settled or
not (+12.7% and +16.7% on GlusterFS 2 s after, before a raced scan only
bounded the view). No
store fails for another reason than capacity or write backpressure (both
designed drops); every load of what is left is byte-exact (the cross-host
tests).

``FSTIER_SHAREDFS_CAPACITY_S`` sets the store phase (default 20 s, CI's
budget; docs/deployment.md also cites 60 s runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from fstier.tier.gc import scan_usage

from .conftest import FIGURES, SharedFs

HOST = Path(__file__).with_name("_host.py")
#: each view is within 5% of the disk this long after both hosts drained
#: (publish and listing rounds, the mounts' 1 s caches), settled or not
QUIET_BOUND_S = 5.0
MAX_BYTES = 32 << 20
SECONDS = float(os.environ.get("FSTIER_SHAREDFS_CAPACITY_S", "20"))


def test_two_hosts_share_max_bytes(sfs: SharedFs) -> None:
    hosts = [
        subprocess.Popen(
            [sys.executable, str(HOST), str(root), str(MAX_BYTES), str(SECONDS), str(seed), str(QUIET_BOUND_S)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        for seed, root in ((1, sfs.a), (2, sfs.b))
    ]
    peak = 0
    samples = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak, samples
        while not stop.is_set():
            try:
                peak = max(peak, scan_usage(sfs.a).block_bytes)
                samples += 1
            except OSError:
                pass
            stop.wait(0.5)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for h in hosts:
            assert h.stdout is not None
            line = h.stdout.readline().strip()
            assert line == "drained", line
        stop.set()
        sampler.join(60)
        views = []
        for h in hosts:
            assert h.stdin is not None and h.stdout is not None
            h.stdin.write("report\n")
            h.stdin.flush()
        for h in hosts:
            views.append(json.loads(h.stdout.readline()))
        for h in hosts:
            assert h.wait(120) == 0
        # Both tiers closed: nothing changes any more. Wait out the mount's
        # own caches (1 s attribute/entry timeouts) before the last walk.
        time.sleep(2.0)
        on_disk = scan_usage(sfs.a).block_bytes
        peak = max(peak, on_disk)
    finally:
        stop.set()
        for h in hosts:
            if h.poll() is None:
                h.kill()
                h.wait(30)
    errors = [abs(v["usage"] - on_disk) / max(on_disk, 1) for v in views]
    # QUIET_BOUND_S after both drained: the disk then held what it holds now
    # plus what either host evicted since.
    then = on_disk + sum(int(v["evicted_after_bound"]) for v in views)
    early = [abs(v["at_bound"] - then) / max(then, 1) for v in views]
    FIGURES[f"{sfs.name} two hosts, max_bytes {MAX_BYTES >> 20} MiB, {SECONDS:.0f} s"] = {
        "peak / max_bytes": round(peak / MAX_BYTES, 3),
        "samples": samples,
        "on disk after drain (MiB)": round(on_disk / 2**20, 1),
        "count error per host (%)": [round(100 * e, 2) for e in errors],
        f"count error per host {QUIET_BOUND_S:.0f} s after both drained (%)": [round(100 * e, 2) for e in early],
        "settled after (s)": [v["settle_s"] if v["settled"] else None for v in views],
        "shared scans taken": [v["scans_adopted"] for v in views],
        "stored blocks": [v["stored"] for v in views],
        "dropped (capacity, backpressure)": [v["dropped"] for v in views],
        "failed (other causes)": [v["failed_causes"] for v in views],
    }
    assert all(v["failed"] == 0 for v in views), views
    assert all(v["stored"] > 0 for v in views), views
    assert peak <= 1.25 * MAX_BYTES, (peak / MAX_BYTES, views)
    assert all(e <= 0.05 for e in errors), (errors, on_disk, views)
    assert all(e <= 0.05 for e in early), (early, then, views)
