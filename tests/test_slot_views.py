"""A batch's slot views (``slot_views`` / ``payload_views``) are exactly the
per-slot ``slot_view`` answers, and a job names its files once.

Every provider's batch ``slot_views`` (HostBlockPool, RowSlots with a
stride and an offset, JoinedSlots, LMCache's LentSlots, and a provider
without one, served by ``slot_view`` through ``map``) is checked against
``slot_view`` for the same slots: the same memory, length, format and
writability, and the same refusal (type and message) for a slot the
per-slot call refuses. FsTier's I/O threads cut those views to each
payload's exact length, and a load or store batch encodes its keys' paths
once, for its I/O and its recency note alike: the note names exactly the
keys loaded (or the keys a store skipped), on both I/O paths.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from manager_support import keys, load, open_tier, store

import fstier.io.blockstore as blockstore_mod
from fstier.integrations.lmcache_space import LentSlots
from fstier.slots import HostBlockPool, JoinedSlots, RowSlots
from fstier.slots.provider import SlotProvider, payload_views, slot_views

NUM = 8
ROW = 3000


class ViewOnly:
    """A provider with ``slot_view`` and no batch ``slot_views``."""

    def __init__(self, inner: RowSlots) -> None:
        self.inner = inner
        self.num_slots, self.slot_bytes = inner.num_slots, inner.slot_bytes

    def slot_view(self, i: int) -> memoryview:
        return self.inner.slot_view(i)

    def check_slots(self, slots: Sequence[int]) -> None:
        self.inner.check_slots(slots)

    def fence(self, i: int) -> None:
        self.inner.fence(i)

    def unfence(self, i: int) -> None:
        self.inner.unfence(i)


def _rows(n: int, buffers: list[Any], row: int = ROW) -> RowSlots:
    buf = mmap.mmap(-1, 64 + n * 4096)
    buffers.append(buf)
    return RowSlots(memoryview(buf), n, 4096, row_bytes=row, offset=64)


@pytest.fixture(params=["HostBlockPool", "RowSlots", "JoinedSlots", "JoinedWithPool", "LentSlots", "ViewOnly"])
def provider(request: pytest.FixtureRequest) -> Iterator[Any]:
    kind, keep = request.param, []
    if kind == "HostBlockPool":
        p: Any = HostBlockPool(NUM, 4096)
    elif kind == "RowSlots":
        p = _rows(NUM, keep)
    elif kind == "JoinedSlots":
        p = JoinedSlots(_rows(3, keep), _rows(2, keep), _rows(NUM - 5, keep))
    elif kind == "JoinedWithPool":  # an engine's rows, then fstier's own slots
        p = JoinedSlots(_rows(3, keep, 4096), HostBlockPool(NUM - 3, 4096))
    elif kind == "LentSlots":
        p = LentSlots(ROW, num_slots=NUM)
        bufs = [memoryview(bytearray(ROW)) for _ in range(NUM)]
        keep.append(bufs)
        assert p.lend(bufs) == list(range(NUM))
    else:
        p = ViewOnly(_rows(NUM, keep))
    yield p
    for q in p.providers if isinstance(p, JoinedSlots) else (p,):
        if isinstance(q, HostBlockPool):
            q.close()


def _address(v: memoryview) -> int | None:
    return int(np.frombuffer(v, dtype=np.uint8).ctypes.data) if len(v) else None


def _answer(call: Callable[[], list[memoryview]]) -> tuple[Any, ...]:
    """What a call gave: its views' memory, length, format and writability,
    or its refusal's type and message."""
    try:
        views = call()
    except Exception as exc:  # the refusal is the answer
        return ("refused", type(exc), str(exc))
    return ("views", [(_address(v), len(v), v.format, v.readonly, v.ndim) for v in views])


ORDERS = [list(range(NUM)), list(range(NUM))[::-1], [5, 1, 6, 2], [3, 3, 0], [4], [], [2, 3, 4], [0, NUM - 1]]


@pytest.mark.parametrize("slots", ORDERS)
def test_slot_views_are_slot_view_of_each_slot(provider: Any, slots: list[int]) -> None:
    assert isinstance(provider, SlotProvider)
    want = _answer(lambda: [provider.slot_view(s) for s in slots])
    assert want[0] == "views"
    assert _answer(lambda: slot_views(provider, slots)) == want
    if hasattr(provider, "slot_views"):  # the provider's own batch, called directly
        assert _answer(lambda: provider.slot_views(slots)) == want


@pytest.mark.parametrize("slots", [[0, NUM], [NUM + 5], [-1], [1, True], [0, 1.0], [np.int64(2)], ["0"]])
def test_slot_views_refuse_or_answer_as_slot_view_does(provider: Any, slots: list[Any]) -> None:
    """A slot out of range or not a plain int: whatever ``slot_view`` says
    (a refusal, or the view it gives), the batch says the same."""
    want = _answer(lambda: [provider.slot_view(s) for s in slots])
    assert _answer(lambda: slot_views(provider, slots)) == want


def test_payload_views_are_each_slots_payload_exactly(provider: Any) -> None:
    slots, nbytes = [6, 0, 3], [provider.slot_bytes, 1, 100]
    got = payload_views(provider, slots, nbytes)
    want = [provider.slot_view(s)[:n] for s, n in zip(slots, nbytes, strict=True)]
    assert _answer(lambda: got) == _answer(lambda: want)
    assert [len(v) for v in got] == nbytes
    with pytest.raises(ValueError, match="3 slots but 2 payload lengths"):
        payload_views(provider, slots, nbytes[:2])


@pytest.mark.parametrize("slots", [*ORDERS, [0, NUM], [NUM + 5], [-1], [1, True], [0, 1.0], [np.int64(2)], ["0"]])
def test_payload_views_answer_as_slot_view_cut_does(provider: Any, slots: list[Any]) -> None:
    """Any slots, a provider's own ``payload_views`` (RowSlots' one slicing
    pass) included: the views, or the refusal, of ``slot_view(s)[:n]``."""
    nbytes = [1 + (7 * i) % provider.slot_bytes for i in range(len(slots))]
    want = _answer(lambda: [provider.slot_view(s)[:n] for s, n in zip(slots, nbytes, strict=True)])
    assert _answer(lambda: payload_views(provider, slots, nbytes)) == want
    if hasattr(provider, "payload_views"):  # the provider's own, called directly
        assert _answer(lambda: provider.payload_views(slots, nbytes)) == want


@pytest.mark.parametrize("slots", ORDERS)
def test_checked_payload_views_are_the_payload_views_of_checked_slots(slots: list[int]) -> None:
    """``RowSlots.payload_views_checked`` (the slicing alone, for a job FsTier checked; the one provider
    that has it) gives the views ``payload_views`` gives for plain slots in range and payloads of at
    most a slot."""
    keep: list[Any] = []
    provider = _rows(NUM, keep)
    nbytes = [1 + (7 * i) % provider.slot_bytes for i in range(len(slots))]
    got = provider.payload_views_checked(slots, nbytes)
    assert _answer(lambda: got) == _answer(lambda: payload_views(provider, slots, nbytes))
    assert [len(v) for v in got] == nbytes


def test_a_lent_slot_not_lent_is_the_same_key_error() -> None:
    p = LentSlots(16, num_slots=4)
    p.lend([memoryview(bytearray(16))])
    want = _answer(lambda: [p.slot_view(s) for s in (0, 2)])
    assert want[0] == "refused" and want[1] is KeyError
    assert _answer(lambda: p.slot_views([0, 2])) == want


# ----------------------------------------------------- one encoding per job
@pytest.fixture
def encodings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of keys of each ``encode_many`` call the block store makes."""
    calls: list[int] = []
    real = blockstore_mod.encode_many

    def counted(ks: Sequence[Any], prefix: str = "") -> list[str]:
        calls.append(len(ks))
        return real(ks, prefix)

    monkeypatch.setattr(blockstore_mod, "encode_many", counted)
    return calls


@pytest.mark.parametrize("native_io", ["auto", "off"])
def test_a_load_names_its_files_once_and_notes_exactly_the_loaded(
    tmp_path: Path, native_io: str, encodings: list[int]
) -> None:
    with open_tier(tmp_path / "root", native_io=native_io, read_threads=1, write_threads=1) as t:
        ks = keys(0, 6)
        assert store(t, "s", ks).success
        assert load(t, "l0", ks).success  # the C engine's first uniform summary of a kind names its outcome's paths
        t.flush_recency()
        encodings.clear()
        assert load(t, "l", ks).success
        # named at most once per job: by the Python engine's I/O; not at all on the C engine, which names its
        # files in C (the loaded keys' recency is noted by key, their paths named at the flush)
        in_c = native_io != "off" and t._engine.engine.backend == "native"
        assert encodings == ([] if in_c else [6])
        assert sorted(t._recency.pending()) == sorted(t.blocks.path(k) for k in ks)
        t.flush_recency()
        Path(t.blocks.path(ks[2])).unlink()  # a miss in the middle
        res = load(t, "l2", ks)
        assert res.keys_completed == 2
        # every key was attempted; the note names exactly the keys loaded
        assert sorted(t._recency.pending()) == sorted(t.blocks.path(k) for k in (ks[0], ks[1], ks[3], ks[4], ks[5]))


@pytest.mark.parametrize("native_io", ["auto", "off"])
def test_a_store_names_its_files_once_and_notes_exactly_the_skipped(
    tmp_path: Path, native_io: str, encodings: list[int]
) -> None:
    with open_tier(tmp_path / "root", native_io=native_io, read_threads=1, write_threads=1) as t:
        ks = keys(10, 6)
        assert store(t, "s", [ks[1], ks[4]]).success
        t.flush_recency()
        encodings.clear()
        res = store(t, "s2", ks)
        assert res.success and res.skipped == 2
        # named at most once per job: by the Python engine's I/O; not at all on the C engine, which names its
        # files in C (the skipped keys' recency is noted by key, their paths named at the flush)
        in_c = native_io != "off" and t._engine.engine.backend == "native"
        assert encodings == ([] if in_c else [6])
        assert sorted(t._recency.pending()) == sorted([t.blocks.path(ks[1]), t.blocks.path(ks[4])])


@pytest.mark.parametrize("native_io", ["auto", "off"])
def test_block_store_batches_use_the_callers_paths_or_refuse_a_count_mismatch(
    tmp_path: Path, native_io: str
) -> None:
    with open_tier(tmp_path / "root", native_io=native_io) as t:
        b, ks = t.blocks, keys(20, 3)
        n = t.payload_bytes(ks[0])
        bufs = [memoryview(bytearray(bytes([i]) * n)) for i in range(3)]
        with pytest.raises(ValueError, match="2 paths for 3 keys"):
            b.store_many(list(zip(ks, bufs, strict=True)), paths=b.paths(ks)[:2])
        with pytest.raises(ValueError, match="2 paths for 3 keys"):
            b.load_many(list(zip(ks, bufs, strict=True)), paths=b.paths(ks)[:2])
        outs = b.store_many(list(zip(ks, bufs, strict=True)), paths=b.paths(ks))
        assert [o.status for o in outs] == ["STORED"] * 3
        back = [memoryview(bytearray(n)) for _ in range(3)]
        outs = b.load_many(list(zip(ks, back, strict=True)), paths=b.paths(ks))
        assert [o.status for o in outs] == ["LOADED"] * 3
        assert [bytes(v) for v in back] == [bytes(v) for v in bufs]


def test_a_python_store_batch_refuses_replace_flags_of_another_length(tmp_path: Path) -> None:
    """As before the batch took its paths: a strict zip, never a key dropped silently."""
    with open_tier(tmp_path / "root", native_io="off") as t:
        b, ks = t.blocks, keys(30, 3)
        bufs = [memoryview(bytearray(t.payload_bytes(k))) for k in ks]
        with pytest.raises(ValueError, match="zip"):
            b.store_many(list(zip(ks, bufs, strict=True)), replace=[False, False])
