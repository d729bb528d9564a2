"""fstier's metrics as vLLM exports them: names, kinds, labels, buckets.

vLLM exports a tier's metrics under its own Prometheus registry; every
fstier metric there is ``METRIC_PREFIX`` + a name below, fed from FsTier's
metrics snapshot (``TierMetrics.snapshot()``) at each ``get_stats`` call.
Tables only: importing this module imports neither vLLM nor prometheus.
"""

from __future__ import annotations

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
    "load_missed_blocks": ("fstier_load_missed_blocks_total", "Blocks a load reported as misses; vLLM recomputes them."),
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
        "fstier_store_dropped_blocks_total", "reason",
        "Stores dropped before any I/O, a future miss: backpressure (write queue over "
        "max_write_queue_seconds), capacity (root over max_bytes), degraded (breaker open).",
    ),
    "failures": ("fstier_failures_total", "cause", "Failed block operations by cause (errno name, timeout, corrupt, ...)."),
}
VLLM_GAUGES: dict[str, tuple[str, str]] = {
    "usage_bytes": ("fstier_usage_bytes", "Bytes of block files under root_dir (tracked with max_bytes)."),
    "degraded": ("fstier_degraded", "1 while fstier's circuit breaker is open (no I/O is issued)."),
    "write_bytes_per_second": ("fstier_write_bytes_per_second", "Measured write speed (EMA) that backpressure uses."),
    "queued_store_bytes": ("fstier_queued_store_bytes", "Bytes of stores queued or running."),
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
#: Observations kept per histogram between two get_stats calls (vLLM calls
#: it every step when stats are on); beyond it the oldest are dropped.
MAX_OBSERVATIONS = 4096


def scraped_metric_names() -> list[str]:
    """Every fstier metric name as Prometheus scrapes it from vLLM."""
    names = [f"{METRIC_PREFIX}{n}_total" for n in (*VLLM_COUNTERS, *VLLM_LABELED_COUNTERS)]
    names += [f"{METRIC_PREFIX}{n}" for n in (*VLLM_GAUGES, "breaker_state")]
    names += [f"{METRIC_PREFIX}{n}_{s}" for n in VLLM_HISTOGRAMS for s in ("bucket", "sum", "count")]
    return names
