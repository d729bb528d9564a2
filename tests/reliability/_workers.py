"""Worker bodies of the multi-process concurrency tests. They run in child
processes started by a ``forkserver`` multiprocessing context (modules
preloaded once, so eight workers start in milliseconds) and write one JSON
result file each. Every loaded payload is compared with the deterministic
content of its key; any mismatch counts as wrong bytes."""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fstier.io.fsops import atomic_write
from fstier.tier.gc import collect_garbage

from ._support import Tier, key_for, payload_for


@dataclass
class WorkerReport:
    ops: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    wrong_bytes: int = 0

    def count(self, what: str) -> None:
        self.ops[what] = self.ops.get(what, 0) + 1


def _write(out: Path, rep: WorkerReport) -> None:
    out.write_text(json.dumps(asdict(rep)))


MIXED_MIN_OPS = 200


def mixed(root: str, seed: int, seconds: float, keyspace: int, out: str) -> None:
    """Store, load and evict random keys of a shared key space; one in fifty
    operations is an LRU capacity pass over the whole root."""
    rng = random.Random(seed)
    tier = Tier.open(root)
    n = tier.payload_len
    rep = WorkerReport()
    budget = (keyspace // 2) * 8192
    deadline = time.monotonic() + seconds
    # At least MIXED_MIN_OPS operations whatever the clock says: on a loaded
    # machine 0.5 s was a handful of operations per worker and the test's
    # "some loads, stores and evictions happened" failed on timing luck.
    done = 0
    while time.monotonic() < deadline or done < MIXED_MIN_OPS:
        done += 1
        key = key_for(rng.randrange(keyspace), "mixed")
        r = rng.random()
        if r < 0.45:
            res = tier.store(key)
            rep.count(f"store_{res.status.value}")
            if not res.ok:
                rep.errors.append(f"store {res.cause} {res.detail}")
        elif r < 0.90:
            res, got = tier.load(key)
            rep.count(f"load_{res.status.value}")
            if res.status == "LOADED" and got != payload_for(key, n):
                rep.wrong_bytes += 1
            elif res.status in ("CORRUPT", "ERROR"):
                rep.errors.append(f"load {res.status.value} {res.cause} {res.detail}")
        elif r < 0.98:
            try:
                os.unlink(tier.path(key))
                rep.count("evict")
            except FileNotFoundError:
                rep.count("evict_absent")
        else:
            gc = collect_garbage(root, budget, low_watermark=0.5, high_watermark=0.8)
            rep.count("gc")
            rep.ops["gc_evicted"] = rep.ops.get("gc_evicted", 0) + gc.removed_files
    _write(Path(out), rep)


ONE_KEY_MIN_STORES = 50


def one_key_writer(root: str, seed: int, seconds: float, out: str) -> None:
    """Row 8: many stores of ONE key; evictions in between so stores race."""
    rng = random.Random(seed)
    tier = Tier.open(root)
    key = key_for(0, "hot")
    rep = WorkerReport()
    deadline = time.monotonic() + seconds
    # At least ONE_KEY_MIN_STORES stores whatever the clock says: under load
    # 0.4 s held a handful per worker and "more than 8 stores landed" failed
    # on timing luck (6 STORED, 8 SKIPPED once).
    done = 0
    while time.monotonic() < deadline or done < ONE_KEY_MIN_STORES:
        done += 1
        res = tier.store(key)
        rep.count(f"store_{res.status.value}")
        if not res.ok:
            rep.errors.append(f"store {res.cause} {res.detail}")
        if rng.random() < 0.5:
            try:
                os.unlink(tier.path(key))
                rep.count("evict")
            except FileNotFoundError:
                pass
    _write(Path(out), rep)


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


#: Row 9 synchronises on a barrier and shared counts, never on a time
#: window; this bound only turns a worker that can no longer make progress
#: (a dead peer) into a reported error instead of a hang.
_STUCK_S = 300.0


@dataclass(frozen=True)
class ReplaceSync:
    """What the row-9 workers share: a start barrier (all four run at once,
    however late the machine schedules one), the number of replacements
    made so far, and how many readers are done."""

    start: Any  # multiprocessing Barrier(4)
    replaces: Any  # multiprocessing Value("q")
    readers_done: Any  # multiprocessing Value("i")
    readers: int = 2


def _started(sync: ReplaceSync, rep: WorkerReport) -> bool:
    try:
        sync.start.wait(_STUCK_S)
    except threading.BrokenBarrierError:
        rep.errors.append(f"a peer never reached the start barrier within {_STUCK_S:.0f} s")
        return False
    return True


def replacer(root: str, seed: int, sync: ReplaceSync, min_ops: int, out: str) -> None:
    """Row 9 writer: replace the hot key's file in place by rename (a new
    valid version), or evict and store it again; runs from the common start
    until both readers are done AND it replaced the file ``min_ops`` times."""
    rng = random.Random(seed)
    tier = Tier.open(root)
    key = key_for(0, "hot")
    rep = WorkerReport()
    # The other replacer may evict the file between any two calls here.
    good = _read_or_none(tier.path(key))
    if _started(sync, rep):
        stuck = time.monotonic() + _STUCK_S
        while sync.readers_done.value < sync.readers or rep.ops.get("replace", 0) < min_ops:
            if time.monotonic() > stuck:
                rep.errors.append(f"replacer: readers not done after {_STUCK_S:.0f} s ({rep.ops})")
                break
            if good is not None and rng.random() < 0.5:
                atomic_write(tier.path(key), good, fsync="none")
                rep.count("replace")
                with sync.replaces.get_lock():
                    sync.replaces.value += 1
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tier.path(key))
                res = tier.store(key)
                rep.count(f"store_{res.status.value}")
                if good is None and res.status == "STORED":
                    good = _read_or_none(tier.path(key))
    _write(Path(out), rep)


def reader(root: str, seed: int, sync: ReplaceSync, min_ops: int, out: str) -> None:
    """Row 9 reader: every load is the complete right file or a miss; runs
    from the common start until it loaded the file ``min_ops`` times AND
    ``min_ops`` replacements were made while it was loading (so loads and
    replacements interleave whatever the machine's load)."""
    tier = Tier.open(root)
    key = key_for(0, "hot")
    n = tier.payload_len
    rep = WorkerReport()
    if _started(sync, rep):
        first = sync.replaces.value
        stuck = time.monotonic() + _STUCK_S
        while rep.ops.get("load_LOADED", 0) < min_ops or sync.replaces.value - first < min_ops:
            if time.monotonic() > stuck:
                rep.errors.append(f"reader: too few loads or replacements after {_STUCK_S:.0f} s ({rep.ops})")
                break
            res, got = tier.load(key)
            rep.count(f"load_{res.status.value}")
            if res.status == "LOADED" and got != payload_for(key, n):
                rep.wrong_bytes += 1
            elif res.status in ("CORRUPT", "ERROR"):
                rep.errors.append(f"load {res.status.value} {res.cause} {res.detail}")
        rep.ops["replaces_during_loads"] = sync.replaces.value - first
    with sync.readers_done.get_lock():
        sync.readers_done.value += 1
    _write(Path(out), rep)
