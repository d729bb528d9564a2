"""The completion's straight lines (``NativeEngine._done_alike``, ``Results.publish_jobs_locked(take=True)``
under ``FsTier.get_finished``) raced by every other taker: each job's result is returned exactly once
(``get_finished`` from one thread, ``wait`` from another, ``drain`` and submits meanwhile), each stored key's
event exactly once (``take_events`` with and without a reap), a job whose uniform outcome was never
seen before is published as one seen before is, and the write budget and the root's count are given back
exactly whether a collect is judged job by job or as one batch."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from manager_support import fill, keys, load, open_tier, payload_for, slot_bytes, store

from fstier.io.engine import summary
from fstier.io.engine.native import NativeEngine
from fstier.tier.records import BlockStored


def _stored_hashes(evs: list[object]) -> list[bytes]:
    return [k.block_hash for e in evs if isinstance(e, BlockStored) for k in e.keys]


def test_every_result_and_event_is_taken_once_while_takers_race(tmp_path: Path) -> None:
    # Two threads poll get_finished and take_events (with and without a reap) while a third drains and the
    # main thread submits: each job's result comes out once, each stored key's event once.
    jobs, per = 150, 2
    with open_tier(tmp_path, num_slots=2 * jobs) as tier:
        stop = threading.Event()
        got: list[object] = []
        events: list[bytes] = []
        lock = threading.Lock()

        def poll() -> None:
            while not stop.is_set():
                out = tier.get_finished()
                ev = tier.take_events(reap=False) + tier.take_events()
                with lock:
                    got.extend(r.job_id for r in out if r.success)
                    events.extend(_stored_hashes(ev))

        def drain() -> None:
            while not stop.is_set():
                tier.drain(0.01)

        takers = [threading.Thread(target=poll), threading.Thread(target=poll), threading.Thread(target=drain)]
        for t in takers:
            t.start()
        try:
            for j in range(jobs):
                ks, slots = keys(per * j, per), [per * j + i for i in range(per)]
                fill(tier, ks, slots)
                tier.submit_store(j, ks, slots)
            assert tier.drain(10)
        finally:
            stop.set()
            for t in takers:
                t.join()
        got.extend(r.job_id for r in tier.get_finished() if r.success)
        events.extend(_stored_hashes(tier.take_events()))
        ids = Counter(got)
        assert set(ids) == set(range(jobs)) and set(ids.values()) == {1}, [i for i, n in ids.items() if n > 1]
        hashes = Counter(events)
        assert set(hashes) == {k.block_hash for k in keys(0, per * jobs)} and set(hashes.values()) == {1}
        assert tier.metrics.stored_blocks.value == per * jobs


def test_each_waiter_gets_its_own_result_while_events_are_taken(tmp_path: Path) -> None:
    # SGLang's way: each caller waits for its own job (wait), while another thread takes events and drains;
    # no waiter sleeps to its timeout, none gets another's result, every result is taken once.
    jobs, per, callers = 40, 2, 4
    with open_tier(tmp_path, num_slots=per * jobs * callers) as tier:
        stop = threading.Event()
        events: list[bytes] = []
        results: dict[int, list[object]] = {c: [] for c in range(callers)}

        def caller(c: int) -> None:
            for j in range(jobs):
                n = c * jobs + j
                ks, slots = keys(per * n, per), [per * n + i for i in range(per)]
                fill(tier, ks, slots)
                tier.submit_store(n, ks, slots)
                r = tier.wait(n, 10)
                assert r is not None and r.job_id == n and r.success, (n, r)
                results[c].append(r.job_id)

        def take() -> None:
            while not stop.is_set():
                events.extend(_stored_hashes(tier.take_events(reap=False) + tier.take_events()))
                tier.drain(0.001)

        taker = threading.Thread(target=take)
        threads = [threading.Thread(target=caller, args=(c,)) for c in range(callers)]
        taker.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stop.set()
        taker.join()
        assert all(results[c] == [c * jobs + j for j in range(jobs)] for c in range(callers)), results
        assert tier.get_finished() == [] and not tier.has_pending()
        events.extend(_stored_hashes(tier.take_events()))
        hashes = Counter(events)
        assert set(hashes) == {k.block_hash for k in keys(0, per * jobs * callers)} and set(hashes.values()) == {1}


def test_a_uniform_outcome_never_seen_before_is_published_as_one_seen_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The straight line publishes only an outcome the judged path cached: with the cache empty, the first
    # store and load of a tier are judged by the other path, the next by the straight line; all alike.
    summary.SHARED.clear()
    taken: list[bool] = []
    real = NativeEngine._done_alike

    def done_alike(self: NativeEngine, ev: tuple[object, ...]) -> bool:
        taken.append(real(self, ev))
        return taken[-1]

    monkeypatch.setattr(NativeEngine, "_done_alike", done_alike)
    with open_tier(tmp_path, num_slots=8) as tier:
        answers = []
        for i in range(3):
            ks = keys(10 * i, 4)
            r = store(tier, ("s", i), ks, [0, 1, 2, 3])
            answers.append((r.success, r.cause, r.keys_completed, r.skipped))
            r = load(tier, ("l", i), ks, 4)  # checks the loaded bytes
            answers.append((r.success, r.cause, r.keys_completed, r.skipped))
            assert [slot_bytes(tier, k, 4 + n) for n, k in enumerate(ks)] == [
                payload_for(k, tier.payload_bytes(k)) for k in ks
            ]
        assert answers == [(True, None, 4, 0)] * 6
        assert tier.metrics.stored_blocks.value == 12 and tier.metrics.loaded_blocks.value == 12
        if isinstance(tier._engine.engine, NativeEngine):  # the first of each kind judged, the rest straight
            assert taken[:2] == [False, False] and taken[2:] == [True] * 4, taken


def test_budget_and_root_count_are_given_back_exactly_under_concurrent_stores(tmp_path: Path) -> None:
    # Three threads store bursts of jobs (new keys, keys already present, some refused for backpressure by a
    # tiny write budget) while a poller takes results, so collects of one job and of many (the batch judgement)
    # both settle: once all is done, the write budget holds nothing and the root's count is the files on disk.
    root = tmp_path / "root"
    threads_n, rounds, burst, per = 3, 8, 4, 2
    with open_tier(root, num_slots=threads_n * burst * per, max_bytes=1 << 30, max_write_queue_seconds=2e-4) as tier:
        stop = threading.Event()
        causes: dict[object, object] = {}

        def poll() -> None:
            while not stop.is_set():
                causes.update((r.job_id, r.cause) for r in tier.get_finished())
                time.sleep(0.005)  # several jobs finish between two polls: one collect of many

        def storer(t: int) -> None:
            for r in range(rounds):
                ids = []
                for j in range(burst):
                    slots = [(t * burst + j) * per + i for i in range(per)]
                    ks = keys(10000 * t + 100 * (r // 2) + per * j, per)  # every second round: the same keys
                    fill(tier, ks, slots)
                    tier.submit_store((t, r, j), ks, slots)
                    ids.append((t, r, j))
                while not all(i in causes for i in ids):  # its slots are reused by the next round
                    time.sleep(0.001)

        poller = threading.Thread(target=poll)
        poller.start()
        storers = [threading.Thread(target=storer, args=(t,)) for t in range(threads_n)]
        for t in storers:
            t.start()
        for t in storers:
            t.join(60)
        assert tier.drain(10)
        stop.set()
        poller.join()
        assert len(causes) == threads_n * rounds * burst and set(causes.values()) <= {None, "backpressure"}
        assert tier.metrics.snapshot()["fstier_queued_store_bytes"] == 0 and tier._budget.queued == 0
        shared = tier.capacity._shared
        assert shared is not None and shared.inflight == 0
        on_disk = sum(f.stat().st_size for f in root.rglob("*.bin"))
        assert on_disk > 0 and shared.read() == on_disk
