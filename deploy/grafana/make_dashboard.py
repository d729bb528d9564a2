"""Write deploy/grafana/fstier.json, the Grafana dashboard of fstier, from
the panel list below (the one place panels are spelled).

Run ``python deploy/grafana/make_dashboard.py`` after changing a panel;
tests/test_deploy.py fails while fstier.json differs from what this writes
and when a query names a metric neither fstier nor vLLM exports;
tests/e2e/test_prometheus.py runs every query against a real Prometheus
scraping a real ``vllm serve`` and fails on a query with no data.

Queries use two Grafana variables: ``$instance`` (the scrape targets shown)
and ``$__rate_interval``. Rows: the tier under vLLM (``FstierTier``, names
``vllm:kv_offload_fstier_*``, with vLLM's own prefill figures), then
fstier's own exporter (``fstier_*`` names: the ``metrics_port`` option
under SGLang and LMCache, ``FsTier.metrics.start_prometheus_exporter`` for
FsTier used directly).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
V = "vllm:kv_offload_fstier_"
SEL = '{instance=~"$instance"}'
R = "[$__rate_interval]"


def sel(extra: str = "") -> str:
    return '{instance=~"$instance"' + (f",{extra}" if extra else "") + "}"


TIMEOUT = sel('cause="timeout"')
CAPACITY = sel('reason="capacity"')

#: (title, unit, description, [(legend, expr)], kind) per row
VLLM_PANELS: list[tuple[str, str, str, list[tuple[str, str]], str]] = [
    ("Hit ratio", "percentunit",
     "Share of the keys vLLM asked about that were on disk (background lookups).",
     [("{{instance}}", f"sum by (instance) (rate({V}lookup_hits_total{SEL}{R})) / "
                       f"sum by (instance) (rate({V}lookup_keys_total{SEL}{R}))")], "timeseries"),
    ("Bytes loaded instead of recomputed", "Bps",
     "KV bytes loaded and verified from the root: prefill the engine did not redo.",
     [("{{instance}}", f"sum by (instance) (rate({V}loaded_bytes_total{SEL}{R}))")], "timeseries"),
    ("Prefill time saved (estimate)", "s",
     "Prefix tokens vLLM's connector supplied x vLLM's prefill seconds per computed token, minus fstier's "
     "load time; per second of wall time. Counts CPU-tier hits too (after a restart they are fstier's).",
     [("{{instance}}",
       f'sum by (instance) (rate(vllm:external_prefix_cache_hits_total{SEL}{R})) * '
       f'(sum by (instance) (rate(vllm:request_prefill_time_seconds_sum{SEL}{R})) / '
       f'sum by (instance) (rate(vllm:request_prefill_kv_computed_tokens_sum{SEL}{R}))) - '
       f'sum by (instance) (rate({V}load_job_seconds_sum{SEL}{R}))')], "timeseries"),
    ("Failures by cause", "ops",
     "Failed block operations per second by cause: an errno name, timeout, corrupt, slot_busy, ...",
     [("{{cause}}", f"sum by (cause) (rate({V}failures_total{SEL}{R}))")], "timeseries"),
    ("Circuit breaker", "none",
     "1 for the breaker's current state per instance; open: no I/O is issued, every lookup misses.",
     [("{{instance}} {{state}}", f"max by (instance, state) ({V}breaker_state{SEL})")], "timeseries"),
    ("Timeouts and fenced slots", "none",
     "I/O calls past io_timeout_s per second, and slots their stuck calls still hold.",
     [("timeouts/s {{instance}}",
       f"sum by (instance) (rate({V}failures_total{TIMEOUT}{R})) "
       f"or on (instance) (0 * max by (instance) ({V}degraded{SEL}))"),
      ("fenced {{instance}}", f"max by (instance) ({V}fenced_slots{SEL})")], "timeseries"),
    ("Corrupt files found (1 h)", "none",
     "Block files proven bad (checksum, header, length) and removed in the last hour.",
     [("{{instance}}", f"sum by (instance) (increase({V}corrupt_blocks_total{SEL}[1h]))")], "stat"),
    ("Usage vs max_bytes", "bytes",
     "The root's bytes as the shared count holds them, its high watermark and max_bytes.",
     [("usage {{instance}}", f"max by (instance) ({V}usage_bytes{SEL})"),
      ("high watermark {{instance}}", f"max by (instance) ({V}high_watermark_bytes{SEL})"),
      ("max_bytes {{instance}}", f"max by (instance) ({V}max_bytes{SEL})")], "timeseries"),
    ("Root full", "percentunit", "Usage as a share of max_bytes (only tiers with max_bytes).",
     [("{{instance}}", f"max by (instance) ({V}usage_bytes{SEL} / ({V}max_bytes{SEL} > 0))")], "stat"),
    ("Eviction rate", "Bps", "Bytes removed by LRU eviction per second.",
     [("{{instance}}", f"sum by (instance) (rate({V}evicted_bytes_total{SEL}{R}))")], "timeseries"),
    ("Stores dropped by reason", "ops",
     "Stores dropped before any I/O (a future miss): capacity (root over max_bytes), backpressure, degraded.",
     [("{{reason}}", f"sum by (reason) (rate({V}store_dropped_blocks_total{SEL}{R}))")], "timeseries"),
    ("Instances sharing the root", "none",
     "FsTier instances (any host) whose usage count on the root is live, as each instance sees it.",
     [("{{instance}}", f"max by (instance) ({V}root_instances{SEL})")], "stat"),
    ("Store and load latency p99", "s", "Seconds per job, submission to result.",
     [("store {{instance}}", f"histogram_quantile(0.99, sum by (instance, le) "
                             f"(rate({V}store_job_seconds_bucket{SEL}{R})))"),
      ("load {{instance}}", f"histogram_quantile(0.99, sum by (instance, le) "
                            f"(rate({V}load_job_seconds_bucket{SEL}{R})))")], "timeseries"),
]

F = "fstier_"
OWN_PANELS: list[tuple[str, str, str, list[tuple[str, str]], str]] = [
    ("Hit ratio (fstier exporter)", "percentunit", "Keys found present by lookup() over keys asked.",
     [("{{instance}}", f"sum by (instance) (rate({F}lookup_hits_total{SEL}{R})) / "
                       f"sum by (instance) (rate({F}lookup_keys_total{SEL}{R}))")], "timeseries"),
    ("Bytes loaded (fstier exporter)", "Bps", "Payload bytes loaded and verified.",
     [("{{instance}}", f"sum by (instance) (rate({F}loaded_bytes_total{SEL}{R}))")], "timeseries"),
    ("Failures by cause (fstier exporter)", "ops", "Failed block operations per second by cause.",
     [("{{cause}}", f"sum by (cause) (rate({F}failures_total{SEL}{R}))")], "timeseries"),
    ("Usage vs max_bytes (fstier exporter)", "bytes", "Shared usage count, high watermark and max_bytes.",
     [("usage {{instance}}", f"max by (instance) ({F}usage_bytes{SEL})"),
      ("high watermark {{instance}}", f"max by (instance) ({F}high_watermark_bytes{SEL})"),
      ("max_bytes {{instance}}", f"max by (instance) ({F}max_bytes{SEL})")], "timeseries"),
    ("Degraded and fenced (fstier exporter)", "none", "1 while the breaker is open; fenced slots.",
     [("degraded {{instance}}", f"max by (instance) ({F}degraded{SEL})"),
      ("fenced {{instance}}", f"max by (instance) ({F}fenced_slots{SEL})")], "timeseries"),
    ("Evictions and capacity drops (fstier exporter)", "ops", "Evicted blocks/s; stores dropped for capacity/s.",
     [("evicted {{instance}}", f"sum by (instance) (rate({F}evicted_blocks_total{SEL}{R}))"),
      ("dropped for capacity {{instance}}",
       f"sum by (instance) (rate({F}store_dropped_blocks_total{CAPACITY}{R}))"
       f" or on (instance) (0 * max by (instance) ({F}degraded{SEL}))")], "timeseries"),
]


def _panel(pid: int, x: int, y: int, spec: tuple[str, str, str, list[tuple[str, str]], str]) -> dict:
    title, unit, desc, targets, kind = spec
    return {
        "id": pid,
        "type": kind,
        "title": title,
        "description": desc,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
        "targets": [
            {"refId": chr(65 + i), "expr": expr, "legendFormat": legend,
             "datasource": {"type": "prometheus", "uid": "${datasource}"}}
            for i, (legend, expr) in enumerate(targets)
        ],
    }


def dashboard() -> dict:
    panels: list[dict] = []
    y = 0
    pid = 1
    for row_title, specs in (("fstier under vLLM (FstierTier)", VLLM_PANELS),
                             ("fstier's own exporter (SGLang, LMCache, FsTier)", OWN_PANELS)):
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid += 1
        y += 1
        for i, spec in enumerate(specs):
            panels.append(_panel(pid, 8 * (i % 3), y + 8 * (i // 3), spec))
            pid += 1
        y += 8 * ((len(specs) + 2) // 3)
    return {
        "title": "fstier",
        "uid": "fstier",
        "description": "fstier, a filesystem tier for KV caches: is it helping, is it healthy, is it full.",
        "tags": ["fstier", "vllm", "kv-cache"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "instance", "type": "query", "label": "instance", "multi": True, "includeAll": True,
             "allValue": ".*", "current": {"text": "All", "value": "$__all"},
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(up, instance)", "refId": "instance"},
             "definition": "label_values(up, instance)", "refresh": 2},
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    out = HERE / "fstier.json"
    out.write_text(render())
    print(f"wrote {out}", file=sys.stderr)
