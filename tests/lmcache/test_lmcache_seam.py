"""What FstierL2Adapter stands on that needs no LMCache (runs in every
venv): the completion signal (``FsTier(on_finished=...)``, the job
engine's ``on_complete``, and the eventfds the job engine writes itself,
``FsTier(notify_fds=...)``) that lets an engine sleep on an eventfd instead
of polling, the lent slots, the namespace rules, the options, and the
error a user without LMCache gets."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import threading
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from fstier.config import TierConfig
from fstier.errors import ConfigError
from fstier.integrations.lmcache import LmcacheUnavailableError, tier_config_from_adapter_params
from fstier.integrations.lmcache_space import Layout, LentSlots, SpaceId, space_mapper
from fstier.io.engine.native import available as native_engine_available
from fstier.keys import BlockKey
from fstier.manager import FsTier


def _have_lmcache() -> bool:
    # The installed distribution, not find_spec: this folder (tests/lmcache)
    # is itself an importable namespace package named lmcache.
    try:
        metadata.version("lmcache")
    except metadata.PackageNotFoundError:
        return False
    return True


HAVE_LMCACHE = _have_lmcache()


class Signals:
    """An ``on_finished`` that records kinds and wakes a waiter (only signals)."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.cond = threading.Condition()

    def __call__(self, kind: str) -> None:
        with self.cond:
            self.kinds.append(kind)
            self.cond.notify_all()

    def wait(self, kind: str, timeout: float = 30.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: kind in self.kinds, timeout), f"no {kind!r} signal"
            self.kinds.remove(kind)


def _tier(root: Path, sig: Signals, nbytes: int = 8192, **tier: object) -> tuple[FsTier, LentSlots]:
    cfg = TierConfig(root_dir=root, **tier)  # type: ignore[arg-type]
    layout = Layout.of([(2, nbytes // 4)], ["float16"])
    assert layout is not None
    slots = LentSlots(layout.nbytes)
    mapper = space_mapper(SpaceId("m", 0x01000100, "", layout), cfg)
    return FsTier(cfg, slots, mapper, hold_fenced_results=True, on_finished=sig), slots


def test_a_finished_job_is_signalled_and_then_found_in_get_finished(tmp_path: Path) -> None:
    """The signal comes once the result can be taken: a caller woken by it
    never finds an empty get_finished() (no polling, no sleep)."""
    sig = Signals()
    tier, slots = _tier(tmp_path, sig)
    try:
        bufs = [np.full(8192, i, dtype=np.uint8) for i in range(4)]
        keys = [BlockKey(bytes([i]) * 32) for i in range(4)]
        ids = slots.lend([memoryview(b) for b in bufs])
        assert ids is not None
        tier.submit_store("s", keys, ids)
        sig.wait("store")
        (res,) = tier.get_finished()
        assert res.job_id == "s" and res.success and res.keys_completed == 4
        slots.release(ids)
        out = [np.zeros(8192, dtype=np.uint8) for _ in range(4)]
        ids = slots.lend([memoryview(b) for b in out])
        assert ids is not None
        tier.submit_load("l", keys, ids)
        sig.wait("load")
        (res,) = tier.get_finished()
        assert res.job_id == "l" and res.keys_completed == 4
        assert all((o == b).all() for o, b in zip(out, bufs, strict=True))
        # A job refused at once is signalled too (here: nothing to do).
        tier.submit_load("empty", [], [])
        sig.wait("load")
        assert [r.job_id for r in tier.get_finished()] == ["empty"]
    finally:
        tier.close()


def _readable(fd: int, timeout: float = 30.0) -> bool:
    """Whether ``fd`` turned readable within ``timeout`` (and drain it)."""
    if not select.select([fd], [], [], timeout)[0]:
        return False
    os.eventfd_read(fd)
    return True


@pytest.mark.parametrize("engine", ["python", "native"])
def test_the_engine_writes_the_callers_eventfd_and_the_caller_collects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """``FsTier(notify_fds=...)`` (LMCache's adapter): the engine writes the
    job's kind's eventfd once the job is published, with no callback; the
    caller's own ``get_finished`` collects it. On the C engine the fd is
    written in C: the engine's completion thread is kept out of every
    collection here (its lock held) and the fd still turns readable, so no
    Python ran between the I/O and the wake-up."""
    if engine == "native" and not native_engine_available():
        pytest.skip("the C engine is not built here")
    monkeypatch.setenv("FSTIER_ENGINE", engine)
    cfg = TierConfig(root_dir=tmp_path)
    layout = Layout.of([(2, 2048)], ["float16"])
    assert layout is not None
    slots = LentSlots(layout.nbytes)
    fds = {k: os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for k in ("store", "load")}
    mapper = space_mapper(SpaceId("m", 0x01000100, "", layout), cfg)
    tier = FsTier(cfg, slots, mapper, hold_fenced_results=True, notify_fds=fds)
    reg = tier._engine
    try:
        native_io = tier.io_path.backend == "native"

        @contextlib.contextmanager
        def no_collection() -> Iterator[None]:
            """Nothing collects the C engine's completions meanwhile: not the
            tier (its pump is off), not the completion thread (the lock of
            every collection is held here)."""
            if engine != "native" or not native_io:
                yield
                return
            pump, reg.pump = reg.pump, None
            try:
                with reg.engine._collecting:
                    yield
            finally:
                reg.pump = pump

        bufs = [np.full(8192, i + 1, dtype=np.uint8) for i in range(4)]
        keys = [BlockKey(bytes([i + 1]) * 32) for i in range(4)]
        ids = slots.lend([memoryview(b) for b in bufs])
        assert ids is not None
        with no_collection():
            tier.submit_store("s", keys, ids)
            assert _readable(fds["store"]), "the store's eventfd was not written"
        assert not _readable(fds["load"], 0), "a store wrote the load's eventfd"
        (res,) = tier.get_finished()
        assert res.job_id == "s" and res.success and res.keys_completed == 4
        slots.release(ids)
        out = [np.zeros(8192, dtype=np.uint8) for _ in range(4)]
        ids = slots.lend([memoryview(b) for b in out])
        assert ids is not None
        with no_collection():
            tier.submit_load("l", keys, ids)
            assert _readable(fds["load"]), "the load's eventfd was not written"
        (res,) = tier.get_finished()
        assert res.job_id == "l" and res.keys_completed == 4
        assert all((o == b).all() for o, b in zip(out, bufs, strict=True))
        slots.release(ids)
        tier.submit_load("empty", [], [])  # finished at once: written by the tier
        assert _readable(fds["load"], 5)
        assert [r.job_id for r in tier.get_finished()] == ["empty"]
        assert tier.drain(10)
    finally:
        tier.close()
        dups = dict(reg.notify_fds)
        for fd in fds.values():
            os.close(fd)
    assert dups == {}, "the registration kept its dups of the caller's fds after close"


def test_engine_on_complete_runs_once_the_job_is_published(tmp_path: Path) -> None:
    """The engine calls ``on_complete`` from the thread that finished the
    job once the engine's lock is released (the woken caller's
    ``get_finished`` does not wait for it) and once the job is published."""
    seen: list[tuple[str, int, bool]] = []
    done = threading.Event()
    box: list[FsTier] = []

    def on_finished(kind: str) -> None:
        tier = box[0]
        lock = tier._engine.engine.lock
        # Held by this thread (a callback run under the lock), no try succeeds; another thread (the engine's
        # completion thread's periodic step, preempted on a loaded machine) holds it only for a moment.
        free = False
        for _ in range(200):
            free = lock.acquire(blocking=False)
            if free:
                lock.release()
                break
            time.sleep(0.005)
        seen.append((kind, int(free), tier._engine.has_finished()))
        done.set()

    cfg = TierConfig(root_dir=tmp_path, native_io="off")  # type: ignore[arg-type]
    layout = Layout.of([(2, 2048)], ["float16"])
    assert layout is not None
    slots = LentSlots(layout.nbytes)
    tier = FsTier(cfg, slots, space_mapper(SpaceId("m", 0x01000100, "", layout), cfg), on_finished=on_finished)
    box.append(tier)
    try:
        buf = np.full(layout.nbytes, 7, dtype=np.uint8)
        ids = slots.lend([memoryview(buf)])
        assert ids is not None
        tier.submit_store("j", [BlockKey(b"\x01" * 32)], ids)
        assert done.wait(10)
        assert seen == [("store", 1, True)]
        assert [r.job_id for r in tier.get_finished()] == ["j"]
    finally:
        tier.close()


def test_lent_slots_lend_release_and_fence() -> None:
    slots = LentSlots(16, num_slots=4)
    a, b = bytearray(16), bytearray(16)
    ids = slots.lend([memoryview(a), memoryview(b)])
    assert ids == [0, 1] and slots.lent == 2
    slots.check_slots(ids)
    slots.slot_view(1)[:] = b"x" * 16
    assert bytes(b) == b"x" * 16
    assert slots.lend([memoryview(bytearray(8))]) is None  # wrong size
    assert slots.lend([memoryview(bytes(16))]) is None  # read-only
    slots.fence(0)
    with pytest.raises(ValueError, match="fenced"):
        slots.check_slots([0])
    slots.release(ids)
    assert slots.lent == 1  # the fenced slot keeps its buffer
    assert slots.lend([memoryview(bytearray(16))] * 3) == [2, 3, 1]  # 0 is not reused
    slots.unfence(0)
    assert slots.lent == 3
    with pytest.raises(ValueError, match="not lent"):
        slots.check_slots([0])


def test_namespaces_digest_layout_rank_and_salt(tmp_path: Path) -> None:
    cfg = TierConfig(root_dir=tmp_path)
    mha = Layout.of([(2, 4, 256, 64)], ["torch.float16"])
    other = Layout.of([(2, 4, 128, 128)], ["float16"])
    mla = Layout.of([(4, 256, 576)], ["bfloat16"])
    assert mha is not None and other is not None and mla is not None
    assert mha.nbytes == other.nbytes == 2 * 4 * 256 * 64 * 2 and not mha.mla and mla.mla
    assert Layout.of([(2, 3)], ["complex64"]) is None and Layout.of([], []) is None

    def ns(kv_rank: int, layout: Layout, salt: str = "") -> tuple[str, Path]:
        m = space_mapper(SpaceId("org/m", kv_rank, salt, layout), cfg)
        return m.namespace, m.blocks_dir

    r0, r1 = 0x02000200, 0x02010201  # world 2: ranks 0 and 1
    assert ns(r0, mha)[0] != ns(r0, other)[0]  # same bytes, another layout
    assert ns(r0, mha)[0] != ns(r0, mha, "tenant")[0]
    assert ns(r0, mha)[0] != ns(0x01000100, mha)[0]  # another world size
    assert ns(r1, mha)[1].name == "r1" and ns(r0, mha)[1].name == "r0"


def test_adapter_params_are_checked_by_field() -> None:
    with pytest.raises(ConfigError, match="'root_dir': required"):
        tier_config_from_adapter_params({})
    with pytest.raises(ConfigError, match="expected a JSON object"):
        tier_config_from_adapter_params(["/mnt/kv"])
    with pytest.raises(ConfigError, match=r"tier\.checksum"):
        tier_config_from_adapter_params({"root_dir": "/tmp", "checksum": "md5"})
    cfg = tier_config_from_adapter_params({"root_dir": "/tmp", "max_bytes": "2GiB"})
    assert cfg.max_bytes == 2 << 30


def test_the_server_line_in_the_docs_builds_a_valid_config(tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "lmcache.md").read_text()
    m = re.search(r"--l2-adapter '(\{.*?\})'\n", doc, re.S)
    assert m is not None, "docs/lmcache.md shows no --l2-adapter line"
    spec = json.loads(m.group(1))
    assert spec["type"] == "plugin" and spec["class_name"] == "FstierL2Adapter"
    assert spec["module_path"] == "fstier.integrations.lmcache"
    params = {**spec["adapter_params"], "root_dir": str(tmp_path)}
    assert tier_config_from_adapter_params(params).max_bytes == 2 << 40


@pytest.mark.skipif(HAVE_LMCACHE, reason="LMCache is installed here")
def test_without_lmcache_the_adapter_says_what_is_missing(tmp_path: Path) -> None:
    from fstier.integrations.lmcache import FstierL2Adapter

    with pytest.raises(LmcacheUnavailableError, match="needs LMCache .*not installed"):
        FstierL2Adapter({"root_dir": str(tmp_path)})


def test_lent_views_are_moved_whole_and_nothing_around_them(tmp_path: Path) -> None:
    # A job of whole lent slots hands the engine the lent views themselves (LentSlots.payload_views, no
    # second slice). Views one byte short or long are not lent, even as slices of one plain arena view
    # (plain=True), so nothing is lent that the engine could move past; a view of another format is cast.
    # A store reads, and a load writes, exactly each lent view: the guard bytes between them never move.
    sig = Signals()
    tier, slots = _tier(tmp_path, sig)
    size, gap = slots.slot_bytes, 4096 + 13
    arena = bytearray(gap + 6 * (size + gap))
    arena[:] = b"\x5a" * len(arena)
    view = memoryview(arena)
    at = [gap + i * (size + gap) for i in range(6)]
    try:
        assert slots.lend([view[at[0] : at[0] + size - 1]], plain=True) is None
        assert slots.lend([view[at[0] : at[0] + size + 1]], plain=True) is None
        assert slots.lend([view[at[0] : at[0] + size], view[at[1] : at[1] + size + 1]], plain=True) is None
        assert slots.lent == 0
        src = [view[a : a + size] for a in at[:3]]
        for i, v in enumerate(src):
            v[:] = bytes((i * 31 + j) % 253 for j in range(size))
        keys = [BlockKey(bytes([i + 9]) * 32) for i in range(3)]
        ids = slots.lend(src, plain=True)
        assert ids is not None
        before = bytes(arena)
        tier.submit_store("s", keys, ids)
        sig.wait("store")
        assert [r.success for r in tier.get_finished()] == [True] and bytes(arena) == before
        slots.release(ids)
        dst = [view[at[3] : at[3] + size], np.frombuffer(view[at[4] : at[4] + size], dtype=np.float16).data]
        ids = slots.lend([*dst, view[at[5] : at[5] + size]])
        assert ids is not None
        tier.submit_load("l", [*keys[:2], keys[2]], ids)
        sig.wait("load")
        (res,) = tier.get_finished()
        assert res.success and res.keys_completed == 3
        for i in range(3):
            assert arena[at[3 + i] : at[3 + i] + size] == arena[at[i] : at[i] + size]
        outside = bytearray(arena)
        for a in at[3:]:
            outside[a : a + size] = before[a : a + size]
        assert bytes(outside) == before
        slots.release(ids)
    finally:
        tier.close()
