"""AsyncBlockIO: async store/load/exists on real files, never blocking the loop."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

from fstier.io import posix
from fstier.io.aio import AsyncBlockIO
from fstier.io.blockfile import header_for_payload, padded_len
from fstier.io.pool import IOPool
from fstier.io.posix import (
    IOOptions,
    LoadRequest,
    LoadStatus,
    StoreRequest,
    StoreStatus,
    aligned_buffer,
)

sys.path.insert(0, str(Path(__file__).parent))
import io_worker  # noqa: E402

N = io_worker.PAYLOAD
DIGEST = io_worker.DIGEST


def _store_reqs(root: Path, n: int) -> list[StoreRequest]:
    reqs = []
    for i in range(n):
        key = io_worker.key_of(i)
        data = io_worker.payload_of(key, i)
        slot = aligned_buffer(padded_len(N))
        slot[:N] = data
        reqs.append(
            StoreRequest(
                io_worker.path_of(root, key), header_for_payload(key, DIGEST, data, 1, N), slot
            )
        )
    return reqs


def _load_reqs(root: Path, n: int) -> list[LoadRequest]:
    return [
        LoadRequest(
            io_worker.path_of(root, io_worker.key_of(i)),
            aligned_buffer(padded_len(N)),
            io_worker.key_of(i),
            DIGEST,
            N,
        )
        for i in range(n)
    ]


def test_store_load_exists_round_trip(tmp_path: Path) -> None:
    async def main() -> None:
        async with AsyncBlockIO(opts=IOOptions(), read_threads=3, write_threads=2) as aio:
            outs = await aio.store(_store_reqs(tmp_path, 6))
            assert [o.status for o in outs] == [StoreStatus.STORED] * 6
            assert await aio.exists(
                [io_worker.path_of(tmp_path, io_worker.key_of(i)) for i in (0, 5, 9)]
            ) == [
                True,
                True,
                False,
            ]
            reqs = _load_reqs(tmp_path, 6)
            res = await aio.load(reqs)
            assert res.num_loaded == 6 and res.complete
            for i, r in enumerate(reqs):
                assert bytes(r.buffer[:N]) == io_worker.payload_of(io_worker.key_of(i), i)
            # A hole in the middle: the prefix before it counts.
            io_worker.path_of(tmp_path, io_worker.key_of(3)).unlink()
            res = await aio.load(_load_reqs(tmp_path, 6))
            assert res.num_loaded == 3 and res.outcomes[3].status is LoadStatus.MISSING

    asyncio.run(main())


def test_loop_is_not_blocked_by_slow_io(tmp_path: Path, monkeypatch) -> None:
    real = posix.FS.pwritev

    def slow(fd, bufs, off):  # type: ignore[no-untyped-def]
        time.sleep(0.3)
        return real(fd, bufs, off)

    monkeypatch.setattr(posix.FS, "pwritev", slow)

    async def main() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        async with AsyncBlockIO(read_threads=1, write_threads=2) as aio:
            outs = await aio.store(_store_reqs(tmp_path, 2))
        task.cancel()
        assert all(o.status is StoreStatus.STORED for o in outs)
        return ticks

    assert asyncio.run(main()) >= 10  # the loop kept running during 0.3 s of I/O


def test_timeout_becomes_error_outcome_and_shared_pool_stays_open(
    tmp_path: Path, monkeypatch
) -> None:
    release = threading.Event()
    real = posix.FS.preadv

    def hang(fd, bufs, off):  # type: ignore[no-untyped-def]
        release.wait(5)
        return real(fd, bufs, off)

    pool = IOPool(1, 1, io_timeout_s=0.2)
    try:

        async def main() -> None:
            aio = AsyncBlockIO(pool, IOOptions())
            await aio.store(_store_reqs(tmp_path, 1))
            monkeypatch.setattr(posix.FS, "preadv", hang)
            res = await aio.load(_load_reqs(tmp_path, 1))
            assert res.num_loaded == 0
            assert (res.outcomes[0].status, res.outcomes[0].cause) == (
                LoadStatus.ERROR,
                "ETIMEDOUT",
            )
            await aio.aclose()
            assert not pool.closed  # a shared pool belongs to its owner

        asyncio.run(main())
    finally:
        release.set()
        pool.shutdown()


def test_read_manifest_with_aiofiles(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"digest": "abc"}))

    async def main() -> None:
        async with AsyncBlockIO() as aio:
            assert await aio.read_manifest(tmp_path) == {"digest": "abc"}
            assert await aio.read_manifest(tmp_path / "nope") is None

    asyncio.run(main())
