"""FstierTier as an operator sees it under vLLM (issue 22, points 4 and 6):
the warning when vLLM's block hashes are random per process, and fstier's
log lines printed through vLLM's logging configuration. Real vLLM classes
(tests/_vllm_helpers.py), real processes for logging (its configuration is
process-global)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _vllm_helpers import (
    FSTIER_TIER,
    LookupResult,
    ReqContext,
    fstier_tier,
    offloading_config,
    tiering_manager,
)

REPO = Path(__file__).resolve().parents[1]


def _new_request(manager: object, req_id: str) -> None:
    with manager.lock:  # type: ignore[attr-defined]
        manager.on_new_request(ReqContext(req_id=req_id))  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("algo", "seed_env", "warns"),
    [("xxhash", None, True), ("sha256", None, False), ("xxhash", "0", False)],
)
def test_random_hash_seed_warns_once_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    algo: str, seed_env: str | None, warns: bool,
) -> None:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    if seed_env is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed_env)
    # vLLM's engine core seeds its block hashes after building the scheduler
    # (and so the tier): unseeded while the tier starts.
    monkeypatch.setattr(kv_cache_utils, "_NONE_HASH_SEED", None)
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", getattr(kv_cache_utils, "NONE_HASH", None), raising=False)
    caplog.set_level(logging.WARNING, logger="fstier")
    with tiering_manager(offloading_config([{**FSTIER_TIER, "root_dir": str(tmp_path / "kv")}])) as m:
        assert not [r for r in caplog.records if "hash seed" in r.getMessage()]
        kv_cache_utils.init_none_hash(get_hash_fn_by_name(algo))  # what EngineCore does next
        _new_request(m, "a")
        _new_request(m, "b")
        assert fstier_tier(m)._seed_checked
    found = [r.getMessage() for r in caplog.records if r.name.startswith("fstier") and "hash seed" in r.getMessage()]
    if not warns:
        assert found == []
        return
    assert len(found) == 1, found  # once, not per request
    assert "PYTHONHASHSEED" in found[0] and "sha256" in found[0] and str(tmp_path / "kv") in found[0]


_LOGGING_RUN = r"""
import logging, sys, tempfile
from pathlib import Path
sys.path.insert(0, {tests!r})
mode = sys.argv[1]
if mode == "root":
    logging.basicConfig(level=logging.INFO, format="ROOT %(name)s %(levelname)s %(message)s")
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())  # as vLLM's engine core does before building the scheduler
from _vllm_helpers import FSTIER_TIER, offloading_config, tiering_manager
root = Path(tempfile.mkdtemp())
with tiering_manager(offloading_config([{{**FSTIER_TIER, "root_dir": str(root / "kv")}}])) as m:
    pass
print("handlers:", len(logging.getLogger("fstier").handlers))
"""


@pytest.mark.parametrize("mode", ["vllm", "root"])
def test_fstier_log_lines_print_through_vllm_logging(tmp_path: Path, mode: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_LOGGING_LEVEL": "INFO", "TMPDIR": str(tmp_path)}
    env.pop("VLLM_CONFIGURE_LOGGING", None)
    proc = subprocess.run(
        [sys.executable, "-c", _LOGGING_RUN.format(tests=str(REPO / "tests")), mode],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    start = [ln for ln in (proc.stderr + proc.stdout).splitlines() if "fstier: vLLM tier" in ln]
    assert len(start) == 1, proc.stderr[-3000:]
    assert "row 65536 bytes" in start[0] and "namespace acme_llama-tiny-" in start[0]
    if mode == "vllm":
        # vLLM's format: "(process pid=N) INFO date [file:line] message"
        assert " INFO " in start[0] and "pid=" in start[0] and "[vllm.py:" in start[0], start[0]
        assert "handlers: 1" in proc.stdout
    else:
        # The operator configured logging: fstier's lines follow it, vLLM's handlers are not borrowed.
        assert start[0].startswith("ROOT fstier.vllm INFO"), start[0]
        assert "handlers: 0" in proc.stdout


def test_integration_doc_entry_starts_vllms_tiering(tmp_path: Path) -> None:
    """docs/integration.md's --kv-transfer-config, root pointed at a temporary
    directory and the CPU tier shrunk for a test, builds vLLM's real tiering
    manager with FstierTier in it."""
    import json
    import re

    from fstier.integrations.vllm import FstierTier

    text = (REPO / "docs" / "integration.md").read_text()
    doc = json.loads(re.search(r"```json\n(.*?)```", text, re.S).group(1))  # type: ignore[union-attr]
    extra = dict(doc["kv_connector_extra_config"])
    tiers = [{**t, "root_dir": str(tmp_path / "kv")} for t in extra.pop("secondary_tiers")]
    assert extra.pop("cpu_bytes_to_use") > 0  # the helper sizes the CPU tier for the test
    with tiering_manager(offloading_config(tiers, extra=extra)) as m:
        assert isinstance(fstier_tier(m), FstierTier)


@pytest.mark.parametrize(
    ("tp", "worker", "replicated"), [(2, 65536 + 100, False), (4, 3 * 4096, False), (4, 8192, True)]
)
def test_row_formula_matches_vllms_allocation(tmp_path: Path, tp: int, worker: int, replicated: bool) -> None:
    """docs/vllm.md "Sizing": row = blocks_per_chunk x tp x worker bytes per
    block (x 1 with replicated_layout), rounded up to 4096 -- as vLLM
    allocates it and FstierTier stores it."""
    cfg = offloading_config([{**FSTIER_TIER, "root_dir": str(tmp_path / "kv")}], tp=tp, worker_kv_bytes=worker,
                            replicated=replicated, agnostic=not replicated)
    with tiering_manager(cfg) as m:
        tier = fstier_tier(m)
        row = (1 if replicated else tp) * worker
        assert tier.rows.slot_bytes == -(-row // 4096) * 4096
        manifest = (tier.mapper.namespace_dir / "config.json").read_text()
        assert f'"row_bytes": {tier.rows.slot_bytes}' in manifest


def _scrape(extra_config: dict, stats_list: list) -> str:
    """Feed FstierTier's stats through vLLM's own Prometheus recorder
    (OffloadPromMetrics, what `vllm serve` runs) into a private registry and
    return the exposition text, as a Prometheus scrape sees it."""
    import functools
    from types import SimpleNamespace

    import prometheus_client
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics

    reg = prometheus_client.CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra_config))
    prom = OffloadPromMetrics(vllm_config, types, ["model_name", "engine"], {0: ["acme/llama-tiny", "0"]})  # type: ignore[arg-type]
    for stats in stats_list:
        prom.observe(stats.data, 0)
    return prometheus_client.generate_latest(reg).decode()


def test_metrics_reach_prometheus_under_the_documented_names(tmp_path: Path) -> None:
    """Drops by reason, failures by cause, breaker state, lookups, bytes and
    latency histograms reach Prometheus through vLLM, under exactly the names
    docs/vllm.md lists (with _total on counters)."""
    import re

    from _vllm_helpers import keys_for, lookup_all, promote, row_pattern, steps

    import fstier.integrations.vllm as fv

    root = tmp_path / "kv"
    keys = keys_for(31, 24)
    stats: list = []
    opts = {**FSTIER_TIER, "root_dir": str(root), "max_write_queue_seconds": 1e-9}
    cfg = offloading_config([opts], num_chunks=32)
    with tiering_manager(cfg) as m:
        tier = fstier_tier(m)
        view = m.primary_tier.get_kv_memoryview()
        flat, stride = view.cast("B"), view.strides[0]
        for i in range(3):  # a flood: fstier's write budget drops some jobs (backpressure)
            ctx = ReqContext(req_id=f"r{i}")
            with m.lock:
                m.on_new_request(ctx)
                out = m.prepare_store(keys[i * 8 : (i + 1) * 8], ctx)
                for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                    flat[int(c) * stride : (int(c) + 1) * stride] = row_pattern(k, stride)
                m.complete_store(keys[i * 8 : (i + 1) * 8], ctx)
                m.on_request_finished(ctx)
        flat.release()
        steps(m)
        stats.append(tier.get_stats())
        assert tier.fstier.metrics.drops.values().get("backpressure", 0) >= 8
    with tiering_manager(offloading_config([{**FSTIER_TIER, "root_dir": str(root)}])) as m:
        tier = fstier_tier(m)
        present = [k for k in keys if Path(tier.mapper.path_for(fv._block_key(k))).exists()][:3]
        assert len(present) == 3
        ctx = ReqContext(req_id="q")
        with m.lock:
            m.on_new_request(ctx)
        assert lookup_all(m, ctx, present) == [LookupResult.RETRY] * 3
        steps(m, until=lambda: tier._lookup.lookup(present[2], ctx) is not None)
        bad = Path(tier.mapper.path_for(fv._block_key(present[2])))
        with open(bad, "r+b") as f:  # one flipped payload byte: a corrupt load
            f.seek(8192)
            b = f.read(1)
            f.seek(8192)
            f.write(bytes([b[0] ^ 0x40]))
        promote(m, ctx, present)
        with m.lock:
            m.on_request_finished(ctx)
        stats.append(tier.get_stats())
        assert tier.get_stats() is None  # nothing new: no report (vLLM skips a tier's None)
    text = _scrape(dict(cfg.extra_config), stats)
    for name in fv.scraped_metric_names():
        assert re.search(rf"^{re.escape(name)}\{{", text, re.M), f"{name} not scraped"
    p = re.escape(fv.METRIC_PREFIX)
    assert re.search(rf'^{p}store_dropped_blocks_total\{{[^}}]*reason="backpressure"[^}}]*\}} ([0-9.e+]+)', text, re.M)
    assert re.search(rf'^{p}failures_total\{{[^}}]*cause="corrupt"[^}}]*\}} 1\.0', text, re.M), text
    assert re.search(rf'^{p}corrupt_blocks_total\{{[^}}]*\}} 1\.0', text, re.M)
    assert re.search(rf'^{p}breaker_state\{{[^}}]*state="closed"[^}}]*\}} 1\.0', text, re.M)
    assert re.search(rf'^{p}lookup_keys_total\{{[^}}]*\}} [1-9]', text, re.M)
    loads = re.search(rf'^{p}load_job_seconds_count\{{[^}}]*\}} ([0-9.]+)', text, re.M)
    assert loads is not None and float(loads.group(1)) >= 1
    # docs/vllm.md lists exactly these names, as scraped.
    doc = (REPO / "docs" / "vllm.md").read_text()
    section = doc[doc.index("## Metrics") :]
    section = section[: section.find("\n## ", 5)]
    documented = set(re.findall(r"`(vllm:kv_offload_fstier_[a-z_]+)`", section))
    histos = {f"{fv.METRIC_PREFIX}{n}" for n in fv.VLLM_HISTOGRAMS}
    expected = {n for n in fv.scraped_metric_names() if not n.endswith(("_bucket", "_sum", "_count"))} | histos
    assert documented == expected, documented ^ expected


def test_inspect_shows_a_vllm_namespace_with_row_size_and_blocks_per_chunk(tmp_path: Path) -> None:
    import json

    from _vllm_helpers import keys_for, store_request

    root = tmp_path / "kv"
    with tiering_manager(offloading_config([{**FSTIER_TIER, "root_dir": str(root)}], tp=2)) as m:
        store_request(m, "s", keys_for(41, 3))
        namespace = fstier_tier(m).mapper.namespace
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"}
    doc = json.loads(subprocess.run([sys.executable, "-m", "fstier.cli", "inspect", str(root), "--json"],
                                    capture_output=True, text=True, env=env, timeout=120).stdout)
    (ns,) = doc["namespaces"]
    assert ns["namespace"] == namespace and ns["engine"] == "vllm"
    assert ns["row_bytes"] == 2 * 65536 and ns["blocks_per_chunk"] == 1 and ns["files"] == 3
    text = subprocess.run([sys.executable, "-m", "fstier.cli", "inspect", str(root)],
                          capture_output=True, text=True, env=env, timeout=120).stdout
    (line,) = [ln for ln in text.splitlines() if namespace in ln.split()]
    assert "vllm" in line.split() and "128.0 KiB" in line and len(line) <= 80, line
