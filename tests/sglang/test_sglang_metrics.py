"""``metrics_port`` in SGLang's extra config: fstier's own Prometheus exporter
(``fstier_*`` names, the dashboard's second row), scraped over HTTP.

Each SGLang rank is a process of its own, so each case runs real processes:
two tp ranks built by SGLang's own factory over real CPU host pools, each
storing pages and serving its page on ``metrics_port + tp_rank``; a second
backend in one process shares that process's exporter (one family per name,
one sample per namespace); another port in the same process is refused.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("FSTIER_REQUIRE_SGLANG") == "1":
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401  (fail loudly in CI)
else:
    pytest.importorskip(
        "sglang.srt.mem_cache.hicache_storage",
        reason="SGLang not installed (make test-sglang builds .venv-sglang with it)",
    )
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

_RANK = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import _sglang_cpu as sgl
from fstier.errors import ConfigError
root, port, rank, pages = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
opts = {"metrics_port": port, "lookup_cache_ttl_s": 0}
pool = sgl.mha_pool("page_first")
b = sgl.fstier_backend(root, pool, tp_rank=rank, tp_size=2, options=opts)
idx = pool.alloc(pages * pool.page_size)
sgl.fill_pages(pool, idx, seed=rank)
keys = sgl.page_keys(pages, f"metrics-{rank}")
assert b.batch_set_v1(keys, idx) == [True] * pages
assert b.batch_get_v1(keys, idx) == [True] * pages
# A second backend of this process (another layout: another namespace) shares its exporter.
other = sgl.fstier_backend(root, sgl.mha_pool("layer_first"), tp_rank=rank, tp_size=2, options=opts)
try:
    sgl.fstier_backend(root, sgl.mha_pool("page_first"), tp_rank=rank, tp_size=2,
                       options={**opts, "metrics_port": port + 100})
    refused = ""
except ConfigError as exc:
    refused = str(exc)
print(json.dumps({"namespaces": [b.mapper.namespace, other.mapper.namespace],
                  "fragments": b._geometry.fragments, "refused": refused}), flush=True)
sys.stdin.readline()
b.close()
other.close()
"""


def _free_ports(n: int) -> int:
    """A base port with ``n`` free ports from it on."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("", p))
            return base
        except OSError:
            continue
    pytest.fail("no run of free TCP ports found")


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample on ``http://127.0.0.1:port/metrics``, by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_each_rank_serves_its_tiers_on_metrics_port_plus_its_rank(tmp_path: Path) -> None:
    base = _free_ports(2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH.parent), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(BENCH), str(tmp_path), str(base), str(rank), str(2 + rank)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )
        for rank in range(2)
    ]
    try:
        infos: list[dict[str, Any]] = []
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line, f"rank process exited {p.wait(60)} before it was ready"
            infos.append(json.loads(line))
        for rank, info in enumerate(infos):
            samples = scrape(base + rank)
            ns, other = info["namespaces"]
            assert ns != other
            stored = ("fstier_stored_blocks_total", (("fstier_namespace", ns),))
            assert samples[stored] == (2 + rank) * info["fragments"], samples
            loaded = ("fstier_loaded_blocks_total", (("fstier_namespace", ns),))
            assert samples[loaded] == (2 + rank) * info["fragments"]
            assert samples[("fstier_stored_blocks_total", (("fstier_namespace", other),))] == 0
            # one family per name: each metric once per namespace, no other label set
            names = {labels for (name, labels) in samples if name == "fstier_degraded"}
            assert names == {(("fstier_namespace", ns),), (("fstier_namespace", other),)}
            assert f"port {base + rank}" in info["refused"] and str(base + rank + 100) in info["refused"]
        # The ranks share the namespace names (their files differ by rank directory); each
        # page counts its own rank's stores only (2 pages on rank 0, 3 on rank 1, above).
        assert infos[0]["namespaces"] == infos[1]["namespaces"]
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
        codes = [p.wait(60) for p in procs]
    assert codes == [0, 0]


@pytest.mark.parametrize("bad", ["9400", 0, 70000, True, 1.5])
def test_a_bad_metrics_port_is_refused_by_name(tmp_path: Path, bad: object) -> None:
    sys.path.insert(0, str(BENCH))
    import _sglang_cpu as sgl

    from fstier.errors import ConfigError

    with pytest.raises(ConfigError, match="'metrics_port': expected a TCP port"):
        sgl.fstier_backend(tmp_path, sgl.mha_pool("page_first"), options={"metrics_port": bad})
