"""Old import path of :mod:`fstier.tier.metrics`, kept for one release: import from there."""

from __future__ import annotations

from fstier.tier.metrics import (
    Counter,
    Gauge,
    Histogram,
    HistogramSnapshot,
    LabeledCounter,
    TierMetrics,
)

__all__ = ["Counter", "Gauge", "Histogram", "HistogramSnapshot", "LabeledCounter", "TierMetrics"]
