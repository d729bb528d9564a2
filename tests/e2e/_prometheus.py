"""A real Prometheus for the end-to-end tests: Debian's ``prometheus``
(``make e2e`` installs it), started on a free port with its data in the
test's tmp dir, scraping the given targets every second and evaluating
fstier's alert rules (``deploy/prometheus/fstier-rules.yml``, unchanged)
every second.

:class:`Prometheus` is a context manager: the server runs in its own
process group and is stopped (SIGTERM, then SIGKILL) on exit, also on
failure; :meth:`Prometheus.query` runs one PromQL query through the HTTP
API and :meth:`Prometheus.alerts` lists the alerts the server's own rule
evaluation holds.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
from pathlib import Path
from typing import Any

from tests.e2e._harness import free_port, http, tail

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "fstier-rules.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "fstier-rules.test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "fstier.json"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise AssertionError(
            f"{name} is not installed: `make e2e` installs Debian's prometheus package "
            f"(apt-get install -y prometheus), which brings prometheus and promtool"
        )
    return path


def dashboard_queries(rate_interval: str = "5m") -> list[tuple[str, str, str]]:
    """(panel title, legend format, PromQL) of every query of the dashboard,
    its Grafana variables filled in: every instance, ``rate_interval`` for
    rates."""
    doc = json.loads(DASHBOARD.read_text())
    out = []
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$instance", ".*").replace("$__rate_interval", rate_interval)
            out.append((panel["title"], target["legendFormat"], expr))
    return out


class Prometheus:
    """``prometheus`` scraping ``targets`` ({job: ["host:port", ...]})."""

    def __init__(self, workdir: Path, targets: dict[str, list[str]]) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = self.dir / "prometheus.log"
        rules = self.dir / "fstier-rules.yml"
        shutil.copyfile(RULES, rules)
        jobs = "".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: {json.dumps(hosts)}\n"
            for job, hosts in targets.items()
        )
        self.config = self.dir / "prometheus.yml"
        self.config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files:\n  - {rules}\nscrape_configs:\n{jobs}"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Prometheus:
        with self.log.open("wb") as logf:
            self.proc = subprocess.Popen(
                [tool("prometheus"), f"--config.file={self.config}", f"--storage.tsdb.path={self.dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited {self.proc.returncode}:\n{tail(self.log)}")
            with contextlib.suppress(OSError):
                if http(self.base + "/-/ready", timeout=5)[0] == 200:
                    return self
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus not ready after 60 s:\n{tail(self.log)}")
            time.sleep(0.5)

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)

    def api(self, path: str, **params: str) -> Any:
        status, text = http(f"{self.base}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=30)
        doc = json.loads(text)
        assert status == 200 and doc.get("status") == "success", f"{path} {params}: {status} {text[:500]}"
        return doc["data"]

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """The instant vector ``expr`` evaluates to now: (labels, value) per series."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        """``expr`` over [start, end]: [{"metric": labels, "values": [[t, "v"], ...]}, ...]."""
        data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")
        return list(data["result"])

    def has_data(self, expr: str) -> bool:
        return any(math.isfinite(v) for _, v in self.query(expr))

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts the server's own rule evaluation holds (pending or firing)."""
        return list(self.api("alerts")["alerts"])

    def wait_firing(self, name: str, timeout: float = 60.0, **labels: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for a in self.alerts():
                if (a["labels"].get("alertname") == name and a["state"] == "firing"
                        and all(a["labels"].get(k) == v for k, v in labels.items())):
                    return a
            if time.monotonic() > deadline:
                raise AssertionError(f"alert {name} {labels} not firing after {timeout:.0f} s: {self.alerts()}")
            time.sleep(1)

    def wait_up(self, target: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(v == 1 for _, v in self.query(f'up{{instance="{target}"}}')):
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus has not scraped {target} after {timeout:.0f} s")
            time.sleep(1)
