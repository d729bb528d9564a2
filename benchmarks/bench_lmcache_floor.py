"""How close can fstier's LMCache adapter get to LMCache's ``fs_native`` on a
warm load? The floor of fstier's own load path, measured beside both.

One process, the same machine moment, tasks interleaved; for each chunk size
32 chunks are stored through LMCache's ``fs_native`` adapter and through
``FstierL2Adapter`` (bench_lmcache.py's harness: LMCache's factory, L1 buffer
and memory objects), then loaded warm (from the page cache) over and over as:

* **fs_native**: LMCache's C++ adapter (no checksum);
* **fstier**: fstier's adapter, the whole task: LMCache's submit, the
  adapter, ``FsTier``'s job and I/O pool, the native call, the eventfd,
  the result; on the Python engine (``FSTIER_ENGINE=python``, set here:
  the C engine makes no batch call to capture);
* **floor**: the SAME native call the adapter made (captured from it:
  names, buffers, options, helper threads; XXH3 checked; under the C
  engine, ``FSTIER_ENGINE=native``, which makes no such call, the one the
  Python engine makes for the same task) run by one waiting
  Python thread that writes an eventfd, the caller polling it as LMCache
  does: everything fstier's job path adds removed. No job path of fstier
  can load faster than this with checksums on;
* **floor_unchecked**: the floor without the checksum (what the hash costs).

Every load's bytes are compared with what was stored (a wrong byte fails
the run). Prints the median microseconds per task and each one's ratio to
``fs_native`` (>1: faster), with the load average before and after.

    DO_NOT_TRACK=1 .venv-lmcache/bin/python benchmarks/bench_lmcache_floor.py --sizes-kib 256,1024,2048
"""

from __future__ import annotations

import argparse
import dataclasses
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


class Floor:
    """A waiting thread that runs one captured native call per task and
    writes an eventfd, as the cheapest job path around that call would."""

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

    def load(self, checked: bool) -> list[Any]:
        self.checked = checked
        self.go.release()
        poller = select.poll()
        poller.register(self.efd, select.POLLIN)
        poller.poll(60_000)
        os.eventfd_read(self.efd)
        return self.out.pop()

    def close(self) -> None:
        self.stop = True
        self.go.release()
        self.thread.join()
        os.close(self.efd)


def python_engine_load(adapter: Any, keys: list[Any], objs: list[Any], size: int) -> None:
    """The native call the Python engine makes for this warm load task
    (the C engine runs the same per-key work in its own workers): one
    ``load_many`` with the helpers its plan gives 32 keys on idle threads."""
    from fstier.integrations.lmcache_space import block_keys_of
    from fstier.io.engine.record import plan

    (space,) = adapter._open_spaces()
    blocks = space.tier.blocks
    bkeys = block_keys_of(keys)
    helpers = plan(len(bkeys), adapter.tier_config.read_threads, True)[1]
    outs = blocks.load_many(list(zip(bkeys, adapter._arena.views_of(objs, size), strict=True)), helpers=helpers)
    assert all(o.status.name == "LOADED" for o in outs), outs


def run_size(size: int, reps: int, work: Path) -> dict[str, float]:
    from fstier.io import native

    n = 32
    benches = {name: B.Bench(name, B._spec(name, work, size, 4 * n), size, n) for name in ("fs_native", "fstier")}
    keys, dst, src = {}, {}, {}
    for name, b in benches.items():
        src[name] = b.data.make_memory_objects(b.buf, n, size, 0, fill_offset=1)
        keys[name] = B._keys(n, 0, name)
        b.store(keys[name], src[name])
        dst[name] = b.data.make_memory_objects(b.buf, n, size, n * size, fill_offset=3)
    # Capture the adapter's own native call (one warm load through it).
    captured: dict[str, Any] = {}
    real = native.load_batch

    def capture(*args: Any, **kw: Any) -> Any:
        captured.update(args=args, kw=kw)
        return real(*args, **kw)

    native.load_batch = capture
    try:
        benches["fstier"]._load(keys["fstier"], dst["fstier"])
        if "args" not in captured:  # the C engine makes no load_batch call: the Python engine's one
            python_engine_load(benches["fstier"].adapter, keys["fstier"], dst["fstier"], size)
    finally:
        native.load_batch = real
    floor = Floor(real, captured["args"], captured["kw"])
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
                    outs = floor.load(v == "floor")
                    assert all(o.status.name == "LOADED" for o in outs), outs
                times[v].append(time.perf_counter() - t)
                if [bytes(x.byte_array) for x in dst[target(v)]] != want[target(v)]:
                    raise SystemExit(f"{v}: loaded bytes differ from what was stored")
    finally:
        floor.close()
        for b in benches.values():
            b.close()
    return {v: statistics.median(ts) * 1e6 for v, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-kib", default="256,1024,2048")
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--workdir", default=None, help="directory for the roots (default: the temp dir)")
    a = p.parse_args(argv)
    from fstier.io import native

    path = native.status().backend
    if path != "native":  # the floor is the adapter's native call: on the Python path there is none
        print(f"bench_lmcache_floor.py: fstier's I/O path here is {path} ({native.status().reason}); "
              "the floor replays the adapter's native load call: build the extension and unset FSTIER_NATIVE=0",
              file=sys.stderr)
        return 2
    # The floor replays the Python engine's batch call (native.load_batch); the C engine, the default on
    # the native path, makes none to capture: this benchmark measures the adapter on the Python engine.
    engine = os.environ.setdefault("FSTIER_ENGINE", "python")
    if engine != "python":
        print(f"bench_lmcache_floor.py: FSTIER_ENGINE={engine}; the floor replays the adapter's native load "
              "call of the Python engine (the C engine makes none): unset FSTIER_ENGINE", file=sys.stderr)
        return 2
    before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-lmcache-floor-", dir=a.workdir) as tmp:
        for kib in (int(x) for x in a.sizes_kib.split(",")):
            work = Path(tmp) / f"{kib}k"
            work.mkdir()
            rows.append((kib, run_size(kib << 10, a.reps, work)))
    print(f"load average before {before:.2f}, after {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs); "
          f"32 chunks per task, warm; median us per task (ratio: fs_native / it, >1 is faster)")
    print()
    print("| chunk | " + " | ".join(VARIANTS) + " |")
    print("| --- | " + " | ".join("---:" for _ in VARIANTS) + " |")
    for kib, us in rows:
        cells = [f"{us[v]:.0f} ({us['fs_native'] / us[v]:.2f}x)" for v in VARIANTS]
        print(f"| {kib} KiB | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
