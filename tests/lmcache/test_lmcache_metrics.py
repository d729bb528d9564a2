"""``metrics_port`` in FstierL2Adapter's ``adapter_params``: fstier's own
Prometheus exporter (``fstier_*`` names, the dashboard's second row), scraped
over HTTP:

* the real ``lmcache server`` with the option: after LMCache's own bench
  stored its chunks, the page counts exactly the chunk files on disk, per
  namespace (``fstier_namespace``);
* in process: two adapters with the same port share one page (each
  namespace once, so no name is registered twice); a closed adapter's
  namespaces leave it; another port in the same process, or a port that
  is not one, is refused by name.

Without LMCache these tests skip, unless ``FSTIER_REQUIRE_LMCACHE=1``.
"""

from __future__ import annotations

import os
import time
import urllib.request
from pathlib import Path

import pytest

os.environ.setdefault("DO_NOT_TRACK", "1")
if os.environ.get("FSTIER_REQUIRE_LMCACHE") == "1":
    import lmcache.v1.multiprocess  # noqa: F401  (fail loudly in CI)
else:
    pytest.importorskip(
        "lmcache.v1.multiprocess", reason="LMCache not installed (make test-lmcache builds .venv-lmcache)"
    )

import _lmc  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_lmcache_adapter import Listener, build, free, keys, objects, store  # noqa: E402

from fstier.errors import ConfigError  # noqa: E402

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

#: The port of this pytest process's exporter (one per process).
PORT = _lmc.free_port()


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def by_namespace(samples: Samples, name: str) -> dict[str, float]:
    return {dict(labels)["fstier_namespace"]: v for (n, labels), v in samples.items() if n == name}


def test_the_lmcache_server_serves_fstier_metrics_on_metrics_port(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    port = _lmc.free_port()
    server = _lmc.Server([_lmc.fstier_spec(root, metrics_port=port)], tmp_path / "server.log")
    try:
        server.wait_ready()
        report, out = server.bench(0, 3)
        assert report["metrics"]["results"]["checksum_ok"] == 3, out[-3000:]
        files = sorted(root.rglob("*.bin"))
        deadline = time.monotonic() + 60
        while True:  # the L2 stores finish after the bench's own calls return
            stored = by_namespace(scrape(port), "fstier_stored_blocks_total")
            files = sorted(root.rglob("*.bin"))
            if sum(stored.values()) == len(files) == 6 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(files) == 6 and sum(stored.values()) == 6, (stored, files)
        on_disk = {p.relative_to(root).parts[0] for p in files}
        assert {ns for ns, v in stored.items() if v} == on_disk
    finally:
        server.stop()


def test_adapters_of_one_process_share_one_page(tmp_path: Path) -> None:
    made = [build(tmp_path, metrics_port=PORT) for _ in range(2)]
    try:
        for a in made:
            a.listener = Listener()
            a.register_listener(a.listener)
        src = objects(3)
        assert store(made[0], keys(3, kv_rank=1), src).is_successful()
        assert store(made[1], keys(2, seed=9, kv_rank=2), src[:2]).is_successful()
        free(src)
        stored = by_namespace(scrape(PORT), "fstier_stored_blocks_total")
        assert sorted(v for v in stored.values()) == [2, 3], stored
        assert len(by_namespace(scrape(PORT), "fstier_degraded")) == 2  # one sample per namespace
        with pytest.raises(ConfigError, match=f"'metrics_port' {PORT + 1}: .*already serves .* port {PORT}"):
            build(tmp_path, metrics_port=PORT + 1)
        made[0].close()
        assert list(by_namespace(scrape(PORT), "fstier_stored_blocks_total").values()) == [2]
    finally:
        for a in made:
            a.close()
    assert by_namespace(scrape(PORT), "fstier_stored_blocks_total") == {}


@pytest.mark.parametrize("bad", ["9400", 0, 65536, True, 2.5])
def test_a_bad_metrics_port_is_refused_by_name(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match="FstierL2Adapter option 'metrics_port': expected a TCP port"):
        build(tmp_path, metrics_port=bad)
