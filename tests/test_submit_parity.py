"""The submit's straight line (``Submitter.submit``'s common job) and its general path
(``Submitter._general``: ``check_job``, ``payload_sizes``, ``JobMaker.job``) answer every job alike: the
same refusal (type and message) or the same result (success, cause, keys, bytes moved), on the same tier
state. Each job is submitted to two tiers of one kind, one as it runs and one whose straight line is off
(every job by the general path), and their answers compared; the straight line is checked to be taken
on the first (else the comparison proves nothing). Each slot provider's ``check_plain`` (the straight
line's) refuses exactly what its ``check_slots`` (the general path's) refuses."""

from __future__ import annotations

import enum
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from manager_support import FILE_BYTES, fill, key, keys, open_tier, payload_for, slot_bytes

from fstier.integrations.lmcache_space import LentSlots
from fstier.io.engine import EngineJob
from fstier.keys import BlockKey
from fstier.manager import FsTier
from fstier.slots.host_pool import HostBlockPool
from fstier.slots.rows import RowSlots
from fstier.tier import jobs


class _Idx(enum.IntEnum):
    ONE = 1


class _Key(BlockKey):
    """A BlockKey subclass (a caller's own)."""


def _gen(ks: list[BlockKey]) -> Iterator[BlockKey]:
    yield from ks


#: name -> (keys, slots) of a store; the tier has 8 slots, all held but slot 7 (freed)
CASES: dict[str, Callable[[], tuple[Any, Any]]] = {
    "common list": lambda: (keys(0, 3), [0, 1, 2]),
    "common tuple": lambda: (tuple(keys(10, 2)), (3, 4)),
    "bool slot": lambda: (keys(20, 2), [0, True]),
    "numpy int slots": lambda: (keys(30, 2), [np.int64(0), np.int64(1)]),
    "numpy slot array": lambda: (keys(40, 2), np.array([0, 1])),
    "int subclass slot": lambda: (keys(50, 2), [0, _Idx.ONE]),
    "negative slot": lambda: (keys(60, 2), [0, -1]),
    "slot out of range": lambda: (keys(70, 2), [0, 8]),
    "duplicate slot": lambda: (keys(80, 2), [2, 2]),
    "slot not held": lambda: (keys(90, 2), [0, 7]),
    "float slot": lambda: (keys(100, 1), [1.0]),
    "unknown group": lambda: ([key(110), key(111, group=1)], [0, 1]),
    "BlockKey subclass": lambda: ([_Key(key(120).block_hash, 0)], [0]),
    "not a key": lambda: ([key(130), "x"], [0, 1]),
    "lengths differ": lambda: (keys(140, 2), [0]),
    "empty": lambda: ([], []),
    "range slots": lambda: (keys(150, 2), range(2)),
    "generator keys": lambda: (_gen(keys(160, 2)), [0, 1]),
}


def _answer(tier: FsTier, job_id: str, ks: Any, slots: Any) -> tuple[Any, ...]:
    """What the tier answers a store of ``ks`` from ``slots``: its refusal, or its result and the bytes
    a load of the stored keys brings back."""
    try:
        tier.submit_store(job_id, ks, slots)
    except Exception as exc:  # the refusal, as the caller sees it
        text = re.sub(r" at 0x[0-9a-f]+", "", str(exc).replace(repr(tier.pool.name), "<pool>"))
        return ("raised", type(exc).__name__, text)
    assert tier.drain(10)
    (r,) = [r for r in tier.get_finished() if r.job_id == job_id]
    return ("result", r.kind, r.success, r.cause, r.keys_completed, r.keys_failed, r.skipped)


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[tuple[FsTier, FsTier]]:
    with ExitStack() as stack:
        fast = stack.enter_context(open_tier(tmp_path / "fast", num_slots=8))
        general = stack.enter_context(open_tier(tmp_path / "general", num_slots=8))
        general._submitter._one = None  # every job by the general path (a multi-payload-length model's way)
        for t in (fast, general):
            t.pool.free([7])
        yield fast, general


def test_the_straight_line_and_the_general_path_answer_every_job_alike(
    tiers: tuple[FsTier, FsTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    fast, general = tiers
    by_general: list[int] = []
    real = jobs.check_job

    def check_job(job_id: Any, *a: Any, **k: Any) -> None:
        by_general.append(id(job_id))
        real(job_id, *a, **k)

    monkeypatch.setattr(jobs, "check_job", check_job)
    for name, case in CASES.items():
        answers = []
        for tier in (fast, general):
            ks, slots = case()
            if isinstance(ks, list | tuple) and all(type(k) is BlockKey for k in ks) and len(ks) == len(slots):
                with suppress(Exception):  # a slot the pool has not: nothing to fill
                    fill(tier, ks, [int(s) for s in slots])
            before = len(by_general)
            answers.append(_answer(tier, name, ks, slots))
            if tier is fast and name.startswith("common"):
                assert len(by_general) == before, f"{name}: the straight line was not taken"
            if tier is general:
                assert len(by_general) == before + 1, f"{name}: the general path was not taken"
        assert answers[0] == answers[1], f"{name}: straight line {answers[0]} != general path {answers[1]}"
    # What was stored is what the common jobs' slots held, on both tiers, read back through the straight line.
    for tier in (fast, general):
        ks = keys(0, 3) + keys(10, 2)
        for s in range(5):
            tier.pool.slot_view(s)[:] = b"\xee" * tier.pool.slot_bytes
        tier.submit_load("back", ks, list(range(5)))
        assert tier.drain(10)
        (r,) = tier.get_finished()
        assert r.success and r.keys_completed == 5
        assert [slot_bytes(tier, k, s) for s, k in enumerate(ks)] == [
            payload_for(k, tier.payload_bytes(k)) for k in ks
        ]


def test_a_slot_fenced_between_the_straight_lines_test_and_its_lock_refuses_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The straight line reads the fences without the tier's lock; a timed-out job whose slot it names may be
    # reaped (fenced) after that read: the job is then refused slot_busy (a load's slot a late unit may still
    # write is never handed to a new job), and runs once the slot is released.
    with open_tier(tmp_path, num_slots=8) as tier:
        ks = keys(0, 2)
        fill(tier, ks, [0, 1])
        tier.submit_store("s", ks, [0, 1])
        assert tier.drain(10) and tier.get_finished()[0].success
        late = EngineJob.made({}, tag="late", kind="load", keys=(), slots=(1,), fenced=(1,),
                               released=False, timeout_s=1.0)
        real = tier._submitter._check_plain

        def check_plain(slots: Any) -> None:  # the provider's check, after the unlocked test of the fences
            with tier._lock:
                tier._fences.fence_job(late)
            real(slots)

        monkeypatch.setattr(tier._submitter, "_check_plain", check_plain)
        for s in (0, 1):
            tier.pool.slot_view(s)[:] = b"\xee" * tier.pool.slot_bytes
        tier.submit_load("l", ks, [0, 1])
        assert tier.drain(10)
        (r,) = tier.get_finished()
        assert (r.success, r.cause, r.keys_completed) == (False, "slot_busy", 0)
        assert bytes(tier.pool.slot_view(1)[:8]) == b"\xee" * 8  # nothing moved into the fenced slot
        monkeypatch.undo()
        released = threading.Thread(target=tier._fences.on_released, args=(late,))
        released.start()
        released.join()
        tier.submit_load("l2", ks, [0, 1])
        assert tier.drain(10)
        (r,) = tier.get_finished()
        assert r.success and r.keys_completed == 2
        assert slot_bytes(tier, ks[1], 1) == payload_for(ks[1], tier.payload_bytes(ks[1]))


def _refusal(check: Callable[[list[int]], None], slots: list[int]) -> str | None:
    try:
        check(slots)
    except ValueError as exc:
        return str(exc)
    return None


def test_each_providers_check_plain_refuses_exactly_what_its_check_slots_refuses() -> None:
    # The straight line calls the provider's check_plain (slots already known plain, distinct, in range); over
    # random histories of each provider (alloc/free, lend/release, fence/unfence) it refuses exactly the slot
    # lists check_slots refuses, with the same message.
    rng = np.random.default_rng(5)
    n = 12
    pool = HostBlockPool(n, FILE_BYTES)
    rows = RowSlots.from_primary_view(memoryview(bytearray(n * 64)).cast("B", (n, 64)))
    lent = LentSlots(64, n)
    held: list[int] = []
    lent_now: list[int] = []
    refused = {"pool": 0, "rows": 0, "lent": 0}
    try:
        for _ in range(400):
            op = rng.integers(6)
            if op == 0 and len(held) < n:
                held += pool.alloc(1)
            elif op == 1 and held:
                pool.free([held.pop(int(rng.integers(len(held))))])
            elif op == 2:
                i = int(rng.integers(n))
                (rows.fence if rng.integers(2) else rows.unfence)(i)
            elif op == 3 and len(lent_now) < n:
                got = lent.lend([memoryview(bytearray(64))])
                lent_now += got or []
            elif op == 4 and lent_now:
                lent.release([lent_now.pop(int(rng.integers(len(lent_now))))])
            elif op == 5:
                i = int(rng.integers(n))
                (lent.fence if rng.integers(2) else lent.unfence)(i)
            slots = [int(s) for s in rng.choice(n, size=int(rng.integers(1, 5)), replace=False)]
            for name, p in (("pool", pool), ("rows", rows), ("lent", lent)):
                want = _refusal(p.check_slots, slots)
                assert _refusal(p.check_plain, slots) == want, (name, slots)
                refused[name] += want is not None
        assert all(refused.values()), refused  # each provider refused some lists (else nothing was compared)
    finally:
        rows.release()
        pool.close()
