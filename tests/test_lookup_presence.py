"""Presence (``FsTier.lookup`` / ``present``) on both I/O paths: one probe
call per batch, the same answers for every hostile thing at a block path,
no hit through a symlinked fan-out directory, a clear error for a non-list,
and a caller never held past the per-I/O deadline by a hung probe."""

from __future__ import annotations

import math
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
from manager_support import keys, open_tier, store

from fstier.io import native

PATHS = pytest.mark.parametrize("native_io", ["auto", "off"])


@PATHS
def test_the_first_lookup_starts_no_thread(tmp_path: Path, native_io: str) -> None:
    """Every thread a lookup needs runs once the tier is built: the first
    present()/lookup() starts none. A lookup pool once started at the first
    probe, on vLLM's lookup thread: three thread starts, each waiting for
    the GIL that an in-process engine's scheduler (which never sleeps)
    holds, cost the first prompt after a restart 28-34 ms (docs/vllm.md
    "Time to first token"). Now no lookup thread exists at all: the native
    probe runs on the caller's thread (its deadline in C), the Python one
    as a probe job of the tier's engine, whose threads run since the tier
    was built; closing the tier stops them."""
    engine_threads: set[threading.Thread] = set()
    with open_tier(tmp_path / "root", native_io=native_io, lookup_cache_ttl_s=0) as t:
        ks = keys(0, 4)
        assert store(t, "s", ks).success
        lookup_threads = [th for th in threading.enumerate() if th.name.startswith("fstier-lookup")]
        assert not lookup_threads, f"a lookup thread runs: {sorted(th.name for th in lookup_threads)}"
        engine_threads = {th for th in threading.enumerate() if th.name.startswith("fstier-")}
        before = set(threading.enumerate())
        assert t.present(ks + keys(50, 2)) == [True] * 4 + [False] * 2
        assert t.lookup(ks) == 4
        started = set(threading.enumerate()) - before
        assert not started, f"the first lookup started {sorted(th.name for th in started)}"
    for th in engine_threads:
        th.join(5)
        assert not th.is_alive(), f"{th.name} still runs after close()"


def test_native_probe_runs_on_the_callers_thread(tmp_path: Path, monkeypatch) -> None:
    """Native presence: ONE native call per batch, made on the caller's own
    thread (the deadline is kept in C), no Python thread in between: each
    hand-off to a Python lookup thread and back cost a GIL acquisition, up
    to the switch interval behind a scheduler that never sleeps."""
    if native.status("auto").backend != "native":
        pytest.skip("the native I/O path is off here (FSTIER_NATIVE=0, or the extension is not built)")
    calls: list[int] = []
    real = native.lookup_within

    def spy(*args, **kw):
        calls.append(threading.get_ident())
        return real(*args, **kw)

    monkeypatch.setattr(native, "lookup_within", spy)
    with open_tier(tmp_path / "root", native_io="on", lookup_cache_ttl_s=0) as t:
        ks = keys(0, 6)
        assert store(t, "s", ks[:4]).success
        before = threading.active_count()
        assert t.present(ks) == [True] * 4 + [False] * 2
        assert t.lookup(ks) == 4
        assert calls == [threading.get_ident()] * 2, calls
        assert threading.active_count() == before
        assert native.lookup_stuck() == 0


def test_native_probes_stuck_past_the_deadline_are_bounded(tmp_path: Path) -> None:
    """A dead mount: each probe returns None at the deadline and leaves its C
    thread in the system call; while 4 are stuck, a probe starts no thread
    and answers None at once; once they return, they free themselves and
    presence answers again."""
    if native.status("auto").backend != "native":
        pytest.skip("the native I/O path is off here (FSTIER_NATIVE=0, or the extension is not built)")
    with open_tier(tmp_path / "root", native_io="on", lookup_cache_ttl_s=0) as t:
        ks = keys(0, 1)
        assert store(t, "s", ks).success
        native.fault("stat", delay_s=2.0, times=4)
        try:
            for _ in range(4):
                t0 = time.monotonic()
                assert t.blocks.present_within(ks, timeout_s=0.05) is None
                assert time.monotonic() - t0 < 1.5
            assert native.lookup_stuck() == 4
            calls = native.fault_count("stat")
            t0 = time.monotonic()
            assert t.blocks.present_within(ks, timeout_s=5.0) is None  # at once: no fifth thread
            assert time.monotonic() - t0 < 1.0 and native.fault_count("stat") == calls
        finally:
            native.clear_faults()
        deadline = time.monotonic() + 30
        while native.lookup_stuck() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert native.lookup_stuck() == 0
        assert t.blocks.present_within(ks, timeout_s=5.0) == [True]
        assert t.lookup(ks) == 1


def _kernel_at_least(major: int, minor: int) -> bool:
    release = os.uname().release.split(".")
    try:
        return (int(release[0]), int(release[1].split("-")[0])) >= (major, minor)
    except (IndexError, ValueError):
        return False


def test_a_probe_the_caches_answer_keeps_the_gil(tmp_path: Path) -> None:
    """A native probe of files whose entries the kernel has cached is
    answered on the caller's thread without releasing the GIL (openat2's
    RESOLVE_CACHED, statx's AT_STATX_DONT_SYNC): a caller that let the GIL go
    waits up to the switch interval (5 ms) to take it back from a thread
    that runs Python without a pause (vLLM's in-process scheduler), which
    every prompt's lookup paid. Seen as: a Python thread spinning beside the
    prober gets no bytecode in during a cached probe, and does during a
    probe that must wait (fault injection sends it down the slow path). Only
    on a local filesystem: on FUSE, NFS or CephFS a cached entry can name a
    file another host removed (tests/sharedfs/test_cross_host.py
    ::test_cli_from_the_other_host), so a probe there always asks."""
    if native.status("auto").backend != "native":
        pytest.skip("the native I/O path is off here (FSTIER_NATIVE=0, or the extension is not built)")
    if not _kernel_at_least(5, 12):
        pytest.skip("openat2's RESOLVE_CACHED needs Linux 5.12")
    with open_tier(tmp_path / "root", native_io="on", lookup_cache_ttl_s=0) as t:
        caps = t.blocks.options.capabilities
        if caps is None or not caps.coherent_cache:
            pytest.skip(f"{tmp_path} is not on a local filesystem fstier trusts the caches of (COHERENT_CACHE_FS)")
        ks = keys(0, 16)
        assert store(t, "s", ks).success
        assert t.blocks.present_within(ks, timeout_s=5.0) == [True] * 16  # entries cached
        counter = [0]
        stop = threading.Event()

        def spin() -> None:
            while not stop.is_set():
                counter[0] += 1

        def probes(n: int, trust_caches: bool = True) -> int:
            moved = 0
            for _ in range(n):
                before = counter[0]
                if trust_caches:
                    assert t.blocks.present_within(ks, timeout_s=5.0) == [True] * 16
                else:  # a root on FUSE, NFS or CephFS: its caches are not the truth
                    base, paths = str(t.blocks.mapper.blocks_dir), t.blocks.paths(ks)
                    assert native.lookup_within(base, paths, prefix=True, timeout_s=5.0) == [True] * 16
                moved += counter[0] != before
            return moved

        spinner = threading.Thread(target=spin, daemon=True)
        spinner.start()
        try:
            while counter[0] == 0:
                time.sleep(0.001)
            cached = probes(200)
            untrusted = probes(200, trust_caches=False)
            native.fault("stat", delay_s=0.002, times=-1)
            try:
                slow = probes(20)
            finally:
                native.clear_faults()
        finally:
            stop.set()
            spinner.join(5)
        # A cached probe lets the spinner in only where the interpreter's own
        # switch interval falls (about one call in 50); a waiting one at every call.
        assert cached <= 100, f"the spinner ran during {cached} of 200 cached probes: the GIL was released"
        assert slow >= 1, "the spinner never ran during a probe that waits: the check cannot see a release"
        assert untrusted > cached, f"a probe not told to trust the caches kept the GIL ({untrusted} vs {cached})"


@PATHS
def test_a_symlinked_fan_out_directory_is_a_miss(tmp_path: Path, native_io: str) -> None:
    """A fan-out directory swapped for a symlink to a copy outside the root:
    the files behind it are not hits (lookup and present stat'ed through the
    link and reported hits whose load then missed)."""
    with open_tier(tmp_path / "root", native_io=native_io, lookup_cache_ttl_s=0) as t:
        ks = keys(0, 4)
        assert store(t, "s", ks).success
        assert t.lookup(ks) == 4 and t.present(ks) == [True] * 4
        fan = Path(t.blocks.path(ks[0])).parent
        outside = tmp_path / "outside"
        shutil.copytree(fan, outside)
        shutil.rmtree(fan)
        fan.symlink_to(outside, target_is_directory=True)
        assert (fan / Path(t.blocks.path(ks[0])).name).is_file()  # reachable through the link
        assert t.lookup(ks[:1]) == 0
        assert t.present(ks)[0] is False


@PATHS
def test_a_namespace_directory_swapped_for_a_symlink_is_all_misses(tmp_path: Path, native_io: str) -> None:
    """The blocks directory itself (the namespace's) swapped for a symlink to a
    copy outside the root: no key is a hit, on either I/O path, and on the
    native one neither through the probe the kernel's caches answer (its
    base opened RESOLVE_NO_SYMLINKS | RESOLVE_CACHED) nor the slow probe."""
    with open_tier(tmp_path / "root", native_io=native_io, lookup_cache_ttl_s=0) as t:
        ks = keys(20, 4)
        assert store(t, "s", ks).success
        blocks = t.blocks.mapper.blocks_dir
        outside = tmp_path / "outside"
        shutil.copytree(blocks, outside)
        shutil.rmtree(blocks)
        blocks.symlink_to(outside, target_is_directory=True)
        paths = t.blocks.paths(ks)
        assert all(os.path.isfile(p) for p in paths)  # reachable through the link
        assert t.lookup(ks) == 0 and t.present(ks) == [False] * 4
        if native.status("auto").backend == "native":
            for cached in (True, False):
                got = native.lookup_batch(str(blocks), paths, prefix=False, cached=cached)
                assert got == [False] * 4, cached


@PATHS
def test_hostile_things_at_a_block_path_are_misses(tmp_path: Path, native_io: str, monkeypatch) -> None:
    with open_tier(tmp_path / "root", native_io=native_io, lookup_cache_ttl_s=0) as t:
        ks = keys(10, 5)
        assert store(t, "s", ks[:1]).success
        paths = [Path(t.blocks.path(k)) for k in ks]
        for p in paths[1:]:
            p.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(paths[1])
        s = socket.socket(socket.AF_UNIX)
        try:
            monkeypatch.chdir(paths[2].parent)  # a block path is longer than sun_path
            s.bind(paths[2].name)
            paths[3].mkdir()
            paths[4].symlink_to(paths[0])
            assert t.present(ks) == [True, False, False, False, False]
            assert t.lookup(ks) == 1
            assert t.lookup(ks[1:]) == 0
        finally:
            s.close()


def test_lookup_of_a_non_list_is_the_same_clear_error_as_submit(tmp_path: Path) -> None:
    """lookup(None) answered 0 where submit_load(None) raised."""
    with open_tier(tmp_path / "root") as t:
        for call in (t.lookup, t.present, lambda ks: t.submit_load("j", ks, [0])):
            with pytest.raises(ValueError, match="keys must be a list or tuple, got NoneType"):
                call(None)
        with pytest.raises(ValueError, match="got str"):
            t.lookup("abc")
        assert t.lookup([]) == 0 and t.present([]) == []


@PATHS
def test_a_hung_probe_returns_within_the_deadline(tmp_path: Path, native_io: str, monkeypatch) -> None:
    """A probe stuck in the filesystem (a dead mount) holds the caller at
    most io_timeout_s: the keys are misses, the timeout is counted, the
    answer is not cached, and the next lookup probes again."""
    timeout = 0.3
    with open_tier(tmp_path / "root", native_io=native_io, io_timeout_s=timeout, lookup_cache_ttl_s=0) as t:
        ks = keys(20, 3)
        assert store(t, "s", ks).success
        if t.blocks.batched:
            native.fault("stat", delay_s=3.0, times=1)
        else:
            import fstier.io.blockstore as bs

            real = bs._present_python
            calls = []

            def slow(*args):  # (prefix, paths, prefix_only): whatever the real one takes
                if not calls:
                    calls.append(args)
                    time.sleep(3.0)
                return real(*args)

            monkeypatch.setattr(bs, "_present_python", slow)
        try:
            t0 = time.monotonic()
            assert t.lookup(ks) == 0
            took = time.monotonic() - t0
            assert took < timeout + 1.2, f"lookup held the caller {took:.2f}s"
            assert t.metrics.failures.values().get("timeout") == 1
            assert t.lookup(ks) == 3  # not cached as absent: probed again
        finally:
            if t.blocks.batched:
                native.clear_faults()


@PATHS
def test_keys_after_a_prefix_miss_are_not_cached_as_misses(tmp_path: Path, native_io: str) -> None:
    """lookup([k1, k0]) stops at k1 (absent) and never probes k0; a lookup of
    [k0] right after must still find it (the keys after the stop were once
    cached as misses for lookup_cache_ttl_s: found by test_manager_state.py's
    state machine, k0 stored, restart, lookup [k1, k0] -> 0, lookup [k0] -> 0)."""
    root = tmp_path / "root"
    k0, k1 = keys(0, 2)
    with open_tier(root, native_io=native_io) as tier:
        assert store(tier, "s", [k0]).success
    with open_tier(root, native_io=native_io, lookup_cache_ttl_s=60) as tier:
        assert tier.lookup([k1, k0]) == 0
        assert tier.lookup([k0]) == 1
        assert tier.present([k1, k0]) == [False, True]


#: Deadlines at and past 2**63 ns (threading.TIMEOUT_MAX): the native probe
#: computed a negative tv_nsec from them and spun on EINVAL, holding its mutex.
HUGE_DEADLINES = ["2**63 / 1e9", "2.0**63", "1e300", "math.inf"]

_HUGE_CHILD = """
import math, os, sys, time
from pathlib import Path
from manager_support import keys, open_tier, store
from fstier.io import native
from fstier.tier.admission import Breaker
from fstier.tier.lookup import Lookup, LookupCache
from fstier.tier.metrics import TierMetrics

native_io, root, huge = sys.argv[1], Path(sys.argv[2]), [eval(v) for v in sys.argv[3:]]
with open_tier(root, native_io=native_io, lookup_cache_ttl_s=0) as t:
    ks = keys(0, 2)
    assert store(t, "s", ks[:1]).success
    for v in huge:
        m = TierMetrics()
        look = Lookup(LookupCache(0), t.blocks, 1, v, breaker=Breaker(8, 10.0, m), metrics=m, engine=t._engine)
        try:
            assert look.present(ks)[0] == [True, False], v
        finally:
            look.close()
        if t.blocks.batched:
            assert t.blocks.present_within(ks, timeout_s=v) == [True, False], v
            base = t.blocks.mapper.blocks_dir
            ext = native._require()  # the C entry clamps on its own, without the Python entry's clamp
            rels = native.split(os.fspath(base), t.blocks.paths(ks))
            assert ext.lookup_within(os.fsencode(base), rels, False, v) == b"\\x01\\x00", v
    if t.blocks.batched:  # a slow probe under an infinite deadline is waited for, and answers
        native.fault("stat", delay_s=0.5, times=1)
        assert t.blocks.present_within(ks, timeout_s=math.inf) == [True, False]
        native.clear_faults()
print("ok")
"""


@PATHS
def test_a_huge_or_infinite_probe_deadline_returns(tmp_path: Path, native_io: str) -> None:
    """A presence probe given a deadline at or past 2**63 ns (or inf) answers
    at once: the C entry clamps it to threading.TIMEOUT_MAX (and ends its
    wait on any error), the Python entries clamp it the same way or take inf
    as no deadline. Before: the native probe never returned and spun a core.
    Run in a child: a hang must fail the test, not wedge the suite."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    t0 = time.monotonic()
    try:
        out = subprocess.run(
            [sys.executable, "-c", _HUGE_CHILD, native_io, str(tmp_path / "root"), *HUGE_DEADLINES],
            env=env, capture_output=True, text=True, timeout=60,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"a probe with a deadline among {HUGE_DEADLINES} did not return within 60 s")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    assert time.monotonic() - t0 < 60


@PATHS
@pytest.mark.parametrize("bad", [math.nan, -1.0, -math.inf])
def test_a_nan_or_negative_probe_deadline_is_refused(tmp_path: Path, native_io: str, bad: float) -> None:
    """nan or a negative deadline is a caller's mistake: one ValueError naming
    the argument, from the C entry, the Python entry and the Lookup alike."""
    from fstier.tier.admission import Breaker
    from fstier.tier.lookup import Lookup, LookupCache
    from fstier.tier.metrics import TierMetrics

    with open_tier(tmp_path / "root", native_io=native_io) as t:
        m = TierMetrics()
        with pytest.raises(ValueError, match="timeout"):
            Lookup(LookupCache(0), t.blocks, 1, bad, breaker=Breaker(8, 10.0, m), metrics=m, engine=t._engine)
        if t.blocks.batched:
            with pytest.raises(ValueError, match="timeout_s"):
                t.blocks.present_within(keys(0, 1), timeout_s=bad)
            with pytest.raises(ValueError, match="timeout_s"):
                native._require().lookup_within(os.fsencode(t.blocks.mapper.blocks_dir), [b"x"], False, bad)
