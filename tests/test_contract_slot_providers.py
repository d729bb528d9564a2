"""The slot provider contract (fstier.slots.provider.SlotProvider), one suite
run against every implementation: fstier's own HostBlockPool, RowSlots
(an engine's rows lent in place, here with a stride wider than a row and an
offset, as vLLM's rows may have) and JoinedSlots (an engine's rows, then
rows of fstier's own, as SGLang's backend joins them)."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from manager_support import FILE_BYTES, keys, payload_for, tiny_config

from fstier.manager import FsTier
from fstier.slots import HostBlockPool, JoinedSlots, RowSlots, SlotProvider

NUM = 8


@dataclass
class Provider:
    slots: SlotProvider
    usable: list[int]  # slots a job may name now
    outside: memoryview | None  # bytes next to the slots that must stay untouched


@pytest.fixture(params=["HostBlockPool", "RowSlots", "JoinedSlots"])
def provider(request: pytest.FixtureRequest) -> Iterator[Provider]:
    if request.param == "HostBlockPool":
        pool = HostBlockPool(NUM, FILE_BYTES)
        usable = pool.alloc(NUM - 2)  # two slots stay free: not the caller's
        try:
            yield Provider(pool, usable, None)
        finally:
            pool.close()
    elif request.param == "JoinedSlots":
        engine = bytearray(3 * FILE_BYTES)  # the engine's rows, then fstier's
        own = bytearray((NUM - 3) * FILE_BYTES)
        joined = JoinedSlots(
            RowSlots(memoryview(engine), 3, FILE_BYTES), RowSlots(memoryview(own), NUM - 3, FILE_BYTES)
        )
        try:
            yield Provider(joined, list(range(NUM)), None)
        finally:
            joined.release()
    else:
        row, stride, offset = FILE_BYTES - 4096 + 100, FILE_BYTES, 64  # unaligned, shorter than the stride
        buf = mmap.mmap(-1, offset + NUM * stride)
        view = memoryview(buf)
        rows = RowSlots(view, NUM, stride, row_bytes=row, offset=offset)
        try:
            yield Provider(rows, list(range(NUM)), view)
        finally:
            rows.release()
            view.release()
            buf.close()


def test_is_a_slot_provider(provider: Provider) -> None:
    assert isinstance(provider.slots, SlotProvider)
    assert provider.slots.num_slots == NUM


def test_slot_view_is_writable_and_exactly_slot_bytes(provider: Provider) -> None:
    p = provider.slots
    for i in provider.usable:
        v = p.slot_view(i)
        assert len(v) == p.slot_bytes and not v.readonly
        v[:] = bytes([i]) * p.slot_bytes
    for i in provider.usable:  # slots do not overlap
        assert bytes(p.slot_view(i)) == bytes([i]) * p.slot_bytes


@pytest.mark.parametrize("bad", [-1, NUM, 1.0, True, "0"])
def test_check_slots_names_a_slot_out_of_range(provider: Provider, bad: Any) -> None:
    with pytest.raises(ValueError, match="slot"):
        provider.slots.check_slots([provider.usable[0], bad])
    provider.slots.check_slots(provider.usable)


def test_a_fenced_slot_is_refused_until_unfenced(provider: Provider) -> None:
    p, s = provider.slots, provider.usable[1]
    p.fence(s)
    try:
        if isinstance(p, HostBlockPool):  # the pool never hands it out again while fenced, even once freed
            p.free([s])
            assert s not in p.alloc(p.num_free)
        else:  # the engine owns the rows: a job may not name it
            with pytest.raises(ValueError, match="fenced"):
                p.check_slots([s])
    finally:
        p.unfence(s)
    if isinstance(p, HostBlockPool):
        assert s in p.alloc(1)
    p.check_slots([s])


def test_fstier_moves_exactly_the_payload_through_any_provider(provider: Provider, tmp_path: Path) -> None:
    p = provider.slots
    if provider.outside is not None:
        provider.outside[:] = b"\xab" * len(provider.outside)
        guard = bytes(provider.outside)
    with FsTier(tiny_config(tmp_path / "root"), p) as tier:
        ks = keys(0, 3)
        slots = provider.usable[:3]
        for k, s in zip(ks, slots, strict=True):
            p.slot_view(s)[: tier.payload_bytes(k)] = payload_for(k, tier.payload_bytes(k))
        tier.submit_store("s", ks, slots)
        tier.drain()
        (res,) = tier.get_finished()
        assert res.success and res.keys_completed == 3
        back = provider.usable[3:6]
        for s in back:
            p.slot_view(s)[:] = b"\xee" * p.slot_bytes
        tier.submit_load("l", ks, back)
        tier.drain()
        (res,) = tier.get_finished()
        assert res.success
        for k, s in zip(ks, back, strict=True):
            n = tier.payload_bytes(k)
            assert bytes(p.slot_view(s)[:n]) == payload_for(k, n)
            assert bytes(p.slot_view(s)[n:]) == b"\xee" * (p.slot_bytes - n)  # nothing past the payload
    if provider.outside is not None:  # bytes between rows: never read into, never written
        gaps = [
            (64 + i * FILE_BYTES + p.slot_bytes, 64 + (i + 1) * FILE_BYTES) for i in range(NUM - 1)
        ]
        for a, b in [(0, 64), *gaps]:
            assert bytes(provider.outside[a:b]) == guard[a:b]


def test_a_job_naming_a_slot_it_may_not_use_is_refused(provider: Provider, tmp_path: Path) -> None:
    p = provider.slots
    with FsTier(tiny_config(tmp_path / "root"), p) as tier:
        with pytest.raises(ValueError, match="slot"):
            tier.submit_store("s", keys(0, 1), [NUM])
        if isinstance(p, HostBlockPool):  # a slot the caller does not hold
            free = sorted(set(range(NUM)) - set(provider.usable))[0]
            with pytest.raises(ValueError, match="not allocated"):
                tier.submit_store("s2", keys(0, 1), [free])


def test_joined_slots_route_to_their_providers_and_refuse_mixed_sizes() -> None:
    a, b = bytearray(2 * 4096), bytearray(3 * 4096)
    ra, rb = RowSlots(memoryview(a), 2, 4096), RowSlots(memoryview(b), 3, 4096)
    joined = JoinedSlots(ra, rb)
    assert (joined.num_slots, joined.slot_bytes, joined.start_of(1)) == (5, 4096, 2)
    for i in range(5):
        joined.slot_view(i)[:] = bytes([i + 1]) * 4096
    assert a == bytes([1]) * 4096 + bytes([2]) * 4096
    assert b == bytes([3]) * 4096 + bytes([4]) * 4096 + bytes([5]) * 4096
    joined.fence(3)  # provider b's row 1
    assert rb.fenced == frozenset({1}) and ra.fenced == frozenset()
    with pytest.raises(ValueError, match=r"slot 3 \(its provider's slot 1\).*fenced"):
        joined.check_slots([0, 3])
    joined.unfence(3)
    joined.check_slots([0, 3])
    joined.release()
    with pytest.raises(ValueError, match="same slot_bytes"):
        JoinedSlots(RowSlots(memoryview(bytearray(8192)), 1, 8192), RowSlots(memoryview(bytearray(4096)), 1, 4096))
    with pytest.raises(ValueError, match="at least one"):
        JoinedSlots()
