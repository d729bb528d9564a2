"""An asyncio facade over a :class:`~fstier.io.blockstore.BlockStore`:
``await io.store(items)``, ``load``, ``present``, ``read_manifest``.

The block I/O runs on :class:`~fstier.io.pool.IOPool` threads through the
store's batch methods (``store_many``, ``load_many``, ``present_many``), cut
into batches by :meth:`~fstier.io.blockstore.BlockStore.batch_plan` as
:class:`~fstier.manager.FsTier` cuts its jobs: on the native backend one
GIL-free call per job with the pool's thread count as C helpers inside it,
on the Python backend one key per op.
Each pool job's completion is handed back to the event loop with
``loop.call_soon_threadsafe``: the loop never blocks on a system call.

The namespace manifest is read with ``asyncio.to_thread`` through the one
hardened manifest reader (:mod:`fstier.io.manifest`: no symlinks, no blocking on
a FIFO, size-capped); aiofiles, which opens by path and follows symlinks,
is not used for it. Nor for blocks: ``benchmarks/bench_io.py`` compares an
aiofiles-only block path with this pool path; the pool path stores faster
and reads with O_DIRECT into the caller's slot with no extra copy
(aiofiles' read allocates and copies), see docs/performance.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from fstier.io.blockstore import BlockStore
from fstier.io.iotypes import LoadOutcome, LoadStatus, StoreOutcome, StoreStatus
from fstier.io.pool import OP_CANCELLED, OP_EXPIRED, OP_TIMED_OUT, IOPool, PoolJob
from fstier.keys import BlockKey

__all__ = ["AsyncBlockIO"]


def _set_result(fut: asyncio.Future[PoolJob], job: PoolJob) -> None:
    if not fut.done():  # the awaiting task may have been cancelled
        fut.set_result(job)


def _failure_cause(result: Any) -> tuple[str, str]:
    if result is OP_TIMED_OUT:
        return "ETIMEDOUT", "I/O op exceeded io_timeout_s; its buffer stays in use until it returns"
    if result is OP_EXPIRED:
        return "ETIMEDOUT", "I/O op still queued io_timeout_s after its job was submitted; it never ran"
    if result is OP_CANCELLED:
        return "cancelled", "I/O pool shut down before the op ran"
    return type(result).__name__, str(result)


class AsyncBlockIO:
    """Async store/load/presence of ``blocks``' files on an :class:`IOPool`.

    Pass a ``pool`` to share one with an ``FsTier``; otherwise a private pool
    with ``read_threads``/``write_threads`` is created and closed by
    :meth:`aclose`.
    """

    def __init__(
        self,
        blocks: BlockStore,
        pool: IOPool | None = None,
        *,
        read_threads: int = 4,
        write_threads: int = 2,
        io_timeout_s: float | None = 30.0,
    ) -> None:
        self.blocks = blocks
        self._owns_pool = pool is None
        self.pool = pool if pool is not None else IOPool(read_threads, write_threads, io_timeout_s)
        self._ids = itertools.count()

    async def _run(self, kind: str, ops: Sequence[Callable[[], Any]]) -> PoolJob:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[PoolJob] = loop.create_future()

        def done(job: PoolJob) -> None:
            # RuntimeError: the loop closed while the job ran; nobody awaits it.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_set_result, fut, job)

        self.pool.submit(("aio", next(self._ids)), kind, ops, on_done=done)
        return await fut

    async def _batches(self, kind: str, n: int, run: Callable[[int, int, int], Any]) -> list[tuple[int, int, Any]]:
        threads = self.pool.read_threads if kind == "read" else self.pool.write_threads
        b, helpers = self.blocks.batch_plan(n, threads)
        spans = list(zip(b[:-1], b[1:], strict=True))
        job = await self._run(kind, [partial(run, lo, hi, helpers) for lo, hi in spans])
        return [(lo, hi, r) for (lo, hi), r in zip(spans, job.results, strict=True)]

    async def store(
        self, items: Sequence[tuple[BlockKey, memoryview]], *, replace: Sequence[bool] | None = None
    ) -> list[StoreOutcome]:
        """Store every ``(key, payload)`` (exactly the payload's bytes) in
        parallel; one outcome per item, in order."""
        flags = list(replace) if replace is not None else [False] * len(items)
        blocks = self.blocks

        def run(lo: int, hi: int, helpers: int) -> list[StoreOutcome]:
            return blocks.store_many(items[lo:hi], replace=flags[lo:hi], helpers=helpers)

        out: list[StoreOutcome] = []
        for lo, hi, r in await self._batches("write", len(items), run):
            if isinstance(r, list):
                out.extend(r)
            else:
                cause, detail = _failure_cause(r)
                out.extend(StoreOutcome(StoreStatus.FAILED, cause, detail) for _ in range(lo, hi))
        return out

    async def load(self, items: Sequence[tuple[BlockKey, memoryview]]) -> list[LoadOutcome]:
        """Load every ``(key, buffer)`` in parallel (each buffer exactly the
        payload length expected); one outcome per item, in order. Only a
        LOADED buffer holds verified bytes."""
        blocks = self.blocks

        def run(lo: int, hi: int, helpers: int) -> list[LoadOutcome]:
            return blocks.load_many(items[lo:hi], helpers=helpers)

        out: list[LoadOutcome] = []
        for lo, hi, r in await self._batches("read", len(items), run):
            if isinstance(r, list):
                out.extend(r)
            else:
                cause, detail = _failure_cause(r)
                out.extend(LoadOutcome(LoadStatus.ERROR, cause, detail) for _ in range(lo, hi))
        return out

    async def present(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether its block file is present
        (:meth:`~fstier.io.blockstore.BlockStore.present_many`, one batch,
        off the loop); a key whose check failed is absent."""
        job = await self._run("read", [partial(self.blocks.present_many, keys)])
        (r,) = job.results
        return r if isinstance(r, list) else [False] * len(keys)

    async def read_manifest(self) -> dict[str, Any] | None:
        """The namespace's ``config.json`` as a dict, or None when absent.

        Read off the loop like every manifest read (:mod:`fstier.io.manifest`):
        no symlink followed, non-blocking (a FIFO cannot hang it), regular
        files only, size-capped, depth-checked JSON; anything else raises
        :class:`~fstier.errors.NamespaceMismatchError` naming the path."""
        from fstier.file_mapper import MANIFEST_NAME
        from fstier.io.manifest import parse_json_object, read_manifest_bytes

        path = self.blocks.mapper.namespace_dir / MANIFEST_NAME
        raw = await asyncio.to_thread(read_manifest_bytes, path)
        if raw is None:
            return None
        return parse_json_object(path, raw)

    async def aclose(self) -> None:
        """Shut the private pool down (a shared pool is left to its owner)."""
        if self._owns_pool:
            await asyncio.to_thread(self.pool.shutdown)

    async def __aenter__(self) -> AsyncBlockIO:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
