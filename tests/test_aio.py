"""AsyncBlockIO: async store/load/presence through a BlockStore on real
files, on the process's job engine (a registration, no threads of its own),
never blocking the loop, on both backends."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import make_config
from manager_support import TINY_GROUP, payload_for

from fstier.errors import ConfigError
from fstier.file_mapper import FileMapper
from fstier.io import fsops, native
from fstier.io.aio import AsyncBlockIO
from fstier.io.blockstore import BlockStore
from fstier.io.fsops import aligned_buffer
from fstier.io.iotypes import IOOptions, LoadStatus, StoreStatus
from fstier.io.manifest import ensure_manifest
from fstier.keys import BlockKey

N = 3 * 4096 + 100


def _key(i: int) -> BlockKey:
    return BlockKey(bytes([i]) * 16, 0)


def _blocks(root: Path, backend: native.NativeStatus) -> BlockStore:
    group = {**TINY_GROUP, "kind": "mamba", "page_size_bytes": N}
    mapper = FileMapper(make_config(root, groups=[group]))
    ensure_manifest(mapper)
    bs = BlockStore(mapper, IOOptions(), backend)
    bs.ensure_namespace()
    return bs


@pytest.fixture(params=["python", "native"])
def blocks(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlockStore]:
    if request.param == "python":
        backend = native.python_backend()
    else:
        try:
            backend = native.native_backend()
        except ConfigError as exc:
            pytest.skip(f"native extension not built: {exc}")
    yield _blocks(tmp_path / "root", backend)


def _items(n: int, start: int = 0) -> list[tuple[BlockKey, memoryview]]:
    out = []
    for i in range(start, start + n):
        buf = aligned_buffer(N + 4096)
        buf[:N] = payload_for(_key(i), N)
        out.append((_key(i), buf[:N]))
    return out


def _bufs(n: int) -> list[memoryview]:
    return [aligned_buffer(N + 4096)[:N] for _ in range(n)]


def test_store_load_present_round_trip(blocks: BlockStore) -> None:
    async def main() -> None:
        async with AsyncBlockIO(blocks, read_threads=3, write_threads=2) as aio:
            outs = await aio.store(_items(9))
            assert [o.status for o in outs] == [StoreStatus.STORED] * 9
            assert await aio.present([_key(0), _key(5), _key(20)]) == [True, True, False]
            bufs = _bufs(9)
            res = await aio.load([(_key(i), bufs[i]) for i in range(9)])
            assert [o.status for o in res] == [LoadStatus.LOADED] * 9
            assert all(bytes(bufs[i]) == payload_for(_key(i), N) for i in range(9))
            # a hole in the middle: one outcome per item, in order
            assert blocks.remove(_key(3))
            res = await aio.load([(_key(i), b) for i, b in enumerate(_bufs(9))])
            assert [o.status for o in res].index(LoadStatus.MISSING) == 3
            assert sum(o.status is LoadStatus.LOADED for o in res) == 8
            assert await aio.read_manifest() == blocks.mapper.manifest()

    asyncio.run(main())


def test_loop_is_not_blocked_by_slow_io(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = _blocks(tmp_path / "root", native.python_backend())  # the delay is in the Python seam
    real = fsops.FS.pwritev

    def slow(fd, bufs, off):  # type: ignore[no-untyped-def]
        time.sleep(0.3)
        return real(fd, bufs, off)

    monkeypatch.setattr(fsops.FS, "pwritev", slow)

    async def main() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        async with AsyncBlockIO(blocks, read_threads=1, write_threads=2) as aio:
            outs = await aio.store(_items(2))
        task.cancel()
        assert all(o.status is StoreStatus.STORED for o in outs)
        return ticks

    assert asyncio.run(main()) >= 10  # the loop kept running during 0.3 s of I/O


def test_timeout_becomes_error_outcome_and_shared_engine_stays_open(blocks: BlockStore) -> None:
    """A load past io_timeout_s is one ETIMEDOUT outcome per key; closing one
    facade leaves the engine it shares with another running (a namespace is a
    registration: the engine stops with its last one)."""
    release = threading.Event()
    try:

        async def main() -> None:
            aio = AsyncBlockIO(blocks, read_threads=1, write_threads=1, io_timeout_s=0.2)
            other = AsyncBlockIO(blocks, read_threads=1, write_threads=1, io_timeout_s=30.0)
            assert aio.engine.engine is other.engine.engine  # one engine, two registrations
            await aio.store(_items(1))
            if blocks.batched:
                native.fault("read", delay_s=1.0)
            else:
                real = fsops.FS.preadv

                def hang(fd, bufs, off):  # type: ignore[no-untyped-def]
                    release.wait(5)
                    return real(fd, bufs, off)

                fsops.FS.preadv = hang  # type: ignore[method-assign]
            try:
                res = await aio.load([(_key(0), _bufs(1)[0])])
            finally:
                vars(fsops.FS).pop("preadv", None)
            assert [(o.status, o.cause) for o in res] == [(LoadStatus.ERROR, "ETIMEDOUT")]
            await aio.aclose()
            release.set()
            native.clear_faults()
            assert not other.engine.engine.closed  # the other registration keeps the engine
            buf = _bufs(1)[0]
            assert [o.status for o in await other.load([(_key(0), buf)])] == [LoadStatus.LOADED]
            assert bytes(buf) == payload_for(_key(0), N)
            await other.aclose()
            assert other.engine.engine.closed  # the last registration stopped it

        asyncio.run(main())
    finally:
        release.set()
        native.clear_faults()


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("inf"), float("nan")])
def test_io_timeout_must_be_positive_and_finite(blocks: BlockStore, timeout: float) -> None:
    """inf or nan would be a deadline no engine keeps (it once killed the
    pool's watchdog, silently disabling every deadline); 0 or less, none."""
    with pytest.raises(ValueError, match="io_timeout_s"):
        AsyncBlockIO(blocks, io_timeout_s=timeout)


def test_present_is_taken_before_queued_loads(tmp_path: Path) -> None:
    """present() is a probe job: the next thread free takes it before the
    loads queued ahead of it, so it answers after one slow read, not after
    all of them (8 reads of 0.4 s on 2 threads: 1.6 s)."""
    blocks = _blocks(tmp_path / "root", native.python_backend())
    real = fsops.FS.preadv

    def slow(fd, bufs, off):  # type: ignore[no-untyped-def]
        time.sleep(0.4)
        return real(fd, bufs, off)

    async def main() -> None:
        async with AsyncBlockIO(blocks, read_threads=1, write_threads=1, io_timeout_s=30.0) as aio:
            await aio.store(_items(8))
            fsops.FS.preadv = slow  # type: ignore[method-assign]
            try:
                loads = asyncio.ensure_future(aio.load([(_key(i), b) for i, b in enumerate(_bufs(8))]))
                await asyncio.sleep(0.1)  # both threads in a read; six more queued
                assert await aio.present([_key(0), _key(9)]) == [True, False]
                assert not loads.done(), "the probe waited behind the queued loads"
                assert [o.status for o in await loads] == [LoadStatus.LOADED] * 8
            finally:
                vars(fsops.FS).pop("preadv", None)

    asyncio.run(main())


def test_read_manifest_is_none_when_the_namespace_is_gone(blocks: BlockStore) -> None:
    import shutil

    shutil.rmtree(blocks.mapper.namespace_dir)

    async def main() -> None:
        async with AsyncBlockIO(blocks) as aio:
            assert await aio.read_manifest() is None

    asyncio.run(main())


def test_python_path_jobs_after_the_native_engines_python_side_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C engine runs a Python-path block store's jobs on a Python engine
    of its own; when that engine's last registration left it stopped, and the
    next Python-path job of another registration was refused ("the I/O engine
    is shut down") instead of starting a new one."""
    from fstier.io.engine.native import available

    if not available():
        pytest.skip("the native extension (and its C engine) is not built")
    monkeypatch.setenv("FSTIER_ENGINE", "native")
    blocks = _blocks(tmp_path / "root", native.python_backend())

    async def main() -> None:
        a = AsyncBlockIO(blocks, read_threads=1, write_threads=3)  # a thread count of its own: a fresh engine
        b = AsyncBlockIO(blocks, read_threads=1, write_threads=3)
        assert a.engine.engine is b.engine.engine and a.engine.engine.backend == "native"
        assert [o.status for o in await a.store(_items(1))] == [StoreStatus.STORED]
        await a.aclose()  # the Python side's only registration leaves: it stops
        assert [o.status for o in await b.store(_items(1, 1))] == [StoreStatus.STORED]
        await b.aclose()

    asyncio.run(main())
