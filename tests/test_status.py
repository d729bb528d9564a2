"""``fstier status ROOT``: what running tiers publish in a root, read back.

Real tiers on real roots: one FsTier in this process, then two FsTier
processes storing into one root; the report must agree with the disk (the
block files' sizes summed here) and name each process by host and pid.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _hung_mount import hung_mount
from click.testing import CliRunner
from manager_support import FILE_BYTES, keys, open_tier, store

from fstier.cli import main
from fstier.tier.status import read_status

TESTS = Path(__file__).resolve().parent


def run_cli(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(main, list(args), env=env)


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.bin"))


def settled(root: Path, **kw: Any) -> Any:
    """The status once the tiers' shared count is comparable with the disk
    (their usage thread publishes a settled scan a round after it)."""
    deadline = time.monotonic() + 20
    while True:
        st = read_status(root, **kw)
        if st.agree is not None or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


def test_status_of_a_local_root_agrees_with_the_disk(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with open_tier(root, max_bytes=100 * FILE_BYTES) as tier:
        tier.run_capacity_pass()
        store(tier, "a", keys(0, 5))
        tier.run_capacity_pass()  # a quiet rescan: published as a settled scan
        st = settled(root, max_bytes=100 * FILE_BYTES)
        assert st.agree is True, st.to_json()
        assert st.counts_bytes == st.scan_bytes == disk_bytes(root) == 5 * FILE_BYTES
        (inst,) = st.instances
        assert (inst.host, inst.pid, inst.state) == (socket.gethostname(), os.getpid(), "live")
        assert inst.stored_bytes == 5 * FILE_BYTES and inst.inflight_bytes == 0
        (ns,) = st.namespaces
        assert ns.namespace == tier.mapper.namespace and (ns.files, ns.bytes) == (5, 5 * FILE_BYTES)
        newest = max(p.stat().st_mtime_ns for p in root.rglob("*.bin")) / 1e9
        assert ns.last_use == newest
        assert st.problems == []
        res = run_cli("status", str(root), "--json", "--max-bytes", str(100 * FILE_BYTES))
        assert res.exit_code == 0, res.output
        doc = json.loads(res.output)
        assert doc["ok"] is True and doc["scan_bytes"] == 5 * FILE_BYTES and doc["hosts"] == [socket.gethostname()]
        # As a person sees it, within 80 columns.
        text = run_cli("status", str(root), env={"COLUMNS": "80"})
        assert text.exit_code == 0, text.output
        assert "count vs disk: agree" in text.output
        assert f"{os.getpid()}" in text.output and "live" in text.output
        long = [ln for ln in text.output.splitlines() if len(ln) > 80 and str(root) not in ln]
        assert long == [], long
        # Over the limit the operator gives: a problem, exit 1.
        over = run_cli("status", str(root), "--max-bytes", str(4 * FILE_BYTES))
        assert over.exit_code == 1 and "over max_bytes" in over.output


_WORKER = r"""
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from manager_support import keys, open_tier, store, FILE_BYTES
root, first, n, stop = Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
with open_tier(root, max_bytes=1000 * FILE_BYTES) as tier:
    store(tier, "s", keys(first, n))
    tier.run_capacity_pass()
    print("ready", flush=True)
    while not stop.exists():
        time.sleep(0.05)
    # What this instance exports: the root's limit and the live instances on it.
    end = time.monotonic() + 10
    while tier.metrics.root_instances.value < 2 and time.monotonic() < end:
        time.sleep(0.05)
    snap = tier.metrics.snapshot()
    print(snap["fstier_max_bytes"], snap["fstier_root_instances"], flush=True)
"""


def test_status_of_a_root_shared_by_two_processes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    stop = tmp_path / "stop"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(TESTS), str(root), str(first), str(n), str(stop)],
            stdout=subprocess.PIPE, text=True, env=env,
        )
        for first, n in ((0, 3), (100, 6))
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        st = settled(root)
        by_pid = {i.pid: i for i in st.instances}
        assert set(by_pid) == {p.pid for p in procs}, st.to_json()
        assert by_pid[procs[0].pid].stored_bytes == 3 * FILE_BYTES
        assert by_pid[procs[1].pid].stored_bytes == 6 * FILE_BYTES
        assert all(i.state == "live" and i.age_s < 60 for i in st.instances)
        assert st.scan_bytes == disk_bytes(root) == 9 * FILE_BYTES
        assert st.agree is True and st.counts_bytes == 9 * FILE_BYTES, st.to_json()
        # The CLI, as a separate process, sees the same.
        out = subprocess.run(
            [sys.executable, "-m", "fstier.cli", "status", str(root), "--json"],
            capture_output=True, text=True, env=env, timeout=60,
        )
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert sorted(i["pid"] for i in doc["instances"]) == sorted(p.pid for p in procs)
        assert doc["agree"] is True and doc["lease"] is None
    finally:
        stop.touch()
        outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert [o.split() for o in outs] == [[str(1000 * FILE_BYTES), "2"]] * 2


def test_an_expired_lease_is_a_problem_and_a_gone_instance_is_shown(tmp_path: Path) -> None:
    root = tmp_path / "root"
    usage = root / ".fstier-usage.d"
    usage.mkdir(parents=True)
    # What a holder killed mid-pass and an instance killed an hour ago leave.
    lease = usage / "evict.lease"
    lease.write_text("fstier-lease 2 otherhost-4242-0badf00d\n")
    old = time.time() - 3 * 3600
    os.utime(lease, (old, old))
    count = usage / "otherhost-4242-0badf00d.7.8192.0.0.cnt"
    count.touch()
    os.utime(count, (old, old))
    st = read_status(root)
    assert st.lease is not None and st.lease.holder == "otherhost-4242-0badf00d" and st.lease.expired
    (inst,) = st.instances
    assert (inst.host, inst.pid, inst.generation, inst.state) == ("otherhost", 4242, 7, "gone")
    assert len(st.problems) == 1 and "eviction lease" in st.problems[0], st.problems
    res = run_cli("status", str(root))
    assert res.exit_code == 1
    assert "otherhost-4242-0badf00d, renewed 3 h ago" in res.output
    assert res.output.count("problem: ") == 1 and " gone" in res.output


def test_a_walk_past_the_deadline_is_reported_not_waited_for(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with open_tier(root) as tier:
        store(tier, "one", keys(0, 1))
        # A walk counts block files by name: 60,000 empty ones take it far
        # longer than the 0.3 s deadline (ROOT's own check, a few names and
        # one manifest, fits in it).
        for k in keys(1, 60_000):
            path = tier.mapper.path_for(k)
            path.parent.mkdir(exist_ok=True)
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
    walk = time.monotonic()
    assert read_status(root, deadline_s=120).scan_files == 60_001
    walk = time.monotonic() - walk
    started = time.monotonic()
    res = run_cli("status", str(root), "--json", "--deadline", "0.3")
    took = time.monotonic() - started
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and "the walk of ROOT did not answer within 0.3 s" in doc["error"], (doc, walk)
    # the usage directory answered (none: no tier with max_bytes ran here); the walk was cut
    assert doc["published"] is False and doc["scan_bytes"] is None and took < walk, (took, walk)


def _status_bin(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "fstier.cli", "status", *args],
                         capture_output=True, text=True, timeout=120)
    return out, time.monotonic() - started


def test_a_hung_mount_is_reported_within_the_deadline(tmp_path: Path) -> None:
    """A real hung mount (a FUSE server that never answers): as ROOT, and as
    the usage directory inside a good root. Each report comes back about one
    deadline after the start, exit 1, saying what did not answer."""
    root = tmp_path / "root"
    with open_tier(root) as tier:
        store(tier, "a", keys(0, 2))
    hung = tmp_path / "hung"
    with hung_mount(hung):
        out, took = _status_bin(str(hung), "--deadline", "2")
        assert out.returncode == 1 and "did not answer within 2 s (a hung mount?)" in out.stderr, out
        assert took < 30, took
        with hung_mount(root / ".fstier-usage.d"):
            out, took = _status_bin(str(root), "--deadline", "2", "--json")
            assert out.returncode == 1, out
            doc = json.loads(out.stdout)
            assert doc["problems"] == [".fstier-usage.d did not answer within 2 s (a hung mount?)"], doc
            assert doc["published"] is None and doc["scan_bytes"] is None and took < 30, (doc, took)


def test_watch_prints_one_json_line_per_report(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    res = run_cli("status", str(root), "--json", "--watch", "0.05", "--count", "3")
    assert res.exit_code == 0, res.output
    docs = [json.loads(line) for line in res.output.splitlines()]
    assert len(docs) == 3 and all(d["published"] is False and d["ok"] for d in docs)


def test_bad_options_and_roots_exit_2(tmp_path: Path) -> None:
    for args in (["--deadline", "0"], ["--watch", "-1"], ["--count", "2"], ["--max-bytes", "lots"]):
        res = run_cli("status", str(tmp_path), *args)
        assert res.exit_code == 2, (args, res.output)
    res = run_cli("status", str(tmp_path / "nowhere"), "--json")
    assert res.exit_code == 2 and json.loads(res.stdout)["ok"] is False
    # Plainly not an fstier root: refused like inspect refuses it, nothing walked.
    (tmp_path / "notes.txt").write_text("x")
    res = run_cli("status", str(tmp_path))
    assert res.exit_code == 2 and "is not an fstier root" in res.output


def test_a_file_the_count_never_saw_is_exported_as_the_next_rescans_correction(tmp_path: Path) -> None:
    """What an instance without max_bytes, a writer killed mid-store or a
    copy by hand leaves: bytes on disk the shared count does not hold. The
    next quiet rescan corrects the count and exports how far off it was
    (the FstierUsageCountOff alert, deploy/prometheus/fstier-rules.yml)."""
    root = tmp_path / "root"
    with open_tier(root, max_bytes=100 * FILE_BYTES) as tier:
        tier.run_capacity_pass()
        store(tier, "a", keys(0, 3))
        tier.run_capacity_pass()
        assert tier.metrics.snapshot()["fstier_usage_correction_bytes"] == 0
        src = tier.mapper.path_for(keys(0, 1)[0])
        planted = tier.mapper.path_for(keys(50, 1)[0])
        planted.parent.mkdir(exist_ok=True)
        planted.write_bytes(src.read_bytes())
        tier.run_capacity_pass()
        assert tier.metrics.snapshot()["fstier_usage_correction_bytes"] == FILE_BYTES
        assert tier.usage_bytes == 4 * FILE_BYTES
