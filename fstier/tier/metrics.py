"""Plain in-process metrics for FsTier, with an optional Prometheus bridge.

Counters, gauges and fixed-bucket histograms are small objects with no
dependency; the metrics of one :class:`TierMetrics` share one lock, and no
metric calls out while holding it. A finished job's counts and latency
(:meth:`TierMetrics.job_stored`, :meth:`TierMetrics.job_loaded`) are one
list append on the completion path, counted into the counters and
histograms they move at the next read of any of them (``_fold_locked``):
what every reader sees is exactly what counting at completion gave.
:meth:`TierMetrics.snapshot` returns a plain dict (what tests, logs and
``--json`` read). ``prometheus_client`` is imported only when
:meth:`TierMetrics.start_prometheus_exporter` or
:meth:`TierMetrics.prometheus_collector` is called; without the ``metrics``
extra installed those raise :class:`~fstier.errors.MetricsUnavailableError`
saying what to install.
"""

from __future__ import annotations

import bisect
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import compress, filterfalse, repeat
from operator import itemgetter
from typing import Any

from fstier.errors import MetricsUnavailableError

__all__ = [
    "Counter", "Gauge", "Histogram", "HistogramSnapshot", "LabeledCounter", "OwnedGauge", "TierMetrics",
    "serve_collector", "tiers_collector",
]

#: Seconds buckets for per-job latency (0.1 ms .. 60 s).
SECONDS_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)

_STORE, _BLOCKS, _NBYTES, _OTHER, _SECONDS = map(itemgetter, range(5))
#: finished jobs noted by :meth:`TierMetrics.job_stored` / ``job_loaded`` that are counted at once, read or not
FOLD_EVERY = 1024


class Counter:
    """A monotonically increasing number. ``lock``: the lock it shares with
    the other metrics of its :class:`TierMetrics` (its own when None).
    ``_fold``: set by a :class:`TierMetrics` whose finished jobs this counter
    counts (run under the lock before a read: it adds the jobs counted since)."""

    _fold: Callable[[], None] | None = None

    def __init__(self, name: str, doc: str, lock: threading.Lock | None = None) -> None:
        self.name = name
        self.doc = doc
        self._value = 0.0
        self._lock = lock or threading.Lock()
        #: how many times the value changed (see :meth:`TierMetrics.changes`)
        self.changes = 0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name}: increment must be >= 0, got {amount}")
        with self._lock:
            self._add(amount)

    def _add(self, amount: float) -> None:
        """:meth:`inc` with the lock held by the caller."""
        self._value += amount
        self.changes += 1

    def _add_n(self, amount: float, times: int) -> None:
        """``times`` :meth:`_add` calls adding ``amount`` in all (the lock held by the caller)."""
        self._value += amount
        self.changes += times

    @property
    def value(self) -> float:
        with self._lock:
            if self._fold is not None:
                self._fold()
            return self._value


class Gauge:
    """A number that goes up and down (e.g. usage bytes)."""

    def __init__(self, name: str, doc: str, lock: threading.Lock | None = None) -> None:
        self.name = name
        self.doc = doc
        self._value = 0.0
        self._lock = lock or threading.Lock()
        self.changes = 0

    def set(self, value: float) -> None:
        with self._lock:
            if value != self._value:
                self._value = value
                self.changes += 1

    def add(self, amount: float) -> None:
        with self._lock:
            if amount:
                self._value += amount
                self.changes += 1

    @property
    def value(self) -> float:
        with self._lock:
            return self._value


class OwnedGauge(Gauge):
    """A gauge whose value another part keeps as a plain number (the write
    budget's queued bytes): read on demand, one call per read, none per
    change. ``changes`` is the owner's own count of changes, so
    :meth:`TierMetrics.changes` still sees every one. Unbound, it reads 0."""

    def __init__(self, name: str, doc: str, lock: threading.Lock | None = None) -> None:
        self.name = name
        self.doc = doc
        self._read: Callable[[], tuple[float, int]] = lambda: (0.0, 0)

    def bind(self, read: Callable[[], tuple[float, int]]) -> None:
        """Read ``(value, changes)`` from ``read`` from now on."""
        self._read = read

    def set(self, value: float) -> None:
        raise TypeError(f"gauge {self.name} is kept by its owner; it cannot be set")

    def add(self, amount: float) -> None:
        raise TypeError(f"gauge {self.name} is kept by its owner; it cannot be added to")

    @property
    def changes(self) -> int:  # type: ignore[override]  # the owner's count, read-only here
        return self._read()[1]

    @property
    def value(self) -> float:
        return self._read()[0]


class LabeledCounter:
    """Counters keyed by one label (e.g. failures by cause)."""

    def __init__(self, name: str, doc: str, label: str, lock: threading.Lock | None = None) -> None:
        self.name = name
        self.doc = doc
        self.label = label
        self._values: dict[str, float] = {}
        self._lock = lock or threading.Lock()
        self.changes = 0

    def inc(self, label_value: str, amount: float = 1.0) -> None:
        with self._lock:
            self._values[label_value] = self._values.get(label_value, 0.0) + amount
            self.changes += 1

    def values(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """Cumulative bucket counts (Prometheus convention), sum and count."""

    buckets: tuple[float, ...]
    cumulative: tuple[int, ...]
    total: float
    count: int


class Histogram:
    """A fixed-bucket histogram of observations (``_fold``: as :class:`Counter`'s)."""

    _fold: Callable[[], None] | None = None

    def __init__(
        self, name: str, doc: str, buckets: Sequence[float] = SECONDS_BUCKETS, lock: threading.Lock | None = None,
    ) -> None:
        self.name = name
        self.doc = doc
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum = 0.0
        self._lock = lock or threading.Lock()
        self.changes = 0

    def observe(self, value: float) -> None:
        with self._lock:
            self._add(value)

    def _add(self, value: float) -> None:
        """:meth:`observe` with the lock held by the caller."""
        self._counts[bisect.bisect_left(self.buckets, value)] += 1
        self._sum += value
        self.changes += 1

    def _add_many(self, values: Sequence[float]) -> None:
        """:meth:`_add` of each of ``values`` (the lock held by the caller):
        a line per bucket they fall in, none per value."""
        counts, where = self._counts, list(map(bisect.bisect_left, repeat(self.buckets), values))
        for i in set(where):  # (not collections.Counter: its Mapping check runs Python ABC hooks)
            counts[i] += where.count(i)
        self._sum += sum(values)
        self.changes += len(values)

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            if self._fold is not None:
                self._fold()
            counts = list(self._counts)
            total = self._sum
        cumulative: list[int] = []
        running = 0
        for c in counts[:-1]:
            running += c
            cumulative.append(running)
        return HistogramSnapshot(self.buckets, tuple(cumulative), total, running + counts[-1])


class TierMetrics:
    """Every metric one FsTier keeps. Names follow Prometheus conventions.
    They share one lock; a finished job's counts and latency are one list
    append (:meth:`job_stored`, :meth:`job_loaded`), counted at the next read."""

    def __init__(self) -> None:
        self._lock = lock = threading.Lock()
        c = functools.partial(Counter, lock=lock)
        g = functools.partial(Gauge, lock=lock)
        self.stored_bytes = c("fstier_stored_bytes_total", "payload bytes written to new block files")
        self.stored_blocks = c("fstier_stored_blocks_total", "block files written")
        self.skipped_blocks = c("fstier_store_skipped_blocks_total", "stores skipped: key already present")
        self.loaded_bytes = c("fstier_loaded_bytes_total", "payload bytes loaded and verified")
        self.loaded_blocks = c("fstier_loaded_blocks_total", "block files loaded and verified")
        self.lookup_keys = c("fstier_lookup_keys_total", "keys asked by lookup()")
        self.hits = c("fstier_lookup_hits_total", "keys reported present by lookup()")
        self.misses = c("fstier_lookup_misses_total", "lookups that stopped at a missing key")
        self.load_misses = c("fstier_load_missed_blocks_total", "blocks a load reported as misses to recompute")
        self.drops = LabeledCounter("fstier_store_dropped_blocks_total", "stores dropped, by reason", "reason", lock)
        self.failures = LabeledCounter("fstier_failures_total", "failed block operations, by cause", "cause", lock)
        self.corrupt = c("fstier_corrupt_blocks_total", "block files proven bad and removed")
        self.evicted_blocks = c("fstier_evicted_blocks_total", "block files removed by LRU eviction")
        self.evicted_bytes = c("fstier_evicted_bytes_total", "bytes removed by LRU eviction")
        self.temp_swept = c("fstier_temp_swept_total", "stale temp/.nfs files removed")
        self.breaker_trips = c("fstier_breaker_trips_total", "times the circuit breaker opened")
        self.usage_bytes = g("fstier_usage_bytes", "bytes of block files under the root (tracked)")
        #: kept by the write budget (:class:`~fstier.tier.admission.WriteBudget`), read on demand
        self.write_speed = OwnedGauge("fstier_write_bytes_per_second", "EMA of measured write speed")
        #: kept by the write budget (:class:`~fstier.tier.admission.WriteBudget`), read on demand
        self.queued_store_bytes = OwnedGauge("fstier_queued_store_bytes", "bytes of stores queued or running")
        self.degraded = g("fstier_degraded", "1 while the circuit breaker is open")
        self.native_io = g("fstier_native_io", "1 when the native I/O path runs, 0 for the Python path")
        self.fenced_slots = g("fstier_fenced_slots", "slots held by timed-out I/O that has not returned")
        # Set by the capacity manager (fstier.tier.capacity), with max_bytes only.
        self.max_bytes = g("fstier_max_bytes", "max_bytes of the root (0: no limit)")
        self.high_watermark_bytes = g("fstier_high_watermark_bytes", "usage above which eviction starts")
        self.usage_correction_bytes = g(
            "fstier_usage_correction_bytes", "how far the shared count was from the disk at the last quiet rescan"
        )
        self.root_instances = g(
            "fstier_root_instances", "instances (this one included) whose usage count on the root is live"
        )
        self.store_seconds = Histogram("fstier_store_job_seconds", "store job latency", lock=lock)
        self.load_seconds = Histogram("fstier_load_job_seconds", "load job latency", lock=lock)
        self.lookup_seconds = Histogram("fstier_lookup_seconds", "lookup() latency", lock=lock)
        self._metrics = tuple(
            v for v in vars(self).values() if isinstance(v, Counter | Gauge | LabeledCounter | Histogram)
        )
        #: finished jobs not counted yet: (store?, blocks, nbytes, skipped or missed, seconds), in order
        self._jobs: list[tuple[bool, int, int, int, float]] = []
        #: told every batch of jobs as it is counted, under the lock (vLLM's per-job histograms,
        #: :meth:`~fstier.integrations._vllm_metrics.VllmMetrics.observe_counted`); must not call back here
        self.tap: Callable[[list[tuple[bool, int, int, int, float]]], None] | None = None
        for m in (self.stored_blocks, self.stored_bytes, self.skipped_blocks, self.store_seconds,
                  self.loaded_blocks, self.loaded_bytes, self.load_misses, self.load_seconds):
            m._fold = self._fold_locked

    def job_stored(self, blocks: int, nbytes: int, skipped: int, seconds: float) -> None:
        """A store job ended: ``blocks`` files of ``nbytes`` payload written,
        ``skipped`` keys found present, in ``seconds``: one list append, no
        lock (counted at the next read, :meth:`_fold_locked`, or once
        :data:`FOLD_EVERY` wait: a tier nobody reads keeps no more)."""
        self._jobs.append((True, blocks, nbytes, skipped, seconds))
        if len(self._jobs) >= FOLD_EVERY:
            self._fold()

    def job_loaded(self, blocks: int, nbytes: int, missed: int, seconds: float) -> None:
        """A load job ended: ``blocks`` files of ``nbytes`` payload loaded and
        verified, ``missed`` keys reported as misses, in ``seconds`` (as :meth:`job_stored`)."""
        self._jobs.append((False, blocks, nbytes, missed, seconds))
        if len(self._jobs) >= FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        with self._lock:
            self._fold_locked()

    def _fold_locked(self) -> None:
        """Count the jobs :meth:`job_stored` and :meth:`job_loaded` noted
        since the last read (the lock held; run by every read of a counter
        or histogram they move, :meth:`changes` and :meth:`snapshot`): each
        moves the counters as one job's counts did, a skip or miss count only
        when not 0 (C-level loops over them, a line per kind, none per job),
        and :attr:`tap` is told them. Appends racing it stay for the next read
        (the list is cut by its length, never swapped)."""
        jobs = self._jobs
        if not jobs:
            return
        n = len(jobs)
        done, jobs[:n] = jobs[:n], []
        stores, loads = list(compress(done, map(_STORE, done))), list(filterfalse(_STORE, done))
        for js, blocks, nbytes, other, seconds in (
            (stores, self.stored_blocks, self.stored_bytes, self.skipped_blocks, self.store_seconds),
            (loads, self.loaded_blocks, self.loaded_bytes, self.load_misses, self.load_seconds),
        ):
            if js:
                blocks._add_n(sum(map(_BLOCKS, js)), len(js))
                nbytes._add_n(sum(map(_NBYTES, js)), len(js))
                others = list(filter(None, map(_OTHER, js)))
                if others:
                    other._add_n(sum(others), len(others))
                seconds._add_many(list(map(_SECONDS, js)))
        if self.tap is not None:
            self.tap(done)

    def jobs_noted(self, jobs: list[tuple[bool, int, int, int, float]]) -> None:
        """:meth:`job_stored` / :meth:`job_loaded` of each of a batch of jobs,
        ``(store?, blocks, nbytes, skipped or missed, seconds)`` each: one extend."""
        self._jobs.extend(jobs)
        if len(self._jobs) >= FOLD_EVERY:
            self._fold()

    def _all(self) -> Iterator[Counter | Gauge | LabeledCounter | Histogram]:
        yield from self._metrics

    def changes(self) -> int:
        """A number that grows whenever any metric's value changes (the sum
        of each metric's own change count, each bumped under that metric's
        lock): equal answers mean nothing changed in between. Costs ~2 us,
        against a :meth:`snapshot`'s ~60 us, so an engine that polls every
        scheduler step (vLLM's ``get_stats``) builds a report only when
        there is news."""
        if self._jobs:
            self._fold()
        return sum(m.changes for m in self._metrics)

    def snapshot(self) -> dict[str, Any]:
        """A plain dict: counters and gauges as numbers, labeled counters as
        ``{label: n}``, histograms as ``{"count", "sum", "buckets"}``."""
        out: dict[str, Any] = {}
        for m in self._all():
            if isinstance(m, Counter | Gauge):
                out[m.name] = m.value
            elif isinstance(m, LabeledCounter):
                out[m.name] = m.values()
            else:
                s = m.snapshot()
                out[m.name] = {
                    "count": s.count,
                    "sum": s.total,
                    "buckets": dict(zip(s.buckets, s.cumulative, strict=True)),
                }
        return out

    # -- Prometheus ---------------------------------------------------------
    def prometheus_collector(self) -> Any:
        """A ``prometheus_client`` collector reading these metrics at scrape
        time. Register it with ``registry.register(...)``."""
        return tiers_collector(lambda: [((), self)])

    def start_prometheus_exporter(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Serve these metrics over HTTP on ``port`` from a daemon thread, in a
        private registry (so several FsTier instances never collide). Returns
        the registry."""
        return serve_collector(self.prometheus_collector(), port, addr)


def serve_collector(collector: Any, port: int, addr: str = "0.0.0.0") -> Any:
    """Serve ``collector`` over HTTP on ``port`` from a daemon thread, in a
    private registry of its own. Returns the registry; ``OSError`` when the
    port cannot be listened on."""
    client = _import_prometheus_client()
    registry = client.CollectorRegistry()
    registry.register(collector)
    client.start_http_server(port, addr=addr, registry=registry)
    return registry


def tiers_collector(
    tiers: Callable[[], Sequence[tuple[tuple[str, ...], TierMetrics]]], labels: tuple[str, ...] = (),
) -> Any:
    """A ``prometheus_client`` collector of several tiers' metrics: at each
    scrape ``tiers()`` gives ``(label values, metrics)`` pairs, and each
    metric name is one family with one sample per tier, told apart by
    ``labels`` (so tiers never collide in one registry). Costs one
    :meth:`TierMetrics.snapshot`'s worth of reads per tier and scrape."""
    core = _import_prometheus()

    class _Collector:
        def collect(self) -> Iterator[Any]:
            listed = list(tiers())
            if not listed:
                return
            for i, first in enumerate(listed[0][1]._metrics):
                name = first.name.removesuffix("_total")
                if isinstance(first, Counter):
                    fam = core.CounterMetricFamily(name, first.doc, labels=labels)
                elif isinstance(first, Gauge):
                    fam = core.GaugeMetricFamily(first.name, first.doc, labels=labels)
                elif isinstance(first, LabeledCounter):
                    fam = core.CounterMetricFamily(name, first.doc, labels=[*labels, first.label])
                else:
                    fam = core.HistogramMetricFamily(first.name, first.doc, labels=labels)
                for values, metrics in listed:
                    _add_sample(fam, metrics._metrics[i], list(values))
                yield fam

        def describe(self) -> list[Any]:
            return []

    return _Collector()


def _add_sample(fam: Any, m: Counter | Gauge | LabeledCounter | Histogram, values: list[str]) -> None:
    if isinstance(m, Counter | Gauge):
        fam.add_metric(values, m.value)
    elif isinstance(m, LabeledCounter):
        for label, v in sorted(m.values().items()):
            fam.add_metric([*values, label], v)
    else:
        s = m.snapshot()
        buckets = [(repr(b), float(c)) for b, c in zip(s.buckets, s.cumulative, strict=True)]
        buckets.append(("+Inf", float(s.count)))
        fam.add_metric(values, buckets, s.total)


def _import_prometheus_client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise MetricsUnavailableError(
            "Prometheus export needs prometheus-client (fstier's metrics extra); install it "
            "with `pip install prometheus-client`"
        ) from None
    return prometheus_client


def _import_prometheus() -> Any:
    _import_prometheus_client()
    import prometheus_client.core as core

    return core
