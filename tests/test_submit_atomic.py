"""A submit is taken by the engine or given back whole, whatever interrupts it.

An interrupt (KeyboardInterrupt) or a signal handler's exception (here TimeoutError, as SIGALRM raising it) is
injected at each point of a store's submit, before and after the engine takes the job, on the engine this run
uses (the C engine; FSTIER_ENGINE=python and FSTIER_NATIVE=0: the Python engine). Before the take the job is
given back: nothing in flight, the write budget and the root's usage count as before, the job id free again.
After it the exception still reaches the caller and the job completes: its result published once, its files
on disk and counted once, nothing logged as an error."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from manager_support import fill, keys, load, open_tier, store

from fstier.manager import FsTier

C_POINTS = ("args", "c_before", "c_after")  # building the C call's arguments; the C call, not run / returned
PY_POINTS = ("queue_before", "queue_after")  # the Python engine's bookkeeping before its queue append; after it
AFTER = {"c_after", "queue_after"}


def _engine(tier: FsTier) -> Any:
    return tier._engine.engine  # type: ignore[attr-defined]


def _is_c(tier: FsTier) -> bool:
    return type(_engine(tier)).__name__ == "NativeEngine" and tier.io_path.backend == "native"


@contextmanager
def _raise_once(tier: FsTier, point: str, exc: type[BaseException]) -> Iterator[list[str]]:
    """Raise ``exc`` once at ``point`` of the next submit; yields the points that raised."""
    engine, hit = _engine(tier), []

    def once(real: Callable[..., Any], before: bool) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            if hit:
                return real(*a, **k)
            hit.append(point)
            if before:
                raise exc("injected")
            real(*a, **k)
            raise exc("injected")
        return call

    if point == "args":
        buffers = tier._maker._fixed["buffers"]
        real_views = buffers.views
        buffers.views = once(real_views, True)
        try:
            yield hit
        finally:
            buffers.views = real_views
    elif point in ("c_before", "c_after"):
        real_ext = engine._ext

        class Ext:
            engine_submit = staticmethod(once(real_ext.engine_submit, point == "c_before"))

            def __getattr__(self, name: str) -> Any:
                return getattr(real_ext, name)

        engine._ext = Ext()
        try:
            yield hit
        finally:
            engine._ext = real_ext
    elif point == "queue_before":
        work = engine._work
        work.notify = once(work.notify, True)
        try:
            yield hit
        finally:
            del work.notify
    else:
        q = engine._queues["write"]

        class Queue(deque):  # type: ignore[type-arg]
            append = once(deque.append, False)

        engine._queues["write"] = Queue(q)
        yield hit


def _usage(tier: FsTier) -> int:
    deadline = time.monotonic() + 10
    while tier.usage_bytes is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tier.usage_bytes is not None
    return tier.usage_bytes


@pytest.mark.parametrize("exc", [KeyboardInterrupt, TimeoutError])
@pytest.mark.parametrize("point", C_POINTS + PY_POINTS)
def test_an_interrupted_store_is_given_back_whole_or_completes(
    tmp_path: Path, point: str, exc: type[BaseException], caplog: pytest.LogCaptureFixture
) -> None:
    with open_tier(tmp_path / "root", max_bytes=64 << 20) as tier:
        if (point in C_POINTS) != _is_c(tier):
            pytest.skip(f"{point}: a point of the {'C' if point in C_POINTS else 'Python'} engine's submit")
        assert store(tier, "warm", keys(0, 2)).success  # the C engine's fixed arguments cached: one C call
        before = _usage(tier)
        ks = keys(4, 2)
        fill(tier, ks, [2, 3])
        with caplog.at_level(logging.ERROR, logger="fstier"):
            with _raise_once(tier, point, exc) as hit, pytest.raises(exc, match="injected"):
                tier.submit_store("J", ks, [2, 3])
            assert hit == [point]
            assert tier.drain(5)
            results = tier.get_finished()
            assert not tier.has_pending()
            assert tier.metrics.snapshot()["fstier_queued_store_bytes"] == 0
            on_disk = [k for k in ks if os.path.isfile(tier.blocks.path(k))]
            if point in AFTER:  # taken: it completed, published once, its files counted once
                assert [(r.job_id, r.success, r.keys_completed) for r in results] == [("J", True, 2)]
                assert on_disk == ks
                assert tier.usage_bytes == before + sum(os.path.getsize(tier.blocks.path(k)) for k in ks)
                assert load(tier, "L", ks).success
            else:  # given back: nothing of it left, the id free again
                assert results == [] and on_disk == []
                assert tier.usage_bytes == before
                assert store(tier, "J", ks, [2, 3]).success
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize(
    ("before", "exc"), [(True, KeyboardInterrupt), (False, KeyboardInterrupt), (False, TimeoutError)]
)
def test_an_interrupted_recency_flush_is_given_back_whole_or_completes(
    tmp_path: Path, before: bool, exc: type[BaseException], caplog: pytest.LogCaptureFixture
) -> None:
    # The recency flush's C touch job follows the same rule: not taken, the engine keeps no trace of it (no tag,
    # the registration idle); taken, C touches the files and its completion finds the job (no error logged).
    with open_tier(tmp_path / "root") as tier:
        if not _is_c(tier):
            pytest.skip("the C engine's touch job (FSTIER_ENGINE=python or native I/O off runs another)")
        engine = _engine(tier)
        assert store(tier, "s", keys(0, 2)).success
        path = tier.blocks.path(keys(0, 1)[0])
        os.utime(path, (1_000_000, 1_000_000))
        real_ext, hit = engine._ext, []

        class Ext:
            @staticmethod
            def engine_touch(*a: Any) -> None:
                hit.append(a[1])
                if not before:
                    real_ext.engine_touch(*a)
                raise exc("injected")

            def __getattr__(self, name: str) -> Any:
                return getattr(real_ext, name)

        engine._ext = Ext()
        try:
            with caplog.at_level(logging.ERROR, logger="fstier"), pytest.raises(exc, match="injected"):
                tier._recency._submit_flush([path])
        finally:
            engine._ext = real_ext
        assert len(hit) == 1
        with caplog.at_level(logging.ERROR, logger="fstier"):
            deadline = time.monotonic() + 10
            while not before and os.stat(path).st_mtime == 1_000_000 and time.monotonic() < deadline:
                time.sleep(0.01)  # C touched the file: its completion is due
            assert tier._engine.wait_idle(5)  # type: ignore[attr-defined]
            assert tier.drain(5)
            engine._pump_all()
        assert (os.stat(path).st_mtime == 1_000_000) is before
        assert not engine._jobs and not tier.has_pending() and tier._engine.active == 0  # type: ignore[attr-defined]
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("exc", [KeyboardInterrupt, TimeoutError])
@pytest.mark.parametrize("max_bytes", [None, 64 << 20])
def test_a_store_interrupted_right_after_its_admission_is_given_back_whole(
    tmp_path: Path, max_bytes: int | None, exc: type[BaseException], caplog: pytest.LogCaptureFixture
) -> None:
    # The window between the admission's reservation and the hand-over to the engine: the exception arrives as
    # the write budget's reservation returns (no max_bytes: the common job's path; with max_bytes the root's
    # usage was counted just before it). Given back: nothing in flight, no budget or usage leaked, the id free.
    with open_tier(tmp_path / "root", max_bytes=max_bytes) as tier:
        assert store(tier, "warm", keys(0, 2)).success
        before = _usage(tier) if max_bytes else None
        ks = keys(4, 2)
        fill(tier, ks, [2, 3])
        budget, hit = tier._budget, []
        real = budget.admit

        def admitted(*a: Any, **k: Any) -> Any:
            out = real(*a, **k)
            if not hit:
                hit.append(out)
                raise exc("injected")
            return out

        budget.admit = admitted  # type: ignore[method-assign]
        try:
            with caplog.at_level(logging.ERROR, logger="fstier"), pytest.raises(exc, match="injected"):
                tier.submit_store("J", ks, [2, 3])
        finally:
            del budget.admit
        assert hit == [True]  # it was admitted: its bytes reserved
        assert tier.drain(5) and tier.get_finished() == [] and not tier.has_pending()
        assert tier.metrics.snapshot()["fstier_queued_store_bytes"] == 0
        assert tier.usage_bytes == before
        assert not [k for k in ks if os.path.isfile(tier.blocks.path(k))]
        assert store(tier, "J", ks, [2, 3]).success
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("exc", [KeyboardInterrupt, TimeoutError])
@pytest.mark.parametrize("point", ["counted", "budget"])
def test_a_store_interrupted_between_its_usage_count_and_its_budget_is_given_back_whole(
    tmp_path: Path, point: str, exc: type[BaseException], caplog: pytest.LogCaptureFixture
) -> None:
    # With max_bytes a store's admission counts its bytes in the root's usage, then reserves them in the write
    # budget. The exception arrives as the count returns ("counted") or as the budget's reservation begins
    # ("budget": nothing reserved there yet). Given back: the root's usage as before, no budget, the id free.
    with open_tier(tmp_path / "root", max_bytes=64 << 20) as tier:
        assert store(tier, "warm", keys(0, 2)).success
        before = _usage(tier)
        ks = keys(4, 2)
        fill(tier, ks, [2, 3])
        owner = tier.capacity if point == "counted" else tier._budget
        name = "try_reserve" if point == "counted" else "admit"
        real, hit = getattr(owner, name), []

        def interrupted(*a: Any, **k: Any) -> Any:
            if hit:
                return real(*a, **k)
            hit.append(real(*a, **k) if point == "counted" else None)
            raise exc("injected")

        setattr(owner, name, interrupted)
        try:
            with caplog.at_level(logging.ERROR, logger="fstier"), pytest.raises(exc, match="injected"):
                tier.submit_store("J", ks, [2, 3])
        finally:
            delattr(owner, name)
        assert hit == ([True] if point == "counted" else [None])
        assert tier.drain(5) and tier.get_finished() == [] and not tier.has_pending()
        assert tier.metrics.snapshot()["fstier_queued_store_bytes"] == 0
        assert tier.usage_bytes == before
        assert not [k for k in ks if os.path.isfile(tier.blocks.path(k))]
        assert store(tier, "J", ks, [2, 3]).success
        assert tier.usage_bytes == before + sum(os.path.getsize(tier.blocks.path(k)) for k in ks)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
