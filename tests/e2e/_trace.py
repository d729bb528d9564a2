"""A timeline of a secondary tier's calls inside a real vLLM engine (a
profiling aid for benchmarks/bench_vllm_ttft.py ``--trace``; not a test).

:func:`install` wraps, in the engine's process before the engine is built,
the methods vLLM calls on FstierTier and on vLLM's own fs tier (``lookup``,
``on_schedule_end``, ``submit_load``, ``submit_store``, ``touch``,
``get_finished_jobs``, the async lookup's ``batch_lookup``), plus the
fstier parts behind them (``FsTier.present``, the lookup probe and its
thread pool's creation, ``Recency.note_many`` / ``note_keys`` and the recency flush job,
the job engine's ``submit`` (either engine) and the C engine's completion of
each job on its completion thread (``engine.complete``), ``BlockStore.load_many``/
``store_many``, the native ``lookup_batch``) and every garbage collection. Each call appends one row
``(name, thread, t_start, t_end, detail)`` to a list (a ``perf_counter``
pair and one append: about a microsecond); ``lookup`` rows are kept only
when the answer a key gets changes (its first RETRY, its HIT). The rows
are written as JSON to ``<dir>/trace-<pid>-<tier>.json`` when the tier
shuts down, and (vLLM's multi-process engine core) on SIGUSR1 from the
driver (:func:`dump_children`).

:func:`mark` records an event of the driver (a prompt's start and end).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

_rows: list[tuple[str, str, float, float, Any]] = []
_dir: Path | None = None


def mark(name: str, detail: Any = None) -> None:
    t = time.perf_counter()
    _rows.append((name, threading.current_thread().name, t, t, detail))


def _size(x: Any) -> Any:
    try:
        return len(x)
    except TypeError:
        return None


def _wrap(cls: type, name: str, label: str, detail: Any = None) -> None:
    fn = getattr(cls, name)
    if getattr(fn, "_traced", False):
        return

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            d = detail(args) if detail is not None else None
            _rows.append((label, threading.current_thread().name, t0, time.perf_counter(), d))

    traced._traced = True  # type: ignore[attr-defined]
    setattr(cls, name, traced)


def _wrap_lookup(cls: type, label: str) -> None:
    """``lookup`` rows only when a key's answer changes (RETRY, then HIT/MISS)."""
    fn = cls.lookup
    if getattr(fn, "_traced", False):
        return
    seen: dict[Any, Any] = {}

    @functools.wraps(fn)
    def traced(self: Any, key: Any, req_context: Any) -> Any:
        t0 = time.perf_counter()
        r = fn(self, key, req_context)
        name = getattr(r, "name", str(r))
        if seen.get(key) != name:
            seen[key] = name
            _rows.append((f"{label}.lookup", threading.current_thread().name, t0, time.perf_counter(), name))
        return r

    traced._traced = True  # type: ignore[attr-defined]
    cls.lookup = traced


def _wrap_finished(cls: type, label: str) -> None:
    """``get_finished_jobs`` rows only when it returns a result (it is polled every step)."""
    fn = cls.get_finished_jobs
    if getattr(fn, "_traced", False):
        return

    @functools.wraps(fn)
    def traced(self: Any) -> Any:
        t0 = time.perf_counter()
        r = list(fn(self))
        if r:
            _rows.append((f"{label}.get_finished_jobs", threading.current_thread().name, t0,
                          time.perf_counter(), [(j.job_id, j.success) for j in r]))
        return r

    traced._traced = True  # type: ignore[attr-defined]
    cls.get_finished_jobs = traced


def dump(tier: str) -> None:
    if _dir is None:
        return
    out = _dir / f"trace-{os.getpid()}-{tier}.json"
    out.write_text(json.dumps({"pid": os.getpid(), "tier": tier, "rows": _rows}))


def dump_children(wait_s: float = 2.0) -> None:
    """Ask every process this one started (vLLM's engine core) to write its
    timeline (SIGUSR1, handled by the wrappers it inherited), then wait."""
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            fields = stat.read_text().rpartition(")")[2].split()
            # vLLM's engine core ("VLLM::EngineCore"), not the resource tracker
            if fields[1] == me and (stat.parent / "comm").read_text().startswith("VLLM::"):
                os.kill(int(stat.parent.name), signal.SIGUSR1)
    time.sleep(wait_s)


def _wrap_shutdown(cls: type, tier: str) -> None:
    fn = cls.shutdown
    if getattr(fn, "_traced", False):
        return

    @functools.wraps(fn)
    def traced(self: Any) -> Any:
        with contextlib.suppress(OSError):  # a trace never stops the engine's shutdown
            dump(tier)
        return fn(self)

    traced._traced = True  # type: ignore[attr-defined]
    cls.shutdown = traced


def install(directory: str) -> None:
    """Wrap the tiers' methods; the timeline goes to ``directory``. A
    process forked from this one (vLLM's multi-process engine core) keeps
    the wrappers and writes its own file on SIGUSR1 (:func:`dump_children`); a
spawned one (vLLM's engine core on CPU) runs tests/e2e/engine_run.py as its
``__mp_main__``, which installs them again from ``FSTIER_E2E_TRACE``."""
    global _dir
    _dir = Path(directory)
    _dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGUSR1, lambda *_: dump("core"))
    from fstier.integrations import vllm as fv
    from fstier.manager import FsTier
    from fstier.tier import lookup as flookup
    from fstier.tier import recency as frec

    n_keys = lambda a: _size(a[1])  # noqa: E731
    job_keys = lambda a: len(a[1].keys)  # noqa: E731
    for cls, label in ((fv.FstierTier, "fstier"),):
        _wrap_lookup(cls, label)
        for m in ("on_schedule_end", "touch"):
            _wrap(cls, m, f"{label}.{m}", n_keys if m == "touch" else None)
        for m in ("submit_load", "submit_store"):
            _wrap(cls, m, f"{label}.{m}", job_keys)
        _wrap_finished(cls, label)
        _wrap_shutdown(cls, label)
    _wrap(fv._PresenceLookup, "batch_lookup", "fstier.batch_lookup", n_keys)
    _wrap(FsTier, "present", "FsTier.present", n_keys)
    _wrap(flookup.Lookup, "_probe", "Lookup._probe", n_keys)
    _wrap(flookup.Lookup, "_probe_now", "Lookup._probe_now", n_keys)
    from fstier.io import native

    native.lookup_batch = _traced_fn(native.lookup_batch, "native.lookup_batch", lambda a: _size(a[1]))
    _trace_gc()
    _wrap(frec.Recency, "note_many", "Recency.note_many", n_keys)
    _wrap(frec.Recency, "note_keys", "Recency.note_keys", n_keys)
    frec._bump_mtimes = _traced_fn(frec._bump_mtimes, "recency.bump_mtimes", lambda a: _size(a[0]))
    from fstier.io.blockstore import BlockStore

    _wrap(BlockStore, "load_many", "BlockStore.load_many", lambda a: _size(a[1]))
    _wrap(BlockStore, "store_many", "BlockStore.store_many", lambda a: _size(a[1]))
    from fstier.io.engine import PythonEngine

    _wrap(PythonEngine, "submit", "engine.submit", lambda a: (a[2].kind, len(a[2].keys)))
    _wrap(PythonEngine, "__init__", "PythonEngine.__init__", lambda a: a[1:3])
    from fstier.io.engine.native import NativeEngine

    # The C engine: its submit (one C call) and, on its completion thread, each
    # summary turned into the record (detail: the kind, 0 finished / 1 released,
    # and the job's seconds in C from submit to its last key).
    _wrap(NativeEngine, "submit", "engine.submit", lambda a: (a[2].kind, len(a[2].keys)))
    _wrap(NativeEngine, "_event", "engine.complete", lambda a: (a[1][1], round(a[1][2] * 1000, 2)))
    try:
        from vllm.v1.kv_offload.tiering.fs import manager as vfs
    except Exception:
        return
    cls, label = vfs.FileSystemTierManager, "fs"
    _wrap_lookup(cls, label)
    for m in ("on_schedule_end", "touch"):
        _wrap(cls, m, f"{label}.{m}", n_keys if m == "touch" else None)
    for m in ("submit_load", "submit_store"):
        _wrap(cls, m, f"{label}.{m}", job_keys)
    _wrap_finished(cls, label)
    _wrap_shutdown(cls, label)
    _wrap(vfs.FsAsyncLookupManager, "batch_lookup", "fs.batch_lookup", n_keys)
    if hasattr(vfs, "batch_load_block"):
        vfs.batch_load_block = _traced_fn(vfs.batch_load_block, "fs.batch_load_block", lambda a: _size(a[0]))


def _trace_gc() -> None:
    """A row per garbage collection (it holds the GIL throughout)."""
    import gc

    started: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            _rows.append(("gc", threading.current_thread().name, started[0], time.perf_counter(),
                          info.get("generation")))

    if on_gc not in gc.callbacks:
        gc.callbacks.append(on_gc)


def _traced_fn(fn: Any, label: str, detail: Any) -> Any:
    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _rows.append((label, threading.current_thread().name, t0, time.perf_counter(), detail(args)))

    return traced


def report(directory: str, summary: bool = False) -> None:
    """Per prompt, each traced call relative to the prompt's start (ms)."""
    rows: set[tuple[Any, ...]] = set()
    for f in sorted(Path(directory).glob("trace-*.json")):
        d = json.loads(f.read_text())
        for name, thread, t0, t1, detail in d["rows"]:
            rows.add((t0, t1, name, thread, json.dumps(detail)))
    ordered = sorted(rows)
    starts = [r for r in ordered if r[2] == "prompt.start"]
    ends = [r for r in ordered if r[2] == "prompt.end"]
    for s, e in zip(starts, ends, strict=False):
        inside = [r for r in ordered if s[0] <= r[0] <= e[0] and not r[2].startswith("prompt.")]
        done = [r[0] for r in inside if r[2].endswith(".get_finished_jobs")]
        lookups = [r[1] - r[0] for r in inside if r[2].endswith(".batch_lookup")]
        ready = f"{1000 * (done[0] - s[0]):.1f} ms" if done else "-"
        probe = f"{1000 * sum(lookups):.1f} ms" if lookups else "-"
        print(f"\n== prompt {s[4]}: {1000 * (e[0] - s[0]):.1f} ms; load reported at {ready}; "
              f"batch_lookup {probe}")
        if summary:
            continue
        for t0, t1, name, thread, detail in inside:
            print(f"  {1000 * (t0 - s[0]):8.2f} +{1000 * (t1 - t0):7.2f} ms  {name:28s} {thread[:28]:28s} {detail}")


if __name__ == "__main__":
    import sys

    report(sys.argv[1], summary="--summary" in sys.argv[2:])
