"""A finished job's counts are noted with no lock and counted at the next read
(``TierMetrics._fold_locked``): every reader sees what counting at completion gave,
and a tier nobody reads keeps at most ``FOLD_EVERY`` noted jobs."""

from __future__ import annotations

import threading

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
