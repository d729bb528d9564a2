"""How close can fstier's LMCache adapter get to LMCache's ``fs_native`` on a
warm load? The floor of fstier's own load path, measured beside both.

One process, the same machine moment, tasks interleaved; for each chunk size
32 chunks are stored through LMCache's ``fs_native`` adapter and through
``FstierL2Adapter`` (bench_lmcache.py's harness: LMCache's factory, L1 buffer
and memory objects), then loaded warm (from the page cache) over and over as:

* **fs_native**: LMCache's C++ adapter (no checksum);
* **fstier**: fstier's adapter, the whole task: LMCache's submit, the
  adapter, ``FsTier``'s job, the engine, the eventfd, the result;
* **floor**: the SAME engine work with fstier's job path removed, XXH3
  checked. On the C engine (the default on the native path) the adapter's
  own ``engine_submit`` call, captured from it (names, buffers, flags,
  spread) and replayed on the caller's thread with an eventfd of its own,
  then one ``engine_collect``: the same C workers and per-key work. On the
  Python engine (``FSTIER_ENGINE=python``) the native batch call its job
  makes (``load_batch``, with its helper threads), run by one waiting
  Python thread that writes an eventfd. Either way the caller polls the
  eventfd as LMCache does; no job path of fstier on that engine can load
  faster than this with checksums on;
* **floor_unchecked**: the floor without the checksum (what the hash costs).

Every load's bytes are compared with what was stored (a wrong byte fails
the run). Prints the engine, the median microseconds per task and each
one's ratio to ``fs_native`` (>1: faster), with the load average before and
after. ``--timeline`` prints, per size, where one fstier task's time goes
instead: the caller's submit, its wait on the eventfd and its collect (wall
and the caller thread's CPU), the job's own time in the engine (its
submit to its completion), the process CPU, and each thread's context
switches and time on a CPU per task (which threads a task wakes); on the
C engine the submit is split further: the adapter's Python until it calls
the tier (``adapter_before_tier``) and the tier's until it calls the
engine (``tier_before_engine``), both before any C worker starts, and of
the collect, the tier's ``get_finished`` (``tier_collect``; the rest is
the adapter's and LMCache's). ``--cold`` precedes each traced task with
what the ratio loop does between two tasks (the destination objects
zeroed, their last bytes compared: ~3 x 32 chunks through the caches), so
the Python runs as it does in the ratio rows: from memory, not cache.
``--steps`` prints the caller's CPU per step of a task instead (a
thread-CPU timer around each of the adapter's steps, the tier's submit and
collect and LMCache's accounting call), with or without ``--cold``.

    DO_NOT_TRACK=1 .venv-lmcache/bin/python benchmarks/bench_lmcache_floor.py --sizes-kib 256,1024,2048
    DO_NOT_TRACK=1 .venv-lmcache/bin/python benchmarks/bench_lmcache_floor.py --sizes-kib 256 --timeline
    DO_NOT_TRACK=1 .venv-lmcache/bin/python benchmarks/bench_lmcache_floor.py --sizes-kib 256 --timeline --cold
    DO_NOT_TRACK=1 .venv-lmcache/bin/python benchmarks/bench_lmcache_floor.py --sizes-kib 256 --steps --cold
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import select
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import bench_lmcache as B  # noqa: E402  (sets LMCache's environment first)

VARIANTS = ("fs_native", "fstier", "floor", "floor_unchecked")
#: the job engines fstier's adapter ran on (printed)
ENGINES: set[str] = set()


def wait_fd(efd: int) -> None:
    """Wait for ``efd`` as LMCache's caller does (poll), then reset it."""
    poller = select.poll()
    poller.register(efd, select.POLLIN)
    if not poller.poll(60_000):
        raise SystemExit("floor: no completion within 60 s")
    os.eventfd_read(efd)


class Floor:
    """The Python engine's floor: a waiting thread that runs one captured
    native batch call per task and writes an eventfd, as the cheapest job
    path around that call would."""

    def __init__(self, call: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        self.call, self.kw = call, kw
        self.args = {True: args, False: (*args[:5], dataclasses.replace(args[5], checksum=False), *args[6:])}
        self.efd = os.eventfd(0)
        self.go = threading.Semaphore(0)
        self.checked = True
        self.out: list[Any] = []
        self.stop = False
        self.thread = threading.Thread(target=self._run, name="floor", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.go.acquire()
            if self.stop:
                return
            self.out.append(self.call(*self.args[self.checked], **self.kw))
            os.eventfd_write(self.efd, 1)

    def load(self, checked: bool) -> None:
        self.checked = checked
        self.go.release()
        wait_fd(self.efd)
        outs = self.out.pop()
        assert all(o.status.name == "LOADED" for o in outs), outs

    def close(self) -> None:
        self.stop = True
        self.go.release()
        self.thread.join()
        os.close(self.efd)


#: positions in NativeEngine.submit's engine_submit call: the flag bits, the notify fd and, last, the job's
#: record (C marks it accepted; the floor replays the call without one)
_FLAGS, _NOTIFY, _RECORD = 11, 17, 18


class EngineFloor:
    """The C engine's floor: the adapter's own ``engine_submit`` call,
    replayed on the caller's thread with a new tag and an eventfd of its
    own, then one ``engine_collect``. The engine's collection lock is held
    from submit to collect, so its completion thread cannot take the event."""

    def __init__(self, engine: Any, args: tuple[Any, ...]) -> None:
        assert len(args) == _RECORD + 1, "NativeEngine's engine_submit call changed: update _FLAGS/_NOTIFY/_RECORD"
        self.engine, self.args = engine, list(args[:_RECORD])
        self.efd = os.eventfd(0, os.EFD_CLOEXEC)
        self.args[_NOTIFY] = self.efd
        flags = args[_FLAGS]
        self.flags = {True: flags, False: flags & ~engine._ext.F_CHECKSUM}
        assert flags & engine._ext.F_CHECKSUM, "the adapter's load was not checked"
        self.tags = itertools.count(1 << 60)

    def load(self, checked: bool) -> None:
        eng, a = self.engine, self.args
        a[1], a[_FLAGS] = next(self.tags), self.flags[checked]
        with eng._collecting:
            eng._ext.engine_submit(*a)
            wait_fd(self.efd)
            events = eng._ext.engine_collect(eng._cap)
            for ev in events:
                if ev[0] != a[1]:
                    eng._event(ev)  # not the floor's: the engine's own handling
        (ev,) = [ev for ev in events if ev[0] == a[1]]
        assert ev[3] is not None and ev[3][0] == 0, f"floor: not every chunk loaded: {ev}"

    def close(self) -> None:
        os.close(self.efd)


def python_engine_load(adapter: Any, keys: list[Any], objs: list[Any], size: int) -> None:
    """The native call the Python engine makes for this warm load task: one
    ``load_many`` with the helpers its plan gives 32 keys on idle threads."""
    from fstier.integrations.lmcache_space import block_keys_of
    from fstier.io.engine.record import plan

    (space,) = adapter._open_spaces()
    blocks = space.tier.blocks
    bkeys = block_keys_of(keys)
    helpers = plan(len(bkeys), adapter.tier_config.read_threads, True)[1]
    outs = blocks.load_many(list(zip(bkeys, adapter._arena.views_of(objs, size), strict=True)), helpers=helpers)
    assert all(o.status.name == "LOADED" for o in outs), outs


def native_engine(adapter: Any) -> Any:
    """The C engine behind the adapter's namespace, or None (the Python engine)."""
    from fstier.io.engine.native import NativeEngine

    (space,) = adapter._open_spaces()
    engine = space.tier._engine.engine
    return engine if isinstance(engine, NativeEngine) else None


class _Capture:
    """The C extension seen through: its ``engine_submit`` calls are kept
    (and, given ``marks``, when the last one started, as ``marks["engine"]``)."""

    def __init__(self, ext: Any, marks: dict[str, int] | None = None) -> None:
        self._ext = ext
        self.calls: list[tuple[Any, ...]] = []
        self.marks = marks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ext, name)

    def engine_submit(self, *args: Any) -> Any:
        if self.marks is not None:
            self.marks["engine"] = time.perf_counter_ns()
        else:
            self.calls.append(args)
        return self._ext.engine_submit(*args)


def make_floor(bench: Any, keys: list[Any], dst: list[Any], size: int) -> Floor | EngineFloor:
    """Capture the adapter's engine call of one warm load and wrap it as its floor."""
    from fstier.io import native

    engine = native_engine(bench.adapter)
    if engine is not None:
        ext = engine._ext
        engine._ext = cap = _Capture(ext)
        try:
            bench._load(keys, dst)
        finally:
            engine._ext = ext
        (args,) = cap.calls
        return EngineFloor(engine, args)
    captured: dict[str, Any] = {}
    real = native.load_batch

    def capture(*args: Any, **kw: Any) -> Any:
        captured.update(args=args, kw=kw)
        return real(*args, **kw)

    native.load_batch = capture
    try:
        python_engine_load(bench.adapter, keys, dst, size)
    finally:
        native.load_batch = real
    return Floor(real, captured["args"], captured["kw"])


def _stored(size: int, work: Path, names: tuple[str, ...]) -> tuple[dict[str, Any], ...]:
    """Each adapter of ``names`` with 32 chunks stored: (benches, keys, src, dst)."""
    n = 32
    benches = {name: B.Bench(name, B._spec(name, work, size, 4 * n), size, n) for name in names}
    keys, dst, src = {}, {}, {}
    for name, b in benches.items():
        src[name] = b.data.make_memory_objects(b.buf, n, size, 0, fill_offset=1)
        keys[name] = B._keys(n, 0, name)
        b.store(keys[name], src[name])
        dst[name] = b.data.make_memory_objects(b.buf, n, size, n * size, fill_offset=3)
    ENGINES.add("native (C)" if native_engine(benches["fstier"].adapter) is not None else "python")
    return benches, keys, src, dst


def run_size(size: int, reps: int, work: Path) -> dict[str, float]:
    n = 32
    benches, keys, src, dst = _stored(size, work, ("fs_native", "fstier"))
    floor = make_floor(benches["fstier"], keys["fstier"], dst["fstier"], size)
    want = {name: [bytes(x.byte_array) for x in src[name]] for name in benches}

    def target(variant: str) -> str:  # whose files and memory objects a variant loads
        return "fs_native" if variant == "fs_native" else "fstier"

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for r in range(reps):
            for v in VARIANTS[r % 2:] + VARIANTS[:r % 2]:  # alternate who goes first
                for x in dst[target(v)]:
                    x.raw_data.zero_()  # stale bytes would show
                t = time.perf_counter()
                if v in ("fs_native", "fstier"):
                    _, _, bits = benches[v]._load(keys[v], dst[v])
                    assert bits.popcount() == n, f"{v}: not every chunk loaded"
                else:
                    floor.load(v == "floor")
                times[v].append(time.perf_counter() - t)
                if [bytes(x.byte_array) for x in dst[target(v)]] != want[target(v)]:
                    raise SystemExit(f"{v}: loaded bytes differ from what was stored")
    finally:
        floor.close()
        for b in benches.values():
            b.close()
    return {v: statistics.median(ts) * 1e6 for v, ts in times.items()}


def _switches() -> dict[int, tuple[int, int, int]]:
    """Each thread of this process: (voluntary, involuntary) context switches
    and nanoseconds on a CPU (the scheduler's own count, ``schedstat``) so far."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                lines = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                on_cpu = int(f.read().split()[0])
        except OSError:
            continue  # a thread that exited
        out[int(tid)] = (int(lines["voluntary_ctxt_switches"]), int(lines["nonvoluntary_ctxt_switches"]), on_cpu)
    return out


def _comm(tid: int) -> str:
    """A thread Python does not know (a C thread) by its kernel name: the C
    engine names its workers ``fstier-cread`` / ``fstier-cwrite`` and its
    watchdog ``fstier-cwatch``."""
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "(exited)"


def timeline(size: int, reps: int, work: Path, cold: bool = False) -> list[str]:
    """Where one warm fstier task's time goes (module docstring, ``--timeline``;
    ``cold``: each task after what the ratio loop does between tasks)."""
    n = 32
    benches, keys, src, dst = _stored(size, work, ("fstier",))
    want = [bytes(x.byte_array) for x in src["fstier"]]
    b = benches["fstier"]
    a, k, d = b.adapter, keys["fstier"], dst["fstier"]
    efd = a.get_load_event_fd()
    cols = ("submit", "wait", "collect", "total", "caller_cpu_submit", "caller_cpu_collect", "process_cpu")
    got: dict[str, list[int]] = {c: [] for c in cols}
    (space,) = a._open_spaces()
    tier = space.tier
    engine_s: list[float] = []
    real_finished, real_submit = tier.get_finished, tier.submit_load
    marks: dict[str, int] = {}  # when the adapter called the tier, when the tier called the engine, ...

    def finished() -> list[Any]:  # the job's own time, engine submit to publish (JobResult.seconds)
        t = time.perf_counter_ns()
        out = real_finished()
        marks["finished"] = marks.get("finished", 0) + time.perf_counter_ns() - t
        engine_s.extend(r.seconds for r in out if r.kind == "load")
        return out

    def submit_load(*args: Any, **kw: Any) -> Any:
        marks["tier"] = time.perf_counter_ns()
        return real_submit(*args, **kw)

    tier.get_finished, tier.submit_load = finished, submit_load
    engine = native_engine(a)
    if engine is not None:  # the C engine: when its submit call starts
        engine._ext = _Capture(engine._ext, marks)
    parts = ("adapter_before_tier", "tier_before_engine", "tier_collect")
    split: dict[str, list[int]] = {c: [] for c in parts}
    try:
        for _ in range(5):
            b._load(k, d)
        before = _switches()
        for _ in range(reps):
            if cold:
                _between_tasks(d)
            p0, c0, t0 = time.process_time_ns(), time.thread_time_ns(), time.perf_counter_ns()
            tid = a.submit_load_task(k, d)
            t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            bits = None
            while bits is None:
                wait_fd(efd)
                t2, c2 = time.perf_counter_ns(), time.thread_time_ns()
                bits = a.query_load_result(tid)
            t3, c3, p3 = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
            assert bits.popcount() == n, "fstier: not every chunk loaded"
            if cold and [bytes(x.byte_array) for x in d] != want:
                raise SystemExit("fstier: loaded bytes differ from what was stored")
            for c, v in zip(cols, (t1 - t0, t2 - t1, t3 - t2, t3 - t0, c1 - c0, c3 - c2, p3 - p0), strict=True):
                got[c].append(v)
            if "engine" in marks:
                split["adapter_before_tier"].append(marks["tier"] - t0)
                split["tier_before_engine"].append(marks["engine"] - marks["tier"])
            split["tier_collect"].append(marks.pop("finished", 0))
        after = _switches()
        names = {tid: _comm(tid) for tid in after}  # before the engine's threads exit with the adapter
        names.update((t.native_id, t.name) for t in threading.enumerate() if t.native_id is not None)
    finally:
        if engine is not None:
            engine._ext = engine._ext._ext
        b.close()
    main_id = threading.main_thread().native_id
    rows = [f"{c}: {statistics.median(v) / 1e3:.0f} us" for c, v in got.items()]
    rows += [f"  of which {c}: {statistics.median(v) / 1e3:.0f} us" for c, v in split.items() if v]
    in_engine = statistics.median(engine_s[-reps:]) * 1e6
    rows.insert(4, f"job in the engine (its submit to its completion): {in_engine:.0f} us")
    woken: dict[str, list[float]] = {}
    for tid, (vol, invol, cpu) in after.items():
        v0, i0, c0 = before.get(tid, (0, 0, 0))
        if vol == v0 and invol == i0:
            continue
        who = "caller" if tid == main_id else names[tid]
        agg = woken.setdefault(who, [0.0, 0.0, 0.0, 0.0])
        agg[0] += 1
        agg[1] += (vol - v0) / reps
        agg[2] += (invol - i0) / reps
        agg[3] += (cpu - c0) / 1e3 / reps
    rows.append("per task, each thread that ran: context switches (voluntary: it slept and was woken; "
                "involuntary: preempted) and time on a CPU")
    for who, (threads, per_vol, per_invol, per_cpu) in sorted(woken.items()):
        rows.append(f"  {who}: {threads:.0f} thread(s), {per_vol:.2f} voluntary, {per_invol:.2f} involuntary, "
                    f"{per_cpu:.0f} us CPU")
    return rows


def _between_tasks(dst: list[Any]) -> None:
    """What the ratio loop does between two tasks: the objects zeroed, their bytes compared."""
    for x in dst:
        x.raw_data.zero_()
    junk = [bytes(x.byte_array) for x in dst] * 2
    del junk


def steps(size: int, reps: int, work: Path, cold: bool = False) -> list[str]:
    """The caller's CPU per step of a warm fstier task (``--steps``): a
    thread-CPU timer around each of the adapter's steps and the tier's two
    calls (the timers add ~1 us each); ``cold`` as for :func:`timeline`."""
    import fstier.integrations.lmcache as lmc

    n = 32
    benches, keys, src, dst = _stored(size, work, ("fstier",))
    b = benches["fstier"]
    a, k, d = b.adapter, keys["fstier"], dst["fstier"]
    want = [bytes(x.byte_array) for x in src["fstier"]]
    (space,) = a._open_spaces()
    acc: dict[str, int] = {}

    def timed(name: str, fn: Any) -> Any:
        def run(*args: Any, **kw: Any) -> Any:
            t = time.thread_time_ns()
            try:
                return fn(*args, **kw)
            finally:
                acc[name] = acc.get(name, 0) + time.thread_time_ns() - t
        return run

    real_sig = lmc.one_signature
    wrapped = [
        (a, "_resolve", "adapter: _resolve"), (a._reg, "acquire", "adapter: Spaces.acquire"),
        (space.keys, "block_keys", "adapter: KeyMemo.block_keys"), (a._arena, "lend", "adapter: L1Arena.lend"),
        (space.tier, "submit_load", "tier: submit_load (the C call in it)"),
        (space.tier, "get_finished", "tier: get_finished"), (space.slots, "release", "adapter: LentSlots.release"),
        (a, "_publish", "adapter: _publish"), (a, "_notify_keys_accessed", "LMCache: _notify_keys_accessed"),
        (a, "submit_load_task", "the caller's submit"), (a, "query_load_result", "the caller's collect"),
    ]
    lmc.one_signature = timed("adapter: one_signature", real_sig)  # type: ignore[assignment]
    for obj, attr, name in wrapped:
        setattr(obj, attr, timed(name, getattr(obj, attr)))
    per: dict[str, list[int]] = {}
    try:
        for i in range(reps + 5):
            if cold:
                _between_tasks(d)
            acc.clear()
            _, _, bits = b._load(k, d)
            assert bits.popcount() == n, "fstier: not every chunk loaded"
            if cold and [bytes(x.byte_array) for x in d] != want:
                raise SystemExit("fstier: loaded bytes differ from what was stored")
            if i >= 5:
                for name, v in acc.items():
                    per.setdefault(name, []).append(v)
    finally:
        lmc.one_signature = real_sig  # type: ignore[assignment]
        b.close()
    return [f"{name}: {statistics.median(v) / 1e3:.1f} us CPU" for name, v in per.items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-kib", default="256,1024,2048")
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--workdir", default=None, help="directory for the roots (default: the temp dir)")
    p.add_argument("--timeline", action="store_true", help="where one fstier task's time goes (docstring)")
    p.add_argument("--cold", action="store_true",
                   help="--timeline, --steps: each task after the ratio loop's work between tasks (docstring)")
    p.add_argument("--steps", action="store_true", help="the caller's CPU per step of a task (docstring)")
    a = p.parse_args(argv)
    from fstier.io import native

    path = native.status().backend
    if path != "native":  # the floor is the adapter's native call: on the Python path there is none
        print(f"bench_lmcache_floor.py: fstier's I/O path here is {path} ({native.status().reason}); "
              "the floor replays the adapter's native load call: build the extension and unset FSTIER_NATIVE=0",
              file=sys.stderr)
        return 2
    before = os.getloadavg()[0]
    rows: list[tuple[int, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-lmcache-floor-", dir=a.workdir) as tmp:
        for kib in (int(x) for x in a.sizes_kib.split(",")):
            work = Path(tmp) / f"{kib}k"
            work.mkdir()
            if a.steps:
                rows.append((kib, steps(kib << 10, a.reps, work, a.cold)))
            elif a.timeline:
                rows.append((kib, timeline(kib << 10, a.reps, work, a.cold)))
            else:
                rows.append((kib, run_size(kib << 10, a.reps, work)))
    print(f"engine {', '.join(sorted(ENGINES))}; load average before {before:.2f}, after {os.getloadavg()[0]:.2f} "
          f"({os.cpu_count()} CPUs); 32 chunks per task, warm")
    if a.timeline or a.steps:
        for kib, lines in rows:
            print(f"{kib} KiB, median per task over {a.reps}:")
            print("\n".join("  " + line for line in lines))
        return 0
    print("median us per task (ratio: fs_native / it, >1 is faster)")
    print()
    print("| chunk | " + " | ".join(VARIANTS) + " |")
    print("| --- | " + " | ".join("---:" for _ in VARIANTS) + " |")
    for kib, us in rows:
        cells = [f"{us[v]:.0f} ({us['fs_native'] / us[v]:.2f}x)" for v in VARIANTS]
        print(f"| {kib} KiB | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
