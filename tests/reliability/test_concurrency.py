"""Rows 8 and 9 of the fault matrix and the eight-process soak: processes
storing, loading and evicting overlapping keys surface zero errors and load
zero wrong bytes; concurrent writers of one key leave one verifying file and
no temp file; a reader racing replacements sees the complete file or a miss.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fstier.io.blockcheck import verify_file

from . import _workers
from ._support import Tier, block_files, key_for, temp_files

FIGURES: dict[str, int] = {}


#: Preloaded by the fork server so workers start fast. ``fstier.io`` is left
#: out on purpose: see test_io_buffers_private_after_fork (a known bug).
PRELOAD = [
    "numpy", "xxhash", "pydantic", "asyncio", "aiofiles", "concurrent.futures", "logging",
    "fstier.config", "fstier.file_mapper", "fstier.tier.gc",
]


def _ctx(preload_io: bool = False) -> Any:
    if preload_io:
        # Plain fork of this process, which has imported fstier.io.blockstore.
        return multiprocessing.get_context("fork")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _run_all(
    jobs: list[tuple[Callable[..., None], tuple[Any, ...]]], tmp: Path, timeout: float, preload_io: bool = False,
    ctx: Any = None,
) -> list[dict[str, Any]]:
    """Run each job in its own process (of ``ctx``, where the jobs share its
    synchronisation objects); their reports once all exited 0."""
    ctx = ctx if ctx is not None else _ctx(preload_io)
    procs, outs = [], []
    for i, (fn, args) in enumerate(jobs):
        out = tmp / f"worker-{i}.json"
        outs.append(out)
        p = ctx.Process(target=fn, args=(*args, str(out)))
        p.start()
        procs.append(p)
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
        assert p.exitcode == 0, f"worker exited with {p.exitcode}"
    return [json.loads(o.read_text()) for o in outs]


def _merge(reports: list[dict[str, Any]]) -> tuple[Counter[str], list[str], int]:
    ops: Counter[str] = Counter()
    errors: list[str] = []
    wrong = 0
    for r in reports:
        ops.update(r["ops"])
        errors += r["errors"]
        wrong += r["wrong_bytes"]
    return ops, errors, wrong


def _mixed(tmp_path: Path, seconds: float, preload_io: bool = False) -> Counter[str]:
    root = tmp_path / "root"
    Tier.open(root)
    jobs = [(_workers.mixed, (str(root), seed, seconds, 64)) for seed in range(8)]
    ops, errors, wrong = _merge(_run_all(jobs, tmp_path, seconds + 60, preload_io))
    assert errors == [], errors[:5]
    assert wrong == 0
    assert ops["load_LOADED"] > 0 and ops["store_STORED"] > 0 and ops["evict"] > 0
    for f in block_files(root):
        assert verify_file(f).ok
    assert temp_files(root) == []
    return ops


def test_eight_processes_store_load_evict(tmp_path: Path) -> None:
    ops = _mixed(tmp_path, 0.5)
    FIGURES["fast_ops"] = sum(v for k, v in ops.items() if k != "gc_evicted")


FORK_BUG = (
    "BUG: fstier/io/posix.py aligned_buffer() maps MAP_SHARED anonymous memory; the "
    "per-thread header/tail buffers (_BUFS, created at import) are shared with every "
    "child forked after the import, so processes overwrite each other's headers: stores "
    "publish files with another key's header and loads flag good files CORRUPT and unlink "
    "them. Fix: mmap(-1, size, flags=MAP_PRIVATE|MAP_ANONYMOUS) or os.register_at_fork"
)


def test_io_buffers_private_after_fork() -> None:
    # Every I/O buffer of the io layer (the per-thread header, bounce and
    # overflow pages made at import included) comes from aligned_buffer.
    from fstier.io import aligned_buffer

    header = aligned_buffer(4096)
    header[:4] = b"AAAA"
    pid = os.fork()
    if pid == 0:  # the child scribbles on its own (should be private) buffer
        header[:4] = b"BBBB"
        os._exit(0)
    os.waitpid(pid, 0)
    assert bytes(header[:4]) == b"AAAA", "a forked child wrote into the parent's io buffer"


def test_eight_processes_forked_after_io_import(tmp_path: Path) -> None:
    """The same workload, workers forked from a server that imported
    fstier.io.blockstore (as an engine forking its workers would)."""
    _mixed(tmp_path, 0.5, preload_io=True)


@pytest.mark.slow
def test_eight_processes_soak(tmp_path: Path) -> None:
    seconds = float(os.environ.get("FSTIER_SOAK_SECONDS", "30"))
    ops = _mixed(tmp_path, seconds)
    total = sum(v for k, v in ops.items() if k != "gc_evicted")
    FIGURES["ops"] = total
    print(f"\nRELIABILITY-FIGURES concurrency processes=8 seconds={seconds} ops={total} {dict(ops)}")


def test_concurrent_writers_of_one_key(tmp_path: Path) -> None:
    root = tmp_path / "root"
    tier = Tier.open(root)
    jobs = [(_workers.one_key_writer, (str(root), seed, 0.4)) for seed in range(8)]
    ops, errors, wrong = _merge(_run_all(jobs, tmp_path, 60))
    assert errors == [], errors[:5]
    assert ops["store_STORED"] > 8, ops
    key = key_for(0, "hot")
    if not tier.path(key).exists():
        assert tier.store(key).status == "STORED"
    assert verify_file(tier.path(key)).ok
    assert temp_files(root) == []


def test_read_during_replace(tmp_path: Path) -> None:
    """Two processes replace one file (rename over it, or unlink + store)
    while two load it: every load is the right bytes or a miss. The four
    start together at a barrier, each reader loads until it loaded 6 times
    AND 6 replacements were made while it loaded, and the replacers go on
    until both readers are done: the race is exercised however the machine
    schedules them (0.4 s windows failed under heavy load: a worker started
    late ran its window alone)."""
    root = tmp_path / "root"
    tier = Tier.open(root)
    assert tier.store(key_for(0, "hot")).status == "STORED"
    ctx = _ctx()
    sync = _workers.ReplaceSync(ctx.Barrier(4), ctx.Value("q", 0), ctx.Value("i", 0))
    jobs: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (_workers.replacer, (str(root), 1, sync, 6)),
        (_workers.replacer, (str(root), 2, sync, 6)),
        (_workers.reader, (str(root), 3, sync, 6)),
        (_workers.reader, (str(root), 4, sync, 6)),
    ]
    reports = _run_all(jobs, tmp_path, 600, ctx=ctx)
    ops, errors, wrong = _merge(reports)
    assert errors == [], errors[:5]
    assert wrong == 0
    assert ops["load_LOADED"] >= 12 and ops["replace"] >= 12, ops
    assert all(r["ops"]["replaces_during_loads"] >= 6 for r in reports[2:]), [r["ops"] for r in reports]
    assert temp_files(root) == []


# ------------------------------------------------------------------ row 26
@pytest.mark.slow
def test_many_instances_share_max_bytes(tmp_path: Path) -> None:
    """Issue 15 item 6: five processes, each with its own FsTier and
    max_bytes of 300 files on one root, storing ~17x max_bytes. Each used to
    count only its own stores (peak 2.86x max_bytes); with the shared count
    sampled usage stays within 1.15x and settles below max_bytes. Stores
    count from admission, so every instance sees those in flight (1.11x and
    1.17x at load average 27 on a 2-core VM), and above the high watermark
    a job that would take the root over max_bytes is dropped (1.01-1.04x at
    load average 8-24, once 1.12x)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "bench_multi_instance.py"), "--json",
         "--root", str(tmp_path / "root")],
        capture_output=True, text=True, timeout=600, cwd=repo,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"\nRELIABILITY-FIGURES multi-instance processes={res['procs']} "
        f"peak={res['peak_ratio']}x settled={res['settled_ratio']}x max_bytes "
        f"samples={res['samples']} dropped={res['dropped']} ({res['dropped_fraction']:.0%})"
    )
    assert res["samples"] >= 100
    assert res["peak_ratio"] <= 1.15, res
    assert res["settled_ratio"] < 1.0, res
