"""A finished job's counts are noted with no lock and counted at the next read
(``TierMetrics._fold_locked``): every reader sees what counting at completion gave,
and a tier nobody reads keeps at most ``FOLD_EVERY`` noted jobs."""

from __future__ import annotations

import threading
from typing import Any

from fstier.tier.metrics import FOLD_EVERY, TierMetrics


def test_noted_jobs_read_as_counted_jobs() -> None:
    m = TierMetrics()
    m.job_stored(4, 4096, 0, 0.002)
    m.job_stored(0, 0, 3, 0.001)
    m.job_loaded(2, 2048, 1, 0.003)
    assert m.stored_blocks.value == 4 and m.stored_bytes.value == 4096 and m.skipped_blocks.value == 3
    assert (m.loaded_blocks.value, m.loaded_bytes.value, m.load_misses.value) == (2, 2048, 1)
    # a skip or miss count moves only with a job that had one (test_checks_fast's change counts)
    assert (m.skipped_blocks.changes, m.load_misses.changes, m.stored_blocks.changes) == (1, 1, 2)
    snap = m.snapshot()
    assert snap["fstier_store_job_seconds"]["count"] == 2 and snap["fstier_load_job_seconds"]["count"] == 1
    before = m.changes()
    m.job_loaded(1, 1024, 0, 0.001)
    assert m.changes() > before  # a noted job is news to a poll of changes()
    assert m.load_seconds.snapshot().count == 2


def test_a_tier_nobody_reads_keeps_a_bounded_list() -> None:
    m = TierMetrics()
    for _ in range(3 * FOLD_EVERY + 7):
        m.job_stored(1, 10, 0, 0.0)
    assert len(m._jobs) < FOLD_EVERY
    assert m.stored_blocks.value == 3 * FOLD_EVERY + 7 and m.stored_bytes.value == 10 * (3 * FOLD_EVERY + 7)


def test_jobs_noted_while_readers_fold_are_each_counted_once() -> None:
    m = TierMetrics()
    per, writers = 5000, 4
    stop = threading.Event()

    def note() -> None:
        for _ in range(per):
            m.job_loaded(1, 1, 0, 0.0)

    def read() -> None:
        while not stop.is_set():
            m.changes()
            m.loaded_blocks.value  # noqa: B018  # a read folds

    readers = [threading.Thread(target=read) for _ in range(2)]
    threads = [threading.Thread(target=note) for _ in range(writers)]
    for t in readers + threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert m.loaded_blocks.value == per * writers == m.load_seconds.snapshot().count


def test_vllm_get_stats_while_jobs_are_noted_reports_each_job_once_and_skips_no_news() -> None:
    # vLLM's get_stats, as the adapter runs it (changes() first; a report from snapshot() only when it moved),
    # polled while engine threads note jobs one by one and by collect: every job reaches the reports' counters
    # and histograms exactly once, and the poll after the last job is news unless everything was reported.
    from fstier.integrations._vllm_metrics import MAX_OBSERVATIONS, METRIC_PREFIX, VllmMetrics

    m, vm = TierMetrics(), VllmMetrics()
    m.tap = vm.observe_counted
    per, writers = 500, 4
    assert 2 * per * writers <= MAX_OBSERVATIONS  # no observation is dropped by the bound between two reports
    stop = threading.Event()
    reported = {"stored": 0.0, "loaded": 0.0, "store_s": 0, "load_s": 0, "store_b": 0, "load_b": 0}
    seen: list[int] = [-1]

    def get_stats() -> bool:
        now = m.changes()
        if now == seen[0]:
            return False
        seen[0] = now
        types: dict[str, str] = {}
        values: dict[str, dict[tuple[str, ...], Any]] = {}
        vm.report(m.snapshot(), "closed", types, values)
        for name, field in (("stored_blocks", "stored"), ("loaded_blocks", "loaded")):
            reported[field] += sum(values.get(METRIC_PREFIX + name, {}).values())
        for name, field in (("store_job_seconds", "store_s"), ("load_job_seconds", "load_s"),
                            ("store_job_bytes", "store_b"), ("load_job_bytes", "load_b")):
            reported[field] += len(values.get(METRIC_PREFIX + name, {}).get((), []))
        return True

    def note(i: int) -> None:
        for j in range(per):
            if i % 2:
                m.jobs_noted([(True, 1, 64, 0, 0.001), (False, 1, 64, 0, 0.001)])
            else:
                m.job_stored(1, 64, 0, 0.001)
                m.job_loaded(1, 64, 0, 0.001)
            if j % 50 == 0:
                m.snapshot()  # another reader (a Prometheus scrape, `fstier status`) folds too

    def poll() -> None:
        while not stop.is_set():
            get_stats()

    poller = threading.Thread(target=poll)
    threads = [threading.Thread(target=note, args=(i,)) for i in range(writers)]
    poller.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    poller.join()
    jobs = per * writers
    if reported["store_s"] < jobs:
        assert get_stats(), "jobs were noted since the last report but get_stats saw no news"
    get_stats()
    assert reported == {"stored": jobs, "loaded": jobs, "store_s": jobs, "load_s": jobs,
                        "store_b": jobs, "load_b": jobs}
    assert not get_stats()  # nothing new: no report
