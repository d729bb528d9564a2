"""fstier's metrics as vLLM exports them: names, kinds, labels, buckets,
and the per-step report.

vLLM exports a tier's metrics under its own Prometheus registry; every
fstier metric there is ``METRIC_PREFIX`` + a name below, fed from FsTier's
metrics snapshot (``TierMetrics.snapshot()``) at each ``get_stats`` call
that has news (none when no metric moved: ``get_stats`` returns None):
:func:`metric_definitions` declares them, :class:`VllmMetrics` reports
counter increments since the last report, current gauges and the histogram
observations since the last report. Observations are bounded
(``MAX_OBSERVATIONS`` per histogram between two reports; the oldest are
dropped); one report costs one pass over the tables. Importing this module
imports neither vLLM nor prometheus (:func:`metric_definitions` imports
vLLM's metadata classes when called).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from itertools import compress
from operator import attrgetter, itemgetter
from typing import Any

__all__ = [
    "BREAKER_STATES",
    "BYTES_BUCKETS_VLLM",
    "MAX_OBSERVATIONS",
    "METRIC_PREFIX",
    "SECONDS_BUCKETS_VLLM",
    "VLLM_COUNTERS",
    "VLLM_GAUGES",
    "VLLM_HISTOGRAMS",
    "VLLM_LABELED_COUNTERS",
    "KNOWN_LABELS",
    "VllmMetrics",
    "metric_definitions",
    "scraped_metric_names",
]

#: Every fstier metric vLLM exports has this prefix; prometheus_client adds
#: ``_total`` to counters and ``_bucket``/``_sum``/``_count`` to histograms
#: when they are scraped (docs/vllm.md lists the names as scraped).
METRIC_PREFIX = "vllm:kv_offload_fstier_"
#: name under vLLM -> (FsTier metrics snapshot key, help)
VLLM_COUNTERS: dict[str, tuple[str, str]] = {
    "stored_blocks": ("fstier_stored_blocks_total", "Block files written."),
    "stored_bytes": ("fstier_stored_bytes_total", "Payload bytes written to new block files."),
    "store_skipped_blocks": ("fstier_store_skipped_blocks_total", "Stores skipped: the block was already on disk."),
    "loaded_blocks": ("fstier_loaded_blocks_total", "Block files loaded and verified."),
    "loaded_bytes": ("fstier_loaded_bytes_total", "Payload bytes loaded and verified."),
    "load_missed_blocks": (
        "fstier_load_missed_blocks_total",
        "Blocks a load reported as misses; vLLM recomputes them.",
    ),
    "lookup_keys": ("fstier_lookup_keys_total", "Keys whose presence vLLM asked for (background lookups)."),
    "lookup_hits": ("fstier_lookup_hits_total", "Keys found present by lookups."),
    "corrupt_blocks": ("fstier_corrupt_blocks_total", "Block files proven bad and removed."),
    "evicted_blocks": ("fstier_evicted_blocks_total", "Block files removed by LRU eviction."),
    "evicted_bytes": ("fstier_evicted_bytes_total", "Bytes removed by LRU eviction."),
    "temp_swept": ("fstier_temp_swept_total", "Stale temp and .nfs files removed."),
    "breaker_trips": ("fstier_breaker_trips_total", "Times the circuit breaker opened."),
}
#: name under vLLM -> (snapshot key, label name, help)
VLLM_LABELED_COUNTERS: dict[str, tuple[str, str, str]] = {
    "store_dropped_blocks": (
        "fstier_store_dropped_blocks_total",
        "reason",
        "Stores dropped before any I/O, a future miss: backpressure (write queue over "
        "max_write_queue_seconds), capacity (root over max_bytes), degraded (breaker open).",
    ),
    "failures": (
        "fstier_failures_total",
        "cause",
        "Failed block operations by cause (errno name, timeout, corrupt, ...).",
    ),
}
VLLM_GAUGES: dict[str, tuple[str, str]] = {
    "usage_bytes": ("fstier_usage_bytes", "Bytes of block files under root_dir (tracked with max_bytes)."),
    "degraded": ("fstier_degraded", "1 while fstier's circuit breaker is open (no I/O is issued)."),
    "write_bytes_per_second": ("fstier_write_bytes_per_second", "Measured write speed (EMA) that backpressure uses."),
    "queued_store_bytes": ("fstier_queued_store_bytes", "Bytes of stores queued or running."),
    "fenced_slots": (
        "fstier_fenced_slots",
        "Slots held by timed-out I/O that has not returned (the engine cannot reuse them).",
    ),
    "max_bytes": ("fstier_max_bytes", "max_bytes of root_dir (0 when no limit is set)."),
    "high_watermark_bytes": (
        "fstier_high_watermark_bytes", "Usage above which eviction starts (max_bytes x high_watermark)."
    ),
    "usage_correction_bytes": (
        "fstier_usage_correction_bytes",
        "How far the shared usage count was from the disk at the last rescan that raced nothing.",
    ),
    "root_instances": (
        "fstier_root_instances",
        "FsTier instances on root_dir (any host, this one included) whose usage count moved in the last 60 s.",
    ),
}
#: Label values sent at 0 from the start (causes appear when they happen).
KNOWN_LABELS = {"store_dropped_blocks": ("backpressure", "capacity", "degraded")}
#: The breaker state as a labeled gauge: 1 for the current state, 0 for the others.
BREAKER_STATES = ("closed", "open", "half_open")
SECONDS_BUCKETS_VLLM: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)
BYTES_BUCKETS_VLLM: tuple[float, ...] = tuple(float(4096 * 4**i) for i in range(11))  # 4 KiB .. 4 GiB
#: name under vLLM -> (buckets, help); observed per job (and per lookup batch)
VLLM_HISTOGRAMS: dict[str, tuple[tuple[float, ...], str]] = {
    "store_job_seconds": (SECONDS_BUCKETS_VLLM, "Seconds per store job, submission to result."),
    "load_job_seconds": (SECONDS_BUCKETS_VLLM, "Seconds per load job, submission to result."),
    "lookup_seconds": (SECONDS_BUCKETS_VLLM, "Seconds per background lookup batch (cache, then stat)."),
    "store_job_bytes": (BYTES_BUCKETS_VLLM, "Payload bytes written per store job."),
    "load_job_bytes": (BYTES_BUCKETS_VLLM, "Payload bytes loaded per load job."),
}
_KIND, _SECONDS, _NBYTES = attrgetter("kind"), attrgetter("seconds"), attrgetter("nbytes")
_STORE, _MOVED, _SEC = itemgetter(0), itemgetter(2), itemgetter(4)
#: Observations kept per histogram between two get_stats calls (vLLM calls
#: it every step when stats are on); beyond it the oldest are dropped.
MAX_OBSERVATIONS = 4096


def scraped_metric_names() -> list[str]:
    """Every fstier metric name as Prometheus scrapes it from vLLM."""
    names = [f"{METRIC_PREFIX}{n}_total" for n in (*VLLM_COUNTERS, *VLLM_LABELED_COUNTERS)]
    names += [f"{METRIC_PREFIX}{n}" for n in (*VLLM_GAUGES, "breaker_state")]
    names += [f"{METRIC_PREFIX}{n}_{s}" for n in VLLM_HISTOGRAMS for s in ("bucket", "sum", "count")]
    return names


def metric_definitions() -> dict[str, Any]:
    """fstier's metrics as vLLM's ``OffloadingMetricMetadata`` by full name
    (what ``build_metric_definitions`` returns)."""
    from vllm.v1.kv_offload.base import (
        OffloadingCounterMetadata,
        OffloadingGaugeMetadata,
        OffloadingHistogramMetadata,
    )

    defs: dict[str, Any] = {}
    for name, (_, doc) in VLLM_COUNTERS.items():
        defs[METRIC_PREFIX + name] = OffloadingCounterMetadata(documentation=doc)
    for name, (_, label, doc) in VLLM_LABELED_COUNTERS.items():
        defs[METRIC_PREFIX + name] = OffloadingCounterMetadata(documentation=doc, labelnames=(label,))
    for name, (_, doc) in VLLM_GAUGES.items():
        defs[METRIC_PREFIX + name] = OffloadingGaugeMetadata(documentation=doc)
    defs[METRIC_PREFIX + "breaker_state"] = OffloadingGaugeMetadata(
        documentation="fstier's circuit breaker: 1 for the current state (closed, open, half_open).",
        labelnames=("state",),
    )
    for name, (buckets, doc) in VLLM_HISTOGRAMS.items():
        defs[METRIC_PREFIX + name] = OffloadingHistogramMetadata(documentation=doc, buckets=buckets)
    return defs


class VllmMetrics:
    """One tier's metrics between two of vLLM's ``get_stats`` calls:
    :meth:`observe` from any thread, :meth:`report` from vLLM's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: the counter values last reported, by (name, labels)
        self._reported: dict[tuple[str, tuple[str, ...]], float] = {}
        #: histogram observations since the last report (bounded)
        self._observations: dict[str, deque[float]] = {
            name: deque(maxlen=MAX_OBSERVATIONS) for name in VLLM_HISTOGRAMS
        }
        #: a job kind (or "is a store", as TierMetrics notes it) -> its seconds and its bytes observations
        obs = self._observations
        self._seconds: dict[str | bool, deque[float]] = {
            "store": obs["store_job_seconds"], "load": obs["load_job_seconds"],
            True: obs["store_job_seconds"], False: obs["load_job_seconds"],
        }
        self._bytes: dict[str | bool, deque[float]] = {
            "store": obs["store_job_bytes"], "load": obs["load_job_bytes"],
            True: obs["store_job_bytes"], False: obs["load_job_bytes"],
        }

    def observe(self, name: str, value: float) -> None:
        """One observation of histogram ``name`` for the next report."""
        with self._lock:
            self._observations[name].append(float(value))

    def observe_jobs(self, results: Iterable[Any]) -> None:
        """Each finished job's seconds and bytes (when it moved any) for the
        next report: one lock per collected batch, none per job, and C-level
        loops over the batch (no line per result)."""
        results = list(results)
        moved = list(compress(results, map(_NBYTES, results)))
        self._observe_batch(map(_KIND, results), map(_SECONDS, results), map(_KIND, moved), map(_NBYTES, moved))

    def observe_counted(self, jobs: Sequence[tuple[bool, int, int, int, float]]) -> None:
        """:meth:`observe_jobs` of the jobs FsTier's metrics just counted, as
        they note them (``(store?, blocks, nbytes, skipped or missed,
        seconds)``): the tap of :attr:`fstier.tier.metrics.TierMetrics.tap`,
        run when a read of those metrics counts them (at the latest by
        ``get_stats``' change check, before its report), never on a job's
        completion path."""
        moved = list(compress(jobs, map(_MOVED, jobs)))
        self._observe_batch(map(_STORE, jobs), map(_SEC, jobs), map(_STORE, moved), map(_MOVED, moved))

    def _observe_batch(self, kinds: Iterable[Any], seconds: Iterable[float], moved_kinds: Iterable[Any],
                       moved_bytes: Iterable[int]) -> None:
        """Each job's seconds under its kind, and the bytes of those that moved any: one lock, C-level loops
        (the kind keys the job-seconds and job-bytes observation lists: its name, or the store flag)."""
        with self._lock:
            deque(map(deque.append, map(self._seconds.__getitem__, kinds), map(float, seconds)), maxlen=0)
            deque(map(deque.append, map(self._bytes.__getitem__, moved_kinds), map(float, moved_bytes)), maxlen=0)

    def _counter_delta(self, name: str, labels: tuple[str, ...], now: float) -> float:
        key = (name, labels)
        delta = now - self._reported.get(key, 0.0)
        self._reported[key] = now
        return delta

    def report(
        self,
        snap: Mapping[str, Any],
        breaker_state: str,
        types: dict[str, str],
        values: dict[str, Any],
    ) -> None:
        """Fill vLLM's stats sections (``types``: name -> kind, ``values``:
        name -> series) from FsTier's metrics snapshot ``snap``: counter
        increments since the last report, current gauges, the breaker state
        and the histogram observations since the last report."""
        # A series is sent the first time even at 0, so every counter is
        # scraped from the start (a rate over a missing series is empty).
        for name, (src, _) in VLLM_COUNTERS.items():
            first = (name, ()) not in self._reported
            delta = self._counter_delta(name, (), float(snap.get(src, 0.0)))
            if delta or first:
                types[METRIC_PREFIX + name] = "counter"
                values[METRIC_PREFIX + name] = {(): delta}
        for name, (src, _, _) in VLLM_LABELED_COUNTERS.items():
            series = {}
            current = {**dict.fromkeys(KNOWN_LABELS.get(name, ()), 0.0), **dict(snap.get(src) or {})}
            for label, now in sorted(current.items()):
                first = (name, (str(label),)) not in self._reported
                delta = self._counter_delta(name, (str(label),), float(now))
                if delta or first:
                    series[(str(label),)] = delta
            if series:
                types[METRIC_PREFIX + name] = "counter"
                values[METRIC_PREFIX + name] = series
        for name, (src, _) in VLLM_GAUGES.items():
            types[METRIC_PREFIX + name] = "gauge"
            values[METRIC_PREFIX + name] = {(): float(snap.get(src, 0.0))}
        types[METRIC_PREFIX + "breaker_state"] = "gauge"
        values[METRIC_PREFIX + "breaker_state"] = {(s,): float(s == breaker_state) for s in BREAKER_STATES}
        with self._lock:
            observed = {n: list(q) for n, q in self._observations.items() if q}
            for q in self._observations.values():
                q.clear()
        for name, obs in observed.items():
            types[METRIC_PREFIX + name] = "histogram"
            values[METRIC_PREFIX + name] = {(): obs}
