"""deploy/: the Grafana dashboard and the Prometheus alert rules, checked
without a server: the dashboard JSON is what its generator writes, every
query and rule names only metrics fstier or vLLM exports, and every alert
has its runbook in docs/operating.md. (``make e2e`` runs them against a
real Prometheus scraping a real ``vllm serve``, and runs promtool:
tests/e2e/test_vllm_engine.py.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import runpy
from pathlib import Path

import pytest
import yaml

from fstier.integrations._vllm_metrics import scraped_metric_names
from fstier.tier.metrics import Counter, Gauge, Histogram, LabeledCounter, TierMetrics

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "fstier.json"
RULES = REPO / "deploy" / "prometheus" / "fstier-rules.yml"
_NAME = re.compile(r"\b(vllm:[a-z_:]+|fstier_[a-z_]+)\b")


def fstier_names() -> set[str]:
    """Every metric name fstier exports, as Prometheus scrapes it: under
    vLLM and from fstier's own exporter."""
    names = set(scraped_metric_names())
    for m in vars(TierMetrics()).values():
        if isinstance(m, Counter | LabeledCounter | Gauge):
            names.add(m.name)
        elif isinstance(m, Histogram):
            names.update(f"{m.name}_{s}" for s in ("bucket", "sum", "count"))
    return names


def vllm_source() -> str:
    spec = importlib.util.find_spec("vllm.v1.metrics.loggers")
    if spec is None or spec.origin is None:
        if os.environ.get("FSTIER_REQUIRE_VLLM") == "1":
            raise AssertionError("vLLM is not importable (FSTIER_REQUIRE_VLLM=1): run `make install-vllm`")
        pytest.skip("vLLM not installed: `make install-vllm`")
    return Path(spec.origin).read_text()


def vllm_exports(name: str, source: str) -> bool:
    base = re.sub(r"_(total|sum|count|bucket)$", "", name)
    return f'"{base}"' in source


def dashboard_exprs() -> list[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in doc["panels"] for t in p.get("targets", [])]


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_dashboard_json_is_what_its_generator_writes() -> None:
    gen = runpy.run_path(str(REPO / "deploy" / "grafana" / "make_dashboard.py"))
    assert DASHBOARD.read_text() == gen["render"](), (
        "deploy/grafana/fstier.json is stale: run `python deploy/grafana/make_dashboard.py`"
    )


def test_every_query_and_rule_names_only_exported_metrics() -> None:
    ours = fstier_names()
    source = vllm_source()
    used: set[str] = set()
    for where, expr in [*dashboard_exprs(), *((r["alert"], r["expr"]) for r in rules())]:
        names = set(_NAME.findall(expr))
        assert names, f"{where}: no metric in {expr}"
        for name in names:
            used.add(name)
            assert name in ours or (name.startswith("vllm:") and vllm_exports(name, source)), (
                f"{where}: {name} is exported by neither fstier nor vLLM"
            )
    # The panels cover what an operator asks (issue 44), fstier's side of each.
    for needed in ("lookup_hits_total", "loaded_bytes_total", "failures_total", "breaker_state", "fenced_slots",
                   "corrupt_blocks_total", "usage_bytes", "max_bytes", "evicted_bytes_total",
                   "store_dropped_blocks_total", "root_instances"):
        assert f"vllm:kv_offload_fstier_{needed}" in used, needed


def test_every_alert_has_a_runbook_in_docs() -> None:
    doc = (REPO / "docs" / "operating.md").read_text()
    headings = set(re.findall(r"^### (Fstier[A-Za-z]+)$", doc, re.M))
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names))
    assert set(names) == headings, set(names) ^ headings
    for r in rules():
        assert r["annotations"]["runbook"] == f"docs/operating.md#{r['alert'].lower()}"


def test_the_plot_of_scraped_series_is_an_svg_with_a_line_per_series() -> None:
    import xml.etree.ElementTree as ET

    gen = runpy.run_path(str(REPO / "deploy" / "grafana" / "plot_series.py"))
    series = {
        "Hit ratio": [{"metric": {"instance": "a:1"}, "values": [[100, "0"], [102, "0.5"], [104, "NaN"]]}],
        "Failures by cause": [{"metric": {"cause": "corrupt"}, "values": [[100, "0"], [110, "0.2"]]},
                              {"metric": {"cause": "ENOSPC"}, "values": [[100, "1"], [110, "3"]],
                               "legend": "{{cause}} on {{instance}}"}],
    }
    root = ET.fromstring(gen["svg"](series, ("Hit ratio", "Failures by cause")))
    lines = root.findall("{http://www.w3.org/2000/svg}polyline")
    assert [len(p.get("points", "").split()) for p in lines] == [2, 2, 2]  # NaN dropped
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "ENOSPC on ?" in texts and "cause=corrupt" in texts and "instance=a:1" in texts and "10 s" in texts
