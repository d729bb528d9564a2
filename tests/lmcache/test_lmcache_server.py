"""The real ``lmcache server`` with FstierL2Adapter as its L2, driven by
LMCache's own ``lmcache bench server --mode cpu --transfer-mode
engine_driven`` (the bench zeroes its KV blocks before each retrieve, so a
checksum that matches is bytes that came back):

* two servers on one root: the first stores (checksums pass), the second,
  whose L1 is empty, serves the same requests from the first one's files
  with the same checksums;
* warm reads come from L2: ``--l2-store-policy skip_l1`` makes L1 a write
  buffer, and the second server and the restarted one hold nothing in L1,
  so their server logs count every hit as an L2 hit. (On the storing
  server itself LMCache keeps a chunk in L1 when its L2 store finishes
  while the bench's own retrieve still read-locks it, so its warm reads
  are L1 or L2 by timing; the test does not count them.)
* a restarted server still hits, from the files alone.

Without LMCache these tests skip, unless ``FSTIER_REQUIRE_LMCACHE=1``.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

if os.environ.get("FSTIER_REQUIRE_LMCACHE") == "1":
    import lmcache.v1.multiprocess  # noqa: F401  (fail loudly in CI)
else:
    pytest.importorskip(
        "lmcache.v1.multiprocess", reason="LMCache not installed (make test-lmcache builds .venv-lmcache)"
    )

import _lmc  # noqa: E402

REQUESTS = 3  # seqs 0..2, two 256-token chunks each
_CHECKSUM = re.compile(r"\[seq (\d+)/(cold|warm)\] CHECKSUM: ([0-9a-f]+)")
_HITS = re.compile(r"\[seq (\d+)/cold\] LOOKUP: (\d+)/(\d+) chunks hit")
_L2 = re.compile(r"retained keys \((\d+) L1, (\d+) L2\)")


def _checksums(out: str) -> dict[tuple[int, str], str]:
    return {(int(s), phase): c for s, phase, c in _CHECKSUM.findall(out)}


def _l2_hits(log: Path) -> int:
    return sum(int(l2) for _l1, l2 in _L2.findall(log.read_text(errors="replace")))


def _wait_files(root: Path, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(list(root.rglob("*.bin"))) < n:
        assert time.monotonic() < deadline, f"{n} chunk files never appeared under {root}"
        time.sleep(0.1)


def test_two_servers_on_one_root_warm_reads_from_l2_and_restart_hits(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    spec = _lmc.fstier_spec(root)
    a = _lmc.Server([spec], tmp_path / "a.log")
    b = _lmc.Server([spec], tmp_path / "b.log")
    servers = [a, b]
    try:
        a.wait_ready()
        b.wait_ready()
        report, out = a.bench(0, REQUESTS)
        res = report["metrics"]["results"]
        assert res["checksum_ok"] == REQUESTS and res["checksum_fail"] == 0, out[-3000:]
        stored = _checksums(out)
        _wait_files(root, 2 * REQUESTS)

        # Server b never saw these requests: its L1 is empty, every hit is
        # a chunk of a's files, and the retrieved bytes match.
        _report, out_b = b.bench(0, REQUESTS)
        assert [int(h) for _s, h, _t in _HITS.findall(out_b)] == [2] * REQUESTS, out_b[-3000:]
        got = _checksums(out_b)
        for seq in range(REQUESTS):
            assert got[(seq, "warm")] == stored[(seq, "cold")]
        assert _l2_hits(b.log) >= 2 * REQUESTS
        # A restarted server hits from the files alone.
        for s in servers:
            s.stop()
        c = _lmc.Server([spec], tmp_path / "c.log")
        servers.append(c)
        c.wait_ready()
        _report, out_c = c.bench(0, REQUESTS)
        assert [int(h) for _s, h, _t in _HITS.findall(out_c)] == [2] * REQUESTS, out_c[-3000:]
        for seq in range(REQUESTS):
            assert _checksums(out_c)[(seq, "warm")] == stored[(seq, "cold")]
        assert _l2_hits(c.log) >= 2 * REQUESTS
    finally:
        for s in servers:
            s.stop()
