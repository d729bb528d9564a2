"""Plot some dashboard panels from what a real Prometheus scraped, as SVG.

``make e2e``'s ``vllm serve`` test writes the dashboard's queries over the
whole run (``.e2e-tmp/.../prometheus-series.json``: panel title -> its
queries' ``query_range`` series, each with its ``legend`` format); this draws the chosen panels one above
the other, a line per series named by its legend format, time in seconds
from the first sample::

    python deploy/grafana/plot_series.py prometheus-series.json docs/img/operating_dashboard.svg

Plain Python (no plotting library); values are drawn as they are, each
panel on its own scale.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

PANELS = (
    "Hit ratio",
    "Bytes loaded instead of recomputed",
    "Failures by cause",
    "Usage vs max_bytes",
    "Corrupt files found (1 h)",
)
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")
W, H, LEFT, TOP, GAP = 760, 120, 90, 24, 40


def _label(metric: dict[str, str], legend: str | None = None) -> str:
    """The panel's legend format filled in, else the labels that tell series apart."""
    if legend:
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), "?"), legend)
    keep = {k: v for k, v in metric.items() if k in ("instance", "cause", "reason", "state")}
    return ", ".join(f"{k}={v}" for k, v in sorted(keep.items())) or "value"


def _num(v: float) -> str:
    if v == 0:
        return "0"
    mag = max(abs(v), 1e-12)
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if mag >= scale:
            return f"{v / scale:.3g}{unit}"
    return f"{v:.3g}"


def svg(series: dict[str, list[dict[str, Any]]], panels: tuple[str, ...] = PANELS) -> str:
    points = [float(t) for title in panels for s in series.get(title, []) for t, _ in s["values"]]
    t0, t1 = (min(points), max(points)) if points else (0.0, 1.0)
    span = max(t1 - t0, 1.0)
    height = len(panels) * (H + TOP + GAP) + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W + LEFT + 220}" height="{height}" '
           f'font-family="sans-serif" font-size="11">', '<rect width="100%" height="100%" fill="white"/>']
    for i, title in enumerate(panels):
        y0 = i * (H + TOP + GAP) + TOP
        lines = [(_label(s["metric"], s.get("legend")),
                  [(float(t), float(v)) for t, v in s["values"] if math.isfinite(float(v))])
                 for s in series.get(title, [])]
        vals = [v for _, pts in lines for _, v in pts]
        lo, hi = (min(vals + [0.0]), max(vals + [0.0])) if vals else (0.0, 1.0)
        hi = hi if hi > lo else lo + 1.0
        out.append(f'<text x="{LEFT}" y="{y0 - 6}" font-weight="bold">{title}</text>')
        out.append(f'<rect x="{LEFT}" y="{y0}" width="{W}" height="{H}" fill="none" stroke="#999"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y0 + 10}" text-anchor="end">{_num(hi)}</text>')
        out.append(f'<text x="{LEFT - 6}" y="{y0 + H}" text-anchor="end">{_num(lo)}</text>')
        for j, (label, pts) in enumerate(lines):
            colour = COLOURS[j % len(COLOURS)]
            path = " ".join(
                f"{LEFT + W * (t - t0) / span:.1f},{y0 + H - H * (v - lo) / (hi - lo):.1f}" for t, v in pts
            )
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{path}"/>')
            out.append(f'<text x="{LEFT + W + 8}" y="{y0 + 12 + 14 * j}" fill="{colour}">{label}</text>')
    y = len(panels) * (H + TOP + GAP) + 10
    out.append(f'<text x="{LEFT}" y="{y}">0 s</text>')
    out.append(f'<text x="{LEFT + W}" y="{y}" text-anchor="end">{span:.0f} s</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    dst.write_text(svg(json.loads(src.read_text())))
    print(f"wrote {dst}", file=sys.stderr)
