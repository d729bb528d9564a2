"""run_job (fstier.integrations._blocking) and FsTier.wait: FsTier jobs run
to completion inside a synchronous engine call (SGLang's storage calls), each
caller woken by its own job's completion, on a real FsTier over an engine's
rows. The SGLang backend's own tests
(tests/sglang) drive it through SGLang's real classes; these run in the
main suite, without SGLang."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from pathlib import Path

import pytest
from manager_support import FILE_BYTES, key, keys, payload_for, tiny_config

from fstier.integrations._blocking import run_job
from fstier.manager import FsTier
from fstier.slots import RowSlots

THREADS, PER = 4, 9  # each thread: 4 rows to store from, 5 to load into


def test_each_calling_thread_gets_its_own_jobs_result(tmp_path: Path) -> None:
    rows = RowSlots(memoryview(bytearray(THREADS * PER * FILE_BYTES)), THREADS * PER, FILE_BYTES)
    errors: list[str] = []
    with FsTier(tiny_config(tmp_path / "root"), rows, hold_fenced_results=True) as tier:
        tags = itertools.count()
        n = tier.payload_bytes(key(0))

        def run(kind: str, ks: list, slots: list[int]):  # type: ignore[no-untyped-def]
            return run_job(tier, ("test", kind, next(tags)), kind, ks, slots, "Test")

        def caller(t: int) -> None:
            ks = keys(t * 10, 4)
            src = list(range(t * PER, t * PER + 4))
            dst = list(range(t * PER + 4, t * PER + 9))
            for k, s in zip(ks, src, strict=True):
                rows.slot_view(s)[:n] = payload_for(k, n)
            for rep in range(5):
                r = run("store", ks, src)
                if r is None or not r.success or r.keys_completed != 4 or r.job_id[:2] != ("test", "store"):
                    errors.append(f"thread {t} store {rep}: {r}")
                for s in dst:
                    rows.slot_view(s)[:] = b"\xee" * FILE_BYTES
                # the last key was never stored: a 4-key prefix, then a miss
                r = run("load", [*ks, key(1000 + t)], dst)
                if r is None or r.success or r.keys_completed != 4:
                    errors.append(f"thread {t} load {rep}: {r}")
                    continue
                for k, s in zip(ks, dst, strict=False):
                    if bytes(rows.slot_view(s)[:n]) != payload_for(k, n):
                        errors.append(f"thread {t} load {rep}: row {s} holds another key's bytes")

        threads = [threading.Thread(target=caller, args=(t,)) for t in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not any(th.is_alive() for th in threads)
        assert errors == []
        assert tier.get_finished() == []  # every result went to its caller
        assert tier.take_events() == []  # a blocking caller publishes none: taken after each call
    rows.release()


def test_a_refused_job_is_none_and_a_log_line_not_an_exception(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = RowSlots(memoryview(bytearray(4 * FILE_BYTES)), 4, FILE_BYTES)
    with FsTier(tiny_config(tmp_path / "root"), rows) as tier:
        with caplog.at_level(logging.ERROR, logger="fstier.test"):
            assert run_job(tier, "a", "store", keys(0, 1), [99], "Test") is None  # no such row
        assert "fstier: Test store of 1 file(s) refused" in caplog.text
        rows.fence(2)
        assert run_job(tier, "b", "load", keys(0, 1), [2], "Test") is None  # a fenced row
        rows.unfence(2)
    assert run_job(tier, "c", "load", keys(0, 1), [2], "Test") is None  # a closed tier
    rows.release()


def test_wait_is_woken_by_the_engine_and_takes_only_its_own_result(tmp_path: Path) -> None:
    """FsTier.wait: each waiter gets its own job's result, taken (get_finished
    never returns it) while a job nobody waits for stays for get_finished; a
    timeout is None with the job still in flight; an unknown id is one
    ValueError naming it. Woken by the engine, not by polling: a waiter
    returns well before a 1 s poll could have noticed."""
    rows = RowSlots(memoryview(bytearray(8 * FILE_BYTES)), 8, FILE_BYTES)
    with FsTier(tiny_config(tmp_path / "root"), rows) as tier:
        n = tier.payload_bytes(key(0))
        for s in range(4):
            rows.slot_view(s)[:n] = payload_for(key(s), n)
        tier.submit_store("other", keys(0, 2), [0, 1])
        tier.submit_store("mine", keys(2, 2), [2, 3])
        t0 = time.monotonic()
        r = tier.wait("mine", timeout=30)
        assert r is not None and r.job_id == "mine" and r.success and r.keys_completed == 2
        assert time.monotonic() - t0 < 5
        assert tier.drain(30)
        assert [x.job_id for x in tier.get_finished()] == ["other"]  # "mine" was taken by its waiter
        with pytest.raises(ValueError, match="'mine'"):
            tier.wait("mine", timeout=1)  # already taken
        with pytest.raises(ValueError, match="'never'"):
            tier.wait("never")
        # decided at submission (an empty job): its result is there for wait at once
        tier.submit_load("empty", [], [])
        r = tier.wait("empty", timeout=5)
        assert r is not None and r.success and r.keys_completed == 0
    rows.release()


def test_wait_times_out_while_the_job_runs_then_returns_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait whose timeout ends first is None and leaves the job in flight;
    the next wait returns its result once the engine completed it."""
    import fstier.io.blockstore as bs

    rows = RowSlots(memoryview(bytearray(4 * FILE_BYTES)), 4, FILE_BYTES)
    release = threading.Event()
    with FsTier(tiny_config(tmp_path / "root", native_io="off"), rows) as tier:
        real = bs.BlockStore.store_many

        def held(self, *a, **kw):  # type: ignore[no-untyped-def]
            release.wait(10)
            return real(self, *a, **kw)

        monkeypatch.setattr(bs.BlockStore, "store_many", held)
        n = tier.payload_bytes(key(0))
        rows.slot_view(0)[:n] = payload_for(key(0), n)
        tier.submit_store("slow", keys(0, 1), [0])
        assert tier.wait("slow", timeout=0.2) is None
        threading.Timer(0.2, release.set).start()
        r = tier.wait("slow", timeout=30)
        assert r is not None and r.success
    rows.release()
