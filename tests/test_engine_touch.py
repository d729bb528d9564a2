"""The recency flush on the C engine is a C job (``engine_touch``): its
worker touches the files, no Python thread runs it, and with it no Python
thread of the native path does I/O: a tier's stores, loads (a corrupt file
among them, removed in C), a store into a namespace removed under it and a
due flush run with only the main thread and the engine's completion thread
(no ``-call`` or ``fstier-io-*`` thread), no Python-level I/O on any thread
(an audit hook: ``open``, ``os.utime``, ``os.remove``, ``os.mkdir``, ...; run
in a child process, since a hook cannot be removed), and, while the flush's
first touch is held in the C fault seam, no Python thread's stack is in a
touch. The flush keeps its semantics (test_recency_batch.py runs both
paths) and its deadline: one held past it is finished as timed out and its
late return logged."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from manager_support import keys, open_tier, store

from fstier.clock import ManualClock
from fstier.io import native
from fstier.io.engine.native import available
from fstier.tier.recency import FLUSH_S

pytestmark = pytest.mark.skipif(
    not available() or os.environ.get("FSTIER_NATIVE") == "0",
    reason="the native extension is not built, or FSTIER_NATIVE=0 forces the Python I/O path",
)

CHILD = r'''
import json, os, shutil, sys, threading, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
IO = {"open", "os.utime", "os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.link", "os.symlink",
      "os.truncate", "os.chmod", "os.chown", "os.listdir", "os.scandir", "os.walk"}
seen, on = [], [False]


def hook(ev, args):
    if on[0] and ev in IO:
        seen.append([threading.current_thread().name, ev])


sys.addaudithook(hook)
from fstier.clock import ManualClock
from fstier.io import native
from fstier.tier.recency import FLUSH_S
from manager_support import keys, load, open_tier, store

TOUCH = {"touch_many", "touch_batch", "_bump_mtimes", "touch_file"}
clock = ManualClock()
out = {}
with open_tier(Path(sys.argv[1]), clock=clock, native_io="on") as t:
    out["engine"] = type(t._engine.engine).__name__
    assert store(t, "s0", keys(100, 2)).success
    shutil.rmtree(t.blocks.mapper.namespace_dir)
    on[0] = True
    out["restored"] = store(t, "s1", keys(100, 2)).success  # made again in C
    ks = keys(0, 8)
    assert store(t, "s", ks).success
    on[0] = False
    paths = [Path(t.blocks.path(k)) for k in ks]
    for p in paths:
        os.utime(p, (1_000_000, 1_000_000))
    raw = bytearray(paths[7].read_bytes())
    raw[4096] ^= 0xFF
    paths[7].write_bytes(bytes(raw))
    on[0] = True
    out["l1"] = load(t, "l1", ks[:7]).success
    t.submit_load("l2", ks[7:], [60])
    t.drain()
    out["corrupt_removed"] = not paths[7].exists()
    clock.advance(FLUSH_S + 1)
    native.fault("touch", delay_s=0.6, times=1)  # the flush's first touch, held in C
    t.touch(ks[:7])  # due: the flush job is submitted
    in_touch, end = [], time.monotonic() + 0.4
    while time.monotonic() < end:
        for tid, frame in sys._current_frames().items():
            f = frame
            while f is not None:
                if f.f_code.co_name in TOUCH:
                    in_touch.append(f.f_code.co_name)
                f = f.f_back
        time.sleep(0.01)
    end = time.monotonic() + 10
    while time.monotonic() < end and not all(p.stat().st_mtime > 1_000_000 for p in paths[:7]):
        time.sleep(0.01)
    on[0] = False
    out["held_open"] = native.fault_count("touch") >= 1
    out["bumped"] = [p.stat().st_mtime > 1_000_000 for p in paths[:7]]
    out["in_touch"] = sorted(set(in_touch))
    out["threads"] = sorted({th.name for th in threading.enumerate()})
out["seen"] = sorted({tuple(s) for s in seen})
print(json.dumps(out))
'''


def test_no_python_thread_does_io_on_the_native_path(tmp_path: Path) -> None:
    tests = str(Path(__file__).parent)
    env = {**os.environ, "FSTIER_ENGINE": "native"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "root"), tests], env=env, capture_output=True, text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["engine"] == "NativeEngine"
    assert got["l1"] and got["corrupt_removed"] and got["restored"] and got["held_open"]
    assert got["bumped"] == [True] * 7
    assert got["in_touch"] == [], "a Python thread ran the flush"
    assert got["threads"] == ["MainThread", "fstier-engine-complete"]
    assert got["seen"] == [], "Python-level I/O on the native path"


def test_a_flush_past_its_deadline_is_timed_out_and_its_late_return_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("FSTIER_ENGINE", "native")
    clock = ManualClock()
    with open_tier(tmp_path / "root", clock=clock, native_io="on", io_timeout_s=0.2) as t:
        ks = keys(0, 3)
        assert store(t, "s", ks).success
        paths = [Path(t.blocks.path(k)) for k in ks]
        for p in paths:
            os.utime(p, (1_000_000, 1_000_000))
        engine = t._engine.engine
        timeouts = engine.timeouts
        clock.advance(FLUSH_S + 1)
        native.fault("touch", delay_s=1.0, times=1)
        try:
            with caplog.at_level(logging.WARNING, logger="fstier.io"):
                t.touch(ks)
                end = time.monotonic() + 10
                while time.monotonic() < end and engine.timeouts == timeouts:
                    time.sleep(0.01)
                assert engine.timeouts > timeouts, "the flush was not given up on at its deadline"
                assert engine.stuck_threads == 1
                end = time.monotonic() + 10
                while time.monotonic() < end and not any("late call job" in r.getMessage() for r in caplog.records):
                    time.sleep(0.01)
        finally:
            native.clear_faults()
        assert [r.getMessage() for r in caplog.records if "late call job" in r.getMessage()] == [
            "late call job ('recency', 1) returned after its deadline"
        ]
        assert engine.stuck_threads == 0
        assert paths[0].stat().st_mtime > 1_000_000, "the held touch still ran when its open returned"
        assert [p.stat().st_mtime for p in paths[1:]] == [1_000_000] * 2, "names after the deadline ran"
