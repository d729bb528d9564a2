"""BlockingJobs (fstier.integrations._blocking): FsTier jobs run to
completion inside a synchronous engine call (SGLang's storage calls), on a
real FsTier over an engine's rows. The SGLang backend's own tests
(tests/sglang) drive it through SGLang's real classes; these run in the
main suite, without SGLang."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
from manager_support import FILE_BYTES, key, keys, payload_for, tiny_config

from fstier.integrations._blocking import BlockingJobs
from fstier.manager import FsTier
from fstier.slots import RowSlots

THREADS, PER = 4, 9  # each thread: 4 rows to store from, 5 to load into


def test_each_calling_thread_gets_its_own_jobs_result(tmp_path: Path) -> None:
    rows = RowSlots(memoryview(bytearray(THREADS * PER * FILE_BYTES)), THREADS * PER, FILE_BYTES)
    errors: list[str] = []
    with FsTier(tiny_config(tmp_path / "root"), rows, hold_fenced_results=True) as tier:
        jobs = BlockingJobs(tier, "Test")
        n = tier.payload_bytes(key(0))

        def caller(t: int) -> None:
            ks = keys(t * 10, 4)
            src = list(range(t * PER, t * PER + 4))
            dst = list(range(t * PER + 4, t * PER + 9))
            for k, s in zip(ks, src, strict=True):
                rows.slot_view(s)[:n] = payload_for(k, n)
            for rep in range(5):
                r = jobs.run("store", ks, src)
                if r is None or not r.success or r.keys_completed != 4 or r.job_id[:2] != ("test", "store"):
                    errors.append(f"thread {t} store {rep}: {r}")
                for s in dst:
                    rows.slot_view(s)[:] = b"\xee" * FILE_BYTES
                # the last key was never stored: a 4-key prefix, then a miss
                r = jobs.run("load", [*ks, key(1000 + t)], dst)
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
        assert tier.take_events() == []  # a blocking caller publishes none: taken at each poll
    rows.release()


def test_a_refused_job_is_none_and_a_log_line_not_an_exception(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = RowSlots(memoryview(bytearray(4 * FILE_BYTES)), 4, FILE_BYTES)
    with FsTier(tiny_config(tmp_path / "root"), rows) as tier:
        jobs = BlockingJobs(tier, "Test")
        with caplog.at_level(logging.ERROR, logger="fstier.test"):
            assert jobs.run("store", keys(0, 1), [99]) is None  # no such row
        assert "fstier: Test store of 1 file(s) refused" in caplog.text
        rows.fence(2)
        assert jobs.run("load", keys(0, 1), [2]) is None  # a fenced row
        rows.unfence(2)
    assert jobs.run("load", keys(0, 1), [2]) is None  # a closed tier
    rows.release()
